"""Tracing (skymesh.obs.tracing through skymesh.obs.access) with the real OpenTelemetry SDK
and its InMemorySpanExporter: a front app on loopback plays the balancer (one attempt that
fails over, then one that succeeds) in front of a real aiohttp upstream that records the
``traceparent`` each request brought."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from support import eventually

from skymesh.obs.access import inject_trace, install, note, upstream_span
from skymesh.obs.config import TracingConfig
from skymesh.obs.logs import ACCESS_LOGGER
from skymesh.obs.tracing import Tracing, TracingUnavailable, from_config

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@dataclass
class Rig:
    front: str
    exporter: InMemorySpanExporter
    seen: list[str | None] = field(default_factory=list)  # traceparent per upstream request


async def rig(sample_ratio: float = 1.0, fail_first: bool = True) -> AsyncIterator[Rig]:
    exporter = InMemorySpanExporter()
    seen: list[str | None] = []

    async def replica(request: web.Request) -> web.Response:
        seen.append(request.headers.get("traceparent"))
        if fail_first and len(seen) == 1:
            return web.Response(status=503)
        return web.json_response({"usage": {"prompt_tokens": 4, "completion_tokens": 2}})

    up = web.Application()
    up.router.add_post("/v1/completions", replica)
    up_runner, up_url = await start(up)

    async def generate(request: web.Request) -> web.StreamResponse:
        note(request, model="m1")
        async with aiohttp.ClientSession() as s:
            for attempt in (1, 2):  # the balancer's retry loop, in small
                with upstream_span(request, up_url, attempt=attempt):
                    note(request, served_by=up_url)
                    headers: dict[str, str] = {}
                    inject_trace(request, headers)
                    async with s.post(up_url + "/v1/completions", headers=headers) as r:
                        if r.status < 500:
                            return web.Response(status=r.status, body=await r.read(),
                                                content_type="application/json")
        return web.Response(status=502)

    tracing = Tracing.create("skymesh-lb", TracingConfig(sample_ratio=sample_ratio), exporter)
    front = web.Application()
    front.router.add_post("/v1/completions", generate)
    install(front, tracing=tracing, request_id=lambda r: "rid-1")
    front_runner, front_url = await start(front)
    yield Rig(front_url, exporter, seen)
    await front_runner.cleanup()  # shuts the provider down (on_cleanup)
    await up_runner.cleanup()


@pytest.fixture
async def traced() -> AsyncIterator[Rig]:
    async for r in rig():
        yield r


async def post(url: str, headers: dict[str, str] | None = None) -> int:
    async with aiohttp.ClientSession() as s, \
            s.post(url + "/v1/completions", json={}, headers=headers or {}) as r:
        await r.read()
        return r.status


def parts(traceparent: str | None) -> tuple[str, str, bool]:
    """(trace id, parent span id, sampled) of a W3C ``traceparent``."""
    assert traceparent is not None
    version, trace, span, flags = traceparent.split("-")
    assert version == "00"
    return trace, span, bool(int(flags, 16) & 1)  # bit 1 (random trace id) may be set too


async def test_a_request_is_a_server_span_with_one_client_span_per_attempt(
        traced: Rig) -> None:
    assert await post(traced.front) == 200
    spans = traced.exporter.get_finished_spans()
    (server,) = [s for s in spans if s.kind == SpanKind.SERVER]
    attempts = sorted((s for s in spans if s.kind == SpanKind.CLIENT),
                      key=lambda s: s.attributes["skymesh.attempt"])  # type: ignore[index]
    assert len(spans) == 3 and len(attempts) == 2
    assert server.name == "POST /v1/completions" and server.parent is None  # a new trace
    attrs = dict(server.attributes or {})
    assert attrs["http.response.status_code"] == 200
    assert attrs["skymesh.request_id"] == "rid-1" and attrs["gen_ai.request.model"] == "m1"
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (4, 2)
    assert server.resource.attributes["service.name"] == "skymesh-lb"
    trace_id = server.context.trace_id
    for n, (span, sent) in enumerate(zip(attempts, traced.seen, strict=True), 1):
        assert span.parent is not None and span.parent.span_id == server.context.span_id
        assert span.context.trace_id == trace_id
        assert span.attributes["skymesh.attempt"] == n  # type: ignore[index]
        # the replica got this attempt's span as its parent, sampled
        assert parts(sent) == (f"{trace_id:032x}", f"{span.context.span_id:016x}", True)


async def test_the_clients_traceparent_is_continued(traced: Rig) -> None:
    sent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    assert await post(traced.front, {"traceparent": sent}) == 200
    (server,) = [s for s in traced.exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert f"{server.context.trace_id:032x}" == CLIENT_TRACE
    assert server.parent is not None and f"{server.parent.span_id:016x}" == CLIENT_SPAN
    assert {parts(t)[0] for t in traced.seen} == {CLIENT_TRACE}


async def test_a_malformed_traceparent_starts_a_new_trace(traced: Rig) -> None:
    assert await post(traced.front, {"traceparent": "00-not-a-trace-01"}) == 200
    (server,) = [s for s in traced.exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert server.parent is None


async def test_unsampled_new_traces_export_nothing_but_a_sampled_client_still_counts() -> None:
    async for r in rig(sample_ratio=0.0, fail_first=False):
        assert await post(r.front) == 200
        assert r.exporter.get_finished_spans() == ()
        assert parts(r.seen[0])[2] is False  # the replica learns it is not sampled
        assert await post(r.front, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}) \
            == 200
        assert len(r.exporter.get_finished_spans()) == 2  # server + the one attempt
        assert parts(r.seen[1])[::2] == (CLIENT_TRACE, True)


async def test_a_5xx_marks_the_span_as_an_error_and_the_log_line_names_the_trace(
        caplog: pytest.LogCaptureFixture) -> None:
    async for r in rig():
        caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
        async with aiohttp.ClientSession() as s, s.post(r.front + "/nowhere") as resp:
            assert resp.status == 404
        assert await post(r.front) == 200
        await eventually(lambda: len(caplog.records) == 2, "two access lines")
        spans = {s.attributes["http.response.status_code"]: s  # type: ignore[index]
                 for s in r.exporter.get_finished_spans() if s.kind == SpanKind.SERVER}
        assert spans[404].status.status_code == StatusCode.UNSET  # a client's mistake
        assert spans[404].name == "POST /nowhere"
        logged = {rec.status: rec.trace_id for rec in caplog.records}  # type: ignore[attr-defined]
        assert logged[200] == f"{spans[200].context.trace_id:032x}"

    exporter = InMemorySpanExporter()
    tracing = Tracing.create("t", exporter=exporter)

    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=502)

    app = web.Application()
    app.router.add_post("/v1/completions", fail)
    install(app, access_log=False, tracing=tracing)
    runner, url = await start(app)
    try:
        assert await post(url) == 502
    finally:
        await runner.cleanup()
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR


def test_off_without_an_endpoint_and_a_clear_error_without_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert from_config(TracingConfig(), "skymesh-lb") is None
    from skymesh.util import extras

    monkeypatch.setitem(extras.EXTRAS, "tracing",
                        ("skymesh", ("opentelemetry.sdk", "no_such_otel_xyz")))
    with pytest.raises(TracingUnavailable, match=r"pip install 'skymesh\[tracing\]'"):
        from_config(TracingConfig(otlp_endpoint="http://127.0.0.1:1/v1/traces"), "lb")
