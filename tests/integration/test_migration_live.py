"""Predictive routing in the live balancer: deadlines, SLO classes, length predictions and
GoodServe's mid-stream migration, with real replica and balancer processes.

The fleet is heterogeneous: a slow replica (L4 profile) and a fast one (H100), both at
time scale 0.2 with the same ``--seed``, so a request with a given per-request ``seed``
produces the same tokens on either. At this scale, one decode step of a lone request takes
about 11.1 ms on the L4 and 1.3 ms on the H100 (``Profile.step_time``).

GoodServe learns replica speeds from completed streams; to make its first placement
deterministic the balancer is given per-replica decode priors (``decode_priors``, a
GoodServe parameter). In the migration test the L4's prior is deliberately 4x optimistic:
the model of a replica whose real speed has fallen behind what the router believes (a
co-tenant burst, a stale estimate). GoodServe then places a deadline request on the L4
("just enough"), sees it fall behind while it streams, and moves it to the H100.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from support import get_metrics, read_sse, until

from skymesh.util.procs import Daemon, start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TIME_SCALE = 0.2
L4_DECODE_S = 0.0556 * TIME_SCALE  # llama3.1-8b-l4, one sequence (Profile.step_time)
H100_DECODE_S = 0.0063 * TIME_SCALE  # llama3.1-8b-h100


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    tmp = tmp_path_factory.mktemp("fleet")
    slow = start_daemon("skymesh-replica", ["--port", "0", "--profile", "llama3.1-8b-l4",
                                            "--time-scale", str(TIME_SCALE), "--seed", "7"],
                        log_path=tmp / "l4.log")
    try:
        fast = start_daemon("skymesh-replica", ["--port", "0", "--profile",
                                                "llama3.1-8b-h100", "--time-scale",
                                                str(TIME_SCALE), "--seed", "7"],
                            log_path=tmp / "h100.log")
    except BaseException:
        slow.stop()
        raise
    try:
        yield slow, fast
    finally:
        slow.stop()
        fast.stop()


def start_lb(tmp: Path, slow: Daemon, fast: Daemon, *, l4_prior: float,
             migration: bool = True, **extra: Any) -> Daemon:
    cfg: dict[str, Any] = {
        "region": "test",
        # One process: the tests read exact counters and the migrations log of one
        # balancer (/metrics, /status).
        "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
        # length_margin 1 (the paper's raw length): with the optimistic L4 prior the
        # request is placed on the L4, which is the setup these migration tests need.
        "policy": {"name": "goodserve", "params": {
            "decode_priors": {slow.url: l4_prior, fast.url: H100_DECODE_S},
            "length_margin": 1.0,
            "migration": migration, "migration_interval_s": 0.02}},
        "probe": {"interval_s": 0.05},
        "prediction": {"predictor": "none"},
        "replicas": [{"url": slow.url}, {"url": fast.url}],
        **extra,
    }
    path = tmp / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(path), "--log-level", "info"],
                        log_path=tmp / "lb.log")


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def ready(s: aiohttp.ClientSession, lb: Daemon, replicas: int = 2) -> None:
    async def ok() -> bool:
        try:
            async with s.get(lb.url + "/ready") as r:
                return r.status == 200 and (await r.json())["healthy_replicas"] == replicas
        except aiohttp.ClientError:
            return False
    await until(ok, f"{replicas} replicas healthy behind the balancer")


async def status(s: aiohttp.ClientSession, lb: Daemon) -> dict[str, Any]:
    async with s.get(lb.url + "/status") as r:
        out: dict[str, Any] = await r.json()
        return out


async def post_stream(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any],
                      headers: dict[str, str] | None = None) -> list[Any]:
    async with s.post(url + path, json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        return await read_sse(r)


def texts(events: list[Any]) -> list[str]:
    """The text of each token event, in order (role and usage chunks left out)."""
    out = []
    for ev in events:
        if not isinstance(ev, dict) or not ev.get("choices"):
            continue
        ch = ev["choices"][0]
        if "delta" in ch:
            if "role" in ch["delta"]:
                continue
            out.append(ch["delta"].get("content") or "")
        else:
            out.append(ch.get("text") or "")
    return out


async def tokenize(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[int]:
    async with s.post(url + "/tokenize", json=body) as r:
        assert r.status == 200
        ids: list[int] = (await r.json())["tokens"]
        return ids


N = 150  # output tokens; about 1.7 s alone on the L4, 0.19 s on the H100
DEADLINE_MS = 550  # feasible on the L4 only under the optimistic prior


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_goodserve_moves_a_late_stream_to_the_fast_replica_and_the_client_sees_one_stream(
        fleet: tuple[Daemon, Daemon], tmp_path: Path, session: aiohttp.ClientSession,
        kind: str) -> None:
    slow, fast = fleet
    lb = start_lb(tmp_path, slow, fast, l4_prior=L4_DECODE_S / 4)
    try:
        await ready(session, lb)
        l4_aborted = await aborted(session, slow)
        common = {"model": MODEL, "max_tokens": N, "ignore_eos": True, "seed": 11,
                  "stream": True, "stream_options": {"include_usage": True}}
        if kind == "chat":
            path = "/v1/chat/completions"
            body = {**common, "messages": [{"role": "user",
                                            "content": "Describe the river in spring."}]}
            prompt_req: dict[str, Any] = {"model": MODEL, "messages": body["messages"]}
        else:
            path = "/v1/completions"
            body = {**common, "prompt": "The river in spring is"}
            prompt_req = {"model": MODEL, "prompt": body["prompt"]}
        events = await post_stream(session, lb.url, path, body,
                                   {"X-SkyMesh-Deadline-Ms": str(DEADLINE_MS)})

        st = await status(session, lb)
        assert st["migrations"]["total"] == 1
        move = st["migrations"]["recent"][0]
        assert (move["source"], move["target"]) == (slow.url, fast.url)
        k = move["tokens_streamed"]
        assert 1 <= k < N
        m = await get_metrics(session, lb.url)
        assert m[f'skymesh_migrations_total{{source="{slow.url}",target="{fast.url}"}}'] == 1

        # One response: one [DONE] at the end, one role chunk (chat), one id/created/model.
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [e for e in events if isinstance(e, dict)]
        assert not any("error" in e for e in chunks)
        heads = {(e["id"], e["object"], e["created"], e["model"]) for e in chunks}
        assert len(heads) == 1
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        assert next(iter(heads))[1] == obj
        roles = [i for i, e in enumerate(chunks)
                 if e["choices"] and "role" in e["choices"][0].get("delta", {})]
        assert roles == ([0] if kind == "chat" else [])
        got = texts(events)
        assert len(got) == N
        finishes = [e["choices"][0]["finish_reason"] for e in chunks if e["choices"]]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        usage = chunks[-1]["usage"]
        prompt_ids = await tokenize(session, fast.url, prompt_req)
        assert usage == {"prompt_tokens": len(prompt_ids), "completion_tokens": N,
                         "total_tokens": len(prompt_ids) + N}

        await check_continued(session, fast, path, body, prompt_ids, got, k)
        await until(lambda: drained(session, lb), "in-flight counts back to zero")
        m = await get_metrics(session, lb.url)
        assert m[f'skymesh_requests_total{{model="{MODEL}",outcome="ok"}}'] == 1
        # The L4's upstream request was cancelled, not left running to its end.
        assert await aborted(session, slow) == l4_aborted + 1
    finally:
        lb.stop()


async def check_continued(s: aiohttp.ClientSession, fast: Daemon, path: str,
                          body: dict[str, Any], prompt_ids: list[int], got: list[str],
                          k: int) -> None:
    """No token lost, duplicated or reordered: the first ``k`` are the unmigrated run's
    first k; the rest are exactly what the fast replica continues with when given prompt
    + those k tokens (the same request seed; both replicas run --seed 7)."""
    direct = texts(await post_stream(s, fast.url, path, body))
    assert len(direct) == N
    assert got[:k] == direct[:k]
    gen_ids = await tokenize(s, fast.url, {"model": MODEL, "prompt": "".join(direct[:k])})
    assert len(gen_ids) == k
    cont = {"model": MODEL, "prompt": prompt_ids + gen_ids, "max_tokens": N - k,
            "ignore_eos": True, "seed": body["seed"], "stream": True}
    rest = texts(await post_stream(s, fast.url, "/v1/completions", cont))
    assert got[k:] == rest


async def drained(s: aiohttp.ClientSession, lb: Daemon) -> bool:
    """The balancer settled every attempt: nothing in flight, nothing queued."""
    st = await status(s, lb)
    return st["queued"] == 0 and all(r["in_flight"] == 0 for r in st["replicas"].values())


async def _route(s: aiohttp.ClientSession, lb: Daemon, replicas: dict[str, str],
                 headers: dict[str, str], max_tokens: int = 40) -> str:
    """Send one non-streamed request; the name of the replica GoodServe routed it to."""
    before = await get_metrics(s, lb.url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}],
            "max_tokens": max_tokens, "ignore_eos": True}
    async with s.post(lb.url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
    after = await get_metrics(s, lb.url)
    moved = [name for url, name in replicas.items()
             if after.get(f'skymesh_routing_decisions_total{{policy="goodserve",target="{url}"}}',
                          0) > before.get(
                 f'skymesh_routing_decisions_total{{policy="goodserve",target="{url}"}}', 0)]
    assert len(moved) == 1
    return moved[0]


SLO = {"classes": {"interactive": 0.09, "batch": 60.0}}


async def test_deadline_header_and_slo_class_reach_goodserve(
        fleet: tuple[Daemon, Daemon], tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """40 output tokens: 0.12 s predicted on the L4, 0.06 s on the H100. GoodServe takes
    the fastest replica without a deadline and the slowest one that meets it with one, so
    the replica it picks shows which deadline it saw. Non-streamed requests teach it no
    speeds, so its estimates stay the priors throughout."""
    slow, fast = fleet
    lb = start_lb(tmp_path, slow, fast, l4_prior=L4_DECODE_S / 4, migration=False, slo=SLO)
    names = {slow.url: "l4", fast.url: "h100"}
    try:
        await ready(session, lb)
        assert await _route(session, lb, names, {}) == "h100"
        assert await _route(session, lb, names, {"X-SkyMesh-Deadline-Ms": "60000"}) == "l4"
        assert await _route(session, lb, names, {"X-SkyMesh-SLO-Class": "batch"}) == "l4"
        assert await _route(session, lb, names, {"X-SkyMesh-SLO-Class": "interactive"}) == "h100"
        # Both given: the tighter one holds.
        assert await _route(session, lb, names, {"X-SkyMesh-SLO-Class": "interactive",
                                                 "X-SkyMesh-Deadline-Ms": "60000"}) == "h100"
        assert await _route(session, lb, names, {"X-SkyMesh-SLO-Class": "batch",
                                                 "X-SkyMesh-Deadline-Ms": "90"}) == "h100"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(lb.url + "/v1/chat/completions", json=body,
                                headers={"X-SkyMesh-SLO-Class": "gold"}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert "gold" in err["message"] and "X-SkyMesh-SLO-Class" in err["message"]
            assert err["type"] == "invalid_request_error"
        st = await status(session, lb)
        assert st["prediction"]["in_use"] is False  # predictor: none
    finally:
        lb.stop()


async def test_predicted_length_reaches_goodserve_with_history_fallback_for_a_missing_model(
        fleet: tuple[Daemon, Daemon], tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """With the MoE model file missing, the balancer starts at once and predicts with the
    history baseline. After three 4-token answers it predicts 4 tokens (capped by nothing
    else), so an interactive request asking for up to 40 now fits the L4's 0.09 s budget
    and goes there, where with no prediction (previous test) it went to the H100."""
    slow, fast = fleet
    missing = tmp_path / "no-such-model.pt"
    lb = start_lb(tmp_path, slow, fast, l4_prior=L4_DECODE_S / 4, migration=False, slo=SLO,
                  prediction={"predictor": "moe", "model_path": str(missing)})
    names = {slow.url: "l4", fast.url: "h100"}
    try:
        await ready(session, lb)
        st = await status(session, lb)
        assert st["prediction"]["in_use"] is True
        assert st["prediction"]["active"] == "history"
        assert str(missing) in st["prediction"]["error"]
        for _ in range(3):
            await _route(session, lb, names, {}, max_tokens=4)
        assert await _route(session, lb, names, {"X-SkyMesh-SLO-Class": "interactive"}) == "l4"
        st = await status(session, lb)
        assert st["prediction"]["predictions"] == 4
        assert "history baseline" in lb.log_path.read_text()
    finally:
        lb.stop()


async def replica_load(s: aiohttp.ClientSession, replica: Daemon) -> tuple[float, float]:
    async with s.get(replica.url + "/metrics") as r:
        text = await r.text()
    vals = {}
    for line in text.splitlines():
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                vals[name] = float(line.rsplit(" ", 1)[1])
    return vals["vllm:num_requests_running"], vals["vllm:num_requests_waiting"]


async def aborted(s: aiohttp.ClientSession, replica: Daemon) -> float:
    async with s.get(replica.url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("skymesh_engine_requests_aborted"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no skymesh_engine_requests_aborted on the replica")


async def test_a_client_that_leaves_after_the_move_aborts_the_continuation(
        fleet: tuple[Daemon, Daemon], tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """400 tokens, a deadline 1.3x what the optimistic prior predicts on the L4: moved
    about 40 tokens in, and the client leaves at 100, with some 0.4 s of work left on the
    H100. Both upstream requests end as aborted on their replicas and the balancer's
    counters settle."""
    slow, fast = fleet
    lb = start_lb(tmp_path, slow, fast, l4_prior=L4_DECODE_S / 4)
    n = 400
    deadline_ms = round(1300 * n * L4_DECODE_S / 4)
    try:
        await ready(session, lb)
        before = [await aborted(session, rep) for rep in (slow, fast)]
        body = {"model": MODEL, "max_tokens": n, "ignore_eos": True, "seed": 3,
                "stream": True, "prompt": "Rivers"}
        seen = 0
        async with session.post(lb.url + "/v1/completions", json=body,
                                headers={"X-SkyMesh-Deadline-Ms": str(deadline_ms)}) as r:
            assert r.status == 200
            async for line in r.content:
                seen += line.startswith(b"data: {")
                if seen == 100:
                    break
            assert (await status(session, lb))["migrations"]["total"] == 1
            r.close()  # the client goes away mid-stream

        async def settled() -> bool:
            st = await status(session, lb)
            load = [await replica_load(session, rep) for rep in (slow, fast)]
            return (st["queued"] == 0 and st["migrations"]["open_streams"] == 0
                    and all(v["in_flight"] == 0 for v in st["replicas"].values())
                    and load == [(0.0, 0.0), (0.0, 0.0)])
        await until(settled, "no request left on either replica or in the balancer")
        after = [await aborted(session, rep) for rep in (slow, fast)]
        # The L4's attempt was cancelled by the move, the H100's by the client leaving.
        assert [a - b for a, b in zip(after, before, strict=True)] == [1.0, 1.0]
    finally:
        lb.stop()


async def test_a_late_non_streamed_request_is_not_migrated(
        fleet: tuple[Daemon, Daemon], tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """Placed on the L4 under the optimistic prior and late there, but the balancer does
    not see a non-streamed request's progress: it finishes where it started."""
    slow, fast = fleet
    lb = start_lb(tmp_path, slow, fast, l4_prior=L4_DECODE_S / 4)
    names = {slow.url: "l4", fast.url: "h100"}
    try:
        await ready(session, lb)
        assert await _route(session, lb, names, {"X-SkyMesh-Deadline-Ms": "200"},
                            max_tokens=60) == "l4"
        assert (await status(session, lb))["migrations"]["total"] == 0
    finally:
        lb.stop()


@pytest.fixture
async def refusing_proxy(fleet: tuple[Daemon, Daemon]) -> AsyncIterator[tuple[str, list[str]]]:
    """A replica whose continuations fail: a proxy to the H100 that answers everything as
    the H100 does except a ``/v1/completions`` whose prompt is token ids (a migrated
    request's continuation), which gets a 500. Yields its URL and the refused prompts."""
    fast = fleet[1]
    refused: list[str] = []
    async with aiohttp.ClientSession() as client:
        async def forward(request: web.Request) -> web.Response:
            raw = await request.read()
            if request.path == "/v1/completions" and isinstance(
                    json.loads(raw).get("prompt"), list):
                refused.append(request.path)
                return web.json_response({"error": {"message": "engine fault",
                                                    "type": "server_error"}}, status=500)
            async with client.request(request.method, fast.url + request.path_qs,
                                      data=raw or None, headers={
                                          "Content-Type": request.content_type}) as r:
                return web.Response(body=await r.read(), status=r.status,
                                    headers={"Content-Type": r.headers["Content-Type"]})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            yield f"http://127.0.0.1:{port}", refused
        finally:
            await runner.cleanup()


async def test_a_failed_cut_over_is_retried_on_another_replica(
        fleet: tuple[Daemon, Daemon], refusing_proxy: tuple[str, list[str]], tmp_path: Path,
        session: aiohttp.ClientSession) -> None:
    """GoodServe moves a late stream to the slowest replica that still makes its deadline:
    the proxy, believed 1.5x slower than the H100. Its continuation fails before a byte, so
    the balancer re-offers it, never to the proxy or the source again, and the H100
    continues. The client sees one correct stream and no error."""
    slow, fast = fleet
    proxy, refused = refusing_proxy
    lb = start_lb(tmp_path, slow, fast, l4_prior=L4_DECODE_S / 4,
                  replicas=[{"url": slow.url}, {"url": proxy}, {"url": fast.url}],
                  policy={"name": "goodserve", "params": {
                      "decode_priors": {slow.url: L4_DECODE_S / 4, proxy: 1.5 * H100_DECODE_S,
                                        fast.url: H100_DECODE_S},
                      "length_margin": 1.0, "migration_interval_s": 0.02}})
    try:
        await ready(session, lb, replicas=3)
        body = {"model": MODEL, "max_tokens": N, "ignore_eos": True, "seed": 11,
                "stream": True, "stream_options": {"include_usage": True},
                "prompt": "The river in spring is"}
        events = await post_stream(session, lb.url, "/v1/completions", body,
                                   {"X-SkyMesh-Deadline-Ms": str(DEADLINE_MS)})
        assert refused == ["/v1/completions"]
        st = await status(session, lb)
        assert st["migrations"]["total"] == 1
        move = st["migrations"]["recent"][0]
        assert (move["source"], move["target"]) == (slow.url, proxy)
        m = await get_metrics(session, lb.url)
        assert m[f'skymesh_retries_total{{target="{proxy}"}}'] == 1
        assert m[f'skymesh_requests_total{{model="{MODEL}",outcome="ok"}}'] == 1

        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert not any(isinstance(e, dict) and "error" in e for e in events)
        got = texts(events)
        assert len(got) == N
        prompt_ids = await tokenize(session, fast.url, {"model": MODEL,
                                                        "prompt": body["prompt"]})
        await check_continued(session, fast, "/v1/completions", body, prompt_ids, got,
                              move["tokens_streamed"])
        await until(lambda: drained(session, lb), "in-flight counts back to zero")
    finally:
        lb.stop()
