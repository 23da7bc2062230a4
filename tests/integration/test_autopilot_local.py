"""The autopilot end to end on this machine: a real ``skymesh-controller`` in auto mode
with the local actuator. Telemetry (as a balancer sends it, over HTTP with an agent
token) says us needs 2 instances: the controller's own loop forecasts, solves, starts
two ``skymesh-replica`` processes and registers them; the demand goes away and it
scales back to the bound's minimum, stopping what it started; on shutdown it stops the
rest. Windows are one second long so the whole loop runs in seconds."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import support
from controller_support import AGENT, READER, TelemetryFeeder, auth, planner_controller

from skymesh.util.procs import Daemon

TIMEOUT_S = 60.0
pytestmark = pytest.mark.slow


def wait_for(cond: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> Any:
    return support.wait_for(cond, what, timeout, interval=0.1)


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Daemon]:
    planner = {
        "mode": "auto", "epsilon": 1.0, "capacity": {"llama": {"L4": 100.0}},
        "bounds": {"llama": {"*": {"min": 1, "max": 2}}},
        "schedule": {"window_s": 1, "horizon": 2, "interval_s": 2, "tick_s": 0.5,
                     "first_round_s": 0, "min_history_windows": 3,
                     "stale_windows": 3},
        "forecaster": {"headroom": 0.2}, "cooldowns": {"hold_s": 5, "retry_s": 1},
        "actuator": {"kind": "local", "local": {"log_dir": str(tmp_path)}}}
    with planner_controller(tmp_path, planner) as ctl:
        yield ctl


def replicas(c: httpx.Client) -> list[dict[str, Any]]:
    return [r for r in c.get("/v1/replicas").json() if r["kind"] == "skymesh"]


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_controller_scales_local_replicas_with_the_demand(controller: Daemon) -> None:
    admin = httpx.Client(base_url=controller.url, headers=auth(), timeout=10)
    reader = httpx.Client(base_url=controller.url, headers=auth(READER), timeout=10)
    assert admin.post("/v1/regions", json={"name": "us", "latitude": 38.9,
                                           "longitude": -77.0}).status_code == 201
    r = httpx.post(f"{controller.url}/v1/balancers", headers=auth(AGENT),
                   json={"id": "lb-us", "region": "us", "url": "http://127.0.0.1:9"})
    assert r.status_code == 201, r.text
    with TelemetryFeeder(controller.url, "llama", {"us": 0.0}) as feed:
        # x 1.2 headroom = 192 tokens/s: 2 instances of 100 (and still 2 when a loaded
        # machine delivers only 45% of the reports: over 100 tokens/s after headroom).
        feed.tps["us"] = 160.0
        up = wait_for(lambda: len(replicas(reader)) == 2 and replicas(reader),
                      "two replicas started and registered")
        assert all(answers(r["url"]) for r in up)
        assert {(r["model"], r["region"], r["gpu"]) for r in up} == {("llama", "us", "L4")}
        plans = reader.get("/v1/plans").json()
        # The round that asked for two (an earlier one may have seen the first windows only).
        to_two = next(p for p in plans if p["status"] == "applied"
                      and p["changes"][0]["after"] == 2)
        # Under two days of history the forecast is persistence: the last complete window.
        seen = to_two["inputs"]["series"][0]["tokens_per_s"][-1]
        assert to_two["forecast"][0]["tokens_per_s"] == [seen, seen]
        assert to_two["forecast"][0]["forecaster"].startswith("persistence")

        feed.tps["us"] = 0.0  # the demand goes away: down to the bound's minimum of one
        left = wait_for(lambda: len(replicas(reader)) == 1 and replicas(reader),
                        "scaled in to one replica")
    gone = [r["url"] for r in up if r["url"] != left[0]["url"]]
    wait_for(lambda: not any(answers(u) for u in gone), "the stopped replicas exited")
    # The round that scaled in is counted once its actuation is over.
    wait_for(lambda: 'skymesh_controller_planner_actual_instances{model="llama",region="us"} '
             '1.0' in httpx.get(f"{controller.url}/metrics").text, "actual instances: 1")
    assert controller.stop() == 0
    assert not answers(left[0]["url"])  # the controller stopped its own replicas on exit
