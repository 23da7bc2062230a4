"""Tenants from the controller, end to end with real processes: a tenant created through
the admin API reaches two balancers (one per region, neither with a ``tenants`` section)
with membership; its global rate limit, split between them, turns the tenant's second
request at each into a 429 in the OpenAI shape with a Retry-After; deleting it at the
controller reverts both to no limit. Waits are on conditions, never on the clock."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import aiohttp
import pytest
import yaml
from controller_support import AGENT, auth, start_controller
from support import until

from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.timeout(180)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEY = "sk-acme-live-1"
# 0.02/s for the whole mesh: each of the two balancers holds 0.01/s (a burst of one
# request, then a wait of ~100 s), so the second request is refused at once.
TENANT = {"keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
          "requests_per_s": 0.02}


def start_lb(tmp: Path, name: str, region: str, controller: str, replica: Daemon) -> Daemon:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "region": region, "listen": {"host": "127.0.0.1", "port": 0},
        "probe": {"interval_s": 0.05},
        "replicas": [{"url": replica.url, "models": [MODEL], "gpu": "L4"}],
        "controller": {"url": controller, "balancer_id": name, "poll_wait_s": 10,
                       "retry_s": 0.2, "url_policy": {"allow_loopback": True}}}))
    env = {**os.environ, "SKYMESH_AGENT_TOKEN": AGENT, "SKYMESH_API_KEYS": KEY}
    return start_daemon("skymesh-lb", ["--config", str(path), "--log-level", "info"],
                        log_path=tmp / f"{name}.log", env=env)


async def send(s: aiohttp.ClientSession, lb: Daemon) -> tuple[int, dict[str, str], str]:
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}
    async with s.post(lb.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        return r.status, dict(r.headers), await r.text()


async def limited(s: aiohttp.ClientSession, lb: Daemon) -> bool:
    """Whether the tenant's limit holds here: two requests, the second refused."""
    await send(s, lb)
    status, _, _ = await send(s, lb)
    return status == 429


async def test_tenant_from_the_controller_limits_both_balancers_and_delete_reverts(
        tmp_path: Path) -> None:
    reps = [start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.05",
                                             "--seed", str(i)], log_path=tmp_path / f"r{i}.log")
            for i in range(2)]
    ctl = start_controller(tmp_path, probe_s=0.3, timeout_s=0.25)
    daemons: list[Daemon] = [*reps, ctl]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            for region in ({"name": "us-east", "latitude": 38.9, "longitude": -77.0},
                           {"name": "eu-west", "latitude": 53.3, "longitude": -6.3}):
                async with s.post(ctl.url + "/v1/regions", json=region, headers=auth()) as r:
                    assert r.status == 201
            lbs = [start_lb(tmp_path, "lb-us", "us-east", ctl.url, reps[0]),
                   start_lb(tmp_path, "lb-eu", "eu-west", ctl.url, reps[1])]
            daemons += lbs

            async def registered() -> bool:
                async with s.get(ctl.url + "/v1/balancers", headers=auth()) as r:
                    return len(await r.json()) == 2

            await until(registered, "both balancers registered")
            for lb in lbs:  # no limit yet: the key is served
                async def served(lb: Daemon = lb) -> bool:
                    return (await send(s, lb))[0] == 200
                await until(served, f"{lb.url} serves the key")

            async with s.put(ctl.url + "/v1/tenants/acme", json=TENANT,
                             headers=auth()) as r:
                assert r.status == 200, await r.text()
            for lb in lbs:
                await until(lambda lb=lb: limited(s, lb), f"the limit reaches {lb.url}")
                status, headers, text = await send(s, lb)
                assert status == 429, text
                assert int(headers["Retry-After"]) >= 30  # the bucket's own wait (~100 s)
                err = json.loads(text)["error"]
                assert "acme" in err["message"] and err["type"]
                async with s.get(lb.url + "/metrics") as r:  # the pushed tenant's queue depth
                    assert 'skymesh_tenant_queue_waiting{priority="standard",tenant="acme"} 0.0' \
                        in await r.text()

            async with s.delete(ctl.url + "/v1/tenants/acme", headers=auth()) as r:
                assert r.status == 204
            for lb in lbs:
                async def free(lb: Daemon = lb) -> bool:
                    return not await limited(s, lb)
                await until(free, f"{lb.url} drops the limit")
                assert (await send(s, lb))[0] == 200
    finally:
        for d in daemons:
            d.stop()
