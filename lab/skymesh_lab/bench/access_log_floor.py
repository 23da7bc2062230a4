"""The least an access log in Python can do for a request, patched into a live skymesh-lb.

``access_log_cost --ablate floor`` (:mod:`skymesh_lab.bench.access_log_ablate`) runs a
daemon whose access log is replaced by this: the same line for a whole reply served
with its usage (``METHOD PATH STATUS request_id=... client=...``, text format), written
the same way (the loop's batches, its sink or the writer thread), and nothing else. It
tells what the 5% aimed at by issue #35 asks of the request path: if even this costs
more live, the goal is out of reach for a log made in Python on the loop.

Per request: a list made as the request starts (its start, then what the balancer's
notes store by position), one tuple appended to the batch at its end; per batch, one
f-string per line and one write. What it leaves out, and the full log keeps: streams
(no prepare hook: their first byte and usage), disconnects and failed requests (their
status and lines), tenants, tracing, the JSON format, lines through ``logging`` for
other handlers, the backlog's drops. Lab only: it patches the revision the bench runs
(``skymesh.net.front``, ``skymesh.obs.access``) and follows that code.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

LINGER_S = 0.02  # the full log's: a batch waits this long or for BATCH lines
BATCH = 64
# The record's positions: the request's start, then the notes'.
START, MODEL, REQUEST_ID, SERVED_BY, PEER, USAGE = range(6)


def apply(notes: bool = True, lines: bool = True) -> None:
    """Replace this process's access log with the floor's (see the module). Its parts,
    to tell what each costs live: ``notes`` off, the balancer's notes return at once
    (the line prints what the record then holds); ``lines`` off, each batch is dropped
    when it would be made and written."""
    from skymesh.net import front
    from skymesh.obs import access
    from skymesh.obs.logs import MILLIS, direct_handler

    # A key of its own: the full log's readers (tracing's) find no record under theirs.
    key = "skymesh_lab.access_log_floor"
    made = front.request_handler
    plain_install = access.install

    def install(app: Any, **kwargs: Any) -> None:
        plain_install(app, **kwargs)
        log = app.get(access._ACCESS_KEY)  # no streams here: no hook
        if log is not None and log.watch_body in app.on_response_prepare:
            app.on_response_prepare.remove(log.watch_body)

    def note_model(request: Any, model: str, request_id: str | None) -> None:
        if notes and access._installed and (rec := request._state.get(key)) is not None:
            rec[MODEL] = model
            rec[REQUEST_ID] = request_id

    def note_target(request: Any, served_by: str, peer: bool) -> None:
        if notes and access._installed and (rec := request._state.get(key)) is not None:
            rec[SERVED_BY] = served_by
            rec[PEER] = peer

    def note_usage(request: Any, usage: Any) -> None:
        if notes and access._installed and (rec := request._state.get(key)) is not None:
            rec[USAGE] = usage

    def request_handler(app: Any, handle: Any, routes: Any, log: Any) -> Any:
        if log is None or log.writer is None:
            return made(app, handle, routes, log)
        batch = _Batch(log.writer, direct_handler, MILLIS, lines)
        clock = log.clock
        # What front's handler without the log calls (its closure's ``route``), in one
        # frame with the record around it: the floor adds no coroutine frame.
        plain = made(app, handle, routes, None)
        cells = plain.__closure__ or ()
        route = cells[plain.__code__.co_freevars.index("route")].cell_contents
        mark_started = front.mark_started

        async def floor_front(request: Any) -> Any:
            conn = mark_started(request)
            rec = [clock(), None, None, None, False, None]
            request._state[key] = rec
            try:
                resp = await route(request)
            finally:
                if conn is not None:
                    conn.request_finished()
            batch.add((rec, resp._status, clock(), request.method, request.path,
                       request.remote))
            return resp

        return floor_front

    front.request_handler = request_handler
    access.install = install
    access.note_model = note_model
    access.note_target = note_target
    access.note_usage = note_usage


class _Batch:
    """The loop's open batch of finished requests, and its lines made and written."""

    def __init__(self, writer: Any, direct_handler: Any, millis: Any,
                 lines: bool = True) -> None:
        self.writer = writer
        self.lines = lines
        self.direct_handler = direct_handler
        self.millis = millis
        self.items: list[tuple[Any, ...]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.wall = 0.0
        self.handler: Any = None

    def add(self, item: tuple[Any, ...]) -> None:
        items = self.items
        if not items:
            self.handler = self.direct_handler(self.writer.log)
            self.wall = time.time() - self.writer.clock()
            self.timer = asyncio.get_running_loop().call_later(LINGER_S, self.flush)
        items.append(item)
        if len(items) >= BATCH:
            self.flush()

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        items, self.items = self.items, []
        handler = self.handler
        if not items or handler is None or not self.lines:
            return
        fmt, millis, wall = handler.formatter, self.millis, self.wall
        second, stamp = -1, ""
        lines = []
        for rec, code, end, method, path, client in items:
            start, model, rid, served_by, peer, usage = rec
            created = end + wall
            if int(created) != second:
                second = int(created)
                stamp = fmt.second_text(created)
            ms = (end - start) * 1e3
            lines.append(
                f"{stamp}{millis[int((created - second) * 1000)]} INFO skymesh.access: "
                f"{method} {path} {code} request_id={rid} model={model} "
                f"served_by={served_by} via={'peer' if peer else 'replica'} "
                f"ttft_ms={ms:.3f} duration_ms={ms:.3f} "
                f"prompt_tokens={usage and usage['prompt_tokens']} "
                f"completion_tokens={usage and usage['completion_tokens']} client={client}\n")
        text = "".join(lines)
        writer = self.writer
        sink = writer._sink
        if sink is not None and handler is writer._sink_handler:
            sink.write(text.encode(), len(items))
        else:
            writer._queue.put((handler, text))
