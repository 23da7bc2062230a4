"""Where a strategy misses the TTFT SLO in the capacity week, against reactive.

``python -m skymesh_lab.planning.week_diagnose [--days 7] [--seed 0] [--forecaster NAME]
[--week-param KEY=VALUE ...] [--strategies reactive,lt-ua] [--json out/diag.json]``

Runs the week once per strategy with a :class:`~skymesh_lab.planning.capacity_week.WeekTrace`
and splits each strategy's missed requests (in points of all its interactive requests)
by local hour of day, minute of the hour, model, region, the endpoint's state in the step
(saturated, capped at the ILP target, waiting for a cold start, ...) and its busy
fraction ``rho``; it also gives the misses batch work causes (the same step with batch's
share of ``rho`` removed), the forecast's error where the misses fall, and the attainment
a clairvoyant allocator reaches on the same GPU-hours (:func:`fluid_bound`).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from skymesh.util.jsonio import write_json
from skymesh_controller.planning.strategies import SCALE_OUT_UTILISATION
from skymesh_lab.planning.capacity_week import (
    MODELS,
    REGIONS,
    RTT_S,
    SLO_QUANTILE,
    WINDOW_S,
    Demand,
    WeekConfig,
    WeekTrace,
    attainment,
    build_demand,
    fluid_model,
    parse_week_params,
    plan_theta,
    run_strategy,
)

# Re-exported: parity_budget moved to capacity_week (which needs it) from here.
from skymesh_lab.planning.capacity_week import parity_budget as parity_budget

# Endpoint states, first match wins (see ``classify``).
STATES = (
    "saturated",  # backlog: the pool served less than arrived (rho ~ 1 or a queue wait)
    "over 70%, at ILP target",  # over the scale-out threshold, capped by the plan
    "over 70%, cold start",  # over the threshold with instances on their way
    "over 70%, other",  # over the threshold, free to scale (cooldown, first step)
    "under 70%",  # the latency tail at moderate load: prompt lengths, not capacity
)
RHO_BINS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.999, 1.01)
MINUTE_BINS = tuple(range(0, 61, 10))
RATIO_BINS = (0.0, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, np.inf)


def classify(row: dict[str, np.ndarray]) -> np.ndarray:
    """Per step, the index into ``STATES`` of the endpoint's state."""
    saturated = (row["rho"] >= 0.999) | (row["wait_s"] - row["forwarded"] * RTT_S > 1e-9)
    over = row["utilisation"] > SCALE_OUT_UTILISATION
    total = row["ready"] + row["starting"]
    capped = over & (row["target"] >= 0) & (total >= row["target"])
    cold = over & (row["starting"] > 0)
    out = np.full(len(row["rho"]), 4)
    for idx, mask in ((3, over), (2, cold), (1, capped), (0, saturated)):
        out[mask] = idx
    return out


def _labels(bins: Sequence[float], fmt: str) -> list[str]:
    return [f"{a:{fmt}}-{b:{fmt}}" for a, b in itertools.pairwise(bins)]


def _share(missed: np.ndarray, keys: np.ndarray, labels: Sequence[Any],
           total: float) -> dict[str, float]:
    """Missed requests per key, in percentage points of all requests."""
    return {str(lab): float(missed[keys == i].sum()) / total * 100
            for i, lab in enumerate(labels)}


def diagnose(trace: WeekTrace, slo_s: dict[str, float], t0_s: dict[str, float],
             theta: dict[str, float]) -> dict[str, Any]:
    """The split of one run's misses (see the module docstring)."""
    reqs, missed, nobatch_missed = [], [], []
    hour, minute, model, region, state, rho_bin, ratio_bin, over_plan = ([] for _ in range(8))
    for (m, r), row in trace.data.items():
        n = len(row["requests"])
        t = (np.arange(n) + 0.5) * trace.step_s
        w = row["requests"]
        miss = w * (1 - row["attainment"])
        # Batch interference: the same step with batch work's share of rho taken out.
        rho_i = np.clip(row["rho"] - row["batch_rho"], 0.0, 0.999)
        scale_i = np.where(row["rho"] >= 0.999, np.inf, t0_s[m] / (1 - rho_i))
        nb = w * (1 - attainment(slo_s[m], row["wait_s"], scale_i))
        reqs.append(w)
        missed.append(miss)
        nobatch_missed.append(np.minimum(nb, miss))
        hour.append(((t / 3600 + REGIONS[r][0]) % 24).astype(int))
        minute.append(np.digitize(t % 3600 / 60, MINUTE_BINS) - 1)
        model.append(np.full(n, list(MODELS).index(m)))
        region.append(np.full(n, list(REGIONS).index(r)))
        st = classify(row)
        state.append(st)
        rho_bin.append(np.digitize(row["rho"], RHO_BINS) - 1)
        ratio = np.divide(row["load_tps"], row["forecast_tps"],
                          out=np.full(n, np.inf), where=row["forecast_tps"] > 0)
        ratio_bin.append(np.digitize(ratio, RATIO_BINS) - 1)
        # Load over what the plan's target serves at the SLO utilisation.
        plan_cap = row["target"] * theta[m]
        over_plan.append((row["target"] >= 0) & (row["load_tps"] > plan_cap))
    w_all = np.concatenate(reqs)
    miss_all = np.concatenate(missed)
    total = float(w_all.sum())
    cat = {k: np.concatenate(v) for k, v in (
        ("hour", hour), ("minute", minute), ("model", model), ("region", region),
        ("state", state), ("rho", rho_bin), ("ratio", ratio_bin))}
    state_requests = {s: float(w_all[cat["state"] == i].sum()) / total * 100
                      for i, s in enumerate(STATES)}
    over = np.concatenate(over_plan)
    return {
        "slo_attainment": 1 - float(miss_all.sum()) / total,
        "missed_points": float(miss_all.sum()) / total * 100,
        "missed_points_without_batch_slowdown": float(np.concatenate(nobatch_missed).sum())
        / total * 100,
        "by_local_hour": _share(miss_all, cat["hour"], range(24), total),
        "by_minute_of_hour": _share(miss_all, cat["minute"],
                                    _labels(MINUTE_BINS, "02d"), total),
        "by_model": _share(miss_all, cat["model"], list(MODELS), total),
        "by_region": _share(miss_all, cat["region"], list(REGIONS), total),
        "by_state": _share(miss_all, cat["state"], STATES, total),
        "requests_by_state": state_requests,
        "by_rho": _share(miss_all, cat["rho"],
                         _labels(RHO_BINS, ".2f"), total),
        "requests_by_rho": _share(w_all, cat["rho"],
                                  _labels(RHO_BINS, ".2f"), total),
        "by_load_over_forecast": _share(miss_all, cat["ratio"],
                                        _labels(RATIO_BINS, "g"),
                                        total),
        "missed_points_load_over_plan": float(miss_all[over].sum()) / total * 100,
        "requests_load_over_plan": float(w_all[over].sum()) / total * 100,
    }


def fluid_bound(cfg: WeekConfig, demand: Demand, budget_gpu_hours: float,
                per_model: bool = True) -> dict[str, Any]:
    """The best interactive SLO attainment any strategy can reach in this latency model
    on ``budget_gpu_hours``: clairvoyant, fractional instances, no cold starts, no
    backlog, and batch work on capacity of its own run full (so it slows no interactive
    request). A step's attainment depends only on its busy fraction ``rho = load /
    capacity``, and the gain of capacity, ``rho^2 |a'(rho)|``, grows with ``rho``, so the
    optimum holds one ``rho`` per model all week; this finds those three. With
    ``per_model=False`` every model runs at the same ``rho`` (so each gets about the same
    attainment, as reactive's models do) and the bound is lower."""
    from scipy.optimize import brentq

    f = fluid_model(cfg, demand)
    models = list(MODELS)
    interactive_budget = budget_gpu_hours - f.batch_gpu_hours

    def gain(m: str, rho: float, h: float = 1e-5) -> float:
        # Requests that meet the SLO per extra GPU-hour: capacity = unit / rho, so
        # d(weight * a(rho)) / d(unit / rho) = weight * rho^2 |a'(rho)| / unit.
        return (f.weight[m] * rho * rho * (f.att(m, rho - h) - f.att(m, rho + h)) / (2 * h)
                / f.unit[m])

    def rhos_for(lam: float) -> dict[str, float]:
        out = {}
        for m in models:
            lo, hi = 0.02, 0.99
            if gain(m, lo) >= lam:
                out[m] = lo
            elif gain(m, hi) <= lam:
                out[m] = hi
            else:
                out[m] = brentq(lambda r, m=m: gain(m, r) - lam, lo, hi)
        return out

    def spend(lam: float) -> float:
        return sum(f.unit[m] / rho for m, rho in rhos_for(lam).items())

    if interactive_budget <= sum(f.unit.values()):
        raise ValueError("budget below what the load needs at 100% utilisation")
    if per_model:
        lo_l, hi_l = 1e-15, 1.0
        while spend(hi_l) > interactive_budget:
            hi_l *= 10
        lam = brentq(lambda x: spend(x) - interactive_budget, lo_l, hi_l, xtol=1e-14)
        rhos = rhos_for(lam)
    else:
        one = sum(f.unit.values()) / interactive_budget
        rhos = dict.fromkeys(models, one)
    total = sum(f.weight.values())
    return {"budget_gpu_hours": budget_gpu_hours, "batch_gpu_hours": f.batch_gpu_hours,
            "rho": rhos,
            "slo_attainment": sum(f.weight[m] * f.att(m, rhos[m]) for m in models) / total}


def oracle_forecast(demand: Demand) -> None:
    """Replace every forecast by the realised window means (a perfect window forecast),
    to separate forecast error from what happens inside a window."""
    per_window = round(WINDOW_S / demand.step_s)
    for key, fc in demand.forecast.items():
        series = demand.tps[key]
        windows = fc.shape[0]
        padded = np.resize(series, windows * per_window)  # the last window may be short
        means = padded.reshape(windows, per_window).mean(axis=1)
        ahead = np.concatenate([means, np.full(fc.shape[1], means[-1])])
        for h in range(fc.shape[1]):
            fc[:, h] = ahead[h:h + windows]


def run(cfg: WeekConfig, progress: Callable[[str], None] | None = None,
        oracle: bool = False) -> dict[str, Any]:
    demand = build_demand(cfg)
    if oracle:
        oracle_forecast(demand)
    slo_s = {m: cfg.slo_factor * c.prompt_len / c.mu_p for m, c in demand.caps.items()}
    t0_s = {m: c.prompt_len / c.mu_p for m, c in demand.caps.items()}
    out: dict[str, Any] = {"strategies": {}, "slo_quantile": SLO_QUANTILE}
    for name in cfg.strategies:
        trace = WeekTrace()
        res = run_strategy(name, cfg, demand, trace)
        diag = diagnose(trace, slo_s, t0_s,
                        plan_theta(cfg, demand) if name != 'reactive' else demand.theta)
        diag["gpu_hours"] = res["gpu_hours"]
        # What a clairvoyant allocator would attain on the same GPU-hours.
        diag["fluid_bound_slo"] = fluid_bound(cfg, demand, res["gpu_hours"])["slo_attainment"]
        diag["fluid_bound_slo_one_rho"] = fluid_bound(
            cfg, demand, res["gpu_hours"], per_model=False)["slo_attainment"]
        out["strategies"][name] = diag
        if progress:
            progress(name)
    return out


def _print(res: dict[str, Any]) -> None:
    names = list(res["strategies"])
    rows = res["strategies"]
    print("missed requests, points of all requests: " + " | ".join(names))
    for key in ("missed_points", "missed_points_without_batch_slowdown",
                "missed_points_load_over_plan", "requests_load_over_plan", "gpu_hours"):
        print(f"  {key:<40} " + " ".join(f"{rows[n][key]:10.2f}" for n in names))
    for key in ("fluid_bound_slo", "fluid_bound_slo_one_rho"):
        print(f"  {key + ' (%)':<40} " + " ".join(f"{rows[n][key] * 100:10.2f}" for n in names))
    for section in ("by_state", "requests_by_state", "by_rho", "requests_by_rho",
                    "by_minute_of_hour", "by_model", "by_region", "by_load_over_forecast",
                    "by_local_hour"):
        print(f"{section}:")
        for lab in rows[names[0]][section]:
            print(f"  {lab:<40} " + " ".join(f"{rows[n][section][lab]:10.3f}" for n in names))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.planning.week_diagnose",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forecaster", default="seasonal-naive")
    ap.add_argument("--strategies", default="reactive,lt-ua")
    ap.add_argument("--week-param", action="append", default=[])
    ap.add_argument("--oracle-forecast", action="store_true",
                    help="plan from the realised window means instead of the forecast")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        params = parse_week_params(args.week_param)
        params["strategies"] = tuple(s for s in args.strategies.split(",") if s)
        cfg = WeekConfig(days=args.days, seed=args.seed, forecaster=args.forecaster,
                         **params)
    except ValueError as exc:
        print(f"week_diagnose: {exc}", file=sys.stderr)
        return 2
    res = run(cfg, oracle=args.oracle_forecast)
    _print(res)
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
