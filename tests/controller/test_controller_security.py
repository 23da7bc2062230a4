"""Regressions for issue #23 on the controller: SSRF through registered URLs, record
takeover by another token, the API documents open, 405 without ``Allow``."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from aiohttp import web
from controller_support import ADMIN, AGENT, READER, auth, token_config
from fastapi.testclient import TestClient

from skymesh_controller.api import build_app
from skymesh_controller.auth import Principal, digest
from skymesh_controller.config import parse_config
from skymesh_controller.models import BalancerIn, RegionIn, ReplicaIn
from skymesh_controller.service import Controller
from skymesh_controller.store import MemoryStore

AGENT2 = "second-agent-token"
DNS: dict[str, list[str]] = {}  # what the fake resolver answers; tests change it


async def fake_dns(host: str, port: int) -> list[str]:
    if host not in DNS:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return DNS[host]


@contextmanager
def client(url_policy: dict[str, Any] | None = None, **cfg: Any) -> Iterator[TestClient]:
    tokens = [*token_config(), {"name": "lbs-2", "sha256": digest(AGENT2), "role": "agent"}]
    config = parse_config({"tokens": tokens, "url_policy": url_policy or {}, **cfg})
    with TestClient(build_app(config, probe=False, resolver=fake_dns)) as c:
        assert c.post("/v1/regions", headers=auth(), json={
            "name": "us", "latitude": 1, "longitude": 2}).status_code == 201
        yield c


def balancer(bid: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"id": bid, "region": "us", "url": url, **extra}


def replica(url: str, **extra: Any) -> dict[str, Any]:
    return {"url": url, "model": "m", "region": "us", "gpu": "L4", **extra}


# -- 1. SSRF -------------------------------------------------------------------------------
REFUSED = [
    "http://169.254.169.254", "http://[::ffff:169.254.169.254]", "http://2852039166",
    "http://0xa9fea9fe:80", "http://0251.0376.0251.0376", "http://169.254.169.254.",
    "http://metadata.google.internal", "http://[fd00:ec2::254]", "http://[fe80::1%25eth0]",
    "http://user:pw@10.0.0.1:8000", "http://10.0.0.1:8000/admin?", "http://10.0.0.1/x#",
    "http://127.0.0.1:8000", "http://[::1]:8000", "http://0.0.0.0:8000",
    "http://rebind.example:8000",  # a name that resolves to the metadata address
    "http://nowhere.example:8000",  # a name that does not resolve
]


@pytest.mark.parametrize("url", REFUSED)
def test_registration_refuses_urls_the_policy_denies(url: str) -> None:
    DNS.update({"rebind.example": ["169.254.169.254"]})
    with client() as c:
        for path, body in (("/v1/replicas", replica(url)),
                           ("/v1/balancers", balancer("lb", url))):
            r = c.post(path, headers=auth(AGENT), json=body)
            assert r.status_code == 422, (path, r.text)
            err = r.json()["error"]
            assert err["fields"][0]["field"] == "url" and err["message"].startswith("url: ")
        r = c.post("/v1/balancers", headers=auth(AGENT), json=balancer(
            "lb", "http://10.0.0.1:8000", peer_address="169.254.169.254:7001"))
        assert r.status_code == 422 and "peer_address" in r.json()["error"]["message"]
        assert c.get("/v1/replicas", headers=auth()).json() == []


def test_private_addresses_pass_by_default_and_loopback_when_allowed() -> None:
    DNS.update({"replica.internal": ["10.0.0.7"]})
    with client() as c:
        for url in ("http://10.0.0.1:8000", "http://replica.internal:8000/v1"):
            assert c.post("/v1/replicas", headers=auth(AGENT),
                          json=replica(url)).status_code == 201
    with client({"allow_private": False}) as c:
        r = c.post("/v1/replicas", headers=auth(), json=replica("http://10.0.0.1:8000"))
        assert r.status_code == 422 and "private" in r.json()["error"]["message"]
    with client({"allow_loopback": True}) as c:
        assert c.post("/v1/replicas", headers=auth(),
                      json=replica("http://127.0.0.1:8000")).status_code == 201


def test_updates_are_checked_like_registrations() -> None:
    with client() as c:
        rid = c.post("/v1/replicas", headers=auth(AGENT),
                     json=replica("http://10.0.0.1:8000")).json()["id"]
        r = c.patch(f"/v1/replicas/{rid}", headers=auth(AGENT),
                    json={"url": "http://169.254.169.254"})
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "url"
        c.post("/v1/balancers", headers=auth(AGENT), json=balancer("lb", "http://10.0.0.2:1"))
        r = c.put("/v1/balancers/lb", headers=auth(AGENT),
                  json={"region": "us", "url": "http://[::ffff:a9fe:a9fe]"})
        assert r.status_code == 422


class Recorder:
    """A real HTTP server on loopback that records the paths it was asked for."""

    def __init__(self, health: web.StreamResponse | None = None) -> None:
        self.paths: list[str] = []
        self.health = health

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path_qs)
        # No keep-alive: each probe opens a new connection, so it resolves (and is checked)
        # again; a kept-alive connection stays with the address that was checked.
        return self.health if self.health is not None else web.Response(
            text="ok", headers={"Connection": "close"})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def controller(**policy: Any) -> Controller:
    ctl = Controller(parse_config({"url_policy": policy, "probe": {"timeout_s": 2}}),
                     MemoryStore(), resolver=fake_dns)
    await ctl.start(probe=False)
    await ctl.put_region(RegionIn(name="us", latitude=1, longitude=2))
    return ctl


async def test_probe_checks_dns_again_at_fetch_time() -> None:
    # Registered while the name pointed at an allowed address; it now points at a denied
    # one (DNS rebinding): the probe must not connect.
    target = Recorder()
    base = await target.start()
    port = base.rsplit(":", 1)[1]
    DNS["flip.example"] = ["127.0.0.1"]
    ctl = await controller(allow_hosts=["flip.example"])
    try:
        rep = await ctl.add_replica(ReplicaIn(**replica(f"http://flip.example:{port}/v1")))
        await ctl.probe_once()
        assert target.paths == ["/v1/health"]  # joined as a path segment under the base
        assert (await ctl.get("replicas", rep["id"], "replica"))["state"] == "healthy"
        DNS["flip.example"] = ["169.254.169.254"]
        ctl._session.connector.clear_dns_cache()  # type: ignore[union-attr]
        for _ in range(2):
            await ctl.probe_once()
        assert target.paths == ["/v1/health"]  # nothing more was fetched
        assert (await ctl.get("replicas", rep["id"], "replica"))["state"] == "unhealthy"
    finally:
        await ctl.stop()
        await target.stop()


async def test_probe_refuses_stored_urls_the_policy_now_denies() -> None:
    # A record stored before the policy (or under a looser one) is not fetched either.
    target = Recorder()
    base = await target.start()
    ctl = await controller(allow_loopback=True)
    try:
        rep = await ctl.add_replica(ReplicaIn(**replica(base)))
        ctl.url_policy = parse_config({}).url_policy.policy()  # loopback denied now
        await ctl.probe_once()
        assert target.paths == []
        assert (await ctl.get("replicas", rep["id"], "replica"))["state"] == "unknown"
    finally:
        await ctl.stop()
        await target.stop()


async def test_probe_does_not_follow_redirects() -> None:
    inner = Recorder()
    inner_url = await inner.start()
    outer = Recorder(web.Response(status=302, headers={
        "Location": inner_url + "/latest/meta-data"}))
    outer_url = await outer.start()
    ctl = await controller(allow_loopback=True)
    try:
        rep = await ctl.add_replica(ReplicaIn(**replica(outer_url)))
        await ctl.probe_once()
        assert outer.paths == ["/health"] and inner.paths == []
        assert (await ctl.get("replicas", rep["id"], "replica"))["state"] == "unknown"
    finally:
        await ctl.stop()
        await inner.stop()
        await outer.stop()


# -- 2. ownership --------------------------------------------------------------------------
def test_another_agent_cannot_take_over_a_record() -> None:
    with client() as c:
        assert c.post("/v1/balancers", headers=auth(AGENT),
                      json=balancer("lb-us", "http://10.0.0.1:80")).status_code == 201
        r = c.post("/v1/replicas", headers=auth(AGENT),
                   json=replica("http://10.0.0.2:80", id="r1", balancer="lb-us"))
        assert r.status_code == 201 and r.json()["owner"] == "lbs"
        # Re-POST by another agent: 409 and nothing changed.
        r = c.post("/v1/balancers", headers=auth(AGENT2),
                   json=balancer("lb-us", "http://10.6.6.6:80"))
        assert r.status_code == 409 and r.json()["error"]["type"] == "conflict"
        r = c.post("/v1/replicas", headers=auth(AGENT2),
                   json=replica("http://10.6.6.6:80", id="r1"))
        assert r.status_code == 409
        assert c.get("/v1/balancers/lb-us", headers=auth()).json()["url"] == "http://10.0.0.1:80"
        assert c.get("/v1/replicas/r1", headers=auth()).json()["url"] == "http://10.0.0.2:80"
        # PUT/PATCH by another agent: 403; telemetry for its balancer: 403.
        for call in (lambda: c.patch("/v1/replicas/r1", headers=auth(AGENT2),
                                     json={"url": "http://10.6.6.6:80"}),
                     lambda: c.put("/v1/balancers/lb-us", headers=auth(AGENT2),
                                   json={"region": "us", "url": "http://10.6.6.6:80"}),
                     lambda: c.post("/v1/balancers/lb-us/telemetry", headers=auth(AGENT2),
                                    json={"window_s": 1})):
            r = call()
            assert r.status_code == 403 and r.json()["error"]["type"] == "not_owner", r.text
        # Nor may it home a replica at lb-us (that would put it in lb-us's membership).
        r = c.post("/v1/replicas", headers=auth(AGENT2),
                   json=replica("http://10.6.6.7:80", balancer="lb-us"))
        assert r.status_code == 403 and "lb-us" in r.json()["error"]["message"]
        r = c.post("/v1/replicas", headers=auth(AGENT2), json=replica("http://10.6.6.7:80"))
        assert r.status_code == 403  # lb-us is the region's home by placement, too
        assert len(c.get("/v1/replicas", headers=auth()).json()) == 1


def test_owner_reregisters_updates_and_admin_does_all() -> None:
    with client() as c:
        c.post("/v1/balancers", headers=auth(AGENT), json=balancer("lb-us", "http://10.0.0.1"))
        c.put("/v1/balancers/lb-us/policy", headers=auth(), json={"policy": "least-load"})
        # A balancer restart: same token, same id, same body.
        r = c.post("/v1/balancers", headers=auth(AGENT),
                   json=balancer("lb-us", "http://10.0.0.1"))
        assert r.status_code == 201 and r.json()["policy"] == "least-load"
        body = replica("http://10.0.0.2:80", balancer="lb-us")
        rid = c.post("/v1/replicas", headers=auth(AGENT), json=body).json()["id"]
        assert c.post("/v1/replicas", headers=auth(AGENT), json=body).status_code == 201
        r = c.patch(f"/v1/replicas/{rid}", headers=auth(AGENT), json={"gpu": "H100"})
        assert r.status_code == 200 and r.json()["gpu"] == "H100"
        assert r.json()["url"] == "http://10.0.0.2:80" and r.json()["owner"] == "lbs"
        # An agent cannot give a record away; an admin can, and the new owner then acts.
        r = c.patch(f"/v1/replicas/{rid}", headers=auth(AGENT), json={"owner": "lbs-2"})
        assert r.status_code == 403
        r = c.patch("/v1/balancers/lb-us", headers=auth(ADMIN), json={"owner": "lbs-2"})
        assert r.status_code == 200 and r.json()["owner"] == "lbs-2"
        assert r.json()["policy"] == "least-load"  # PATCH keeps what it does not name
        # The replica's own owner is still lbs, and lbs-2 owns its balancer: both may.
        for token in (AGENT, AGENT2):
            assert c.patch(f"/v1/replicas/{rid}", headers=auth(token),
                           json={"model": "m2"}).status_code == 200
        # A PUT without the policy keeps it: policy is an admin's (issue #33).
        assert c.put("/v1/balancers/lb-us", headers=auth(AGENT2), json={
            "region": "us", "url": "http://10.0.0.9"}).json()["policy"] == "least-load"
        assert c.patch("/v1/replicas/ghost", headers=auth(), json={}).status_code == 404
        assert c.put("/v1/balancers/ghost", headers=auth(),
                     json={"region": "us", "url": "http://10.0.0.9"}).status_code == 404
        assert c.patch("/v1/replicas/" + rid, headers=auth(READER), json={}).status_code == 403


async def test_records_without_owner_go_to_the_first_writer() -> None:
    # Written before owners existed: the balancer that re-registers first claims it.
    ctl = await controller()
    try:
        await ctl.store.commit([("balancers", "old", {
            "id": "old", "region": "us", "url": "http://10.0.0.1", "state": "up"})])
        who = Principal("lbs", "agent")
        obj = await ctl.register_balancer(BalancerIn(**balancer("old", "http://10.0.0.1")),
                                          who)
        assert obj["owner"] == "lbs" and obj["state"] == "up"
    finally:
        await ctl.stop()


# -- 3. documents and methods --------------------------------------------------------------
def test_api_documents_are_off_by_default_and_need_a_token_when_on() -> None:
    with client() as c:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert c.get(path, headers=auth()).status_code == 404, path
    with client(api_docs=True) as c:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers=auth(READER)).status_code == 200, path
        schema = c.get("/openapi.json", headers=auth(READER)).json()
        post = schema["paths"]["/v1/replicas"]["post"]["responses"]
        assert {"401", "403", "404", "409", "422"} <= set(post)
        assert "ErrorOut" in str(post["409"])


def test_405_names_the_allowed_methods() -> None:
    with client() as c:
        r = c.request("TRACE", "/v1/regions", headers=auth())
        assert r.status_code == 405
        assert set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}
        assert r.json()["error"]["type"] == "http_error"


def test_unknown_query_parameters_are_named() -> None:
    with client() as c:
        r = c.get("/v1/telemetry", params={"regoin": "us"}, headers=auth())
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "regoin"
        assert c.get("/v1/telemetry", params={"region": "us"}, headers=auth()).status_code == 200
