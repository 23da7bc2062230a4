"""Shares that follow the traffic, end to end with real processes: a controller and two
balancers of one region; a tenant with a global limit sends only to the first balancer,
which reports the demand in its telemetry, and the controller moves the tenant's limit
to it (the second keeps the floor); when the traffic moves to the second balancer, the
parts follow. Read from the controller's membership and from the balancers' logs (the
fractions they applied); waits are on conditions, never on the clock."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from controller_support import AGENT, auth, token_config
from support import until

from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.timeout(180)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEY = "sk-acme-shares-1"
TENANT = {"keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
          "requests_per_s": 4.0}
FLOOR = 0.05  # the controller's default tenant_share_floor: the idle one holds 0.05 / 2


def start_ctl(tmp: Path) -> Daemon:
    path = tmp / "controller.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0}, "tokens": token_config(),
        "url_policy": {"allow_loopback": True},
        "probe": {"interval_s": 0.3, "timeout_s": 0.25, "failure_threshold": 2},
        "tenant_demand_stale_s": 3.0}))
    return start_daemon("skymesh-controller", ["--config", str(path)],
                        log_path=tmp / "controller.log")


def start_lb(tmp: Path, name: str, controller: str, replica: Daemon) -> Daemon:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "region": "us-east", "listen": {"host": "127.0.0.1", "port": 0},
        "probe": {"interval_s": 0.05},
        "replicas": [{"url": replica.url, "models": [MODEL], "gpu": "L4"}],
        "controller": {"url": controller, "balancer_id": name, "poll_wait_s": 10,
                       "retry_s": 0.2, "telemetry_interval_s": 0.3,
                       "url_policy": {"allow_loopback": True}}}))
    env = {**os.environ, "SKYMESH_AGENT_TOKEN": AGENT, "SKYMESH_API_KEYS": KEY}
    return start_daemon("skymesh-lb", ["--config", str(path), "--log-level", "debug"],
                        log_path=tmp / f"{name}.log", env=env)


async def flood(s: aiohttp.ClientSession, lb: Daemon) -> None:
    """The tenant's clients, all at ``lb``: a steady stream (429s expected)."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    # Until the test's session closes: the task may run once more after that, before the
    # test's ``finally`` cancels it, and a post on a closed session raises RuntimeError.
    while not s.closed:
        # A keep-alive connection the server closed as it was reused: the next one goes.
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with s.post(lb.url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                await r.read()
        await asyncio.sleep(0.02)  # pacing of the load, not a wait for a condition


async def test_the_controller_moves_a_tenants_limit_to_where_its_traffic_is(
        tmp_path: Path) -> None:
    rep = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.02"],
                       log_path=tmp_path / "r.log")
    ctl = start_ctl(tmp_path)
    daemons: list[Daemon] = [rep, ctl]
    traffic: asyncio.Task[None] | None = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.post(ctl.url + "/v1/regions", headers=auth(), json={
                    "name": "us-east", "latitude": 38.9, "longitude": -77.0}) as r:
                assert r.status == 201
            lbs = [start_lb(tmp_path, n, ctl.url, rep) for n in ("lb-a", "lb-b")]
            daemons += lbs

            async def fractions() -> dict[str, float]:
                out = {}
                for name in ("lb-a", "lb-b"):
                    async with s.get(f"{ctl.url}/v1/balancers/{name}/membership",
                                     headers=auth(AGENT)) as r:
                        m: dict[str, Any] = await r.json()
                    out[name] = next((t["fraction"] for t in m.get("tenants", [])), -1.0)
                return out

            async def registered() -> bool:
                async with s.get(ctl.url + "/v1/balancers", headers=auth()) as r:
                    return len(await r.json()) == 2

            await until(registered, "both balancers registered")
            async with s.put(ctl.url + "/v1/tenants/acme", json=TENANT,
                             headers=auth()) as r:
                assert r.status == 200, await r.text()
            assert await fractions() == {"lb-a": 0.5, "lb-b": 0.5}  # no demand yet: even

            for busy, idle in ((lbs[0], "lb-b"), (lbs[1], "lb-a")):
                if traffic is not None:
                    traffic.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await traffic
                traffic = asyncio.create_task(flood(s, busy))
                name = "lb-a" if idle == "lb-b" else "lb-b"

                async def moved(name: str = name, idle: str = idle) -> bool:
                    f = await fractions()
                    return f[name] >= 0.9 and f[idle] <= FLOOR / 2 + 1e-6

                await until(moved, f"the limit moves to {name}", timeout=60)
                # The balancer applied the answer to its telemetry (a debug line each).
                assert "tenants from the controller: acme (9" in busy.log()
    finally:
        for d in daemons:  # first: whatever the load task ended with, nothing is left
            d.stop()
        if traffic is not None:
            traffic.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await traffic
