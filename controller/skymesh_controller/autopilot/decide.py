"""One planning round's decision, pure: telemetry samples in, a plan and its diff out.

SageServe's hourly loop (sec. 5): per (model, region) endpoint, the token rate of each
window from the balancers' telemetry (prompt + output tokens / window); a forecast of the
next ``horizon`` windows with the configured forecaster, scaled by ``1 + headroom``; the
capacity ILP (skymesh_controller.planning.ilp) over every (model, region, GPU type) with the current
counts, the per-instance capacities and the bounds; the diff between the plan and now;
which of its changes become replica moves rather than a stop and a start (pair_moves).

No clock, store or network here: the caller passes ``now``, the samples and the counts,
so tests drive a round with hand-made series and a fake clock. Safety rules that live
here: a round with under ``min_history_windows`` of telemetry is skipped (after a restart
an empty series would read as "no demand" and scale everything to the minimum), and an
endpoint whose region sent no telemetry at all keeps its count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from skymesh_controller.autopilot.config import PlannerConfig
from skymesh_controller.planning.forecast.registry import make_forecaster
from skymesh_controller.planning.forecast.schedule import RetrainSchedule
from skymesh_controller.planning.ilp import (
    Key,
    Plan,
    PlanInfeasible,
    PlanInput,
    PlanInputError,
    solve,
)
from skymesh_controller.series import telemetry_series

DAY_S = 86_400
Pair = tuple[str, str]  # (model, region)
RECORDED_WINDOWS = 24  # of each input series kept in a round's record


@dataclass(frozen=True)
class Series:
    start_slot: int  # window index since the epoch (unix time // window_s) of values[0]
    values: np.ndarray  # tokens/s per window


def token_rates(samples: Iterable[Mapping[str, Any]], pairs: Iterable[Pair], window_s: int,
                now: float, stale_s: float = math.inf) -> dict[Pair, Series]:
    """Per pair, tokens/s of every complete window from its region's first report up to
    the window before ``now``'s (the current one is still filling). Regions that sent
    nothing, or nothing in the last ``stale_s``, are absent: balancers report every few
    seconds even when idle, so silence is a lost balancer, not a lack of demand."""
    samples = list(samples)
    current = math.floor(now / window_s)
    newest: dict[str, float] = {}
    for s in samples:
        newest[s["region"]] = max(newest.get(s["region"], -math.inf), float(s["ts"]))
    out: dict[Pair, Series] = {}
    for model, region in pairs:
        if now - newest.get(region, -math.inf) > stale_s:
            continue
        s = telemetry_series(samples, window_s, model=model, region=region)
        if s["start"] is None:
            continue
        first = s["start"] // window_s
        tokens = np.asarray(s["prompt_tokens"], float) + np.asarray(s["output_tokens"], float)
        # Windows after the last report and before now carried nothing: zeros.
        n = current - first
        if n <= 0:
            continue
        padded = np.zeros(n)
        kept = tokens[:n]
        padded[:len(kept)] = kept
        out[model, region] = Series(first, padded / window_s)
    return out


@dataclass
class ForecastOut:
    values: list[float]  # tokens/s, the next horizon windows (before headroom)
    used: str  # the model actually used (persistence when history is short or a fit failed)
    start_slot: int  # window index of values[0]
    error: float | None  # mean APE of the previous round's forecast on windows seen since


@dataclass
class _Fitted:
    kind: tuple[str, int]
    schedule: RetrainSchedule
    last_slot: int
    forecast: tuple[int, np.ndarray] | None = None


@dataclass
class ForecastBook:
    """Fitted forecasters per pair, retrained on the configured schedule, and their error."""

    cfg: PlannerConfig
    _fits: dict[Pair, _Fitted] = field(default_factory=dict)

    def forecast(self, pair: Pair, series: Series) -> ForecastOut:
        f, sch = self.cfg.forecaster, self.cfg.schedule
        y = series.values
        last = series.start_slot + len(y) - 1
        old = self._fits.get(pair)
        error = _ape(old.forecast, series) if old and old.forecast else None
        period = max(1, sch.day_s // sch.window_s)
        kind = (f.name, period) if len(y) >= 2 * period + 1 else ("seasonal-naive", 1)
        used: str = f.name if kind[1] == period else "persistence (under two days of history)"
        try:
            fitted = self._fitted(pair, kind, series, old)
            ahead = fitted.schedule.predict(sch.horizon)
        except (ValueError, np.linalg.LinAlgError) as exc:
            # Degenerate demand (all zeros, constant) can break a statistical fit: plan
            # with the plainest model rather than not at all, and say so.
            used = f"persistence ({f.name} failed: {exc})"[:200]
            fitted = self._fit(("seasonal-naive", 1), series)
            ahead = fitted.schedule.predict(sch.horizon)
        fitted.forecast = (last + 1, np.asarray(ahead, float))
        self._fits[pair] = fitted
        return ForecastOut([float(v) for v in ahead], used, last + 1, error)

    def _fitted(self, pair: Pair, kind: tuple[str, int], series: Series,
                old: _Fitted | None) -> _Fitted:
        last = series.start_slot + len(series.values) - 1
        if (old is None or old.kind != kind or self.cfg.forecaster.retrain_every == 0
                or old.last_slot < series.start_slot - 1 or old.last_slot > last):
            return self._fit(kind, series)
        new = series.values[old.last_slot + 1 - series.start_slot:]
        if len(new):
            old.schedule.observe(new)
        old.last_slot = last
        return old

    def _fit(self, kind: tuple[str, int], series: Series) -> _Fitted:
        name, period = kind
        params = self.cfg.forecaster.params if name == self.cfg.forecaster.name else {}
        model = make_forecaster(name, period, **params)
        sch = RetrainSchedule(model, self.cfg.forecaster.retrain_every,
                              self.cfg.schedule.history_windows)
        sch.fit(series.values, origin=series.start_slot)
        return _Fitted(kind, sch, series.start_slot + len(series.values) - 1)


def _ape(forecast: tuple[int, np.ndarray], series: Series) -> float | None:
    """Mean absolute percentage error over the windows both cover (actual > 0 only)."""
    first, values = forecast
    errs = []
    for i, f in enumerate(values):
        j = first + i - series.start_slot
        if 0 <= j < len(series.values) and series.values[j] > 0:
            errs.append(abs(f - series.values[j]) / series.values[j])
    return float(np.mean(errs)) if errs else None


@dataclass
class Decision:
    series: dict[Pair, Series]
    forecasts: dict[Pair, ForecastOut]
    plan: Plan | None
    changes: list[tuple[Key, int, int]]  # (key, before, after)
    kept: list[tuple[Pair, str]]  # endpoints left as they are, and why
    skipped: str | None = None  # why no plan was made (short history, infeasible...)
    note: str | None = None  # what the plan had to give up (a forecast above the bounds)


def decide(cfg: PlannerConfig, book: ForecastBook, *, now: float,
           samples: Sequence[Mapping[str, Any]], regions: Iterable[str],
           current: Mapping[Key, int],
           model_limits: Mapping[str, tuple[int, int | None]] | None = None) -> Decision:
    """Forecast every endpoint, solve the ILP, and diff the plan against ``current``."""
    sch = cfg.schedule
    regions = sorted(set(regions) | {r for _, r, _ in current})
    pairs = [(m, r) for m in sorted(cfg.capacity) for r in regions]
    series = token_rates(samples, pairs, sch.window_s, now,
                         stale_s=sch.stale_windows * sch.window_s)
    longest = max((len(s.values) for s in series.values()), default=0)
    if longest < sch.min_history_windows:
        return Decision(series, {}, None, [], [], skipped=(
            f"{longest} complete window(s) of telemetry; planning needs "
            f"{sch.min_history_windows}"))
    forecasts = {p: book.forecast(p, s) for p, s in series.items()}
    kept = [(p, f"no telemetry from this region in {sch.stale_windows} windows")
            for p in pairs if p not in series]
    silent = {p for p, _ in kept}
    # Endpoints left alone enter the ILP empty (max 0), so the plan does not count on
    # capacity nobody reported on; the plan then shows them at their current count.
    inp = plan_input(cfg, forecasts, regions,
                     {k: n for k, n in current.items() if k[:2] not in silent},
                     model_limits or {}, silent)
    note = None
    try:
        plan = solve(inp, time_limit_s=cfg.solve_time_limit_s)
    except PlanInfeasible as exc:
        # Most often a forecast above what the bounds allow: plan at the bounds rather
        # than leave the fleet where it is while the load outgrows it.
        inp, cut = within_bounds(inp)
        try:
            if not cut:
                raise exc
            plan = solve(inp, time_limit_s=cfg.solve_time_limit_s)
        except (PlanInfeasible, PlanInputError) as again:
            return Decision(series, forecasts, None, [], kept, skipped=str(again))
        note = "forecast above the bounds, planned at them: " + "; ".join(cut)
    except PlanInputError as exc:
        return Decision(series, forecasts, None, [], kept, skipped=str(exc))
    for k in [k for k in plan.counts if k[:2] in silent]:
        plan.counts[k], plan.deltas[k] = current.get(k, 0), 0
    changes = [(k, current.get(k, 0), n) for k, n in sorted(plan.counts.items())
               if n != current.get(k, 0)]
    return Decision(series, forecasts, plan, changes, kept, note=note)


def within_bounds(inp: PlanInput) -> tuple[PlanInput, list[str]]:
    """``inp`` with each forecast cut to what its bounds can serve: an endpoint's to its
    ``max_per_endpoint`` instances of the model's largest per-instance capacity, and a
    model's regions together (scaled alike) to its ``max_instances``; with what was cut
    (model/region: forecast peak -> servable), empty when nothing was."""
    demand: dict[str, dict[str, list[float]]] = {}
    cut: list[str] = []
    for m, per_region in inp.demand.items():
        per_instance = max(inp.capacity.get(m, {}).values(), default=0.0)
        rows: dict[str, list[float]] = {}
        for r, values in per_region.items():
            row = [float(v) for v in (values if isinstance(values, Sequence) else [values])]
            bound = inp.max_per_endpoint.get(m, {}).get(r)
            if bound is not None and row and max(row) > bound * per_instance:
                cut.append(f"{m}/{r}: {max(row):.0f} -> {bound * per_instance:.0f} tokens/s")
                row = [min(v, bound * per_instance) for v in row]
            rows[r] = row
        total = inp.max_instances.get(m)
        width = max((len(v) for v in rows.values()), default=0)
        for w in range(width):
            here = sum(v[w] for v in rows.values() if w < len(v))
            if total is not None and here > total * per_instance > 0:
                scale = total * per_instance / here
                for v in rows.values():
                    if w < len(v):
                        v[w] *= scale
                cut.append(f"{m} window {w}: {here:.0f} -> {total * per_instance:.0f} "
                           "tokens/s over its regions")
        demand[m] = rows
    return replace(inp, demand=demand), cut


def plan_input(cfg: PlannerConfig, forecasts: Mapping[Pair, ForecastOut], regions: list[str],
               current: Mapping[Key, int],
               model_limits: Mapping[str, tuple[int, int | None]],
               empty: Iterable[Pair] = ()) -> PlanInput:
    """The ILP's input; ``empty`` endpoints get no instance (min = max = 0)."""
    scale = 1 + cfg.forecaster.headroom
    demand: dict[str, dict[str, list[float]]] = {}
    for (m, r), fc in forecasts.items():
        demand.setdefault(m, {})[r] = [v * scale for v in fc.values]
    cur: dict[str, dict[str, dict[str, int]]] = {}
    for (m, r, g), n in current.items():
        if m in cfg.capacity:  # replicas of models the planner does not manage stay out
            cur.setdefault(m, {}).setdefault(r, {})[g] = n
    gpus = {g for per in cfg.capacity.values() for g in per}
    # Absent: unbounded, i.e. more GPUs than any bound could ask for.
    available = {r: {g: cfg.gpus_available.get(r, {}).get(g, 1_000_000) for g in gpus}
                 for r in regions}
    lo = {m: model_limits[m][0] for m in cfg.capacity if m in model_limits}
    hi = {m: v for m in cfg.capacity if m in model_limits
          and (v := model_limits[m][1]) is not None}
    ep_lo = {m: {r: cfg.bound(m, r).min for r in regions} for m in cfg.capacity}
    ep_hi = {m: {r: b for r in regions if (b := cfg.bound(m, r).max) is not None}
             for m in cfg.capacity}
    for m, r in empty:
        ep_lo[m][r] = ep_hi[m][r] = 0
    return PlanInput(current=cur, demand=demand, capacity=cfg.capacity,
                     gpus_available=available, epsilon=cfg.epsilon,
                     min_instances=lo, max_instances=hi,
                     # A unit price when none is given, so the plan uses no more than needed.
                     vm_cost={g: cfg.vm_cost.get(g, 1.0) for g in gpus},
                     gpus_per_instance=cfg.gpus_per_instance,
                     min_per_endpoint=ep_lo, max_per_endpoint=ep_hi)


# -- moves ---------------------------------------------------------------------------------
MoveKind = str  # "region" (same model, another region) or "model" (same region, another)


def move_kind(src: Key, dst: Key) -> frozenset[MoveKind] | None:
    """What a replica changes moving from ``src`` to ``dst`` (None: it cannot: the GPU
    type is the machine, and a replica never changes it)."""
    if src[2] != dst[2] or src == dst:
        return None
    return frozenset(k for k, i in (("model", 0), ("region", 1)) if src[i] != dst[i])


def pair_moves(changes: Sequence[tuple[Key, int, int]], kinds: frozenset[MoveKind],
               movable: Mapping[Key, int]) -> list[tuple[Key, Key]]:
    """Pair a key that loses replicas with one that gains on the same GPU type, one
    ``(src, dst)`` per replica, as far as ``movable`` (replicas the actuator may move, per
    key) and ``kinds`` (what its replicas can change) allow; the rest stays stop + start.

    Cheapest first: a region move keeps the process (and only its cache goes cold), a
    model change restarts it, both at once restarts it elsewhere. Within a kind, keys in
    sorted order, so the same diff always gives the same moves."""
    surplus = {k: min(b - a, movable.get(k, 0)) for k, b, a in changes if b > a}
    deficit = {k: a - b for k, b, a in changes if a > b}
    order = [frozenset({"region"}), frozenset({"model"}), frozenset({"model", "region"})]
    out: list[tuple[Key, Key]] = []
    for want in order:
        if not want <= kinds:
            continue
        for src in sorted(surplus):
            for dst in sorted(deficit):
                if move_kind(src, dst) != want:
                    continue
                n = min(surplus[src], deficit[dst])
                out += [(src, dst)] * n
                surplus[src] -= n
                deficit[dst] -= n
    return out
