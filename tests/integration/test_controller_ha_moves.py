"""A leader lost in the middle of a planner move, on a real ``redis-server``: two
controllers (in-process apps, so the test can freeze one's lease renewals as a SIGSTOP
would) share the store. The leader starts a move and drains the replica; its renewals
stop; the standby takes over, finds the move in the round's record and undrains the
replica where it is. The old leader's move then goes idle and tries to re-register the
replica: the store refuses that write (fencing), so the replica is neither moved twice
nor left between two regions."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from controller_support import AGENT, RedisServer, auth, token_config
from fastapi.testclient import TestClient
from support import wait_for

from skymesh.util.procs import Daemon, start_daemon
from skymesh_controller.api import build_app
from skymesh_controller.autopilot.planner import Planner
from skymesh_controller.config import parse_config
from skymesh_controller.planning.actuate import ApplyReport
from skymesh_controller.planning.ilp import Key

US, EU = ("llama", "us", "L4"), ("llama", "eu", "L4")
W = 60


class Mover:
    """A stand-in actuator whose one replica, r1, the plan moves from us to eu."""

    kind = "fake"
    move_kinds = frozenset({"region", "model"})

    def __init__(self, url: str) -> None:
        self.ids: dict[Key, list[str]] = {US: ["r1"]}
        self.url, self.mover = url, self
        self.prepared: list[str] = []

    def current(self, keys: Any, registered: Any) -> dict[Key, int]:
        return {k: len(self.ids.get(k, [])) for k in keys}

    def apply_counts(self, counts: dict[Key, int], registered: Any) -> ApplyReport:
        return ApplyReport(unchanged=list(counts))

    def close(self) -> None:
        pass

    def movable(self, key: Key) -> list[str]:
        return list(self.ids.get(key, []))

    def prepare_move(self, rid: str, src: Key, dst: Key) -> str:
        self.prepared.append(rid)
        return self.url

    def finish_move(self, rid: str, src: Key, dst: Key) -> None:
        self.ids[src].remove(rid)
        self.ids.setdefault(dst, []).append(rid)

    def abort_move(self, rid: str) -> None:
        pass


@pytest.fixture
def replica() -> Iterator[Daemon]:
    d = start_daemon("skymesh-replica", ["--port", "0", "--model", "llama",
                                         "--log-level", "warning"])
    try:
        yield d
    finally:
        d.stop()


def app_for(name: str, store: str) -> Any:
    cfg = parse_config({
        "store": store, "tokens": token_config(), "url_policy": {"allow_loopback": True},
        "ha": {"id": name, "lease_ttl_s": 1.5, "renew_interval_s": 0.3},
        "planner": {"mode": "auto", "capacity": {"llama": {"L4": 100.0}}, "epsilon": 1.0,
                    "drain_timeout_s": 60, "drain_poll_s": 0.05,
                    "schedule": {"window_s": W, "horizon": 2, "first_round_s": 1e9,
                                 "tick_s": 3600},
                    "forecaster": {"headroom": 0.0},
                    "cooldowns": {"retry_s": 60, "hold_s": 0}}})
    return build_app(cfg, probe=False)


def test_a_standby_settles_a_move_its_lost_leader_started(tmp_path: Path,
                                                          replica: Daemon) -> None:
    redis = RedisServer(tmp_path)
    redis.start()
    app_a, app_b = app_for("a", redis.url), app_for("b", redis.url)
    pa: Planner = app_a.state.planner
    pb: Planner = app_b.state.planner
    pa.backend, pb.backend = Mover(replica.url), Mover(replica.url)
    try:
        with TestClient(app_a) as a:
            wait_for(lambda: pa.ctl.leadership.leader, "a to lead")
            with TestClient(app_b) as b:
                run_move_and_lose_the_leader(a, b, pa, pb)
    finally:
        redis.stop()


def run_move_and_lose_the_leader(a: TestClient, b: TestClient, pa: Planner,
                                 pb: Planner) -> None:
    for region in ("us", "eu"):
        assert b.post("/v1/regions", headers=auth(), json={
            "name": region, "latitude": 1.0, "longitude": 2.0}).status_code == 201
        assert b.post("/v1/balancers", headers=auth(AGENT), json={
            "id": f"lb-{region}", "region": region,
            "url": "http://127.0.0.1:9"}).status_code == 201
    assert b.post("/v1/replicas", headers=auth(), json={
        "id": "r1", "url": pa.backend.url, "model": "llama", "region": "us",  # type: ignore[union-attr]
        "gpu": "L4"}).status_code == 201
    # lb-us follows membership (so the drain waits for it), and the demand is in eu.
    rev = b.get("/v1/status", headers=auth()).json()["revision"]
    b.get("/v1/balancers/lb-us/membership", headers=auth(AGENT), params={"after": rev})
    now = time.time()
    for i in range(5):
        for region, tps in (("us", 0.0), ("eu", 80.0)):
            a.portal.call(pa.store.append, f"balancer:lb-{region}", {
                "ts": now - (5 - i) * W, "region": region, "window_s": W,
                "balancer": f"lb-{region}", "queue_length": 0, "in_flight": 0,
                "models": {"llama": {"requests": 1, "prompt_tokens": int(tps * W),
                                     "output_tokens": 0}}}, 1000)
    pa.clock = pb.clock = lambda: now

    # a (the leader) applies a round: it drains r1 and waits for lb-us, which never acks.
    answer: dict[str, Any] = {}
    t = threading.Thread(target=lambda: answer.update(r=a.post(
        "/v1/plans", headers=auth(), json={"dry_run": False})))
    t.start()

    def draining() -> dict[str, Any] | None:
        recs = b.get("/v1/plans", headers=auth()).json()
        return next((r for r in recs if any(m["state"] == "draining"
                                             for m in r.get("moves", []))), None)

    rec = wait_for(draining, "a's move to drain r1")
    assert b.get("/v1/replicas/r1", headers=auth()).json()["state"] == "draining"

    # a stops renewing (as if stopped); b takes over and settles the move from its record.
    a.portal.call(stop_renewing, pa)
    wait_for(lambda: pb.ctl.leadership.leader, "b to lead", timeout=10)

    def settled() -> dict[str, Any] | None:
        got = b.get(f"/v1/plans/{rec['id']}", headers=auth()).json()
        return got if got["status"] == "failed" else None

    got = wait_for(settled, "b to settle a's round")
    assert "1 undrained" in got["reason"] and got["moves"][0]["state"] == "planned"
    r1 = b.get("/v1/replicas/r1", headers=auth()).json()
    assert (r1["region"], r1["balancer"], r1["state"]) == ("us", "lb-us", "unknown")

    # a's drain now goes idle (lb-us acks, r1 is quiet): its re-registration is refused.
    fenced_before = pa.store.fenced_total
    rev = b.get("/v1/status", headers=auth()).json()["revision"]
    a.portal.call(pa.ctl.members.record_poll, "lb-us", rev)
    t.join(30)
    assert not t.is_alive()
    assert answer["r"].status_code == 503, answer["r"].text  # its round's save refused
    assert pa.store.fenced_total > fenced_before
    r1 = b.get("/v1/replicas/r1", headers=auth()).json()
    assert (r1["region"], r1["balancer"], r1["state"]) == ("us", "lb-us", "unknown")
    final = b.get(f"/v1/plans/{rec['id']}", headers=auth()).json()
    assert final["status"] == "failed" and final["actions"] == []  # applied by no one
    assert b.get("/v1/status", headers=auth()).json()["control"]["leader"] == "b"


async def stop_renewing(p: Planner) -> None:
    task = p.ctl.leadership._task
    assert task is not None
    task.cancel()
