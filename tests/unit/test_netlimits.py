"""skymesh.net.limits without sockets: the file-limit check at start, admission counting
and the rate-limited log line (on a fake clock)."""

from __future__ import annotations

import logging
import resource

import pytest

from skymesh.net.limits import (
    CLIENT_LIMIT,
    DEFAULT_LIMITS,
    FAIR_SHARE,
    FD_RESERVE,
    PROCESS_LIMIT,
    ConnectionGuard,
    ConnLimits,
    admission,
    fit_file_limit,
)

INF = resource.RLIM_INFINITY


class FakeRlimit:
    def __init__(self, soft: int, hard: int, settable: bool = True) -> None:
        self.soft, self.hard, self.settable = soft, hard, settable

    def get(self, which: int) -> tuple[int, int]:
        return self.soft, self.hard

    def set(self, which: int, value: tuple[int, int]) -> None:
        if not self.settable:
            raise ValueError("not allowed")
        self.soft = value[0]


LIMITS = ConnLimits(max_connections=10_000, max_connections_per_client=1_000)
NEED = 10_000 + FD_RESERVE


@pytest.mark.parametrize("soft,hard,settable,soft_after,cap_after,warns", [
    (65_536, 65_536, True, 65_536, 10_000, False),  # enough: untouched
    (INF, INF, True, INF, 10_000, False),
    (1_024, 1_048_576, True, NEED, 10_000, False),  # raised to what the cap needs
    (1_024, INF, True, NEED, 10_000, False),
    (1_024, 5_000, True, 5_000, 5_000 - FD_RESERVE, True),  # raised to hard, cap lowered
    (1_024, 5_000, False, 1_024, 512, True),  # cannot raise: the cap fits what there is
])
def test_the_file_limit_is_raised_or_the_cap_fitted(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, soft: int,
        hard: int, settable: bool, soft_after: int, cap_after: int, warns: bool) -> None:
    fake = FakeRlimit(soft, hard, settable)
    monkeypatch.setattr(resource, "getrlimit", fake.get)
    monkeypatch.setattr(resource, "setrlimit", fake.set)
    with caplog.at_level(logging.INFO, logger="skymesh.net.limits"):
        fitted = fit_file_limit(LIMITS, "test")
    assert fake.soft == soft_after
    assert fitted.max_connections == cap_after
    assert fitted.max_connections_per_client == min(1_000, cap_after)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warned) == warns
    if warns:
        assert "max_connections 10000" in warned[-1].getMessage()


def test_admission_counts_per_process_and_per_client() -> None:
    guard = ConnectionGuard(ConnLimits(max_connections=3, max_connections_per_client=2), "t")
    assert [guard.admit("a"), guard.admit("a"), guard.admit("a")] == [None, None, CLIENT_LIMIT]
    assert guard.admit("b") is None
    assert guard.admit("c") == PROCESS_LIMIT
    guard.release("a")
    assert guard.admit("c") is None
    for client in ("a", "b", "c"):
        guard.release(client)
    assert guard.open == 0 and not guard.by_client


FAIR = ConnLimits(max_connections=100, max_connections_per_client=50,
                  reserved_fraction=0.2, reserve_share=0.1)


@pytest.mark.parametrize(("open_", "held", "reason"), [
    (0, 0, None),
    (79, 49, None),            # below the reserve: only the per-address cap
    (79, 50, CLIENT_LIMIT),
    (80, 1, None),             # in the reserve: 20 free, a tenth is 2
    (80, 2, FAIR_SHARE),
    (95, 0, None),             # 5 free: an address holding none still gets in
    (95, 1, FAIR_SHARE),
    (99, 0, None),
    (100, 0, PROCESS_LIMIT),
])
def test_admission_keeps_a_reserve_for_addresses_that_hold_few(
        open_: int, held: int, reason: str | None) -> None:
    assert admission(FAIR, open_, held) == reason


@pytest.mark.parametrize("addresses", [1, 2, 10, 50])
def test_a_few_greedy_addresses_never_take_the_whole_process(addresses: int) -> None:
    """Issue #33, item 11: 10 addresses at 1,000 connections each took all of the 10,000
    (every other client got 503 while they held them)."""
    guard = ConnectionGuard(DEFAULT_LIMITS, "t")
    greedy = [f"10.0.0.{i}" for i in range(addresses)]
    progress = True
    while progress:  # round after round, each opens one more until all are refused
        progress = False
        for a in greedy:
            progress |= guard.admit(a) is None
    lim = DEFAULT_LIMITS
    free = lim.max_connections - guard.open
    assert free >= (lim.max_connections - lim.shared()) / (1 + addresses * lim.reserve_share) - 1
    assert all(guard.by_client[a] <= lim.max_connections_per_client for a in greedy)
    # Whoever else comes is let in.
    assert guard.admit("192.0.2.1") is None and guard.admit("192.0.2.2") is None


def test_refusals_log_one_line_per_window_with_the_count_between(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    guard = ConnectionGuard(ConnLimits(max_connections_per_client=1), "lb",
                            clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="skymesh.net.limits"):
        for _ in range(5):
            guard.note_refused(CLIENT_LIMIT, "10.0.0.1")
        now[0] += 10.0
        guard.note_refused(CLIENT_LIMIT, "10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "refused a connection from 10.0.0.1" in lines[0]
    assert "max_connections_per_client 1" in lines[0]
    assert lines[1].endswith("(4 more since the last such line)")
    assert guard.refused[CLIENT_LIMIT] == 6


def test_a_fair_share_refusal_says_why(caplog: pytest.LogCaptureFixture) -> None:
    guard = ConnectionGuard(FAIR, "lb")
    for _ in range(50):
        assert guard.admit("10.0.0.1") is None
    for _ in range(30):
        assert guard.admit("10.0.0.2") is None
    assert guard.admit("10.0.0.2") == FAIR_SHARE
    with caplog.at_level(logging.WARNING, logger="skymesh.net.limits"):
        guard.note_refused(FAIR_SHARE, "10.0.0.2")
    [line] = [r.getMessage() for r in caplog.records]
    assert "refused a connection from 10.0.0.2: it holds 30 of 80" in line
    assert "reserved_fraction 0.2 of max_connections 100" in line
    assert guard.refused[FAIR_SHARE] == 1
