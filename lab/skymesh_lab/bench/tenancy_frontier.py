"""The frontier of the interactive tail against the batch tenant's throughput under the
flood (issue #37): the simulator's flood (``skymesh_lab.bench.tenancy``: the same
arrivals, replicas and release rule as the tenancy page) with each knob of the slot
reserve swept from first come first served to "no batch request while an interactive one
may arrive", and two bounds.

The knobs, each on top of the default reserve (``auto``, ``reserve_headroom`` 1.5,
``reserve_pace`` 1, ``reserve_fall_gaps`` 4, ``reserve_idle_s`` 120 s, ``reserve_window_s``
10 s), one changed at a time:

- ``reserve_headroom``: the slots kept free per interactive request in service (at most
  all but one of a replica's);
- a fixed reserve of ``k`` of each replica's ``SEQS`` slots (``tenants.reserve``
  ``k / SEQS``), 1 to all but one;
- ``reserve_pace``: the batch requests not yet started per replica while an interactive
  one arrived within ``reserve_window_s``. It is the balancer's cap on batch prefill
  work queued at a replica, in whole prompts (a balancer cannot split a prompt): 0 is no
  batch request at all then (the far end: batch admitted only while no interactive
  request arrived within the window);
- with ``reserve_pace`` 0, ``reserve_window_s``: how long after an interactive arrival
  no batch request is released;
- ``reserve_stagger`` (the path the engine bound leaves open): batch requests released
  one at a time over the replicas while an interactive one arrived within
  ``reserve_window_s``, and interactive requests sent to a replica with no batch request
  pending its start; alone (``reserve: {}``), with the default reserve and with a larger
  ``reserve_headroom``.

The bounds: no batch at all (the no-flood run); and what the engine model alone implies
for a balancer that does not preempt and chooses the replica without knowing the
engine's step in progress (:func:`engine_bound`).

``--live-only --live-points A,B`` runs those settings on a live balancer (the tenancy
page's live arm: ``skymesh_lab.bench.tenancy._live_arm``), each seed's first come first
served and no flood beside them, into the ``--json`` file's ``live`` rows (the
simulator's rows stay).

    python -m skymesh_lab.bench.tenancy_frontier --json out.json [--seeds 0-19]
    python -m skymesh_lab.bench.tenancy_frontier --json out.json --live-only \
        --live-points pace_0_window_3 --live-seeds 0,1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skymesh.balancer.tenancy import Reserve
from skymesh_lab.bench.tenancy import (
    FLOOD,
    LIVE_FLOOD,
    RATE,
    RESERVE,
    RESERVE_WINDOW_S,
    SEQS,
    STEADY,
    _flood_sim,
    _live_arm,
    _live_setup,
    _tenant_of_id,
    _tenants,
    flood_figures,
    merge_live,
)
from skymesh_lab.sim.runner import Simulation
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile

BATCH_PROMPT, BATCH_OUTPUT = 400, 200  # the flood's requests (tenancy.flood_run)
INTERACTIVE_TOKENS = 250  # 200 prompt + 50 output
GOAL_X = 1.2  # the interactive TTFT p50 and p99 within 20% of the no-flood one
# The batch goal: the idle capacity (the run's batch tokens over all its tokens) within
# a point, as the tenancy page judges it.
BATCH_GOAL_SLACK = 0.01
# The share of first come first served's batch prefills while the interactive tenant
# sends, at which the engine bound is given.
BOUND_SHARES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# reserve_stagger on the default reserve with these reserve_headroom (1.5: the default).
STAGGER_HEADROOMS = (1.5, 2.0, 3.0)


@dataclass(frozen=True)
class Point:
    """One setting: its name in the JSON, the knob it moves and its value there."""

    name: str
    knob: str
    value: float | None
    reserve: Reserve | None  # None: no reserve (the fair queue alone, or FCFS)
    window_s: float = RESERVE_WINDOW_S
    arm: str = "frontier"  # tenancy._sim's arm: "fcfs", "fair" or with ``reserve``


def _paced(pace: int | None) -> Reserve:
    return replace(RESERVE, pace=pace if pace is not None else 1 << 30)


def points() -> list[Point]:
    """Every setting, from first come first served to no batch while the interactive
    tenant sends."""
    out = [Point("fcfs", "order", None, None, arm="fcfs"),
           Point("fair", "order", None, None, arm="fair")]
    out += [Point(f"headroom_{h:g}", "reserve_headroom", h, replace(RESERVE, headroom=h))
            for h in (0.25, 0.5, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0)]
    out += [Point(f"fixed_{k}", "fixed slots per replica", k,
                  replace(RESERVE, fractions={"batch": k / SEQS}, adaptive=frozenset()))
            for k in (1, 2, 4, 8, 12, SEQS - 1)]
    out += [Point(f"pace_{p if p is not None else 'none'}", "reserve_pace", p, _paced(p))
            for p in (None, 4, 2, 1, 0)]
    out += [Point(f"pace_0_window_{w:g}", "reserve_pace 0, reserve_window_s", w,
                  replace(RESERVE, pace=0, pace_s=w), window_s=w)
            for w in (0.5, 1.0, 2.0, 3.0, 5.0, 20.0)]
    # The stagger: alone (no slot reserve, so pacing has nothing to pace), and on the
    # default reserve with its reserve_headroom (the value; None: alone).
    out.append(Point("stagger", "reserve_stagger", None,
                     replace(RESERVE, adaptive=frozenset(), stagger=True)))
    out += [Point(f"stagger_headroom_{h:g}", "reserve_stagger", h,
                  replace(RESERVE, headroom=h, stagger=True)) for h in STAGGER_HEADROOMS]
    return out


def tenants_of(p: Point) -> dict[str, Any]:
    """The ``tenants:`` section of ``lb.yaml`` that is setting ``p`` (the tenancy page's
    live arms' tenants and classes, the default reserve with ``p``'s knob moved)."""
    out = _tenants("fair_reserve")
    if p.arm == "fair":
        return {**out, "reserve": {}}
    r = p.reserve
    if r is None:
        raise ValueError(f"{p.name}: no reserve to configure")
    if not r.adaptive:
        fixed = r.fractions.get("batch")
        out["reserve"] = {"batch": fixed} if fixed else {}
    if r.stagger:
        out["reserve_stagger"] = True
    if r.headroom != RESERVE.headroom:
        out["reserve_headroom"] = r.headroom
    if r.pace != RESERVE.pace:
        out["reserve_pace"] = min(r.pace, 1 << 20)
    if p.window_s != RESERVE_WINDOW_S:
        out["reserve_window_s"] = p.window_s
    return out


async def live(seeds: list[int], names: list[str]) -> list[dict[str, Any]]:
    """Each seed: no flood, first come first served and the settings ``names``, one
    after another on a live balancer."""
    by_name = {p.name: p for p in points()}
    rows = []
    with tempfile.TemporaryDirectory(prefix="tenancy-frontier-") as d:
        for seed in seeds:
            for name in ["no_flood", "fcfs", *names]:
                p = by_name.get(name)
                tenants = tenants_of(p) if p is not None and p.arm != "fcfs" else None
                row = await _live_arm(Path(d), name, seed, tenants)
                rows.append({**row, "knob": p.knob if p else "bound",
                             "value": p.value if p else None})
    return rows


def _run(seed: int, p: Point) -> tuple[Simulation, dict[str, Any]]:
    sim, queue, last = _flood_sim(seed, p.arm, RATE, reserve=p.reserve, window_s=p.window_s)
    row = flood_figures(sim, queue, last, seed, p.arm)
    row.update(arm=p.name, knob=p.knob, value=p.value)
    return sim, row


def _ttfts(sim: Simulation) -> list[float]:
    return [r.t_first - r.t_arrival for r in sim.records if _tenant_of_id(r) == "web" and r.ok]


def batch_prefill_step_s(profile_name: str = DEFAULT_PROFILE) -> float:
    """The shortest engine step that holds one of the flood's batch prefills: the prompt
    alone (no decodes beside it), whole in one step (it fits the step's token budget)."""
    prof = get_profile(profile_name)
    return prof.step_time(BATCH_PROMPT, BATCH_PROMPT * BATCH_PROMPT / 2, 0, 0)


def max_cdf(base: list[float], f: float, step_s: float, x: float) -> float:
    """P(the slowest of ``base`` TTFTs, each delayed with probability ``f`` by a uniform
    share of ``step_s``, is at most ``x``)."""
    p = 1.0
    for b in base:
        late = min(1.0, max(0.0, (x - b) / step_s)) if step_s > 0 else float(x >= b)
        p *= (1.0 - f) * (b <= x) + f * late
    return p


def max_median(base: list[float], f: float, step_s: float) -> float:
    """The median of that slowest TTFT (bisection on :func:`max_cdf`)."""
    lo, hi = max(base), max(base) + step_s
    for _ in range(50):
        mid = (lo + hi) / 2
        if max_cdf(base, f, step_s, mid) >= 0.5:
            hi = mid
        else:
            lo = mid
    return hi


def engine_bound(base: list[float], no_flood_p99: float, batch_rate_fcfs: float,
                 fcfs_end_s: float, last_s: float, step_s: float,
                 share: float) -> dict[str, float]:
    """What the engine model alone implies for the interactive p99 when the batch tenant
    gets ``share`` of first come first served's batch prefills while the interactive
    tenant sends (``batch_rate_fcfs`` per second per replica over its run, which ends at
    ``fcfs_end_s``; the interactive tenant's last arrival ``last_s``).

    A step runs to its end (vLLM V1 does not preempt by priority), and each batch prefill
    occupies at least ``step_s`` of a step. So a replica spends at least
    ``f = share x batch_rate_fcfs x step_s`` of its time in steps that prefill a batch
    prompt. A balancer that does not know where the engine's step is (when it releases or
    routes a request) and Poisson interactive arrivals: each interactive request arrives
    during such a step with probability ``f`` (PASTA), and then waits for its remainder,
    uniform over ``step_s``. Each interactive request's TTFT is at least what it is with
    no flood (``base``: the same arrivals served alone) plus that wait; the seed's p99 is
    its slowest (60 requests). Nothing else the flood costs (longer steps of fuller
    replicas, sharing its own step with a batch prefill) is counted: a lower bound.

    The batch tenant's throughput to its last at best, given that share: it loses
    ``(1 - share) x last_s`` of first come first served's work while the interactive
    tenant sends and makes it up at first come first served's rate after."""
    f = min(1.0, share * batch_rate_fcfs * step_s)
    med = max_median(base, f, step_s)
    return {"share": share, "in_batch_prefill": f,
            "ttft_p99_s": med, "ttft_p99_x": med / no_flood_p99,
            "ttft_p99_x_alone": med / max(base),
            "p99_within_goal_chance": max_cdf(base, f, step_s, GOAL_X * no_flood_p99),
            "batch_vs_fcfs_at_best": fcfs_end_s / (fcfs_end_s + (1 - share) * last_s)}


def batch_goal(flood: int = FLOOD, steady: int = STEADY) -> float:
    """The batch goal as the tenancy page has it: the idle capacity (the batch tenant's
    share of the run's tokens) within a point."""
    b = flood * (BATCH_PROMPT + BATCH_OUTPUT)
    return b / (b + steady * INTERACTIVE_TOKENS) - BATCH_GOAL_SLACK


def share_needed(goal: float, fcfs_end_s: float, last_s: float) -> float:
    """The least share of first come first served's batch prefills while the interactive
    tenant sends that can still give the batch tenant ``goal`` of its throughput to its
    last (:func:`engine_bound`'s at best)."""
    return max(0.0, 1.0 - (fcfs_end_s / goal - fcfs_end_s) / last_s)


def bound_run(seed: int, fcfs: dict[str, Any], no_flood: dict[str, Any],
              step_s: float) -> dict[str, Any]:
    """The engine bound for one seed: the flood's interactive arrivals served alone (the
    same draw, the batch requests left out) are the base."""
    alone, _, last = _flood_sim(seed, "fcfs", RATE, alone=True)
    base = _ttfts(alone)
    end = fcfs["batch_last_done_s"]
    rate = FLOOD / end / 2  # batch prefills per second per replica, FCFS
    goal = batch_goal()
    needed = share_needed(goal, end, last)
    args = (base, no_flood["ttft_p99_s"], rate, end, last, step_s)
    return {"seed": seed, "batch_prefill_step_s": step_s, "batch_rate_fcfs": rate,
            "fcfs_end_s": end, "interactive_last_arrival_s": last,
            "alone_p99_s": max(base), "no_flood_p99_s": no_flood["ttft_p99_s"],
            "batch_goal": goal, "share_needed": needed,
            "at_share_needed": engine_bound(*args, needed),
            "by_share": [engine_bound(*args, s) for s in BOUND_SHARES]}


def run(seeds: list[int], progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    t0 = time.monotonic()
    step_s = batch_prefill_step_s()
    rows: list[dict[str, Any]] = []
    bounds: list[dict[str, Any]] = []
    for seed in seeds:
        _, no_flood = _run(seed, Point("no_flood", "bound", None, None, arm="no_flood"))
        rows.append(no_flood)
        fcfs: dict[str, Any] = {}
        for p in points():
            _, row = _run(seed, p)
            rows.append(row)
            if p.name == "fcfs":
                fcfs = row
        bounds.append(bound_run(seed, fcfs, no_flood, step_s))
        if progress:
            progress(f"seed {seed} done at {time.monotonic() - t0:.0f} s")
    return {"setup": {"seeds": seeds, "profile": DEFAULT_PROFILE, "replicas": 2,
                      "max_num_seqs": SEQS, "flood": FLOOD, "steady": STEADY,
                      "steady_rate_per_s": RATE, "batch_request_tokens":
                      BATCH_PROMPT + BATCH_OUTPUT,
                      "interactive_request_tokens": INTERACTIVE_TOKENS,
                      "goal_x": GOAL_X, "batch_goal": batch_goal(),
                      "live_batch_goal": batch_goal(LIVE_FLOOD),
                      "reserve_headroom": RESERVE.headroom, "reserve_pace": RESERVE.pace,
                      "reserve_idle_s": RESERVE.idle_s, "reserve_window_s": RESERVE_WINDOW_S,
                      "bound_shares": list(BOUND_SHARES)},
            "points": [{"name": p.name, "knob": p.knob, "value": p.value}
                       for p in points()],
            "flood": rows, "bound": bounds,
            "wall_seconds": round(time.monotonic() - t0, 1),
            "date": datetime.now(UTC).strftime("%Y-%m-%d")}


def _seeds(text: str) -> list[int]:
    if "-" in text and "," not in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--seeds", default="0-19", help="0-19, or a list: 0,1,2")
    ap.add_argument("--live-only", action="store_true",
                    help="run --live-points on a live balancer into the existing --json")
    ap.add_argument("--live-points", default="", help="the settings to run live (names)")
    ap.add_argument("--live-seeds", default="0,1")
    args = ap.parse_args(argv)
    if args.live_only:
        names = [n for n in args.live_points.split(",") if n]
        if unknown := set(names) - {p.name for p in points()}:
            ap.error(f"--live-points: no setting {', '.join(sorted(unknown))}")
        prior: dict[str, Any] = json.loads(args.json.read_text())
        seeds = _seeds(args.live_seeds)
        t0 = time.monotonic()
        new = asyncio.run(live(seeds, names))
        # The other settings' rows stay, each paired on the page with its own run's
        # baselines (merge_live tags the runs).
        prior["live"] = merge_live(prior.get("live", []), new)
        prior["setup"].update(_live_setup(seeds))
        walls = prior.get("live_wall_seconds_by_run") or (
            {"0": prior["live_wall_seconds"]} if prior.get("live_wall_seconds") else {})
        walls[str(max(r.get("run", 0) for r in prior["live"]))] = \
            round(time.monotonic() - t0, 1)
        prior["live_wall_seconds_by_run"] = walls
        args.json.write_text(json.dumps(prior, indent=2) + "\n")
        return 0
    doc = run(_seeds(args.seeds), progress=lambda m: print(m, flush=True))
    if args.json.exists():
        # The simulator alone: the file's live rows stay (with their setup), as a live
        # run takes far longer than the simulator's.
        prior = json.loads(args.json.read_text())
        if prior.get("live"):
            doc["live"] = prior["live"]
            doc["live_wall_seconds"] = prior.get("live_wall_seconds")
            if prior.get("live_wall_seconds_by_run"):
                doc["live_wall_seconds_by_run"] = prior["live_wall_seconds_by_run"]
            doc["setup"].update({k: v for k, v in prior.get("setup", {}).items()
                                 if k.startswith("live_") and k != "live_batch_goal"})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
