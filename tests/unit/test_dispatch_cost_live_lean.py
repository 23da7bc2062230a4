"""dispatch_cost_live's lean arms (``--lean``): each is the aiohttp arm's flags with a config
turning ``listen.http_server: lean`` on, and the JSON pairs each with its aiohttp arm per
round."""

from __future__ import annotations

import argparse

from skymesh.balancer.config import parse_config
from skymesh_lab.bench import dispatch_cost_live as dcl


def test_the_lean_arms_are_the_aiohttp_arms_with_the_lean_config() -> None:
    assert dcl.configs_of(False) == dcl.CONFIGS
    lean = dcl.configs_of(True)
    assert lean["rr-lean"][2:] == dcl.CONFIGS["rr"]
    assert lean["default-lean"] == ["--config", dcl.LEAN_FILE]
    import yaml
    assert parse_config(yaml.safe_load(dcl.LEAN_YAML)).listen.http_server == "lean"


def test_the_summary_pairs_each_lean_arm_with_its_aiohttp_arm_per_round() -> None:
    res = {("current", c): [100.0, 200.0] for c in dcl.configs_of(True)}
    res[("current", "rr-lean")] = [90.0, 210.0]
    args = argparse.Namespace(base=None, rounds=2, duration=1.0, warmup=1.0, seed=0,
                              workers=1, json=None, lean=True)
    doc = dcl.summary(res, ["current"], args, 0.5)
    assert doc["versions"]["current"]["lean_ratios"]["rr-lean"] == {
        "over": "rr", "rounds": [0.9, 1.05], "median": 0.98}
    assert "rr-lean" in doc["setup"]["configs"] and doc["command"].endswith("--lean")
    plain = dcl.summary(res, ["current"], argparse.Namespace(**{**vars(args), "lean": False}),
                        0.5)
    assert "lean_ratios" not in plain["versions"]["current"]
    assert "rr-lean" not in plain["setup"]["configs"]
