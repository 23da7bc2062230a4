"""The controller's parts (skymesh_controller/service.py lists them) stay apart: none
names the object that wires them or the API that calls them, and the planner's strategy
stepper does not name the planner. Read with ``ast``, counting every kind of import
(module level, lazy, under ``TYPE_CHECKING``)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from skymesh_controller.refusals import LOG_EVERY_S, Refusals
from skymesh_controller.telemetry import keep_for

PACKAGE = Path(__file__).resolve().parents[2] / "controller" / "skymesh_controller"
PARTS = ("changes", "records", "balancers", "replicas", "membership", "telemetry",
         "probing", "dns_sync", "relocation", "refusals", "status", "errors")
WIRING = ("skymesh_controller.service", "skymesh_controller.api",
          "skymesh_controller.autopilot")


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("part", PARTS)
def test_a_part_never_names_the_wiring_or_the_api(part: str) -> None:
    bad = sorted(n for n in imported(PACKAGE / f"{part}.py")
                 if any(n == w or n.startswith(w + ".") for w in WIRING))
    assert bad == [], f"{part}.py imports {bad}"


def test_the_strategy_stepper_does_not_name_the_planner() -> None:
    names = imported(PACKAGE / "autopilot" / "strategy.py")
    assert not any(n.startswith("skymesh_controller.autopilot.planner") for n in names)


def test_refusals_count_every_one_and_log_each_reason_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    refused = Refusals(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="skymesh.controller"):
        for _ in range(50):
            refused("body_too_large")
        refused("balancer_quota", "token 'x'")
        now[0] += LOG_EVERY_S
        refused("body_too_large")
    assert refused.counts == {"body_too_large": 51, "balancer_quota": 1}
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused a request: body_too_large (1 so far)",
                     "refused a request: balancer_quota: token 'x' (1 so far)",
                     "refused a request: body_too_large (51 so far)"]


@pytest.mark.parametrize(("size", "keep", "budget", "want"), [
    (1000, 10_000, 1 << 20, 1024),   # 1000 bytes round up to 1024: 1 MiB holds 1024
    (1024, 10_000, 1 << 20, 1024),
    (1025, 10_000, 1 << 20, 512),
    (100, 50, 1 << 20, 50),          # the count cap bites first
    (1 << 21, 10_000, 1 << 20, 1),   # larger than the budget: the newest one is kept
])
def test_telemetry_history_is_bounded_in_count_and_bytes(size: int, keep: int, budget: int,
                                                         want: int) -> None:
    assert keep_for(size, keep, budget) == want
