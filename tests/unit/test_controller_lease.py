"""The leader lease's state machine (skymesh_controller.lease) on a fake clock, and the
election loop (leadership.py) on the in-process store with the same clock."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh_controller.config import HaConfig
from skymesh_controller.leadership import Leadership, parse_value
from skymesh_controller.lease import LeaseState
from skymesh_controller.store import FENCE, Fenced, MemoryStore


def test_a_standby_acquires_and_then_renews() -> None:
    st = LeaseState(ttl_s=3.0, renew_s=1.0)
    assert st.next_action() == "acquire" and not st.acts(0.0)
    assert st.acquired(10.0, None) is None  # held by another: still standing by
    assert st.role == "standby"
    assert st.acquired(10.0, 7) == "elected"
    assert st.role == "leader" and st.epoch == 7 and st.next_action() == "renew"
    # Trusted until sent + ttl - margin (margin: min(renew, ttl / 10) = 0.3 s).
    assert st.acts(10.0) and st.acts(12.69) and not st.acts(12.7)


def test_a_renewal_extends_from_when_it_was_sent() -> None:
    st = LeaseState(ttl_s=3.0, renew_s=1.0)
    st.acquired(0.0, 1)
    assert st.renewed(1.0, True) is None
    assert st.valid_until == pytest.approx(3.7)
    # A late answer to an older renewal never shortens the lease.
    assert st.renewed(0.5, True) is None and st.valid_until == pytest.approx(3.7)


def test_a_refused_renewal_stands_down_at_once() -> None:
    st = LeaseState(ttl_s=3.0, renew_s=1.0)
    st.acquired(0.0, 1)
    assert st.renewed(1.0, False) == "lost"
    assert st.role == "standby" and not st.acts(1.0) and st.losses == 1
    assert st.next_action() == "acquire"


def test_an_unreachable_store_keeps_the_leader_until_its_lease_runs_out() -> None:
    st = LeaseState(ttl_s=3.0, renew_s=1.0)
    st.acquired(0.0, 1)
    assert st.unreachable(2.5) is None and st.acts(2.5)
    assert st.unreachable(2.7) == "lost" and not st.acts(2.7)


def test_a_stopped_leader_finds_its_lease_expired_when_it_wakes() -> None:
    st = LeaseState(ttl_s=3.0, renew_s=1.0)
    st.acquired(0.0, 1)
    # SIGSTOP at 0.5, SIGCONT at 30: the monotonic clock kept counting.
    assert not st.acts(30.0)
    assert st.expire(30.0) == "lost"
    assert st.expire(31.0) is None  # once


def test_the_wait_between_steps() -> None:
    st = LeaseState(ttl_s=3.0, renew_s=1.0)
    assert st.wait_s(0.0) == 1.0
    st.acquired(0.0, 1)
    assert st.wait_s(0.0) == 1.0
    assert st.wait_s(2.2) == pytest.approx(0.5)  # never past the local deadline
    with pytest.raises(ValueError):
        LeaseState(ttl_s=1.0, renew_s=1.0)


def test_resign_only_from_leader() -> None:
    st = LeaseState(ttl_s=3.0, renew_s=1.0)
    assert st.resign() is None
    st.acquired(0.0, 1)
    assert st.resign() == "lost" and st.role == "standby"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_two_controllers_on_one_store_elect_one() -> None:
    store, clock = MemoryStore(), FakeClock()
    cfg = HaConfig(lease_ttl_s=3.0, renew_interval_s=1.0)
    a = Leadership(store, cfg.model_copy(update={"id": "a"}), clock=clock)
    b = Leadership(store, cfg.model_copy(update={"id": "b"}), clock=clock)
    won: list[str] = []

    async def a_won() -> None:
        won.append("a")

    async def b_won() -> None:
        won.append("b")

    a.on_elected.append(a_won)
    b.on_elected.append(b_won)
    await a.step()
    await b.step()
    assert a.leader and not b.leader and won == ["a"]
    info = await b.info()
    assert info["leader"] == "a" and info["role"] == "standby" and info["epoch"] == 1
    assert parse_value(a.value)["epoch"] == 1  # type: ignore[index]


async def test_a_paused_leaders_writes_are_fenced_after_a_takeover(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store, clock = MemoryStore(), FakeClock()
    cfg = HaConfig(lease_ttl_s=3.0, renew_interval_s=1.0)
    a = Leadership(store, cfg.model_copy(update={"id": "a"}), clock=clock)
    b = Leadership(store, cfg.model_copy(update={"id": "b"}), clock=clock)
    await a.step()
    old = a.value
    # The memory store expires on the real monotonic clock: let a's lease lapse there.
    import skymesh_controller.store as store_mod

    real = store_mod.time.monotonic
    monkeypatch.setattr(store_mod.time, "monotonic", lambda: real() + 10.0)
    clock.now += 10.0
    await b.step()
    assert b.leader and (await b.info())["epoch"] == 2
    # a, woken, still has its old lease in its context: its write is refused.
    token = FENCE.set(old)
    try:
        with pytest.raises(Fenced):
            await store.commit([("regions", "x", {"name": "x"})])
    finally:
        FENCE.reset(token)
    assert await store.get("regions", "x") is None and store.fenced_total == 1
    # ...and its next step stands it down without a renewal.
    await a.step()
    assert not a.leader and a.state.losses == 1


async def test_only_the_leader_syncs_dns_on_its_own() -> None:
    from skymesh_controller.config import parse_config
    from skymesh_controller.dns_sync import DnsSync

    calls: list[bool] = []

    async def hook(balancers: Any, regions: Any, dry_run: bool) -> dict[str, Any]:
        calls.append(dry_run)
        return {}

    class Records:
        async def list_kind(self, kind: str) -> list[Any]:
            return []

    sync = DnsSync(parse_config({"dns": {"record": "api.example.com"}}), hook,
                   Records())  # type: ignore[arg-type]
    sync.acts = lambda: False
    sync.schedule()
    assert sync.task is None  # a standby (or a lapsed leader) leaves DNS alone
    sync.acts = lambda: True
    sync.schedule()
    assert sync.task is not None
    await sync.task
    assert calls == [False]
