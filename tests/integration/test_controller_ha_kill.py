"""The leader SIGKILLed mid-round and mid-move, with real processes (issue #38): two
``skymesh-controller`` on one ``redis-server``, a ``skymesh-lb`` per region (one worker)
and emulated replicas; the leader's round is ``applying`` with its move of r1 ``draining``
when it is killed (``drain_poll_s`` longer than the test holds the move there). The
standby takes over, settles the round once (r1 undrained where it was, no action applied
by anyone), and a client sending through lb-us all along sees no failure; r1 serves again.

The scenario is the lab's (skymesh_lab.bench.control_ha_move), which also measures it for
the results page; here one run is asserted on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from skymesh_lab.bench.control_ha_move import marked, midmove_once, midround_once

# About a minute each on two loaded cores (process start-ups): marked slow, as the other
# end-to-end planner tests.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_leader_killed_mid_move_loses_no_request_and_settles_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = marked

    def spy(mark: str) -> list[int]:
        pids = real(mark)
        seen.append(mark)
        return pids

    monkeypatch.setattr("skymesh_lab.bench.control_ha_move.marked", spy)
    row = midmove_once(tmp_path)
    print({k: v for k, v in row.items() if k != "client"}, row["client"])

    # The standby took over (a later election).
    assert row["epoch_after"] > row["epoch_before"]
    # The round the leader was applying is settled, once, and nobody applied it.
    assert row["round_status"] == "failed"
    assert "1 undrained where they were, 0 had moved" in row["round_reason"]
    assert row["round_actions"] == 0 and row["move_state"] == ["planned"]
    assert row["settled_times"] == 1  # one "planner round <id>: ..." line, the settlement
    assert row["rounds"].get("applying", 0) == 0
    assert row["rounds"]["applied"] == 1  # round 1 (r1 started), and no other
    # r1 is where it was, serving, the same process; nothing was started in eu.
    assert row["replica"]["region"] == "us" and row["replica"]["balancer"] == "lb-us"
    assert row["replica"]["state"] != "draining" and row["r1_url_unchanged"]
    assert len(row["replicas"]) == 2 and "r2" in row["replicas"]
    assert row["r1_served_before_drain"] >= 1 and row["r1_served_after_undrain"] >= 3
    # The client through lb-us: no failure, before, across and after the kill.
    assert row["failed_requests"] == 0, row["client"]
    assert row["client"]["completed"] > row["client_completed_at_kill"] >= 5
    # The killed leader's orphaned replica was found and stopped.
    assert seen and marked(seen[0]) == []


def test_a_leader_killed_while_its_actuator_starts_a_replica_is_settled_once(
        tmp_path: Path) -> None:
    """Mid-round without a move: the round is ``applying`` and the leader's actuator has
    started a replica whose registration waits (the run holds the store's writer lock).
    After the kill the new leader marks the round failed, once; its own round then starts
    the one replica the plan wants, and only that one is registered: the killed leader's
    half-started replica is not counted twice (it was never registered; the run stops it)."""
    row = midround_once(tmp_path)
    print(row)
    assert row["epoch_after"] > row["epoch_before"]
    assert row["round_status"] == "failed" and row["round_actions"] == 0
    assert "stopped while applying this round" in row["round_reason"]
    assert row["settled_times"] == 1
    assert row["registered_at_settle"] == []  # the old leader's start never registered
    assert row["next_round_status"] == "applied"
    assert row["rounds"]["applied"] == 1 and row["rounds"].get("applying", 0) == 0
    # Two starts (one per leader), one replica registered, in us: the plan's count.
    assert row["replicas_started"] == 2
    assert [r["region"] for r in row["replicas_registered"]] == ["us"]
