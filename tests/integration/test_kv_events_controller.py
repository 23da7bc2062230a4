"""KV-cache events with a controller (issue #36), real processes over loopback: a
controller, a balancer and an emulated replica publishing on ``--kv-events-endpoint``.

1. The replica is in lb.yaml with its ``kv_events``: once the controller's membership has
   arrived, the balancer still follows the feed (membership used to replace the entry,
   dropping its endpoint).
2. The replica is registered through the admin API with its endpoint and the balancer
   has no replicas of its own: it follows the endpoint the controller gives.
Waits are on conditions, never on the clock."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from controller_support import AGENT, auth, start_controller
from support import until

from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile

pytestmark = pytest.mark.timeout(120)

MODEL = get_profile(DEFAULT_PROFILE).model
REGION = {"name": "us-east", "latitude": 38.9, "longitude": -77.0}


def port_pair() -> int:
    """A free port whose next one is free too (the replica replays on PORT + 1)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def publishing_replica(tmp: Path) -> tuple[Daemon, dict[str, str]]:
    port = port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    d = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.01",
                                         "--kv-events-endpoint", endpoint],
                     log_path=tmp / "replica.log")
    return d, {"endpoint": endpoint, "replay_endpoint": f"tcp://127.0.0.1:{port + 1}"}


def start_lb(tmp: Path, controller: str, replicas: list[dict[str, Any]]) -> Daemon:
    path = tmp / "lb.yaml"
    path.write_text(yaml.safe_dump({
        "region": "us-east", "listen": {"host": "127.0.0.1", "port": 0},
        "probe": {"interval_s": 0.1},
        "kv_events": {"heartbeat_s": 0.2, "stale_after_s": 2.0, "replay_timeout_s": 0.5},
        "replicas": replicas,
        "controller": {"url": controller, "balancer_id": "lb-us", "poll_wait_s": 10,
                       "retry_s": 0.2, "url_policy": {"allow_loopback": True}}}))
    return start_daemon("skymesh-lb", ["--config", str(path), "--log-level", "info"],
                        log_path=tmp / "lb.log",
                        env={**os.environ, "SKYMESH_AGENT_TOKEN": AGENT})


async def status(s: aiohttp.ClientSession, lb: Daemon) -> dict[str, Any]:
    async with s.get(lb.url + "/status") as r:
        return await r.json()


async def follows_after_membership(s: aiohttp.ClientSession, lb: Daemon, url: str) -> None:
    """Membership applied, then the replica's feed live in /status and /metrics."""
    async def membership_arrived() -> bool:
        return (await status(s, lb))["controller"]["revision"] >= 0

    async def live() -> bool:
        rep = (await status(s, lb))["replicas"].get(url)
        return rep is not None and rep["kv_events"] == "live"

    await until(membership_arrived, "the controller's membership applied")
    await until(live, f"{url}'s kv events live after membership")
    async with s.get(lb.url + "/metrics") as r:
        assert f'skymesh_kv_events_live{{replica="{url}"}} 1.0' in await r.text()


@contextlib.asynccontextmanager
async def cluster(tmp: Path) -> AsyncIterator[tuple[aiohttp.ClientSession, Daemon,
                                                    dict[str, str], Daemon, list[Daemon]]]:
    """A publishing replica and a controller with the region; the daemons appended to the
    list (the balancer) are stopped with them."""
    rep, kv = publishing_replica(tmp)
    ctl = start_controller(tmp, probe_s=0.3, timeout_s=0.25)
    daemons = [rep, ctl]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.post(ctl.url + "/v1/regions", json=REGION, headers=auth()) as r:
                assert r.status == 201
            yield s, rep, kv, ctl, daemons
    finally:
        for d in daemons:
            d.stop()


async def test_membership_keeps_the_lb_yaml_kv_events(tmp_path: Path) -> None:
    async with cluster(tmp_path) as (s, rep, kv, ctl, daemons):
        lb = start_lb(tmp_path, ctl.url, [{"url": rep.url, "kind": "skymesh",
                                            "models": [MODEL], "kv_events": kv}])
        daemons.append(lb)
        await follows_after_membership(s, lb, rep.url)
        # ... and the balancer registered the endpoint for the others sharing it
        async with s.get(ctl.url + "/v1/replicas", headers=auth()) as r:
            (record,) = await r.json()
        assert record["kv_events"] == kv


async def test_a_balancer_follows_the_endpoint_the_controller_gives(tmp_path: Path) -> None:
    async with cluster(tmp_path) as (s, rep, kv, ctl, daemons):
        lb = start_lb(tmp_path, ctl.url, [])
        daemons.append(lb)

        async def registered() -> bool:
            return (await status(s, lb))["controller"]["registered"]

        await until(registered, "the balancer registered")
        async with s.post(ctl.url + "/v1/replicas", headers=auth(), json={
                "url": rep.url, "model": MODEL, "region": "us-east", "gpu": "L4",
                "kind": "skymesh", "kv_events": kv}) as r:
            assert r.status == 201, await r.text()
        await follows_after_membership(s, lb, rep.url)
