"""``skymesh.bench.results`` rebuilds the command that reproduces a run, load scale included."""

from __future__ import annotations

from pathlib import Path

from skymesh.bench.results import command_for
from skymesh.bench.skylb_macro import CALIBRATED_LOAD_SCALE, WORKLOADS, parse_load_scale


def _setup(scale: dict[str, float], workloads: list[str]) -> dict[str, object]:
    return {"setup": {"mode": "sim", "duration_s": 300, "workloads": dict.fromkeys(workloads),
                      "load_scale": scale}}


def test_the_reproducing_command_carries_the_load_scale() -> None:
    every = list(WORKLOADS)
    cal = {w: CALIBRATED_LOAD_SCALE.get(w, 1.0) for w in every}
    cmd = command_for(_setup(cal, every), Path("out/a.json"))
    assert "--load-scale calibrated" in cmd
    pair = {"chat-arena": 2.0, "tot": 1.0}
    cmd = command_for(_setup(pair, ["chat-arena", "tot"]), Path("b.json"))
    flag = cmd.split("--load-scale ")[1].split()[0]
    assert flag == "chat-arena=2"
    assert parse_load_scale(flag)["chat-arena"] == 2.0  # the flag parses back
    assert "--load-scale" not in command_for(_setup(dict.fromkeys(every, 1.0), every),
                                             Path("c.json"))
