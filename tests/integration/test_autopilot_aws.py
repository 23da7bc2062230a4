"""The autopilot on moto's AWS server: a real ``skymesh-controller`` in auto mode with
the AWS actuator, driven by its own loop. Telemetry from a balancer in us and one in mars
(a region with no AWS region mapped) make it plan; the us Auto Scaling group is created
at the plan's count and follows the demand up, while the mars key is reported as a
partial failure, tried again after the cooldown and counted on /metrics."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from controller_support import AGENT, READER, auth, planner_controller
from prometheus_client.parser import text_string_to_metric_families

from skymesh.util.procs import Daemon
from skymesh_controller.planning.actuate_aws import group_name

TIMEOUT_S = 60.0
pytestmark = pytest.mark.slow


def wait_for(cond: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
    return got


CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
         "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def controller(tmp_path: Path, moto_url: str) -> Iterator[Daemon]:
    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"))
    planner = {
        "mode": "auto", "epsilon": 1.0, "capacity": {"llama": {"L4": 100.0}},
        "bounds": {"llama": {"*": {"min": 1, "max": 8}}},
        "schedule": {"window_s": 1, "horizon": 2, "interval_s": 1, "tick_s": 0.25,
                     "first_round_s": 0, "min_history_windows": 2, "stale_windows": 3},
        "forecaster": {"headroom": 0.0},
        "cooldowns": {"hold_s": 0, "retry_s": 0.5, "retry_max_s": 1, "max_attempts": 3},
        "actuator": {"kind": "aws", "aws": {
            "endpoint_url": moto_url, "regions": {"us": "us-east-1"}}}}
    with planner_controller(tmp_path, planner, probe_s=None,
                            env={**os.environ, **CREDS}) as ctl:
        yield ctl


def post_telemetry(base: str, bid: str, tps: float) -> None:
    # One report per call, covering a second: the planner sums what lands in a window.
    r = httpx.post(f"{base}/v1/balancers/{bid}/telemetry", headers=auth(AGENT), timeout=10,
                   json={"window_s": 1.0, "models": {"llama": {
                       "requests": 1, "prompt_tokens": int(tps), "output_tokens": 0}}})
    assert r.status_code == 204, r.text


def metric(base: str, name: str, **labels: str) -> float | None:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def test_the_controller_loop_drives_auto_scaling_groups(controller: Daemon,
                                                        moto_url: str) -> None:
    base = controller.url
    asg = boto3.client("autoscaling", endpoint_url=moto_url, **{
        "region_name": "us-east-1", "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing"})

    def desired() -> int | None:
        groups = asg.describe_auto_scaling_groups(
            AutoScalingGroupNames=[group_name("llama", "us", "L4")])["AutoScalingGroups"]
        return groups[0]["DesiredCapacity"] if groups else None

    admin = httpx.Client(base_url=base, headers=auth(), timeout=10)
    for region in ("us", "mars"):
        assert admin.post("/v1/regions", json={"name": region, "latitude": 0.0,
                                               "longitude": 0.0}).status_code == 201
        r = httpx.post(f"{base}/v1/balancers", headers=auth(AGENT), timeout=10,
                       json={"id": f"lb-{region}", "region": region,
                             "url": "http://127.0.0.1:9"})
        assert r.status_code == 201, r.text

    def feed(us_tps: float) -> None:
        post_telemetry(base, "lb-us", us_tps)
        post_telemetry(base, "lb-mars", 50)

    def feeding(cond: Callable[[], bool], us_tps: float) -> Callable[[], bool]:
        """``cond``, with the balancers' reports going on while we wait for it."""
        def check() -> bool:
            feed(us_tps)
            time.sleep(0.2)  # a reporting cadence (balancers report every few seconds)
            return cond()
        return check

    def group_at_least(n: int) -> bool:
        got = desired()
        return got is not None and got >= n

    def errors_in_mars() -> float:
        return metric(base, "skymesh_controller_planner_actuation_errors_total",
                      model="llama", region="mars") or 0

    wait_for(feeding(lambda: group_at_least(3), 300.0), "the us group created at 3 or more")
    wait_for(feeding(lambda: group_at_least(6), 600.0), "the us group scaled out to 6 or more")
    wait_for(feeding(lambda: (metric(base, "skymesh_controller_planner_actual_instances",
                                     model="llama", region="us") or 0) >= 6, 600.0),
             "actual instances in us: 6 or more")
    reader = httpx.Client(base_url=base, headers=auth(READER), timeout=10)
    plans: list[dict[str, Any]] = reader.get("/v1/plans", params={"limit": 200}).json()
    partial = [p for p in plans if p["status"] in ("partial", "failed")]
    assert partial, [p["status"] for p in plans]
    errors = [e for p in partial for a in p["actions"] for e in a["errors"]]
    assert {e["region"] for e in errors} == {"mars"}
    assert "no AWS region mapped for 'mars'" in errors[0]["error"]
    # Tried again (by a retry or a later round, whichever the cooldown lets first).
    wait_for(feeding(lambda: errors_in_mars() >= 2, 600.0), "mars tried again")
