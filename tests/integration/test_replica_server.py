"""skymesh-replica end to end: the real command on a local port, driven over HTTP.

One replica process (time scale 0.05: the L4 profile's ~55 ms decode steps take ~3 ms)
serves the whole module; tests look at metric deltas, not absolute values. Everything
that waits polls a condition under a deadline. The driver is also tested in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import read_sse, until

from skymesh.common.probe import parse_metrics
from skymesh.prefix.prompt import FallbackTokenizer, Tokenizer, get_tokenizer, render_chat
from skymesh.util.procs import Daemon, executable, start_daemon
from skymesh_replica.driver import WORDS, ContextLengthError, RealtimeDriver
from skymesh_replica.engine.core import Engine
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile

pytestmark = pytest.mark.timeout(60)

MODEL = get_profile(DEFAULT_PROFILE).model
MAX_BODY = 1 << 20
TIME_SCALE = 0.05


# -- the replica process ---------------------------------------------------------------
def _start(tmp: Path, *args: str) -> Daemon:
    return start_daemon("skymesh-replica", ["--port", "0", *args],
                        log_path=tmp / "replica.log")


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("replica")
    # No metrics lag here: these tests read the gauges against the requests they made.
    d = _start(tmp, "--time-scale", str(TIME_SCALE), "--seed", "7", "--metrics-lag-s", "0",
               "--max-body-bytes", str(MAX_BODY), "--log-level", "info")
    try:
        yield d.url
    finally:
        rc = d.stop()
        assert rc == 0, d.log()


@pytest.fixture
async def http(replica: str) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=replica) as session:
        await until(lambda: _healthy(session), "replica healthy")
        yield session


async def _healthy(session: aiohttp.ClientSession) -> bool:
    try:
        async with session.get("/health") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def metrics(session: aiohttp.ClientSession) -> dict[str, float]:
    """Each sample name's value summed over its series (the real Prometheus parser)."""
    async with session.get("/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_bucket"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def post(session: aiohttp.ClientSession, path: str, body: Any) -> tuple[int, Any]:
    async with session.post(path, json=body) as r:
        return r.status, await r.json()


async def sse(session: aiohttp.ClientSession, path: str, body: Any) -> list[Any]:
    async with session.post(path, json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        return await read_sse(r)


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


# -- generation --------------------------------------------------------------------------
async def test_chat_json_ignore_eos(http: aiohttp.ClientSession) -> None:
    status, body = await post(http, "/v1/chat/completions",
                              chat("Say something.", max_tokens=12, ignore_eos=True))
    assert status == 200, body
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    # Synthetic text re-tokenises to exactly the tokens generated.
    assert len(get_tokenizer().encode(choice["message"]["content"])) == 12
    # max_completion_tokens is the newer spelling of max_tokens.
    _, body = await post(http, "/v1/chat/completions",
                         chat("Say something.", max_completion_tokens=3, ignore_eos=True))
    assert body["usage"]["completion_tokens"] == 3


async def test_chat_stream(http: aiohttp.ClientSession) -> None:
    events = await sse(http, "/v1/chat/completions", chat(
        "Stream please.", max_tokens=10, ignore_eos=True, stream=True,
        stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:]]
    assert len(content) == 10 and all(content)  # one event per engine step, one token each
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None] * 9 + ["length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 10
    assert len(get_tokenizer().encode("".join(content))) == 10


async def test_stream_without_usage(http: aiohttp.ClientSession) -> None:
    events = await sse(http, "/v1/chat/completions",
                       chat("x", max_tokens=3, ignore_eos=True, stream=True))
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])


async def test_completions(http: aiohttp.ClientSession) -> None:
    status, body = await post(http, "/v1/completions", {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens"] == len(get_tokenizer().encode("Once upon a time"))
    # Like vLLM, /v1/completions defaults to 16 tokens.
    _, body = await post(http, "/v1/completions", {
        "model": MODEL, "prompt": "Once upon a time", "ignore_eos": True})
    assert body["usage"]["completion_tokens"] == 16
    # Token-id prompts are taken as ids.
    _, body = await post(http, "/v1/completions", {
        "model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2, "ignore_eos": True})
    assert body["usage"]["prompt_tokens"] == 4
    events = await sse(http, "/v1/completions", {
        "model": MODEL, "prompt": ["Hi"], "max_tokens": 4, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    texts = [e["choices"][0]["text"] for e in events[:-2]]
    assert len(texts) == 4 and events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 4


async def test_natural_stop_and_request_seed(http: aiohttp.ClientSession) -> None:
    # Without ignore_eos the length is drawn (median 256), well under a large max_tokens.
    _, a = await post(http, "/v1/chat/completions", chat("Go.", max_tokens=3000, seed=11))
    _, b = await post(http, "/v1/chat/completions", chat("Go.", max_tokens=3000, seed=11))
    assert a["choices"][0]["finish_reason"] == "stop"
    assert 1 <= a["usage"]["completion_tokens"] < 3000
    assert a["choices"][0]["message"] == b["choices"][0]["message"]  # same seed, same text
    _, c = await post(http, "/v1/chat/completions",
                      chat("Go.", max_tokens=4, min_tokens=4, seed=11))
    assert c["usage"]["completion_tokens"] == 4


# -- load and cache signals ---------------------------------------------------------------
async def test_waiting_rises_under_load(http: aiohttp.ClientSession) -> None:
    # 4k-token prompts: one fills two steps' 2,048-token prefill budget, so the rest queue.
    n = 16
    bodies = [chat(words(4000, seed=100 + i), max_tokens=2, ignore_eos=True) for i in range(n)]
    before = await metrics(http)
    tasks = [asyncio.create_task(post(http, "/v1/chat/completions", b)) for b in bodies]
    peak = {"waiting": 0.0, "usage": 0.0}

    async def saw_waiting() -> bool:
        m = await metrics(http)
        peak["waiting"] = max(peak["waiting"], m["vllm:num_requests_waiting"])
        peak["usage"] = max(peak["usage"], m["vllm:kv_cache_usage_perc"])
        async with http.get("/get_load") as r:
            load = (await r.json())[0]
        return m["vllm:num_requests_waiting"] > 0 and load["num_waiting_reqs"] > 0

    await until(saw_waiting, "vllm:num_requests_waiting > 0")
    results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _ in results)
    after = await metrics(http)
    assert after["vllm:num_requests_waiting"] == 0 and after["vllm:num_requests_running"] == 0
    assert peak["usage"] > 0
    prompt = sum(body["usage"]["prompt_tokens"] for _, body in results)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == prompt
    gen = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert gen == 2 * n


async def test_repeated_prompt_hits_prefix_cache(http: aiohttp.ClientSession) -> None:
    body = chat(words(300, seed=1), max_tokens=2, ignore_eos=True)
    before = await metrics(http)
    _, first = await post(http, "/v1/chat/completions", body)
    _, second = await post(http, "/v1/chat/completions", body)
    after = await metrics(http)
    plen = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # All full blocks but the one holding the last prompt token (always recomputed).
    hit = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit == (plen - 1) // 16 * 16 > 0
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == hit
    assert after["vllm:prefix_cache_queries_total"] - before[
        "vllm:prefix_cache_queries_total"] == 2 * plen
    assert after["sglang:cache_hit_rate"] > 0


async def test_next_turn_hits_previous_answer(http: aiohttp.ClientSession) -> None:
    turn1 = [{"role": "user", "content": words(200, seed=2)}]
    _, a = await post(http, "/v1/chat/completions",
                      {"model": MODEL, "messages": turn1, "max_tokens": 64, "ignore_eos": True})
    answer = a["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And then?"}]
    _, b = await post(http, "/v1/chat/completions",
                      {"model": MODEL, "messages": turn2, "max_tokens": 2})
    # The answer's own blocks were cached: everything computed in turn 1 is reused.
    computed = a["usage"]["prompt_tokens"] + a["usage"]["completion_tokens"] - 1
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= computed // 16 * 16


async def test_max_num_seqs_and_lagging_gauges(tmp_path: Path) -> None:
    # A lag far beyond this test's run: the gauges must still show the idle engine while
    # the live /get_load shows the limit at work (2 running, the third waiting).
    d = _start(tmp_path, "--time-scale", str(TIME_SCALE), "--max-num-seqs", "2",
               "--metrics-lag-s", "30")
    try:
        async with aiohttp.ClientSession(base_url=d.url) as http:
            await until(lambda: _healthy(http), "replica healthy")
            body = chat("Long answer.", max_tokens=4000, ignore_eos=True, stream=True)
            streams = [await http.post("/v1/chat/completions", json=body) for _ in range(3)]

            async def limited() -> bool:
                async with http.get("/get_load") as r:
                    load = (await r.json())[0]
                return (load["num_reqs"], load["num_waiting_reqs"]) == (3, 1)
            await until(limited, "2 running and 1 waiting")
            m = await metrics(http)
            assert m["skymesh_engine_max_num_seqs"] == 2
            assert (m["vllm:num_requests_waiting"], m["vllm:num_requests_running"]) == (0, 0)
            assert m["vllm:num_requests_waiting_by_reason"] == 0
            for r in streams:
                r.close()
    finally:
        assert d.stop() == 0, d.log()


# -- disconnects ---------------------------------------------------------------------------
async def _running(http: aiohttp.ClientSession) -> float:
    return (await metrics(http))["vllm:num_requests_running"]


async def test_stream_disconnect_aborts(replica: str, http: aiohttp.ClientSession) -> None:
    before = (await metrics(http))["skymesh_engine_requests_aborted_total"]
    body = chat("Long answer.", max_tokens=4000, ignore_eos=True, stream=True)
    async with aiohttp.ClientSession(base_url=replica) as client:
        resp = await client.post("/v1/chat/completions", json=body)
        got = 0
        async for line in resp.content:
            got += line.startswith(b"data: ")
            if got >= 4:
                break
        assert await _running(http) == 1
        resp.close()  # drops the connection mid-stream
    # The request alone would run ~11 s more: a short deadline proves it was aborted.
    await until(lambda: _is(_running(http), 0), "running back to 0 after disconnect",
                timeout=3.0)
    after = (await metrics(http))["skymesh_engine_requests_aborted_total"]
    assert after == before + 1


async def test_nonstream_disconnect_aborts(replica: str, http: aiohttp.ClientSession) -> None:
    body = chat("Long answer.", max_tokens=4000, ignore_eos=True)
    async with aiohttp.ClientSession(base_url=replica) as client:
        task = asyncio.create_task(post(client, "/v1/chat/completions", body))
        await until(lambda: _is(_running(http), 1), "request running")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    # The request alone would run ~11 s more: a short deadline proves it was aborted.
    await until(lambda: _is(_running(http), 0), "running back to 0 after disconnect",
                timeout=3.0)


async def _is(value: Awaitable[float], want: float) -> bool:
    return await value == want


# -- errors ----------------------------------------------------------------------------------
BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("/v1/chat/completions", chat("x") | {"model": 3}, 400, "model"),
    ("/v1/chat/completions", chat("x") | {"model": "nope"}, 404, "model"),
    ("/v1/chat/completions", chat("x", max_tokens=-1), 400, "max_tokens"),
    ("/v1/chat/completions", chat("x", max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", chat("x", max_tokens="5"), 400, "max_tokens"),
    ("/v1/chat/completions", chat("x", max_tokens=3, min_tokens=5), 400, "min_tokens"),
    ("/v1/chat/completions", chat("x", n=2), 400, "n"),
    ("/v1/chat/completions", chat("x", stream="yes"), 400, "stream"),
    ("/v1/chat/completions", chat("x", max_tokens=20_000), 400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 16_380}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions/render", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions/render", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/chat/completions/render", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions/render", chat("x") | {"model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
async def test_bad_requests(
    http: aiohttp.ClientSession, path: str, body: Any, status: int, param: str | None
) -> None:
    kw: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(path, **kw) as r:
        assert r.status == status
        err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert isinstance(err["code"], str) and err["code"]  # clients branch on it
    if status == 404:
        assert err["code"] == "model_not_found"
    if body == chat("x", n=2):
        assert err["message"] == "n>1 not supported"


async def test_http_level_errors(http: aiohttp.ClientSession) -> None:
    big = json.dumps(chat("x" * (MAX_BODY + 10))).encode()
    async with http.post("/v1/chat/completions", data=big,
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413
        assert "too large" in (await r.json())["error"]["message"]
    async with http.get("/v1/chat/completions") as r:
        assert r.status == 405
        assert "error" in await r.json()
    async with http.get("/no/such/path") as r:
        assert r.status == 404
        assert "error" in await r.json()


# -- information endpoints ---------------------------------------------------------------------
async def test_info_endpoints(http: aiohttp.ClientSession) -> None:
    async with http.get("/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"
    async with http.get("/get_load") as r:
        (load,) = await r.json()
    assert load["dp_rank"] == 0
    assert {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load)
    for path in ("/get_model_info", "/model_info"):
        async with http.get(path) as r:
            info = await r.json()
        assert info["model_path"] == MODEL and info["is_generation"] is True
    for path in ("/get_server_info", "/server_info"):
        async with http.get(path) as r:
            info = await r.json()
        assert info["max_total_num_tokens"] == get_profile(DEFAULT_PROFILE).kv_capacity_tokens
    async with http.get("/version") as r:
        assert "version" in await r.json()
    text = (await (await http.get("/metrics")).text())
    # vLLM 0.32's names and labels (tests/fixtures/vllm_metrics), SGLang's.
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "skymesh_engine_max_num_seqs"):
        assert re.search(rf'^{re.escape(name)}{{engine="0",model_name="{re.escape(MODEL)}"}} ',
                         text, re.M), name
    for reason in ("capacity", "deferred"):
        assert re.search(rf'^vllm:num_requests_waiting_by_reason{{engine="0",model_name='
                         rf'"{re.escape(MODEL)}",reason="{reason}"}} ', text, re.M), reason
    assert "vllm:gpu_cache_usage_perc" not in text  # gone in vLLM 0.32
    for name in ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate"):
        assert re.search(rf'^{re.escape(name)}{{model_name="{re.escape(MODEL)}"}} ', text,
                         re.M), name
    p = get_profile(DEFAULT_PROFILE)
    res = parse_metrics(text)  # what the balancer reads from it
    assert res.kv_capacity_tokens == p.kv_capacity_tokens
    assert res.max_num_seqs == p.max_num_seqs


async def test_tokenize(http: aiohttp.ClientSession) -> None:
    tok = get_tokenizer()
    _, body = await post(http, "/tokenize", {"prompt": "hello world"})
    assert body == {"count": 2, "max_model_len": 16384, "tokens": tok.encode("hello world"),
                    "token_strs": None}
    msgs = [{"role": "user", "content": "hi"}]
    _, body = await post(http, "/tokenize", {"model": MODEL, "messages": msgs})
    assert body["tokens"] == tok.encode(render_chat(msgs))
    assert body["count"] == len(body["tokens"])
    _, back = await post(http, "/detokenize", {"tokens": body["tokens"]})
    assert back["prompt"] == render_chat(msgs)


async def test_render_tokenises_as_generation_does_without_running(
    http: aiohttp.ClientSession,
) -> None:
    """vLLM's /render endpoints (vllm-router's prefix-aware policies call them per request)."""
    tok = get_tokenizer()
    before = (await metrics(http))["vllm:prompt_tokens_total"]
    _, batch = await post(http, "/v1/completions/render", {
        "model": MODEL, "prompt": ["hello world", "goodbye"], "temperature": 0.5})
    assert [b["token_ids"] for b in batch] == [tok.encode("hello world"), tok.encode("goodbye")]
    assert all(b["request_id"].startswith("cmpl-") and b["model"] == MODEL for b in batch)
    assert batch[0]["sampling_params"] == {"temperature": 0.5, "max_tokens": 16}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "more"}]
    _, one = await post(http, "/v1/chat/completions/render", {
        "model": MODEL, "messages": msgs, "stream": True, "max_tokens": 7})
    assert one["token_ids"] == tok.encode(render_chat(msgs))
    assert one["request_id"].startswith("chatcmpl-") and one["stream"] is True
    assert one["sampling_params"] == {"max_tokens": 7}
    # Nothing ran: the engine prefilled no token.
    assert (await metrics(http))["vllm:prompt_tokens_total"] == before


async def test_sigterm_mid_stream_exits_cleanly(tmp_path: Path) -> None:
    d = _start(tmp_path, "--time-scale", "0.05")
    proc = d.proc
    try:
        async with aiohttp.ClientSession(base_url=d.url) as s:
            await until(lambda: _healthy(s), "second replica healthy")
            resp = await s.post("/v1/chat/completions", json=chat(
                "x", max_tokens=4000, ignore_eos=True, stream=True))
            await resp.content.readline()
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(aiohttp.ClientError):
                await resp.read()  # the stream ends instead of hanging
        rc = await asyncio.to_thread(proc.wait, 10)
        assert rc == 0, d.log()
    finally:
        d.stop()


# -- the driver in process ---------------------------------------------------------------------
@pytest.fixture
async def driver() -> AsyncIterator[RealtimeDriver]:
    d = RealtimeDriver(Engine(get_profile(DEFAULT_PROFILE)), seed=3, time_scale=0.02)
    yield d
    await d.close()


async def test_driver_stream_ends(driver: RealtimeDriver) -> None:
    prompt = get_tokenizer().encode("hello there, engine")
    h = driver.submit(prompt, max_tokens=7, ignore_eos=True)
    chunks = [c async for c in h]
    assert [len(c) for c in chunks] == [1] * 7
    assert [t for c in chunks for t in c] == h.output_ids
    assert h.finish_reason == "length" and h.num_delivered == 7
    assert h.arrival <= (h.first_token_time or 0) <= (h.finish_time or 0)
    assert driver.num_open == 0 and driver.engine.num_running == 0


async def test_driver_abort_mid_stream(driver: RealtimeDriver) -> None:
    h = driver.submit([1] * 40, max_tokens=5000, ignore_eos=True)
    got = 0
    async for _ in h:
        got += 1
        if got == 3:
            assert driver.abort(h.request_id)
    assert got == 3 and h.finish_reason == "abort"
    assert driver.engine.num_running == driver.engine.num_waiting == 0
    assert not driver.abort(h.request_id)


async def test_driver_close_ends_streams(driver: RealtimeDriver) -> None:
    handles = [driver.submit([2] * 3000, max_tokens=100, request_id=f"r{i}") for i in range(3)]
    await driver.close()
    assert all(h.finish_reason == "abort" for h in handles)
    for h in handles:
        assert [c async for c in h] == []  # iteration ends at once, no step ever ran
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "engine"]


@pytest.mark.parametrize("tok", [get_tokenizer(), FallbackTokenizer()], ids=lambda t: t.name)
async def test_driver_output_is_reproducible_and_retokenises(tok: Tokenizer) -> None:
    outs = []
    for _ in range(2):
        d = RealtimeDriver(Engine(get_profile(DEFAULT_PROFILE)), tokenizer=tok, seed=5,
                           time_scale=0.01)
        outs.append([d.submit([3] * 20, max_tokens=300).output_ids for _ in range(3)])
        await d.close()
    assert outs[0] == outs[1]
    for ids in outs[0]:
        assert tok.encode(tok.decode(ids)) == ids
        head = tok.encode(render_chat([{"role": "user", "content": "q"}]))
        assert tok.encode(tok.decode(head) + tok.decode(ids)) == head + ids


async def test_driver_rejects_overlong() -> None:
    d = RealtimeDriver(Engine(get_profile(DEFAULT_PROFILE)), time_scale=0.01)
    try:
        with pytest.raises(ValueError, match="context length"):
            d.submit([1] * 16_000, max_tokens=1000)
        with pytest.raises(ValueError, match="context length"):
            d.submit([1] * 16_384)
        d.submit([1] * 10, request_id="dup")
        with pytest.raises(ValueError, match="duplicate") as info:
            d.submit([1] * 10, request_id="dup")
        assert not isinstance(info.value, ContextLengthError)
    finally:
        await d.close()


def test_list_profiles() -> None:
    out = subprocess.run([*executable("skymesh-replica"), "--list-profiles"],
                         capture_output=True, text=True,
                         timeout=30, check=True)
    assert DEFAULT_PROFILE in out.stdout.split()


async def test_its_own_metric_names_pass_promtool(http: aiohttp.ClientSession) -> None:
    """``promtool check metrics`` finds nothing to say of the replica's own metrics; the
    engines' names it copies (``vllm:``, ``sglang:``) are theirs, colons included."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (make system-deps installs it)")
    async with http.get("/metrics") as r:
        text = await r.text()
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert any(p.startswith("vllm:") for p in problems), problems  # promtool did read it
    ours = [p for p in problems if not p.startswith(("vllm:", "sglang:"))]
    assert not ours, ours
    assert "skymesh_engine_steps_total" in text
