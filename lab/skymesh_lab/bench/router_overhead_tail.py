"""Where skymesh-lb's c=256 tail goes: an instrumented skymesh-lb under wrk.

    python -m skymesh_lab.bench.router_overhead_tail --rounds 3 --duration 5 --json OUT.json

The product is not changed: each skymesh-lb runs in a wrapper process (``--serve``) that
imports it, installs the instruments and then calls its own ``main``:

* a middleware in front of every other one times the handler (aiohttp has parsed the
  request when it starts; the response is written when it returns). An app with a
  middleware is served by aiohttp's server alone (skymesh.net.serving), so the wrapped
  skymesh-lb runs on aiohttp's server, not on the lean one that is the default since
  session 25: its figures are those of ``listen.http_server: aiohttp``;
* an asyncio task measures the event loop's lag (a 2 ms sleep's overshoot);
* ``gc.callbacks`` time every collection, per generation;
* skymesh-lb's own ``skymesh_connections_closed_total`` tells keep-alive churn with
  the client, a count of ``Upstream._connect`` calls the churn towards the stubs.

wrk's latency minus the handler's time is what is spent outside the handler: in the
kernel's queues, waiting for the loop, parsing, writing. Variants, interleaved in every
round (``--variants``): the product as it runs (``tuned``: uvloop, its gc.freeze +
threshold 20,000) at 64 and
256 connections, the cyclic GC switched off (``nogc``), and the same 256 connections
spread over 4 stubs instead of 2 (fewer in flight per replica: the balancer keeps at most
128 idle connections per replica, ``skymesh.balancer.upstream.MAX_IDLE_PER_TARGET``),
and ``asyncio``: the standard library's event loop instead of uvloop;
round-robin + bp. New connections to the stubs are counted in the wrapper; every 20 ms
the harness asks ``ss -tin`` how long the bytes waiting in each connection's receive
queue have waited (``lastrcv`` while the queue is not empty): on the balancer's end (a
request it has not read yet) and on wrk's end (an answer wrk has not read yet), and
reports per connection the oldest seen; only connections seen with bytes waiting count.
The wrapper also samples, every 20 ms, how many client transports have reading stopped
and counts aiohttp's ``pause_reading`` calls (flow control: never seen at c=256).

More modes: ``loopaccept`` serves with the event loop's own server (``loop.create_server``,
as skymesh-lb did before ``skymesh.net.accept``: under uvloop, one accept per loop
iteration), ``uvnouring`` is ``tuned`` with libuv's io_uring off (``UV_USE_IO_URING=0``).
skymesh-lb runs with ``--workers 1`` (``--lb-workers``): the instruments see one process.
``--checkouts DIR,DIR`` instead drives each checkout's own skymesh-lb (its ``.venv``),
unwrapped, with its default workers: wrk's figures and CPU only, e.g. before/after a change.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from skymesh.util.procs import Daemon
from skymesh_lab.bench import router_overhead as ro
from skymesh_lab.bench import router_overhead_stats as st

RING = 200_000  # samples kept per instrument (newest), so memory stays bounded
LAG_TICK_S = 0.002


def _pcts(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(p * len(s)))]

    return {"n": float(len(s)), "p50_ms": q(0.5) * 1e3, "p99_ms": q(0.99) * 1e3,
            "max_ms": s[-1] * 1e3, "sum_ms": sum(s) * 1e3}


class Instruments:
    """Handler times, loop lags and GC pauses since the last ``reset``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.handler: list[float] = []
        self.lag: list[float] = []
        self.gc: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._gc_t0 = 0.0
        # From a connection's accept to its first request's handler (id(protocol) ->
        # accept time, taken out at that request).
        self.opened: dict[int, float] = {}
        self.first_wait: list[float] = []
        self.upstream_connects = 0
        # Client connections, to sample how many have reading stopped on their transport.
        self.conns: dict[int, Any] = {}
        self.not_reading: list[float] = []
        self.pauses = 0

    def reset(self) -> None:
        with self.lock:
            self.handler, self.lag, self.first_wait = [], [], []
            self.upstream_connects = 0
            self.not_reading, self.pauses = [], 0
            self.gc = {0: [], 1: [], 2: []}

    def add(self, xs: list[float], v: float) -> None:
        if len(xs) < RING:
            xs.append(v)

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.add(self.gc[info["generation"]], time.perf_counter() - self._gc_t0)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"handler": _pcts(self.handler), "loop_lag": _pcts(self.lag),
                    "accept_to_first_handler": _pcts(self.first_wait),
                    "upstream_connects": self.upstream_connects,
                    "not_reading_max": max(self.not_reading, default=0.0),
                    "transport_pauses": self.pauses,
                    "gc": {str(g): _pcts(v) for g, v in self.gc.items()}}


def serve(stats_path: Path, control_path: Path, gc_mode: str, lb_argv: list[str]) -> int:
    """Run skymesh-lb with the instruments; every 0.2 s, a ``reset`` written to
    ``control_path`` clears them and the current figures go to ``stats_path``."""
    from aiohttp import web
    from aiohttp.web_protocol import RequestHandler

    import skymesh.balancer.server as server
    import skymesh.balancer.upstream as upstream
    import skymesh.net.serving as serving
    from skymesh.balancer.cli import main as lb_main

    inst = Instruments()
    gc.callbacks.append(inst.on_gc)

    made = RequestHandler.connection_made

    def connection_made(self: RequestHandler, transport: asyncio.BaseTransport) -> None:
        inst.conns[id(self)] = self
        if len(inst.opened) < RING:
            inst.opened[id(self)] = time.perf_counter()
        made(self, transport)

    RequestHandler.connection_made = connection_made  # type: ignore[method-assign]
    lost = RequestHandler.connection_lost

    def connection_lost(self: RequestHandler, exc: BaseException | None) -> None:
        inst.conns.pop(id(self), None)
        lost(self, exc)

    RequestHandler.connection_lost = connection_lost  # type: ignore[method-assign]
    connect = upstream.Upstream._connect

    async def counted_connect(self: upstream.Upstream, key: tuple[str, int, bool]) -> Any:
        inst.upstream_connects += 1
        return await connect(self, key)

    upstream.Upstream._connect = counted_connect  # type: ignore[method-assign]
    build_app = server.build_app

    def build_app_timed(cfg: Any, **kwargs: Any) -> web.Application:
        app = build_app(cfg, **kwargs)

        @web.middleware
        async def timed(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                        ) -> web.StreamResponse:
            t0 = time.perf_counter()
            opened = inst.opened.pop(id(request.protocol), None)
            if opened is not None:
                inst.add(inst.first_wait, t0 - opened)
            try:
                return await handler(request)
            finally:
                inst.add(inst.handler, time.perf_counter() - t0)

        app.middlewares.insert(0, timed)
        return app

    server.build_app = build_app_timed
    run = serving.run

    async def lag_monitor() -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(LAG_TICK_S)
            inst.add(inst.lag, max(0.0, time.perf_counter() - t0 - LAG_TICK_S))

    async def reading_monitor() -> None:
        while True:
            await asyncio.sleep(0.02)
            n = 0
            for h in list(inst.conns.values()):
                tr = h.transport
                if tr is not None and not tr.is_closing() and not tr.is_reading():
                    n += 1
            inst.add(inst.not_reading, float(n))

    from aiohttp.base_protocol import BaseProtocol
    pause = BaseProtocol._pause_transport_reading

    def counted_pause(self: Any) -> None:
        inst.pauses += 1
        pause(self)

    BaseProtocol._pause_transport_reading = counted_pause  # type: ignore[method-assign]

    async def reporter() -> None:
        while True:
            await asyncio.sleep(0.2)
            if control_path.exists() and control_path.read_text() == "reset":
                control_path.write_text("")
                inst.reset()
            # Whole or not at all: the harness may read it at any moment.
            tmp = stats_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(inst.snapshot()))
            os.replace(tmp, stats_path)

    def run_instrumented(main: Coroutine[Any, Any, None]) -> None:
        async def wrapped() -> None:
            tasks = [asyncio.create_task(lag_monitor()), asyncio.create_task(reporter()),
                     asyncio.create_task(reading_monitor())]
            try:
                await main
            finally:
                for t in tasks:
                    t.cancel()

        if gc_mode == "nogc":
            # After the product's tune_gc (it runs once serving): off for good.
            def off() -> None:
                time.sleep(3.0)
                gc.disable()
            threading.Thread(target=off, daemon=True).start()
        run(wrapped())

    if gc_mode == "asyncio":  # the standard library's loop instead of uvloop
        run = asyncio.run
    if gc_mode == "loopaccept":  # the loop's own server, as before skymesh.net.accept
        serving.GuardedSite.start = _loop_server_start  # type: ignore[method-assign]
    serving.run = run_instrumented
    return lb_main(lb_argv)


async def _loop_server_start(self: Any) -> None:
    """GuardedSite.start as it was: ``loop.create_server`` (uvloop: one accept per loop
    iteration), for the before/after comparison."""
    from aiohttp import web
    await web.BaseSite.start(self)
    server = self._runner.server
    handshake = self._guard.limits.header_timeout_s if self._ssl_context else None
    where: dict[str, Any] = ({"sock": self._sock} if self._sock is not None
                             else {"host": self._host, "port": self._port})
    self._server = await asyncio.get_running_loop().create_server(
        self._guard.protocol_factory(server), **where,
        ssl=self._ssl_context, backlog=self._backlog, ssl_handshake_timeout=handshake)
    self._bound_port = self._server.sockets[0].getsockname()[1]


# -- the measurement -------------------------------------------------------------------
_LISTENING = re.compile(r"listening on (http://\S+)")


def start_wrapped(name: str, cmd: list[str], workdir: Path,
                  env: dict[str, str] | None = None) -> Daemon:
    """``cmd`` (a wrapped skymesh-lb), once it printed where it listens."""
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    deadline = time.monotonic() + ro.READY_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        m = _LISTENING.search(log_path.read_text(errors="replace"))
        if m:
            return Daemon(name, proc, m.group(1), log_path)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{name} did not start:\n{log_path.read_text()[-2000:]}")


# Modes that are another mode plus environment variables for skymesh-lb's process.
MODE_GC = {"uvnouring": "tuned"}
MODE_ENV = {"uvnouring": {"UV_USE_IO_URING": "0"}}

# (skymesh-lb instance "GC mode-replicas", connections)
VARIANTS = (("tuned-2", 64), ("tuned-2", 256), ("tuned-4", 256), ("nogc-2", 256))


_LASTRCV = re.compile(r"\blastrcv:(\d+)")


def parse_ss(text: str) -> dict[tuple[str, str], float]:
    """``ss -tinH`` output -> (local, peer) -> seconds the bytes in its receive queue have
    waited unread (``lastrcv``: since data last arrived, when the queue is not empty);
    sockets with an empty queue are left out."""
    out: dict[tuple[str, str], float] = {}
    lines = text.splitlines()
    for head, info in zip(lines[::2], lines[1::2], strict=False):
        parts = head.split()
        if len(parts) < 4 or not parts[0].isdigit() or int(parts[0]) == 0:
            continue
        m = _LASTRCV.search(info)
        out[(parts[2], parts[3])] = int(m.group(1)) / 1e3 if m else 0.0
    return out


def unread_ages(port: int) -> dict[str, dict[tuple[str, str], float]]:
    """Per side, the age of unread bytes on ``port``'s connections: ``server`` is the
    balancer's end (a request not read yet), ``client`` wrk's (an answer not read yet)."""
    out = {}
    for side, sel in (("server", f"( sport = :{port} )"), ("client", f"( dport = :{port} )")):
        r = subprocess.run(["ss", "-tinH", "state", "established", sel], capture_output=True,
                           text=True, timeout=10)
        out[side] = parse_ss(r.stdout)
    return out


class QueueSampler(threading.Thread):
    """``unread_ages`` every ``every_s`` until stopped; per side and connection, the
    oldest unread bytes seen."""

    def __init__(self, port: int, every_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.port, self.every_s = port, every_s
        self.oldest: dict[str, dict[tuple[str, str], float]] = {"server": {}, "client": {}}
        self.samples = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.every_s):
            for side, ages in unread_ages(self.port).items():
                seen = self.oldest[side]
                for key, age in ages.items():
                    seen[key] = max(seen.get(key, 0.0), age)
            self.samples += 1


def _closed(url: str) -> float:
    """skymesh-lb's client connections closed so far (all reasons)."""
    _, text = ro.http_request(url, "GET", "/metrics")
    total = 0.0
    for line in text.decode(errors="replace").splitlines():
        if line.startswith("skymesh_connections_closed_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def measure(rounds: int, duration_s: float, seed: int,
            variants: tuple[tuple[str, int], ...] = VARIANTS,
            lb_workers: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="c256-tail-") as tmp:
        work = Path(tmp)
        binary = ro.build_stub(work)
        stubs = [ro.start_stub(binary, ro.STREAM_EVENTS, work, i) for i in range(4)]
        lbs: dict[str, tuple[Daemon, Path, Path]] = {}
        try:
            for name in sorted({m for m, _ in variants}):
                gc_mode, n_replicas = name.split("-")
                env = MODE_ENV.get(gc_mode, {})
                gc_mode = MODE_GC.get(gc_mode, gc_mode)
                stats, control = work / f"{name}.stats", work / f"{name}.control"
                argv = ["--port", "0", "--workers", str(lb_workers), "--replicas",
                        ",".join(d.url for d in stubs[:int(n_replicas)]),
                        *ro.CONFIG_FLAGS[ro.SKYMESH]["rr"]]
                d = start_wrapped(
                    f"skymesh-lb-{name}",
                    [sys.executable, "-m", "skymesh_lab.bench.router_overhead_tail",
                     "--serve", str(stats), "--control", str(control), "--gc", gc_mode,
                     "--", *argv], work, env)
                lbs[name] = (d, stats, control)
            for d, _, _ in lbs.values():
                ro.wait_ready(d)
                ro.run_wrk(d.url, ro.Case("warmup", "rr", 64, False, "fixed"), 1.0)
            time.sleep(3.5)  # nogc's switch
            for rnd in range(rounds):
                plan = list(variants)
                rng.shuffle(plan)
                for name, conns in plan:
                    d, stats, control = lbs[name]
                    control.write_text("reset")
                    deadline = time.monotonic() + 5
                    while control.read_text() == "reset" and time.monotonic() < deadline:
                        time.sleep(0.05)
                    closed0 = _closed(d.url)
                    case = ro.Case(f"c{conns}", "rr", conns, False, "fixed")
                    sampler = QueueSampler(int(d.url.rsplit(":", 1)[1]))
                    cpu0 = st.tree_cpu_ticks(st.tree(ro.proc_snapshot(), d.proc.pid))
                    sampler.start()
                    try:
                        wrk = st.parse_wrk(ro.run_wrk(d.url, case, duration_s))
                    finally:
                        sampler.halt.set()
                        sampler.join()
                    cpu1 = st.tree_cpu_ticks(st.tree(ro.proc_snapshot(), d.proc.pid))
                    time.sleep(0.5)  # one more report from the wrapper
                    inst = json.loads(stats.read_text())
                    row = {"round": rnd, "lb": name, "connections": conns, "wrk": wrk,
                           "client_conns_closed": _closed(d.url) - closed0,
                           "unread_request_s": _pcts(list(sampler.oldest["server"].values())),
                           "unread_answer_s": _pcts(list(sampler.oldest["client"].values())),
                           "queue_samples": sampler.samples,
                           "cpu_ms_per_1k": st.cpu_ms_per_1k(cpu0, cpu1, wrk["requests"],
                                                             os.sysconf("SC_CLK_TCK")),
                           **inst}
                    out.append(row)
                    print(describe(row), flush=True)
        finally:
            for d, _, _ in lbs.values():
                d.stop()
            for s in stubs:
                s.stop()
    return {"setup": {"rounds": rounds, "duration_s": duration_s, "variants": variants,
                      "loadavg": list(os.getloadavg()), "cores": os.cpu_count()},
            "rows": out}


def compare_checkouts(roots: list[Path], workers: str, conns: int, rounds: int,
                      duration_s: float, seed: int) -> dict[str, Any]:
    """wrk's p50/p99 through skymesh-lb of each checkout (its ``.venv``), unwrapped (no
    instruments: with several workers they would see one process only), interleaved."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="c256-tail-co-") as tmp:
        work = Path(tmp)
        binary = ro.build_stub(work)
        stubs = [ro.start_stub(binary, ro.STREAM_EVENTS, work, i) for i in range(2)]
        lbs: dict[str, Daemon] = {}
        try:
            for i, root in enumerate(roots):
                argv = [str(root / ".venv/bin/python"), "-m", "skymesh.balancer.cli",
                        "--port", "0", "--workers", workers,
                        "--replicas", ",".join(d.url for d in stubs),
                        *ro.CONFIG_FLAGS[ro.SKYMESH]["rr"]]
                lbs[f"{i}:{root}"] = start_wrapped(f"skymesh-lb-{i}", argv, work)
            for d in lbs.values():
                ro.wait_ready(d)
                ro.run_wrk(d.url, ro.Case("warmup", "rr", 64, False, "fixed"), 1.0)
            for rnd in range(rounds):
                plan = list(lbs)
                rng.shuffle(plan)
                for name in plan:
                    d = lbs[name]
                    case = ro.Case(f"c{conns}", "rr", conns, False, "fixed")
                    cpu0 = st.tree_cpu_ticks(st.tree(ro.proc_snapshot(), d.proc.pid))
                    wrk = st.parse_wrk(ro.run_wrk(d.url, case, duration_s))
                    cpu1 = st.tree_cpu_ticks(st.tree(ro.proc_snapshot(), d.proc.pid))
                    row = {"round": rnd, "checkout": name, "connections": conns, "wrk": wrk,
                           "cpu_ms_per_1k": st.cpu_ms_per_1k(cpu0, cpu1, wrk["requests"],
                                                             os.sysconf("SC_CLK_TCK"))}
                    out.append(row)
                    print(f"r{rnd} {name} c={conns} {wrk['rps']:.0f} req/s p50 "
                          f"{wrk['p50_ms']:.1f} p99 {wrk['p99_ms']:.1f} ms "
                          f"(x{wrk['p99_ms'] / wrk['p50_ms']:.1f})", flush=True)
        finally:
            for d in lbs.values():
                d.stop()
            for s in stubs:
                s.stop()
    return {"setup": {"roots": [str(r) for r in roots], "workers": workers,
                      "connections": conns, "rounds": rounds, "duration_s": duration_s,
                      "loadavg": list(os.getloadavg()), "cores": os.cpu_count()},
            "rows": out}


def describe(row: dict[str, Any]) -> str:
    wrk, h, lag = row["wrk"], row["handler"], row["loop_lag"]
    acc = row.get("accept_to_first_handler", {})
    gcs = " ".join(f"g{g}:{v.get('n', 0):.0f}/{v.get('max_ms', 0):.1f}ms"
                   for g, v in row["gc"].items())
    return (f"r{row['round']} {row['lb']:<7} c={row['connections']:<3} {wrk['rps']:>6.0f} "
            f"req/s wrk p50 {wrk['p50_ms']:.1f} p99 {wrk['p99_ms']:.1f} ms | handler p50 "
            f"{h.get('p50_ms', 0):.2f} p99 {h.get('p99_ms', 0):.2f} | loop lag p99 "
            f"{lag.get('p99_ms', 0):.1f} max {lag.get('max_ms', 0):.1f} | gc {gcs} | "
            f"accept->handler p50 {acc.get('p50_ms', 0):.1f} max {acc.get('max_ms', 0):.1f} "
            f"(n {acc.get('n', 0):.0f}) | "
            f"client conns closed {row['client_conns_closed']:.0f}, upstream connects "
            f"{row['upstream_connects']} | longest unread request per conn p99 "
            f"{row['unread_request_s'].get('p99_ms', 0):.0f} max "
            f"{row['unread_request_s'].get('max_ms', 0):.0f} ms, unread answer p99 "
            f"{row['unread_answer_s'].get('p99_ms', 0):.0f} max "
            f"{row['unread_answer_s'].get('max_ms', 0):.0f} ms "
            f"({row['queue_samples']} samples) | not reading max "
            f"{row.get('not_reading_max', 0):.0f}"
            f", pauses {row.get('transport_pauses', 0)}")


def checkout_table(res: dict[str, Any]) -> str:
    """A ``--checkouts`` run: per checkout, the median and [min, max] over the rounds."""
    import statistics

    def cell(rows: list[dict[str, Any]], get: Callable[[dict[str, Any]], float],
             fmt: str) -> str:
        xs = [get(r) for r in rows]
        return (f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]")

    setup = res["setup"]
    out = [f"skymesh-lb --workers {setup['workers']}, {setup['connections']} connections, "
           f"{setup['rounds']} rounds of {setup['duration_s']:g} s; median [min, max]:", "",
           "| checkout | req/s | wrk p50 ms | wrk p99 ms | p99/p50 | CPU ms per 1,000 requests |",
           "|---|---:|---:|---:|---:|---:|"]
    for i, root in enumerate(setup["roots"]):
        rows = [r for r in res["rows"] if r["checkout"] == f"{i}:{root}"]
        out.append(f"| {root} | {cell(rows, lambda r: r['wrk']['rps'], ',.0f')} "
                   f"| {cell(rows, lambda r: r['wrk']['p50_ms'], '.1f')} "
                   f"| {cell(rows, lambda r: r['wrk']['p99_ms'], '.1f')} "
                   f"| {cell(rows, lambda r: r['wrk']['p99_ms'] / r['wrk']['p50_ms'], '.1f')} "
                   f"| {cell(rows, lambda r: r['cpu_ms_per_1k'], '.0f')} |")
    return "\n".join(out)


def spread_table(res: dict[str, Any]) -> str:
    """Per variant, wrk's p99/p50 and the longest unread request of every round."""
    out = ["| skymesh-lb (variant, replicas) | conns | p99/p50 per round | unread request, "
           "longest per round, ms | loop lag max per round, ms |", "|---|---:|---|---|---|"]
    for name, conns in res["setup"]["variants"]:
        rows = sorted((r for r in res["rows"] if r["lb"] == name
                       and r["connections"] == conns), key=lambda r: r["round"])
        if not rows:
            continue
        mode, reps = name.split("-")
        out.append(
            f"| {mode}, {reps} | {conns} | "
            + ", ".join(f"{r['wrk']['p99_ms'] / r['wrk']['p50_ms']:.1f}" for r in rows)
            + " | " + ", ".join(f"{r['unread_request_s'].get('max_ms', 0.0):.0f}"
                                 for r in rows)
            + " | " + ", ".join(f"{r['loop_lag'].get('max_ms', 0.0):.0f}" for r in rows)
            + " |")
    return "\n".join(out)


def table(res: dict[str, Any]) -> str:
    """Medians over the rounds per variant, as markdown (docs/notes/c256-tail.md)."""
    import statistics

    if "roots" in res["setup"]:
        return checkout_table(res)

    def med(rows: list[dict[str, Any]], get: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(get(r) for r in rows)

    out = ["| skymesh-lb (variant, replicas) | conns | req/s | wrk p50 ms | wrk p99 ms | p99/p50 "
           "| handler p50 ms | handler p99 ms | loop lag p99 ms | loop lag max ms "
           "| GC runs (all gens) / longest ms | new conns: accept to handler p50 / max ms "
           "| client conns closed | upstream connects | unread request, longest per conn: "
           "p99 / max ms | unread answer (wrk side): p99 / max ms | CPU ms per 1,000 requests |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, conns in res["setup"]["variants"]:
        rows = [r for r in res["rows"] if r["lb"] == name and r["connections"] == conns]
        if not rows:
            continue
        gc_mode, reps = name.split("-")
        with_cpu = [r for r in rows if "cpu_ms_per_1k" in r]  # older runs lack it
        cpu = f"{med(with_cpu, lambda r: r['cpu_ms_per_1k']):.0f}" if with_cpu else "-"
        out.append(
            f"| {gc_mode}, {reps} | {conns} | {med(rows, lambda r: r['wrk']['rps']):,.0f} "
            f"| {med(rows, lambda r: r['wrk']['p50_ms']):.1f} "
            f"| {med(rows, lambda r: r['wrk']['p99_ms']):.1f} "
            f"| {med(rows, lambda r: r['wrk']['p99_ms'] / r['wrk']['p50_ms']):.1f} "
            f"| {med(rows, lambda r: r['handler'].get('p50_ms', 0.0)):.2f} "
            f"| {med(rows, lambda r: r['handler'].get('p99_ms', 0.0)):.2f} "
            f"| {med(rows, lambda r: r['loop_lag'].get('p99_ms', 0.0)):.1f} "
            f"| {med(rows, lambda r: r['loop_lag'].get('max_ms', 0.0)):.1f} "
            f"| {med(rows, lambda r: sum(g.get('n', 0.0) for g in r['gc'].values())):.0f}"
            f" / {med(rows, lambda r: max(g.get('max_ms', 0.0) for g in r['gc'].values())):.1f} "
            f"| {med(rows, lambda r: r['accept_to_first_handler'].get('p50_ms', 0.0)):.1f} / "
            f"{med(rows, lambda r: r['accept_to_first_handler'].get('max_ms', 0.0)):.1f} "
            f"| {med(rows, lambda r: r['client_conns_closed']):,.0f} "
            f"| {med(rows, lambda r: r['upstream_connects']):,.0f} "
            f"| {med(rows, lambda r: r['unread_request_s'].get('p99_ms', 0.0)):.0f} / "
            f"{med(rows, lambda r: r['unread_request_s'].get('max_ms', 0.0)):.0f} "
            f"| {med(rows, lambda r: r['unread_answer_s'].get('p99_ms', 0.0)):.0f} / "
            f"{med(rows, lambda r: r['unread_answer_s'].get('max_ms', 0.0)):.0f} "
            f"| {cpu} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--serve" in argv:
        cut = argv.index("--")
        ap = argparse.ArgumentParser()
        ap.add_argument("--serve", type=Path)
        ap.add_argument("--control", type=Path)
        ap.add_argument("--gc", default="tuned", choices=["tuned", "nogc", "asyncio", "loopaccept"])
        a = ap.parse_args(argv[:cut])
        return serve(a.serve, a.control, a.gc, argv[cut + 1:])
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.router_overhead_tail",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--variants", default=None, metavar="LIST",
                    help="e.g. tuned-2:256,asyncio-2:256 (MODE-REPLICAS:CONNECTIONS; MODE "
                         "tuned, nogc or asyncio)")
    ap.add_argument("--lb-workers", type=int, default=1,
                    help="skymesh-lb's --workers (default 1: the instruments see one process)")
    ap.add_argument("--markdown", type=Path, default=None, metavar="JSON",
                    help="print the table of a run's JSON instead of running")
    ap.add_argument("--checkouts", default=None, metavar="DIR,DIR",
                    help="instead: wrk through each checkout's skymesh-lb (its .venv), "
                         "unwrapped, with --checkout-workers (default auto) at "
                         "--checkout-conns connections")
    ap.add_argument("--checkout-workers", default="auto")
    ap.add_argument("--checkout-conns", type=int, default=256)
    a = ap.parse_args(argv)
    if a.checkouts:
        res = compare_checkouts([Path(p) for p in a.checkouts.split(",")],
                                a.checkout_workers, a.checkout_conns, a.rounds, a.duration,
                                a.seed)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1) + "\n")
        return 0
    if a.markdown:
        res = json.loads(a.markdown.read_text())
        print(table(res))
        if "variants" in res["setup"]:
            print()
            print(spread_table(res))
        return 0
    variants = VARIANTS if not a.variants else tuple(
        (v.split(":")[0], int(v.split(":")[1])) for v in a.variants.split(","))
    res = measure(a.rounds, a.duration, a.seed, variants, a.lb_workers)
    print(table(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
