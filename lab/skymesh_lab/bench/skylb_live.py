"""``skymesh bench skylb-macro --mode live``: the macrobenchmark with real processes.

Scaled to two shared cores: 6 emulated L4 replicas (``skymesh-replica --time-scale``, 2 per
region; 2 / 1 / 2 for the uneven fleet), real balancers, real streaming clients in this
process, and a :class:`~skymesh_lab.netproxy.DelayProxy` on every path that crosses regions
(half the simulator's RTT each way, as in the mesh demo). The GPU is sped up by
``TIME_SCALE`` but the RTTs are not, so the network weighs more here than in the paper.

- mesh systems (``region-local``, ``skymesh-ch``, ``skymesh-prefix``, ``skymesh-lmetric``):
  :class:`skymesh_lab.faults.cluster.Mesh` (the demo's three-region mesh), policies set
  through its balancer overrides; each region's clients talk to their own balancer.
- ``single-*``: one ``skymesh-lb`` in us with blind pushing in front of all replicas; its
  connections to eu and asia replicas, and eu and asia clients' connections to it, go
  through delay proxies.
- ``--peers sglang-router,vllm-router``: the PyPI routers (sglang-router 0.3.2 and
  vllm-router 0.1.17, each in its own venv under /tmp, created on first use) with their
  default cache-aware policy, in the same single-US topology in front of the same kind of
  replicas, in the same run: throughput, TTFT, hit rate, and TTFT added over skymesh-lb
  with the same policy family (``single-sgl``, our port of sglang's cache-aware policy).
- ``oracle`` is simulator-only (it reads the replicas' caches).

Clients: chat clients hold conversations of 3-8 turns (chat API, each turn carrying the
whole history); tree-of-thoughts clients expand depth-4 trees (completions API, a shared
instruction prefix, children prompted with the parent's prompt + output), 4-branch for
the US clients of the mixed tree. ``user`` carries the conversation / question id (the
consistent-hashing key). Prefix hit rate: cached over queried prompt tokens from the
replicas' ``/metrics``. Requests still streaming when the window ends are cut off and not
counted. Figures measured under contention (everything shares 2 cores with other jobs).

``--scheduler sglang`` starts every replica with ``skymesh-replica --scheduler sglang``
(SGLang's admission, retraction and snapshot queue gauge; its /metrics speaks SGLang only,
so the balancers read ``sglang:num_queue_reqs``). SGLang publishes no prefix-hit counters,
only a cumulative ``sglang:cache_hit_rate``: the window's hit rate is then the change of
rate x ``sglang:prompt_tokens`` over the change of ``sglang:prompt_tokens`` (exact but for
retracted requests, whose re-admission counts as a query and not as prompt tokens).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.util.procs import Daemon
from skymesh.util.stats import fmt, summary
from skymesh_lab.bench.skylb_setup import (
    BOX_QS,
    SYSTEMS,
    Options,
    comparisons,
    spread_stats,
)
from skymesh_lab.bench.venvs import ensure_package
from skymesh_lab.faults.cluster import (
    MODEL,
    REGIONS,
    Mesh,
    free_port,
    metrics,
    start_lb,
    start_replicas,
    wait_for,
)
from skymesh_lab.netproxy import DelayProxy
from skymesh_lab.sim.network import Network

TIME_SCALE = 0.5
DEFAULT_DURATION_S = 30.0
QUICK_DURATION_S = 8.0
WARMUP_FRACTION = 0.15
LIVE_REPLICAS_EVEN = {"us": 2, "eu": 2, "asia": 2}
LIVE_REPLICAS_UNEVEN = {"us": 2, "eu": 1, "asia": 2}


@dataclass(frozen=True)
class LiveWorkload:
    kind: str  # "chat" or "tot"
    clients: dict[str, int]
    replicas: dict[str, int]
    branching: dict[str, int] = field(default_factory=dict)


# The sim workloads scaled down by about 13x in clients (6 replicas instead of 12).
LIVE_WORKLOADS: dict[str, LiveWorkload] = {
    "chat-arena": LiveWorkload("chat", {"us": 6, "eu": 6, "asia": 6}, LIVE_REPLICAS_EVEN),
    "chat-wildchat": LiveWorkload("chat", {"us": 4, "eu": 3, "asia": 3}, LIVE_REPLICAS_UNEVEN),
    "tot": LiveWorkload("tot", {"us": 4, "eu": 2, "asia": 2}, LIVE_REPLICAS_EVEN),
    "mixed-tree": LiveWorkload("tot", {"us": 1, "eu": 2, "asia": 2}, LIVE_REPLICAS_EVEN,
                               {"us": 4}),
}
DEFAULT_LIVE_WORKLOADS = ("chat-arena", "mixed-tree")
QUICK_LIVE_WORKLOADS = ("chat-arena",)
QUICK_LIVE_SYSTEMS = ("single-ll", "region-local", "skymesh-prefix")
LIVE_SYSTEMS = tuple(s for s in SYSTEMS if s != "oracle")

PEERS: dict[str, dict[str, str]] = {
    "sglang-router": {"package": "sglang-router", "version": "0.3.2",
                      "module": "sglang_router.launch_router",
                      "import": "sglang_router", "venv": "/tmp/skymesh-bench-sglr"},
    "vllm-router": {"package": "vllm-router", "version": "0.1.17",
                    "module": "vllm_router.launch_router",
                    "import": "vllm_router", "venv": "/tmp/skymesh-bench-vllmr"},
}
NET = Network()


# ---------------------------------------------------------------------------- peers
def ensure_router(name: str) -> tuple[Path | None, str]:
    """The python of ``name``'s own venv with the pinned version, or None and why."""
    spec = PEERS[name]
    return ensure_package(Path(spec["venv"]), spec["package"], spec["version"],
                          spec["import"])


def start_router(name: str, py: Path, workers: Sequence[str], workdir: Path) -> Daemon:
    port = free_port()
    log_path = workdir / f"{name}.log"
    # Default policy (cache_aware in both); own Prometheus port so two routers never clash.
    cmd = [str(py), "-m", PEERS[name]["module"], "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *workers, "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port())]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return Daemon(name, proc, f"http://127.0.0.1:{port}", log_path)


# ---------------------------------------------------------------------------- clients
@dataclass
class Sample:
    sent: float
    ttft: float
    e2e: float
    done: float


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(2000)}" for _ in range(n))


async def stream_once(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      samples: list[Sample]) -> str | None:
    """One streamed request; its sample and output text, or None if it failed."""
    chat = "messages" in body
    t0 = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    try:
        async with s.post(url + ("/v1/chat/completions" if chat else "/v1/completions"),
                          json=body) as r:
            if r.status != 200:
                await r.read()
                return None
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                try:
                    choice = json.loads(line[5:])["choices"][0]
                except (ValueError, KeyError, IndexError):
                    continue
                text = (choice.get("delta") or {}).get("content") if chat \
                    else choice.get("text")
                if text:
                    if first is None:
                        first = time.monotonic() - t0
                    parts.append(text)
    except (TimeoutError, aiohttp.ClientError):
        return None
    if first is None:
        return None
    now = time.monotonic()
    samples.append(Sample(t0, first, now - t0, now))
    return "".join(parts)


async def chat_client(s: aiohttp.ClientSession, url: str, rng: random.Random, cid: str,
                      stop_at: float, samples: list[Sample]) -> None:
    conv = 0
    while time.monotonic() < stop_at:
        conv += 1
        messages: list[dict[str, str]] = []
        for _ in range(rng.randint(3, 8)):
            messages.append({"role": "user", "content": _words(rng, rng.randint(20, 120))})
            body = {"model": MODEL, "messages": messages, "stream": True,
                    "max_tokens": rng.randint(16, 96), "ignore_eos": True,
                    "user": f"{cid}-conv{conv}"}
            out = await stream_once(s, url, body, samples)
            if out is None or time.monotonic() >= stop_at:
                break
            messages.append({"role": "assistant", "content": out})


TOT_SYSTEM = "You solve grade-school math step by step. " + _words(random.Random("tot"), 110)


async def tot_client(s: aiohttp.ClientSession, url: str, rng: random.Random, cid: str,
                     branching: int, stop_at: float, samples: list[Sample]) -> None:
    tree = 0

    async def node(prompt: str, level: int, qid: str) -> None:
        if time.monotonic() >= stop_at:
            return
        body = {"model": MODEL, "prompt": prompt, "stream": True, "ignore_eos": True,
                "max_tokens": rng.randint(24, 96), "user": qid}
        out = await stream_once(s, url, body, samples)
        if out is None or level + 1 >= 4:
            return
        await asyncio.gather(*(node(f"{prompt}{out} Next step, option {i}:", level + 1, qid)
                               for i in range(branching)))

    while time.monotonic() < stop_at:
        tree += 1
        qid = f"{cid}-q{tree}"
        await node(f"{TOT_SYSTEM} Question {qid}: {_words(rng, 40)} Answer:", 0, qid)


# ---------------------------------------------------------------------------- topologies
class Topology:
    """Processes for one system; ``urls[region]`` is where that region's clients send."""

    def __init__(self, workdir: Path, replica_args: tuple[str, ...] = ()) -> None:
        self.dir = workdir
        self.replica_args = replica_args
        self.urls: dict[str, str] = {}
        self.replica_urls: list[str] = []  # direct, for metrics
        self.replica_regions: list[str] = []  # the region of each of replica_urls
        self.daemons: list[Daemon] = []
        self.proxies: list[DelayProxy] = []
        self.mesh: Mesh | None = None

    async def _proxy(self, url: str, one_way: float) -> str:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        p = DelayProxy(host, int(port), one_way)
        await p.start()
        self.proxies.append(p)
        return f"http://{p.address}"

    async def start_mesh(self, replicas: dict[str, int], system: str) -> None:
        cfg = SYSTEMS[system]
        overrides: dict[str, Any] = {"policy": {"name": cfg["policy"]},
                                     "pushing": {"mode": cfg["push_mode"]}}
        if cfg.get("peer_policy"):
            overrides["mesh"] = {"peer_policy": cfg["peer_policy"]}
        mesh = Mesh(self.dir, bool(cfg["forwarding"]), replicas=replicas,
                    time_scale=TIME_SCALE, lb_overrides=overrides,
                    replica_args=self.replica_args)
        self.mesh = mesh
        await mesh.start()
        self.urls = {r: mesh.lbs[r].url for r in REGIONS}
        self.replica_urls = [d.url for r in REGIONS for d in mesh.replicas[r]]
        self.replica_regions = [r for r in REGIONS for _ in mesh.replicas[r]]

    async def start_single(self, replicas: dict[str, int], system: str,
                           router_py: Path | None = None) -> None:
        """One balancer in us; remote replicas and remote clients across delay proxies."""
        worker_urls: list[str] = []
        for r in REGIONS:
            reps = await start_replicas(self.dir, replicas.get(r, 0), time_scale=TIME_SCALE,
                                        name=f"{r}-replica",
                                        extra=["--log-level", "warning", *self.replica_args])
            self.daemons.extend(reps)
            for d in reps:
                self.replica_urls.append(d.url)
                self.replica_regions.append(r)
                worker_urls.append(d.url if r == "us"
                                   else await self._proxy(d.url, NET.one_way("us", r)))
        if router_py is not None:
            lb = start_router(system, router_py, worker_urls, self.dir)
        else:
            cfg = SYSTEMS[system]
            lb = await start_lb(self.dir, [], name="lb-single", overrides={
                "region": "us", "policy": {"name": cfg["policy"]},
                "pushing": {"mode": cfg["push_mode"]}, "probe": {"interval_s": 0.1},
                "replicas": [{"url": u, "models": [MODEL], "gpu": "L4"} for u in worker_urls]})
        self.daemons.append(lb)
        for r in REGIONS:
            self.urls[r] = lb.url if r == "us" else await self._proxy(lb.url,
                                                                       NET.one_way(r, "us"))

    async def ready(self, s: aiohttp.ClientSession, timeout: float = 60) -> None:
        if self.mesh is not None:
            await self.mesh.wait_ready(s, timeout)
            return
        body = {"model": MODEL, "prompt": "ready?", "max_tokens": 1}

        async def ok() -> bool:
            async with s.post(self.urls["us"] + "/v1/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()
                return r.status == 200

        await wait_for(ok, "the balancer to serve", timeout)

    async def stop(self) -> None:
        if self.mesh is not None:
            await self.mesh.stop()
        for d in self.daemons:
            await asyncio.to_thread(d.stop)
        for p in self.proxies:
            await p.stop()


# ---------------------------------------------------------------------------- one run
@dataclass
class Counters:
    """The replicas' cumulative counters at one moment."""

    hits: float = 0.0
    queries: float = 0.0
    finished: list[float] = field(default_factory=list)  # per replica, as replica_urls


async def _counters(s: aiohttp.ClientSession, urls: Sequence[str]) -> Counters:
    c = Counters()
    for u in urls:
        m = await metrics(s, u)
        if "sglang:prompt_tokens_total" in m or "sglang:prompt_tokens" in m:
            prompt = m.get("sglang:prompt_tokens_total", m.get("sglang:prompt_tokens", 0.0))
            c.hits += m.get("sglang:cache_hit_rate", 0.0) * prompt
            c.queries += prompt
            c.finished.append(m.get("sglang:num_requests_total",
                                    m.get("sglang:num_requests", 0.0)))
            continue
        c.hits += m.get("vllm:prefix_cache_hits_total", m.get("vllm:prefix_cache_hits", 0.0))
        c.queries += m.get("vllm:prefix_cache_queries_total",
                           m.get("vllm:prefix_cache_queries", 0.0))
        c.finished.append(m.get("vllm:request_success_total", 0.0))
    return c


def served_share(before: Counters, after: Counters, regions: Sequence[str]
                 ) -> dict[str, float]:
    """Share of the requests finished in the window by each region's replicas: where a
    router put them (a single US balancer pays a round trip for every one placed away)."""
    done: dict[str, float] = dict.fromkeys(REGIONS, 0.0)
    for region, b, a in zip(regions, before.finished, after.finished, strict=True):
        done[region] += a - b
    total = sum(done.values())
    return {r: n / total for r, n in done.items()} if total > 0 else {}


async def _sample_loads(s: aiohttp.ClientSession, urls: Sequence[str], stop_at: float,
                        out: list[list[int]]) -> None:
    while time.monotonic() < stop_at:
        row: list[int] = []
        for u in urls:
            try:
                async with s.get(u + "/get_load", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    row.append(int((await r.json())[0]["num_reqs"]))
            except (TimeoutError, aiohttp.ClientError, ValueError, KeyError):
                row.append(0)
        out.append(row)
        await asyncio.sleep(1.0)


async def run_one(workload: str, system: str, duration: float, seed: int,
                  router_py: Path | None = None, scheduler: str = "vllm") -> dict[str, Any]:
    wl = LIVE_WORKLOADS[workload]
    with tempfile.TemporaryDirectory(prefix="skymesh-live-") as tmp:
        topo = Topology(Path(tmp), ("--scheduler", scheduler))
        try:
            if router_py is not None or system.startswith("single-"):
                await topo.start_single(wl.replicas, system, router_py)
            else:
                await topo.start_mesh(wl.replicas, system)
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as s:
                await topo.ready(s)
                c0 = await _counters(s, topo.replica_urls)
                samples: list[Sample] = []
                loads: list[list[int]] = []
                rng = random.Random(seed)
                t0 = time.monotonic()
                stop_at = t0 + duration
                tasks: list[asyncio.Task[None]] = []
                for r in REGIONS:
                    for i in range(wl.clients.get(r, 0)):
                        crng = random.Random(rng.random())
                        cid = f"{r}-c{i}"
                        coro = (chat_client(s, topo.urls[r], crng, cid, stop_at, samples)
                                if wl.kind == "chat" else
                                tot_client(s, topo.urls[r], crng, cid,
                                           wl.branching.get(r, 2), stop_at, samples))
                        tasks.append(asyncio.create_task(coro))
                tasks.append(asyncio.create_task(
                    _sample_loads(s, topo.replica_urls, stop_at, loads)))
                # The window ends for everyone at once: requests still in flight are
                # cancelled (their streams cut), not waited for.
                _, pending = await asyncio.wait(tasks, timeout=duration)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                c1 = await _counters(s, topo.replica_urls)
        finally:
            await topo.stop()
    w0 = t0 + WARMUP_FRACTION * duration
    inwin = [x for x in samples if x.sent >= w0]
    row: dict[str, Any] = {"workload": workload, "system": system,
                           "throughput_rps": sum(1 for x in samples if w0 <= x.done <= stop_at)
                           / (stop_at - w0)}
    row.update(summary([x.ttft for x in inwin], BOX_QS, prefix="ttft_", suffix="_s"))
    row.update(summary([x.e2e for x in inwin], BOX_QS, prefix="e2e_", suffix="_s"))
    row["prefix_hit_rate"] = ((c1.hits - c0.hits) / (c1.queries - c0.queries)
                              if c1.queries > c0.queries else 0.0)
    row["served_share_by_region"] = served_share(c0, c1, topo.replica_regions)
    row.update(spread_stats(loads))
    row["requests"] = len(inwin)
    return row


# ---------------------------------------------------------------------------- sweep
def peers_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["### PyPI routers in the single-US configuration (live, 2 shared cores)", "",
             "| workload | router | req/s | TTFT p50 | TTFT p90 | TTFT p50 added over"
             " skymesh-lb (single-sgl) | hit rate | served in us / eu / asia |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for w in dict.fromkeys(r["workload"] for r in rows):
        by = {r["system"]: r for r in rows if r["workload"] == w}
        base = by.get("single-sgl")
        for name in ("single-sgl", *PEERS):
            r = by.get(name)
            if r is None:
                continue
            added = "-"
            if base is not None and name != "single-sgl":
                have = r["ttft_p50_s"] is not None and base["ttft_p50_s"] is not None
                added = (f"{1000 * (r['ttft_p50_s'] - base['ttft_p50_s']):+.0f} ms" if have
                         else "n/a")
            share = r.get("served_share_by_region") or {}
            where = " / ".join(f"{100 * share[g]:.0f}%" for g in REGIONS) if share else "-"
            lines.append(f"| {w} | {name} | {r['throughput_rps']:.2f} |"
                         f" {fmt(r['ttft_p50_s'], '.0f', 1000)} ms |"
                         f" {fmt(r['ttft_p90_s'], '.0f', 1000)} ms |"
                         f" {added} | {100 * r['prefix_hit_rate']:.1f}% | {where} |")
    return "\n".join(lines)


def run(opts: Options) -> dict[str, Any]:
    from tqdm import tqdm

    quick = bool(opts.extra.get("quick"))
    duration = opts.duration_s if opts.extra.get("duration_given") else (
        QUICK_DURATION_S if quick else DEFAULT_DURATION_S)
    workloads = opts.workloads if opts.extra.get("workloads_given") else (
        QUICK_LIVE_WORKLOADS if quick else DEFAULT_LIVE_WORKLOADS)
    systems = [s for s in opts.systems if s in LIVE_SYSTEMS] if not quick \
        else list(QUICK_LIVE_SYSTEMS)
    notes: dict[str, str] = {}
    routers: dict[str, Path] = {}
    for name in opts.peers:
        if name not in PEERS:
            raise SystemExit(f"--peers: unknown router {name!r}; known: {list(PEERS)}")
        py, note = ensure_router(name)
        notes[name] = note
        if py is not None:
            routers[name] = py
    jobs: list[tuple[str, str]] = [(w, s) for w in workloads for s in [*systems, *routers]]
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with tqdm(jobs, desc="skylb-macro live", unit="run", file=sys.stderr,
              disable=not opts.progress) as bar:
        for w, s in bar:
            bar.set_postfix_str(f"{w} / {s}")
            rows.append(asyncio.run(run_one(w, s, duration, opts.seed, routers.get(s),
                                            opts.scheduler)))
    out: dict[str, Any] = {
        "runs": rows,
        "comparisons": comparisons(rows),
        "setup": {"mode": "live", "scheduler": opts.scheduler,
                  "time_scale": TIME_SCALE, "duration_s": duration,
                  "warmup_s": WARMUP_FRACTION * duration, "seed": opts.seed,
                  "workloads": {w: {"kind": LIVE_WORKLOADS[w].kind,
                                    "clients": LIVE_WORKLOADS[w].clients,
                                    "replicas": LIVE_WORKLOADS[w].replicas,
                                    "branching": LIVE_WORKLOADS[w].branching or 2}
                                for w in workloads},
                  "systems": systems, "peers": notes,
                  "contention": f"2 cores shared with other jobs; load average "
                                f"{os.getloadavg()[0]:.2f} at the end"},
        "wall_seconds": time.perf_counter() - t0,
    }
    if routers:
        out["peers_table"] = peers_table(rows)
    return out

