"""Several ``skymesh-controller`` processes on one real ``redis-server``: one leader (the
only one that probes), a standby taking over after SIGKILL, and a SIGSTOPped leader that
stands down when it wakes (docs/operations-control-ha.md).

Short leases (1.5 s, renewed every 0.3 s) keep the test fast; every wait is on a
condition with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from controller_support import ADMIN, RedisServer, auth, token_config
from support import run_bounded, wait_for

from skymesh.util.procs import Daemon, executable, start_daemon
from skymesh_lab.faults.cluster import parse_metrics

TTL_S, RENEW_S, PROBE_S = 1.5, 0.3, 0.1


def start(tmp: Path, name: str, store: str) -> Daemon:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0}, "tokens": token_config(), "store": store,
        "url_policy": {"allow_loopback": True}, "probe": {"interval_s": PROBE_S},
        "ha": {"id": name, "lease_ttl_s": TTL_S, "renew_interval_s": RENEW_S,
               "revision_poll_s": 0.1},
        # A planner that runs a (skipped: no telemetry) round every 0.5 s, so its round
        # count shows which controller plans.
        "planner": {"mode": "dry-run", "capacity": {"llama": {"L4": 100.0}},
                    "schedule": {"interval_s": 0.5, "tick_s": 0.1, "first_round_s": 0}}}))
    return start_daemon("skymesh-controller", ["--config", str(path)],
                        log_path=tmp / f"{name}.log")


def metrics(d: Daemon) -> dict[str, float]:
    try:
        return parse_metrics(httpx.get(d.url + "/metrics", timeout=2).text)
    except httpx.HTTPError:
        return {}


def control(d: Daemon) -> dict[str, Any]:
    return httpx.get(d.url + "/v1/status", headers=auth(), timeout=2).json()["control"]


def leaders(ds: list[Daemon]) -> list[Daemon]:
    return [d for d in ds if metrics(d).get("skymesh_controller_leader") == 1.0]


def rounds(d: Daemon) -> float:
    return metrics(d).get("skymesh_controller_probe_rounds_total", 0.0)


def plans(d: Daemon) -> float:
    return metrics(d).get("skymesh_controller_planner_rounds_total", 0.0)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def controllers(tmp: Path, store: str, n: int) -> Iterator[list[Daemon]]:
    ds: list[Daemon] = []
    try:
        for i in range(n):
            ds.append(start(tmp, f"ctl-{i}", store))
        yield ds
    finally:
        for d in ds:
            with contextlib.suppress(ProcessLookupError):
                os.kill(d.proc.pid, signal.SIGCONT)
            d.stop()


@pytest.mark.parametrize("n", [2, 3])
def test_one_leader_probes_the_rest_stand_by(tmp_path: Path, redis: RedisServer,
                                             n: int) -> None:
    with controllers(tmp_path, redis.url, n) as ds:
        # Something to probe, registered through a standby (standbys take writes).
        leader = wait_for(lambda: leaders(ds), "a leader")[0]
        standby = next(d for d in ds if d is not leader)
        r = httpx.post(standby.url + "/v1/regions", headers=auth(),
                       json={"name": "us", "latitude": 0, "longitude": 0})
        assert r.status_code == 201, r.text
        base = {d.url: rounds(d) for d in ds}
        wait_for(lambda: rounds(leader) >= base[leader.url] + 5, "the leader probing")
        wait_for(lambda: plans(leader) >= 3, "the leader planning")
        # Exactly one leader, and only it probed and planned: the others' counters are 0.
        assert leaders(ds) == [leader]
        for d in ds:
            if d is not leader:
                assert rounds(d) == base[d.url] == 0.0
                assert plans(d) == 0.0
        # Every controller names the same leader, and the lease's age.
        for d in ds:
            c = control(d)
            assert c["leader"] == control(leader)["id"]
            assert c["role"] == ("leader" if d is leader else "standby")
            assert c["lease_age_s"] is not None and c["lease_age_s"] >= 0
        # A balancer long-polling a standby wakes for a write made through the leader
        # (the client's 5 s timeout is far below the 30 s wait: only a wake answers).
        assert httpx.post(leader.url + "/v1/balancers", headers=auth(), json={
            "id": "lb-us", "region": "us", "url": "http://127.0.0.1:9"}).status_code == 201
        view = httpx.get(standby.url + "/v1/balancers/lb-us/membership",
                         headers=auth()).json()
        with ThreadPoolExecutor(1) as pool:
            polled = pool.submit(lambda: httpx.get(
                standby.url + "/v1/balancers/lb-us/membership", headers=auth(),
                params={"after": view["revision"], "wait": 30}, timeout=5).json())
            r = httpx.post(leader.url + "/v1/replicas", headers=auth(), json={
                "id": "r1", "url": "http://127.0.0.1:9", "model": "llama", "region": "us",
                "gpu": "L4"})
            assert r.status_code == 201, r.text
            woke = polled.result()
        assert woke["revision"] > view["revision"]
        # `skymesh ctl status` on a standby names the leader.
        token = tmp_path / "admin-token"
        token.write_text(ADMIN)
        out = run_bounded([*executable("skymesh"), "ctl", "--controller", standby.url,
                           "--token-file", str(token), "status"], timeout=30)
        assert out.returncode == 0, out.stderr
        lead_id = control(leader)["id"]
        assert f"control: leader {lead_id} (epoch " in out.stdout
        assert f"({control(standby)['id']}) standby" in out.stdout


def test_a_standby_takes_over_from_a_killed_leader(tmp_path: Path,
                                                   redis: RedisServer) -> None:
    with controllers(tmp_path, redis.url, 2) as ds:
        old = wait_for(lambda: leaders(ds), "a leader")[0]
        new = next(d for d in ds if d is not old)
        epoch = control(new)["epoch"]
        old.kill()
        t0 = time.monotonic()
        wait_for(lambda: leaders([new]), "the standby to take over", timeout=10)
        took = time.monotonic() - t0
        before = rounds(new)
        wait_for(lambda: rounds(new) > before, "the new leader probing")
        wait_for(lambda: plans(new) > 0, "the new leader planning")
        assert control(new)["epoch"] == epoch + 1
        # Bounded by the lease: it lapses within ttl, then the next try wins (not a
        # timing assertion on the machine's speed: the bound is the configuration's).
        print(f"takeover after SIGKILL: {took:.2f} s (ttl {TTL_S} s, renew {RENEW_S} s)")


def test_a_stopped_leader_stands_down_when_it_wakes(tmp_path: Path,
                                                    redis: RedisServer) -> None:
    with controllers(tmp_path, redis.url, 2) as ds:
        old = wait_for(lambda: leaders(ds), "a leader")[0]
        new = next(d for d in ds if d is not old)
        down = metrics(old)["skymesh_controller_leader_stood_down_total"]
        os.kill(old.proc.pid, signal.SIGSTOP)
        wait_for(lambda: leaders([new]), "the standby to take over", timeout=10)
        os.kill(old.proc.pid, signal.SIGCONT)
        m = wait_for(lambda: (mm := metrics(old)) and mm, "the woken leader to answer")
        after_wake = m["skymesh_controller_probe_rounds_total"]
        # Woken: it is a standby, it says who leads, and it probes no more.
        wait_for(lambda: metrics(old).get("skymesh_controller_leader_stood_down_total", 0)
                 > down,
                 "the woken leader to stand down")
        assert metrics(old)["skymesh_controller_leader"] == 0.0
        assert control(old)["leader"] == control(new)["id"]
        planned = metrics(old).get("skymesh_controller_planner_rounds_total", 0.0)
        later = rounds(new)
        wait_for(lambda: rounds(new) >= later + 5, "the new leader probing on")
        assert rounds(old) == after_wake
        assert plans(old) == planned  # nor plans
        assert leaders(ds) == [new]
        assert f"standing down: {control(old)['id']}" in old.log()


def test_a_tenant_written_through_a_standby_reaches_a_balancer_polling_the_leader(
        tmp_path: Path, redis: RedisServer) -> None:
    with controllers(tmp_path, redis.url, 2) as ds:
        leader = wait_for(lambda: leaders(ds), "a leader")[0]
        standby = next(d for d in ds if d is not leader)
        assert httpx.post(leader.url + "/v1/regions", headers=auth(), json={
            "name": "us", "latitude": 0, "longitude": 0}).status_code == 201
        assert httpx.post(leader.url + "/v1/balancers", headers=auth(), json={
            "id": "lb-us", "region": "us", "url": "http://127.0.0.1:9"}).status_code == 201
        path = "/v1/balancers/lb-us/membership"
        view = httpx.get(leader.url + path, headers=auth()).json()
        assert view["tenants"] == []

        def poll(after: int) -> dict[str, Any]:
            # Waits up to 30 s for a change; the client gives up after 10: only a wake-up
            # answers in time.
            return httpx.get(leader.url + path, headers=auth(),
                             params={"after": after, "wait": 30}, timeout=10).json()

        with ThreadPoolExecutor(1) as pool:
            polled = pool.submit(poll, view["revision"])
            r = httpx.put(standby.url + "/v1/tenants/acme", headers=auth(),
                          json={"requests_per_s": 5.0})
            assert r.status_code == 200, r.text
            woke = polled.result()
        # Another change (the prober marking lb-us down) may wake the poll first: poll on.
        for _ in range(5):
            if woke["tenants"]:
                break
            woke = poll(woke["revision"])
        assert [(t["name"], t["requests_per_s"], t["share"]) for t in woke["tenants"]] == [
            ("acme", 5.0, 1)]
