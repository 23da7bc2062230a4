"""dispatch_cost_live's aiohttp arms (``--lean``): the lean server is skymesh-lb's default,
so each added arm is a plain arm's flags with a config turning ``listen.http_server:
aiohttp`` on, and the JSON pairs each plain (lean) arm with its aiohttp arm per round."""

from __future__ import annotations

import argparse

import yaml

from skymesh.balancer.config import parse_config
from skymesh_lab.bench import dispatch_cost_live as dcl


def test_the_plain_arms_are_lean_and_the_added_arms_aiohttp() -> None:
    assert dcl.configs_of(False) == dcl.CONFIGS
    both = dcl.configs_of(True)
    assert both["rr-aiohttp"][2:] == dcl.CONFIGS["rr"]
    assert both["default-aiohttp"] == ["--config", dcl.AIOHTTP_FILE]
    assert parse_config(yaml.safe_load(dcl.AIOHTTP_YAML)).listen.http_server == "aiohttp"
    # The plain arms carry no config naming a server: they are the default, lean.
    assert all("--config" not in dcl.CONFIGS[c] for c in ("default", "rr"))
    assert parse_config({}).listen.http_server == "lean"


def test_the_summary_pairs_each_lean_arm_with_its_aiohttp_arm_per_round() -> None:
    res = {("current", c): [100.0, 200.0] for c in dcl.configs_of(True)}
    res[("current", "rr")] = [90.0, 210.0]  # the lean arm
    args = argparse.Namespace(base=None, rounds=2, duration=1.0, warmup=1.0, seed=0,
                              workers=1, json=None, lean=True)
    doc = dcl.summary(res, ["current"], args, 0.5)
    assert doc["versions"]["current"]["lean_ratios"]["rr"] == {
        "over": "rr-aiohttp", "rounds": [0.9, 1.05], "median": 0.98}
    assert "rr-aiohttp" in doc["setup"]["configs"] and doc["command"].endswith("--lean")
    plain = dcl.summary(res, ["current"], argparse.Namespace(**{**vars(args), "lean": False}),
                        0.5)
    assert "lean_ratios" not in plain["versions"]["current"]
    assert "rr-aiohttp" not in plain["setup"]["configs"]
