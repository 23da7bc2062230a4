"""Forecast-aware overflow end to end with real processes: a ``skymesh-controller`` whose
planner forecasts telemetry (as balancers send it, over HTTP with an agent token)
publishes ``GET /v1/outlook``, and a real ``skymesh-lb`` with ``mesh.outlook`` on reads it
on its telemetry cadence and shows it, with its peers' regions, in ``/status``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import support
import yaml
from controller_support import AGENT, READER, TelemetryFeeder, auth, planner_controller

from skymesh.mesh import certs
from skymesh.util.procs import Daemon, start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TIMEOUT_S = 60.0
# tokens/s each peer region's balancer reports; capacity is one L4 of 100 tokens/s each.
DEMAND = {"eu": 40.0, "asia": 160.0}
pytestmark = pytest.mark.slow


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Daemon]:
    planner = {
        "mode": "dry-run", "epsilon": 1.0, "capacity": {MODEL: {"L4": 100.0}},
        "schedule": {"window_s": 1, "horizon": 3, "interval_s": 1, "tick_s": 0.5,
                     "first_round_s": 0, "min_history_windows": 3,
                     "stale_windows": 5},
        "forecaster": {"headroom": 0.0}}
    # The peers below are records, not processes: no probe during the test.
    with planner_controller(tmp_path, planner, probe_s=3600) as ctl:
        yield ctl


def outlook_of(lb: Daemon) -> Any:
    try:
        st = httpx.get(f"{lb.url}/status", timeout=5).json()
    except httpx.HTTPError:
        return None
    o = st["mesh"]["outlook"]
    return o if {r["region"] for r in o["regions"]} >= set(DEMAND) else None


def test_a_balancer_reads_the_planners_outlook(controller: Daemon, tmp_path: Path) -> None:
    admin = httpx.Client(base_url=controller.url, headers=auth(), timeout=10)
    agent = httpx.Client(base_url=controller.url, headers=auth(AGENT), timeout=10)
    for name in ("us", "eu", "asia"):
        assert admin.post("/v1/regions", json={"name": name, "latitude": 1.0,
                                               "longitude": 2.0}).status_code == 201
    for i, region in enumerate(DEMAND):
        r = agent.post("/v1/balancers", json={"id": f"lb-{region}", "region": region,
                                              "url": f"http://127.0.0.1:{9 + i}"})
        assert r.status_code == 201, r.text
        r = admin.post("/v1/replicas", json={"url": f"http://127.0.0.1:{19 + i}",
                                             "model": MODEL, "region": region, "gpu": "L4",
                                             "balancer": f"lb-{region}"})
        assert r.status_code == 201, r.text
    # No planner round yet: an empty outlook, readable with the balancers' token.
    assert agent.get("/v1/outlook").json()["regions"] == []

    pki = tmp_path / "pki"
    certs.create_ca(pki)
    certs.issue_cert(pki, "lb-us")
    rep = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.05"],
                       log_path=tmp_path / "replica.log")
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump({
        "region": "us", "listen": {"host": "127.0.0.1", "port": 0},
        "replicas": [{"url": rep.url, "models": [MODEL], "gpu": "L4"}],
        "mesh": {"id": "lb-us", "certs_dir": str(pki), "outlook": {"enabled": True}},
        "controller": {"url": controller.url, "balancer_id": "lb-us", "poll_wait_s": 5,
                       "retry_s": 0.2, "telemetry_interval_s": 0.25, "follow_peers": False,
                       "url_policy": {"allow_loopback": True}}}))
    lb = start_daemon("skymesh-lb", ["--config", str(path)], log_path=tmp_path / "lb.log",
                      env={**os.environ, "SKYMESH_AGENT_TOKEN": AGENT})
    try:
        with TelemetryFeeder(controller.url, MODEL, dict(DEMAND)):
            got = support.wait_for(lambda: outlook_of(lb), "the balancer holds an outlook "
                                   "for eu and asia", TIMEOUT_S, interval=0.1)
        published = httpx.get(f"{controller.url}/v1/outlook", headers=auth(READER),
                              timeout=10).json()
    finally:
        lb.stop()
        rep.stop()
    assert got["peer_regions"] == {"lb-asia": "asia", "lb-eu": "eu"}
    assert got["horizon"] == 3 and got["updates"] >= 1
    load = {r["region"]: r["load"] for r in got["regions"]}
    # One L4 of 100 tokens/s per region; asia is asked for four times what eu is (a
    # loaded machine may deliver fewer reports, so no exact figures).
    assert all(len(v) == 3 for v in load.values())
    assert max(load["eu"]) < min(load["asia"])
    assert 0 < load["asia"][0] <= 1.6 + 1e-9
    by_region = {r["region"]: r for r in published["regions"]}
    assert by_region["asia"]["capacity_tokens_per_s"] == 100.0
    assert published["window_s"] == 1 and published["plan"].startswith("plan-")
