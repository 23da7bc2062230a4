"""skymesh-lb with 1 and N workers (``listen.workers``), on real processes over loopback.

Lab code, not product. Two experiments, the arms interleaved within each repeat (the order
rotated by one per repeat) so a slow spell of the shared machine falls on all of them:

- ``locality``: the prefix cache hit rate the replicas report with 1 and N workers, and
  how many trie inserts the workers told each other (``/status``'s ``share``).
  ``--replicas`` emulated replicas (``skymesh-replica``, time scale 0.05) behind skymesh-lb's
  default (prefix-tree, sp-p); ``--clients`` closed-loop clients send ``--requests``
  completions, each on a new connection (a new source port, so the kernel spreads them
  over the workers as it would real clients), each prompt one of ``--groups`` shared
  prefixes (about 3,000 characters) and a unique question. Hit rate: the replicas' added
  ``vllm:prefix_cache_hits`` over their added ``vllm:prefix_cache_queries`` (tokens). Each
  arm's prefixes carry a salt of their own, so no arm finds another's in the caches.
- ``simulator``: the same question in the simulator (``SimConfig.workers``), on
  tree-of-thoughts clients (``tot-gsm8k``; a child follows its parent at once, the hard
  case for a shared trie) and multi-turn chat (``sharegpt-chat``), 4 replicas, 120 s,
  seeds 0-2: 1 worker, N workers, and N workers that do not share their tries (the
  counterfactual: what the sharing is worth).
- ``throughput``: wrk (non-streamed completions, ``--connections`` connections) through
  skymesh-lb in front of two fast stub backends (``skymesh_lab.bench.stub_backend``), for
  the default path (prefix-tree, sp-p) and round-robin with bp. Per arm: req/s, and the
  CPU the balancer's processes used (supervisor and workers, from /proc) per 1,000
  requests. wrk, the stubs and the balancer share the machine's cores, so req/s is
  bounded by all of them; CPU per request is the comparable figure.

    python -m skymesh_lab.bench.lb_workers --json out.json [--workers 1,2] [--repeats 3]

The balancer runs its default HTTP server (``listen.http_server``) unless
``--http-server`` says; ``setup.http_server`` records which.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.balancer.workers import usable_cores
from skymesh.net.serving import DEFAULT_HTTP_SERVER, HTTP_SERVERS
from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_lab.faults.cluster import parse_metrics

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
         "sierra", "tango", "uniform", "victor", "whiskey", "xray")


def rotated(arms: Sequence[Any], repeat: int) -> list[Any]:
    k = repeat % len(arms)
    return [*arms[k:], *arms[:k]]


def _prefix(salt: str, group: int, chars: int = 3000) -> str:
    rng = random.Random(f"{salt}-{group}")
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return f"[{salt} document {group}] " + " ".join(words)


def _replica_counts(text: str) -> tuple[float, float]:
    m = parse_metrics(text)
    return m.get("vllm:prefix_cache_hits_total", 0.0), m.get("vllm:prefix_cache_queries_total", 0.0)


async def _counts(s: aiohttp.ClientSession, reps: Sequence[Daemon]) -> tuple[float, float]:
    hits = queries = 0.0
    for r in reps:
        async with s.get(r.url + "/metrics") as resp:
            h, q = _replica_counts(await resp.text())
        hits, queries = hits + h, queries + q
    return hits, queries


# --http-server: listen.http_server has no flag, so a config file of that one key
SERVER_CONFIG = "http-server.yaml"


@contextlib.contextmanager
def _lb(workdir: Path, name: str, args: list[str]) -> Iterator[Daemon]:
    config = workdir / SERVER_CONFIG
    if config.exists():
        args = ["--config", str(config), *args]
    lb = start_daemon("skymesh-lb", ["--port", "0", *args], log_path=workdir / f"{name}.log",
                      timeout=120)
    try:
        yield lb
    finally:
        lb.stop(30)


async def _ready(s: aiohttp.ClientSession, url: str, path: str = "/ready") -> None:
    """Until ``url + path`` answers 200 (60 s at most)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with s.get(url + path) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}{path} not ready")


async def locality_arm(workdir: Path, reps: Sequence[Daemon], workers: int, salt: str, *,
                       requests: int, clients: int, groups: int, seed: int) -> dict[str, Any]:
    urls = ",".join(r.url for r in reps)
    with _lb(workdir, f"lb-loc-{salt}", ["--replicas", urls, "--workers", str(workers)]) as lb:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            await _ready(s, lb.url)
            h0, q0 = await _counts(s, reps)
            rng = random.Random(seed)
            order = [rng.randrange(groups) for _ in range(requests)]
            prefixes = [_prefix(salt, g) for g in range(groups)]
            failed = 0
            # A new connection per request: the kernel picks a worker for each.
            fresh = aiohttp.TCPConnector(force_close=True, limit=0)
            async with aiohttp.ClientSession(timeout=timeout, connector=fresh) as c:
                async def client(k: int) -> None:
                    nonlocal failed
                    for i in range(k, requests, clients):
                        body = {"model": MODEL, "max_tokens": 4,
                                "prompt": f"{prefixes[order[i]]}\nQuestion {i}: why?"}
                        async with c.post(lb.url + "/v1/completions", json=body) as r:
                            await r.read()
                            failed += r.status != 200
                t0 = time.monotonic()
                await asyncio.gather(*(client(k) for k in range(clients)))
                wall = time.monotonic() - t0
            h1, q1 = await _counts(s, reps)
            sent, applied = await _share_counts(s, lb.url)
    return {"workers": workers, "requests": requests, "failed": failed,
            "hit_rate": round((h1 - h0) / (q1 - q0), 4) if q1 > q0 else None,
            "wall_s": round(wall, 2), "share_sent": sent, "share_applied": applied}


async def _share_counts(s: aiohttp.ClientSession, url: str) -> tuple[int | None, int | None]:
    """Trie inserts the workers sent each other and applied (``/status``; None: one
    worker, nothing shared)."""
    async with s.get(url + "/status") as r:
        workers = (await r.json()).get("workers")
    if not workers:
        return None, None
    shares = [w.get("share", {}) for w in workers]
    return (sum(x.get("inserts_sent", 0) for x in shares),
            sum(x.get("inserts_applied", 0) for x in shares))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (alive ones)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pids = [pid]
    with contextlib.suppress(OSError):
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


WRK_LUA = """wrk.method = "POST"
wrk.body = '{"model": "stub", "prompt": "hello there", "max_tokens": 1}'
wrk.headers["Content-Type"] = "application/json"
"""


def _wrk(url: str, connections: int, duration_s: float, script: Path) -> dict[str, float]:
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{duration_s:g}s", "-s",
                          str(script), url + "/v1/completions"],
                         capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {"rps": rps, "requests": total, "non_2xx": int(bad.group(1)) if bad else 0}


async def throughput_arm(workdir: Path, stubs: Sequence[str], workers: int, path: str, *,
                         connections: int, duration_s: float) -> dict[str, Any]:
    policy = [] if path == "default" else ["--policy", "round-robin", "--push-mode", "bp"]
    script = workdir / "post.lua"
    script.write_text(WRK_LUA)
    # The stubs publish no max_num_seqs (as vLLM): give it, else sp-p learns it from 1.
    args = ["--replicas", ",".join(stubs), "--workers", str(workers), "--max-num-seqs",
            "256", *policy]
    with _lb(workdir, f"lb-tp-{path}-{workers}", args) as lb:
        async with aiohttp.ClientSession() as s:
            await _ready(s, lb.url)
        await asyncio.to_thread(_wrk, lb.url, connections, 1.0, script)  # warm up
        cpu0 = _cpu_s(lb.proc.pid)
        res = await asyncio.to_thread(_wrk, lb.url, connections, duration_s, script)
        cpu = _cpu_s(lb.proc.pid) - cpu0
    return {"workers": workers, "path": path, **res,
            "cpu_ms_per_1k": round(cpu * 1e6 / max(res["requests"], 1), 1)}


@contextlib.contextmanager
def _stubs(count: int) -> Iterator[list[str]]:
    procs, urls = [], []
    try:
        for _ in range(count):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m",
                                           "skymesh_lab.bench.stub_backend", "--port",
                                           str(port)]))
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


async def _stubs_up(urls: Sequence[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for u in urls:
            await _ready(s, u, "/health")


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


SIM_WORKLOADS = ("tot-gsm8k", "sharegpt-chat")
SIM_SEEDS = (0, 1, 2)


def simulated(counts: Sequence[int]) -> dict[str, Any]:
    """Prefix hit rate (and throughput) in the simulator, by workload and arm."""
    from skymesh_lab.sim.runner import SimConfig
    from skymesh_lab.sim.runner import run as sim_run

    arms: list[tuple[str, int, float | None]] = [(str(n), n, None) for n in counts]
    arms += [(f"{n} unshared", n, 1e6) for n in counts if n > 1]
    out: dict[str, Any] = {}
    for wl in SIM_WORKLOADS:
        rows: dict[str, Any] = {}
        for name, n, share in arms:
            share_opt: dict[str, Any] = {} if share is None else {"worker_share_s": share}
            runs = [sim_run(SimConfig(workload=wl, regions=["us"], replicas={"us": 4},
                                      forwarding=False, policy="prefix-tree", seed=seed,
                                      duration_s=120.0, workers=n,
                                      **share_opt))
                    for seed in SIM_SEEDS]
            rows[name] = {"workers": n, "shared": share is None,
                          "hit_rate": [round(r["prefix_hit_rate"], 4) for r in runs],
                          "throughput_rps": [round(r["throughput_rps"], 3) for r in runs]}
        out[wl] = rows
    return out


async def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    counts = [int(x) for x in opts.workers.split(",")]
    if opts.http_server:
        (workdir / SERVER_CONFIG).write_text(f"listen:\n  http_server: {opts.http_server}\n")
    doc: dict[str, Any] = {"setup": {"workers": counts, "repeats": opts.repeats,
                                     "http_server": opts.http_server or DEFAULT_HTTP_SERVER,
                                     "usable_cores": usable_cores(),
                                     "replicas": opts.replicas, "clients": opts.clients,
                                     "requests": opts.requests, "groups": opts.groups,
                                     "connections": opts.connections,
                                     "duration_s": opts.duration,
                                     # how busy the shared machine was (other sessions)
                                     "load_average_1m_at_start": round(os.getloadavg()[0], 2)}}
    doc["simulator"] = simulated(counts)
    loc: list[dict[str, Any]] = []
    reps = [start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.05",
                                             "--seed", str(i)],
                         log_path=workdir / f"rep{i}.log") for i in range(opts.replicas)]
    try:
        for rep in range(opts.repeats):
            for n in rotated(counts, rep):
                row = await locality_arm(workdir, reps, n, f"r{rep}w{n}",
                                         requests=opts.requests, clients=opts.clients,
                                         groups=opts.groups, seed=rep)
                print(f"locality {row}", file=sys.stderr, flush=True)
                loc.append({**row, "repeat": rep})
    finally:
        for r in reps:
            r.stop()
    doc["locality"] = {"runs": loc, "median_hit_rate": {
        str(n): _median([r for r in loc if r["workers"] == n], "hit_rate") for n in counts}}
    tp: list[dict[str, Any]] = []
    if opts.duration > 0:
        with _stubs(2) as stubs:
            await _stubs_up(stubs)
            arms = [(n, p) for p in ("default", "rr-bp") for n in counts]
            for rep in range(opts.repeats):
                for n, p in rotated(arms, rep):
                    row = await throughput_arm(workdir, stubs, n, p,
                                               connections=opts.connections,
                                               duration_s=opts.duration)
                    print(f"throughput {row}", file=sys.stderr, flush=True)
                    tp.append({**row, "repeat": rep})
    doc["setup"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    doc["throughput"] = {"runs": tp, "median": {
        f"{p}/{n}": {"rps": _median(rows, "rps"), "cpu_ms_per_1k": _median(rows, "cpu_ms_per_1k")}
        for p in ("default", "rr-bp") for n in counts
        if (rows := [r for r in tp if r["workers"] == n and r["path"] == p])}}
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--http-server", choices=HTTP_SERVERS,
                    help="listen.http_server (default: the balancer's)")
    ap.add_argument("--duration", type=float, default=6.0,
                    help="seconds of wrk per throughput arm (0: skip throughput)")
    opts = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lb-workers-") as d:
        doc = asyncio.run(run(opts, Path(d)))
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
