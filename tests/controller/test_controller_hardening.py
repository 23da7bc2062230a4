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

from skymesh.controller.api import build_app
from skymesh.controller.auth import digest
from skymesh.controller.config import parse_config
from skymesh.util.procs import Daemon, free_port, start_daemon

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
            rev = c.get("/v1/status", headers=auth()).json()["revision"]
            assert c.get("/v1/replicas/r-a", headers=auth()).json()["assigned"] is None
            m = c.get("/v1/balancers/lb-b/membership", headers=auth(AGENT2)).json()
            assert [x["id"] for x in m["replicas"]] == [], m
            # A second round of probes changes nothing: no later move either.
            wait_for(lambda: c.get("/v1/status", headers=auth()).json()["revision"] >= rev
                     and c.get("/v1/balancers/lb-b/membership", headers=auth(AGENT2))
                     .json()["replicas"] == [], "still no foreign replica")
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
