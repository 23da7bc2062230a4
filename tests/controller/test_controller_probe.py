"""The controller's probes against real processes: balancer down/up, replica health."""

from __future__ import annotations

from pathlib import Path

from controller_support import free_port

from skymesh.util.procs import start_daemon
from skymesh_controller.config import parse_config
from skymesh_controller.models import BalancerIn, RegionIn, ReplicaIn
from skymesh_controller.service import Controller
from skymesh_controller.store import MemoryStore


async def test_probes_mark_states_and_membership_follows(tmp_path: Path) -> None:
    rep = start_daemon("skymesh-replica", ["--port", "0"], log_path=tmp_path / "r.log")
    # Any server answering /health stands in for lb-eu here: the probe asks nothing more.
    eu = start_daemon("skymesh-replica", ["--port", "0"], log_path=tmp_path / "eu.log")
    ctl = Controller(parse_config({"probe": {"failure_threshold": 2, "timeout_s": 0.5},
                                   "url_policy": {"allow_loopback": True}}), MemoryStore())
    await ctl.start(probe=False)  # rounds driven by the test, one at a time
    try:
        await ctl.put_region(RegionIn(name="us", latitude=38.9, longitude=-77.0))
        await ctl.put_region(RegionIn(name="eu", latitude=53.3, longitude=-6.3))
        # lb-us points at a closed port: it never answers its probes
        await ctl.register_balancer(BalancerIn(id="lb-us", region="us",
                                               url=f"http://127.0.0.1:{free_port()}"))
        await ctl.register_balancer(BalancerIn(id="lb-eu", region="eu", url=eu.url))
        r = await ctl.add_replica(ReplicaIn(url=rep.url, model="m", region="us", gpu="L4"))
        assert r["assigned"] == "lb-us"

        await ctl.probe_once()
        b = await ctl.get("balancers", "lb-us", "balancer")
        assert b["state"] == "unknown"  # one failure is not enough
        assert (await ctl.get("replicas", r["id"], "replica"))["state"] == "healthy"
        await ctl.probe_once()
        assert (await ctl.get("balancers", "lb-us", "balancer"))["state"] == "down"
        assert (await ctl.get("balancers", "lb-eu", "balancer"))["state"] == "up"
        moved = await ctl.get("replicas", r["id"], "replica")
        assert moved["assigned"] == "lb-eu" and moved["balancer"] == "lb-us"
        assert [x["url"] for x in (await ctl.membership("lb-eu"))["replicas"]] == [rep.url]
        assert [p["id"] for p in (await ctl.membership("lb-eu"))["peers"]] == []

        rep.kill()
        for _ in range(2):
            await ctl.probe_once()
        assert (await ctl.get("replicas", r["id"], "replica"))["state"] == "unhealthy"
        assert (await ctl.membership("lb-eu"))["replicas"] == []
        st = await ctl.status()
        assert st["balancers"] == {"down": 1, "up": 1}
        assert st["replicas"] == {"unhealthy": 1} and st["moved_replicas"] == [r["id"]]
    finally:
        rep.stop()
        eu.stop()
        await ctl.stop()


def test_controller_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    import os

    d = start_daemon("skymesh-controller", ["--port", "0"], log_path=tmp_path / "c.log",
                     env={**os.environ, "SKYMESH_ADMIN_TOKEN": "t"})
    assert d.stop() == 0, d.log()
