"""The local actuator against a real controller and real replica processes: a plan's +2
replicas start, register and turn healthy; a -1 deregisters one and stops its process."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
from controller_support import ADMIN, auth, start_controller
from support import until

from skymesh.util.procs import Daemon
from skymesh_controller.planning.actuate_local import LocalActuator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEY = (MODEL, "us-east", "L4")
PROBE_S = 0.2


async def replicas(s: aiohttp.ClientSession, ctl: Daemon) -> dict[str, dict[str, Any]]:
    async with s.get(ctl.url + "/v1/replicas", headers=auth()) as r:
        assert r.status == 200
        return {rep["id"]: rep for rep in await r.json()}


async def test_plans_start_register_and_stop_replicas(tmp_path: Path) -> None:
    ctl = start_controller(tmp_path, probe_s=PROBE_S, timeout_s=0.5)
    act = LocalActuator(ctl.url, token=ADMIN, replica_args=("--time-scale", "0.05"),
                        log_dir=tmp_path)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.post(ctl.url + "/v1/regions", headers=auth(), json={
                    "name": "us-east", "latitude": 38.9, "longitude": -77.0}) as r:
                assert r.status == 201

            report = await asyncio.to_thread(act.apply_counts, {KEY: 2})
            assert report.ok, report.errors
            assert [(c.before, c.after) for c in report.changed] == [(0, 2)]
            ids = act.running()[KEY]
            urls = act.urls(KEY)
            assert len(set(urls)) == 2

            async def registered_healthy() -> bool:
                reps = await replicas(s, ctl)
                return set(reps) == set(ids) and all(
                    reps[i]["state"] == "healthy" and reps[i]["model"] == MODEL
                    and reps[i]["region"] == "us-east" and reps[i]["gpu"] == "L4"
                    for i in ids)

            await until(registered_healthy, "both replicas registered and healthy")
            assert {(await replicas(s, ctl))[i]["url"] for i in ids} == set(urls)

            # The same plan again: nothing starts, nothing stops.
            again = await asyncio.to_thread(act.apply_counts, {KEY: 2})
            assert again.changed == [] and again.unchanged == [KEY]
            assert act.running()[KEY] == ids

            # One fewer: the newest is deregistered and its process ends.
            victim = act._running[KEY][-1].daemon
            shrink = await asyncio.to_thread(act.apply_counts, {KEY: 1})
            assert [(c.before, c.after) for c in shrink.changed] == [(2, 1)]
            assert act.running()[KEY] == ids[:1]
            assert set(await replicas(s, ctl)) == {ids[0]}
            assert not victim.alive()
            async with s.get(urls[0] + "/health") as r:
                assert r.status == 200  # the survivor still serves
    finally:
        await asyncio.to_thread(act.close)
        ctl.stop()
