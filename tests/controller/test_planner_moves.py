"""Replica moves (issue #25 item 2): the pure pairing of a plan's diff into moves, the
drain's state machine on a fake clock, and a move run by the planner inside a real
controller (memory store) against a real ``skymesh-replica``: a drain no balancer
confirms times out, rolls back and is reported; its retry on the cooldowns moves the
replica to the other region's balancer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from controller_support import AGENT, auth, token_config
from fastapi.testclient import TestClient

from skymesh.util.procs import Daemon, start_daemon
from skymesh_controller.api import build_app
from skymesh_controller.autopilot.decide import pair_moves
from skymesh_controller.autopilot.moves import IDLE, TIMEOUT, WAITING, DrainWatch
from skymesh_controller.autopilot.planner import Planner
from skymesh_controller.planning.actuate import ApplyReport
from skymesh_controller.planning.ilp import Key

US, EU = ("llama", "us", "L4"), ("llama", "eu", "L4")
BOTH = frozenset({"region", "model"})


# -- pairing ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("changes", "kinds", "movable", "want"), [
    # a region loses one, another gains one: a move
    ([(US, 1, 0), (EU, 0, 1)], BOTH, {US: 1}, [(US, EU)]),
    # the actuator may move only what it runs: one of the two
    ([(US, 3, 1), (EU, 0, 2)], BOTH, {US: 1}, [(US, EU)]),
    ([(US, 3, 1), (EU, 0, 2)], BOTH, {US: 3}, [(US, EU), (US, EU)]),
    # more surplus than deficit: the rest is a stop
    ([(US, 3, 0), (EU, 1, 2)], BOTH, {US: 3}, [(US, EU)]),
    # another GPU type is another machine: no move
    ([(US, 1, 0), (("llama", "eu", "H100"), 0, 1)], BOTH, {US: 1}, []),
    # a model change in the same region
    ([(US, 1, 0), (("qwen", "us", "L4"), 0, 1)], BOTH, {US: 1}, [(US, ("qwen", "us", "L4"))]),
    # an actuator that cannot change models leaves that to stop + start
    ([(US, 1, 0), (("qwen", "us", "L4"), 0, 1)], frozenset({"region"}), {US: 1}, []),
    ([(US, 1, 0), (EU, 0, 1)], frozenset({"model"}), {US: 1}, []),
    # no mover (aws, none): nothing movable
    ([(US, 1, 0), (EU, 0, 1)], BOTH, {}, []),
    # a model and a region at once only with both kinds
    ([(US, 1, 0), (("qwen", "eu", "L4"), 0, 1)], BOTH, {US: 1}, [(US, ("qwen", "eu", "L4"))]),
    ([(US, 1, 0), (("qwen", "eu", "L4"), 0, 1)], frozenset({"region"}), {US: 1}, []),
])
def test_pairing_turns_a_surplus_and_a_deficit_into_moves(
        changes: list[tuple[Key, int, int]], kinds: frozenset[str], movable: dict[Key, int],
        want: list[tuple[Key, Key]]) -> None:
    assert pair_moves(changes, kinds, movable) == want


def test_pairing_prefers_a_region_move_to_a_model_change() -> None:
    """us loses one; eu (same model) and qwen in us both gain one: the process that keeps
    running goes to eu, and qwen gets a fresh start."""
    qwen_us = ("qwen", "us", "L4")
    got = pair_moves([(US, 1, 0), (qwen_us, 0, 1), (EU, 0, 1)], BOTH, {US: 1})
    assert got == [(US, EU)]


def test_pairing_is_deterministic_whatever_the_order_of_the_diff() -> None:
    asia = ("llama", "asia", "L4")
    a = [(US, 2, 0), (EU, 0, 1), (asia, 0, 1)]
    assert pair_moves(a, BOTH, {US: 2}) == pair_moves(a[::-1], BOTH, {US: 2}) == [
        (US, asia), (US, EU)]


# -- the drain's state machine ---------------------------------------------------------------
def test_a_drain_is_idle_after_two_quiet_polls_once_every_balancer_applied_it() -> None:
    w = DrainWatch(deadline=100.0)
    assert w.observe(0.0, acked=False, busy=None) == WAITING  # a balancer still serves it
    assert w.observe(1.0, acked=True, busy=3) == WAITING  # requests finishing
    assert w.observe(2.0, acked=True, busy=0) == WAITING  # one quiet poll is not enough
    assert w.observe(3.0, acked=True, busy=1) == WAITING  # one was still on its way
    assert w.observe(4.0, acked=True, busy=0) == WAITING
    assert w.observe(5.0, acked=True, busy=0) == IDLE
    assert w.polls == 6


@pytest.mark.parametrize(("acked", "busy"), [(False, 0), (True, None), (True, 2)])
def test_a_drain_that_never_goes_quiet_times_out_at_its_deadline(acked: bool,
                                                                 busy: int | None) -> None:
    """Unacknowledged, unreadable (None) or busy: never idle, and the deadline ends it."""
    w = DrainWatch(deadline=10.0)
    states = [w.observe(t, acked=acked, busy=busy) for t in (0.0, 5.0, 9.99)]
    assert states == [WAITING] * 3
    assert w.observe(10.0, acked=acked, busy=busy) == TIMEOUT


def test_quiet_polls_at_the_deadline_still_count() -> None:
    w = DrainWatch(deadline=1.0)
    assert w.observe(0.5, acked=True, busy=0) == WAITING
    assert w.observe(1.5, acked=True, busy=0) == IDLE  # idle wins over a passed deadline


# -- a move run by the planner ---------------------------------------------------------------
W = 60
T0 = 1_800_000_000.0


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.now += s
        await asyncio.sleep(0)


class FakeMovingActuator:
    """Counts per key, and its replicas by id, moved by the mover calls (at the edge)."""

    kind = "fake"
    move_kinds = BOTH

    def __init__(self, ids: dict[Key, list[str]], urls: dict[str, str]) -> None:
        self.ids, self.urls = ids, urls
        self.calls: list[dict[Key, int]] = []
        self.mover = self

    def current(self, keys: Any, registered: Any) -> dict[Key, int]:
        return {k: len(self.ids.get(k, [])) for k in keys}

    def apply_counts(self, counts: dict[Key, int], registered: Any) -> ApplyReport:
        self.calls.append(dict(counts))
        rep = ApplyReport()
        for k, n in counts.items():
            if n != len(self.ids.get(k, [])):  # this test's plans are all moves
                rep.errors[k] = f"would start or stop ({n} wanted)"
            else:
                rep.unchanged.append(k)
        return rep

    def close(self) -> None:
        pass

    def movable(self, key: Key) -> list[str]:
        return list(reversed(self.ids.get(key, [])))

    def prepare_move(self, rid: str, src: Key, dst: Key) -> str:
        return self.urls[rid]

    def finish_move(self, rid: str, src: Key, dst: Key) -> None:
        self.ids[src].remove(rid)
        self.ids.setdefault(dst, []).append(rid)

    def abort_move(self, rid: str) -> None:
        pass


@pytest.fixture(scope="module")
def replica() -> Iterator[Daemon]:
    d = start_daemon("skymesh-replica", ["--port", "0", "--model", "llama",
                                         "--log-level", "warning"])
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def world(replica: Daemon) -> Iterator[tuple[TestClient, Planner, FakeMovingActuator,
                                             FakeClock]]:
    from skymesh_controller.config import parse_config

    cfg = parse_config({"store": "memory", "tokens": token_config(),
                        "url_policy": {"allow_loopback": True}, "planner": {
                            "mode": "auto", "capacity": {"llama": {"L4": 100.0}},
                            "epsilon": 1.0, "drain_timeout_s": 30, "drain_poll_s": 1,
                            "schedule": {"window_s": W, "horizon": 2, "first_round_s": 1e9,
                                         "tick_s": 3600},
                            "forecaster": {"headroom": 0.0},
                            "cooldowns": {"retry_s": 60, "hold_s": 0}}})
    app = build_app(cfg, probe=False)
    p: Planner = app.state.planner
    fake = FakeMovingActuator({US: ["r1"]}, {"r1": replica.url})
    clock = FakeClock()
    p.backend, p.clock, p.sleep = fake, clock, clock.sleep
    with TestClient(app) as c:
        for region in ("us", "eu"):
            assert c.post("/v1/regions", headers=auth(), json={
                "name": region, "latitude": 1.0, "longitude": 2.0}).status_code == 201
            assert c.post("/v1/balancers", headers=auth(AGENT), json={
                "id": f"lb-{region}", "region": region,
                "url": "http://127.0.0.1:9"}).status_code == 201
        r = c.post("/v1/replicas", headers=auth(), json={
            "id": "r1", "url": replica.url, "model": "llama", "region": "us", "gpu": "L4"})
        assert r.status_code == 201, r.text
        yield c, p, fake, clock


def poll(c: TestClient, bid: str, after: int = -1) -> dict[str, Any]:
    """One membership long poll as a balancer makes it (``after``: what it applied)."""
    r = c.get(f"/v1/balancers/{bid}/membership", headers=auth(AGENT),
              params={"after": after, "wait": 0})
    assert r.status_code == 200, r.text
    return r.json()


def demand(c: TestClient, p: Planner, clock: FakeClock, load: dict[str, float]) -> None:
    for _ in range(5):
        for region, tps in load.items():
            sample = {"ts": clock.now + 1, "region": region, "window_s": W,
                      "balancer": f"lb-{region}", "queue_length": 0, "in_flight": 0,
                      "models": {"llama": {"requests": 1, "prompt_tokens": int(tps * W),
                                           "output_tokens": 0}}}
            c.portal.call(p.ctl.store.append, f"balancer:lb-{region}", sample, 1000)
        clock.now += W


def test_a_move_that_times_out_rolls_back_and_its_retry_moves_the_replica(
        world: tuple[TestClient, Planner, FakeMovingActuator, FakeClock]) -> None:
    c, p, fake, clock = world
    first = poll(c, "lb-us")
    assert [r["id"] for r in first["replicas"]] == ["r1"]
    # lb-us applied this membership and polls no more: it never confirms a drain.
    poll(c, "lb-us", first["revision"])
    demand(c, p, clock, {"us": 0.0, "eu": 80.0})  # the demand is in eu now

    rec = c.post("/v1/plans", headers=auth(), json={"dry_run": False}).json()
    assert [(m["from"]["region"], m["to"]["region"]) for m in rec["moves"]] == [("us", "eu")]
    assert rec["status"] == "failed"
    act = rec["actions"][0]
    assert [(m["replica"], m["outcome"]) for m in act["moves"]] == [("r1", "timeout")]
    assert "a balancer has not applied the drain" in act["moves"][0]["error"]
    assert {e["region"] for e in act["errors"]} == {"us", "eu"}  # both keys, retried later
    assert fake.calls == [{}]  # no stop or start of the move's keys meanwhile
    # Rolled back: at home, serving again, and back in lb-us's membership.
    r1 = c.get("/v1/replicas/r1", headers=auth()).json()
    assert (r1["region"], r1["balancer"], r1["state"]) == ("us", "lb-us", "unknown")
    assert [r["id"] for r in poll(c, "lb-us")["replicas"]] == ["r1"]
    assert act["retry_at"] >= clock.now + 60 - 1e-6  # retry_s from the end of the drain

    # lb-us catches up from now on (each poll says it applied the newest revision).
    clock.now = act["retry_at"]
    done = asyncio.Event()

    async def follow() -> None:
        while not done.is_set():
            rev = await p.ctl.store.revision()
            p.ctl.note_poll("lb-us", rev)
            await asyncio.sleep(0)  # the drain's polls run on the fake clock: keep up

    async def retry() -> None:
        task = asyncio.create_task(follow())
        try:
            await p.retry_due()
        finally:
            done.set()
            await task

    c.portal.call(retry)
    rec = c.get(f"/v1/plans/{rec['id']}", headers=auth()).json()
    assert rec["status"] == "applied", rec["actions"]
    assert [(m["replica"], m["outcome"]) for m in rec["actions"][1]["moves"]] == [
        ("r1", "moved")]
    assert rec["moves"][0]["state"] == "moved"
    r1 = c.get("/v1/replicas/r1", headers=auth()).json()
    assert (r1["region"], r1["balancer"], r1["state"]) == ("eu", "lb-eu", "unknown")
    assert [r["id"] for r in poll(c, "lb-eu")["replicas"]] == ["r1"]
    assert poll(c, "lb-us")["replicas"] == []
    assert fake.ids == {US: [], EU: ["r1"]}
    assert 'skymesh_controller_planner_moves_total{outcome="moved"} 1.0' in c.get(
        "/metrics").text


def test_a_restart_undrains_the_replica_of_a_move_it_cut_short(
        world: tuple[TestClient, Planner, FakeMovingActuator, FakeClock]) -> None:
    """The controller stopped mid-drain: the replica is still draining in the store and
    the round still applying. Start-up puts the replica back to work where it is."""
    c, p, _, clock = world
    assert c.post("/v1/replicas/r1/drain", headers=auth()).json()["state"] == "draining"
    key = {"model": "llama", "gpu": "L4"}
    rec = {"id": "plan-cut", "ts": clock.now, "status": "applying", "reason": None,
           "changes": [{**key, "region": "us", "before": 1, "after": 0},
                       {**key, "region": "eu", "before": 0, "after": 1}],
           "moves": [{"from": {**key, "region": "us"}, "to": {**key, "region": "eu"},
                      "replica": "r1", "state": "draining"}], "held": [], "actions": []}
    c.portal.call(p.save, rec)
    c.portal.call(p._recall)
    r1 = c.get("/v1/replicas/r1", headers=auth()).json()
    assert (r1["region"], r1["state"]) == ("us", "unknown")
    got = c.get("/v1/plans/plan-cut", headers=auth()).json()
    assert got["status"] == "failed" and "undrained" in got["reason"]
    assert got["moves"][0]["state"] == "planned"


def test_the_controller_re_registers_a_drained_replica_in_one_step(
        world: tuple[TestClient, Planner, FakeMovingActuator, FakeClock]) -> None:
    """A model change's re-registration (new URL, new model) and its refusals."""
    from skymesh_controller.errors import ApiError

    c, p, _, _ = world
    ctl = p.ctl
    move = {"model": "qwen", "region": "us", "url": "http://127.0.0.1:9"}
    with pytest.raises(ApiError, match="only a draining replica") as exc:
        c.portal.call(lambda: ctl.move_replica("r1", **move))
    assert exc.value.status == 409
    assert c.post("/v1/regions", headers=auth(), json={
        "name": "asia", "latitude": 1.0, "longitude": 2.0}).status_code == 201
    rev = c.portal.call(ctl.begin_drain, "r1")
    assert rev == c.get("/v1/status", headers=auth()).json()["revision"]
    with pytest.raises(ApiError, match="no balancer"):
        c.portal.call(lambda: ctl.move_replica("r1", **{**move, "region": "asia"}))
    assert c.get("/v1/replicas/r1", headers=auth()).json()["state"] == "draining"

    c.portal.call(lambda: ctl.move_replica("r1", **move))
    r1 = c.get("/v1/replicas/r1", headers=auth()).json()
    assert (r1["model"], r1["url"], r1["state"], r1["balancer"]) == (
        "qwen", "http://127.0.0.1:9", "unknown", "lb-us")
    assert [(r["id"], r["model"]) for r in poll(c, "lb-us")["replicas"]] == [("r1", "qwen")]


def test_a_round_left_applying_is_settled_by_the_next_leader(
        world: tuple[TestClient, Planner, FakeMovingActuator, FakeClock]) -> None:
    """The leader died while its actuator applied a round (no move): the round was
    recorded as applying before the actuator ran, and the next leader's start-up marks
    it failed rather than leaving it applying for ever; nothing is re-applied."""
    c, p, fake, clock = world
    key = {"model": "llama", "gpu": "L4"}
    rec = {"id": "plan-mid", "ts": clock.now, "status": "applying", "reason": None,
           "changes": [{**key, "region": "eu", "before": 0, "after": 1}],
           "moves": [], "held": [], "actions": []}
    c.portal.call(p.save, rec)
    c.portal.call(p._recall)
    got = c.get("/v1/plans/plan-mid", headers=auth()).json()
    assert got["status"] == "failed" and "stopped while applying" in got["reason"]
    assert got["actions"] == [] and fake.calls == []


def test_an_applying_round_is_recorded_before_the_actuator_runs(
        world: tuple[TestClient, Planner, FakeMovingActuator, FakeClock]) -> None:
    c, p, fake, clock = world
    seen: list[list[str]] = []
    inner = fake.apply_counts

    def apply_counts(counts: dict[Key, int], registered: Any) -> ApplyReport:
        # What a successor would find in the store if this leader died now.
        raw = c.portal.call(p.store.tail, "planner:rounds", 100)
        seen.append([r["status"] for r in raw])
        return inner(counts, registered)

    fake.apply_counts = apply_counts  # type: ignore[method-assign]
    demand(c, p, clock, {"us": 0.0, "eu": 80.0})
    fake.mover = None  # type: ignore[assignment]  # no move: a stop and a start
    rec = c.post("/v1/plans", headers=auth(), json={"dry_run": False}).json()
    assert rec["status"] in ("applied", "partial", "failed")
    assert seen and "applying" in seen[0]


def test_a_controller_that_no_longer_leads_makes_no_actuator_call_that_acts(
        world: tuple[TestClient, Planner, FakeMovingActuator, FakeClock]) -> None:
    """An Auto Scaling group's count cannot carry the lease: the planner checks it just
    before each call that changes the world; reads still go through."""
    from skymesh_controller.store import Fenced

    c, p, fake, _ = world

    async def lose() -> None:  # as a stopped or partitioned leader finds: no renewals
        lead = p.ctl.leadership
        assert lead._task is not None
        lead._task.cancel()
        lead.state.resign()

    c.portal.call(lose)
    with pytest.raises(Fenced, match="no longer leads"):
        c.portal.call(p.actuate, fake.apply_counts, {US: 1}, {})
    with pytest.raises(Fenced):
        c.portal.call(p.actuate, fake.prepare_move, "r1", US, EU)
    assert fake.calls == []
    assert c.portal.call(p.actuate, fake.current, [US], {}) == {US: 1}
    # Not leading, the API refuses to apply a plan, and names who does.
    r = c.post("/v1/plans", headers=auth(), json={"dry_run": False})
    assert r.status_code == 409 and r.json()["error"]["type"] == "not_leader"
    assert c.post("/v1/plans", headers=auth(), json={"dry_run": True}).status_code == 201
