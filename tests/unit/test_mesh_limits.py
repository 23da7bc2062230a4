"""What a peer may do, without sockets: heartbeat field ranges and the capped interval
(fake clock), and the peering port's admission counts (skymesh.mesh.limits, .guard)."""

from __future__ import annotations

import logging

import pytest

from skymesh.mesh.guard import (
    ADDRESS_LIMIT,
    HANDSHAKE_ADDRESS_LIMIT,
    HANDSHAKE_LIMIT,
    TOTAL_LIMIT,
    Admission,
    PortGuard,
)
from skymesh.mesh.heartbeat import HeartbeatSession
from skymesh.mesh.limits import GuardLimits, HeartbeatLimits, heartbeat_problem, peer_interval
from skymesh.mesh.proto import pb
from skymesh.mesh.state import Identity, Liveness, PeerState, Verdict

INTERVAL = 0.2


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def beat(seq: int = 1, interval_ms: int = 200, **load: int) -> pb.HeartbeatMsg:
    msg = pb.HeartbeatMsg(region="eu", balancer_id="lb-x", epoch=1, seq=seq,
                          interval_ms=interval_ms)
    msg.models.add(model="m", **({"available_replicas": 1, "total_replicas": 2} | load))
    return msg


# -- heartbeat fields ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("load", "problem"),
    [
        ({}, None),
        ({"available_replicas": 1024, "total_replicas": 1024}, None),
        ({"available_replicas": 1000, "total_replicas": 1025}, "total_replicas 1025 exceeds"),
        ({"available_replicas": 3, "total_replicas": 2}, "available_replicas 3 exceeds"),
        ({"queue_length": 100_001}, "queue_length 100001 exceeds"),
        ({"outstanding_requests": 100_001}, "outstanding_requests 100001 exceeds"),
        ({"outstanding_requests": 100_000}, None),
        ({"pending_prefill_tokens": 10**12 + 1}, "pending_prefill_tokens"),
    ],
)
def test_heartbeat_problem(load: dict[str, int], problem: str | None) -> None:
    got = heartbeat_problem(beat(**load), HeartbeatLimits())
    assert got is None if problem is None else (got is not None and problem in got)


@pytest.mark.parametrize(
    ("declared_ms", "want"),
    [(200, 0.2), (1000, 1.0), (0, 0.2), (50, 0.2), (4_000_000_000, 2.0), (2**32 - 1, 2.0)],
)
def test_peer_interval_is_no_shorter_than_ours_nor_longer_than_the_cap(
        declared_ms: int, want: float) -> None:
    assert peer_interval(declared_ms, INTERVAL, 2.0) == pytest.approx(want)


def test_a_peer_announcing_a_huge_interval_is_down_after_the_capped_one() -> None:
    # The reported attack: one heartbeat with interval_ms=4e9 kept the peer alive for
    # minutes (12e6 s at down_after=3). Now it is measured in the cap (2 s).
    clock = FakeClock()
    st = PeerState(Identity("us", "lb-a", 100), interval=INTERVAL, clock=clock)
    assert st.observe(beat(interval_ms=4_000_000_000)) is Verdict.ACCEPTED
    clock.t += 2 * 2.0 - 0.01
    assert st.liveness("lb-x") is Liveness.ALIVE
    clock.t += 0.02
    assert st.liveness("lb-x") is Liveness.SUSPECTED
    clock.t += 2.0
    assert st.liveness("lb-x") is Liveness.DOWN
    assert "lb-x" not in st.usable()


def test_a_heartbeat_out_of_range_is_refused_and_changes_nothing() -> None:
    clock = FakeClock()
    st = PeerState(Identity("us", "lb-a", 100), interval=INTERVAL, clock=clock,
                   limits=HeartbeatLimits(max_replicas=100))
    assert st.observe(beat(seq=1)) is Verdict.ACCEPTED
    assert st.observe(beat(seq=2, available_replicas=101, total_replicas=101)) is \
        Verdict.INVALID
    latest = st.latest("lb-x")
    assert latest is not None and latest.seq == 1 and latest.models[0].total_replicas == 2
    assert st.view("lb-x").rejected == 1
    clock.t += 3 * INTERVAL + 0.01  # invalid heartbeats do not keep a peer alive
    assert st.liveness("lb-x") is Liveness.DOWN


def test_the_session_logs_a_refused_heartbeat_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    st = PeerState(Identity("us", "lb-a", 100), interval=INTERVAL, clock=clock)
    heard: list[pb.HeartbeatMsg] = []
    session = HeartbeatSession(st, "lb-x", lambda _: pb.HeartbeatMsg(), heard.append)
    with caplog.at_level(logging.WARNING, logger="skymesh.mesh.heartbeat"):
        for seq in range(1, 4):
            assert session.incoming(beat(seq=seq, available_replicas=5)) is Verdict.INVALID
    assert heard == [] and session.invalid == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "refused a heartbeat from lb-x" in lines[0]
    assert "available_replicas 5 exceeds total_replicas 2" in lines[0]


# -- the peering port's admission ----------------------------------------------------------
SMALL = GuardLimits(handshake_timeout_s=1.0, max_handshakes=4, max_handshakes_per_address=2,
                    max_connections=6, max_connections_per_address=3)


def test_handshaking_connections_are_capped_per_address_then_in_total() -> None:
    a = Admission(SMALL)
    assert [a.admit("10.0.0.1") for _ in range(3)] == [None, None, HANDSHAKE_ADDRESS_LIMIT]
    assert [a.admit("10.0.0.2") for _ in range(2)] == [None, None]
    assert a.admit("10.0.0.3") == HANDSHAKE_LIMIT
    assert (a.total, a.total_handshaking) == (4, 4)


def test_established_connections_free_handshake_slots_but_count_in_the_totals() -> None:
    a = Admission(SMALL)
    for _ in range(2):
        assert a.admit("10.0.0.1") is None
        a.established("10.0.0.1")
    assert a.admit("10.0.0.1") is None  # a third connection, handshaking
    assert a.admit("10.0.0.1") == ADDRESS_LIMIT  # 3 open from it
    for addr in ("10.0.0.2", "10.0.0.2", "10.0.0.3"):
        assert a.admit(addr) is None
    assert a.admit("10.0.0.4") == TOTAL_LIMIT  # 6 open
    a.release("10.0.0.1", handshaking=True)
    a.release("10.0.0.1", handshaking=False)
    assert (a.total, a.total_handshaking) == (4, 3)
    assert a.open["10.0.0.1"] == 1 and a.handshaking["10.0.0.1"] == 0
    assert a.admit("10.0.0.4") is None


def test_refusals_are_counted_and_logged_at_most_once_per_reason_and_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    guard = PortGuard(SMALL, clock=clock)
    with caplog.at_level(logging.WARNING, logger="skymesh.mesh.guard"):
        for _ in range(5):
            guard.note_refused(HANDSHAKE_ADDRESS_LIMIT, "10.0.0.1")
        clock.t += 10.0
        guard.note_refused(HANDSHAKE_ADDRESS_LIMIT, "10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "max_handshakes_per_address 2" in lines[0]
    assert "(4 more since the last such line)" in lines[1]
    samples = {(s.name, s.labels.get("reason"), s.labels.get("state")): s.value
               for m in guard.collect() for s in m.samples}
    assert samples[("skymesh_mesh_connections_refused_total", HANDSHAKE_ADDRESS_LIMIT,
                    None)] == 6
    assert samples[("skymesh_mesh_connections", None, "handshaking")] == 0
