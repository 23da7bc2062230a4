"""Issue #33 (security-2), the controller: real ``skymesh-controller`` processes over
loopback (a real redis-server where the store matters), plus in-process checks.

1. failover never hands one owner's replica to another owner's balancer; membership is
   polled only by the balancer's own token, with no revision from the future;
3. the token before any body byte, and a body cap counted while streaming;
4. no stored record can make a read fail; policy is admin-only;
5. telemetry bounded per report and per balancer, balancers bounded per agent token;
9. UTF-16 bodies, NUL in names, huge integers.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from controller_support import ADMIN, AGENT, READER, RedisServer, auth, token_config
from fastapi.testclient import TestClient
from support import wait_for

from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_controller.api import build_app
from skymesh_controller.auth import digest
from skymesh_controller.config import parse_config

AGENT2 = "second-agent-token"
TOKENS = [*token_config(), {"name": "lbs-2", "sha256": digest(AGENT2), "role": "agent"}]


@contextlib.contextmanager
def controller_daemon(tmp: Path, store: str = "memory", **cfg: Any) -> Iterator[Daemon]:
    path = tmp / "controller.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0}, "store": store, "tokens": TOKENS,
        "url_policy": {"allow_loopback": True},
        "probe": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2}, **cfg}))
    d = start_daemon("skymesh-controller", ["--config", str(path)],
                     log_path=tmp / "controller.log")
    try:
        yield d
    finally:
        d.stop()


@contextlib.contextmanager
def client(**cfg: Any) -> Iterator[TestClient]:
    config = parse_config({"tokens": TOKENS, "url_policy": {"allow_loopback": True}, **cfg})
    with TestClient(build_app(config, probe=False)) as c:
        assert c.post("/v1/regions", headers=auth(), json={
            "name": "us", "latitude": 1, "longitude": 2}).status_code == 201
        yield c


# -- 1. placement by ownership -------------------------------------------------------------
def test_failover_never_hands_a_replica_to_another_owners_balancer(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """Agent A registers a balancer at a dead URL and homes its live replica there;
    agent B has a live balancer in the same region. Once A's balancer is down, B's
    membership must not get A's replica (before the fix it did, and B's clients' prompts
    went to it)."""
    live = start_daemon("skymesh-replica", ["--port", "0"], log_path=tmp_path / "rep.log")
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        with controller_daemon(tmp_path, redis_server.url) as ctl, \
                httpx.Client(base_url=ctl.url, timeout=10) as c:
            assert c.post("/v1/regions", headers=auth(), json={
                "name": "us", "latitude": 1, "longitude": 2}).status_code == 201
            r = c.post("/v1/balancers", headers=auth(AGENT2),
                       json={"id": "lb-b", "region": "us", "url": live.url})
            assert r.status_code == 201, r.text
            r = c.post("/v1/balancers", headers=auth(AGENT),
                       json={"id": "lb-a", "region": "us", "url": dead})
            assert r.status_code == 201, r.text
            r = c.post("/v1/replicas", headers=auth(AGENT), json={
                "id": "r-a", "url": live.url, "model": "m", "region": "us", "gpu": "L4",
                "balancer": "lb-a"})
            assert r.status_code == 201, r.text

            def settled() -> bool:
                lbs = {b["id"]: b for b in c.get("/v1/balancers", headers=auth()).json()}
                rep = c.get("/v1/replicas/r-a", headers=auth()).json()
                return (lbs["lb-a"]["state"] == "down" and lbs["lb-b"]["state"] == "up"
                        and rep["state"] == "healthy")

            wait_for(settled, "lb-a down, lb-b up, r-a healthy")
            assert c.get("/v1/replicas/r-a", headers=auth()).json()["assigned"] is None
            m = c.get("/v1/balancers/lb-b/membership", headers=auth(AGENT2)).json()
            assert [x["id"] for x in m["replicas"]] == [], m
            # Later probe rounds change nothing: no late move either.
            seen = _balancer_probes(ctl.url)
            wait_for(lambda: _balancer_probes(ctl.url) >= seen + 6, "three more probe rounds")
            m = c.get("/v1/balancers/lb-b/membership", headers=auth(AGENT2)).json()
            assert m["replicas"] == [], m
            # A's own live balancer in the region does take it over.
            r = c.post("/v1/balancers", headers=auth(AGENT),
                       json={"id": "lb-a2", "region": "us", "url": live.url})
            assert r.status_code == 201, r.text
            wait_for(lambda: c.get("/v1/replicas/r-a", headers=auth()).json()["assigned"]
                     == "lb-a2", "r-a failed over to its owner's live balancer")
            m = c.get("/v1/balancers/lb-a2/membership", headers=auth(AGENT)).json()
            assert [x["id"] for x in m["replicas"]] == ["r-a"]
            assert c.get("/v1/balancers/lb-b/membership",
                         headers=auth(AGENT2)).json()["replicas"] == []
    finally:
        live.stop()


async def test_a_planner_move_homes_the_replica_only_where_its_owner_may() -> None:
    from skymesh_controller.auth import Principal
    from skymesh_controller.errors import ApiError
    from skymesh_controller.models import BalancerIn, RegionIn, ReplicaIn
    from skymesh_controller.service import Controller
    from skymesh_controller.store import MemoryStore

    a, b = Principal("lbs", "agent"), Principal("lbs-2", "agent")
    for shared, want in (([], None), (["lbs-2"], "lb-eu")):
        ctl = Controller(parse_config({"tokens": TOKENS, "shared_balancer_owners": shared}),
                         MemoryStore())
        await ctl.start(probe=False)
        try:
            for name in ("us", "eu"):
                await ctl.put_region(RegionIn(name=name, latitude=1, longitude=2))
            await ctl.register_balancer(BalancerIn(id="lb-us", region="us",
                                                   url="http://10.0.0.1"), a)
            await ctl.register_balancer(BalancerIn(id="lb-eu", region="eu",
                                                   url="http://10.0.0.2"), b)
            await ctl.add_replica(ReplicaIn(id="r", url="http://10.0.0.3", model="m",
                                            region="us", gpu="L4", balancer="lb-us"), a)
            await ctl.begin_drain("r")
            assert await ctl.move_home("r", "eu") == want
            if want is None:
                with pytest.raises(ApiError) as err:
                    await ctl.move_replica("r", model="m", region="eu",
                                           url="http://10.0.0.3")
                assert err.value.status == 409 and "may serve" in err.value.message
            else:
                moved = await ctl.move_replica("r", model="m", region="eu",
                                               url="http://10.0.0.3")
                assert moved["balancer"] == moved["assigned"] == "lb-eu"
        finally:
            await ctl.stop()


def _balancer_probes(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('skymesh_controller_probes_total{kind="balancer"'))


def test_membership_only_for_own_balancers_and_no_future_revision() -> None:
    with client() as c:
        for token, bid in ((AGENT, "lb-a"), (AGENT2, "lb-b")):
            assert c.post("/v1/balancers", headers=auth(token), json={
                "id": bid, "region": "us", "url": "http://10.0.0.1"}).status_code == 201
        r = c.get("/v1/balancers/lb-a/membership", headers=auth(AGENT2))
        assert r.status_code == 403 and r.json()["error"]["type"] == "not_owner"
        assert c.get("/v1/balancers/lb-a/membership", headers=auth(AGENT)).status_code == 200
        assert c.get("/v1/balancers/lb-a/membership", headers=auth(ADMIN)).status_code == 200
        # An `after` past the current revision is noted as the current one, not believed:
        # it would tell a planner move that a drain not yet made was applied.
        ctl = c.app.state.controller  # type: ignore[attr-defined]
        rev = c.get("/v1/status", headers=auth()).json()["revision"]
        c.get("/v1/balancers/lb-a/membership", params={"after": 10**9}, headers=auth(AGENT))
        assert ctl.polled["lb-a"] == rev


# -- 3. the token before the body, a cap while streaming ----------------------------------
def _raw(url: str, head: str, chunks: Iterator[bytes], timeout: float = 10.0) -> bytes:
    """Send ``head`` and then chunks until the server answers (or closes); the answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head.encode())
        s.setblocking(False)
        answer = b""
        for chunk in chunks:
            with contextlib.suppress(BlockingIOError):
                answer += s.recv(65536)
            if answer:
                break
            try:
                s.setblocking(True)
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            finally:
                s.setblocking(False)
        s.setblocking(True)
        s.settimeout(timeout)
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while b"\r\n\r\n" not in answer:
                got = s.recv(65536)
                if not got:
                    break
                answer += got
        return answer


def _chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    piece = b"x" * size
    for _ in range(total // size):
        yield b"%x\r\n%s\r\n" % (size, piece)  # never the last chunk: the body never ends


def test_body_without_a_token_is_refused_before_it_is_read(tmp_path: Path) -> None:
    with controller_daemon(tmp_path) as ctl:
        head = ("POST /v1/regions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\n\r\n")
        # 2 MB offered, never finished: the answer must come without the body's end.
        answer = _raw(ctl.url, head, _chunks(2 * 1024 * 1024))
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert b"www-authenticate: bearer" in answer.lower()
        bad = head.replace("\r\n\r\n", "\r\nAuthorization: Bearer nope\r\n\r\n", 1)
        assert _raw(ctl.url, bad, _chunks(2 * 1024 * 1024)).startswith(b"HTTP/1.1 401")


def test_chunked_body_over_the_cap_is_refused_while_it_streams(tmp_path: Path) -> None:
    with controller_daemon(tmp_path, max_body_bytes=64 * 1024) as ctl:
        head = (f"POST /v1/regions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
                "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        answer = _raw(ctl.url, head, _chunks(4 * 1024 * 1024, 16 * 1024))
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        metrics = httpx.get(f"{ctl.url}/metrics").text
        assert 'skymesh_controller_refused_total{reason="body_too_large"} 1.0' in metrics
        # A body under the cap still works, and so does an open GET without a token.
        r = httpx.post(f"{ctl.url}/v1/regions", headers=auth(), json={
            "name": "us", "latitude": 1, "longitude": 2})
        assert r.status_code == 201, r.text
        assert httpx.get(f"{ctl.url}/health").status_code == 200


class Source:
    """An endless request body for BodyGate: counts what the gate pulls from it."""

    def __init__(self, chunk: int) -> None:
        self.chunk, self.pulled = chunk, 0

    async def receive(self) -> dict[str, Any]:
        self.pulled += 1
        return {"type": "http.request", "body": b"x" * self.chunk, "more_body": True}


async def _through_gate(headers: list[tuple[bytes, bytes]], source: Source,
                        max_bytes: int = 4096) -> tuple[int, bool, list[str]]:
    from skymesh_controller.intake import BodyGate

    reached, refusals, sent = False, [], []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal reached
        reached = True

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    gate = BodyGate(app, known=lambda t: t == "good", max_bytes=max_bytes,
                    refused=refusals.append)
    await gate({"type": "http", "method": "POST", "path": "/v1/regions",
                "headers": headers}, source.receive, send)
    assert dict(sent[0]["headers"])[b"connection"] == b"close"
    return sent[0]["status"], reached, refusals


async def test_body_gate_reads_no_byte_without_a_token_and_stops_at_the_cap() -> None:
    chunked = (b"transfer-encoding", b"chunked")
    for auth_header in ([], [(b"authorization", b"Bearer bad")],
                        [(b"authorization", b"Basic good")]):
        src = Source(1024)
        assert await _through_gate([chunked, *auth_header], src) == (
            401, False, ["unauthenticated_body"])
        assert src.pulled == 0  # not one byte of the body was read
    src = Source(1024)
    assert await _through_gate([chunked, (b"authorization", b"Bearer good")], src) == (
        413, False, ["body_too_large"])
    assert src.pulled == 5  # 5 KiB: just past the 4 KiB cap, and no further
    src = Source(1024)
    too_long = (b"content-length", b"999999")
    assert await _through_gate([too_long, (b"authorization", b"Bearer good")], src) == (
        413, False, ["body_too_large"])
    assert src.pulled == 0


def test_body_gate_answers_in_the_admin_api_shape() -> None:
    with client(max_body_bytes=2048) as c:
        r = c.post("/v1/regions", content=b"{}", headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
        r = c.post("/v1/regions", content=b"x" * 4096, headers=auth())
        assert r.status_code == 413 and r.json()["error"]["type"] == "too_large"
        # A read token may send a body (it is then refused by role, after a bounded read).
        r = c.post("/v1/regions", headers=auth(READER), json={
            "name": "eu", "latitude": 1, "longitude": 2})
        assert r.status_code == 403


# -- 4. nothing stored can break a read; policy is an admin's ------------------------------
def _deep(levels: int) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for _ in range(levels):
        doc = {"a": doc}
    return doc


def test_policy_params_are_bounded_and_policy_is_admin_only() -> None:
    with client() as c:
        assert c.post("/v1/balancers", headers=auth(AGENT), json={
            "id": "lb", "region": "us", "url": "http://10.0.0.1"}).status_code == 201
        # The 536-byte body: 255 levels. Refused, named, and nothing stored.
        for token in (ADMIN, AGENT):
            r = c.patch("/v1/balancers/lb", headers=auth(token),
                        json={"policy": "least-load", "policy_params": _deep(255)})
            assert r.status_code == 422, r.text
            assert r.json()["error"]["fields"][0]["field"] == "policy_params"
        r = c.put("/v1/balancers/lb/policy", headers=auth(), json={
            "policy": "least-load", "params": _deep(20)})
        assert r.status_code == 422
        r = c.put("/v1/balancers/lb/policy", headers=auth(),
                  content=b'{"policy": "least-load", "params": {"x": NaN}}')
        assert r.status_code == 422
        assert c.get("/v1/balancers", headers=auth(READER)).status_code == 200
        assert c.get("/v1/balancers/lb", headers=auth()).json()["policy_params"] == {}
        # An agent changes neither the policy nor its parameters of its own balancer.
        for body in ({"policy": "least-load"}, {"policy_params": {"virtual_nodes": 80}}):
            r = c.patch("/v1/balancers/lb", headers=auth(AGENT), json=body)
            assert r.status_code == 403 and "admin" in r.json()["error"]["message"], r.text
        r = c.post("/v1/balancers", headers=auth(AGENT), json={
            "id": "lb2", "region": "us", "url": "http://10.0.0.2", "policy": "random"})
        assert r.status_code == 403
        # Parameters without a policy are checked too (they were stored unchecked).
        r = c.patch("/v1/balancers/lb", headers=auth(), json={"policy_params": {"x": 1}})
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == \
            "policy_params"
        assert c.put("/v1/balancers/lb/policy", headers=auth(), json={
            "policy": "consistent-hash"}).status_code == 200
        r = c.patch("/v1/balancers/lb", headers=auth(), json={"policy_params": {"bogus": 1}})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_policy"
        r = c.patch("/v1/balancers/lb", headers=auth(), json={
            "policy_params": {"virtual_nodes": 80}})
        assert r.status_code == 200, r.text
        # The balancer re-registering (no policy fields) keeps what the admin set.
        r = c.post("/v1/balancers", headers=auth(AGENT), json={
            "id": "lb", "region": "us", "url": "http://10.0.0.1"})
        assert r.status_code == 201
        assert r.json()["policy"] == "consistent-hash"
        assert r.json()["policy_params"] == {"virtual_nodes": 80}


def test_a_stored_record_the_api_cannot_serve_breaks_no_read(store_spec: str) -> None:
    """A record stored before writes were bounded (on Redis it outlives a restart): the
    list leaves it out, a GET of it or its membership is a 409, everything else works,
    and an admin can replace it."""
    with client(store=store_spec) as c:
        for bid in ("good", "bad"):
            assert c.post("/v1/balancers", headers=auth(AGENT), json={
                "id": bid, "region": "us", "url": f"http://10.0.0.{len(bid)}"}
                ).status_code == 201
        ctl = c.app.state.controller  # type: ignore[attr-defined]
        bad = {**c.get("/v1/balancers/bad", headers=auth()).json(),
               "policy": "least-load", "policy_params": _deep(300)}
        c.portal.call(ctl.store.commit, [("balancers", "bad", bad)])  # type: ignore[union-attr]
        r = c.get("/v1/balancers", headers=auth(READER))
        assert r.status_code == 200 and [b["id"] for b in r.json()] == ["good"]
        for path in ("/v1/balancers/bad", "/v1/balancers/bad/membership"):
            r = c.get(path, headers=auth())
            assert r.status_code == 409 and r.json()["error"]["type"] == "unreadable_record"
        assert c.get("/v1/balancers/good/membership", headers=auth(AGENT)).status_code == 200
        assert c.get("/v1/status", headers=auth()).status_code == 200
        assert c.get("/metrics").status_code == 200
        r = c.put("/v1/balancers/bad/policy", headers=auth(), json={"policy": "least-load"})
        assert r.status_code == 200, r.text
        assert [b["id"] for b in c.get("/v1/balancers", headers=auth()).json()] == [
            "bad", "good"]


# -- 5. telemetry and balancers bounded ----------------------------------------------------
def _report(models: int = 1, name: str = "m", replicas: int = 0) -> dict[str, Any]:
    return {"window_s": 1, "models": {f"{name}{i}": {"requests": 1} for i in range(models)},
            "replicas": {f"http://10.0.{i // 250}.{i % 250}:8000": "healthy"
                         for i in range(replicas)}}


def test_telemetry_is_bounded_per_report_and_per_balancer() -> None:
    with client(telemetry_max_models=4, telemetry_max_bytes=4096,
                telemetry_balancer_bytes=64 * 1024) as c:
        assert c.post("/v1/balancers", headers=auth(AGENT), json={
            "id": "lb", "region": "us", "url": "http://10.0.0.1"}).status_code == 201
        post = lambda body: c.post("/v1/balancers/lb/telemetry",  # noqa: E731
                                   headers=auth(AGENT), json=body)
        r = post(_report(models=5))
        assert r.status_code == 422 and r.json()["error"]["type"] == "too_many_models"
        r = post(_report(name="m" * 960))  # the issue's ~960-character model keys
        assert r.status_code == 422 and "models" in r.json()["error"]["message"]
        r = post(_report(replicas=200))
        assert r.status_code == 413 and "telemetry_max_bytes" in r.json()["error"]["message"]
        # Reports of ~2,300 bytes (rounded to 4 KiB): 64 KiB keeps 16 of them, not 10,000.
        for _ in range(40):
            assert post(_report(models=4, replicas=50)).status_code == 204
        kept = c.get("/v1/telemetry", params={"balancer": "lb", "limit": 10_000},
                     headers=auth()).json()
        assert len(kept) == 16
        assert sum(len(json.dumps(s)) for s in kept) <= 64 * 1024
        assert 'reason="telemetry_too_large"' in c.get("/metrics").text


def test_balancers_per_agent_token_are_capped() -> None:
    with client(max_balancers_per_agent=2) as c:
        def register(token: str, bid: str) -> httpx.Response:
            return c.post("/v1/balancers", headers=auth(token), json={
                "id": bid, "region": "us", "url": f"http://10.0.0.{len(bid)}"})

        assert register(AGENT, "a").status_code == register(AGENT, "bb").status_code == 201
        r = register(AGENT, "ccc")
        assert r.status_code == 403 and r.json()["error"]["type"] == "quota_exceeded"
        assert register(AGENT, "a").status_code == 201  # re-registering is no new one
        assert register(AGENT2, "ccc").status_code == 201  # its own count
        assert register(ADMIN, "dddd").status_code == 201  # admin: no cap


# -- 9. the minor items --------------------------------------------------------------------
def test_bodies_must_be_utf8_json_and_names_plain() -> None:
    region = {"name": "eu", "latitude": 1, "longitude": 2}
    with client() as c:
        for encoding in ("utf-16", "utf-16-le", "utf-32"):
            r = c.post("/v1/regions", headers={**auth(), "content-type": "application/json"},
                       content=json.dumps(region).encode(encoding))
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_body"
        assert c.get("/v1/regions/eu", headers=auth()).status_code == 404
        r = c.post("/v1/replicas", headers=auth(), json={
            "url": "http://10.0.0.1", "model": "llama\u0000evil", "region": "us", "gpu": "L4"})
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "model"
        r = c.post("/v1/models", headers=auth(), json={"name": "m\nx"})
        assert r.status_code == 422
        r = c.post("/v1/models", headers={**auth(), "content-type": "application/json"},
                   content=b'{"name": "m", "min_replicas": ' + b"9" * 4000 + b"}")
        assert r.status_code == 422 and "min_replicas" in r.json()["error"]["message"]
        r = c.post("/v1/models", headers={**auth(), "content-type": "application/json"},
                   content=b'{"name": "m", "ttft_slo_s": Infinity}')
        assert r.status_code == 422
        assert c.get("/v1/models", headers=auth()).json() == []
