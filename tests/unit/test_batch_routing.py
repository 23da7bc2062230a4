"""Batch across the mesh: the pure rule (skymesh.balancer.batch_routing) and the
dispatcher's batch lane that carries it out."""

from __future__ import annotations

import pytest

from skymesh.balancer.batch_routing import (
    BatchMove,
    IdlePeer,
    batch_move,
    busy,
    deadline_of,
    idle,
    reserved,
)
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import ModelLoad

EU, ASIA = IdlePeer("eu", 0.09), IdlePeer("asia", 0.2)


def move(**kw: object) -> tuple[BatchMove, str | None]:
    args: dict[str, object] = {"now": 0.0, "deadline_at": None, "forwarded": False,
                               "free": 0, "better_waiting": 0, "idle_peers": ()}
    args.update(kw)
    return batch_move(**args)  # type: ignore[arg-type]


def test_busy_means_no_free_replica_left_over_for_batch() -> None:
    assert busy(0, 0) and busy(2, 2) and busy(1, 3)
    assert not busy(3, 2) and not busy(1, 0)


def test_a_free_replica_the_better_classes_do_not_need_takes_batch_locally() -> None:
    assert move(free=3, better_waiting=2, idle_peers=[EU]) == (BatchMove.LOCAL, None)
    # ...but not in the pass before the better classes are placed: that one only forwards.
    assert move(free=3, better_waiting=2, idle_peers=[EU], local=False) == (BatchMove.WAIT,
                                                                             None)


def test_a_busy_region_sends_batch_to_the_nearest_idle_peer() -> None:
    assert move(free=2, better_waiting=2, idle_peers=[ASIA, EU]) == (BatchMove.PEER, "eu")
    assert move(free=0, idle_peers=[ASIA], local=False) == (BatchMove.PEER, "asia")


def test_busy_with_no_idle_peer_or_already_forwarded_waits() -> None:
    assert move(free=1, better_waiting=4) == (BatchMove.WAIT, None)
    assert move(free=0, forwarded=True, idle_peers=[EU]) == (BatchMove.WAIT, None)


def test_past_its_deadline_a_request_is_served_where_it_is() -> None:
    assert move(now=10.0, deadline_at=10.0, idle_peers=[EU]) == (BatchMove.DUE, None)
    assert move(now=9.9, deadline_at=10.0, idle_peers=[EU]) == (BatchMove.PEER, "eu")


def test_the_deadline_header_wins_over_the_default_and_bad_ones_are_refused() -> None:
    assert deadline_of(None, 3600.0) == 3600.0
    assert deadline_of(" ", None) is None
    assert deadline_of("1500", 3600.0) == 1.5
    for bad in ("0", "-5", "soon", "nan", "inf"):
        with pytest.raises(ValueError, match="X-SkyMesh-Batch-Deadline-Ms"):
            deadline_of(bad, None)


# -- the dispatcher's batch lane -----------------------------------------------------------


def lane_dispatcher(replicas: int = 2) -> Dispatcher:
    d = Dispatcher(build_policy("least-load"), PushMode.SP_O, max_outstanding=1,
                   peer_policy=build_policy("least-load"), hold_s=0.0)
    d.set_targets({f"r{i}": ["m"] for i in range(replicas)})
    d.set_peers(["eu"])
    d.set_peer_rtt("eu", 0.09)
    d.batch_lane = True
    return d


def ticket(name: str, *, batch: bool = False, due: float | None = None,
           forwarded: bool = False) -> Ticket:
    t = Ticket(RouteRequest(name, model="m", forwarded=forwarded), 0.0)
    t.batch, t.batch_due = batch, due
    return t


def beat(d: Dispatcher, peer: str, seq: int, available: int, queue: int = 0) -> None:
    d.on_peer_heartbeat(peer, 0.0, 1, seq, {"m": ModelLoad(available, 4, queue)})


def test_batch_goes_to_the_idle_peer_while_interactive_takes_the_local_replicas() -> None:
    d = lane_dispatcher(replicas=1)
    beat(d, "eu", 1, available=1)
    batch, web = ticket("b", batch=True), ticket("w")
    d.offer(batch, 0.0)  # batch came first: FCFS would give it the local replica
    d.offer(web, 0.0)
    out = d.pump(0.0)
    assert {(t.route.request_id, t.target, t.to_peer) for t in out} == {
        ("b", "eu", True), ("w", "r0", False)}


def test_batch_is_forwarded_before_an_interactive_request_overflows_to_the_peer() -> None:
    d = lane_dispatcher(replicas=1)
    busy_ = ticket("x")
    d.offer(busy_, 0.0)
    d.pump(0.0)  # the only replica is taken
    beat(d, "eu", 1, available=1)  # room for one
    web, batch = ticket("w"), ticket("b", batch=True)
    d.offer(web, 0.0)
    d.offer(batch, 0.0)
    out = d.pump(0.0)
    assert [(t.route.request_id, t.target) for t in out] == [("b", "eu")]
    assert web.queued  # it waits for the local replica


def test_batch_is_admitted_locally_last_and_waits_while_better_ones_wait() -> None:
    d = lane_dispatcher(replicas=2)
    waiting = {"m": 2}  # interactive requests in the fair queue, in front of the dispatcher
    d.better_waiting = lambda model: waiting.get(model, 0)
    batch = ticket("b", batch=True)
    d.offer(batch, 0.0)
    assert d.pump(0.0) == []  # two free replicas, both wanted by the better class
    waiting["m"] = 1
    assert d.pump(0.1) == [batch] and batch.target in {"r0", "r1"} and not batch.to_peer


def test_a_batch_request_past_its_deadline_stays_and_joins_the_ordinary_queue() -> None:
    d = lane_dispatcher(replicas=1)
    busy_ = ticket("x")
    d.offer(busy_, 0.0)
    d.pump(0.0)
    late = ticket("b", batch=True, due=5.0)
    d.offer(late, 0.0)
    assert d.pump(1.0) == []  # busy, no idle peer: waits in the lane
    assert d.queue_length("m") == 0 and d.queued == 1
    beat(d, "eu", 1, available=3)
    assert d.pump(6.0) == []  # past its deadline: no longer forwarded, even to idle eu
    assert late.stay and d.queue_length("m") == 1
    d.complete(busy_, 7.0, ok=True)
    assert d.pump(7.0) == [late] and late.target == "r0"


def test_a_forwarded_batch_request_waits_behind_the_peers_own_better_work() -> None:
    d = lane_dispatcher(replicas=1)
    fwd = ticket("b", batch=True, forwarded=True)
    web = ticket("w")
    d.offer(fwd, 0.0)
    d.offer(web, 0.0)
    assert [t.route.request_id for t in d.pump(0.0)] == ["w"]
    d.complete(web, 1.0, ok=True)
    assert d.pump(1.0) == [fwd] and fwd.target == "r0"


def test_a_cancelled_batch_ticket_leaves_its_lane() -> None:
    d = lane_dispatcher(replicas=0)
    t = ticket("b", batch=True)
    d.offer(t, 0.0)
    assert d.queued == 1 and d.cancel(t) and d.queued == 0 and not d.lanes["m"]


def test_the_reserve_keeps_replicas_for_the_better_classes_here_and_at_peers() -> None:
    assert [reserved(n, 0.25) for n in (0, 1, 3, 4, 8, 9)] == [0, 0, 0, 1, 2, 2]
    assert reserved(4, 0.0) == 0 and reserved(4, 1.0) == 4
    # Here: 2 free, 1 kept: one is left over for batch; with 1 free, none is.
    assert move(free=2, keep=1) == (BatchMove.LOCAL, None)
    assert move(free=1, keep=1, idle_peers=[EU]) == (BatchMove.PEER, "eu")
    # At a peer: free replicas beyond its own reserve, and nothing queued.
    assert idle(2, 4, 0, 0.25) and not idle(1, 4, 0, 0.25) and not idle(3, 4, 1, 0.25)
    assert idle(1, 1, 0, 0.25)  # a region of one replica keeps none


def test_the_lane_reads_the_reserve_for_itself_and_for_its_peers() -> None:
    d = lane_dispatcher(replicas=2)
    d.batch_reserve = 0.5  # one of two replicas kept: 2 free -> batch may take one
    beat(d, "eu", 1, available=2)  # eu: 4 replicas, reserve 2: 2 free is not idle
    a, b = ticket("a", batch=True), ticket("b", batch=True)
    d.offer(a, 0.0)
    d.offer(b, 0.0)
    assert d.pump(0.0) == [a] and not a.to_peer
    beat(d, "eu", 2, available=3)
    assert d.pump(0.1) == [b] and b.target == "eu"


def test_batch_mesh_config_names_a_configured_class() -> None:
    from skymesh.balancer.config import ConfigError, parse_config

    cfg = parse_config({"tenants": {"batch_mesh": {}}})
    assert cfg.tenants is not None and cfg.tenants.batch_mesh is not None
    assert cfg.tenants.batch_mesh.batch_class == "batch"
    assert cfg.tenants.batch_mesh.deadline_h == 4.0 and cfg.tenants.batch_mesh.reserve == 0.25
    with pytest.raises(ConfigError, match=r"tenants\.batch_mesh\.batch_class"):
        parse_config({"tenants": {"batch_mesh": {"batch_class": "bulk"}}})
