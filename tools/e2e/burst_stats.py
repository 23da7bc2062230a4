"""The burst benchmark's run order and its aggregation over rounds (pure: no I/O).

Why an order at all: on two shared cores the mode that ran first in a run did 10-17%
better on TTFT and completion, whichever it was, so one run per mode in a fixed order
cannot tell the modes apart. ``round_orders`` gives round ``r`` the modes rotated by ``r``
(each mode once in each position over ``len(modes)`` rounds, a Latin square); the next
``len(modes)`` rounds run the same rotations reversed, so each mode runs both before and
after its neighbours in the cycle (with 3 modes that is all 6 orders in 6 rounds, and each
mode follows every other equally often).

``aggregate`` gives per mode the mean over rounds of each figure with its min, max and
sample standard deviation; ``paired`` the per-round ratio of one mode's figure to
another's (the two ran minutes apart on the same servers, so the ratio cancels what the
machine's load did to both) with the geometric mean over rounds and its 95% confidence
interval; ``by_position`` each
run's figure over its mode's mean, averaged by the run's position in its round: the order
effect itself, 1.0 everywhere when there is none.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

# Per-run figures (keys of a run's result) aggregated over rounds.
RUN_FIGURES = ("ttft_p50_s", "ttft_p90_s", "completion_s", "lb_queue_mean", "lb_queue_max",
               "loadavg_mean", "failed", "unhealthy_flips", "prefix_hit_rate")
# Per-server figures (keys of ``result["servers"][name]``; ``served`` and the prefix-cache
# tokens are what the burst added to the server's counters).
SERVER_FIGURES = ("waiting_mean", "waiting_max", "running_mean",
                  "running_when_backlogged_mean", "served", "prefix_hit_tokens")
# Figures where lower is better and whose ratio between modes is quoted.
PAIRED_FIGURES = ("ttft_p50_s", "ttft_p90_s", "completion_s")


def round_orders(modes: Sequence[str], rounds: int, balanced: bool = True) -> list[list[str]]:
    """The modes' order in each of ``rounds`` rounds (see the module header)."""
    n = len(modes)
    if not balanced or n < 2:
        return [list(modes) for _ in range(rounds)]
    out = []
    for r in range(rounds):
        k = r % n
        order = list(modes[k:]) + list(modes[:k])
        out.append(order[::-1] if (r // n) % 2 else order)
    return out


def spread(xs: Iterable[float | None]) -> dict[str, float | int | None]:
    """Mean, min, max and sample standard deviation of the values that exist."""
    vals = [float(x) for x in xs if x is not None]
    if not vals:
        return {"mean": None, "min": None, "max": None, "sd": None, "n": 0}
    return {"mean": _r(statistics.fmean(vals)), "min": _r(min(vals)), "max": _r(max(vals)),
            "sd": _r(statistics.stdev(vals)) if len(vals) > 1 else None, "n": len(vals)}


def aggregate(rounds: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{mode: {figure: spread, "servers": {name: {figure: spread}}}}`` over the rounds
    (each ``{"runs": {mode: result}}``) in which the mode ran."""
    modes: dict[str, list[dict[str, Any]]] = {}
    for rnd in rounds:
        for mode, res in rnd["runs"].items():
            modes.setdefault(mode, []).append(res)
    out: dict[str, dict[str, Any]] = {}
    for mode, runs in modes.items():
        agg: dict[str, Any] = {f: spread(r.get(f) for r in runs) for f in RUN_FIGURES}
        names = sorted({n for r in runs for n in r.get("servers", {})})
        agg["servers"] = {n: {f: spread(r.get("servers", {}).get(n, {}).get(f) for r in runs)
                              for f in SERVER_FIGURES} for n in names}
        agg["rounds"] = len(runs)
        out[mode] = agg
    return out


def paired(rounds: Sequence[dict[str, Any]], num: str, den: str) -> dict[str, Any]:
    """Per figure: ``num``'s value over ``den``'s in each round holding both, and the
    geometric mean of those ratios (ratios average multiplicatively)."""
    out: dict[str, Any] = {}
    for f in PAIRED_FIGURES:
        ratios = []
        for rnd in rounds:
            a, b = (rnd["runs"].get(m, {}).get(f) for m in (num, den))
            if a is not None and b:
                ratios.append(round(a / b, 4))
        logs = [math.log(x) for x in ratios]
        geo = math.exp(statistics.fmean(logs)) if logs else None
        out[f] = {"per_round": ratios, "geomean": _r(geo, 4),
                  "min": min(ratios, default=None), "max": max(ratios, default=None),
                  "ci95": _ci95(logs)}
    return out


def _ci95(logs: list[float]) -> list[float | None] | None:
    """95% confidence interval of the geometric mean: Student's t on the log ratios (the
    rounds are independent pairs; a ratio's log is near-symmetric where the ratio is
    not). Containing 1.0: the rounds cannot tell the two modes apart."""
    if len(logs) < 2:
        return None
    from scipy.stats import t  # the lab's dependency; only the aggregation needs it

    half = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return [_r(math.exp(mean - half), 4), _r(math.exp(mean + half), 4)]


def by_position(rounds: Sequence[dict[str, Any]],
                figures: Sequence[str] = PAIRED_FIGURES) -> dict[str, list[float | None]]:
    """Per figure: the mean, over runs in position i of their round, of the run's figure
    over its mode's mean across rounds (index i: position i + 1)."""
    out: dict[str, list[float | None]] = {}
    for f in figures:
        means: dict[str, float] = {}
        for mode in {m for rnd in rounds for m in rnd["runs"]}:
            vals = [rnd["runs"][mode].get(f) for rnd in rounds if mode in rnd["runs"]]
            present = [v for v in vals if v is not None]
            if present:
                means[mode] = statistics.fmean(present)
        slots: dict[int, list[float]] = {}
        for rnd in rounds:
            for i, mode in enumerate(rnd["order"]):
                v = rnd["runs"].get(mode, {}).get(f)
                if v is not None and means.get(mode):
                    slots.setdefault(i, []).append(v / means[mode])
        width = max(slots, default=-1) + 1
        out[f] = [_r(statistics.fmean(slots[i]), 4) if i in slots else None
                  for i in range(width)]
    return out


def cores(run: dict[str, Any], part: str) -> float | None:
    """Cores ``part`` ("servers": every server's process group; or a ``cpu_s`` key such
    as "others") kept busy on average during the run's burst."""
    cpu, wall = run.get("cpu_s") or {}, run.get("completion_s")
    if not wall:
        return None
    if part == "servers":
        used = [v for k, v in cpu.items() if k.startswith("s") and k[1:].isdigit()]
        return sum(used) / wall if used else None
    return cpu[part] / wall if part in cpu else None


def contention(rounds: Sequence[dict[str, Any]]) -> dict[str, float | int | None]:
    """Across every run: Pearson's r of the burst's completion time with the cores the
    servers got and with the cores everything else took. On a saturated machine a burst
    is slow when the others take more of it, whatever the mode."""
    runs = [r for rnd in rounds for r in rnd["runs"].values()]
    out: dict[str, float | int | None] = {"runs": len(runs)}
    for part in ("servers", "others"):
        pairs = [(c, r["completion_s"]) for r in runs
                 if (c := cores(r, part)) is not None and r.get("completion_s")]
        ok = len(pairs) > 2 and len({c for c, _ in pairs}) > 1 and len({t for _, t in pairs}) > 1
        out[f"completion_vs_{part}_cores_r"] = (
            _r(statistics.correlation(*zip(*pairs, strict=True)), 3) if ok else None)
    return out


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)
