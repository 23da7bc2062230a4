"""Prefix routing on the trie vs on the engines' KV-cache events, on real vLLM.

Lab code, not product. Two vLLM CPU servers (the e2e lane's tiny model, ``make e2e``
builds it) publish KV events, each with a KV cache small enough to evict
(``--kv-cache-memory-bytes``). In front of them 1, 2 or 4 skymesh-lb processes (one
worker each, ``prefix-tree``), the closed-loop clients spread over them round-robin. Two
arms per balancer count:

- ``trie``: the replicas without ``kv_events``: each balancer scores prefixes on its own
  trie of its own past decisions;
- ``exact``: the replicas with ``kv_events`` and the model folder as ``tokenizer``: every
  balancer scores on the engines' own block index (docs/kv-events.md).

Workload: document QA. ``--docs`` documents of about ``--doc-chars`` characters, each made
of GSM8K training questions (``$SKYMESH_DATA_DIR/gsm8k/train.jsonl``); each request a chat
of the document as the system message and a GSM8K test question, streamed, ``max_tokens``
4; the document drawn at random. Figures per arm: vLLM's own prefix-cache hit rate
(added ``vllm:prefix_cache_hits_total`` over added ``vllm:prefix_cache_queries_total``,
tokens, both servers) and TTFT at the client (to the first streamed event). Each arm's
documents carry a salt of their own and the caches are reset between arms, so no arm
finds another's blocks.

The same question in the simulator (``SimConfig.exact_prefix_state``): tree-of-thoughts
clients (``tot-gsm8k``) and multi-turn chat (``sharegpt-chat``) in each of 3 regions of 4
emulated replicas, forwarding across regions on (the default mesh), 1, 2, 4 and 8
balancers per region that share nothing (``balancers_per_region``), each on its own trie
or on the replicas' KV events, delayed as live (one engine step plus the in-region hop;
also with no delay and with ``SIM_SLOW_DELAY_S``, to show what the delay costs), 120 s,
seeds 0-2.

    python -m skymesh_lab.bench.kv_events_live --json out.json [--balancers 1,2,4]
        [--sim-balancers 1,2,4,8] [--requests 160] [--vllm-env DIR] [--only live|sim]

``--vllm-env`` is the e2e lane's environment (``python tools/e2e/build_env.py --where``;
default ``$SKYMESH_E2E_ENV``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_lab.bench.diurnal import CLIENTS as DIURNAL_CLIENTS
from skymesh_lab.bench.run_record import (
    LoadWindow,
    need_vllm_env,
    parser,
    vllm_flags,
    vllm_setup,
)
from skymesh_lab.faults.cluster import parse_metrics

MODEL = "tiny"
MODES = ("trie", "exact")


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    url: str
    pub: int
    replay: int
    log_path: Path

    def stop(self) -> None:
        # vLLM's engine core is a child in the server's session: signal the group.
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_vllm(env: Path, core: int, kv_bytes: int, workdir: Path) -> Engine:
    port, pub, replay = free_port(), free_port(), free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    cmd = [str(env / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(env / "model"), "--served-model-name", MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
           "--max-num-seqs", "4", "--dtype", "bfloat16", "--enable-prefix-caching",
           "--kv-cache-memory-bytes", str(kv_bytes), "--kv-events-config", json.dumps(events)]
    # VLLM_CPU_KVCACHE_SPACE (GiB) would override --kv-cache-memory-bytes on the CPU build.
    base = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    penv = {**base, "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache between arms
            "VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1))}
    log_path = workdir / f"vllm-{core}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=penv,
                                start_new_session=True)
    return Engine(proc, f"http://127.0.0.1:{port}", pub, replay, log_path)


def documents(data_dir: Path, salt: str, count: int, chars: int) -> list[str]:
    lines = (data_dir / "gsm8k" / "train.jsonl").read_text().splitlines()
    rng = random.Random(f"docs-{salt}")
    out = []
    for d in range(count):
        parts = [f"Document {salt}-{d}."]
        while sum(len(p) + 1 for p in parts) < chars:
            parts.append(json.loads(rng.choice(lines))["question"])
        out.append(" ".join(parts))
    return out


def questions(data_dir: Path, count: int, seed: int) -> list[str]:
    lines = (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()
    rng = random.Random(seed)
    return [json.loads(rng.choice(lines))["question"] for _ in range(count)]


def lb_config(engines: Sequence[Engine], mode: str, tokenizer: str) -> dict[str, Any]:
    reps: list[dict[str, Any]] = []
    for e in engines:
        rep: dict[str, Any] = {"url": e.url, "kind": "vllm"}
        if mode == "exact":
            rep["tokenizer"] = tokenizer
            rep["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{e.pub}",
                                "replay_endpoint": f"tcp://127.0.0.1:{e.replay}"}
        reps.append(rep)
    return {"listen": {"host": "127.0.0.1", "port": 0, "workers": 1}, "region": "us",
            "policy": {"name": "prefix-tree"}, "replicas": reps,
            "kv_events": {"heartbeat_s": 0.5}}


@contextlib.contextmanager
def balancers(workdir: Path, n: int, cfg: dict[str, Any], tag: str) -> Iterator[list[Daemon]]:
    lbs: list[Daemon] = []
    try:
        for i in range(n):
            path = workdir / f"lb-{tag}-{i}.json"  # JSON is YAML to the config loader
            path.write_text(json.dumps(cfg))
            lbs.append(start_daemon("skymesh-lb", ["--config", str(path)],
                                    log_path=workdir / f"lb-{tag}-{i}.log", timeout=120))
        yield lbs
    finally:
        for lb in lbs:
            lb.stop(30)


async def _until(s: aiohttp.ClientSession, url: str, ok: Any, what: str,
                 deadline_s: float = 120) -> None:
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        with contextlib.suppress(aiohttp.ClientError, ValueError):
            async with s.get(url) as r:
                if r.status == 200 and ok(await r.json(content_type=None)):
                    return
        await asyncio.sleep(0.2)  # polling cadence, bounded by the deadline
    raise RuntimeError(f"{what}: not after {deadline_s} s ({url})")


async def counts(s: aiohttp.ClientSession, engines: Sequence[Engine]) -> tuple[float, float]:
    hits = queries = 0.0
    for e in engines:
        async with s.get(e.url + "/metrics") as r:
            m = parse_metrics(await r.text())
        hits += m.get("vllm:prefix_cache_hits_total", 0.0)
        queries += m.get("vllm:prefix_cache_queries_total", 0.0)
    return hits, queries


async def run_arm(workdir: Path, engines: Sequence[Engine], n_lb: int, mode: str, *,
                  tokenizer: str, data_dir: Path, requests: int, clients: int, docs: int,
                  doc_chars: int, seed: int) -> dict[str, Any]:
    salt = f"{mode}{n_lb}s{seed}"
    texts = documents(data_dir, salt, docs, doc_chars)
    qs = questions(data_dir, requests, seed)
    rng = random.Random(seed)
    order = [rng.randrange(docs) for _ in range(requests)]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for e in engines:
            async with s.post(e.url + "/reset_prefix_cache") as r:
                r.raise_for_status()
        with balancers(workdir, n_lb, lb_config(engines, mode, tokenizer), salt) as lbs:
            for lb in lbs:
                await _until(s, lb.url + "/ready",
                             lambda b: b.get("healthy_replicas") == len(engines), "ready")
                if mode == "exact":
                    await _until(s, lb.url + "/status", lambda b: all(
                        r.get("kv_exact") for r in b["replicas"].values()), "kv_exact")
            h0, q0 = await counts(s, engines)
            ttfts: list[float] = []
            failed = 0

            async def client(k: int) -> None:
                nonlocal failed
                lb = lbs[k % len(lbs)]
                for i in range(k, requests, clients):
                    body = {"model": MODEL, "max_tokens": 4, "stream": True,
                            "messages": [{"role": "system", "content": texts[order[i]]},
                                         {"role": "user", "content": qs[i]}]}
                    t0 = time.monotonic()
                    first: float | None = None
                    async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
                        if r.status != 200:
                            failed += 1
                            await r.read()
                            continue
                        async for line in r.content:
                            if first is None and line.startswith(b"data:"):
                                first = time.monotonic() - t0
                    if first is not None:
                        ttfts.append(first)

            t0 = time.monotonic()
            await asyncio.gather(*(client(k) for k in range(clients)))
            wall = time.monotonic() - t0
            h1, q1 = await counts(s, engines)
            exact = 0.0
            for lb in lbs:
                async with s.get(lb.url + "/status") as r:
                    st = await r.json()
                exact += sum(bool(v.get("kv_exact")) for v in st["replicas"].values())
    ttfts.sort()
    return {"balancers": n_lb, "mode": mode, "requests": requests, "failed": failed,
            "hit_rate": round((h1 - h0) / (q1 - q0), 4) if q1 > q0 else None,
            "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
            "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4) if ttfts else None,
            "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4) if ttfts else None,
            "prompt_tokens": int(q1 - q0), "wall_s": round(wall, 1),
            "exact_at_end": exact / (n_lb * len(engines))}


@contextlib.asynccontextmanager
async def vllm_servers(args: argparse.Namespace
                       ) -> AsyncIterator[tuple[list[Engine], dict[str, Any]]]:
    """The two vLLM servers of ``args`` (:func:`run_record.vllm_flags`), up, and their cache."""
    env = Path(os.path.expandvars(args.vllm_env))  # the results registry passes it as is
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    engines = [start_vllm(env, i, args.kv_cache_bytes, workdir) for i in range(2)]
    try:
        async with aiohttp.ClientSession() as s:
            for e in engines:
                await _until(s, e.url + "/v1/models", lambda b: True, "vLLM ready",
                             deadline_s=args.start_deadline_s)
        cache = await cache_info(engines)
        print(f"vLLM up: {cache}", flush=True)
        yield engines, cache
    finally:
        for e in engines:
            e.stop()


async def cache_info(engines: Sequence[Engine]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(engines[0].url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = line[line.index("{") + 1:line.index("}")]
            kv = dict(p.split("=", 1) for p in labels.split(","))
            return {k: v.strip('"') for k, v in kv.items()
                    if k in ("block_size", "num_gpu_blocks", "kv_cache_size_tokens")}
    return {}


SIM_WORKLOADS = ("tot-gsm8k", "sharegpt-chat")
# tot-gsm8k: its 10 clients in every region (each region's load as the one-region run's);
# sharegpt-chat: the diurnal experiment's peak skew (us 120, eu 40, asia 40 clients), so
# the busy region forwards and forwarded prefixes count too.
SIM_WORKLOAD_PARAMS: dict[str, dict[str, Any]] = {
    "tot-gsm8k": {}, "sharegpt-chat": {"clients_per_region": DIURNAL_CLIENTS}}
SIM_SEEDS = (0, 1, 2)
SIM_REGIONS = ("us", "eu", "asia")
SIM_REPLICAS_PER_REGION = 4
SIM_DURATION_S = 120.0
# A subscriber far slower than the default (one step plus the in-region hop, some tens of
# ms): what a feed a second behind would cost, run at the largest balancer count only.
SIM_SLOW_DELAY_S = 1.0
# Simulator arms: name -> (exact_prefix_state, kv_event_delay_s).
SIM_ARMS: dict[str, tuple[bool, float | None]] = {
    "trie": (False, None), "exact": (True, None), "exact-no-delay": (True, 0.0),
    "exact-slow": (True, SIM_SLOW_DELAY_S)}


def sim_row(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One arm's figures, a list per seed."""
    return {"hit_rate": [round(r["prefix_hit_rate"], 4) for r in runs],
            "ttft_mean_s": [round(r["ttft_mean_s"], 4) for r in runs],
            "ttft_p90_s": [round(r["ttft_p90_s"], 4) for r in runs],
            "throughput_rps": [round(r["throughput_rps"], 3) for r in runs],
            "forwarded": [sum(s["forwarded_out"] for s in r["region_stats"].values())
                          for r in runs]}


def simulated_regions(counts: Sequence[int], workloads: Sequence[str] = SIM_WORKLOADS,
                      seeds: Sequence[int] = SIM_SEEDS,
                      duration_s: float = SIM_DURATION_S) -> dict[str, Any]:
    """The simulator's comparison over three regions with forwarding: per workload, per
    balancer count per region, per arm (``SIM_ARMS``; the slow one at the largest count)."""
    from skymesh_lab.sim.runner import SimConfig
    from skymesh_lab.sim.runner import run as sim_run

    results: dict[str, Any] = {}
    for wl in workloads:
        rows = []
        for n in counts:
            for arm, (exact, delay) in SIM_ARMS.items():
                if arm == "exact-slow" and n != max(counts):
                    continue
                runs = [sim_run(SimConfig(
                    workload=wl, regions=list(SIM_REGIONS),
                    replicas=dict.fromkeys(SIM_REGIONS, SIM_REPLICAS_PER_REGION),
                    policy="prefix-tree", seed=seed, duration_s=duration_s,
                    balancers_per_region=n, exact_prefix_state=exact,
                    kv_event_delay_s=delay, workload_params=SIM_WORKLOAD_PARAMS.get(wl, {})))
                    for seed in seeds]
                rows.append({"balancers": n, "mode": arm, **sim_row(runs)})
                print(json.dumps({"workload": wl, **rows[-1]}), flush=True)
        results[wl] = rows
    return {"setup": {"regions": list(SIM_REGIONS),
                      "replicas_per_region": SIM_REPLICAS_PER_REGION,
                      "balancers_per_region": list(counts), "seeds": list(seeds),
                      "duration_s": duration_s, "policy": "prefix-tree", "forwarding": True,
                      "slow_delay_s": SIM_SLOW_DELAY_S,
                      "workload_params": {wl: SIM_WORKLOAD_PARAMS.get(wl, {})
                                          for wl in workloads}},
            "results": results}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    env = Path(os.path.expandvars(args.vllm_env))
    load = LoadWindow()
    runs = []
    counts_ = [int(x) for x in args.balancers.split(",")]
    async with vllm_servers(args) as (engines, cache):
        arms = [(n, m) for n in counts_ for m in MODES]
        for rep in range(args.repeats):
            k = rep % len(MODES)
            for n, mode in arms[k:] + arms[:k]:
                r = await run_arm(Path(args.workdir), engines, n, mode,
                                  tokenizer=str(env / "model"),
                                  data_dir=Path(args.data_dir), requests=args.requests,
                                  clients=args.clients, docs=args.docs,
                                  doc_chars=args.doc_chars, seed=rep)
                r["repeat"] = rep
                print(json.dumps(r), flush=True)
                runs.append(r)
    return {"setup": {**vllm_setup(args, cache),
                      "balancers": counts_, "requests_per_arm": args.requests,
                      "clients": args.clients, "docs": args.docs, "doc_chars": args.doc_chars,
                      "max_tokens": 4, "repeats": args.repeats, "policy": "prefix-tree",
                      "workers_per_balancer": 1, **load.fields()},
            "runs": runs}


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    vllm_flags(ap, repeats=2)
    ap.add_argument("--data-dir", default=os.environ.get("SKYMESH_DATA_DIR",
                                                         "../shared/data"))
    ap.add_argument("--workdir", default="out/kv-events-live")
    ap.add_argument("--balancers", default="1,2,4")
    ap.add_argument("--sim-balancers", default="1,2,4,8",
                    help="the simulator's balancer counts per region")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--doc-chars", type=int, default=3000)
    ap.add_argument("--only", choices=("live", "sim"),
                    help="one part; the other is kept from an existing --json file")
    args = ap.parse_args(argv)
    path = Path(args.json)
    out: dict[str, Any] = json.loads(path.read_text()) if args.only and path.exists() else {}
    if args.only != "sim":
        need_vllm_env(ap, args)
        out.update(asyncio.run(main_async(args)))
    if args.only != "live":
        out.pop("simulator", None)  # the one-region table this replaced, events undelayed
        out["simulator_regions"] = simulated_regions(
            [int(x) for x in args.sim_balancers.split(",")])
    path.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
