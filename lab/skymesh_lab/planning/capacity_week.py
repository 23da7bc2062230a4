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
(:mod:`skymesh_lab.planning.capacity`) with the Azure 2023 conversation mix (1,155 prompt,
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
trip. A region that spills reports the utilisation of its own traffic to the scalers
(the router diverts only once the endpoint is over 70%, so the endpoint has seen it).

Batch (non-interactive) load, ``batch_share`` of each model's mean interactive tokens/s
(SageServe's 0.2M NIW next to 1.4M IW requests: 0.14), arrives at a constant rate, one
bundle per model per step, into SageServe's queue manager (:mod:`batch_queue`).
SageServe's endpoints signal on every request and get one or two requests per signal while
under 60%, so an endpoint tops up with batch work to 60% of its capacity and no further:
each step, an endpoint under 60% receives batch tokens up to that level
(``batch_feed="fill"``, the fluid limit of per-request signalling; a bundle is split when
only part of it fits). ``batch_feed="bundle"`` is the earlier coarse form: one signal per
endpoint per step, one whole bundle (15 s of the model's batch load) under 60%, two under
50%, which can hand a small endpoint more than its spare capacity in one step and run it
at 100%, where every interactive request of the step misses its SLO. Handed-out work waits
at the endpoint and uses only capacity left by interactive work (priority 1), or queues
with it once older than 10 hours (priority 0); it expires after 24 hours. Batch work in
progress counts in the effective memory utilisation the scalers see, and slows interactive
requests like any other running work. The ILP adds SageServe's buffer beta,
``batch_buffer`` (10%) of the batch tokens/s each endpoint received in the past hour, to
its forecast.

Per-model target utilisation (``target_miss``, default off). By default the planners
size every endpoint for one utilisation, ``rho*`` above (95% of requests meet the SLO),
and LT-U / LT-UA scale towards the plan over 70% / under 30%. With ``target_miss = p``,
each model is sized for its own target utilisation, derived once from its latency
profile, as capacity profiling does per model (SageServe, PreServe): the profile is the
function this simulation scores requests with, for one endpoint with no backlog and no
spill round trip,

    miss_m(rho) = 1 - P(X * t0_m / (1 - rho) <= slo_m),   X log-normal, mean 1, sigma 0.985,

and the model's target ``u_m`` is the highest utilisation in [0.05, 0.95] with
``miss_m(u_m) <= p`` (found by bisection; ``miss_m`` rises with ``rho``).
``p`` is one number for all models (the SLO's miss budget, e.g. 0.02 for a 98%
attainment goal), not fitted to any run's outcome. LT-I / LT-U / LT-UA then plan with
``theta_m = u_m x mu_t`` (instances = forecast / theta_m), and LT-U / LT-UA scale out
over ``u_m`` and in under ``u_m x 30/70`` (SageServe's ratio of the two thresholds).
Reactive and PreServe are unchanged, and so are the demand levels (set from ``rho*``).
Note that here ``slo_m = slo_factor x t0_m`` for every model and the prompt spread is the
trace's for all, so ``miss_m`` is the same curve for the three models and ``u_m`` is one
value (0.535 at p = 0.02, 0.391 at p = 0.01, ``rho*`` = 0.689 at p = 0.05): in this model
the per-model skew of the clairvoyant bound (``week_diagnose.fluid_bound``) comes from the
models' requests per GPU-hour, not from their latency curves.

``anticipate``: plan hour H at the start of the window holding H minus the longest cold
start, from the forecast of H's windows, and hold the larger of the two hours' counts
until H, so that instances ordered for H serve from H.

New instances serve after a cold start (default 3 min for 8B, 8 min for 70B: model
load; SageServe quotes 1-5 min to reclaim spot and 10 min to redeploy) and are paid for
meanwhile: that is the scaling overhead. Stopped instances are donated to spot at once.
"""

from __future__ import annotations

import csv
import math
import random
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import norm

from skymesh.util.stats import percentile
from skymesh_controller.planning.batch_queue import BatchQueue, BatchRequest
from skymesh_controller.planning.ilp import PlanInfeasible, PlanInput, solve
from skymesh_controller.planning.strategies import (
    SCALE_IN_UTILISATION,
    SCALE_OUT_UTILISATION,
    STRATEGIES,
    Observation,
    Strategy,
    make_strategy,
)
from skymesh_lab.planning.capacity import (
    DEFAULT_OUTPUT_LEN,
    DEFAULT_PROMPT_LEN,
    Capacity,
    instances_needed,
    profile_capacity,
)
from skymesh_lab.sim.workloads.data import data_file
from skymesh_replica.engine.profiles import get_profile

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
BATCH_FEEDS = ("fill", "bundle")


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
    # Plan hour H at the start of the window holding H - (longest cold start), from the
    # forecast of H's windows, so instances ordered for H serve from H (SageServe invokes
    # the ILP "every hour" for "the next hour"; an instance ordered at H serves at H + 8').
    anticipate: bool = False
    # Non-interactive (batch) load as a fraction of the model's mean interactive tokens/s,
    # arriving at a constant rate into SageServe's queue manager (batch_queue.py).
    # SageServe's trace (sec. 4) has 0.2M NIW next to 1.4M IW requests: 0.14.
    batch_share: float = 0.14
    # SageServe's buffer beta: this fraction of the batch tokens/s an endpoint received in
    # the last hour is added to its forecast in the ILP.
    batch_buffer: float = 0.10
    # How the queue manager hands batch work out (module docstring): "fill" tops each
    # endpoint up to 60% per step; "bundle" hands whole per-step bundles per signal.
    batch_feed: str = "fill"
    # Plan from an upper quantile of the forecast's error instead of a fixed headroom:
    # each endpoint's forecast is scaled by this quantile of (load in a step / the
    # forecast its plan used for that step's window) over the trailing day; ``headroom``
    # applies only until the first hour has been seen. None: fixed headroom.
    plan_quantile: float | None = None
    # Per-model target utilisation for LT-I / LT-U / LT-UA (module docstring): the miss
    # budget p; each model's target is the highest utilisation at which its latency
    # profile misses the TTFT SLO for at most p of requests. None: one rho* for all.
    target_miss: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.days <= 7:
            raise ValueError("days must be in (0, 7]")
        if not 1 <= self.step_s <= 60:
            raise ValueError("step_s must be between 1 and 60 seconds")
        if self.peak_instances < 1:
            raise ValueError("peak_instances must be at least 1")
        if not 0 <= self.batch_share <= 2:
            raise ValueError("batch_share must be in [0, 2]")
        if self.plan_quantile is not None and not 0 < self.plan_quantile < 1:
            raise ValueError("plan_quantile must be in (0, 1)")
        if self.target_miss is not None and not 0 < self.target_miss < 0.5:
            raise ValueError("target_miss must be in (0, 0.5)")
        if self.batch_feed not in BATCH_FEEDS:
            raise ValueError(f"batch_feed must be one of {', '.join(BATCH_FEEDS)}")
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


TARGET_BOUNDS = (0.05, 0.95)  # the range a target utilisation is searched in


def miss_curve(slo_s: float, t0_s: float, wait_s: float = 0.0) -> Callable[[float], float]:
    """A model's latency profile: the fraction of requests that miss TTFT <= ``slo_s`` at
    utilisation ``rho`` on an endpoint whose mean prompt takes ``t0_s`` idle (the same
    function the week scores requests with; ``wait_s`` before prefill, 0 for a profile)."""
    def miss(rho: float) -> float:
        if rho >= 1:
            return 1.0
        return 1.0 - float(attainment(slo_s, np.array([wait_s]),
                                      np.array([t0_s / (1 - rho)]))[0])
    return miss


def target_utilisation(miss: Callable[[float], float], budget: float,
                       bounds: tuple[float, float] = TARGET_BOUNDS) -> float:
    """The highest utilisation in ``bounds`` at which ``miss(rho) <= budget``, for a miss
    curve that rises with ``rho``: the lower bound if even it misses more, the upper if
    even it misses less."""
    if not 0 < budget < 1:
        raise ValueError("budget must be in (0, 1)")
    lo, hi = bounds
    if not 0 < lo < hi < 1:
        raise ValueError("bounds must satisfy 0 < lo < hi < 1")
    if miss(lo) > budget:
        return lo
    if miss(hi) <= budget:
        return hi
    for _ in range(60):  # miss(lo) <= budget < miss(hi)
        mid = (lo + hi) / 2
        if miss(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def model_targets(cfg: WeekConfig, caps: dict[str, Capacity]) -> dict[str, float] | None:
    """Each model's target utilisation from its own latency profile at the budget
    ``cfg.target_miss`` (None when the option is off)."""
    if cfg.target_miss is None:
        return None
    out = {}
    for m, c in caps.items():
        t0 = c.prompt_len / c.mu_p
        out[m] = target_utilisation(miss_curve(cfg.slo_factor * t0, t0), cfg.target_miss)
    return out


def plan_theta(cfg: WeekConfig, demand: Demand) -> dict[str, float]:
    """Tokens/s the plan-driven strategies count per instance of each model."""
    targets = model_targets(cfg, demand.caps)
    if targets is None:
        return dict(demand.theta)
    return {m: targets[m] * demand.caps[m].mu_t for m in demand.caps}


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


P95_WINDOW_S = 3 * 3600.0  # SageServe's Fig. 17 bins TTFT p95 by 3 hours


def p95_windows(slo_s: float, weight: np.ndarray, wait_s: np.ndarray, scale_s: np.ndarray,
                n_regions: int, steps: int) -> tuple[int, int]:
    """(met, counted): the (region, window of ``steps`` steps) cells with requests, and
    how many of them have a TTFT p95 within ``slo_s``. Arrays are step-major, one entry
    per (step, region), as the run fills them."""
    met = counted = 0
    n_steps = len(weight) // n_regions
    for j in range(n_regions):
        w, wait, scale = weight[j::n_regions], wait_s[j::n_regions], scale_s[j::n_regions]
        for a in range(0, n_steps, steps):
            cell = slice(a, a + steps)
            if w[cell].sum() <= 0:
                continue
            counted += 1
            met += mixture_quantile(0.95, w[cell], wait[cell], scale[cell]) <= slo_s
    return met, counted


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
    batch_queued: float = 0.0  # batch tokens handed to this endpoint at priority 1
    batch_urgent: float = 0.0  # ... promoted to priority 0 (older than 10 h)


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
    batch_submitted: float = 0.0  # tokens
    batch_served: float = 0.0
    batch_expired: float = 0.0
    batch_promoted: float = 0.0


@dataclass
class Demand:
    step_s: float
    steps: int
    tps: dict[tuple[str, str], np.ndarray]  # actual tokens/s per step
    forecast: dict[tuple[str, str], np.ndarray]  # [window, horizon 0..6] tokens/s
    caps: dict[str, Capacity]
    theta: dict[str, float]


def build_demand(cfg: WeekConfig) -> Demand:
    from skymesh_controller.planning.forecast.registry import make_forecaster

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
            horizons = 6 + max(1, _lead_windows(cfg))
            out = np.empty((sim_windows, horizons))
            for w in range(sim_windows):
                out[w] = fc.predict(horizons)
                lo, hi = int(w * WINDOW_S / cfg.step_s), int((w + 1) * WINDOW_S / cfg.step_s)
                fc.update(np.array([series[lo:hi].mean()]))
            forecast[(m, r)] = out
    return Demand(cfg.step_s, steps, tps, forecast, caps, theta)


class PlanErrors:
    """Each endpoint's realised load against the forecast its plan was made from.

    ``planned`` records the window forecasts a plan used (from ``first_window`` on);
    ``observe`` adds a step's load over the forecast of its window; ``scale`` is the
    ``quantile`` of those ratios over the last ``keep`` steps, the factor by which the
    next plan scales the forecast (``default`` until there is a plan's worth of history).
    """

    def __init__(self, quantile: float, keep: int, min_samples: int) -> None:
        self.quantile = quantile
        self.min_samples = min_samples
        self._ratios: dict[tuple[str, str], deque[float]] = defaultdict(
            lambda: deque(maxlen=keep))
        self._plans: dict[tuple[str, str], tuple[int, np.ndarray]] = {}

    def planned(self, key: tuple[str, str], first_window: int, forecast: np.ndarray) -> None:
        self._plans[key] = (first_window, np.asarray(forecast, dtype=float))

    def observe(self, key: tuple[str, str], window: int, load_tps: float) -> None:
        plan = self._plans.get(key)
        if plan is None:
            return
        idx = window - plan[0]
        if 0 <= idx < len(plan[1]) and plan[1][idx] > 0:
            self._ratios[key].append(load_tps / float(plan[1][idx]))

    def scale(self, key: tuple[str, str], default: float) -> float:
        seen = self._ratios.get(key)
        if seen is None or len(seen) < self.min_samples:
            return default
        q = percentile(seen, 100 * self.quantile)
        return default if q is None else q


def _plan_targets(cfg: WeekConfig, demand: Demand, eps: dict[tuple[str, str], Endpoint],
                  window: int, tally: Tally, ahead: int = 0,
                  batch_tps: dict[tuple[str, str], float] | None = None,
                  errors: PlanErrors | None = None,
                  theta: dict[str, float] | None = None,
                  ) -> dict[tuple[str, str], int]:
    """The ILP's counts for the hour whose first window is ``window + ahead``, forecast at
    the start of ``window``; ``batch_tps`` (last hour's batch load) feeds the buffer;
    ``errors``, when given, scales each forecast by its error quantile instead of the
    fixed headroom and records the forecasts this plan used; ``theta`` (tokens/s per
    instance of each model, default ``demand.theta``) is the capacity the plan counts."""
    batch_tps = batch_tps or {}
    fcs = {k: demand.forecast[k][window, ahead:ahead + 6] for k in eps}
    factor = {k: (errors.scale(k, 1 + cfg.headroom) if errors else 1 + cfg.headroom)
              for k in eps}
    if errors:
        for k, f in fcs.items():
            errors.planned(k, window + ahead, f)
    gpu = {m: get_profile(p).gpu for m, (p, _) in MODELS.items()}
    n_gpus = {m: get_profile(p).num_gpus for m, (p, _) in MODELS.items()}
    inp = PlanInput(
        current={m: {r: {gpu[m]: e.ready + len(e.starting)} for (mm, r), e in eps.items()
                     if mm == m} for m in MODELS},
        demand={m: {r: (fcs[(m, r)] * factor[(m, r)]
                        + cfg.batch_buffer * batch_tps.get((m, r), 0.0)).tolist()
                    for r in REGIONS} for m in MODELS},
        capacity={m: {gpu[m]: (theta or demand.theta)[m]} for m in MODELS},
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


def _lead_windows(cfg: WeekConfig) -> int:
    """Windows ahead of an hour at which anticipation plans it (0: no anticipation)."""
    if not cfg.anticipate:
        return 0
    return math.ceil(max(_cold(cfg, m) for m in MODELS) / WINDOW_S)


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


TRACE_FIELDS = (
    "requests",  # interactive requests the endpoint served in the step
    "attainment",  # fraction of them that met the TTFT SLO
    "utilisation",  # effective memory utilisation the strategy saw
    "rho",  # busy fraction that sets the processor-sharing slowdown (batch included)
    "batch_rho",  # ... of which batch work
    "wait_s",  # backlog wait plus the spill round trip, before prefill
    "ready", "starting", "target",  # instances; target -1 when there is none
    "load_tps", "forecast_tps", "capacity_tps",  # own traffic, window forecast, ready x mu_t
    "forwarded",  # share of the served load that came from another region
)


@dataclass
class WeekTrace:
    """Per-step state of every endpoint in one strategy's run, for diagnosis.

    ``data[(model, region)][field]`` is an array over steps, one per ``TRACE_FIELDS``.
    Pass one to :func:`run_strategy` to have it filled; runs without one record nothing.
    """

    step_s: float = 0.0
    data: dict[tuple[str, str], dict[str, np.ndarray]] = field(default_factory=dict)

    def reset(self, step_s: float, steps: int) -> None:
        self.step_s = step_s
        self.data = {(m, r): {f: np.zeros(steps) for f in TRACE_FIELDS}
                     for m in MODELS for r in REGIONS}


def run_strategy(name: str, cfg: WeekConfig, demand: Demand,
                 trace: WeekTrace | None = None) -> dict[str, Any]:
    strat: Strategy = make_strategy(name)
    dt = demand.step_s
    slo = {m: cfg.slo_factor * demand.caps[m].prompt_len / demand.caps[m].mu_p
           for m in MODELS}
    t0 = {m: demand.caps[m].prompt_len / demand.caps[m].mu_p for m in MODELS}
    uses_plan = name in ("lt-i", "lt-u", "lt-ua")
    # Per-model target utilisation (``target_miss``): the plan's capacity per instance and
    # LT-U / LT-UA's thresholds; reactive and PreServe keep theirs.
    targets_u = model_targets(cfg, demand.caps) if uses_plan else None
    theta = plan_theta(cfg, demand) if uses_plan else dict(demand.theta)
    thresholds = {m: (u, u * SCALE_IN_UTILISATION / SCALE_OUT_UTILISATION)
                  for m, u in (targets_u or {}).items()}
    eps: dict[tuple[str, str], Endpoint] = {}
    for m, (p, _) in MODELS.items():
        prof = get_profile(p)
        for r in REGIONS:
            first = demand.forecast[(m, r)][0, :6].max()
            eps[(m, r)] = Endpoint(m, r, demand.caps[m], prof.num_gpus, _cold(cfg, m),
                                   ready=max(1, math.ceil(first / theta[m])))
    tally = Tally()
    targets: dict[tuple[str, str], int] = {}
    n = demand.steps
    if trace is not None:
        trace.reset(dt, n)
    weights = {m: np.zeros(n * len(REGIONS)) for m in MODELS}
    waits = {m: np.zeros(n * len(REGIONS)) for m in MODELS}
    scales = {m: np.zeros(n * len(REGIONS)) for m in MODELS}
    mean_tokens = DEFAULT_PROMPT_LEN + DEFAULT_OUTPUT_LEN
    steps_per_window = WINDOW_S / dt
    windows_per_hour = round(3600 / WINDOW_S)
    lead = _lead_windows(cfg)
    sim_windows = demand.forecast[next(iter(demand.forecast))].shape[0]
    upcoming: dict[tuple[str, str], int] | None = None
    errors = (PlanErrors(cfg.plan_quantile, keep=round(DAY_S / dt),
                         min_samples=round(3600 / dt))
              if uses_plan and cfg.plan_quantile is not None else None)
    # Batch (non-interactive) traffic: a constant rate per model into the queue manager.
    queue = BatchQueue()
    batch_tps = {m: cfg.batch_share * float(np.mean(np.sum(
        [demand.tps[(m, r)] for r in REGIONS], axis=0))) for m in MODELS}
    hour_steps = max(1, round(3600 / dt))
    batch_in = {k: np.zeros(n) for k in eps}  # batch tokens handed to each endpoint
    for i in range(n):
        now = i * dt
        window = int(i // steps_per_window)
        new_window = i == 0 or int((i - 1) // steps_per_window) != window
        if uses_plan and (i == 0 or now % 3600 < (now - dt) % 3600):
            last_hour = {k: float(v[max(0, i - hour_steps):i].sum()) / 3600
                         for k, v in batch_in.items()}
            if upcoming is not None:
                targets, upcoming = upcoming, None
            else:
                targets = _plan_targets(cfg, demand, eps, window, tally,
                                        batch_tps=last_hour, errors=errors, theta=theta)
        elif uses_plan and lead and new_window and (window + lead) % windows_per_hour == 0 \
                and window + lead < sim_windows:
            # Anticipation: plan the next hour now, from its forecast; until it starts,
            # hold the larger of this hour's and the next hour's counts.
            last_hour = {k: float(v[max(0, i - hour_steps):i].sum()) / 3600
                         for k, v in batch_in.items()}
            upcoming = _plan_targets(cfg, demand, eps, window, tally, ahead=lead,
                                     batch_tps=last_hour, errors=errors, theta=theta)
            targets = {k: max(v, upcoming.get(k, v)) for k, v in targets.items()}
        if cfg.batch_share > 0:
            for m in MODELS:
                tokens = batch_tps[m] * dt
                queue.submit(BatchRequest(f"{m}-{i}", m, now,
                                          round(tokens * DEFAULT_PROMPT_LEN / mean_tokens),
                                          round(tokens * DEFAULT_OUTPUT_LEN / mean_tokens)))
                tally.batch_submitted += tokens
            for req in queue.expire(now):
                tally.batch_expired += req.prompt_tokens + req.output_tokens
        for m in MODELS:
            caps_now = {}
            for r in REGIONS:
                e = eps[(m, r)]
                caps_now[r] = e.ready * e.caps.mu_t
            loads = {r: float(demand.tps[(m, r)][i]) for r in REGIONS}
            if errors is not None:
                for r in REGIONS:
                    errors.observe((m, r), window, loads[r])
            served, forwarded = _spill(loads, caps_now)
            for j, r in enumerate(REGIONS):
                e = eps[(m, r)]
                cap = caps_now[r]
                arriving = served[r] * dt
                # Promoted batch work (priority 0) is served after the interactive work
                # of the step; the rest (priority 1) gets only the capacity left over.
                inter = arriving + e.backlog
                work = inter + e.batch_urgent
                if cap > 0:
                    done = min(work, cap * dt)
                    low = min(e.batch_queued, cap * dt - done)
                    # Effective memory holds interactive and batch work alike (queued
                    # batch included, so an endpoint stops asking once it has enough).
                    util = min(1.0, (work + e.batch_queued) / (cap * dt))
                    if loads[r] > 0.7 * cap:
                        # The region spilled: the global router diverts requests only once
                        # its endpoint is over 70%, so the endpoint has seen its own
                        # traffic's utilisation. Without this, spilling pins the signal at
                        # exactly the 70% threshold and no strategy scales out a region
                        # while any other has room.
                        util = max(util, min(1.0, loads[r] / cap))
                    # Batch requests share the running batch and slow interactive ones.
                    rho = min((done + low) / (cap * dt), 1.0)
                    wait = e.backlog / cap
                    scale = t0[m] / (1 - rho) if rho < 0.999 else math.inf
                else:
                    done, low, util, rho, wait, scale = 0.0, 0.0, 1.0, 1.0, math.inf, math.inf
                inter_done = min(inter, done)
                e.backlog = inter - inter_done
                e.batch_urgent -= done - inter_done
                e.batch_queued -= low
                tally.batch_served += low + done - inter_done
                if cfg.batch_share > 0:
                    handed = (queue.fill(m, r, util, cap * dt, now)
                              if cfg.batch_feed == "fill" else queue.on_signal(m, r, util, now))
                    for d in handed:
                        tokens = d.request.prompt_tokens + d.request.output_tokens
                        batch_in[(m, r)][i] += tokens
                        if d.priority == 0:
                            e.batch_urgent += tokens
                            tally.batch_promoted += tokens
                        else:
                            e.batch_queued += tokens
                k = i * len(REGIONS) + j
                weights[m][k] = arriving / mean_tokens
                waits[m][k] = wait + forwarded[r] * RTT_S
                scales[m][k] = scale
                # Observe and act.
                fc = demand.forecast[(m, r)][window]
                if trace is not None:
                    row = trace.data[(m, r)]
                    row["requests"][i] = weights[m][k]
                    row["utilisation"][i] = util
                    row["rho"][i] = rho
                    row["batch_rho"][i] = (low + done - inter_done) / (cap * dt) if cap else 0.0
                    row["wait_s"][i] = waits[m][k]
                    row["ready"][i] = e.ready
                    row["starting"][i] = len(e.starting)
                    row["target"][i] = targets.get((m, r), -1)
                    row["load_tps"][i] = loads[r]
                    row["forecast_tps"][i] = float(fc[0])
                    row["capacity_tps"][i] = cap
                    row["forwarded"][i] = forwarded[r]
                # The load anticipator: this step's utilisation plus a minute of its
                # trend, spread over the instances already on their way.
                proj = (util + max(0.0, util - e.last_util) * (60.0 / dt)) \
                    * e.ready / max(1, e.ready + len(e.starting))
                e.last_util = util
                # PreServe sizes a window for all the load its instances will serve: the
                # interactive forecast plus the batch work the queue handed this endpoint
                # in the last window (otherwise each window's N cuts the instances batch
                # work keeps busy, and the anticipator starts them again).
                recent = batch_in[(m, r)][max(0, i - int(steps_per_window)):i]
                pre_load = float(fc[1]) + float(recent.sum()) / WINDOW_S
                obs = Observation(
                    now=now, utilisation=util, load_tps=loads[r], ready=e.ready,
                    starting=len(e.starting), target=targets.get((m, r)),
                    forecast_tps=float(fc[0]),
                    needed=max(1, instances_needed(
                        pre_load * DEFAULT_PROMPT_LEN / mean_tokens,
                        pre_load * DEFAULT_OUTPUT_LEN / mean_tokens, e.caps,
                        utilisation=demand.theta[m] / e.caps.mu_t / (1 + cfg.headroom))),
                    window_start=window * WINDOW_S, projected_utilisation=min(proj, 2.0),
                    min_instances=1, max_instances=cfg.pool_per_endpoint,
                    scale_out_utilisation=thresholds[m][0] if thresholds else None,
                    scale_in_utilisation=thresholds[m][1] if thresholds else None,
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
    windows_met = windows_all = 0
    for m in MODELS:
        met, counted = p95_windows(slo[m], weights[m], waits[m], scales[m], len(REGIONS),
                                   round(P95_WINDOW_S / dt))
        windows_met += met
        windows_all += counted
        ok = attainment(slo[m], waits[m], scales[m])
        if trace is not None:
            for j, r in enumerate(REGIONS):
                trace.data[(m, r)]["attainment"][:] = ok[j::len(REGIONS)]
        w = weights[m]
        all_w += float(w.sum())
        all_ok += float((w * ok).sum())
        per_model[m] = {
            "slo_attainment": float((w * ok).sum() / w.sum()),
            "ttft_slo_s": slo[m],
            # None when over 5% of requests met a saturated pool (TTFT unbounded).
            "ttft_p95_s": _finite(mixture_quantile(0.95, w, waits[m], scales[m])),
            "p95_windows_met": met / counted if counted else None,
        }
    return {
        "gpu_hours": tally.gpu_hours,
        "slo_attainment": all_ok / all_w,
        "p95_windows_met": windows_met / windows_all if windows_all else None,
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
        "batch": {
            "submitted_tokens": tally.batch_submitted,
            "served_tokens": tally.batch_served,
            "expired_tokens": tally.batch_expired,
            "promoted_tokens": tally.batch_promoted,
            "pending_tokens": (sum(e.batch_queued + e.batch_urgent for e in eps.values())
                               + sum(q.prompt_tokens + q.output_tokens
                                     for q in queue.pending())),
        },
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
        out["clairvoyant_parity"] = _parity(cfg, demand, base)
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
        "anticipate": cfg.anticipate, "batch_share": cfg.batch_share,
        "batch_buffer": cfg.batch_buffer, "batch_feed": cfg.batch_feed,
        "plan_quantile": cfg.plan_quantile, "target_miss": cfg.target_miss,
        "target_utilisation": model_targets(cfg, demand.caps),
        "noise_sigma": cfg.noise_sigma, "bursts": cfg.bursts,
    }
    out["wall_seconds"] = time.perf_counter() - t_wall
    return out


# -- the clairvoyant fluid model: a floor for the strategies, here because _parity needs
# it; week_diagnose builds its bounds on it.
@dataclass(frozen=True)
class FluidModel:
    """The clairvoyant fluid model of the week (see ``week_diagnose.fluid_bound``)."""

    unit: dict[str, float]  # GPU-hours per (tokens/s of load at rho = 1), per model
    batch_gpu_hours: float  # batch work run full on capacity of its own
    weight: dict[str, float]  # interactive requests, up to one factor
    t0: dict[str, float]
    slo: dict[str, float]

    def att(self, m: str, rho: float) -> float:
        return float(attainment(self.slo[m], np.zeros(1),
                                np.array([self.t0[m] / (1 - rho)]))[0])


def fluid_model(cfg: WeekConfig, demand: Demand) -> FluidModel:
    dt = demand.step_s
    load = {m: np.concatenate([demand.tps[(m, r)] for r in REGIONS]) for m in MODELS}
    gpus = {m: get_profile(MODELS[m][0]).num_gpus for m in MODELS}
    unit = {m: float(load[m].sum()) * dt / 3600 * gpus[m] / demand.caps[m].mu_t
            for m in MODELS}
    batch = sum(cfg.batch_share * float(np.mean(np.sum([demand.tps[(m, r)] for r in REGIONS],
                                                       axis=0)))
                * cfg.days * 24 * gpus[m] / demand.caps[m].mu_t for m in MODELS)
    t0 = {m: demand.caps[m].prompt_len / demand.caps[m].mu_p for m in MODELS}
    return FluidModel(unit, batch, {m: float(load[m].sum()) for m in MODELS}, t0,
                  {m: cfg.slo_factor * t0[m] for m in MODELS})


def parity_budget(cfg: WeekConfig, demand: Demand,
                  targets: dict[str, float]) -> dict[str, Any]:
    """The fewest GPU-hours on which the clairvoyant of ``week_diagnose.fluid_bound`` gives every
    model at least its target attainment (reactive's own, model by model): each model
    runs at the highest ``rho`` that still meets its target. No strategy in this latency
    model matches reactive model by model on less."""
    from scipy.optimize import brentq

    f = fluid_model(cfg, demand)
    rhos = {}
    for m, target in targets.items():
        if not 0 < target < 1:
            raise ValueError(f"target attainment for {m} must be in (0, 1), got {target}")
        lo, hi = 1e-4, 1 - 1e-9
        if f.att(m, lo) < target:
            raise ValueError(f"{m}: even an idle pool misses the target {target}")
        rhos[m] = brentq(lambda r, m=m, t=target: f.att(m, r) - t, lo, hi, xtol=1e-12)
    return {"rho": rhos,
            "gpu_hours": f.batch_gpu_hours + sum(f.unit[m] / rhos[m] for m in rhos)}


def _parity(cfg: WeekConfig, demand: Demand, reactive: dict[str, Any]) -> dict[str, Any] | None:
    """How few GPU-hours a clairvoyant needs to match reactive model by model (a floor
    for the 'equal SLO' comparison; :func:`parity_budget`)."""
    targets = {m: v["slo_attainment"] for m, v in reactive["per_model"].items()}
    try:
        bound = parity_budget(cfg, demand, targets)
    except ValueError:  # a target no capacity reaches in the fluid model (e.g. 100%)
        return None
    return {"gpu_hours": bound["gpu_hours"], "rho": bound["rho"],
            "vs_reactive": bound["gpu_hours"] / reactive["gpu_hours"], "targets": targets}


def print_summary(res: dict[str, Any]) -> None:
    print(f"capacity-week: {res['setup']['days']:g} days, step {res['setup']['step_s']:g} s, "
          f"forecaster {res['setup']['forecaster']}")
    print(f"  {'strategy':<9} {'GPU-h':>9} {'vs reactive':>11} {'SLO met':>8} "
          f"{'p95 ok':>7} {'events':>7} {'scaling GPU-h':>13} {'spot inst-h':>11}")
    base = res["strategies"].get("reactive", {}).get("gpu_hours")
    for name, s in res["strategies"].items():
        ratio = f"{s['gpu_hours'] / base:.3f}x" if base else "-"
        b = s["batch"]
        batch = (f"  batch served {b['served_tokens'] / b['submitted_tokens']:.1%}, "
                 f"expired {b['expired_tokens'] / b['submitted_tokens']:.1%}"
                 if b["submitted_tokens"] else "")
        p95 = s.get("p95_windows_met")
        p95_ok = f"{p95 * 100:6.1f}%" if p95 is not None else f"{'-':>7}"
        print(f"  {name:<9} {s['gpu_hours']:9.1f} {ratio:>11} "
              f"{s['slo_attainment'] * 100:7.2f}% {p95_ok} {s['scaling_events']:7d} "
              f"{s['scaling_gpu_hours']:13.1f} {s['spot_donated_instance_hours']:11.1f}{batch}")
    par = res.get("clairvoyant_parity")
    if par:
        print(f"  a clairvoyant allocator matching reactive model by model needs "
              f"{par['vs_reactive']:.3f}x its GPU-hours")


# WeekConfig fields ``--week-param KEY=VALUE`` may set, with how to read the value.
_PARAM_TYPES: dict[str, Callable[[str], Any]] = {
    "step_s": float, "peak_instances": int, "slo_factor": float, "epsilon": float,
    "headroom": float, "noise_sigma": float, "bursts": int, "pool_per_endpoint": int,
    "batch_share": float, "batch_buffer": float, "batch_feed": str,
    "plan_quantile": float, "target_miss": float,
    "anticipate": lambda v: _parse_bool(v),
    "strategies": lambda v: tuple(x.strip() for x in v.split(",") if x.strip()),
}


def _parse_bool(value: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def parse_week_params(items: list[str] | None) -> dict[str, Any]:
    """``["headroom=0.2", "anticipate=true"]`` -> WeekConfig keyword arguments."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in _PARAM_TYPES:
            raise ValueError(f"--week-param takes KEY=VALUE with KEY one of "
                             f"{', '.join(sorted(_PARAM_TYPES))}; got {item!r}")
        try:
            out[key] = _PARAM_TYPES[key](value)
        except ValueError as exc:
            raise ValueError(f"--week-param {key}: {exc}") from None
    return out


def _config(args: Any) -> WeekConfig:
    days = args.days if getattr(args, "days", None) is not None else (
        args.duration / DAY_S if getattr(args, "duration", None) else 7.0)
    return WeekConfig(days=days, seed=args.seed,
                      forecaster=getattr(args, "forecaster", None) or "seasonal-naive",
                      **parse_week_params(getattr(args, "week_param", None)))


def _run_args(args: Any, command: str) -> dict[str, Any]:
    """The week for a command line's ``args``; bad input exits 2 with a one-line message."""
    import sys

    try:
        return run(_config(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def run_cli(args: Any) -> int:
    """``skymesh sim --experiment capacity-week``."""
    from skymesh.util.jsonio import write_json

    res = _run_args(args, "skymesh sim --experiment capacity-week")
    print_summary(res)
    write_json(args.json, res)
    return 0


def run_experiment(args: Any) -> dict[str, Any]:
    """``skymesh bench capacity-week``: the same week with its defaults (``--duration`` in
    simulated seconds and ``--seed`` apply)."""
    res = _run_args(args, "skymesh bench capacity-week")
    print_summary(res)
    return res
