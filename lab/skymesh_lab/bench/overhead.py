"""Added latency and throughput cost of the balancer on the request path.

What is measured
    Streaming chat completions (short prompt, exactly ``OUTPUT_TOKENS`` output tokens via
    ``ignore_eos`` + ``max_tokens``) sent to the same emulated replicas along several
    paths, in the same run:

    * ``direct``: the client round-robins over the replicas itself (the baseline);
    * ``skymesh-lb rr/bp``: through ``skymesh-lb --policy round-robin --push-mode bp``:
      blind pushing never holds a request back, so the difference to ``direct`` is the
      proxy's own cost (parse, dispatch, two extra HTTP hops' worth of copying);
    * ``skymesh-lb ll/sp-p``: the default mode (least-load with selective pushing), for
      reference;
    * ``sglang-router``: sglang-router (``--policy round_robin``) from PyPI, installed in
      its own venv outside the repository (skipped with the reason if that fails).

    Per request the client records TTFT (send to the first chunk with non-empty content)
    and end-to-end latency (send to the end of the stream). Per path and rate: p50 and
    p99 of both, and the *added* latency, i.e. the balancer's percentile minus the direct
    path's percentile (a difference of percentiles: requests are not paired).

How
    Open loop: Poisson arrivals at each rate; the time at each rate is split into rounds
    and every round runs every path once in a freshly shuffled order, so drift (thermal,
    page cache, other tenants of this 2-core machine) cannot favour one path. Nothing
    overlaps: a segment's requests all finish before the next segment starts. The client,
    the replicas and the balancers share the machine's cores, so the table also shows the
    client's send lag (actual send time minus the scheduled one), the machine's CPU busy
    share and each process's CPU time per request; a large lag or a busy share near 100%
    means the numbers measure contention as much as the proxy.

    Closed loop: ``--concurrency`` clients, each sending its next request as soon as the
    previous stream ends, for ``--closed-duration`` seconds per path, against fresh
    replicas at ``--closed-time-scale`` (0.001: the emulated GPU is never the limit);
    completed requests per second is the path's maximum throughput on this machine. That
    maximum is set by the sum of every process's CPU per request on 2 shared cores, so
    the proxy's CPU microseconds per request is the comparable figure across machines.

Replicas run a fast profile (H100, time scale 0.05 by default: one decode step is
~0.3 ms of wall time) so replica time does not swamp the measurement. asyncio's timers
have 1 ms resolution (epoll), so the replica's steps come in ~1 ms bursts; every path
sees the same replicas, and the direct path's spread shows that noise floor.

    python -m skymesh_lab.bench.overhead                          # defaults, ~4 minutes
    python -m skymesh_lab.bench.overhead --rates 50,200 --duration 4 --skip-sglang --json o.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from skymesh.util.jsonio import write_json
from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh.util.stats import percentile
from skymesh_lab.bench.venvs import ensure_package
from skymesh_replica.engine.profiles import get_profile

DEFAULT_PROFILE = "llama3.1-8b-h100"
DEFAULT_TIME_SCALE = 0.05
# Closed loop: emulated GPU time ~0 so the processes' CPU is what limits throughput.
DEFAULT_CLOSED_TIME_SCALE = 0.001
DEFAULT_RATES = (20.0, 50.0, 100.0, 200.0)
OUTPUT_TOKENS = 20
PROMPT = "Tell me something short about load balancers."
SGLANG_VERSION = "0.3.2"
SGLANG_VENV = Path("/tmp/skymesh-bench-sglr")
TARGET_P50_S = 0.001
TARGET_P99_S = 0.005
STARTUP_TIMEOUT_S = 60.0
# Quiet time between segments: stragglers of one path must not load the next one.
SETTLE_S = 0.1

LEGEND = """\
columns: latencies in ms, measured by the client from send; +X = X minus the direct path's X
(same rate, same replicas); lag = client send lag (actual send - Poisson schedule);
cpu% = whole machine busy, oth% = part of it used by processes outside this benchmark;
proxy / repl / clnt = CPU microseconds per request of the proxy, all replicas, the client
(background work such as the balancers' 10 Hz probes included, so they fall with the rate)"""

DIRECT = "direct"
LB_BP = "skymesh-lb rr/bp"
LB_DEFAULT = "skymesh-lb ll/sp-p"
SGLR = "sglang-router"


# -- processes -------------------------------------------------------------------------
def ensure_sglang(venv: Path, version: str) -> tuple[Path | None, str]:
    """The venv's python with ``sglang-router==version`` importable, or None and why."""
    return ensure_package(venv, "sglang-router", version, "sglang_router")


def start_sglang_router(py: Path, workers: Sequence[str]) -> Daemon:
    port = free_port()
    fd, tmp = tempfile.mkstemp(prefix="sglang-router-", suffix=".log")
    os.close(fd)
    log_path = Path(tmp)
    # Own prometheus port: the default (29000) may be taken by another router.
    cmd = [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", *workers, "--policy", "round_robin",
           "--log-level", "warn", "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--shutdown-grace-period-secs", "1"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return Daemon("sglang-router", proc, f"http://127.0.0.1:{port}", log_path, _owned_log=True)


@dataclass
class Stack:
    """The processes under test; ``paths`` maps a path name to the URLs the client uses."""

    replicas: list[Daemon]
    proxies: dict[str, Daemon]
    paths: dict[str, list[str]]
    sglang_note: str


async def _wait_ok(session: aiohttp.ClientSession, d: Daemon, method: str, path: str,
                   body: bytes | None = None) -> None:
    """Until ``method path`` answers 200: health for our daemons, a real request for
    sglang-router (it registers workers after its port opens)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_TIMEOUT_S
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.request(method, d.url + path, data=body,
                                       headers={"Content-Type": "application/json"},
                                       timeout=aiohttp.ClientTimeout(total=10)) as r:
                await r.read()
                if r.status == 200:
                    return
        if loop.time() > deadline or not d.alive():
            raise RuntimeError(f"{d.name} at {d.url} never became ready:\n{d.log()[-2000:]}")
        await asyncio.sleep(0.1)


async def start_replicas(exits: contextlib.ExitStack, session: aiohttp.ClientSession,
                         n: int, profile: str, time_scale: float) -> list[Daemon]:
    """``n`` emulated replicas, healthy, each registered on ``exits`` once it exists."""
    replicas: list[Daemon] = []
    for i in range(n):
        d = start_daemon("skymesh-replica", ["--port", "0", "--profile", profile,
                                             "--time-scale", repr(time_scale),
                                             "--seed", str(i)])
        exits.callback(d.stop)
        replicas.append(d)
    await asyncio.gather(*(_wait_ok(session, d, "GET", "/health") for d in replicas))
    return replicas


async def start_stack(exits: contextlib.ExitStack, session: aiohttp.ClientSession,
                      n_replicas: int, profile: str, time_scale: float, body: bytes,
                      sglang_py: Path | None, sglang_note: str) -> Stack:
    """Start everything; each process is registered on ``exits`` as soon as it exists."""
    replicas = await start_replicas(exits, session, n_replicas, profile, time_scale)
    urls = [d.url for d in replicas]
    proxies: dict[str, Daemon] = {}
    for name, policy, mode in ((LB_BP, "round-robin", "bp"), (LB_DEFAULT, "least-load", "sp-p")):
        d = start_daemon("skymesh-lb", ["--port", "0", "--replicas", ",".join(urls),
                                        "--policy", policy, "--push-mode", mode])
        exits.callback(d.stop)
        proxies[name] = d
    if sglang_py is not None:
        d = start_sglang_router(sglang_py, urls)
        exits.callback(d.stop)
        proxies[SGLR] = d
    waits = [_wait_ok(session, d, "GET", "/ready") for n, d in proxies.items() if n != SGLR]
    if SGLR in proxies:
        waits.append(_wait_ok(session, proxies[SGLR], "POST", "/v1/chat/completions", body))
    await asyncio.gather(*waits)
    paths = {DIRECT: urls, **{n: [d.url] for n, d in proxies.items()}}
    return Stack(replicas, proxies, paths, sglang_note)


# -- CPU accounting --------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies over all cores since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            vals = [float(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    total = sum(vals[:8])
    return total - idle, total


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (float(fields[11]) + float(fields[12])) / _TICK


@dataclass
class CpuMeter:
    """CPU used between start() and stop(): machine busy share, client and processes."""

    pids: dict[str, int]
    busy: float = 0.0
    total: float = 0.0
    client_s: float = 0.0
    procs_s: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        self.busy, self.total = _machine_cpu()
        self.client_s = time.process_time()
        self.procs_s = {k: _proc_cpu_s(p) for k, p in self.pids.items()}

    def stop(self) -> dict[str, float]:
        busy, total = _machine_cpu()
        span = (total - self.total) / _TICK  # core-seconds that passed
        out = {"client": time.process_time() - self.client_s}
        for k, p in self.pids.items():
            out[k] = _proc_cpu_s(p) - self.procs_s[k]
        ours = sum(out.values())
        out["machine_busy"] = (busy - self.busy) / _TICK / span if span > 0 else 0.0
        # Everything else on the machine (other tenants): CPU our measurement competes with.
        out["foreign_busy"] = max(0.0, (busy - self.busy) / _TICK - ours) / span \
            if span > 0 else 0.0
        return out


# -- the client ------------------------------------------------------------------------
@dataclass(slots=True)
class Sample:
    due: float
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.first is not None and self.done is not None


def _content_events(block: bytes) -> int:
    """Chunks with non-empty content in complete SSE events (compact JSON fast path)."""
    n = 0
    for ev in block.split(b"\n\n"):
        if b'"content"' not in ev:
            continue
        if b'"content":"' in ev:
            n += b'"content":""' not in ev
            continue
        # Some other serialisation (spaces after colons): parse it properly.
        with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
            data = json.loads(ev.split(b"data:", 1)[1])
            n += bool(data["choices"][0]["delta"].get("content"))
    return n


async def request_once(session: aiohttp.ClientSession, url: str, body: bytes,
                       due: float) -> Sample:
    """One streaming chat request; times on the loop's (monotonic) clock."""
    loop = asyncio.get_running_loop()
    s = Sample(due=due)
    s.sent = loop.time()
    buf = b""
    finished = False
    try:
        async with session.post(url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return s
            # Whole reads, split on event boundaries: cheaper than a readline per line,
            # which matters when the client shares 2 cores with what it measures.
            async for chunk in resp.content.iter_any():
                now = loop.time()
                buf += chunk
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                block, buf = buf[:cut], buf[cut + 2:]
                n = _content_events(block)
                if n and s.first is None:
                    s.first = now
                s.tokens += n
                if b"data: [DONE]" in block:
                    finished = True
            s.done = loop.time()
    except (aiohttp.ClientError, TimeoutError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
        return s
    if not finished:
        s.error = "stream ended without [DONE]"
    elif s.tokens != OUTPUT_TOKENS:
        s.error = f"{s.tokens} content chunks, expected {OUTPUT_TOKENS}"
    return s


async def open_loop_segment(session: aiohttp.ClientSession, urls: Sequence[str], body: bytes,
                            rate: float, seconds: float, rng: random.Random) -> list[Sample]:
    """Poisson arrivals at ``rate`` for ``seconds``; returns when every request ended."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[Sample]] = []
    t0 = loop.time() + 0.005
    t = rng.expovariate(rate)
    i = 0
    while t < seconds:
        due = t0 + t
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(request_once(session, urls[i % len(urls)], body, due)))
        i += 1
        t += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


async def closed_loop(session: aiohttp.ClientSession, urls: Sequence[str], body: bytes,
                      concurrency: int, seconds: float, meter: CpuMeter,
                      warmup: float = 0.5) -> tuple[list[Sample], dict[str, float]]:
    """``concurrency`` back-to-back clients; the samples that ended inside the window
    and the CPU used during it (warm-up and drain excluded, as from the count)."""
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup
    end = start + seconds
    counter = itertools.count()
    kept: list[Sample] = []
    cpu: dict[str, float] = {}

    async def worker() -> None:
        while loop.time() < end:
            s = await request_once(session, urls[next(counter) % len(urls)], body, loop.time())
            if start <= (s.done or s.sent) <= end:
                kept.append(s)
            if s.error:
                await asyncio.sleep(0.01)  # a failing path must not spin the client

    async def window() -> None:
        await asyncio.sleep(max(0.0, start - loop.time()))
        meter.start()
        await asyncio.sleep(max(0.0, end - loop.time()))
        cpu.update(meter.stop())

    await asyncio.gather(window(), *(worker() for _ in range(concurrency)))
    return kept, cpu


# -- statistics ------------------------------------------------------------------------
def round_bootstrap(a: Sequence[np.ndarray], b: Sequence[np.ndarray], q: float, *,
                    n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Percentile ``q`` of path a minus that of path b, with a 95% confidence interval.

    ``a[i]`` and ``b[i]`` are the latencies of round ``i``, in which both paths ran one
    segment minutes apart at most; resampling whole rounds (a block bootstrap) keeps each
    round's pairing, so drift in the machine over the run widens the interval instead of
    biasing the difference. Returns (difference, low, high).

    numpy's percentile here, not ``skymesh.util.stats``: the same (linear) method, and the
    resampling loop runs thousands of times over whole arrays.
    """
    if len(a) != len(b) or not a:
        raise ValueError("need the same, non-zero number of rounds on both paths")
    est = float(np.percentile(np.concatenate(a), q) - np.percentile(np.concatenate(b), q))
    rng = np.random.default_rng(seed)
    diffs = np.empty(n_boot)
    for k in range(n_boot):
        pick = rng.integers(0, len(a), len(a))
        diffs[k] = (np.percentile(np.concatenate([a[i] for i in pick]), q)
                    - np.percentile(np.concatenate([b[i] for i in pick]), q))
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return est, float(lo), float(hi)


def _latencies(rounds: Sequence[Sequence[Sample]], what: str) -> list[np.ndarray]:
    """Per round, send to first content chunk (``ttft``) or to the stream's end (``e2e``)."""
    end = "first" if what == "ttft" else "done"
    return [np.array([getattr(s, end) - s.sent for s in got if s.ok], dtype=float)
            for got in rounds]


def against_sglang(per_round: dict[str, list[list[Sample]]], seed: int
                   ) -> dict[str, dict[str, list[float]]]:
    """Each skymesh path's p50s minus sglang-router's, [difference, 95% low, high]."""
    if SGLR not in per_round:
        return {}
    whats = ("ttft", "e2e")
    theirs = {what: _latencies(per_round[SGLR], what) for what in whats}
    out: dict[str, dict[str, list[float]]] = {}
    for name in (LB_BP, LB_DEFAULT):
        if name not in per_round:
            continue
        out[name] = {
            f"{what}_p50_s": list(round_bootstrap(_latencies(per_round[name], what),
                                                  theirs[what], 50, seed=seed))
            for what in whats}
    return out


def summarize(samples: Sequence[Sample], cpu: dict[str, float], wall_s: float,
              proxy_key: str | None) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    ttft = [s.first - s.sent for s in ok if s.first is not None]
    e2e = [s.done - s.sent for s in ok if s.done is not None]
    lag = [max(0.0, s.sent - s.due) for s in samples]
    n = len(samples)
    errors = [s.error for s in samples if not s.ok]
    replica_cpu = sum(v for k, v in cpu.items() if k.startswith("replica"))
    return {
        "requests": n,
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "send_lag_p50_s": percentile(lag, 50), "send_lag_p99_s": percentile(lag, 99),
        "send_lag_max_s": max(lag, default=None),
        "ttft_min_s": min(ttft, default=None), "e2e_min_s": min(e2e, default=None),
        "machine_cpu_busy": cpu.get("machine_busy", 0.0),
        "foreign_cpu_busy": cpu.get("foreign_busy", 0.0),
        "client_cpu_s_per_req": cpu.get("client", 0.0) / n if n else None,
        "replica_cpu_s_per_req": replica_cpu / n if n else None,
        "proxy_cpu_s_per_req": (cpu.get(proxy_key, 0.0) / n if n and proxy_key else None),
        "wall_s": wall_s,
    }


def _merge_cpu(acc: dict[str, float], cpu: dict[str, float], wall: float) -> None:
    # The *_busy values are shares: weight them by wall time, divide at the end.
    for k, v in cpu.items():
        acc[k] = acc.get(k, 0.0) + (v * wall if k.endswith("_busy") else v)


def added(results: dict[str, dict[str, Any]], path: str) -> dict[str, float | None]:
    """Balancer minus direct, per percentile (None where either side has no data)."""
    out: dict[str, float | None] = {}
    base, mine = results[DIRECT], results[path]
    for key in ("ttft_min_s", "ttft_p50_s", "ttft_p99_s", "e2e_min_s", "e2e_p50_s",
                "e2e_p99_s"):
        a, b = mine.get(key), base.get(key)
        out[key] = None if a is None or b is None else a - b
    return out


# -- CPU placement ---------------------------------------------------------------------
def pin_pid(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` and of its children onto ``cpus`` (sched_setaffinity on a
    pid moves one thread; a launcher's workers are its children)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
                pin_pid(int(child), cpus)


def pin_stack(stack: Stack) -> tuple[set[int], set[int]]:
    """Proxies on the last core, the client and the replicas on the others.

    A balancer in production has its cores to itself; here it shares two with the replicas
    and the client, whose work evicts its caches between requests. Pinning keeps only the
    proxies on one core, so a proxy's added latency is measured without that eviction; each
    proxy gets the same core, so the comparison between them stays fair.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError("--pin needs at least two cores")
    proxy_cpus, rest = {cpus[-1]}, set(cpus[:-1])
    for d in stack.proxies.values():
        pin_pid(d.proc.pid, proxy_cpus)
    for d in stack.replicas:
        pin_pid(d.proc.pid, rest)
    pin_pid(os.getpid(), rest)
    return proxy_cpus, rest


# -- the run ---------------------------------------------------------------------------
@dataclass
class Options:
    replicas: int = 2
    rates: tuple[float, ...] = DEFAULT_RATES
    duration: float = 10.0
    round_seconds: float = 2.0
    concurrency: int = 64
    closed_duration: float = 5.0
    profile: str = DEFAULT_PROFILE
    time_scale: float = DEFAULT_TIME_SCALE
    closed_time_scale: float = DEFAULT_CLOSED_TIME_SCALE
    skip_sglang: bool = False
    sglang_venv: Path = SGLANG_VENV
    seed: int = 0
    pin: bool = False


def decode_step_s(profile: str, time_scale: float) -> float:
    """Wall seconds of one decode step of one short sequence."""
    return get_profile(profile).step_time(0, 0, 1, 64) * time_scale


def _body(model: str) -> bytes:
    return json.dumps({"model": model, "stream": True, "max_tokens": OUTPUT_TOKENS,
                       "ignore_eos": True,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()


async def _warm(session: aiohttp.ClientSession, urls: Sequence[str], body: bytes) -> None:
    # Sequential requests, then a burst: opens pooled keep-alive connections on every hop
    # (client -> proxy -> replica) before anything is timed.
    loop = asyncio.get_running_loop()
    for i in range(20):
        await request_once(session, urls[i % len(urls)], body, loop.time())
    await asyncio.gather(*(request_once(session, urls[i % len(urls)], body, loop.time())
                           for i in range(32)))


def _pids(stack: Stack) -> dict[str, int]:
    pids = {f"replica{i}": d.proc.pid for i, d in enumerate(stack.replicas)}
    pids.update({name: d.proc.pid for name, d in stack.proxies.items()})
    return pids


async def _open_loop(session: aiohttp.ClientSession, stack: Stack, opts: Options,
                     body: bytes, rng: random.Random, out: dict[str, Any]) -> None:
    names = list(stack.paths)
    pids = _pids(stack)
    rounds = max(1, round(opts.duration / opts.round_seconds))
    seg_s = opts.duration / rounds
    for rate in opts.rates:
        samples: dict[str, list[Sample]] = {n: [] for n in names}
        per_round: dict[str, list[list[Sample]]] = {n: [] for n in names}
        cpu: dict[str, dict[str, float]] = {n: {} for n in names}
        walls = dict.fromkeys(names, 0.0)
        for _ in range(rounds):
            order = names[:]
            rng.shuffle(order)
            for name in order:
                meter = CpuMeter(pids)
                meter.start()
                w0 = time.monotonic()
                got = await open_loop_segment(session, stack.paths[name], body, rate, seg_s,
                                              rng)
                wall = time.monotonic() - w0
                _merge_cpu(cpu[name], meter.stop(), wall)
                walls[name] += wall
                samples[name].extend(got)
                per_round[name].append(got)
                await asyncio.sleep(SETTLE_S)
        per_path = {}
        for name in names:
            c = cpu[name]
            for k in ("machine_busy", "foreign_busy"):
                c[k] = c.get(k, 0.0) / max(walls[name], 1e-9)
            per_path[name] = summarize(samples[name], c, walls[name],
                                       None if name == DIRECT else name)
        key = f"{rate:g}"
        out["open_loop"][key] = per_path
        out["added"][key] = {n: added(per_path, n) for n in names if n != DIRECT}
        out["vs_sglang"][key] = against_sglang(per_round, opts.seed)
        print(format_rate(rate, per_path, out["added"][key]), flush=True)
        for line in format_vs_sglang(out["vs_sglang"][key]):
            print(line, flush=True)


async def _closed_loop(session: aiohttp.ClientSession, stack: Stack, opts: Options,
                       body: bytes, rng: random.Random, out: dict[str, Any]) -> None:
    order = list(stack.paths)
    rng.shuffle(order)
    pids = _pids(stack)
    for name in order:
        kept, cpu = await closed_loop(session, stack.paths[name], body, opts.concurrency,
                                      opts.closed_duration, CpuMeter(pids))
        secs = opts.closed_duration
        res = summarize(kept, cpu, secs, None if name == DIRECT else name)
        res["throughput_rps"] = sum(1 for s in kept if s.ok) / secs
        out["closed_loop"][name] = res
        await asyncio.sleep(0.5)


async def _phase(opts: Options, time_scale: float, body: bytes, sglang_py: Path | None,
                 sglang_note: str, rng: random.Random, out: dict[str, Any], *,
                 open_loop: bool, closed: bool) -> None:
    """Start a stack at ``time_scale``, run the asked measurements, stop every process."""
    timeout = aiohttp.ClientTimeout(total=60, sock_connect=5)
    with contextlib.ExitStack() as exits:
        # No connection cap: an open-loop client must never queue requests on its side.
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            stack = await start_stack(exits, session, opts.replicas, opts.profile, time_scale,
                                      body, sglang_py, sglang_note)
            if opts.pin:
                pin_stack(stack)
            for urls in stack.paths.values():
                await _warm(session, urls, body)
            if open_loop:
                await _open_loop(session, stack, opts, body, rng, out)
            if closed:
                await _closed_loop(session, stack, opts, body, rng, out)
            for d in [*stack.replicas, *stack.proxies.values()]:
                if not d.alive():
                    out.setdefault("died", []).append(f"{d.name} {d.url}: {d.log()[-500:]}")


async def run(opts: Options) -> dict[str, Any]:
    profile = get_profile(opts.profile)
    body = _body(profile.model)
    sglang_py: Path | None = None
    sglang_note = "skipped (--skip-sglang)"
    if not opts.skip_sglang:
        sglang_py, sglang_note = ensure_sglang(opts.sglang_venv, SGLANG_VERSION)
        if sglang_py is None:
            print(f"sglang-router column skipped: {sglang_note}", flush=True)
    out: dict[str, Any] = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
                   "output_tokens": OUTPUT_TOKENS, "prompt": PROMPT,
                   "decode_step_s": decode_step_s(opts.profile, opts.time_scale),
                   "cores": os.cpu_count()},
        "sglang": sglang_note,
        "targets": {"added_p50_s": TARGET_P50_S, "added_p99_s": TARGET_P99_S},
        "open_loop": {}, "added": {}, "vs_sglang": {}, "closed_loop": {},
    }
    rng = random.Random(opts.seed)
    closed = opts.closed_duration > 0
    same = opts.closed_time_scale == opts.time_scale
    await _phase(opts, opts.time_scale, body, sglang_py, sglang_note, rng, out,
                 open_loop=True, closed=closed and same)
    if closed and not same:
        # Fresh replicas (and proxies pointing at them) at the closed loop's time scale.
        await _phase(opts, opts.closed_time_scale, body, sglang_py, sglang_note, rng, out,
                     open_loop=False, closed=True)
    return out


# -- report ----------------------------------------------------------------------------
def _ms(v: float | None, width: int = 7, sign: bool = False) -> str:
    if v is None:
        return f"{'-':>{width}}"
    return f"{v * 1e3:>+{width}.2f}" if sign else f"{v * 1e3:>{width}.2f}"


def format_rate(rate: float, per_path: dict[str, dict[str, Any]],
                add: dict[str, dict[str, float | None]]) -> str:
    head = (f"{'path':<20} {'n':>5} {'err':>4} {'TTFT50':>7} {'TTFT99':>7} {'E2E50':>7} "
            f"{'E2E99':>7} | {'+TTFT50':>7} {'+TTFT99':>7} {'+E2E50':>7} {'+E2E99':>7} | "
            f"{'lag50':>6} {'lag99':>6} {'cpu%':>4} {'oth%':>4} {'proxy':>5} {'repl':>5} "
            f"{'clnt':>5}")
    rows = [f"== {rate:g} req/s ==", head]

    def us(v: float | None) -> str:
        return f"{'-':>5}" if v is None else f"{v * 1e6:>5.0f}"

    for name, r in per_path.items():
        a = add.get(name, {})
        rows.append(
            f"{name:<20} {r['requests']:>5} {r['errors']:>4} {_ms(r['ttft_p50_s'])} "
            f"{_ms(r['ttft_p99_s'])} {_ms(r['e2e_p50_s'])} {_ms(r['e2e_p99_s'])} | "
            f"{_ms(a.get('ttft_p50_s'), sign=True)} {_ms(a.get('ttft_p99_s'), sign=True)} "
            f"{_ms(a.get('e2e_p50_s'), sign=True)} {_ms(a.get('e2e_p99_s'), sign=True)} | "
            f"{_ms(r['send_lag_p50_s'], 6)} {_ms(r['send_lag_p99_s'], 6)} "
            f"{100 * r['machine_cpu_busy']:>4.0f} {100 * r['foreign_cpu_busy']:>4.0f} "
            f"{us(r['proxy_cpu_s_per_req'])} {us(r['replica_cpu_s_per_req'])} "
            f"{us(r['client_cpu_s_per_req'])}")
        if r["errors"]:
            rows.append(f"   errors: {r['error_examples']}")
    return "\n".join(rows)


def format_vs_sglang(vs: dict[str, dict[str, list[float]]]) -> list[str]:
    rows = []
    for name, figs in vs.items():
        parts = [f"{what.removesuffix('_p50_s').upper()} p50 {_ms(d, 0, sign=True).strip()} ms "
                 f"[{_ms(lo, 0, sign=True).strip()}, {_ms(hi, 0, sign=True).strip()}]"
                 for what, (d, lo, hi) in figs.items()]
        rows.append(f"{name} - sglang-router, 95% CI over rounds: {'; '.join(parts)}")
    return rows


def format_closed(res: dict[str, dict[str, Any]], opts: Options) -> str:
    step_us = decode_step_s(opts.profile, opts.closed_time_scale) * 1e6
    rows = [f"== closed loop: {opts.concurrency} concurrent streaming clients, "
            f"{opts.closed_duration:g} s per path, replicas at time scale "
            f"{opts.closed_time_scale:g} (decode step {step_us:.0f} us) ==",
            f"{'path':<20} {'req/s':>7} {'err':>4} {'E2E50':>7} {'E2E99':>7} {'cpu%':>4} "
            f"{'oth%':>4} {'proxy':>5} {'repl':>5} {'clnt':>5}"]
    for name, r in res.items():
        def us(v: float | None) -> str:
            return f"{'-':>5}" if v is None else f"{v * 1e6:>5.0f}"
        rows.append(f"{name:<20} {r['throughput_rps']:>7.0f} {r['errors']:>4} "
                    f"{_ms(r['e2e_p50_s'])} {_ms(r['e2e_p99_s'])} "
                    f"{100 * r['machine_cpu_busy']:>4.0f} {100 * r['foreign_cpu_busy']:>4.0f} "
                    f"{us(r['proxy_cpu_s_per_req'])} {us(r['replica_cpu_s_per_req'])} "
                    f"{us(r['client_cpu_s_per_req'])}")
    return "\n".join(rows)


def verdict(out: dict[str, Any]) -> tuple[bool, list[str]]:
    """Targets for skymesh-lb rr/bp: added TTFT and E2E within the limits at every rate,
    and (when measured) no worse than sglang-router."""
    lines: list[str] = []
    ok = True
    for rate, per in out["added"].items():
        mine = per.get(LB_BP)
        if mine is None:
            continue
        for key, limit in (("ttft_p50_s", TARGET_P50_S), ("ttft_p99_s", TARGET_P99_S),
                           ("e2e_p50_s", TARGET_P50_S), ("e2e_p99_s", TARGET_P99_S)):
            v = mine.get(key)
            sg = per.get(SGLR, {}).get(key)
            why = []
            if v is None or v > limit:
                why.append(f"over the {limit * 1e3:g} ms limit")
            # "No worse" with a noise allowance of a tenth of the limit: two differences
            # of percentiles from different request sets are never exactly comparable.
            if sg is not None and (v is None or v > sg + 0.1 * limit):
                why.append(f"worse than sglang-router's {_ms(sg, 0).strip()} ms")
            if why:
                ok = False
                lines.append(f"  {rate} req/s {key.removesuffix('_s')}: added "
                             f"{_ms(v, 0).strip()} ms, {' and '.join(why)}")
    return ok, lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m skymesh_lab.bench.overhead",
        description="Latency added by skymesh-lb (and sglang-router) over direct replica "
                    "access, and closed-loop throughput per path.")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in DEFAULT_RATES),
                    help="comma-separated open-loop request rates (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=10.0,
                    help="seconds per path per rate (default: %(default)s)")
    ap.add_argument("--round-seconds", type=float, default=2.0,
                    help="length of one interleaved segment (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=64,
                    help="closed-loop clients (default: %(default)s)")
    ap.add_argument("--closed-duration", type=float, default=5.0,
                    help="closed-loop seconds per path; 0 skips it (default: %(default)s)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                    help="replica time scale for the open loop (default: %(default)s)")
    ap.add_argument("--closed-time-scale", type=float, default=DEFAULT_CLOSED_TIME_SCALE,
                    help="replica time scale for the closed loop; other than --time-scale "
                         "starts fresh replicas for it (default: %(default)s)")
    ap.add_argument("--skip-sglang", action="store_true", help="no sglang-router column")
    ap.add_argument("--sglang-venv", type=Path, default=SGLANG_VENV,
                    help="venv for sglang-router, created if missing (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pin", action="store_true",
                    help="proxies on the last core, client and replicas on the others")
    ap.add_argument("--json", type=Path, help="write every figure here")
    return ap


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        build_parser().error(f"--rates: not a list of numbers: {args.rates!r}")
    if not rates or min(rates) <= 0 or args.replicas < 1 or args.duration <= 0:
        build_parser().error("need positive --rates, --duration and --replicas")
    get_profile(args.profile)  # fail on a bad name before starting anything
    opts = Options(replicas=args.replicas, rates=rates, duration=args.duration,
                   round_seconds=args.round_seconds, concurrency=args.concurrency,
                   closed_duration=args.closed_duration, profile=args.profile,
                   time_scale=args.time_scale, closed_time_scale=args.closed_time_scale,
                   skip_sglang=args.skip_sglang,
                   sglang_venv=args.sglang_venv, seed=args.seed, pin=args.pin)
    step_ms = decode_step_s(args.profile, args.time_scale) * 1e3
    print(f"overhead: {args.replicas} x {args.profile} replicas at time scale "
          f"{args.time_scale:g} (decode step {step_ms:.2f} ms wall), {OUTPUT_TOKENS} output "
          f"tokens, streaming chat; {args.duration:g} s per path per rate in "
          f"{args.round_seconds:g} s shuffled rounds; {os.cpu_count()} cores shared by all",
          flush=True)
    print(LEGEND, flush=True)
    # SIGTERM takes the KeyboardInterrupt path: asyncio.run cancels the run, whose
    # ExitStack then stops every process it started instead of leaving them orphaned.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        out = asyncio.run(run(opts))
    except KeyboardInterrupt:
        print("interrupted: every process started was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)  # `make bench` runs others after us
    print(f"sglang-router: {out['sglang']}")
    if out["closed_loop"]:
        print(format_closed(out["closed_loop"], opts))
    ok, misses = verdict(out)
    out["pass"] = ok
    measured_sglr = any(SGLR in per for per in out["added"].values())
    print(f"{'PASS' if ok else 'MISS'}: skymesh-lb rr/bp added latency p50 <= "
          f"{TARGET_P50_S * 1e3:g} ms, p99 <= {TARGET_P99_S * 1e3:g} ms, "
          + ("no worse than sglang-router" if measured_sglr else "(sglang-router not run)"))
    for line in misses:
        print(line)
    for line in out.get("died", []):
        print(f"process died: {line}")
    write_json(None if args.json is None else str(args.json), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
