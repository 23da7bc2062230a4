"""The local actuator's decisions: which replicas to start and stop, idempotency, dead
processes replaced, failed registrations cleaned up (fake processes and controller)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from skymesh_controller.planning.actuate import Actuator
from skymesh_controller.planning.actuate_local import ControllerError, LocalActuator, reconcile

A = ("m", "us", "L4")
B = ("m", "eu", "H100")


def test_reconcile_starts_the_shortfall_and_stops_the_newest() -> None:
    acts = reconcile({A: ["a1", "a2", "a3"], B: ["b1"]}, {A: 1, B: 3})
    assert acts.start == {B: 2}
    assert acts.stop == [(A, "a3"), (A, "a2")]


def test_reconcile_is_empty_when_counts_match_and_leaves_unplanned_keys() -> None:
    assert not reconcile({A: ["a1"], B: ["b1", "b2"]}, {A: 1})
    with pytest.raises(ValueError):
        reconcile({}, {A: -1})


class FakeDaemon:
    def __init__(self, url: str) -> None:
        self.url, self.up = url, True

    def alive(self) -> bool:
        return self.up

    def stop(self) -> int:
        self.up = False
        return 0


class FakeController:
    def __init__(self) -> None:
        self.replicas: dict[str, dict[str, Any]] = {}
        self.fail_register = False

    def register(self, body: dict[str, Any]) -> None:
        if self.fail_register:
            raise ControllerError("POST /v1/replicas: HTTP 422: unknown_region")
        self.replicas[body["id"]] = body

    def deregister(self, rid: str) -> None:
        self.replicas.pop(rid, None)


def make(monkeypatch: pytest.MonkeyPatch) -> tuple[LocalActuator, FakeController,
                                                   list[FakeDaemon], list[list[str]]]:
    monkeypatch.setenv("SKYMESH_ADMIN_TOKEN", "t")
    daemons: list[FakeDaemon] = []
    argv: list[list[str]] = []

    def starter(name: str, args: list[str], log_path: Path | None = None) -> FakeDaemon:
        assert name == "skymesh-replica"
        argv.append(args)
        daemons.append(FakeDaemon(f"http://127.0.0.1:{9000 + len(daemons)}"))
        return daemons[-1]

    act = LocalActuator("http://ctl", starter=starter)
    ctl = FakeController()
    act.client = ctl  # type: ignore[assignment]
    return act, ctl, daemons, argv


def test_applies_idempotently_and_registers_what_it_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    act, ctl, daemons, argv = make(monkeypatch)
    assert isinstance(act, Actuator)
    first = act.apply_counts({A: 2, B: 1})
    assert first.ok and len(daemons) == 3
    assert {(c.region, c.before, c.after) for c in first.changed} == {("us", 0, 2),
                                                                       ("eu", 0, 1)}
    assert sorted(r["url"] for r in ctl.replicas.values()) == [d.url for d in daemons]
    # Profile per GPU type; the served model name is the plan's.
    assert argv[0][argv[0].index("--profile") + 1] == "llama3.1-8b-l4"
    assert argv[2][argv[2].index("--profile") + 1] == "llama3.1-8b-h100"
    assert all(a[a.index("--model") + 1] == "m" for a in argv)
    second = act.apply_counts({A: 2, B: 1})
    assert second.changed == [] and sorted(second.unchanged) == sorted([A, B])
    assert len(daemons) == 3


def test_a_dead_replica_is_deregistered_and_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    act, ctl, daemons, _ = make(monkeypatch)
    act.apply_counts({A: 2})
    dead = act.running()[A][0]
    daemons[0].up = False
    act.apply_counts({A: 2})
    assert len(act.running()[A]) == 2 and dead not in act.running()[A]
    assert dead not in ctl.replicas and len(ctl.replicas) == 2


def test_failed_registration_stops_the_process_and_is_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    act, ctl, daemons, _ = make(monkeypatch)
    ctl.fail_register = True
    report = act.apply_counts({A: 1})
    assert not report.ok and "unknown_region" in report.errors[A]
    assert act.running() == {} and not daemons[0].alive()


def test_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKYMESH_ADMIN_TOKEN", raising=False)
    with pytest.raises(ValueError, match="SKYMESH_ADMIN_TOKEN"):
        LocalActuator("http://ctl")


def test_the_replicas_of_one_apply_start_at_once_and_register_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each start waits for its process to listen: one apply's starts overlap (a barrier
    that only three concurrent starts pass), and registration keeps the plan's order."""
    monkeypatch.setenv("SKYMESH_ADMIN_TOKEN", "t")
    together = threading.Barrier(3, timeout=10)
    lock = threading.Lock()
    ports = iter(range(9100, 9200))

    def starter(name: str, args: list[str], log_path: Path | None = None) -> FakeDaemon:
        together.wait()  # BrokenBarrierError if the starts ran one after another
        with lock:
            return FakeDaemon(f"http://127.0.0.1:{next(ports)}")

    act = LocalActuator("http://ctl", starter=starter)
    ctl = FakeController()
    act.client = ctl  # type: ignore[assignment]
    report = act.apply_counts({A: 3})
    assert not report.errors
    assert list(ctl.replicas) == act.running()[A]  # registered in the order started
    assert [r["id"].rsplit("-", 1)[1] for r in ctl.replicas.values()] == ["1", "2", "3"]


def test_close_deregisters_and_stops_everything_even_without_a_controller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    act, ctl, daemons, _ = make(monkeypatch)
    act.apply_counts({A: 2, B: 1})
    act.client.deregister(next(iter(ctl.replicas)))  # one already gone at the controller
    act.close()
    assert ctl.replicas == {} and act.running() == {}
    assert daemons and not any(d.up for d in daemons)

    act2, ctl2, daemons2, _ = make(monkeypatch)
    act2.apply_counts({A: 1})

    def gone(rid: str) -> None:
        raise ControllerError("no answer")

    ctl2.deregister = gone  # type: ignore[method-assign]
    act2.close()
    assert not any(d.up for d in daemons2)  # the controller is gone: still ended
