"""skymesh-lb end to end: real replica and balancer processes on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support import content_of, get_metrics, read_sse, start_lb_with, until

from skymesh.util.procs import Daemon, start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TIME_SCALE = 0.1


def start_replicas(tmp: Path, n: int, *extra: str) -> list[Daemon]:
    return [start_daemon("skymesh-replica",
                         ["--port", "0", "--time-scale", str(TIME_SCALE), "--seed", "7",
                          *extra], log_path=tmp / f"replica{i}.log")
            for i in range(n)]


def start_lb(tmp: Path, replicas: list[Daemon], **overrides: Any) -> Daemon:
    cfg: dict[str, Any] = {
        "region": "test",
        # One process (not one per core): these tests read one balancer's exact counters,
        # queue and per-replica state from /metrics and /status.
        "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
        "policy": {"name": "least-load"},
        "probe": {"interval_s": 0.05},
        "replicas": [{"url": r.url} for r in replicas],
    }
    return start_lb_with(tmp, cfg, overrides)


def stop_all(daemons: list[Daemon]) -> None:
    for d in daemons:
        d.stop()


@pytest.fixture(scope="module")
def mesh1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, list[Daemon]]]:
    tmp = tmp_path_factory.mktemp("lb")
    reps = start_replicas(tmp, 3)
    lb = start_lb(tmp, reps, limits={"max_body_bytes": 65536})
    try:
        yield lb, reps
    finally:
        stop_all([lb, *reps])


async def ready(session: aiohttp.ClientSession, lb: Daemon, n: int) -> None:
    async def ok() -> bool:
        try:
            async with session.get(lb.url + "/ready") as r:
                return r.status == 200 and (await r.json())["healthy_replicas"] == n
        except aiohttp.ClientError:
            return False
    await until(ok, f"{n} healthy replicas behind the balancer")


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def stream_text(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                      ) -> tuple[int, list[Any]]:
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            return r.status, [await r.json()]
        return r.status, await read_sse(r)


async def status(session: aiohttp.ClientSession, lb: Daemon) -> dict[str, Any]:
    async with session.get(lb.url + "/status") as r:
        out: dict[str, Any] = await r.json()
        return out


async def drained(session: aiohttp.ClientSession, lb: Daemon) -> bool:
    st = await status(session, lb)
    return st["queued"] == 0 and all(r["in_flight"] == 0 for r in st["replicas"].values())


async def test_hundreds_of_concurrent_streams_arrive_intact_and_in_order(
        mesh1: tuple[Daemon, list[Daemon]]) -> None:
    lb, reps = mesh1
    n = 200
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await ready(s, lb, 3)
        bodies = [chat(f"question {i % 7} " + "shared context " * 20, max_tokens=12,
                       ignore_eos=True, seed=1000 + i, stream=True,
                       stream_options={"include_usage": True}) for i in range(n)]
        results = await asyncio.gather(*(stream_text(s, lb.url, b) for b in bodies))
        # The same request straight to a replica (same per-request seed) gives the same
        # text: through the balancer nothing was dropped, duplicated or reordered.
        direct = await asyncio.gather(*(stream_text(s, reps[i % 3].url, bodies[i])
                                        for i in range(0, n, 20)))
        for code, events in results:
            assert code == 200
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == 12
            assert sum(1 for e in events[:-2] if e["choices"][0]["delta"].get("content")) == 12
        for j, (code, events) in zip(range(0, n, 20), direct, strict=True):
            assert code == 200
            assert content_of(results[j][1]) == content_of(events)
        await until(lambda: drained(s, lb), "in-flight counts back to zero")
        m = await get_metrics(s, lb.url)
        assert m[f'skymesh_requests_total{{model="{MODEL}",outcome="ok"}}'] >= n


async def test_models_health_and_metrics(mesh1: tuple[Daemon, list[Daemon]]) -> None:
    lb, _ = mesh1
    async with aiohttp.ClientSession() as s:
        await ready(s, lb, 3)
        async with s.get(lb.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
        async with s.get(lb.url + "/health") as r:
            assert r.status == 200
        m = await get_metrics(s, lb.url)
        assert "skymesh_replica_healthy" in m and m["skymesh_replica_healthy"] == 3


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"{not json", 400, None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model"),
    (json.dumps({"model": MODEL}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": "nope"}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": [], "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                 "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "no-such-model",
                 "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 70000}]}
                ).encode(), 413, None),
])
async def test_bad_input_gets_openai_errors(mesh1: tuple[Daemon, list[Daemon]], body: bytes,
                                            status: int, param: str | None) -> None:
    lb, _ = mesh1
    async with aiohttp.ClientSession() as s:
        async with s.post(lb.url + "/v1/chat/completions", data=body,
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == status
            err = (await r.json())["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["message"]
            if param is not None:
                assert err["param"] == param
        assert lb.alive()
        await until(lambda: drained(s, lb), "nothing left queued")


async def test_made_up_model_names_add_no_metric_series(
        mesh1: tuple[Daemon, list[Daemon]]) -> None:
    """A client's model name becomes a metric label only once the model is known to be
    served: made-up names would otherwise grow /metrics (and memory) without bound."""
    lb, _ = mesh1
    async with aiohttp.ClientSession() as s:
        for i in range(5):
            body = chat("x", model=f"made-up-{i}")
            async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 404
        text = await (await s.get(lb.url + "/metrics")).text()
        assert "made-up-" not in text
        m = await get_metrics(s, lb.url)
        assert m['skymesh_requests_total{model="?",outcome="ModelNotFound"}'] >= 5


@pytest.mark.parametrize(("pieces", "status"), [
    ([b'{"model": "%s", "messages": ' % MODEL.encode(),
      b'[{"role": "user", "content": "hi"}], "max_tokens": 2}'], 200),
    ([b'{"model": "x", "messages": [{"role": "user", "content": "'] + [b"x" * 8192] * 9
     + [b'"}]}'], 413),
])
async def test_a_chunked_body_in_pieces_is_read_whole_and_capped(
        mesh1: tuple[Daemon, list[Daemon]], pieces: list[bytes], status: int) -> None:
    # No Content-Length: the body arrives after the headers, in pieces, and the limit
    # (64 KiB here) must hold while reading rather than from a declared length.
    lb, _ = mesh1

    async def body() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    async with aiohttp.ClientSession() as s:
        async with s.post(lb.url + "/v1/chat/completions", data=body(),
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == status, await r.text()
            out = await r.json()
            assert ("choices" in out) if status == 200 else out["error"]["message"]
        assert lb.alive()
        await until(lambda: drained(s, lb), "nothing left queued")


async def test_client_disconnect_cancels_upstream(mesh1: tuple[Daemon, list[Daemon]]) -> None:
    lb, reps = mesh1

    async def running() -> float:
        total = 0.0
        for r in reps:
            total += (await get_metrics(s, r.url)).get("vllm:num_requests_running", 0.0)
        return total

    async with aiohttp.ClientSession() as s:
        await ready(s, lb, 3)
        body = chat("tell me a long story", max_tokens=5000, ignore_eos=True, stream=True)
        r = await s.post(lb.url + "/v1/chat/completions", json=body)
        assert r.status == 200
        await r.content.readline()

        async def one_running() -> bool:
            return await running() == 1.0

        await until(one_running, "the request runs on a replica")
        r.close()  # the client goes away mid-stream

        async def none_running() -> bool:
            return await running() == 0.0

        await until(none_running, "the replica aborted the request")
        await until(lambda: drained(s, lb), "balancer released the request")


async def test_full_queue_answers_429_and_leaks_nothing(tmp_path: Path) -> None:
    reps = start_replicas(tmp_path, 1)
    lb = start_lb(tmp_path, reps, queue={"max_length": 2, "timeout_s": 30})
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await ready(s, lb, 1)
            # Long prompts fill the L4 profile's KV cache, so the replica reports waiting
            # requests and selective pushing holds the rest at the balancer.
            long = "word " * 3000
            bodies = [chat(f"{i} {long}", max_tokens=40, ignore_eos=True) for i in range(40)]

            async def one(b: dict[str, Any]) -> tuple[int, str | None]:
                async with s.post(lb.url + "/v1/chat/completions", json=b) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After")

            results = await asyncio.gather(*(one(b) for b in bodies))
            codes = [c for c, _ in results]
            assert codes.count(429) > 0, codes
            assert all(ra is not None and int(ra) >= 1 for c, ra in results if c == 429)
            assert set(codes) <= {200, 429}
            await until(lambda: drained(s, lb), "in-flight and queue back to zero")
    finally:
        stop_all([lb, *reps])


async def test_queue_timeout_gives_503(tmp_path: Path) -> None:
    reps = start_replicas(tmp_path, 1)
    lb = start_lb(tmp_path, reps, queue={"max_length": 100, "timeout_s": 0.3})
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await ready(s, lb, 1)
            long = "word " * 3000
            bodies = [chat(f"{i} {long}", max_tokens=300, ignore_eos=True) for i in range(30)]

            async def one(b: dict[str, Any]) -> int:
                async with s.post(lb.url + "/v1/chat/completions", json=b) as r:
                    body = await r.json()
                    if r.status == 503:
                        assert body["error"]["code"] == "no_capacity"
                    return r.status

            codes = await asyncio.gather(*(one(b) for b in bodies))
            assert 503 in codes and 200 in codes
            await until(lambda: drained(s, lb), "nothing leaked", timeout=60)
    finally:
        stop_all([lb, *reps])


SAMPLE_EVERY_S = 0.01  # a sampling cadence, not a wait for a condition


async def _sample_waiting(s: aiohttp.ClientSession, reps: list[Daemon], stop: asyncio.Event,
                          out: list[float]) -> None:
    while not stop.is_set():
        for r in reps:
            m = await get_metrics(s, r.url)
            out.append(m["vllm:num_requests_waiting"])
        await asyncio.sleep(SAMPLE_EVERY_S)


async def _waiting_under_load(tmp_path: Path, mode: str) -> list[float]:
    tmp_path.mkdir()
    """Replica-reported waiting counts, sampled while 50 long requests go through."""
    reps = start_replicas(tmp_path, 2)
    lb = start_lb(tmp_path, reps, pushing={"mode": mode}, probe={"interval_s": 0.02})
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await ready(s, lb, 2)
            long = "word " * 1500
            bodies = [chat(f"{i} {long}", max_tokens=60, ignore_eos=True) for i in range(50)]
            samples: list[float] = []
            stop = asyncio.Event()
            sampler = asyncio.create_task(_sample_waiting(s, reps, stop, samples))

            async def one(b: dict[str, Any]) -> int:
                async with s.post(lb.url + "/v1/chat/completions", json=b) as r:
                    await r.read()
                    return r.status

            codes = await asyncio.gather(*(one(b) for b in bodies))
            stop.set()
            await sampler
            assert codes == [200] * len(bodies)
            await until(lambda: drained(s, lb), "drained")
            return samples
    finally:
        stop_all([lb, *reps])


async def test_sp_p_never_piles_onto_a_replica_that_reports_pending(tmp_path: Path) -> None:
    spp = await _waiting_under_load(tmp_path / "spp", "sp-p")
    bp = await _waiting_under_load(tmp_path / "bp", "bp")
    # SP-P stops pushing as soon as a probe shows one waiting request (the one that found
    # the replica full); a second can only come from a preemption inside the replica.
    assert max(spp) <= 2, max(spp)
    # Blind pushing queues at the replicas instead: the same load shows deep queues there.
    assert max(bp) >= 5 and sum(bp) / len(bp) > 4 * sum(spp) / len(spp)


async def test_replica_killed_mid_run(tmp_path: Path) -> None:
    reps = start_replicas(tmp_path, 3)
    lb = start_lb(tmp_path, reps, pushing={"mode": "bp"},
                  probe={"interval_s": 0.05, "failure_threshold": 3})
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await ready(s, lb, 3)
            # 1. Long streams on every replica; kill one replica once they all started.
            long_bodies = [chat(f"story {i}", max_tokens=400, ignore_eos=True, stream=True)
                           for i in range(9)]
            started = asyncio.Event()
            got_first = 0

            async def streamed(b: dict[str, Any]) -> list[Any]:
                nonlocal got_first
                async with s.post(lb.url + "/v1/chat/completions", json=b) as r:
                    assert r.status == 200
                    events: list[Any] = []
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: "):
                            continue
                        if not events:
                            got_first += 1
                            if got_first == len(long_bodies):
                                started.set()
                        data = line[6:]
                        events.append(data if data == "[DONE]" else json.loads(data))
                    return events

            tasks = [asyncio.create_task(streamed(b)) for b in long_bodies]
            await asyncio.wait_for(started.wait(), 30)
            reps[0].kill()
            # 2. Right after the kill, before probes notice, a burst: the balancer still
            # sends some to the dead replica, fails to connect and retries elsewhere.
            burst = [chat(f"after {i}", max_tokens=5, ignore_eos=True) for i in range(12)]

            async def plain(b: dict[str, Any]) -> int:
                async with s.post(lb.url + "/v1/chat/completions", json=b) as r:
                    await r.read()
                    return r.status

            burst_codes = await asyncio.wait_for(asyncio.gather(*(plain(b) for b in burst)), 30)
            streams = await asyncio.wait_for(asyncio.gather(*tasks), 60)

            assert burst_codes == [200] * len(burst)  # none lost: retried before first byte
            broken = [ev for ev in streams if isinstance(ev[-2], dict) and "error" in ev[-2]]
            whole = [ev for ev in streams if ev not in broken]
            # Streams on the dead replica end with an explicit error event and [DONE];
            # the others are complete. Nothing hangs, nothing is silently truncated.
            assert 1 <= len(broken) <= 5
            for ev in broken:
                assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "upstream_failed"
            for ev in whole:
                assert ev[-1] == "[DONE]"
                assert sum(1 for e in ev[:-1] if e["choices"][0]["delta"].get("content")) == 400
            m = await get_metrics(s, lb.url)
            assert m.get("skymesh_retries_total", 0) >= 1
            await ready(s, lb, 2)
            await until(lambda: drained(s, lb), "in-flight back to zero")
    finally:
        stop_all([lb, *reps])


async def test_a_conversations_next_turn_returns_to_the_replica_caching_its_reply(
        tmp_path: Path) -> None:
    """The prefix tree learns the reply each replica relayed (prompt + output are what the
    replica caches), so turn 2, whose history is mostly that reply, goes back to turn 1's
    replica and is served from its cache. With prompts recorded alone, turn 1's prompt is
    a small part of turn 2's and each turn 2 lands on either replica by chance."""
    reps = start_replicas(tmp_path, 2)
    lb = start_lb(tmp_path, reps, policy={"name": "prefix-tree"})
    try:
        async with aiohttp.ClientSession() as s:
            await ready(s, lb, 2)
            for i in range(4):
                msgs = [{"role": "user", "content": f"Conversation {i}: tell me a story."}]
                first = {"model": MODEL, "messages": msgs, "max_tokens": 120,
                         "ignore_eos": True, "seed": 50 + i, "stream": True,
                         "stream_options": {"include_usage": True}}
                code, events = await stream_text(s, lb.url, first)
                assert code == 200
                reply = content_of(events)
                turn1 = events[-2]["usage"]
                nxt = {"model": MODEL, "max_tokens": 4, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [*msgs, {"role": "assistant", "content": reply},
                                    {"role": "user", "content": "Go on."}]}
                code, events = await stream_text(s, lb.url, nxt)
                assert code == 200
                usage = events[-2]["usage"]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                # Turn 2 hit turn 1's prompt and most of its reply on the same replica.
                assert cached >= turn1["prompt_tokens"] + 0.8 * turn1["completion_tokens"] \
                    - 16, (i, cached, turn1)
            await until(lambda: drained(s, lb), "in-flight counts back to zero")
    finally:
        stop_all([lb, *reps])
