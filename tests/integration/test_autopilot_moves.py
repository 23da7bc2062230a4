"""A planned move end to end (issue #25 item 2), with real processes on loopback.

A ``skymesh-controller`` (memory store, autopilot in auto mode, local actuator), regions
``us`` and ``eu``, each with a real ``skymesh-lb`` that registers with the controller and
follows membership by long poll. The demand (telemetry as balancers send it) is in us: the
planner starts a ``skymesh-replica`` there. Streams run on it through lb-us; then the
demand moves to eu, and the next plan moves the replica instead of stopping it and
starting another: it drains at lb-us while the streams finish, then is re-registered in
eu and lb-eu serves it. Every stream completes; the round record shows the move.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from controller_support import AGENT, TelemetryFeeder, auth, planner_controller

from skymesh.util.procs import Daemon, start_daemon
from skymesh_lab.faults.client import Tally, chat_body, send, session
from skymesh_lab.faults.cluster import MODEL, metrics, status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
STREAMS = 4
MAX_TOKENS = 160  # a few seconds per stream: still open when the move begins
START_S = 90.0  # process start-ups on a loaded machine


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Daemon]:
    planner = {
        "mode": "auto", "epsilon": 1.0, "capacity": {MODEL: {"L4": 100.0}},
        "bounds": {MODEL: {"*": {"min": 0, "max": 1}}},
        "schedule": {"window_s": 1, "horizon": 2, "interval_s": 1, "tick_s": 0.25,
                     "first_round_s": 0, "min_history_windows": 3,
                     "stale_windows": 3},
        "forecaster": {"headroom": 0.0},
        "cooldowns": {"hold_s": 0, "retry_s": 1},
        "drain_timeout_s": 60, "drain_poll_s": 0.5,
        "actuator": {"kind": "local", "local": {
            "log_dir": str(tmp_path), "replica_args": ["--metrics-lag-s", "0.1"]}}}
    with planner_controller(tmp_path, planner, start_timeout_s=START_S) as ctl:
        yield ctl


def start_lb(tmp_path: Path, ctl: Daemon, region: str) -> Daemon:
    cfg = {"region": region, "listen": {"host": "127.0.0.1", "port": 0},
           "policy": {"name": "least-load"}, "probe": {"interval_s": 0.1},
           "controller": {"url": ctl.url, "balancer_id": f"lb-{region}", "retry_s": 0.2,
                          "telemetry_interval_s": 0.5,
                          "url_policy": {"allow_loopback": True}}}
    path = tmp_path / f"lb-{region}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(path), "--log-level", "warning"],
                        log_path=tmp_path / f"lb-{region}.log", timeout=START_S,
                        env={**os.environ, "SKYMESH_AGENT_TOKEN": AGENT})


async def wait_for(cond: Callable[[], Awaitable[bool]], what: str, timeout: float) -> None:
    """Await ``cond()`` until it holds (errors count as not yet), with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await cond():
                return
        except (aiohttp.ClientError, OSError, TimeoutError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.1)  # polling cadence: the daemons share two cores


async def get(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url, headers=auth()) as r:
        r.raise_for_status()
        return await r.json()


async def test_a_planned_move_drains_the_replica_without_losing_a_request(
        tmp_path: Path, controller: Daemon) -> None:
    base = controller.url
    for name, lat, lon in (("us", 38.9, -77.0), ("eu", 53.3, -6.3)):
        r = httpx.post(f"{base}/v1/regions", headers=auth(),
                       json={"name": name, "latitude": lat, "longitude": lon})
        assert r.status_code == 201, r.text
    # One instance in all: a window with demand in both regions (the one the demand
    # moves in, or one with the streams' own tokens after the move) has no plan (both
    # regions would need one), so each plan is all in us or all in eu.
    r = httpx.post(f"{base}/v1/models", headers=auth(), json={"name": MODEL,
                                                                "max_replicas": 1})
    assert r.status_code == 201, r.text
    lbs = await asyncio.gather(*(asyncio.to_thread(start_lb, tmp_path, controller, region)
                                 for region in ("us", "eu")))
    lb_us, lb_eu = lbs
    try:
        async with session() as s:
            async def registered() -> bool:
                ids = {b["id"] for b in await get(s, f"{base}/v1/balancers")}
                return ids == {"lb-us", "lb-eu"}

            await wait_for(registered, "both balancers registered", START_S)
            with TelemetryFeeder(base, MODEL, {"us": 0.0, "eu": 0.0}) as feed:
                await _move_under_load(s, base, lb_us, lb_eu, feed)
    finally:
        for lb in lbs:
            lb.stop()


async def _move_under_load(s: aiohttp.ClientSession, base: str, lb_us: Daemon,
                           lb_eu: Daemon, feed: TelemetryFeeder) -> None:
    feed.tps["us"] = 80.0  # one instance of 100 tokens/s, in us
    rep: dict[str, Any] = {}

    async def started_in_us() -> bool:
        mine = [r for r in await get(s, f"{base}/v1/replicas") if r["kind"] == "skymesh"]
        if len(mine) == 1 and mine[0]["region"] == "us":
            rep.update(mine[0])
            # Only it at lb-us (a start that failed on a loaded machine may have left
            # another for a moment): every stream must land on the replica that moves.
            at_us = (await status(s, lb_us.url))["replicas"]
            return list(at_us) == [rep["url"]] and at_us[rep["url"]]["healthy"]
        return False

    await wait_for(started_in_us, "the planner's replica serving at lb-us", START_S)
    rid, url = rep["id"], rep["url"]

    tally = Tally()
    streams = [asyncio.create_task(send(s, lb_us.url, chat_body(f"stream {i}", MAX_TOKENS,
                                                                stream=True), tally, 120))
               for i in range(STREAMS)]

    async def all_running() -> bool:
        m = await metrics(s, url)
        return (m.get("vllm:num_requests_running", 0)
                + m.get("vllm:num_requests_waiting", 0)) >= STREAMS

    await wait_for(all_running, "every stream running on the replica", 30)
    feed.tps.update(us=0.0, eu=80.0)  # the demand moves to eu

    open_at_drain: list[int] = []

    async def draining() -> bool:
        r = await get(s, f"{base}/v1/replicas/{rid}")
        if r["state"] == "draining":
            open_at_drain.append(sum(not t.done() for t in streams))
            return True
        return False

    await wait_for(draining, "the plan to drain the replica", 60)

    async def moved() -> bool:
        r = await get(s, f"{base}/v1/replicas/{rid}")
        if r["region"] != "eu" or r["state"] == "draining":
            return False
        at_eu = (await status(s, lb_eu.url))["replicas"]
        # Healthy at lb-eu too (its own probe): a balancer with no healthy replica for a
        # model fails a request fast with a 503.
        return (at_eu.get(url, {}).get("healthy", False)
                and url not in (await status(s, lb_us.url))["replicas"])

    await wait_for(moved, "the replica re-registered in eu and served by lb-eu", 90)
    await asyncio.gather(*streams)

    # Nothing lost: every stream that was on the replica when it drained completed.
    assert open_at_drain[0] >= 1  # the move really ran under load
    assert tally.row()["completed"] == STREAMS, tally.row()
    assert tally.lost == tally.failed_explicit == 0
    assert dict(tally.statuses) == {200: STREAMS}
    r = await get(s, f"{base}/v1/replicas/{rid}")
    assert (r["model"], r["region"], r["gpu"], r["balancer"], r["url"]) == (
        MODEL, "eu", "L4", "lb-eu", url)  # the same process, now eu's
    # The round that did it records the move.
    plans = await get(s, f"{base}/v1/plans")
    rows = [(p["status"], m) for p in plans for a in p["actions"] for m in a.get("moves", [])]
    assert ("applied", {"replica": rid, "from": {"model": MODEL, "region": "us", "gpu": "L4"},
                        "to": {"model": MODEL, "region": "eu", "gpu": "L4"},
                        "outcome": "moved"}) in [
        (st, {k: m[k] for k in ("replica", "from", "to", "outcome")}) for st, m in rows]
    print("streams open at the drain:", open_at_drain[0], "of", STREAMS,
          "| the move:", next(m for _, m in rows if m["outcome"] == "moved"))
    # And lb-eu serves with it.
    t = Tally()
    assert await send(s, lb_eu.url, chat_body("after", 8, stream=False), t, 60) == "completed"
