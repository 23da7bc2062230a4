"""Every breaker of a model open: the requests already queued (``overload.stranded`` with a
time, ``stranded_error``, ``stranded_line``) and the passthrough routes
(``Passthrough.pick``) get the 503 a new request gets, Retry-After the first trial, spread.
A fake clock throughout: the time is passed in, or injected."""

from __future__ import annotations

import random

import pytest
from aiohttp import web

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.edge import OwnedRoutes
from skymesh.balancer.errors import NoHealthyReplica
from skymesh.balancer.overload import (
    BREAKER_SPREAD_S,
    STRANDED_IDS_SHOWN,
    breakers_open,
    may_strand,
    outage_retry_s,
    stranded,
    stranded_error,
    stranded_line,
)
from skymesh.balancer.passthrough import Passthrough
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import ModelLoad

OPEN_S = 30.0


def _dispatcher(*, peers: bool = False) -> Dispatcher:
    d = Dispatcher(build_policy("round-robin"), PushMode.SP_O, max_outstanding=1,
                   breaker_threshold=1, breaker_open_s=OPEN_S,
                   peer_policy=build_policy("round-robin") if peers else None)
    d.set_targets({"a": ["m"], "b": ["m"], "c": ["other"]})
    if peers:
        d.set_peers(["eu"])
        # Serves m, busy: alive for the stranded rule, too full for the pump to forward.
        d.on_peer_heartbeat("eu", 0.0, 1, 1, {"m": ModelLoad(0, 1, 99, 0)})
        d.set_peer_alive("eu", True)
    return d


def _ticket(i: int, model: str = "m", forwarded: bool = False) -> Ticket:
    return Ticket(RouteRequest(f"r{i}", model=model, forwarded=forwarded), 0.0)


def _busy(d: Dispatcher) -> tuple[list[Ticket], list[Ticket]]:
    """a and b each take a request and three more queue (max_outstanding 1): the ones
    taken, and the queued."""
    first = [_ticket(i) for i in range(2)]
    queued = [_ticket(10 + i) for i in range(3)]
    for t in first + queued:
        d.offer(t, 0.0)
    assert {t.target for t in d.pump(0.0)} == {"a", "b"}
    assert all(t.queued for t in queued)
    return first, queued


def _busy_then_failing(d: Dispatcher, now: float) -> list[Ticket]:
    """:func:`_busy`, then both taken fail with a replica fault at ``now``: both
    breakers open (threshold 1). Returns the queued."""
    first, queued = _busy(d)
    for t in first:
        d.complete(t, now, ok=False, replica_fault=True)
    return queued


def test_queued_requests_are_stranded_once_the_last_breaker_opens() -> None:
    d = _dispatcher()
    first, queued = _busy(d)
    every = {t.key for t in queued}
    d.complete(first[0], 1.0, ok=False, replica_fault=True)  # a's breaker opens
    assert list(stranded(d, every, 1.0)) == []  # b still takes requests: they wait
    d.complete(first[1], 2.0, ok=False, replica_fault=True)  # and b's: none left
    assert may_strand(d)
    assert list(stranded(d, every, 2.0)) == queued
    assert list(stranded(d, every)) == []  # without a time: only the outage rule
    assert list(stranded(d, {queued[0].key}, 2.0)) == [queued[0]]  # only those it may fail
    assert list(stranded(d, every, 1.0 + OPEN_S)) == []  # a's trial is due: they wait


def test_the_stranded_error_is_the_new_request_s_answer() -> None:
    d = _dispatcher()
    _busy_then_failing(d, 5.0)
    exc = stranded_error(d, "m", 6.0, 0.0)
    assert exc.status == 503 and exc.code == "no_healthy_replica"
    assert exc.retry_after_s == pytest.approx(OPEN_S - 1.0)  # the first trial
    new = breakers_open(d, "m", 6.0)
    assert new is not None and (exc.message, exc.retry_after_s) == (new.message,
                                                                    new.retry_after_s)
    # Each queued ticket its own draw: they do not all come back at the same instant.
    spread = stranded_error(d, "m", 6.0, 0.5)
    assert spread.message == exc.message
    assert spread.retry_after_s == pytest.approx(OPEN_S - 1.0 + 0.5 * BREAKER_SPREAD_S)
    # Nothing up at all: the outage's answer, jittered.
    d.set_healthy("a", False)
    d.set_healthy("b", False)
    assert stranded_error(d, "m", 6.0, 0.0).retry_after_s == outage_retry_s(0.0)


def test_a_retry_is_left_to_dead_retries_502() -> None:
    d = _dispatcher()
    queued = _busy_then_failing(d, 1.0)
    queued[0].excluded = {"x"}  # failed elsewhere before: a retry
    assert list(stranded(d, {t.key for t in queued}, 2.0)) == queued[1:]


def test_a_live_peer_takes_them_unless_forwarded_here() -> None:
    d = _dispatcher(peers=True)
    queued = _busy_then_failing(d, 1.0)
    fwd = _ticket(21, forwarded=True)  # a peer sent it: never forwarded again
    d.offer(fwd, 1.0)
    eligible = {t.key for t in (*queued, fwd)}
    assert list(stranded(d, eligible, 2.0)) == [fwd]  # the mesh could take the others
    d.set_peer_alive("eu", False)
    assert list(stranded(d, eligible, 2.0)) == [*queued, fwd]


def test_membership_that_removes_the_last_replica_strands_them() -> None:
    d = _dispatcher()
    _, queued = _busy(d)
    d.set_targets({"c": ["other"]})
    assert list(stranded(d, {t.key for t in queued}, 1.0)) == queued
    assert "none up" in stranded_error(d, "m", 1.0, 0.0).message


def test_the_log_line_names_a_bounded_number_of_requests() -> None:
    exc = NoHealthyReplica("every replica ... open", retry_after_s=3.0)
    ids = [f"id{i}" for i in range(STRANDED_IDS_SHOWN + 3)]
    line = stranded_line("m", ids, exc)
    assert line.startswith(f"{len(ids)} queued request(s) for model 'm'")
    shown = ", ".join(ids[:STRANDED_IDS_SHOWN])
    assert f"(request ids {shown} and 3 more): " in line and line.endswith(exc.message)
    assert "(request ids id0, id1): " in stranded_line("m", ids[:2], exc)


# -- the passthrough ----------------------------------------------------------------------

class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _proxy(d: Dispatcher, clock: Clock) -> Passthrough:
    return Passthrough(d, lambda: None,  # type: ignore[arg-type,return-value]
                       max_body_bytes=1024, forward_client_auth=False,
                       refused=lambda _: None, owned=OwnedRoutes(web.Application()),
                       rng=random.Random(0), clock=clock)


def test_the_passthrough_passes_over_a_replica_behind_an_open_breaker() -> None:
    d, clock = _dispatcher(), Clock(1.0)
    proxy = _proxy(d, clock)
    d.targets["a"].breaker.on_failure(1.0)  # a's breaker opens
    d.set_healthy("a", True)
    d._changed()  # the breaker moved outside complete(): as complete() would tell it
    assert {proxy.pick("m", set()) for _ in range(8)} == {"b"}
    clock.t = 1.0 + OPEN_S  # its trial is due: a may take requests again
    assert {proxy.pick("m", set()) for _ in range(16)} == {"a", "b"}


def test_the_passthrough_answers_503_with_the_first_trial_when_all_are_open() -> None:
    d, clock = _dispatcher(), Clock(6.0)
    proxy = _proxy(d, clock)
    _busy_then_failing(d, 5.0)
    for model in ("m", None):
        if model is None:  # no model: any replica up, c too
            d.targets["c"].breaker.on_failure(4.0)
            d._changed()
        with pytest.raises(NoHealthyReplica) as exc:
            proxy.pick(model, set())
        # a and b opened at 5, c at 4: the first trial is c's (for any model), spread
        # by the passthrough's draw (its rng's)
        trial = OPEN_S - (1.0 if model else 2.0)
        assert trial < exc.value.retry_after_s < trial + BREAKER_SPREAD_S
        assert f"tried again in {trial:.1f} s" in exc.value.message
    clock.t = 4.0 + OPEN_S  # c's trial is due
    assert proxy.pick("other", set()) == "c"
