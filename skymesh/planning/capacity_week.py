"""``skymesh sim --experiment capacity-week``: a week of three regions under each scaling
strategy (SageServe sec. 7.3: reactive, LT-I, LT-U, LT-UA; plus PreServe's scaler).

Demand. Three models, one per ServeGen language trace (Alibaba Bailian, 14 days of request
rates at 10-minute windows: shared/data/servegen/aggregate_language_m-*_10min.csv), each
served by one engine profile: m-large by Llama-3.1-70B on 4 x H100, m-mid by Llama-3.1-8B
on one H100, m-small by Llama-3.1-8B on one L4. Each region sees the trace's daily shape
at its own local time (us UTC-5, eu UTC+1, asia UTC+8; the trace's t = 0 is local
midnight) with a share of the model's traffic (45 / 35 / 20%); zero windows (collection
gaps, per the manifest) take the value one day away. Levels are set so the busiest step
of the week needs ``peak_instances`` instances of the model. Inside a window the rate is
interpolated and multiplied by seeded log-normal noise, correlated over about two minutes.
The first week trains the forecasters; the simulated week is the second.

Capacity. Per-instance tokens/s come from running the engine saturated
(:mod:`skymesh.planning.capacity`) with the Azure 2023 conversation mix (1,155 prompt,
211 output tokens per request).

Latency model (fluid, not discrete-event: a week of 9 endpoints x 5 strategies at
request level would take hours; the engine is used once, to profile capacity). Each
endpoint is a pool of ``ready`` instances with capacity ``C = ready * mu_t``. Tokens
arriving beyond what the pool serves in a step wait in a backlog, adding ``backlog / C``
to every TTFT. A request with ``P`` prompt tokens at utilisation ``rho`` waits
``w + (P / P_mean) * t0 / (1 - rho)`` for its first token: ``t0`` is the prefill time of
a mean prompt on an idle instance, ``1 / (1 - rho)`` the processor-sharing slowdown of a
batch that is busy a fraction ``rho`` of the time, and ``P / P_mean`` log-normal with the
trace's spread (sigma 0.985). The TTFT SLO is ``slo_factor`` x t0 (default 10), so the
fraction of requests meeting it is a closed-form normal CDF per step, weighted by the
step's requests. The planner's per-instance capacity ``theta = rho* x mu_t`` uses the
utilisation ``rho*`` at which 95% of requests meet the SLO. Effective memory utilisation,
the signal the strategies act on, is ``min(1, (arrivals + backlog) / (C dt))``: at
saturation the KV cache is what fills (the profiling runs are KV- or sequence-bound).

A region whose load exceeds 70% of its capacity spills the excess to the regions of the
same model with headroom (SageServe's global router); spilled requests pay an 80 ms round
trip. New instances serve after a cold start (default 3 min for 8B, 8 min for 70B: model
load; SageServe quotes 1-5 min to reclaim spot and 10 min to redeploy) and are paid for
meanwhile: that is the scaling overhead. Stopped instances are donated to spot at once.
"""

from __future__ import annotations

import csv
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import norm

from skymesh.engine.profiles import get_profile
from skymesh.planning.capacity import (
    DEFAULT_OUTPUT_LEN,
    DEFAULT_PROMPT_LEN,
    Capacity,
    instances_needed,
    profile_capacity,
)
from skymesh.planning.ilp import PlanInfeasible, PlanInput, solve
from skymesh.planning.strategies import STRATEGIES, Observation, Strategy, make_strategy
from skymesh.sim.workloads.data import data_file

WINDOW_S = 600
WINDOWS_PER_DAY = 144
DAY_S = 86_400
REGIONS: dict[str, tuple[float, float]] = {  # name -> (UTC offset hours, traffic share)
    "us": (-5.0, 0.45), "eu": (1.0, 0.35), "asia": (8.0, 0.20)}
MODELS: dict[str, tuple[str, float]] = {  # ServeGen trace -> (engine profile, cold start s)
    "m-large": ("llama3.1-70b-4xh100", 480.0),
    "m-mid": ("llama3.1-8b-h100", 180.0),
    "m-small": ("llama3.1-8b-l4", 180.0),
}
GPU_PRICE = {"L4": 0.8, "H100-80GB": 9.8}  # $/GPU-hour, rough on-demand ratios
PROMPT_SIGMA = 0.985  # log-normal spread of prompt lengths, Azure 2023 conversation trace
RTT_S = 0.08
SLO_QUANTILE = 0.95
CONTRACT_STRATEGIES = ("reactive", "lt-i", "lt-u", "lt-ua", "preserve")


@dataclass(frozen=True)
class WeekConfig:
    days: float = 7.0
    step_s: float = 15.0
    seed: int = 0
    forecaster: str = "seasonal-naive"
    peak_instances: int = 20  # instances the model needs at its busiest step, all regions
    slo_factor: float = 10.0
    epsilon: float = 0.8
    # Forecast buffer for the planners (SageServe adds beta = 10% of the last hour's batch
    # load; with no batch load here, 10% of the forecast guards against its error).
    headroom: float = 0.10
    noise_sigma: float = 0.12
    bursts: int = 0  # 8x bursts of 10 minutes at random times (SageServe fig. 16)
    strategies: tuple[str, ...] = CONTRACT_STRATEGIES
    pool_per_endpoint: int = 40  # instances an endpoint may hold (the rest go to spot)
    cold_start_s: dict[str, float] = field(default_factory=dict)  # override per model

    def __post_init__(self) -> None:
        if not 0 < self.days <= 7:
            raise ValueError("days must be in (0, 7]")
        if not 1 <= self.step_s <= 60:
            raise ValueError("step_s must be between 1 and 60 seconds")
        if self.peak_instances < 1:
            raise ValueError("peak_instances must be at least 1")
        for s in self.strategies:
            if s not in STRATEGIES:
                raise ValueError(f"unknown strategy {s!r}; known: {', '.join(STRATEGIES)}")


# -- demand -------------------------------------------------------------------------------

def load_shape(model: str) -> np.ndarray:
    """The model's 14-day request rate at 10-minute windows, gaps filled, peak 1."""
    path = data_file("servegen", f"aggregate_language_{model}_10min.csv")
    with path.open() as fh:
        rate = np.array([float(r["total_rate_rps"]) for r in csv.DictReader(fh)])
    filled = rate.copy()
    for i in np.flatnonzero(rate <= 0):
        for j in (i - WINDOWS_PER_DAY, i + WINDOWS_PER_DAY, i - 2 * WINDOWS_PER_DAY,
                  i + 2 * WINDOWS_PER_DAY):
            if 0 <= j < len(rate) and rate[j] > 0:
                filled[i] = rate[j]
                break
    return filled / filled.max()


def region_windows(shape: np.ndarray, utc_offset_h: float) -> np.ndarray:
    """The shape as seen in UTC by a region at ``utc_offset_h`` (local = UTC + offset)."""
    shift = round(utc_offset_h * 3600 / WINDOW_S)
    return np.roll(shape, -shift)


def step_series(windows: np.ndarray, start_window: int, steps: int, step_s: float,
                rng: np.random.Generator, noise_sigma: float) -> np.ndarray:
    """Per-step rate: window values interpolated between window centres, times AR(1)
    log-normal noise with a correlation time of about two minutes."""
    t = start_window * WINDOW_S + (np.arange(steps) + 0.5) * step_s
    centres = (np.arange(len(windows)) + 0.5) * WINDOW_S
    base = np.interp(t, centres, windows)
    phi = math.exp(-step_s / 120.0)
    eps = rng.normal(0.0, noise_sigma * math.sqrt(1 - phi * phi), steps)
    z = np.empty(steps)
    z[0] = rng.normal(0.0, noise_sigma)
    for i in range(1, steps):
        z[i] = phi * z[i - 1] + eps[i]
    return base * np.exp(z - noise_sigma ** 2 / 2)


# -- latency model ------------------------------------------------------------------------

_MU = -PROMPT_SIGMA ** 2 / 2  # log-mean of P / P_mean so that its mean is 1


def slo_utilisation(slo_factor: float, quantile: float = SLO_QUANTILE) -> float:
    """The utilisation at which ``quantile`` of requests still meet TTFT <= slo x t0."""
    q = math.exp(_MU + norm.ppf(quantile) * PROMPT_SIGMA)
    return max(0.05, 1.0 - q / slo_factor)


def attainment(slo_s: float, wait_s: np.ndarray, scale_s: np.ndarray) -> np.ndarray:
    """P(wait + X * scale <= slo) for log-normal X (mean 1), vectorised; scale inf -> 0."""
    room = slo_s - wait_s
    ok = (room > 0) & np.isfinite(scale_s)
    out = np.zeros_like(room)
    z = (np.log(np.where(ok, room, 1.0) / np.where(ok, scale_s, 1.0)) - _MU) / PROMPT_SIGMA
    out[ok] = norm.cdf(z[ok])
    return out


def mixture_quantile(q: float, weight: np.ndarray, wait_s: np.ndarray,
                     scale_s: np.ndarray) -> float:
    """The ``q`` quantile of TTFT over all steps (each a shifted log-normal)."""
    w = weight / weight.sum()
    finite = np.isfinite(scale_s)
    if w[~finite].sum() >= 1 - q:
        return math.inf
    lo, hi = 0.0, float(np.max(wait_s[finite] + 50 * scale_s[finite])) + 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if float((w * attainment(mid, wait_s, scale_s)).sum()) >= q:
            hi = mid
        else:
            lo = mid
    return hi


# -- simulation ---------------------------------------------------------------------------

@dataclass
class Endpoint:
    model: str
    region: str
    caps: Capacity
    num_gpus: int
    cold_start_s: float
    ready: int
    starting: list[float] = field(default_factory=list)  # times they become ready
    backlog: float = 0.0
    last_util: float = 0.0


@dataclass
class Tally:
    gpu_hours: float = 0.0
    instance_hours: float = 0.0
    starting_gpu_hours: float = 0.0  # paid for, not serving: the scaling overhead
    donated_instance_hours: float = 0.0
    scale_out_events: int = 0
    scale_in_events: int = 0
    instances_started: int = 0
    plan_seconds: float = 0.0
    plans: int = 0
    plan_infeasible: int = 0


@dataclass
class Demand:
    step_s: float
    steps: int
    tps: dict[tuple[str, str], np.ndarray]  # actual tokens/s per step
    forecast: dict[tuple[str, str], np.ndarray]  # [window, horizon 0..6] tokens/s
    caps: dict[str, Capacity]
    theta: dict[str, float]


def build_demand(cfg: WeekConfig) -> Demand:
    from skymesh.planning.forecast.registry import make_forecaster

    rng = np.random.default_rng(cfg.seed)
    steps = round(cfg.days * DAY_S / cfg.step_s)
    sim_windows = math.ceil(steps * cfg.step_s / WINDOW_S)
    rho_star = slo_utilisation(cfg.slo_factor)
    caps = {m: profile_capacity(p, DEFAULT_PROMPT_LEN, DEFAULT_OUTPUT_LEN)
            for m, (p, _) in MODELS.items()}
    theta = {m: rho_star * c.mu_t for m, c in caps.items()}
    tps: dict[tuple[str, str], np.ndarray] = {}
    forecast: dict[tuple[str, str], np.ndarray] = {}
    start = 7 * WINDOWS_PER_DAY
    for m in MODELS:
        shape = load_shape(m)
        per_region = {r: region_windows(shape, off) * share
                      for r, (off, share) in REGIONS.items()}
        raw = {r: step_series(w, start, steps, cfg.step_s, rng, cfg.noise_sigma)
               for r, w in per_region.items()}
        level = cfg.peak_instances * theta[m] / float(np.sum(list(raw.values()), axis=0).max())
        burst_rng = random.Random(cfg.seed * 7919 + len(m))
        for r in REGIONS:
            series = raw[r] * level
            for _ in range(cfg.bursts):
                b0 = burst_rng.randrange(steps)
                series[b0:b0 + int(WINDOW_S / cfg.step_s)] *= 8.0
            tps[(m, r)] = series
            hist = per_region[r][:start] * level
            fc = make_forecaster(cfg.forecaster, WINDOWS_PER_DAY).fit(hist)
            out = np.empty((sim_windows, 7))
            for w in range(sim_windows):
                out[w] = fc.predict(7)
                lo, hi = int(w * WINDOW_S / cfg.step_s), int((w + 1) * WINDOW_S / cfg.step_s)
                fc.update(np.array([series[lo:hi].mean()]))
            forecast[(m, r)] = out
    return Demand(cfg.step_s, steps, tps, forecast, caps, theta)


def _plan_targets(cfg: WeekConfig, demand: Demand, eps: dict[tuple[str, str], Endpoint],
                  window: int, tally: Tally) -> dict[tuple[str, str], int]:
    gpu = {m: get_profile(p).gpu for m, (p, _) in MODELS.items()}
    n_gpus = {m: get_profile(p).num_gpus for m, (p, _) in MODELS.items()}
    inp = PlanInput(
        current={m: {r: {gpu[m]: e.ready + len(e.starting)} for (mm, r), e in eps.items()
                     if mm == m} for m in MODELS},
        demand={m: {r: (demand.forecast[(m, r)][window, :6] * (1 + cfg.headroom)).tolist()
                    for r in REGIONS} for m in MODELS},
        capacity={m: {gpu[m]: demand.theta[m]} for m in MODELS},
        gpus_available={r: {g: cfg.pool_per_endpoint * 4 * len(MODELS)
                            for g in set(gpu.values())} for r in REGIONS},
        epsilon=cfg.epsilon,
        vm_cost={g: GPU_PRICE[g] for g in set(gpu.values())},
        deploy_cost={m: {gpu[m]: GPU_PRICE[gpu[m]] * n_gpus[m] * _cold(cfg, m) / 3600}
                     for m in MODELS},
        gpus_per_instance={m: {gpu[m]: n_gpus[m]} for m in MODELS},
        min_per_endpoint={m: {r: 1 for r in REGIONS} for m in MODELS},
        max_per_endpoint={m: {r: cfg.pool_per_endpoint for r in REGIONS} for m in MODELS},
    )
    try:
        plan = solve(inp)
    except PlanInfeasible:
        tally.plan_infeasible += 1
        return {k: cfg.pool_per_endpoint for k in eps}
    tally.plan_seconds += plan.solve_seconds
    tally.plans += 1
    return {(m, r): plan.count(m, r) for (m, r) in eps}


def _cold(cfg: WeekConfig, model: str) -> float:
    return cfg.cold_start_s.get(model, MODELS[model][1])


def _spill(loads: dict[str, float], caps: dict[str, float]) -> tuple[dict[str, float],
                                                                      dict[str, float]]:
    """Move load above 70% of a region's capacity to regions with headroom; returns the
    load each region serves and the share of it that came from elsewhere."""
    served = dict(loads)
    moved = dict.fromkeys(loads, 0.0)
    excess = {r: max(0.0, loads[r] - 0.7 * caps[r]) for r in loads}
    room = {r: max(0.0, 0.7 * caps[r] - loads[r]) for r in loads}
    total_room = sum(room.values())
    total_excess = sum(excess.values())
    if total_excess <= 0 or total_room <= 0:
        return served, dict.fromkeys(loads, 0.0)
    shift = min(total_excess, total_room)
    for r in loads:
        served[r] -= excess[r] / total_excess * shift
        take = room[r] / total_room * shift
        served[r] += take
        moved[r] = take
    return served, {r: (moved[r] / served[r] if served[r] > 0 else 0.0) for r in loads}


def run_strategy(name: str, cfg: WeekConfig, demand: Demand) -> dict[str, Any]:
    strat: Strategy = make_strategy(name)
    dt = demand.step_s
    slo = {m: cfg.slo_factor * demand.caps[m].prompt_len / demand.caps[m].mu_p
           for m in MODELS}
    t0 = {m: demand.caps[m].prompt_len / demand.caps[m].mu_p for m in MODELS}
    eps: dict[tuple[str, str], Endpoint] = {}
    for m, (p, _) in MODELS.items():
        prof = get_profile(p)
        for r in REGIONS:
            first = demand.forecast[(m, r)][0, :6].max()
            eps[(m, r)] = Endpoint(m, r, demand.caps[m], prof.num_gpus, _cold(cfg, m),
                                   ready=max(1, math.ceil(first / demand.theta[m])))
    tally = Tally()
    targets: dict[tuple[str, str], int] = {}
    n = demand.steps
    weights = {m: np.zeros(n * len(REGIONS)) for m in MODELS}
    waits = {m: np.zeros(n * len(REGIONS)) for m in MODELS}
    scales = {m: np.zeros(n * len(REGIONS)) for m in MODELS}
    mean_tokens = DEFAULT_PROMPT_LEN + DEFAULT_OUTPUT_LEN
    uses_plan = name in ("lt-i", "lt-u", "lt-ua")
    steps_per_window = WINDOW_S / dt
    for i in range(n):
        now = i * dt
        window = int(i // steps_per_window)
        if uses_plan and (i == 0 or now % 3600 < (now - dt) % 3600):
            targets = _plan_targets(cfg, demand, eps, window, tally)
        for m in MODELS:
            caps_now = {}
            for r in REGIONS:
                e = eps[(m, r)]
                caps_now[r] = e.ready * e.caps.mu_t
            loads = {r: float(demand.tps[(m, r)][i]) for r in REGIONS}
            served, forwarded = _spill(loads, caps_now)
            for j, r in enumerate(REGIONS):
                e = eps[(m, r)]
                cap = caps_now[r]
                arriving = served[r] * dt
                work = arriving + e.backlog
                if cap > 0:
                    done = min(work, cap * dt)
                    util = min(1.0, work / (cap * dt))
                    rho = min(served[r] / cap, 1.0)
                    wait = e.backlog / cap
                    scale = t0[m] / (1 - rho) if rho < 0.999 else math.inf
                else:
                    done, util, wait, scale = 0.0, 1.0, math.inf, math.inf
                e.backlog = work - done
                k = i * len(REGIONS) + j
                weights[m][k] = arriving / mean_tokens
                waits[m][k] = wait + forwarded[r] * RTT_S
                scales[m][k] = scale
                # Observe and act.
                fc = demand.forecast[(m, r)][window]
                # The load anticipator: this step's utilisation plus a minute of its
                # trend, spread over the instances already on their way.
                proj = (util + max(0.0, util - e.last_util) * (60.0 / dt)) \
                    * e.ready / max(1, e.ready + len(e.starting))
                e.last_util = util
                obs = Observation(
                    now=now, utilisation=util, load_tps=loads[r], ready=e.ready,
                    starting=len(e.starting), target=targets.get((m, r)),
                    forecast_tps=float(fc[0]),
                    needed=max(1, instances_needed(
                        float(fc[1]) * DEFAULT_PROMPT_LEN / mean_tokens,
                        float(fc[1]) * DEFAULT_OUTPUT_LEN / mean_tokens, e.caps,
                        utilisation=demand.theta[m] / e.caps.mu_t / (1 + cfg.headroom))),
                    window_start=window * WINDOW_S, projected_utilisation=min(proj, 2.0),
                    min_instances=1, max_instances=cfg.pool_per_endpoint,
                )
                act = strat.decide((m, r), obs)
                if act.delta > 0:
                    e.starting.extend([now + e.cold_start_s] * act.delta)
                    tally.scale_out_events += 1
                    tally.instances_started += act.delta
                elif act.delta < 0:
                    e.ready += act.delta
                    tally.scale_in_events += 1
                alloc = e.ready + len(e.starting)
                tally.instance_hours += alloc * dt / 3600
                tally.gpu_hours += alloc * e.num_gpus * dt / 3600
                tally.starting_gpu_hours += len(e.starting) * e.num_gpus * dt / 3600
                tally.donated_instance_hours += (cfg.pool_per_endpoint - alloc) * dt / 3600
        # Instances whose cold start ends during this step serve from the next one.
        for e in eps.values():
            if e.starting:
                due = sum(1 for s in e.starting if s <= now + dt)
                if due:
                    e.ready += due
                    e.starting = [s for s in e.starting if s > now + dt]
    per_model: dict[str, Any] = {}
    all_w, all_ok = 0.0, 0.0
    for m in MODELS:
        ok = attainment(slo[m], waits[m], scales[m])
        w = weights[m]
        all_w += float(w.sum())
        all_ok += float((w * ok).sum())
        per_model[m] = {
            "slo_attainment": float((w * ok).sum() / w.sum()),
            "ttft_slo_s": slo[m],
            # None when over 5% of requests met a saturated pool (TTFT unbounded).
            "ttft_p95_s": _finite(mixture_quantile(0.95, w, waits[m], scales[m])),
        }
    return {
        "gpu_hours": tally.gpu_hours,
        "slo_attainment": all_ok / all_w,
        "scaling_events": tally.scale_out_events + tally.scale_in_events,
        "scale_out_events": tally.scale_out_events,
        "scale_in_events": tally.scale_in_events,
        "instances_started": tally.instances_started,
        "scaling_gpu_hours": tally.starting_gpu_hours,
        "instance_hours": tally.instance_hours,
        "spot_donated_instance_hours": tally.donated_instance_hours,
        "ilp_solves": tally.plans,
        "ilp_infeasible": tally.plan_infeasible,
        "ilp_seconds_total": tally.plan_seconds,
        "per_model": per_model,
    }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def run(cfg: WeekConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    t_wall = time.perf_counter()
    demand = build_demand(cfg)
    strategies: dict[str, Any] = {}
    for name in cfg.strategies:
        t = time.perf_counter()
        strategies[name] = run_strategy(name, cfg, demand)
        strategies[name]["wall_seconds"] = time.perf_counter() - t
        if progress:
            progress(name)
    out: dict[str, Any] = {"strategies": strategies}
    base = strategies.get("reactive")
    if base:
        out["vs_reactive"] = {
            name: {
                "gpu_hours_ratio": s["gpu_hours"] / base["gpu_hours"],
                "scaling_overhead_ratio": (s["scaling_gpu_hours"] / base["scaling_gpu_hours"]
                                           if base["scaling_gpu_hours"] else None),
                "slo_attainment_delta": s["slo_attainment"] - base["slo_attainment"],
            } for name, s in strategies.items()}
    out["setup"] = {
        "days": cfg.days, "step_s": cfg.step_s, "seed": cfg.seed,
        "forecaster": cfg.forecaster, "regions": {r: {"utc_offset_h": o, "share": s}
                                                  for r, (o, s) in REGIONS.items()},
        "models": {m: {"profile": p, "cold_start_s": _cold(cfg, m),
                       "mu_p": demand.caps[m].mu_p, "mu_d": demand.caps[m].mu_d,
                       "mu_t": demand.caps[m].mu_t, "theta": demand.theta[m]}
                   for m, (p, _) in MODELS.items()},
        "slo_utilisation": slo_utilisation(cfg.slo_factor), "slo_factor": cfg.slo_factor,
        "epsilon": cfg.epsilon, "headroom": cfg.headroom, "peak_instances": cfg.peak_instances,
        "noise_sigma": cfg.noise_sigma, "bursts": cfg.bursts,
    }
    out["wall_seconds"] = time.perf_counter() - t_wall
    return out


def print_summary(res: dict[str, Any]) -> None:
    print(f"capacity-week: {res['setup']['days']:g} days, step {res['setup']['step_s']:g} s, "
          f"forecaster {res['setup']['forecaster']}")
    print(f"  {'strategy':<9} {'GPU-h':>9} {'vs reactive':>11} {'SLO met':>8} "
          f"{'events':>7} {'scaling GPU-h':>13} {'spot inst-h':>11}")
    base = res["strategies"].get("reactive", {}).get("gpu_hours")
    for name, s in res["strategies"].items():
        ratio = f"{s['gpu_hours'] / base:.3f}x" if base else "-"
        print(f"  {name:<9} {s['gpu_hours']:9.1f} {ratio:>11} "
              f"{s['slo_attainment'] * 100:7.2f}% {s['scaling_events']:7d} "
              f"{s['scaling_gpu_hours']:13.1f} {s['spot_donated_instance_hours']:11.1f}")


def run_cli(args: Any) -> int:
    """``skymesh sim --experiment capacity-week``: exit 2 with a message on bad input."""
    import sys

    from skymesh.cli import write_json

    days = args.days if getattr(args, "days", None) is not None else (
        args.duration / DAY_S if getattr(args, "duration", None) else 7.0)
    try:
        cfg = WeekConfig(days=days, seed=args.seed,
                         forecaster=getattr(args, "forecaster", None) or "seasonal-naive")
        res = run(cfg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"skymesh sim --experiment capacity-week: {exc}", file=sys.stderr)
        return 2
    print_summary(res)
    write_json(args.json, res)
    return 0
