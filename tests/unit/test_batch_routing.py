"""Batch across the mesh: the pure rule (skymesh.balancer.batch_routing) and the
dispatcher's batch lane that carries it out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from skymesh.balancer.batch_routing import (
    BatchMove,
    PeerRoom,
    batch_move,
    busy,
    deadline_of,
    lane_timeout,
    quiet,
    reserved,
    room,
)
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.overload import stranded
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import ModelLoad

EU, ASIA = PeerRoom("eu", 0.09), PeerRoom("asia", 0.2)


def move(**kw: object) -> tuple[BatchMove, str | None]:
    args: dict[str, object] = {"now": 0.0, "deadline_at": None, "forwarded": False,
                               "quiet": 0, "better_waiting": 0, "peers": ()}
    args.update(kw)
    return batch_move(**args)  # type: ignore[arg-type]


def test_busy_means_no_quiet_replica_left_over_for_batch() -> None:
    assert busy(0, 0) and busy(2, 2) and busy(1, 3)
    assert not busy(3, 2) and not busy(1, 0)


def test_a_quiet_replica_the_better_classes_do_not_need_takes_batch_locally() -> None:
    assert move(quiet=3, better_waiting=2, peers=[EU]) == (BatchMove.LOCAL, None)
    # ...but not in the pass before the better classes are placed: that one only forwards.
    assert move(quiet=3, better_waiting=2, peers=[EU], local=False) == (BatchMove.WAIT,
                                                                             None)


def test_a_busy_region_sends_batch_to_the_nearest_idle_peer() -> None:
    assert move(quiet=2, better_waiting=2, peers=[ASIA, EU]) == (BatchMove.PEER, "eu")
    assert move(quiet=0, peers=[ASIA], local=False) == (BatchMove.PEER, "asia")


def test_busy_with_no_idle_peer_or_already_forwarded_waits() -> None:
    assert move(quiet=1, better_waiting=4) == (BatchMove.WAIT, None)
    assert move(quiet=0, forwarded=True, peers=[EU]) == (BatchMove.WAIT, None)


def test_past_its_deadline_a_request_is_served_where_it_is() -> None:
    assert move(now=10.0, deadline_at=10.0, peers=[EU]) == (BatchMove.DUE, None)
    assert move(now=9.9, deadline_at=10.0, peers=[EU]) == (BatchMove.PEER, "eu")


def test_the_deadline_header_wins_over_the_default_and_bad_ones_are_refused() -> None:
    assert deadline_of(None, 3600.0) == 3600.0
    assert deadline_of(" ", None) is None
    assert deadline_of("1500", 3600.0) == 1.5
    for bad in ("0", "-5", "soon", "nan", "inf"):
        with pytest.raises(ValueError, match="X-SkyMesh-Batch-Deadline-Ms"):
            deadline_of(bad, None)


def test_a_batch_request_waits_until_its_deadline_then_as_long_as_the_queue_lets_it() -> None:
    assert lane_timeout(4 * 3600.0, 60.0, 24 * 3600.0) == 4 * 3600.0 + 60.0
    # A header asking for a week: held to max_wait_h, as one with no deadline is.
    assert lane_timeout(7 * 86400.0, 60.0, 24 * 3600.0) == 24 * 3600.0
    assert lane_timeout(None, 60.0, 24 * 3600.0) == 24 * 3600.0
    assert lane_timeout(0.5, 60.0, 24 * 3600.0) == 60.5


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
    assert move(quiet=2, keep=1) == (BatchMove.LOCAL, None)
    assert move(quiet=1, keep=1, peers=[EU]) == (BatchMove.PEER, "eu")
    # At a peer: fewer requests on its replicas than replicas beyond its own reserve,
    # and nothing queued.
    # (room_per_replica 1: a replica, at least, runs nothing).
    assert room(2, 4, 0, 0.25) and not room(3, 4, 0, 0.25) and not room(1, 4, 1, 0.25)
    assert room(0, 1, 0, 0.25) and not room(1, 1, 0, 0.25)  # one replica: none kept


def test_the_lane_reads_the_reserve_for_itself_and_for_its_peers() -> None:
    d = lane_dispatcher(replicas=2)
    d.batch_room_per_replica = 1  # room: replicas running nothing
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


# -- quiet replicas, urgency, fail fast (the interactive loss on docs/results/tenancy-mesh.md)


def test_a_quiet_replica_runs_no_better_work_and_has_room_for_batch() -> None:
    assert quiet(0, 0, 1) and quiet(0, 3, 4)
    assert not quiet(1, 0, 4)  # one interactive request on it: not for batch
    assert not quiet(0, 4, 4)  # its share of batch already


def test_within_urgent_s_of_its_deadline_a_request_is_due() -> None:
    assert move(now=6.0, deadline_at=10.0, urgent_s=4.0, peers=[EU]) == (
        BatchMove.DUE, None)
    assert move(now=5.9, deadline_at=10.0, urgent_s=4.0, peers=[EU]) == (
        BatchMove.PEER, "eu")


def test_with_no_local_replica_up_batch_goes_to_any_live_peer_or_waits_to_fail() -> None:
    # Not only an idle peer: a busy one admits it in its own lane.
    assert move(local_up=False, live_peers=[ASIA, EU]) == (BatchMove.PEER, "eu")
    assert move(local_up=False, live_peers=[EU], local=False) == (BatchMove.PEER, "eu")
    # Due or not: waiting here is waiting for nothing.
    assert move(local_up=False, live_peers=[EU], now=9.0, deadline_at=10.0, urgent_s=5.0) == (
        BatchMove.PEER, "eu")
    # Forwarded to us already, or no live peer: the stranded check's 503.
    assert move(local_up=False, live_peers=[EU], forwarded=True) == (BatchMove.WAIT, None)
    assert move(local_up=False) == (BatchMove.WAIT, None)


def test_batch_waits_beside_interactive_work_on_a_replica_that_would_take_more() -> None:
    d = Dispatcher(build_policy("least-load"), PushMode.SP_O, max_outstanding=4,
                   hold_s=0.0)
    d.set_targets({"r0": ["m"]})
    d.batch_lane, d.batch_room_per_replica = True, 1  # quiet: no better work at all
    web, batch = ticket("w"), ticket("b", batch=True)
    d.offer(web, 0.0)
    assert d.pump(0.0) == [web]
    d.offer(batch, 0.1)
    assert d.pump(0.1) == []  # r0 has three free slots, but it decodes for a client
    d.complete(web, 1.0, ok=True)
    assert d.pump(1.0) == [batch] and batch.target == "r0"


def test_at_most_max_per_replica_batch_requests_share_a_quiet_replica() -> None:
    d = Dispatcher(build_policy("least-load"), PushMode.SP_O, max_outstanding=8,
                   hold_s=0.0)
    d.set_targets({"r0": ["m"]})
    d.batch_lane, d.batch_max_per_replica = True, 2
    jobs = [ticket(f"b{i}", batch=True) for i in range(3)]
    for t in jobs:
        d.offer(t, 0.0)
    assert d.pump(0.0) == jobs[:2]
    d.complete(jobs[0], 1.0, ok=True)
    assert d.pump(1.0) == [jobs[2]] and d.batch_on == {"r0": 2}


def test_a_peer_with_free_replicas_busy_with_its_own_clients_has_no_room() -> None:
    d = lane_dispatcher(replicas=1)
    busy_ = ticket("x")
    d.offer(busy_, 0.0)
    d.pump(0.0)
    # eu: 4 replicas, 3 free to take one more, room_per_replica (8) decoding on each.
    d.on_peer_heartbeat("eu", 0.0, 1, 1, {"m": ModelLoad(3, 4, 0, outstanding=32)})
    batch = ticket("b", batch=True)
    d.offer(batch, 0.0)
    assert d.pump(0.0) == []
    d.on_peer_heartbeat("eu", 0.0, 1, 2, {"m": ModelLoad(3, 4, 0, outstanding=31)})
    assert d.pump(0.1) == [batch] and batch.target == "eu"


def test_when_the_last_local_replica_goes_down_batch_leaves_its_lane_at_once() -> None:
    d = lane_dispatcher(replicas=1)
    hold = ticket("x")
    d.offer(hold, 0.0)
    d.pump(0.0)
    beat(d, "eu", 1, available=0)  # eu alive but busy: not idle
    batch = ticket("b", batch=True, due=4 * 3600.0)
    d.offer(batch, 0.0)
    assert d.pump(0.0) == [] and list(stranded(d, {batch.key})) == []
    d.set_healthy("r0", False)  # the last replica serving "m" here goes down
    assert d.pump(0.1) == [batch] and batch.target == "eu" and batch.to_peer

    # With no peer to take it, the stranded check (the live balancer's 503) finds it.
    alone = Dispatcher(build_policy("least-load"), PushMode.SP_O, max_outstanding=1,
                       hold_s=0.0)
    alone.set_targets({"r0": ["m"]})
    alone.batch_lane = True
    late = ticket("b2", batch=True, due=4 * 3600.0)
    alone.offer(ticket("y"), 0.0)
    alone.pump(0.0)
    alone.offer(late, 0.0)
    assert alone.pump(0.0) == []
    alone.set_healthy("r0", False)
    alone.pump(0.1)
    assert list(stranded(alone, {late.key})) == [late]


def test_a_due_batch_request_in_the_ordinary_queue_is_stranded_with_its_replicas() -> None:
    d = lane_dispatcher(replicas=1)
    hold = ticket("x")
    d.offer(hold, 0.0)
    d.pump(0.0)
    beat(d, "eu", 1, available=0)
    due = ticket("b", batch=True, due=1.0)
    d.offer(due, 0.0)
    d.pump(2.0)
    assert due.stay and d.queue_length("m") == 1  # due: served here, never forwarded
    d.set_healthy("r0", False)
    d.pump(2.1)
    # eu is alive, but a due request may not go there: the 503 now, not at the timeout.
    assert list(stranded(d, {due.key})) == [due]


# -- room for batch: spare requests, not idle replicas (docs/results/tenancy-mesh.md, night)


def test_a_peers_room_is_its_spare_requests_beyond_its_reserve() -> None:
    # 3 replicas (none reserved) at 8 each: 24; 10 running leave 14.
    assert room(10, 3, 0, 0.25, 8) == 14
    assert room(24, 3, 0, 0.25, 8) == 0 and room(42, 3, 0, 0.25, 8) == 0
    # 4 replicas keep one (0.25): 3 x 8 = 24, less the 10 running.
    assert room(10, 4, 0, 0.25, 8) == 14
    assert room(0, 4, 1, 0.0, 8) == 0  # anything queued there: no room
    assert room(0, 0, 0, 0.0, 8) == 0


def test_a_busy_home_sends_batch_to_the_peer_with_most_room() -> None:
    eu, asia = PeerRoom("eu", 0.09, room=2), PeerRoom("asia", 0.2, room=10)
    assert move(quiet=0, peers=[eu, asia]) == (BatchMove.PEER, "asia")
    assert move(quiet=0, peers=[eu, replace(asia, room=2)]) == (BatchMove.PEER, "eu")
    # Peers that take overflow but have no room for batch: it waits.
    assert move(quiet=0, peers=[replace(eu, room=0)]) == (BatchMove.WAIT, None)


def test_a_due_request_goes_to_a_much_lighter_peer_rather_than_beside_home_chat() -> None:
    eu, asia = PeerRoom("eu", 0.09, room=0, load=15.0), PeerRoom("asia", 0.2, room=0,
                                                                 load=14.0)
    due = {"now": 10.0, "deadline_at": 10.0, "peers": [eu, asia], "lighter_by": 8.0}
    assert move(**due, here_load=38.0) == (BatchMove.PEER, "asia")
    assert move(**due, here_load=20.0) == (BatchMove.DUE, None)  # not lighter enough
    assert move(**due) == (BatchMove.DUE, None)  # here_load unknown: stays
    assert move(**due, here_load=38.0, forwarded=True) == (BatchMove.DUE, None)  # one hop


def test_lanes_order_by_deadline_and_room_per_replica_defaults() -> None:
    from skymesh.balancer.batch_routing import DEFAULT_ROOM_PER_REPLICA, lane_order
    from skymesh.balancer.config import BatchMeshConfig

    assert sorted([None, 5.0, 2.0], key=lane_order) == [2.0, 5.0, None]
    assert BatchMeshConfig().room_per_replica == DEFAULT_ROOM_PER_REPLICA
    assert lane_dispatcher().batch_room_per_replica == DEFAULT_ROOM_PER_REPLICA
    assert quiet(DEFAULT_ROOM_PER_REPLICA - 1, 0, 4, DEFAULT_ROOM_PER_REPLICA)
    assert not quiet(DEFAULT_ROOM_PER_REPLICA, 0, 4, DEFAULT_ROOM_PER_REPLICA)


# -- the defects docs/results/tenancy-mesh.md showed: a peer at night, busy with a few
# requests per replica, was never room for batch; a due job ran at a crowded home beside
# its chat rather than at a far lighter peer; a job a peer forwarded near its deadline
# waited behind the peer's own later ones, past the window of the lane each pump reads.


def home(max_outstanding: int, *, peer: bool = True) -> Dispatcher:
    d = Dispatcher(build_policy("least-load"), PushMode.SP_O,
                   max_outstanding=max_outstanding,
                   peer_policy=build_policy("least-load"), hold_s=0.0)
    d.set_targets({"r0": ["m"]})
    if peer:
        d.set_peers(["eu"])
        d.set_peer_rtt("eu", 0.09)
    d.batch_lane = True
    return d


def chat(d: Dispatcher, n: int) -> None:
    for i in range(n):
        d.offer(ticket(f"c{i}"), 0.0)
    assert len(d.pump(0.0)) == n


def test_a_peer_at_night_with_a_few_requests_per_replica_takes_batch() -> None:
    d = home(40)
    chat(d, 38)  # home at its peak
    # eu at night: 3 replicas, all free to take more, 10 requests on them in all.
    d.on_peer_heartbeat("eu", 0.0, 1, 1, {"m": ModelLoad(3, 3, 0, outstanding=10)})
    batch = ticket("b", batch=True, due=3600.0)
    d.offer(batch, 0.0)
    assert d.pump(0.1) == [batch] and batch.target == "eu" and batch.to_peer


def test_a_due_batch_job_goes_to_a_much_lighter_peer_not_beside_home_chat() -> None:
    d = home(40)
    chat(d, 38)
    # eu: busy too (14 per replica: no room for batch), but far lighter than home's 38.
    d.on_peer_heartbeat("eu", 0.0, 1, 1, {"m": ModelLoad(3, 3, 0, outstanding=42)})
    job = ticket("b", batch=True, due=5.0)
    d.offer(job, 0.0)
    assert d.pump(1.0) == []  # not due, no room anywhere: waits
    assert d.pump(6.0) == [job] and job.target == "eu" and job.to_peer


def test_a_job_forwarded_near_its_deadline_is_not_left_behind_the_peers_own() -> None:
    d = home(9, peer=False)
    chat(d, 8)  # the replica runs interactive work: no room for batch before it is due
    own = [ticket(f"b{i}", batch=True, due=1000.0 + i) for i in range(d.window + 1)]
    for t in own:
        d.offer(t, 0.0)
    assert d.pump(1.0) == []
    late = ticket("fwd", batch=True, due=2.0, forwarded=True)  # due at once here
    d.offer(late, 2.0)
    assert d.pump(2.0) == [late] and late.target == "r0"


def test_a_peer_that_does_not_report_its_requests_is_judged_by_its_busy_replicas() -> None:
    from skymesh.balancer.batch_routing import peer_room
    from skymesh.policies.peers import PeerLoad

    p = PeerLoad("eu", rtt_s=0.09)
    p.on_heartbeat(0.0, 1, 1, {"m": ModelLoad(1, 4, 0)})  # 3 of 4 busy, no count
    r = peer_room("eu", p, "m", 0.0, 8)
    assert r.room == 1 and r.load == float("inf")  # never "much lighter" for a due job
    p.on_heartbeat(0.0, 1, 2, {"m": ModelLoad(1, 4, 0, outstanding=12)})
    r = peer_room("eu", p, "m", 0.0, 8)
    assert r.room == 20 and r.load == 3.0
