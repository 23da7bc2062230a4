"""skymesh-lb as a transparent proxy: the engine routes it does not own reach a replica and
come back untouched; what it answers itself is in the OpenAI error shape; request ids go
both ways. A real balancer process in front of in-test aiohttp replicas (which record what
reached them) and of the emulated replica."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from multidict import CIMultiDict
from support import serving, until
from yarl import URL

from skymesh.util.procs import Daemon, start_daemon

METRICS = """# HELP vllm:num_requests_waiting Waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# HELP vllm:num_requests_running Running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.0
# HELP vllm:gpu_cache_usage_perc KV.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.0
"""
HEX32 = re.compile(r"[0-9a-f]{32}")


@dataclass
class Fake:
    """An engine stand-in: serves its model cards, echoes every other request back as
    JSON (and records it), streams /v1/responses in two parts with a gate between."""

    name: str
    cards: list[dict[str, Any]]
    seen: list[dict[str, Any]] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    def app(self) -> web.Application:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=METRICS)

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": self.cards})

        async def responses(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.seen.append({"path": request.path, "body": body,
                              "headers": CIMultiDict(request.headers)})
            if not body.get("stream"):
                return web.json_response({"id": "resp_1", "object": "response",
                                          "replica": self.name})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"event: response.created\ndata: {\"n\": 1}\n\n")
            await self.gate.wait()  # the client has the first event before this one
            await resp.write(b"event: response.completed\ndata: {\"n\": 2}\n\n")
            await resp.write_eof()
            return resp

        async def transcribe(request: web.Request) -> web.Response:
            self.seen.append({"path": request.path, "body": await request.read(),
                              "headers": CIMultiDict(request.headers)})
            return web.json_response({"error": {"message": "bad audio", "type": "x",
                                                "param": "file", "code": 400}}, status=400,
                                     headers={"X-Engine": self.name})

        async def echo(request: web.Request) -> web.Response:
            raw = await request.read()
            self.seen.append({"method": request.method, "path": request.raw_path,
                              "body": raw, "headers": CIMultiDict(request.headers)})
            return web.json_response(
                {"replica": self.name, "method": request.method, "path": request.raw_path,
                 "body": raw.decode(errors="replace")},
                status=201 if request.method == "PUT" else 200,
                headers={"X-Engine": self.name, "X-Request-Id": "the-replica-s-own"})

        app = web.Application(client_max_size=8 << 20)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/responses", responses)
        app.router.add_post("/v1/audio/transcriptions", transcribe)
        app.router.add_route("*", "/{tail:.*}", echo)
        return app


def card(mid: str, max_len: int) -> dict[str, Any]:
    return {"id": mid, "object": "model", "created": 1700000000, "owned_by": "vllm",
            "root": f"/models/{mid}", "parent": None, "max_model_len": max_len,
            "permission": [{"id": "modelperm-1", "object": "model_permission",
                            "allow_sampling": True}]}


def start_lb(tmp: Path, replicas: list[dict[str, Any]], env: dict[str, str] | None = None,
             **extra: Any) -> Daemon:
    cfg = {"region": "test", "listen": {"host": "127.0.0.1", "port": 0},
           "probe": {"interval_s": 0.05}, "limits": {"max_body_bytes": 65536},
           "replicas": replicas, **extra}
    path = tmp / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # The keys a test gives, not the ones the shell running it may have.
    base = {k: v for k, v in os.environ.items() if k != "SKYMESH_API_KEYS"}
    return start_daemon("skymesh-lb", ["--config", str(path)], log_path=tmp / "lb.log",
                        env={**base, **(env or {})})


async def healthy(s: aiohttp.ClientSession, lb: Daemon, n: int) -> None:
    async def ok() -> bool:
        async with s.get(lb.url + "/ready") as r:
            return (await r.json())["healthy_replicas"] == n
    await until(ok, f"{n} healthy replicas")


@pytest.fixture
async def two() -> AsyncIterator[tuple[Fake, Fake]]:
    """Replica a serves m-a and shared; b serves m-b and shared (a smaller context)."""
    a = Fake("a", [card("m-a", 4096), card("shared/model", 8192)])
    b = Fake("b", [card("m-b", 2048), {"id": "shared/model", "object": "model",
                                       "max_model_len": 1024, "extra_b": True}])
    async with serving(a.app()) as pa, serving(b.app()) as pb:
        a.url, b.url = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
        yield a, b


@pytest.fixture
async def lb_two(two: tuple[Fake, Fake], tmp_path: Path) -> AsyncIterator[Daemon]:
    a, b = two
    # In a thread: the fakes answer its first probes from this loop meanwhile.
    lb = await asyncio.to_thread(start_lb, tmp_path, [
        {"url": a.url}, {"url": b.url},
        # configured, never reachable: its model is still listed
        {"url": "http://127.0.0.1:9", "models": ["m-down"]}])
    try:
        async with aiohttp.ClientSession() as s:
            await healthy(s, lb, 2)
        yield lb
    finally:
        lb.stop()


async def test_engine_routes_reach_the_replica_serving_the_model_untouched(
        two: tuple[Fake, Fake], lb_two: Daemon) -> None:
    a, b = two
    lb = lb_two
    body = json.dumps({"model": "m-b", "input": ["hello"], "encoding_format": "float"})
    async with aiohttp.ClientSession() as s:
        for _ in range(4):  # the model decides, every time
            # encoded=True: sent as written (the balancer must not re-encode either)
            async with s.post(URL(lb.url + "/v1/embeddings?user=x&q=%2Fy", encoded=True),
                              data=body,
                              headers={"Content-Type": "application/json",
                                       "X-Custom": "kept", "X-Request-Id": "client-42"}
                              ) as r:
                assert r.status == 200
                got = await r.json()
                assert r.headers["X-Engine"] == "b"
                assert r.headers["X-Request-Id"] == "client-42"  # the client's, echoed
            assert got == {"replica": "b", "method": "POST",
                           "path": "/v1/embeddings?user=x&q=%2Fy", "body": body}
        # (The replicas' other visitors are the balancer's probes.)
        [sent] = {x["headers"]["X-Custom"]: x["headers"] for x in b.seen
                  if x["path"].startswith("/v1/embeddings")}.values()
        assert sent["X-Custom"] == "kept" and sent["X-Request-Id"] == "client-42"
        assert not [x for x in a.seen if x["path"].startswith("/v1/embeddings")]

        # Other methods, no body, no model: any healthy replica; status passed through.
        async with s.put(URL(lb.url + "/v1/files/a%20b", encoded=True),
                         data=b"raw bytes") as r:
            got = await r.json()
            assert r.status == 201 and got["body"] == "raw bytes"
            assert got["path"] == "/v1/files/a%20b"
            assert HEX32.fullmatch(r.headers["X-Request-Id"])  # generated
            rid = r.headers["X-Request-Id"]
        upstream = next(x for x in a.seen + b.seen if x.get("method") == "PUT")
        assert upstream["headers"]["X-Request-Id"] == rid  # the same id went upstream
        for method, path in (("DELETE", "/v1/responses/resp_1"), ("GET", "/version"),
                             ("GET", "/get_model_info"), ("POST", "/tokenize"),
                             ("POST", "/v1/chat/completions/render"), ("GET", "/v2/x")):
            async with s.request(method, lb.url + path) as r:
                assert r.status == 200, (method, path)
                assert (await r.json())["path"] == path

        # An engine's error comes back as the engine gave it.
        async with s.post(lb.url + "/v1/audio/transcriptions", data=b"\x00audio") as r:
            assert r.status == 400 and r.headers["X-Engine"] in ("a", "b")
            assert (await r.json())["error"]["code"] == 400

        # A streamed response is relayed as it comes: the first event is here while
        # the replica still holds the second.
        async with s.post(lb.url + "/v1/responses",
                          json={"model": "m-a", "input": "hi", "stream": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
            first = await r.content.readuntil(b"\n\n")
            assert first == b"event: response.created\ndata: {\"n\": 1}\n\n"
            a.gate.set()
            assert await r.content.read() == b"event: response.completed\ndata: {\"n\": 2}\n\n"

        # Body limits hold here too.
        async with s.post(lb.url + "/v1/embeddings", data=b"x" * 70000) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "payload_too_large"


async def test_models_are_merged_without_dropping_fields(
        two: tuple[Fake, Fake], lb_two: Daemon) -> None:
    lb = lb_two
    async with aiohttp.ClientSession() as s:
        async with s.get(lb.url + "/v1/models") as r:
            data = {m["id"]: m for m in (await r.json())["data"]}
        assert sorted(data) == ["m-a", "m-b", "m-down", "shared/model"]
        assert data["m-a"] == card("m-a", 4096)  # vLLM's fields, all of them
        shared = data["shared/model"]
        # Both replicas' fields; the context every replica of it accepts.
        assert shared["root"] == "/models/shared/model" and shared["extra_b"] is True
        assert shared["max_model_len"] == 1024
        assert data["m-down"]["object"] == "model"  # configured, never reached
        async with s.get(lb.url + "/v1/models/shared/model") as r:
            assert r.status == 200 and await r.json() == shared
        async with s.get(lb.url + "/v1/models/nope") as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"
        # A model whose replicas are all down is a retryable 503, here too.
        async with s.post(lb.url + "/v1/embeddings", json={"model": "m-down"}) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "no_healthy_replica"
            assert int(r.headers["Retry-After"]) >= 1
        async with s.post(lb.url + "/v1/embeddings", json={"model": "no-such"}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"


ERROR_CASES = [
    ("GET", "/nope", 404, "not_found", None),
    ("GET", "/flush_cache", 404, "not_found", None),  # engine admin: not forwarded
    ("POST", "/v1/load_lora_adapter", 404, "not_found", None),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed", "POST"),
    ("DELETE", "/v1/models", 405, "method_not_allowed", "GET, HEAD"),
    ("POST", "/health", 405, "method_not_allowed", "GET, HEAD"),
    ("DELETE", "/v1/models/m-a", 405, "method_not_allowed", "GET, HEAD"),
]


async def test_the_balancer_s_own_errors_are_openai_shaped(lb_two: Daemon) -> None:
    async with aiohttp.ClientSession() as s:
        for method, path, status, code, allow in ERROR_CASES:
            async with s.request(method, lb_two.url + path) as r:
                assert r.status == status, path
                assert r.content_type == "application/json"
                err = (await r.json())["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["code"] == code
                assert r.headers.get("Allow") == allow
                assert HEX32.fullmatch(r.headers["X-Request-Id"])


async def test_the_replica_gets_the_normalised_path_and_the_deny_list_holds(
        two: tuple[Fake, Fake], lb_two: Daemon) -> None:
    """Issue #33, item 12: spellings of a refused route that used to reach the replica as
    written are refused; a forwarded route arrives in its normalised form."""
    a, b = two
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/./load_lora_adapter", "/v1//load_lora_adapter",
                     "/v1/load_lora_adapter/", "/v1/x/../../sleep",
                     "/v1/%6coad_lora_adapter"):
            async with s.post(URL(lb_two.url + path, encoded=True), json={}) as r:
                assert r.status == 404, path
                assert (await r.json())["error"]["code"] == "not_found"
        for path in ("/v1/%2e%2e/sleep", "/v1/../../sleep", "/v1/files/a%2Fb"):
            async with s.post(URL(lb_two.url + path, encoded=True), json={}) as r:
                assert r.status == 400, path
                assert (await r.json())["error"]["code"] == "invalid_request"
        # The balancer's own route under another spelling is not sent to a replica.
        async with s.post(URL(lb_two.url + "/v1//chat/completions", encoded=True),
                          json={}) as r:
            assert r.status == 404 and "/v1/chat/completions" in \
                (await r.json())["error"]["message"]
        async with s.post(URL(lb_two.url + "/v1//x/../embeddings/?user=a%2Fb", encoded=True),
                          json={"model": "m-b", "input": "hi"}) as r:
            assert r.status == 200
            assert (await r.json())["path"] == "/v1/embeddings?user=a%2Fb"
    reached = [x["path"] for x in a.seen + b.seen if "path" in x]
    assert not [p for p in reached if "lora" in p or "sleep" in p or "chat" in p]


async def test_a_connect_error_is_retried_on_another_replica(tmp_path: Path) -> None:
    """A replica that dies between two probes: requests picked for it go elsewhere."""
    a = Fake("a", [card("m", 4096)])
    b = Fake("b", [card("m", 4096)])
    async with serving(b.app()) as pb:
        b.url = f"http://127.0.0.1:{pb}"
        lb = None
        try:
            async with aiohttp.ClientSession() as s:
                async with serving(a.app()) as pa:
                    a.url = f"http://127.0.0.1:{pa}"
                    # Probes far apart: the balancer keeps thinking a is up.
                    lb = await asyncio.to_thread(start_lb, tmp_path,
                                                 [{"url": a.url}, {"url": b.url}],
                                                 probe={"interval_s": 60})
                    await healthy(s, lb, 2)
                for i in range(12):
                    method = "GET" if i % 2 else "POST"  # never sent: both retried
                    async with s.request(method, lb.url + "/version") as r:
                        assert r.status == 200
                        assert (await r.json())["replica"] == "b"
        finally:
            if lb is not None:
                lb.stop()


async def test_forwarded_routes_need_the_client_key_and_carry_the_balancer_s(
        tmp_path: Path) -> None:
    a = Fake("a", [card("m", 4096)])
    async with serving(a.app()) as pa:
        a.url = f"http://127.0.0.1:{pa}"
        lb = await asyncio.to_thread(
            start_lb, tmp_path, [{"url": a.url}],
            env={"SKYMESH_API_KEYS": "sk-client", "REPLICA_KEY": "sk-replica"},
            upstream={"api_key_env": "REPLICA_KEY"})
        try:
            async with aiohttp.ClientSession() as s:
                await healthy(s, lb, 1)
                async with s.post(lb.url + "/tokenize", json={"prompt": "x"}) as r:
                    assert r.status == 401
                    assert (await r.json())["error"]["code"] == "invalid_api_key"
                async with s.post(lb.url + "/tokenize", json={"prompt": "x"},
                                  headers={"Authorization": "Bearer sk-client"}) as r:
                    assert r.status == 200
                [sent] = [x["headers"] for x in a.seen if x["path"] == "/tokenize"]
                assert sent["Authorization"] == "Bearer sk-replica"
        finally:
            lb.stop()


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    tmp = tmp_path_factory.mktemp("pt-emulated")
    rep = start_daemon("skymesh-replica", ["--port", "0", "--seed", "3"],
                       log_path=tmp / "replica.log")
    lb = start_lb(tmp, [{"url": rep.url}])
    try:
        yield lb, rep
    finally:
        lb.stop()
        rep.stop()


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/tokenize", {"prompt": "hello there, balancer"}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
    ("GET", "/version", None),
    ("GET", "/get_model_info", None),
])
async def test_the_emulated_replica_s_routes_answer_as_they_do_directly(
        emulated: tuple[Daemon, Daemon], method: str, path: str,
        body: dict[str, Any] | None) -> None:
    lb, rep = emulated
    async with aiohttp.ClientSession() as s:
        async with s.get(rep.url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        if body is not None and path != "/detokenize":
            body = {"model": model, **body}
        await healthy(s, lb, 1)
        out = []
        for base in (rep.url, lb.url):
            async with s.request(method, base + path, json=body) as r:
                out.append((r.status, r.content_type, await r.read()))
        assert out[0][0] == 200
        assert out[1] == out[0]
