"""skymesh.net.limits without sockets: the file-limit check at start, admission counting
and the rate-limited log line (on a fake clock)."""

from __future__ import annotations

import logging
import resource

import pytest

from skymesh.net.limits import (
    CLIENT_LIMIT,
    FD_RESERVE,
    PROCESS_LIMIT,
    ConnectionGuard,
    ConnLimits,
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
