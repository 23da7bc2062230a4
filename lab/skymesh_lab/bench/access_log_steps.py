"""The access log's work on the loop for one request, split by step, in process.

``access_log_loop`` gives the log's whole in-process cost (on minus off); this says where
it goes. Each step runs over ``--requests`` lean-server requests (``LeanRequest``, what
the default server hands the balancer) in a loop of its own, timed with
``time.thread_time_ns``, the best of ``--repeats``: the record made as a request starts,
the balancer's two notes and its usage, the prepare hook of a whole reply (0 where the
build marks it as watching streams only: the lean server then does not call it), the request's
end (its record joining the open batch; the batch's lines are the last step, per line).
Each step's figure carries the loop's own overhead (a list index, a call), the same for
every step. Run once per build (``PYTHONPATH`` picks it).

    python -m skymesh_lab.bench.access_log_steps --requests 20000 --repeats 9
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11
from multidict import CIMultiDict, CIMultiDictProxy

from skymesh_lab.bench.access_log_loop import BODY, cli

STEPS = ("begin", "note model+request_id", "note served_by", "note_usage",
         "prepare hook", "finish")
LINES = "lines (per line)"
SERVED_BY = "http://127.0.0.1:8001"


async def _steps_ns(requests: int) -> tuple[dict[str, float], list[str]]:
    """Each step's nanoseconds per request, once, and the lines made of the last step."""
    from skymesh.balancer.edge import request_id
    from skymesh.net.jsonbody import fast_usage
    from skymesh.net.lean_request import LeanRequest
    from skymesh.obs import access

    app = web.Application()
    access._installed = False  # as a daemon starts: install() sets it
    access.install(app, access_log=True, request_id=request_id)
    log = access.outside_chain(app)
    assert log is not None and log.writer is not None
    writer = log.writer
    for cb in app.on_startup:
        await cb(app)
    decoded = fast_usage(BODY)
    # What the lean server makes per request (no connection behind it: not read here).
    nothing: Any = None
    reqs: list[Any] = [
        LeanRequest(app, "POST", "/v1/chat/completions",
                    CIMultiDictProxy(CIMultiDict({"X-Request-Id": f"req-{i}"})),
                    HttpVersion11, True, nothing, nothing, nothing, "127.0.0.1", None)
        for i in range(requests)]
    rids = [request_id(r) for r in reqs]  # the balancer's own, log or not
    resps = [web.Response(body=BODY) for _ in range(requests)]
    recs: list[Any] = [None] * requests
    # The prepare hook: a module function before session 29, then the log's method.
    hook = getattr(access, "_watch_body", None) or log.watch_body
    note, note_usage = access.note, access.note_usage
    took: dict[str, float] = {}
    clock = time.thread_time_ns

    def timed(step: str, each: Callable[[int], Any]) -> None:
        start = clock()
        for i in range(requests):
            each(i)
        took[step] = (clock() - start) / requests

    def begin(i: int) -> None:
        recs[i] = log.begin(reqs[i])

    timed("begin", begin)
    # The balancer's calls as each build has them (positional ones where it has them).
    note_model = getattr(access, "note_model", None)
    note_target = getattr(access, "note_target", None)
    if note_model is not None and note_target is not None:
        timed("note model+request_id", lambda i: note_model(reqs[i], "stub", rids[i]))
        timed("note served_by", lambda i: note_target(reqs[i], SERVED_BY, False))
    else:
        timed("note model+request_id",
              lambda i: note(reqs[i], model="stub", request_id=rids[i]))
        timed("note served_by", lambda i: note(reqs[i], served_by=SERVED_BY, peer=False))
    timed("note_usage", lambda i: note_usage(reqs[i], decoded))
    start = clock()
    if getattr(hook, "skymesh_streams_only", False):  # skymesh.net.prepare_hooks.streams_only
        took["prepare hook"] = 0.0  # the lean server does not call it for a whole reply
    else:
        for i in range(requests):  # awaited as the lean server awaits it
            await hook(reqs[i], resps[i])
        took["prepare hook"] = (clock() - start) / requests
    # The request's end with a batch open, as in a busy daemon: the record joins it.
    # The batch is emptied here rather than made into lines (the next step times those).
    flush = writer.flush
    writer.flush = lambda: None  # type: ignore[method-assign]
    ended: list[Any] = []
    opened: Any = (None, None, 0.0)  # an open batch's first entry (put() starts one)
    if hasattr(writer, "wall"):  # as put() sets it when it opens a batch
        writer.wall = time.time() - writer.clock()
    try:
        writer.pending[:] = [opened]

        def finish(i: int) -> None:
            log.finish(reqs[i], recs[i], resps[i], 200)
            if len(writer.pending) >= access.BATCH:
                ended.extend(writer.pending[1:])
                writer.pending[:] = [opened]

        timed("finish", finish)
        ended.extend(writer.pending[1:])
    finally:
        writer.pending.clear()
        writer.flush = flush  # type: ignore[method-assign]
    handler = writer._handler or access.direct_handler(writer.log)
    assert handler is not None
    lines: list[str] = []
    start = clock()
    for k in range(0, len(ended), access.BATCH):
        lines.extend(writer._lines(handler, ended[k:k + access.BATCH]))
    took[LINES] = (clock() - start) / max(1, len(ended))
    for cb in app.on_cleanup:
        await cb(app)
    return took, lines


def measure(requests: int, repeats: int) -> dict[str, Any]:
    """The best of ``repeats`` per step, in microseconds per request, and their sum for
    the request's own part (the steps but the lines)."""
    from skymesh.obs.logs import ACCESS_LOGGER, setup_logging

    best: dict[str, float] = {}
    lines: list[str] = []
    root, access_log = logging.getLogger(), logging.getLogger(ACCESS_LOGGER)
    handlers, level, access_level = list(root.handlers), root.level, access_log.level
    try:
        with open(os.devnull, "w") as sink:
            # The daemons' set-up alone (no other handler on the way: the lines are made
            # straight from the records, as in a daemon).
            root.handlers[:] = [setup_logging("warning", "text", stream=sink)]
            for _ in range(repeats):
                took, lines = asyncio.run(_steps_ns(requests))
                for step, ns in took.items():
                    best[step] = min(best.get(step, ns), ns)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        access_log.setLevel(access_level)
    us = {step: round(ns / 1e3, 3) for step, ns in best.items()}
    return {"requests": requests, "repeats": repeats, "best_us": us,
            "request_part_us": round(sum(us[s] for s in STEPS), 3),
            "lines": len(lines), "last_line": lines[-1].rstrip("\n") if lines else ""}


def main(argv: list[str] | None = None) -> int:
    return cli("skymesh_lab.bench.access_log_steps", __doc__, measure, 9, argv)


if __name__ == "__main__":
    sys.exit(main())
