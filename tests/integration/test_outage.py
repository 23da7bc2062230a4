"""Overload and outage as a client library meets them: skymesh-lb and emulated replicas
(real processes on loopback), and the official OpenAI SDK's own retry loop.

Every request here has a client-side hang guard well under the balancer's queue timeout:
a request that waited the queue out (instead of failing fast) fails the test."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support import start_lb_with, until

from skymesh.util.procs import Daemon, free_port, start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
QUEUE_TIMEOUT_S = 60  # the wait a fail-fast answer must not come near
GUARD = aiohttp.ClientTimeout(total=20)


def start_replica(tmp: Path, port: int = 0, scale: float = 0.1, tag: str = "") -> Daemon:
    return start_daemon("skymesh-replica", ["--port", str(port), "--time-scale", str(scale),
                                            "--seed", "7"],
                        log_path=tmp / f"replica{tag or port}.log")


def start_lb(tmp: Path, replicas: list[dict[str, Any]], **overrides: Any) -> Daemon:
    cfg: dict[str, Any] = {
        # One process: the tests read one balancer's queue and exact counters.
        "region": "test", "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
        "policy": {"name": "least-load"},
        "probe": {"interval_s": 0.05, "failure_threshold": 2},
        "queue": {"timeout_s": QUEUE_TIMEOUT_S},
        "replicas": replicas,
    }
    return start_lb_with(tmp, cfg, overrides)


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def healthy(s: aiohttp.ClientSession, lb: Daemon, n: int) -> None:
    async def ok() -> bool:
        async with s.get(lb.url + "/ready") as r:
            return (await r.json())["healthy_replicas"] == n
    await until(ok, f"{n} healthy replicas")


async def lb_status(s: aiohttp.ClientSession, lb: Daemon) -> dict[str, Any]:
    async with s.get(lb.url + "/status") as r:
        out: dict[str, Any] = await r.json()
        return out


def check_retry_headers(headers: Any, lo_s: float, hi_s: float) -> float:
    ms = int(headers["retry-after-ms"])
    assert lo_s * 1000 <= ms <= hi_s * 1000, ms
    assert int(headers["Retry-After"]) == -(-ms // 1000)  # whole seconds, rounded up
    return ms / 1000


async def test_replicas_not_reached_yet_give_a_retryable_503_not_a_404(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    lb = start_lb(tmp_path, [{"url": dead}, {"url": "http://127.0.0.1:9", "models": ["conf"]}])
    try:
        async with aiohttp.ClientSession(timeout=GUARD) as s:
            # The unlisted replica may serve any model: 503, whatever the name.
            for model in (MODEL, "conf", "anything"):
                async with s.post(lb.url + "/v1/chat/completions",
                                  json=chat("hi", model=model)) as r:
                    assert r.status == 503, model
                    assert (await r.json())["error"]["code"] == "no_healthy_replica"
                    check_retry_headers(r.headers, 2.0, 3.0)
            async with s.get(lb.url + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["conf"]
    finally:
        lb.stop()
    # With every replica's models known, a model none of them serves is a 404 still;
    # a configured model whose replicas are all down is a 503.
    lb = start_lb(tmp_path, [{"url": dead, "models": ["conf"]}])
    try:
        async with aiohttp.ClientSession(timeout=GUARD) as s:
            async with s.post(lb.url + "/v1/chat/completions",
                              json=chat("hi", model="other")) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "model_not_found"
            async with s.post(lb.url + "/v1/chat/completions",
                              json=chat("hi", model="conf")) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "no_healthy_replica"
    finally:
        lb.stop()


async def test_queued_requests_fail_at_once_when_the_last_replica_goes_down(
        tmp_path: Path) -> None:
    """The replica hangs (SIGSTOP): nothing frees its slot, only the probes see it go.
    Before fail-fast the queued requests sat out the whole queue timeout."""
    rep = start_replica(tmp_path, scale=1.0, tag="0")
    lb = start_lb(tmp_path, [{"url": rep.url}], pushing={"mode": "sp-o", "max_outstanding": 1},
                  probe={"timeout_s": 0.3})
    stopped = False
    try:
        async with aiohttp.ClientSession(timeout=GUARD) as s:
            await healthy(s, lb, 1)
            # One long stream takes the replica's only slot; three more queue here.
            stream = await s.post(lb.url + "/v1/chat/completions",
                                  json=chat("long", max_tokens=4000, ignore_eos=True,
                                            stream=True))
            assert stream.status == 200
            await stream.content.readuntil(b"\n\n")

            async def one(i: int) -> tuple[int, dict[str, Any], Any]:
                async with s.post(lb.url + "/v1/chat/completions",
                                  json=chat(f"q{i}", max_tokens=5)) as r:
                    return r.status, await r.json(), r.headers

            waiting = [asyncio.create_task(one(i)) for i in range(3)]

            async def queued() -> bool:
                return (await lb_status(s, lb))["queued"] == 3
            await until(queued, "three requests queued at the balancer")
            rep.proc.send_signal(signal.SIGSTOP)
            stopped = True
            results = await asyncio.gather(*waiting)
            for status, body, headers in results:
                assert status == 503
                assert body["error"]["code"] == "no_healthy_replica"
                check_retry_headers(headers, 2.0, 3.0)
            stream.close()
            assert (await lb_status(s, lb))["queued"] == 0
    finally:
        if stopped:
            rep.proc.send_signal(signal.SIGCONT)
        lb.stop()
        rep.stop()


async def test_turned_away_requests_are_told_a_spread_honest_retry_after(
        tmp_path: Path) -> None:
    rep = start_replica(tmp_path, scale=0.2, tag="0")
    lb = start_lb(tmp_path, [{"url": rep.url}], pushing={"mode": "sp-o", "max_outstanding": 1},
                  queue={"max_length": 4, "timeout_s": QUEUE_TIMEOUT_S})
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            await healthy(s, lb, 1)

            async def one(i: int, tokens: int = 8) -> tuple[int, Any]:
                async with s.post(lb.url + "/v1/chat/completions",
                                  json=chat(f"q{i}", max_tokens=tokens, ignore_eos=True)) as r:
                    await r.read()
                    return r.status, r.headers

            results = await asyncio.gather(*(one(i) for i in range(30)))
            turned = [h for status, h in results if status == 429]
            assert len(turned) >= 10 and {st for st, _ in results} == {200, 429}
            waits = [check_retry_headers(h, 1.0, 60.0) for h in turned]
            assert len(set(waits)) > len(waits) // 2  # spread, not one instant for all

            # A queue timeout (here the request's own deadline) says when to come back too.
            slow = [asyncio.create_task(one(100 + i, 150)) for i in range(2)]
            await until(lambda: _queued(s, lb, 1), "a request queued again")
            async with s.post(lb.url + "/v1/chat/completions", json=chat("late"),
                              headers={"X-SkyMesh-Deadline-Ms": "300"}) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "no_capacity"
                check_retry_headers(r.headers, 1.0, 60.0)
            assert [st for st, _ in await asyncio.gather(*slow)] == [200] * 2
    finally:
        lb.stop()
        rep.stop()


async def _queued(s: aiohttp.ClientSession, lb: Daemon, n: int) -> bool:
    return (await lb_status(s, lb))["queued"] >= n


# -- the official OpenAI SDK ---------------------------------------------------------------

@pytest.fixture
def down_then_up(tmp_path: Path) -> Iterator[tuple[Daemon, list[Daemon], int]]:
    """A balancer whose only replica has gone down (the balancer knows its model)."""
    pytest.importorskip("openai")  # before any process starts
    first = start_replica(tmp_path, tag="first")
    port = int(first.url.rsplit(":", 1)[1])
    lb = start_lb(tmp_path, [{"url": first.url}])
    reps = [first]
    try:
        asyncio.run(_wait_ready(lb, 1))
        first.kill()
        asyncio.run(_wait_ready(lb, 0))
        yield lb, reps, port
    finally:
        lb.stop()
        for r in reps:
            r.stop()


async def _wait_ready(lb: Daemon, n: int) -> None:
    async with aiohttp.ClientSession(timeout=GUARD) as s:
        await healthy(s, lb, n)


def test_the_openai_sdk_retries_an_outage_into_a_success(
        down_then_up: tuple[Daemon, list[Daemon], int], tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    lb, reps, port = down_then_up
    seen: list[tuple[int, str | None, str | None]] = []

    def on_response(response: Any) -> None:
        response.read()
        code = None
        if response.status_code >= 400:
            code = json.loads(response.content)["error"]["code"]
        seen.append((response.status_code, code, response.headers.get("retry-after-ms")))
        if len(seen) == 1:  # the replica comes back while the SDK waits to retry
            reps.append(start_replica(tmp_path, port=port, tag="again"))

    http = openai.DefaultHttpxClient(event_hooks={"response": [on_response]})
    client = openai.OpenAI(base_url=lb.url + "/v1", api_key="unused", max_retries=4,
                           timeout=20, http_client=http)
    with client:
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
            extra_headers={"X-Request-Id": "sdk-req-1"})
    assert out.choices[0].message.content
    assert out._request_id == "sdk-req-1"  # echoed, and the SDK read it
    assert seen[0][:2] == (503, "no_healthy_replica") and seen[0][2] is not None
    assert seen[-1][0] == 200


def test_the_openai_sdk_sees_codes_and_gives_up_fast(
        down_then_up: tuple[Daemon, list[Daemon], int]) -> None:
    openai = pytest.importorskip("openai")
    lb, _, _ = down_then_up
    attempts: list[int] = []
    http = openai.DefaultHttpxClient(
        event_hooks={"response": [lambda r: attempts.append(r.status_code)]})
    client = openai.OpenAI(base_url=lb.url + "/v1", api_key="unused", max_retries=2,
                           timeout=20, http_client=http)
    with client:
        with pytest.raises(openai.InternalServerError) as exc:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
        assert exc.value.status_code == 503 and exc.value.code == "no_healthy_replica"
        assert attempts == [503, 503, 503]  # retried, each answered at once
        with pytest.raises(openai.NotFoundError) as nf:
            client.models.retrieve("no-such-model")
        assert nf.value.code == "model_not_found"
        assert client.models.retrieve(MODEL).id == MODEL  # listed though down
        with pytest.raises(openai.NotFoundError) as nf:
            client.get(lb.url + "/nope", cast_to=object)
        assert nf.value.code == "not_found"
        with pytest.raises(openai.APIStatusError) as na:
            client.get(lb.url + "/v1/chat/completions", cast_to=object)
        assert na.value.status_code == 405 and na.value.code == "method_not_allowed"
