"""The balancer's fetch-time URL check (issue #23): with a controller, its aiohttp sessions
resolve through the URL policy, so a replica name that re-points to a denied address
after it was registered is refused at connect time. The resolver is injected: no real DNS.
"""

from __future__ import annotations

import aiohttp
import pytest

from skymesh.balancer.config import BalancerConfig
from skymesh.balancer.controller_link import fetch_resolver

ANSWERS = {"rebound.example": ["169.254.169.254"], "vpc.example": ["10.0.0.7"],
           "ctl.internal": ["127.0.0.1"], "loop.example": ["127.0.0.1"]}


async def fake_dns(host: str, port: int) -> list[str]:
    return ANSWERS[host]


def config(**kw: object) -> BalancerConfig:
    return BalancerConfig.model_validate(kw)


def test_without_a_controller_the_default_resolver_is_kept() -> None:
    assert fetch_resolver(config(replicas=[{"url": "http://vpc.example:8000"}]), fake_dns) is None


async def test_a_name_that_rebinds_to_metadata_is_refused_at_connect_time() -> None:
    resolver = fetch_resolver(config(controller={"url": "http://ctl.internal:9000"}), fake_dns)
    assert resolver is not None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=resolver)) as s:
        with pytest.raises(aiohttp.ClientConnectorError, match="refused by the URL policy"):
            await s.get("http://rebound.example:8000/health")


@pytest.mark.parametrize(("host", "allowed"), [
    ("vpc.example", True),     # private: allowed by default
    ("loop.example", False),   # loopback from the controller: denied by default
    ("ctl.internal", True),    # loopback, but the operator wrote it in the config
    ("rebound.example", False),
])
async def test_which_names_resolve(host: str, allowed: bool) -> None:
    resolver = fetch_resolver(config(controller={"url": "http://ctl.internal:9000"}), fake_dns)
    assert resolver is not None
    if allowed:
        assert [r["host"] for r in await resolver.resolve(host, 80)] == ANSWERS[host]
    else:
        with pytest.raises(OSError, match="refused by the URL policy"):
            await resolver.resolve(host, 80)


async def test_an_operator_replica_name_never_lifts_the_metadata_rows() -> None:
    cfg = config(controller={"url": "http://ctl.internal:9000"},
                 replicas=[{"url": "http://rebound.example:8000"}])
    resolver = fetch_resolver(cfg, fake_dns)
    assert resolver is not None
    with pytest.raises(OSError, match="metadata"):
        await resolver.resolve("rebound.example", 8000)


async def test_the_data_path_connects_only_where_the_policy_allows() -> None:
    """Requests to replicas go through skymesh's own pooled client (Upstream), not aiohttp's
    session: it resolves through the same policy at every new connection, connects to the
    address allowed, and still names the host in ``Host``."""
    from aiohttp import web

    from skymesh.balancer.upstream import Upstream, UpstreamConnectionError

    seen: list[str] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append(request.headers["Host"])
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    resolver = fetch_resolver(config(controller={"url": "http://ctl.internal:9000"}), fake_dns)
    up = Upstream(connect_timeout_s=5, read_timeout_s=5, resolver=resolver)
    try:
        reply = await up.post(f"http://ctl.internal:{port}", "/v1/chat/completions", b"{}",
                              {"Content-Type": "application/json"})
        assert reply.status == 200 and await reply.read() == b'{"ok": true}'
        assert seen == [f"ctl.internal:{port}"]
        with pytest.raises(UpstreamConnectionError, match="refused by the URL policy"):
            await up.post(f"http://rebound.example:{port}", "/v1/chat/completions", b"{}", {})
    finally:
        await up.close()
        await runner.cleanup()
