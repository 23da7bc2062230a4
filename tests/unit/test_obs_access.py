"""The access log of skymesh.obs.access on a small aiohttp app served over loopback.

The app's handlers play the balancer's part (they :func:`note` the model and replica and
answer like a replica would); a fake clock they advance gives exact TTFT and duration.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import re
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support import eventually, wait_for

from skymesh.net.jsonbody import NOT_DECODED, fast_usage
from skymesh.net.limits import ConnLimits
from skymesh.net.serving import start_app
from skymesh.obs.access import (
    _ACCESS_KEY,
    BATCH,
    RECORD_KEY,
    AccessRecord,
    AccessWriter,
    _Access,
    inject_trace,
    install,
    ms_text,
    note,
    note_model,
    note_target,
    note_usage,
    upstream_span,
    usage_tokens,
)
from skymesh.obs.logs import (
    ACCESS_LOGGER,
    JsonFormatter,
    batched_writes,
    direct_handler,
    setup_logging,
)

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def fields(self) -> list[dict[str, Any]]:
        keys = ("request_id", "method", "path", "model", "served_by", "via", "status",
                "ttft_ms", "duration_ms", "prompt_tokens", "completion_tokens", "client",
                "disconnected")
        return [{k: getattr(r, k) for k in keys if hasattr(r, k)} for r in self.records]


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root, access = logging.getLogger(), logging.getLogger(ACCESS_LOGGER)
    handlers, level, access_level = list(root.handlers), root.level, access.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    access.setLevel(access_level)


def daemon_logging(fmt: str, stream: io.StringIO) -> None:
    """The daemons' logging set-up to ``stream``, with no other handler on the way (not
    pytest's log capture either: with it, the access lines would go through ``logging``
    and never be made straight from the records). Under ``restore_logging``."""
    ours = setup_logging("warning", fmt, stream=stream)  # type: ignore[arg-type]
    logging.getLogger().handlers[:] = [ours]


@pytest.fixture
def records() -> Iterator[Records]:
    logger = logging.getLogger(ACCESS_LOGGER)
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def build(clock: FakeClock, hang: asyncio.Event) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        # As the balancer notes them: the model with the request's id, when it has one.
        note_model(request, body["model"], body.get("id"))
        if body.get("tenant"):
            note(request, tenant="acme", priority="batch")
        if body.get("bad"):
            clock.t += 0.01
            raise web.HTTPBadRequest(text="a bad request")
        note_target(request, "http://10.0.0.1:8000", False)  # a first attempt failed
        note(request, served_by="http://10.0.0.2:8000")  # over: the last one is logged
        clock.t += 0.2  # queueing and the replica's prefill
        if body.get("wait"):
            await hang.wait()  # the client leaves before any response
        if not body.get("stream"):
            clock.t += 0.3
            reply = web.json_response({"model": body["model"], "usage": USAGE,
                                       "choices": [{"message": {"content": '"usage": 1'}}]})
            if body.get("noted"):  # the balancer hands the log the usage it decoded
                assert isinstance(reply.body, bytes)
                note_usage(request, fast_usage(reply.body))
            return reply
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        clock.t += 0.1  # headers out, the first token comes later
        await resp.write(sse({"choices": [{"delta": {"content": "hi"}}]}))
        clock.t += 1.0
        if body.get("hang"):
            await hang.wait()  # the client leaves here
        await resp.write(sse({"choices": [{"delta": {"content": " there"}}]}))
        if body.get("stream_options", {}).get("include_usage"):
            tail = sse({"choices": [], "usage": USAGE})
            await resp.write(tail[:25])  # the usage event split over two writes
            await resp.write(tail[25:])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def boom(request: web.Request) -> web.Response:
        clock.t += 0.05
        raise RuntimeError("a bug")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/boom", boom)
    install(app, clock=clock)
    return app


@pytest.fixture(params=["middleware", "around_app", "lean"])
async def served(request: pytest.FixtureRequest
                 ) -> AsyncIterator[tuple[str, FakeClock, asyncio.Event]]:
    """The app served by a plain runner (the log is a middleware), or as the daemons
    serve theirs (skymesh.net.serving: the log wraps the server's handler instead), on
    aiohttp's server or the lean one (``listen.http_server: lean``)."""
    clock, hang = FakeClock(), asyncio.Event()
    app = build(clock, hang)
    if request.param == "middleware":
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    else:
        runner, _ = await start_app(app, "127.0.0.1", 0, "test", ConnLimits(),
                                    http_server="lean" if request.param == "lean"
                                    else "aiohttp")
        assert not app.middlewares  # no chain left to run
        port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", clock, hang
    hang.set()
    await runner.cleanup()


async def test_a_whole_reply_logs_model_replica_status_times_and_usage(
        served: tuple[str, FakeClock, asyncio.Event], records: Records) -> None:
    url, _, _ = served
    async with aiohttp.ClientSession() as s, s.post(
            url + "/v1/chat/completions", json={"model": "m1", "messages": []},
            headers={"X-Request-Id": "req-1"}) as r:
        assert r.status == 200
        await r.read()
    await eventually(lambda: bool(records.records), "the access line")
    (line,) = records.fields()
    assert line == {"request_id": "req-1", "method": "POST", "path": "/v1/chat/completions",
                    "model": "m1", "served_by": "http://10.0.0.2:8000", "via": "replica",
                    "status": 200, "ttft_ms": 500.0, "duration_ms": 500.0,
                    "prompt_tokens": 7, "completion_tokens": 3, "client": "127.0.0.1"}
    assert records.records[0].getMessage().startswith("POST /v1/chat/completions 200 ")
    assert "served_by=http://10.0.0.2:8000" in records.records[0].getMessage()


@pytest.mark.parametrize(("include_usage", "tokens"), [(True, (7, 3)), (False, (None, None))])
async def test_a_stream_logs_time_to_its_first_body_byte_and_its_usage_event(
        served: tuple[str, FakeClock, asyncio.Event], records: Records,
        include_usage: bool, tokens: tuple[int | None, int | None]) -> None:
    url, _, _ = served
    body = {"model": "m1", "stream": True, "stream_options": {"include_usage": include_usage}}
    async with aiohttp.ClientSession() as s, \
            s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        text = (await r.read()).decode()
    assert text.endswith("data: [DONE]\n\n")
    await eventually(lambda: bool(records.records), "the access line")
    (line,) = records.fields()
    # prepare at +0.2 s, the first chunk at +0.3 s, the end at +1.3 s
    assert (line["ttft_ms"], line["duration_ms"]) == (300.0, 1300.0)
    assert (line["prompt_tokens"], line["completion_tokens"]) == tokens
    assert line["request_id"] is None  # the client sent none, and this app makes none


async def test_errors_and_unknown_routes_get_a_line_with_their_status(
        served: tuple[str, FakeClock, asyncio.Event], records: Records) -> None:
    url, _, _ = served
    async with aiohttp.ClientSession() as s:
        for path, status in (("/boom", 500), ("/nowhere", 404)):
            async with s.get(url + path) as r:
                assert r.status == status
    await eventually(lambda: len(records.records) == 2, "two access lines")
    boom, nowhere = records.fields()
    assert (boom["path"], boom["status"], boom["duration_ms"]) == ("/boom", 500, 50.0)
    assert (nowhere["status"], nowhere["model"], nowhere["prompt_tokens"]) == (404, None, None)


async def test_a_client_that_leaves_mid_stream_is_logged_as_disconnected(
        served: tuple[str, FakeClock, asyncio.Event], records: Records) -> None:
    url, _, _ = served
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + "/v1/chat/completions",
                         json={"model": "m1", "stream": True, "hang": True})
        await r.content.readuntil(b"\n\n")  # the first event is here: leave
        r.close()
    await eventually(lambda: bool(records.records), "the access line of the cancelled request")
    (line,) = records.fields()
    assert (line["status"], line["disconnected"], line["ttft_ms"]) == (200, True, 300.0)


async def test_a_client_that_leaves_before_any_response_is_logged_as_499(
        served: tuple[str, FakeClock, asyncio.Event], records: Records) -> None:
    url, _, _ = served
    async with aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            await s.post(url + "/v1/chat/completions", json={"model": "m1", "wait": True},
                         timeout=aiohttp.ClientTimeout(total=0.2))
    await eventually(lambda: bool(records.records), "the access line of the cancelled request")
    (line,) = records.fields()
    assert (line["status"], line["disconnected"], line["model"]) == (499, True, "m1")
    assert line["ttft_ms"] is None


def test_nothing_is_installed_when_both_are_off() -> None:
    app = web.Application()
    install(app, access_log=False, tracing=None)
    assert not app.middlewares and not app.on_response_prepare


def usage_event(usage: Any) -> bytes:
    return sse({"choices": [], "usage": usage})


@pytest.mark.parametrize(("body", "expected"), [
    (json.dumps({"usage": USAGE}).encode(), (7, 3)),
    (b'{"usage":{"prompt_tokens":5}}', (5, None)),
    # vLLM's chunks carry "usage": null until the last one
    (usage_event(None) + usage_event({"prompt_tokens": 2, "completion_tokens": 9})
     + b"data: [DONE]\n\n", (2, 9)),
    (usage_event({"prompt_tokens": 2, "completion_tokens": 9}) + usage_event(None), (2, 9)),
    # generated text that spells a usage object is inside a string: escaped quotes
    (json.dumps({"choices": [{"text": '"usage": {"prompt_tokens": 99}'}]}).encode(),
     (None, None)),
    (b'data: {"choices": [], "usage": {"prompt_tok', (None, None)),  # cut short
    (b"", (None, None)),
    # the engines' own shapes (read without the decoder), and others (with it)
    (b'{"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}', (8, 1)),
    (b'{"usage":{"prompt_tokens":8,"total_tokens":9,"completion_tokens":1,'
     b'"prompt_tokens_details":null}}', (8, 1)),
    (b'{"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9,'
     b'"prompt_tokens_details":{"cached_tokens":4}}}', (8, 1)),
    (b'{"usage":{"completion_tokens":1,"prompt_tokens":8}}', (8, 1)),
    (b'{"usage":{"prompt_tokens":08,"completion_tokens":1}}', (None, None)),  # not JSON
    # a reply's top-level usage (decoded alone by msgspec), else any usage object in it
    (b'{"usage":{"prompt_tokens":1,"completion_tokens":2},'
     b'"x":{"usage":{"prompt_tokens":3,"completion_tokens":4}}}', (1, 2)),
    (b'{"usage":null,"x":{"usage":{"prompt_tokens":3,"completion_tokens":4}}}', (3, 4)),
    (b'{"usage":{"prompt_tokens":"8","completion_tokens":1}}', (None, 1)),
    (b'{"usage":[1],"x":{"usage":{"prompt_tokens":3}}}', (3, None)),
    (b'{"usage":{}}', (None, None)),
])
def test_usage_tokens(body: bytes, expected: tuple[int | None, int | None]) -> None:
    assert usage_tokens(body) == expected
    # The balancer's own decode of the reply's usage, handed over: the same counts.
    assert usage_tokens(body, fast_usage(body)) == expected


def test_a_usage_the_balancer_noted_is_not_decoded_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The line takes a whole reply's counts from what the balancer decoded
    (note_usage), not from a second decode of the body."""
    from skymesh.obs import access

    body = json.dumps({"usage": USAGE}).encode()
    rec = finished(model="m", served_by="http://10.0.0.1:8000", via="replica")
    request = make_mocked_request("POST", "/v1/chat/completions")
    access._installed, installed = True, access._installed
    try:
        request[RECORD_KEY] = rec
        note_usage(request, fast_usage(body))
    finally:
        access._installed = installed
    decodes: list[bytes] = []
    monkeypatch.setattr(access, "fast_usage", lambda raw: decodes.append(raw) or None)
    fields = access.record_fields(rec, body)
    assert (fields["prompt_tokens"], fields["completion_tokens"]) == (7, 3)
    assert decodes == []
    rec.usage = NOT_DECODED  # nothing noted (a stream, a peer's reply): the body is read
    assert access.record_fields(rec, body)["prompt_tokens"] == 7
    assert decodes == [body]


@pytest.mark.parametrize("body", [
    json.dumps({"model": "m", "usage": USAGE}).encode(),
    b'{"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}',
    b'{"usage":{"prompt_tokens":"8","completion_tokens":1}}',
    b'{"usage":null}',
    b'{"choices":[]}',
])
def test_usage_tokens_reads_the_same_without_msgspec(
        monkeypatch: pytest.MonkeyPatch, body: bytes) -> None:
    from skymesh.net import jsonbody

    with_msgspec = usage_tokens(body)
    monkeypatch.setattr(jsonbody, "_FAST_USAGE", None)  # the lean core (no fast extra)
    assert usage_tokens(body) == with_msgspec


async def test_the_json_line_has_every_field(
        served: tuple[str, FakeClock, asyncio.Event], records: Records) -> None:
    url, _, _ = served
    async with aiohttp.ClientSession() as s, s.post(
            url + "/v1/chat/completions", json={"model": "m1"},
            headers={"X-Request-Id": "abc"}) as r:
        await r.read()
    await eventually(lambda: bool(records.records), "the access line")
    line = json.loads(JsonFormatter().format(records.records[0]))
    assert line["logger"] == "skymesh.access" and line["level"] == "INFO"
    assert line["msg"].startswith("POST /v1/chat/completions 200 request_id=abc model=m1 ")
    assert {k: line[k] for k in ("request_id", "model", "via", "status", "ttft_ms",
                                 "prompt_tokens", "completion_tokens", "client")} == {
        "request_id": "abc", "model": "m1", "via": "replica", "status": 200,
        "ttft_ms": 500.0, "prompt_tokens": 7, "completion_tokens": 3, "client": "127.0.0.1"}


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


@pytest.mark.usefixtures("restore_logging")
def test_the_writer_thread_writes_every_line_in_order_in_batches() -> None:
    out = CountingStream()
    daemon_logging("text", out)
    writer = AccessWriter(logging.getLogger(ACCESS_LOGGER), linger_s=0.0)
    fields = [{"request_id": f"r{i}", "method": "GET", "path": "/health", "status": 200,
               "duration_ms": 1.5} for i in range(500)]
    assert not writer.put(fields[0], None)  # not started: the caller makes the line
    writer.start()
    try:
        for f in fields:
            assert writer.put(f, None)
    finally:
        writer.stop()  # writes what is queued
    lines = out.getvalue().splitlines()
    assert [line.split("request_id=")[1].split()[0] for line in lines] == [
        f"r{i}" for i in range(500)]
    assert lines[0].endswith("INFO skymesh.access: GET /health 200 request_id=r0 "
                             "duration_ms=1.5")
    assert out.writes < 500  # lines leave in batches, not one write each


def test_a_writer_that_is_behind_hands_the_line_back() -> None:
    writer = AccessWriter(logging.getLogger(ACCESS_LOGGER), max_backlog=0)
    writer.start()
    try:
        assert not writer.put({"method": "GET", "path": "/", "status": 200}, None)
    finally:
        writer.stop()


@pytest.mark.usefixtures("restore_logging")
def test_batched_json_lines_keep_their_format() -> None:
    out = io.StringIO()
    setup_logging("warning", "json", stream=out)
    with batched_writes():
        logging.getLogger(ACCESS_LOGGER).info("GET / 200", extra={"status": 200})
        assert out.getvalue() == ""  # held until the block ends
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line["msg"] == "GET / 200" and line["status"] == 200
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])


@pytest.mark.usefixtures("no_cyclic_gc")
async def test_a_logged_stream_is_freed_without_the_cyclic_gc(records: Records) -> None:
    """The stream's wrapped write refers to its response: the record drops it at the end,
    or every stream (its request, its buffers) waits for a full collection, which a
    tuned daemon runs about once per several hundred thousand requests."""
    responses: list[weakref.ref[web.StreamResponse]] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        responses.append(weakref.ref(resp))
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/s", stream)
    install(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.get(f"http://127.0.0.1:{port}/s") as r:
                    assert await r.read() == b"data: 1\n\n"
        await eventually(lambda: len(records.records) == 3, "three access lines")
        await eventually(lambda: all(ref() is None for ref in responses),
                         "the responses freed by reference counting")
    finally:
        await runner.cleanup()


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_lines_made_without_log_records_are_the_formatters_own(fmt: str) -> None:
    """The writer formats the daemons' lines itself when only our handler would see them;
    with any other handler about it goes through logging: the lines are the same."""
    fields = {"request_id": "r1", "method": "POST", "path": "/v1/chat/completions",
              "model": "m\u00e9", "served_by": "http://10.0.0.1:8000", "via": "replica",
              "status": 200, "ttft_ms": 12.5, "duration_ms": 40.25, "prompt_tokens": None,
              "completion_tokens": None, "client": "127.0.0.1"}
    body = json.dumps({"usage": USAGE}).encode()
    created = 1795885290.0421
    access = logging.getLogger(ACCESS_LOGGER)
    outputs = []
    for extra_handler in (False, True):
        out = io.StringIO()
        daemon_logging(fmt, out)
        other = Records()
        if extra_handler:
            access.addHandler(other)
        try:
            AccessWriter(access).write_batch([(dict(fields), body, created)] * 2)
        finally:
            access.removeHandler(other)
        assert len(other.records) == (2 if extra_handler else 0)  # the path taken
        outputs.append(out.getvalue())
    direct, through_logging = outputs
    assert direct == through_logging
    assert "prompt_tokens=7 completion_tokens=3" in direct


def finished(**kw: Any) -> AccessRecord:
    """A record as the middleware hands it to the writer at a request's end."""
    rec = AccessRecord(100.0, kw.pop("request_id", "r1"))
    rec.method, rec.path, rec.code, rec.end = "POST", "/v1/chat/completions", 200, 100.04025
    rec.client, rec.first_byte_at = "127.0.0.1", 100.0125
    rec.prompt_tokens = rec.completion_tokens = None
    for key, value in kw.items():
        setattr(rec, key, value)
    return rec


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_lines_made_from_records_are_the_formatters_own(fmt: str) -> None:
    """The writer makes a text line straight from the request's record (no dict of
    fields): it must be the line logging makes from the fields, field for field."""
    body = json.dumps({"usage": USAGE}).encode()
    items = [
        (finished(model="m\u00e9", served_by="http://10.0.0.1:8000", via="replica"), body),
        (finished(), None),  # rejected before a model: no model, replica or usage
        (finished(request_id=None, client=None), b'{"usage": null}'),
        (finished(code=499, first_byte_at=None, disconnected=True), None),
        (finished(served_by="peer-eu", via="peer", code=503), None),
        # a whole body: its first byte leaves at its end (one decimal for both times)
        (finished(model="m", served_by="http://10.0.0.1:8000", via="replica",
                  first_byte_at=100.04025), body),
        (finished(model="m", served_by="http://10.0.0.1:8000", via="replica",
                  tenant="acme", priority="batch"), body),  # with tenants (docs/tenancy.md)
    ]
    created = 1795885290.0421
    access = logging.getLogger(ACCESS_LOGGER)
    outputs = []
    for extra_handler in (False, True):
        out = io.StringIO()
        daemon_logging(fmt, out)
        other = Records()
        if extra_handler:
            access.addHandler(other)
        try:
            AccessWriter(access).write_batch([(rec, b, created) for rec, b in items])
        finally:
            access.removeHandler(other)
        assert len(other.records) == (len(items) if extra_handler else 0)  # the path taken
        outputs.append(out.getvalue())
    direct, through_logging = outputs
    assert direct == through_logging
    lines = direct.splitlines()
    assert len(lines) == len(items)
    if fmt == "text":
        assert lines[0].endswith(
            "INFO skymesh.access: POST /v1/chat/completions 200 request_id=r1 model=m\u00e9 "
            "served_by=http://10.0.0.1:8000 via=replica ttft_ms=12.5 duration_ms=40.25 "
            "prompt_tokens=7 completion_tokens=3 client=127.0.0.1")
        assert lines[3].endswith("POST /v1/chat/completions 499 request_id=r1 "
                                 "duration_ms=40.25 client=127.0.0.1 disconnected=True")
        assert "ttft_ms=40.25 duration_ms=40.25 prompt_tokens=7" in lines[5]
        assert lines[6].endswith("client=127.0.0.1 tenant=acme priority=batch")


def test_the_writer_thread_is_named_for_top() -> None:
    """``top -H`` and /proc show the writer's CPU apart from the loop's (the access-log
    cost benchmark reads it there)."""
    writer = AccessWriter(logging.getLogger(ACCESS_LOGGER))
    writer.start()
    try:
        assert writer._thread is not None and writer._thread.native_id is not None
        comm = f"/proc/self/task/{writer._thread.native_id}/comm"
        if not Path(comm).exists():
            pytest.skip("no /proc")
        wait_for(lambda: Path(comm).read_text().strip() == "skymesh-access",
                 "the writer thread named")
    finally:
        writer.stop()


@pytest.mark.usefixtures("restore_logging")
async def test_on_the_loop_lines_are_made_in_batches_and_the_thread_writes_them() -> None:
    """The daemons' set-up: the loop makes a batch's lines at once (BATCH of them, or
    what gathered in ``linger_s``) and the thread writes each batch with one write."""
    out = CountingStream()
    daemon_logging("text", out)
    writer = AccessWriter(logging.getLogger(ACCESS_LOGGER), linger_s=0.0)
    writer.start()
    total = BATCH + 5
    try:
        for i in range(total):
            assert writer.put(finished(request_id=f"r{i}"), None)
        await eventually(lambda: len(out.getvalue().splitlines()) == total, "every line")
        assert writer.put(finished(request_id="last"), None)
    finally:
        writer.stop()  # the loop's pending batch too
    lines = out.getvalue().splitlines()
    assert [line.split("request_id=")[1].split()[0] for line in lines] == [
        *(f"r{i}" for i in range(total)), "last"]
    assert out.writes <= 3  # a full batch, the rest after the linger, the last at stop


@pytest.mark.usefixtures("restore_logging")
async def test_a_loop_batch_is_refused_when_the_thread_is_that_far_behind() -> None:
    out = io.StringIO()
    daemon_logging("text", out)
    writer = AccessWriter(logging.getLogger(ACCESS_LOGGER), max_backlog=0)
    writer.start()
    try:
        assert not writer.put(finished(), None)  # the middleware then makes it itself
    finally:
        writer.stop()
    assert out.getvalue() == ""


@settings(max_examples=2000, deadline=None)
@given(st.floats() | st.floats(min_value=-1e3, max_value=1e3)
       | st.floats(min_value=0, max_value=1e-2))
@example(0.0)
@example(-0.0)
@example(5e-7)  # 0.0005 ms: half-way, rounded as the binary value lies
@example(2.675e-3)
@example(1e9 + 0.5)  # the slow path's edge
@example(1e4 - 1e-9)  # just under the whole-microsecond path's edge, and at it
@example(1e4)
@example(0.0625e-3)  # 62.5 us: an exact half, rounded to even (0.062)
@example(0.0635e-3)
@example(2.0005e-3)  # near a half once scaled: the decimal conversion decides
@example(0.9999999e-3)  # rounds up to the next whole millisecond (1.0)
def test_a_time_in_a_line_is_the_repr_of_its_rounded_milliseconds(seconds: float) -> None:
    """Lines stay byte for byte what ``round(ms, 3)`` gave (ms_text is the fast form)."""
    assert ms_text(seconds) == repr(round(seconds * 1e3, 3))


def test_times_near_a_half_microsecond_read_as_round_gives_them() -> None:
    """Every exact half and its neighbours, where the whole-microsecond path must hand
    over to the decimal conversion (the property test above rarely lands there)."""
    for micros in range(0, 2_000_000, 31):
        for seconds in ((micros + 0.5) / 1e6, micros / 1e6, math.nextafter(
                (micros + 0.5) / 1e6, 0.0), math.nextafter((micros + 0.5) / 1e6, 1.0),
                (micros + 0.5) / 2**20):
            assert ms_text(seconds) == repr(round(seconds * 1e3, 3)), seconds


def test_notes_on_an_app_without_the_access_log_do_nothing() -> None:
    from aiohttp.test_utils import make_mocked_request

    install(web.Application())  # another app of the process has it
    request = make_mocked_request("POST", "/v1/chat/completions", app=web.Application())
    note(request, model="m1", served_by="http://10.0.0.1:8000", left=True)
    note_model(request, "m1", "r1")
    note_target(request, "http://10.0.0.1:8000", False)
    assert RECORD_KEY not in request
    headers: dict[str, str] = {}
    inject_trace(request, headers)
    with upstream_span(request, "http://10.0.0.1:8000"):
        pass
    assert headers == {}


def test_the_positional_notes_set_what_note_sets() -> None:
    """``note_model`` and ``note_target`` (the balancer's calls on every request) leave a
    record as ``note`` with the same values does: a replica's or a peer's."""
    from aiohttp.test_utils import make_mocked_request

    app = web.Application()
    install(app)
    access = app[_ACCESS_KEY]
    for peer in (False, True):
        by_keywords = make_mocked_request("POST", "/v1/chat/completions", app=app)
        positional = make_mocked_request("POST", "/v1/chat/completions", app=app)
        recs = [access.begin(by_keywords), access.begin(positional)]
        note(by_keywords, model="m1", request_id="r1")
        note(by_keywords, served_by="http://10.0.0.1:8000", peer=peer)
        note_model(positional, "m1", "r1")
        note_target(positional, "http://10.0.0.1:8000", peer)
        assert [(r.model, r.request_id, r.served_by, r.via) for r in recs] == [
            ("m1", "r1", "http://10.0.0.1:8000", "peer" if peer else "replica")] * 2


class StuckSink(io.StringIO):
    """A log stream whose writes block until ``release`` is set (a full pipe, a paused
    log shipper)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.blocked = threading.Event()

    def write(self, text: str) -> int:
        self.blocked.set()
        self.release.wait()
        return super().write(text)


def _access_with(max_backlog: int) -> _Access:
    access = _Access(logging.getLogger(ACCESS_LOGGER), None, lambda r: None, FakeClock())
    assert access.writer is not None
    access.writer.max_backlog = max_backlog
    return access


@pytest.mark.usefixtures("restore_logging")
async def test_a_line_past_the_backlog_is_dropped_and_counted_not_made_on_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a line the thread was too far behind for was made on the loop, where
    a stuck sink (whose lock the thread holds in its blocked write) stopped the loop."""
    out = io.StringIO()
    daemon_logging("text", out)
    access = _access_with(0)
    writer = access.writer
    assert writer is not None
    made_on_loop: list[Any] = []
    monkeypatch.setattr(writer, "emit", lambda *a: made_on_loop.append(a))
    writer.start()
    try:
        access._write(finished(), None)
        await asyncio.sleep(0)  # one loop turn: what call_soon scheduled has run
        assert made_on_loop == []
        assert writer.dropped == 1
    finally:
        writer.stop()
    assert "access log: 1 line(s) dropped, the log sink was 0 lines behind" in out.getvalue()


def _balancer_access(backlog: int) -> _Access:
    """The balancer's access log, its backlog set by ``logging.access_log_backlog``."""
    from skymesh.balancer.config import parse_config
    from skymesh.balancer.server import build_app

    app = build_app(parse_config({"logging": {"access_log_backlog": backlog}}))
    access: _Access = app[_ACCESS_KEY]
    return access


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("make", [_access_with, _balancer_access], ids=["set", "config"])
async def test_a_stuck_sink_bounds_the_backlog_and_drops_the_rest(
        make: Callable[[int], _Access]) -> None:
    """With ``config``: the balancer's key reaches its writer (before, the backlog was
    4,096 whatever the config said)."""
    sink = StuckSink()
    setup_logging("warning", "text", stream=sink)  # type: ignore[arg-type]
    access = make(2 * BATCH)
    writer = access.writer
    assert writer is not None and writer.max_backlog == 2 * BATCH
    writer.start()
    try:
        for _ in range(BATCH):  # a first batch: the thread takes it and blocks writing it
            access._write(finished(), None)
        writer.flush()
        wait_for(sink.blocked.is_set, "the thread blocked in its write", timeout=10)
        sent = 20 * BATCH
        for _ in range(sent):  # all in this loop turn: nothing here may wait on the sink
            access._write(finished(), None)
        writer.flush()
        # Bounded: batches of lines (our handler alone) or single lines (pytest's own
        # handler on the way), never more entries than the backlog allows.
        assert writer._queue.qsize() <= writer.max_backlog
        assert writer.dropped > sent - writer.max_backlog - BATCH
    finally:
        sink.release.set()
        await asyncio.to_thread(writer.stop)
    lines = sink.getvalue().splitlines()
    logged = [line for line in lines if "skymesh.access:" in line]
    assert len(logged) + writer.dropped == BATCH + sent  # each line written or counted
    assert f"access log: {writer.dropped} line(s) dropped" in sink.getvalue()


async def test_the_dropped_lines_are_a_prometheus_counter_on_the_apps_registry() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from skymesh.net.serving import METRICS_REGISTRY

    app = web.Application()
    registry = CollectorRegistry()
    app[METRICS_REGISTRY] = registry
    install(app)
    runner, _ = await start_app(app, "127.0.0.1", 0, "test", ConnLimits())
    try:
        writer = app[_ACCESS_KEY].writer
        assert writer is not None
        writer.dropped = 3
        assert b"skymesh_access_log_dropped_total 3.0" in generate_latest(registry)
    finally:
        await runner.cleanup()


class FakeWallClock:
    """``time`` for skymesh.obs.access: each line's wall-clock time 0.4 s after the last
    (lines cross whole seconds), the same in every run."""

    def __init__(self) -> None:
        self.t = 1795885289.0421

    def time(self) -> float:
        self.t += 0.4
        return self.t

    @staticmethod
    def sleep(seconds: float) -> None:
        import time

        time.sleep(seconds)


async def _log_requests(url: str, out: io.StringIO) -> None:
    """One of each kind of request, one at a time, each line awaited before the next:
    whole replies with their usage noted or read from the body (one with tenant fields),
    a 400, a 404, a 500, a stream with its usage event, a client gone mid-stream and one
    gone before any response."""
    whole = {"model": "m\u00e9", "messages": []}
    requests: list[tuple[str, dict[str, Any] | None]] = [
        ("/v1/chat/completions", {**whole, "noted": True, "id": "req-1"}),
        ("/v1/chat/completions", whole),
        ("/v1/chat/completions", {**whole, "noted": True, "tenant": True, "id": "req-3"}),
        ("/v1/chat/completions", {**whole, "bad": True}),
        ("/nowhere", None),
        ("/boom", None),
        ("/v1/chat/completions", {**whole, "stream": True,
                                  "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {**whole, "stream": True, "hang": True}),
        ("/v1/chat/completions", {**whole, "wait": True}),
    ]
    async with aiohttp.ClientSession() as s:
        for i, (path, body) in enumerate(requests, 1):
            if body is None:
                async with s.get(url + path) as r:
                    await r.read()
            elif body.get("hang"):
                r = await s.post(url + path, json=body)
                await r.content.readuntil(b"\n\n")  # the first event is here: leave
                r.close()
            elif body.get("wait"):
                with pytest.raises(asyncio.TimeoutError):
                    await s.post(url + path, json=body,
                                 timeout=aiohttp.ClientTimeout(total=0.2))
            else:
                async with s.post(url + path, json=body,
                                  headers={"X-Request-Id": f"hdr-{i}"}) as r:
                    await r.read()
            await eventually(lambda n=i: len(_access_lines(out)) == n,  # type: ignore[misc]
                             f"access line {i}")


def _access_lines(out: io.StringIO) -> list[str]:
    """The access lines in ``out`` (aiohttp logs the 500's traceback there too)."""
    return [line for line in out.getvalue().splitlines() if ACCESS_LOGGER in line]


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_the_lines_of_served_requests_are_the_formatters_own_byte_for_byte(
        served: tuple[str, FakeClock, asyncio.Event], fmt: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemons' lines, made straight from the requests' records in batches, are byte
    for byte what ``logging`` and the formatter make from the fields (the path taken
    when any other handler sees the access log): the same requests, the same clocks,
    each way."""
    from skymesh.obs import access

    url, clock, _ = served
    access_log = logging.getLogger(ACCESS_LOGGER)
    outputs = []
    for through_logging in (False, True):
        clock.t = 100.0
        monkeypatch.setattr(access, "time", FakeWallClock())
        out = io.StringIO()
        daemon_logging(fmt, out)
        other = Records()
        if through_logging:
            access_log.addHandler(other)
        assert (direct_handler(access_log) is None) == through_logging  # the path taken
        try:
            await _log_requests(url, out)
        finally:
            access_log.removeHandler(other)
        assert len(other.records) == (9 if through_logging else 0)
        outputs.append(_access_lines(out))
    direct, logged = outputs
    assert direct == logged
    lines = direct
    if fmt == "text":
        assert lines[0].endswith(
            "INFO skymesh.access: POST /v1/chat/completions 200 request_id=req-1 "
            "model=m\u00e9 served_by=http://10.0.0.2:8000 via=replica ttft_ms=500.0 "
            "duration_ms=500.0 prompt_tokens=7 completion_tokens=3 client=127.0.0.1")
        assert lines[1].split(" 200 ")[1].startswith("request_id=hdr-2 ")
        assert lines[2].endswith("client=127.0.0.1 tenant=acme priority=batch")
        assert " 400 " in lines[3] and " 404 " in lines[4] and " 500 " in lines[5]
        assert "ttft_ms=300.0 duration_ms=1300.0 prompt_tokens=7" in lines[6]
        assert lines[7].endswith("disconnected=True")
        assert " 499 " in lines[8] and lines[8].endswith("disconnected=True")
        assert lines[0][:19] != lines[3][:19]  # the lines cross whole seconds


class StoppedWallClock(FakeWallClock):
    """``time`` for skymesh.obs.access whose wall clock stands still: a line's time can
    then come only from the log's own clock."""

    def time(self) -> float:
        return self.t


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_each_line_of_a_batch_is_stamped_with_its_requests_end(
        fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's lines carry their requests' ends on the wall clock: the log's clock at
    each end plus the wall clock's offset from it, taken as the batch opened (the wall
    clock is not read per request)."""
    from aiohttp.test_utils import make_mocked_request

    from skymesh.obs import access as module
    from skymesh.obs.logs import TextFormatter

    wall = StoppedWallClock()
    monkeypatch.setattr(module, "time", wall)
    monkeypatch.setattr(module, "_installed", True)
    out = io.StringIO()
    daemon_logging(fmt, out)
    clock = FakeClock()
    access = _Access(logging.getLogger(ACCESS_LOGGER), None, lambda r: None, clock)
    writer = access.writer
    assert writer is not None
    body = json.dumps({"usage": USAGE}).encode()
    ends = (100.0, 101.5)  # the log's clock; the batch opens at the first
    writer.start()
    try:
        for i, end in enumerate(ends):
            request = make_mocked_request("POST", "/v1/chat/completions")
            request._transport_peername = ("127.0.0.1", 40000)
            clock.t = end - 0.25
            rec = access.begin(request)
            note_model(request, "m", f"r{i}")
            note_target(request, "http://10.0.0.1:8000", False)
            note_usage(request, fast_usage(body))
            clock.t = end
            access.finish(request, rec, web.Response(body=body), 200)
        assert len(writer.pending) == len(ends)  # one batch
        writer.flush()
    finally:
        writer.stop()
    lines = _access_lines(out)
    times = [wall.t + end - ends[0] for end in ends]
    if fmt == "json":
        assert [json.loads(line)["ts"] for line in lines] == [
            JsonFormatter()._ts(t) for t in times]
        return
    assert lines == [
        f"{TextFormatter().asctime(t)} INFO skymesh.access: POST /v1/chat/completions "
        f"200 request_id=r{i} model=m served_by=http://10.0.0.1:8000 via=replica "
        "ttft_ms=250.0 duration_ms=250.0 prompt_tokens=7 completion_tokens=3 "
        "client=127.0.0.1" for i, t in enumerate(times)]


async def test_a_whole_replys_prepare_hook_hands_back_a_done_future() -> None:
    """Once the log's app has started, the prepare hook of a whole reply returns a done
    asyncio future (no Python ``__await__`` per response); awaiting it gives None."""
    from skymesh.obs import access

    app = web.Application()
    install(app)
    for start in app.on_startup:
        await start(app)
    try:
        request = make_mocked_request("POST", "/v1/chat/completions", app=app)
        done = app[access._ACCESS_KEY].watch_body(request, web.Response(body=b"{}"))
        assert isinstance(done, asyncio.Future) and done.done()
        assert await done is None
        assert await done is None  # the same one for every reply
    finally:
        for cleanup in app.on_cleanup:
            await cleanup(app)


async def test_the_servers_handler_makes_the_record_its_init_would() -> None:
    """skymesh.net.front makes the request's record without AccessRecord.__init__ (its
    stores inline): the same members set, to the same values, as the constructor's."""
    from skymesh.net.front import request_handler
    from skymesh.obs import access

    app = web.Application()
    install(app)
    log = access.outside_chain(app)
    assert log is not None
    seen: dict[str, Any] = {}

    def members(rec: AccessRecord) -> dict[str, Any]:
        return {k: getattr(rec, k) for k in AccessRecord.__slots__ if hasattr(rec, k)}

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.update(members(request[access.RECORD_KEY]))
        return web.Response(body=b"{}")

    front = request_handler(app, handle, {}, log)
    await front(make_mocked_request("POST", "/v1/chat/completions", app=app))
    assert set(seen) == {"start", *access.BEGUN}
    assert seen == members(AccessRecord(seen["start"]))


def test_the_logs_prepare_hook_is_left_out_of_a_whole_replys_hooks() -> None:
    """The log's prepare hook watches streams only: the hooks the lean server runs for a
    whole reply are the app's others, in their order."""
    from skymesh.net.prepare_hooks import plain_prepare_hooks

    async def stamp(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Stamp"] = "1"

    app = web.Application()
    app.on_response_prepare.append(stamp)
    install(app)
    app.on_response_prepare.append(stamp)
    assert len(app.on_response_prepare) == 3
    assert plain_prepare_hooks(app) == (stamp, stamp)


@pytest.mark.usefixtures("restore_logging")
def test_the_common_lines_times_are_ms_texts() -> None:
    """The writer's common text line prints its time inline (ms_text's whole-microsecond
    case): the same text as ms_text, near halves, at the edges and past them too."""
    durations = [0.0, -1e-3, 5e-7, 0.0625e-3, 2.0005e-3, 0.9999999e-3, 1e4 - 1e-9, 1e4,
                 1e9 + 0.5, 12.5]
    for micros in range(0, 400_000, 997):
        durations += [micros / 1e6, (micros + 0.5) / 1e6,
                      math.nextafter((micros + 0.5) / 1e6, 1.0)]
    items = []
    for duration in durations:
        rec = finished(model="m", served_by="http://10.0.0.1:8000", via="replica",
                       prompt_tokens=7, completion_tokens=3)
        rec.end = rec.first_byte_at = 100.0 + duration
        items.append((rec, None, 1795885290.0421))
    out = io.StringIO()
    daemon_logging("text", out)
    AccessWriter(logging.getLogger(ACCESS_LOGGER)).write_batch(items)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(items)
    for (rec, _, _), line in zip(items, lines, strict=True):
        took = ms_text(rec.end - 100.0)
        assert f" ttft_ms={took} duration_ms={took} " in line, (rec.end, line)
