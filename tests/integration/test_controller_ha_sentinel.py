"""The controller on ``redis+sentinel://`` with real sentinels (``redis-server
--sentinel``): the primary SIGKILLed under a stream of admin writes. The controller
follows the failover to the promoted replica, and no acknowledged write is lost with
``ha.wait_replicas: 1`` (docs/operations-control-ha.md states the settings)."""

from __future__ import annotations

from pathlib import Path

from skymesh_lab.bench.control_ha import failover_once


def test_acknowledged_writes_survive_a_primary_kill(tmp_path: Path) -> None:
    row = failover_once(tmp_path, wait_replicas=1, before=30, after=10)
    assert row["new_primary"] is not None and row["new_primary"] != row["old_primary"]
    assert row["acked"] >= 40  # writes went on after the failover, on the new primary
    assert row["lost"] == 0, row["lost_names"]
    assert row["unavailable_s"] is not None
    # What the client saw meanwhile: clear 503s from the API, never a hang or a 500.
    assert set(row["errors"]) <= {"503"}, row["errors"]
