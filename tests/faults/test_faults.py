"""Every fault scenario in its short form (what ``make faults`` runs), with its invariants.

Each scenario is real processes on loopback; the test asserts the client-side accounting
(no request lost: every one completed correctly or failed with an error the client saw)
and the scenario's own invariants (in-flight counts back to zero, queue and memory
bounded, the right failure mode). Together they take about a minute.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skymesh_lab.faults.runner import run_one
from skymesh_lab.faults.scenarios import SCENARIOS

pytestmark = pytest.mark.timeout(120)

CONTRACT = ("accepted", "completed", "retried", "failed_explicit", "lost")




async def _row(name: str, tmp_path: Path) -> dict[str, Any]:
    row = await run_one(name, short=True, workdir=tmp_path)
    assert "error" not in row, row.get("traceback")
    assert all(isinstance(row[k], int) for k in CONTRACT)
    lost = {k: v for k, v in row["reasons"].items() if k.startswith("lost")}
    assert not lost, row["reasons"]
    assert row["lost"] == 0
    assert row["completed"] + row["failed_explicit"] + row["lost"] == row["sent"]
    assert row["accepted"] <= row["sent"]
    failed = {k: v for k, v in row["checks"].items() if not v}
    assert not failed, (failed, row["info"])
    assert row["ok"]
    if name != "redis_restart":  # the one scenario without a balancer
        assert row["checks"]["in_flight_back_to_zero"]
    return row


async def test_replica_killed_mid_stream(tmp_path: Path) -> None:
    row = await _row("replica_killed_mid_stream", tmp_path)
    # streams on the dead replica end with an SSE error event, never silently
    assert row["failed_explicit"] >= 1
    assert set(row["reasons"]) == {"failed_explicit: SSE error event (upstream_failed)"}
    assert row["checks"]["burst_after_kill_all_completed"]


async def test_replica_slow_10x(tmp_path: Path) -> None:
    row = await _row("replica_slow_10x", tmp_path)
    assert row["completed"] == row["sent"] > 0
    assert row["info"]["served_fast"] > 2 * row["info"]["served_slow"]


async def test_balancer_restart(tmp_path: Path) -> None:
    row = await _row("balancer_restart", tmp_path)
    assert row["checks"]["restarted_balancer_served"]
    assert row["checks"]["old_balancer_exited_cleanly"]


async def test_peer_partition(tmp_path: Path) -> None:
    row = await _row("peer_partition", tmp_path)
    assert row["checks"]["partitioned_peer_marked_down"]
    # The forward cut by the partition is failed when the peer goes DOWN (about half a
    # second), not when gRPC keepalive gives up on the silent connection (15 s).
    assert row["info"]["down_after_s"] < 5
    assert row["retried"] + row["failed_explicit"] >= 1, row


async def test_controller_restart(tmp_path: Path) -> None:
    row = await _row("controller_restart", tmp_path)
    assert row["completed"] == row["sent"] > 0
    assert row["checks"]["served_while_controller_down"]
    assert row["checks"]["balancer_resynced"]


async def test_redis_restart(tmp_path: Path) -> None:
    row = await _row("redis_restart", tmp_path)
    assert row["statuses"].get("503", 0) > 0  # explicit while Redis is down
    assert row["statuses"].get("200", 0) > 0
    assert set(row["statuses"]) <= {"200", "503"}


async def test_overload_10x(tmp_path: Path) -> None:
    row = await _row("overload_10x", tmp_path)
    assert row["statuses"].get("429", 0) > 0
    assert row["info"]["max_queued"] <= row["info"]["max_queue"]
    assert row["info"]["rss_after_mb"] - row["info"]["rss_before_mb"] < 64


def test_cli_writes_the_contract_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    from skymesh.cli import main

    out = tmp_path / "faults.json"
    code = main(["faults", "run", "--short", "--only", "redis_restart", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert code == 0
    assert set(doc["scenarios"]) == {"redis_restart"}
    assert set(CONTRACT) <= set(doc["scenarios"]["redis_restart"])
    table = capsys.readouterr().out
    assert "redis_restart" in table and "failed_explicit" in table


def test_every_scenario_is_tested() -> None:
    tested = {n.removeprefix("test_") for n in globals() if n.startswith("test_")}
    assert set(SCENARIOS) <= tested
