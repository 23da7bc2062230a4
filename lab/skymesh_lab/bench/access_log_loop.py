"""The access log's work on the event loop for one request, measured in process.

The live figure (``access_log_cost``) is a difference of two CPU counts on a shared
machine and moves by several microseconds from round to round. This one takes the
network, aiohttp's server and the balancer out: a non-streamed reply carrying ``usage``
goes through the app's entry point with what ``skymesh.obs.access.install`` adds (the
middleware, or the wrapper around the app that the daemons' server puts in its place;
the prepare hooks) with the balancer's notes and request id, and the writer's batches are
made on the loop as in the daemon (the thread writes them to /dev/null). The figure is
the loop thread's CPU (``time.thread_time``) per request with the access log on minus
the same with it off, repeated; run once per build (``PYTHONPATH`` picks the build).

    python -m skymesh_lab.bench.access_log_loop --requests 20000 --repeats 7
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

# The C stub's reply (lab/skymesh_lab/bench/stub/stub.c): what the live figure sends.
BODY = (b'{"id":"chatcmpl-stub","object":"chat.completion","created":1700000000,'
        b'"model":"stub","choices":[{"index":0,"message":{"role":"assistant",'
        b'"content":"ok"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}')
POOL = 64  # requests made once and reused (a mocked request costs more than the log)


async def loop_us(requests: int, on: bool) -> float:
    """Loop-thread CPU microseconds per request through an app with the access log
    ``on`` (or nothing installed), from the app's entry point as the server calls it
    (routing, the middleware chain if there is one)."""
    from skymesh.balancer.edge import request_id
    from skymesh.net.jsonbody import fast_usage
    from skymesh.obs import access

    app = web.Application()

    # The balancer decodes a whole reply's usage for itself, log or not; builds with
    # note_usage hand that to the access log, older ones have the log decode it again.
    note_usage = getattr(access, "note_usage", None)

    # As the balancer notes its model: with the request's id where the build takes it
    # (the line then does not look the id up again), the id made either way (routing).
    takes_id = "request_id" in inspect.signature(access.note).parameters
    # Builds with positional notes: the balancer calls those.
    note_model = getattr(access, "note_model", None)
    note_target = getattr(access, "note_target", None)

    async def handler(request: web.Request) -> web.StreamResponse:
        rid = request_id(request)
        if note_model is not None and note_target is not None:
            note_model(request, "stub", rid)
            note_target(request, "http://127.0.0.1:8001", False)
        else:
            if takes_id:
                access.note(request, model="stub", request_id=rid)
            else:
                access.note(request, model="stub")
            access.note(request, served_by="http://127.0.0.1:8001")
        decoded = fast_usage(BODY)
        if note_usage is not None:
            note_usage(request, decoded)
        resp = web.Response(body=BODY)
        for hook in hooks:  # what the server runs when it prepares the reply
            await hook(request, resp)
        return resp

    app.router.add_post("/v1/chat/completions", handler)
    # "Off" as in a daemon started with --no-access-log: nothing of this process installed
    # the log. Builds with the flag remember an earlier "on" run in it, and the "off"
    # app's notes would look their record up and miss (a KeyError each, about 0.3 us).
    if hasattr(access, "_installed"):
        access._installed = False
    access.install(app, access_log=on, request_id=request_id)
    try:  # the hooks the lean server (the daemons' default) calls for a whole reply
        from skymesh.net.prepare_hooks import plain_prepare_hooks
    except ImportError:  # builds before it: every hook
        hooks = list(app.on_response_prepare)
    else:
        hooks = list(plain_prepare_hooks(app))
    # What skymesh.net.serving.start_app does with the log, in builds that have it.
    outside = getattr(access, "outside_chain", None)
    wrap = outside(app) if outside is not None else None
    app.freeze()
    entry: Any = app._handle
    if callable(wrap):  # builds before skymesh.net.front: a wrapper around _handle
        entry = wrap(app._handle)
    else:  # the server's one-frame handler as start_app wires it, log on or off
        try:
            from skymesh.net.front import direct_routes, request_handler
        except ImportError:  # builds before it: the server calls _handle itself
            pass
        else:
            entry = request_handler(app, app._handle, await direct_routes(app), wrap)
    for cb in app.on_startup:
        await cb(app)
    pool = [make_mocked_request("POST", "/v1/chat/completions", app=app,
                                headers={"X-Request-Id": f"req-{i}"}) for i in range(POOL)]
    for i, request in enumerate(pool):  # a client's address, as a live request has
        request._transport_peername = ("127.0.0.1", 40000 + i)
    t0 = time.thread_time()
    for i in range(requests):
        await entry(pool[i % POOL])
    spent = time.thread_time() - t0
    for cb in app.on_cleanup:
        await cb(app)
    return spent / requests * 1e6


def measure(requests: int, repeats: int) -> dict[str, Any]:
    from skymesh.obs.logs import setup_logging

    with open(os.devnull, "w") as sink:
        setup_logging("warning", "text", stream=sink)
        on: list[float] = []
        off: list[float] = []
        for _ in range(repeats):  # alternating, so both see the same stretch
            on.append(asyncio.run(loop_us(requests, True)))
            off.append(asyncio.run(loop_us(requests, False)))
    cost = [a - b for a, b in zip(on, off, strict=True)]
    return {"requests": requests, "repeats": repeats, "on_us": on, "off_us": off,
            "cost_us": {"median": round(statistics.median(cost), 3),
                        "min": round(min(cost), 3), "max": round(max(cost), 3)}}


def cli(module: str, doc: str | None, run: Callable[[int, int], dict[str, Any]],
        repeats: int, argv: list[str] | None) -> int:
    """The command line of an in-process access-log bench: ``--requests``, ``--repeats``,
    the figures as JSON on stdout."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=repeats)
    args = ap.parse_args(argv)
    json.dump(run(args.requests, args.repeats), sys.stdout)
    print()
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli("skymesh_lab.bench.access_log_loop", __doc__, measure, 7, argv)


if __name__ == "__main__":
    sys.exit(main())
