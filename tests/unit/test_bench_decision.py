"""The decision benchmark runs end to end on a small setup and reports sane figures."""

from __future__ import annotations

import json
from pathlib import Path

from skymesh_lab.bench import decision


def test_small_decision_run_reports_each_policy_and_the_trie_footprint(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    rc = decision.main(["--replicas", "8", "--nodes", "3000", "--requests", "300",
                        "--repeat", "1", "--policy", "lmetric", "--policy", "round-robin",
                        "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = {r["policy"]: r for r in doc["results"]}
    assert set(rows) == {"lmetric", "round-robin"}
    for r in rows.values():
        assert 0 < r["p50_us"] <= r["p99_us"]
    # The trie policy's trie was prefilled (then grew with the timed decisions); round
    # robin keeps none.
    assert 3000 <= rows["lmetric"]["prefilled"] <= rows["lmetric"]["trie_nodes"]
    assert rows["round-robin"]["trie_nodes"] == 0
    assert 0 < doc["trie_mib"] < 5
