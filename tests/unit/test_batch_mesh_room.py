"""Batch across the mesh, the defects docs/results/tenancy-mesh.md showed (issue #37): a
peer at night, busy with a few requests per replica, was never room for batch; a due job
ran at a crowded home beside its chat rather than at a far lighter peer; and a job a peer
forwarded near its deadline waited behind the peer's own later ones, past the window of
the lane each pump reads. Only the dispatcher's API, so each test runs on the old rule."""

from __future__ import annotations

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import ModelLoad


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


def ticket(name: str, *, batch: bool = False, due: float | None = None,
           forwarded: bool = False) -> Ticket:
    t = Ticket(RouteRequest(name, model="m", forwarded=forwarded), 0.0)
    t.batch, t.batch_due = batch, due
    return t


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
