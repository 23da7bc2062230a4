"""The local actuator's side of a move (the planner runs the drain): a region move keeps
the process, a model change starts one with the other model and stops the old one only
when the move finishes, an aborted move leaves the old one serving (fake processes)."""

from __future__ import annotations

import pytest
from test_local_actuator import A, make

from skymesh_controller.autopilot.actuators import Mover

EU = ("m", "eu", "L4")
OTHER_MODEL = ("q", "us", "L4")


def test_a_region_move_keeps_the_process_and_moves_the_books(
        monkeypatch: pytest.MonkeyPatch) -> None:
    act, _, daemons, _ = make(monkeypatch)
    assert isinstance(act, Mover)
    act.apply_counts({A: 2})
    newest = act.movable(A)[0]
    assert act.movable(A) == list(reversed(act.running()[A]))  # newest first
    url = act.prepare_move(newest, A, EU)
    assert url == daemons[1].url and len(daemons) == 2  # nothing started
    act.finish_move(newest, A, EU)
    assert act.running() == {A: [act.running()[A][0]], EU: [newest]}
    assert all(d.up for d in daemons)
    # The books are the new truth: a plan for the same counts changes nothing.
    assert not act.apply_counts({A: 1, EU: 1}).changed


def test_a_model_change_starts_the_other_model_and_stops_the_old_at_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    act, _, daemons, argv = make(monkeypatch)
    act.apply_counts({A: 1})
    rid = act.movable(A)[0]
    url = act.prepare_move(rid, A, OTHER_MODEL)
    assert url == daemons[1].url and argv[1][argv[1].index("--model") + 1] == "q"
    assert daemons[0].up  # the old one serves until the controller has re-registered
    act.finish_move(rid, A, OTHER_MODEL)
    assert not daemons[0].up and daemons[1].up
    assert act.running() == {OTHER_MODEL: [rid]}
    assert act.urls(OTHER_MODEL) == [daemons[1].url]


def test_an_aborted_move_stops_what_it_started_and_keeps_the_old(
        monkeypatch: pytest.MonkeyPatch) -> None:
    act, _, daemons, _ = make(monkeypatch)
    act.apply_counts({A: 1})
    rid = act.movable(A)[0]
    act.prepare_move(rid, A, OTHER_MODEL)
    act.abort_move(rid)
    assert daemons[0].up and not daemons[1].up
    assert act.running() == {A: [rid]}
    with pytest.raises(ValueError, match="not one of mine"):
        act.prepare_move("nobody", A, EU)


def test_a_fixed_home_balancer_allows_model_changes_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    act, _, _, _ = make(monkeypatch)
    assert act.move_kinds == {"model", "region"}
    act.balancer = "lb-us"
    assert act.move_kinds == {"model"}
