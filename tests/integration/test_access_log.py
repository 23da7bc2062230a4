"""Access logs and tracing of the real daemons (``skymesh-controller`` as a process on
loopback, its app under uvicorn in-process), read back from their JSON log lines and from
a real OTLP/HTTP receiver (an aiohttp app decoding the exporter's protobuf requests)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from controller_support import ADMIN, READER, auth, token_config
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from support import until

from skymesh.obs.asgi import AccessLogMiddleware
from skymesh.obs.tracing import Tracing
from skymesh.util.procs import start_daemon
from skymesh_controller.api import build_app
from skymesh_controller.config import parse_config

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


def access_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            obj = json.loads(line)  # every JSON line parses
            if obj["logger"] == "skymesh.access":
                out.append(obj)
    return out


@pytest.fixture
async def collector() -> AsyncIterator[tuple[str, list[ExportTraceServiceRequest]]]:
    """An OTLP/HTTP trace receiver on loopback: what the exporter posts, decoded."""
    got: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        got.append(msg)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/v1/traces", got
    await runner.cleanup()


async def test_controller_lines_name_the_principal_never_the_token_and_spans_reach_otlp(
        tmp_path: Path, collector: tuple[str, list[ExportTraceServiceRequest]]) -> None:
    endpoint, exported = collector
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0},
                                   "tokens": token_config()}))
    log = tmp_path / "controller.log"
    daemon = await asyncio.to_thread(
        start_daemon, "skymesh-controller",
        ["--config", str(cfg), "--log-format", "json", "--otlp-endpoint", endpoint],
        log_path=log)
    bad = "not-a-token-but-secret"
    try:
        async with aiohttp.ClientSession() as s:
            calls: list[tuple[str, str, str | None, int]] = [
                ("GET", "/health", None, 200),
                ("GET", "/v1/regions", ADMIN, 200),
                ("POST", "/v1/regions", READER, 403),  # known token, wrong role
                ("GET", "/v1/regions", bad, 401),
            ]
            for method, path, token, status in calls:
                headers = {"traceparent": TRACEPARENT, **(auth(token) if token else {})}
                async with s.request(method, daemon.url + path, headers=headers,
                                     json={"name": "us", "latitude": 1, "longitude": 2}
                                     if method == "POST" else None) as r:
                    assert r.status == status, await r.text()

        async def four() -> bool:
            return len(access_lines(daemon.log())) == 4
        await until(four, "four access lines")
    finally:
        await asyncio.to_thread(daemon.stop)  # the exit flushes the spans
    text = log.read_text()
    for token in (ADMIN, READER, bad):
        assert token not in text
    lines = access_lines(text)
    assert [(x["method"], x["path"], x["status"], x["principal"]) for x in lines] == [
        ("GET", "/health", 200, None), ("GET", "/v1/regions", 200, "ops"),
        ("POST", "/v1/regions", 403, "dash"), ("GET", "/v1/regions", 401, None)]
    for x in lines:
        assert x["client"] == "127.0.0.1" and x["duration_ms"] >= 0
        assert x["trace_id"] == CLIENT_TRACE and x["level"] == "INFO"
    spans = [span for req in exported for rs in req.resource_spans
             for ss in rs.scope_spans for span in ss.spans]
    services = {a.value.string_value for req in exported for rs in req.resource_spans
                for a in rs.resource.attributes if a.key == "service.name"}
    assert services == {"skymesh-controller"}
    assert len(spans) == 4 and {s.trace_id.hex() for s in spans} == {CLIENT_TRACE}
    assert {s.parent_span_id.hex() for s in spans} == {TRACEPARENT.split("-")[2]}


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    return sock


async def test_controller_spans_carry_status_and_principal_in_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    monkeypatch.setenv("SKYMESH_ADMIN_TOKEN", ADMIN)
    exporter = InMemorySpanExporter()
    app = build_app(parse_config({"logging": {"access_log": False}}), probe=False)
    traced = AccessLogMiddleware(app, access_log=False,
                                 tracing=Tracing.create("ctl", exporter=exporter))
    sock = _listening_socket()
    server = uvicorn.Server(uvicorn.Config(traced, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async def started() -> bool:
            return server.started
        await until(started, "uvicorn started")
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/regions", headers=auth(ADMIN)) as r:
                assert r.status == 200
            async with s.get(url + "/v1/nothing", headers=auth(ADMIN)) as r:
                assert r.status == 404
    finally:
        server.should_exit = True
        await task
        sock.close()
    by_path = {s.attributes["url.path"]: s  # type: ignore[index]
               for s in exporter.get_finished_spans()}
    ok = by_path["/v1/regions"]
    assert ok.kind == SpanKind.SERVER and ok.name == "GET /v1/regions"
    assert ok.attributes["http.response.status_code"] == 200  # type: ignore[index]
    assert ok.attributes["skymesh.principal"] == "env-admin"  # type: ignore[index]
    assert by_path["/v1/nothing"].attributes["http.response.status_code"] == 404  # type: ignore[index]


# -- skymesh-lb ------------------------------------------------------------------------------
MODEL = "m1"
MESSAGES = [{"role": "user", "content": "hello"}]
USAGE = {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}
METRICS = ("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
           "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n")


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


@pytest.fixture
async def replica() -> AsyncIterator[tuple[str, list[str | None]]]:
    """A vLLM-shaped replica on loopback that records each generation's ``traceparent``."""
    seen: list[str | None] = []

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("traceparent"))
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"model": MODEL, "usage": USAGE, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("hi", " there"):
            await resp.write(sse({"model": MODEL, "choices": [{"delta": {"content": word}}]}))
        await resp.write(sse({"model": MODEL, "choices": [], "usage": USAGE}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def test_balancer_logs_one_line_per_request_and_traces_to_the_replica(
        tmp_path: Path, replica: tuple[str, list[str | None]],
        collector: tuple[str, list[ExportTraceServiceRequest]]) -> None:
    replica_url, seen = replica
    endpoint, exported = collector
    daemon = await asyncio.to_thread(
        start_daemon, "skymesh-lb",
        ["--port", "0", "--replicas", replica_url, "--log-format", "json",
         "--otlp-endpoint", endpoint], log_path=tmp_path / "lb.log")
    chat = daemon.url + "/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as s:
            async def ready() -> bool:
                async with s.get(daemon.url + "/ready") as r:
                    return r.status == 200
            await until(ready, "the balancer ready")
            async with s.post(chat, json={"model": MODEL, "messages": MESSAGES}, headers={
                    "X-Request-Id": "req-whole", "traceparent": TRACEPARENT}) as r:
                assert r.status == 200 and r.headers["X-Request-Id"] == "req-whole"
                await r.read()
            async with s.post(chat, json={"model": MODEL, "messages": MESSAGES, "stream": True,
                                          "stream_options": {"include_usage": True}}) as r:
                assert r.status == 200
                streamed_id = r.headers["X-Request-Id"]
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
            async with s.post(chat, json={"model": "no-such-model", "messages": MESSAGES}) as r:
                assert r.status == 404

        def chats() -> list[dict[str, Any]]:
            return [x for x in access_lines(daemon.log()) if x["path"] == chat[-20:]]

        async def three() -> bool:
            return len(chats()) == 3
        await until(three, "three access lines for the chat requests")
    finally:
        await asyncio.to_thread(daemon.stop)  # the exit flushes the spans
    whole, streamed, unknown = chats()
    assert {k: whole[k] for k in ("request_id", "method", "model", "served_by", "via",
                                  "status", "prompt_tokens", "completion_tokens", "client",
                                  "trace_id")} == {
        "request_id": "req-whole", "method": "POST", "model": MODEL, "served_by": replica_url,
        "via": "replica", "status": 200, "prompt_tokens": 11, "completion_tokens": 2,
        "client": "127.0.0.1", "trace_id": CLIENT_TRACE}
    assert streamed["request_id"] == streamed_id and streamed["trace_id"] not in (
        None, CLIENT_TRACE)
    assert (streamed["prompt_tokens"], streamed["completion_tokens"]) == (11, 2)
    for line in (whole, streamed):
        assert 0 <= line["ttft_ms"] <= line["duration_ms"]
    assert unknown["status"] == 404 and unknown["model"] is None  # refused before intake
    assert unknown["served_by"] is None and unknown["prompt_tokens"] is None

    spans = [span for req in exported for rs in req.resource_spans
             for ss in rs.scope_spans for span in ss.spans]
    server = {s.span_id: s for s in spans if s.kind == s.SPAN_KIND_SERVER}
    client = {s.span_id.hex(): s for s in spans if s.kind == s.SPAN_KIND_CLIENT}
    # one attempt each for the two requests that reached the replica, and the replica got
    # the attempt span's context; each attempt hangs off its request's span
    assert len(client) == len(seen) == 2
    for sent in seen:
        assert sent is not None
        _, trace, parent, _ = sent.split("-")
        assert trace == client[parent].trace_id.hex()
        assert server[client[parent].parent_span_id].name == "POST /v1/chat/completions"
    assert seen[0] is not None and seen[0].split("-")[1] == CLIENT_TRACE
    traced_whole = server[client[seen[0].split("-")[2]].parent_span_id]
    assert traced_whole.parent_span_id.hex() == TRACEPARENT.split("-")[2]
