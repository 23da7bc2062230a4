"""The serving wiring's CPU per request, in process, now against a base revision (#35).

What is measured
    The loop thread's CPU (``time.thread_time``) per request through the request handler
    that ``skymesh.net.serving.start_app`` gives aiohttp's server (the connection guard's
    marks, the access log, the app's routing, ``Application._handle`` or the direct route
    of ``skymesh.net.front``), for an app shaped like skymesh-lb's: the two generation
    routes, a few GETs, the catch-all pass-through route, the request-id stamp and the
    access log as ``skymesh.balancer.server.build_app`` installs them. The handler notes
    the model and replica and answers the C stub's reply without the network; aiohttp's
    parser and response writer are not run (the same code in both builds). Each request
    is on a stand-in guarded connection, so the guard's marks run as on a real one.
    Access log on (``on``) and off (``off``, as ``--no-access-log``).

How
    Each build runs in its own process (``PYTHONPATH`` picks the build: ``--base`` is
    extracted with ``git archive``), in turns: current, base, base, current per round;
    each turn takes the best of ``--repeats`` runs of ``--requests`` requests. The
    figures are the medians over ``--rounds`` of the current build over the base in the
    same round, and each build's access log cost (on minus off).

    python -m skymesh_lab.bench.request_path_cost_loop --base 6b2f2cd --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from skymesh_lab.bench import access_log_cost as alc
from skymesh_lab.bench.access_log_loop import BODY

PATH = "/v1/chat/completions"
POOL = 64  # requests made once and reused (a mocked request costs more than the path)


class _Payload:
    """A request's body that has arrived whole (what the guard asks of it)."""

    def is_eof(self) -> bool:
        return True


class _Connection:
    """Stands in for the guard's connection: the same two marks, as cheap."""

    def __init__(self) -> None:
        self.phase = 0
        self.body_done: Any = None

    def request_started(self, body_done: Any) -> None:
        self.phase, self.body_done = 1, body_done

    def request_finished(self) -> None:
        self.phase, self.body_done = 2, None


def _app(access_log: bool) -> web.Application:
    from skymesh.balancer.edge import request_id, stamp_request_id
    from skymesh.net.jsonbody import fast_usage
    from skymesh.obs import access

    app = web.Application()

    async def generate(request: web.Request) -> web.StreamResponse:
        access.note(request, model="stub")
        access.note(request, served_by="http://127.0.0.1:8001")
        access.note_usage(request, fast_usage(BODY))
        resp = web.Response(body=BODY)
        for hook in app.on_response_prepare:  # what aiohttp runs when it prepares it
            await hook(request, resp)
        return resp

    async def other(request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    app.router.add_post(PATH, generate)
    app.router.add_post("/v1/completions", generate)
    for path in ("/v1/models", "/health", "/ready", "/metrics", "/status"):
        app.router.add_get(path, other)
    app.router.add_route("*", "/{tail:.*}", other)
    app.on_response_prepare.append(stamp_request_id)
    if hasattr(access, "_installed"):  # "off" as in a daemon with --no-access-log
        access._installed = False
    access.install(app, access_log=access_log, request_id=request_id)
    return app


def one(requests: int, repeats: int) -> dict[str, float]:
    """This process's build: ``on`` and ``off`` microseconds per request."""
    from skymesh.obs.logs import setup_logging

    with open(os.devnull, "w") as sink:
        setup_logging("warning", "text", stream=sink)
        return {"on": asyncio.run(_measure(requests, repeats, True)),
                "off": asyncio.run(_measure(requests, repeats, False))}


async def _measure(requests: int, repeats: int, access_log: bool) -> float:
    from skymesh.net import limits
    from skymesh.net.limits import ConnLimits
    from skymesh.net.serving import start_app

    app = _app(access_log)
    runner, _ = await start_app(app, "127.0.0.1", 0, "bench", ConnLimits())
    try:
        server = runner.server
        assert server is not None
        handler = server.request_handler
        pool = [make_mocked_request("POST", PATH, app=app, payload=_Payload(),  # type: ignore[arg-type]
                                    headers={"X-Request-Id": f"req-{i}"})
                for i in range(POOL)]
        limits._CURRENT.set(_Connection())  # type: ignore[arg-type]
        best = float("inf")
        for _ in range(repeats):
            t0 = time.thread_time()
            for i in range(requests):
                await handler(pool[i % POOL])
            best = min(best, time.thread_time() - t0)
        return best / requests * 1e6
    finally:
        await runner.cleanup()


def run_build(pythonpath: Path | None, cwd: Path, requests: int, repeats: int
              ) -> dict[str, float]:
    """:func:`one` in a process of the build on ``pythonpath`` (None: this checkout),
    run in ``cwd`` (see ``access_log_cost.in_process``)."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    r = subprocess.run([sys.executable, "-m", "skymesh_lab.bench.request_path_cost_loop",
                        "--one", "--requests", str(requests), "--repeats", str(repeats)],
                       env=env, cwd=cwd, capture_output=True, text=True, timeout=900,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def compare(base: str, rounds: int, requests: int, repeats: int) -> dict[str, Any]:
    """Current against ``base``, in turns (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="skymesh-path-loop-") as tmp:
        (Path(tmp) / "base").mkdir()
        base_path = alc.extract(base, Path(tmp) / "base")
        cwd = Path(tmp)
        runs: list[dict[str, dict[str, float]]] = []
        load = [os.getloadavg()[0]]
        for _ in range(rounds):
            got: dict[str, list[dict[str, float]]] = {"current": [], "base": []}
            for build in ("current", "base", "base", "current"):
                got[build].append(run_build(None if build == "current" else base_path,
                                            cwd, requests, repeats))
            runs.append({b: {k: min(r[k] for r in got[b]) for k in ("on", "off")}
                         for b in got})
            load.append(os.getloadavg()[0])

    def median(f: Any) -> float:
        return round(statistics.median(f(r) for r in runs), 3)

    return {
        "base": base, "rounds": rounds, "requests": requests, "repeats": repeats,
        "load": [round(x, 2) for x in load], "runs": runs,
        "ratio_on": median(lambda r: r["current"]["on"] / r["base"]["on"]),
        "ratio_off": median(lambda r: r["current"]["off"] / r["base"]["off"]),
        "log_cost_us": {b: median(lambda r, b=b: r[b]["on"] - r[b]["off"])
                        for b in ("current", "base")},
        "us": {b: {k: median(lambda r, b=b, k=k: r[b][k]) for k in ("on", "off")}
               for b in ("current", "base")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.request_path_cost_loop",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="6b2f2cd", help="git revision to compare with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one", action="store_true",
                    help="measure this process's build only (on and off)")
    args = ap.parse_args(argv)
    if args.one:
        out: dict[str, Any] = one(args.requests, args.repeats)
    else:
        out = compare(args.base, args.rounds, args.requests, args.repeats)
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
