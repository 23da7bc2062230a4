"""Where a streamed request's first token spends its time inside skymesh-lb.

``skymesh_lab.bench.overhead`` gives the balancer's added latency end to end; this splits the
balancer's part of it into stages, measured in place on the live daemon:

1. ``server: request bytes -> handler``: from the event loop handing the request's
   last bytes to the HTTP server's protocol (skymesh.net.lean's, the default, or
   aiohttp's ``RequestHandler`` for what it hands over or with ``listen.http_server:
   aiohttp``) until the generate handler starts (parsing, request object, routing, the
   handler's task or wake-up);
2. ``skymesh: handler -> upstream write``: intake, the routing decision and writing the
   request to the replica;
3. ``replica: upstream write -> reply bytes``: the replica's own time plus the loopback
   hop (not the balancer's);
4. ``skymesh + server: reply bytes -> first chunk written``: from the replica's first
   bytes reaching the balancer until the status, headers and first chunk have been
   written to the client.

``balancer total`` is stages 1 + 2 + 4 per request. How: the balancer runs in a child
process (``--traced-lb``) that wraps five functions with perf-counter stamps before
starting ``skymesh-lb``; Poisson load of short streamed chat requests (blind pushing,
round robin, two fast emulated replicas, as in the overhead benchmark) goes through it;
the child writes its records when signalled. The wrappers cost a few microseconds each,
so the figures are a little above the untraced daemon's.

Why it exists: at low request rates every step costs several times its in-a-loop time
(the daemon wakes with cold caches), so the stages, not a profile of a busy process,
say what a lighter data path would save.

    python -m skymesh_lab.bench.critical_path                       # 20 req/s for 30 s
    python -m skymesh_lab.bench.critical_path --rate 50 --seconds 60 --json cp.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from skymesh.util.jsonio import write_json
from skymesh.util.procs import Daemon
from skymesh.util.stats import fmt, percentile, percentiles

TRACE_ENV = "SKYMESH_CRITICAL_PATH_OUT"
STAGES: tuple[tuple[str, str, str], ...] = (
    ("server: request bytes -> handler", "in", "handler"),
    ("skymesh: handler -> upstream write", "handler", "upstream_write"),
    ("replica: upstream write -> reply bytes", "upstream_write", "reply_in"),
    ("skymesh + server: reply bytes -> first chunk written", "reply_in", "first_written"),
)
TOTAL = "balancer total (stages 1, 2 and 4)"
STAMPS = ("in", "handler", "upstream_write", "reply_in", "first_written")
# skymesh_lab.bench.overhead._warm: 20 sequential requests, then a burst of 32.
WARM_REQUESTS = 52


# -- the traced daemon (child process) ---------------------------------------------------
def install_hooks(records: list[dict[str, int]]) -> None:
    """Wrap the five functions that bound the stages; completed requests land in
    ``records`` as {stamp: perf_counter_ns}. A function that moved is an AttributeError
    naming it (they are internals of aiohttp and of the balancer)."""
    from aiohttp import web_protocol

    from skymesh.balancer import handlers, streaming, upstream
    from skymesh.net import lean

    clock = time.perf_counter_ns
    last_in = [0]
    current: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar(
        "skymesh_critical_path", default=None)

    recv = web_protocol.RequestHandler.data_received
    lean_recv = lean.LeanProtocol.data_received

    def data_received(self: Any, data: bytes) -> None:
        last_in[0] = clock()
        recv(self, data)

    def lean_data_received(self: Any, data: bytes) -> None:
        last_in[0] = clock()
        lean_recv(self, data)

    handle = handlers.Handlers.handle_generate

    async def handle_generate(self: Any, request: Any) -> Any:
        rec = {"in": last_in[0], "handler": clock()}
        current.set(rec)
        try:
            return await handle(self, request)
        finally:
            if all(k in rec for k in STAMPS):
                records.append(rec)

    # A reply is made on its connection just before the request is written to it.
    reply_init = upstream.UpstreamReply.__init__

    def reply_made(self: Any, conn: Any, pool: Any, read_timeout: float) -> None:
        reply_init(self, conn, pool, read_timeout)
        rec = current.get()
        if rec is not None:
            rec["upstream_write"] = clock()
            conn._critical_path = rec

    conn_recv = upstream._Conn.data_received

    def conn_data_received(self: Any, data: bytes) -> None:
        rec = getattr(self, "_critical_path", None)
        if rec is not None:
            rec.setdefault("reply_in", clock())
            self._critical_path = None
        conn_recv(self, data)

    open_stream = streaming.Streams._open_stream

    async def _open_stream(self: Any, *args: Any) -> None:
        await open_stream(self, *args)
        rec = current.get()
        if rec is not None:
            rec["first_written"] = clock()

    for cls, name, wrapper in ((web_protocol.RequestHandler, "data_received", data_received),
                               (lean.LeanProtocol, "data_received", lean_data_received),
                               (handlers.Handlers, "handle_generate", handle_generate),
                               (upstream.UpstreamReply, "__init__", reply_made),
                               (upstream._Conn, "data_received", conn_data_received),
                               (streaming.Streams, "_open_stream", _open_stream)):
        setattr(cls, name, wrapper)


def traced_lb(lb_args: list[str]) -> int:
    records: list[dict[str, int]] = []
    install_hooks(records)
    out = Path(os.environ[TRACE_ENV])

    def dump(signum: int, frame: object) -> None:
        out.write_text(json.dumps(records))
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    from skymesh.balancer.cli import main

    return main(lb_args)


# -- the driver ----------------------------------------------------------------------------
def stage_table(records: Sequence[dict[str, int]]) -> dict[str, dict[str, float]]:
    """p50 and p90 of each stage in microseconds, plus the balancer's total."""
    out: dict[str, dict[str, float]] = {}
    spans: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    spans[TOTAL] = []
    for r in records:
        for name, a, b in STAGES:
            spans[name].append((r[b] - r[a]) / 1000.0)
        spans[TOTAL].append((r["upstream_write"] - r["in"] + r["first_written"]
                             - r["reply_in"]) / 1000.0)
    for name, vals in spans.items():
        if vals:
            p50, p90 = percentiles(vals, (50, 90))
            assert p50 is not None and p90 is not None  # vals is not empty
            out[name] = {"p50_us": round(p50, 1), "p90_us": round(p90, 1)}
    return out


async def _drive(lb: Daemon, body: bytes, rate: float, seconds: float, seed: int
                 ) -> list[float]:
    import aiohttp

    from skymesh_lab.bench.overhead import _wait_ok, _warm, open_loop_segment

    async with aiohttp.ClientSession() as session:
        await _wait_ok(session, lb, "GET", "/ready")
        await _warm(session, [lb.url], body)
        samples = await open_loop_segment(session, [lb.url], body, rate, seconds,
                                          random.Random(seed))
    errors = [s.error for s in samples if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(samples)} requests failed: {errors[0]}")
    return [(s.first - s.sent) * 1000.0 for s in samples if s.first is not None]


async def _replicas_and_model(exits: contextlib.ExitStack, n: int) -> tuple[list[str], str]:
    import aiohttp

    from skymesh_lab.bench.overhead import DEFAULT_PROFILE, DEFAULT_TIME_SCALE, start_replicas

    async with aiohttp.ClientSession() as session:
        reps = await start_replicas(exits, session, n, DEFAULT_PROFILE, DEFAULT_TIME_SCALE)
        async with session.get(reps[0].url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
    return [d.url for d in reps], model


def run(rate: float, seconds: float, replicas: int = 2, seed: int = 0) -> dict[str, Any]:
    from skymesh.util.procs import free_port
    from skymesh_lab.bench.overhead import _body

    with contextlib.ExitStack() as exits:
        urls, model = asyncio.run(_replicas_and_model(exits, replicas))
        tmp = Path(tempfile.mkdtemp(prefix="skymesh-cp-"))
        out, log_path = tmp / "records.json", tmp / "lb.log"
        port = free_port()
        # One process: the tracing hooks are installed in this one (workers re-execute).
        args = ["--port", str(port), "--replicas", ",".join(urls), "--policy", "round-robin",
                "--push-mode", "bp", "--workers", "1"]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "skymesh_lab.bench.critical_path", "--traced-lb", "--",
                 *args], stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, TRACE_ENV: str(out)})
        lb = Daemon("skymesh-lb (traced)", proc, f"http://127.0.0.1:{port}", log_path)
        exits.callback(lb.kill)
        ttft = asyncio.run(_drive(lb, _body(model), rate, seconds, seed))
        proc.send_signal(signal.SIGUSR1)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        if not out.exists():
            raise RuntimeError(f"the traced balancer wrote no records:\n"
                               f"{log_path.read_text(errors='replace')[-2000:]}")
        records = json.loads(out.read_text())
    # The warm-up requests are not the measured load.
    measured = records[WARM_REQUESTS:]
    p50 = percentile(ttft, 50)
    return {"rate_rps": rate, "seconds": seconds, "requests": len(measured),
            "client_ttft_p50_ms": None if p50 is None else round(p50, 3),
            "stages": stage_table(measured)}


def format_result(res: dict[str, Any]) -> str:
    lines = [f"critical path in skymesh-lb at {res['rate_rps']:g} req/s for "
             f"{res['seconds']:g} s: {res['requests']} requests, client TTFT p50 "
             f"{fmt(res['client_ttft_p50_ms'])} ms",
             f"{'stage':58s} {'p50 us':>8s} {'p90 us':>8s}"]
    for name, v in res["stages"].items():
        lines.append(f"{name:58s} {v['p50_us']:8.1f} {v['p90_us']:8.1f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of Poisson load")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--traced-lb", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--traced-lb"]:
        return traced_lb(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    args = build_parser().parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.replicas < 1:
        build_parser().error("--rate and --seconds must be positive, --replicas >= 1")
    res = run(args.rate, args.seconds, args.replicas, args.seed)
    print(format_result(res))
    write_json(str(args.json) if args.json else None, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
