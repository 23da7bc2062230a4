"""SageServe's capacity ILP (section 5.1) as a pure function, solved with HiGHS.

Decision: an integer change delta[i, j, k] in the instances of model i in region j on GPU
type k, written delta = add - remove with both parts non-negative integers so additions
and removals can be costed apart. With n the current counts, theta[i, k] the tokens/s one
instance serves and rho[i, j, w] the forecast demand in window w of the next hour:

- regional:  sum_k (n + delta) theta >= epsilon * max_w rho[i, j, w]      for every i, j
- global:    sum_j sum_k (n + delta) theta >= max_w sum_j rho[i, j, w]    for every i
- n + delta >= 0 (the bounds of ``remove``), min <= sum_jk (n + delta) <= max per model
  (and optionally per (model, region) endpoint),
- GPU availability: sum_i (n + delta) * gpus_per_instance[i, k] <= available[j, k].

Objective (SageServe's gamma + mu): sum_k alpha_k * sum_ij delta (VM cost on the *net*
change, so releasing a VM saves its cost, as in the paper) + sum sigma[i, k] * add
(deployment cost, paid only for instances that must load weights), plus a tie-breaker of
``churn_cost`` per move so that of equally priced plans the one with fewer moves wins.

Before solving, capacity is checked against demand so the common infeasible inputs get a
message naming the model, region and shortfall; anything the solver still finds
infeasible is diagnosed by re-solving with one constraint set dropped at a time.

Solving (``solve_highs``): the LP relaxation first (a lower bound; often integral on small
inputs, then it is the answer), then the MIP restricted to deltas within one instance of
the LP's, whose plan is returned when it is within ``MIP_REL_GAP`` of the LP bound, else
the full MIP runs and the better of its plan and the neighbourhood's is returned. The
constraints, the objective and the gap guarantee are those of the plain MIP; only the
search changes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import highspy
import numpy as np
from scipy import sparse

Key = tuple[str, str, str]  # (model, region, gpu)
ConstraintSet = Literal["regional", "global", "model min/max", "endpoint min/max",
                        "GPU availability"]
CONSTRAINT_SETS: tuple[ConstraintSet, ...] = (
    "regional", "global", "model min/max", "endpoint min/max", "GPU availability")


class PlanInputError(ValueError):
    """The input itself is malformed (negative demand, unknown GPU, min above max...)."""


class PlanInfeasible(ValueError):
    """No plan satisfies the constraints; ``constraint`` names the set that cannot be met."""

    def __init__(self, constraint: ConstraintSet | str, message: str) -> None:
        super().__init__(f"{constraint} constraint cannot be met: {message}")
        self.constraint = constraint


@dataclass(frozen=True)
class PlanInput:
    """Everything the ILP needs. Nested mappings are keyed model -> region -> gpu etc."""

    current: Mapping[str, Mapping[str, Mapping[str, int]]]  # n[model][region][gpu]
    demand: Mapping[str, Mapping[str, Sequence[float] | float]]  # rho[model][region][w]
    capacity: Mapping[str, Mapping[str, float]]  # theta[model][gpu], tokens/s
    gpus_available: Mapping[str, Mapping[str, int]]  # [region][gpu], GPUs
    epsilon: float = 0.5
    min_instances: Mapping[str, int] = field(default_factory=dict)  # per model, total
    max_instances: Mapping[str, int] = field(default_factory=dict)
    vm_cost: Mapping[str, float] = field(default_factory=dict)  # alpha[gpu]
    deploy_cost: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # sigma
    gpus_per_instance: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    min_per_endpoint: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    max_per_endpoint: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    churn_cost: float = 1e-3


@dataclass(frozen=True)
class Plan:
    deltas: dict[Key, int]  # every (model, region, gpu) the model can run on
    counts: dict[Key, int]  # n + delta
    objective: float  # alpha * net change + sigma * additions (tie-breaker excluded)
    status: str
    solve_seconds: float
    variables: int
    constraints: int

    def count(self, model: str, region: str) -> int:
        return sum(v for (m, r, _), v in self.counts.items() if m == model and r == region)

    def changes(self) -> dict[Key, int]:
        return {k: v for k, v in self.deltas.items() if v}


@dataclass
class IlpModel:
    """The ILP in matrix form: min c x, row_lo <= A x <= row_hi, lb <= x <= ub, x integer.

    Columns are ``add`` for each key, then ``remove`` for each key.
    """

    keys: list[Key]
    current: np.ndarray
    c: np.ndarray
    a: sparse.csr_matrix
    row_lo: np.ndarray
    row_hi: np.ndarray
    row_sets: list[ConstraintSet]
    lb: np.ndarray
    ub: np.ndarray
    cost_add: np.ndarray  # objective per add / remove without the tie-breaker
    cost_remove: np.ndarray

    def without(self, dropped: ConstraintSet) -> IlpModel:
        keep = np.array([s != dropped for s in self.row_sets], dtype=bool)
        return IlpModel(self.keys, self.current, self.c, self.a[keep], self.row_lo[keep],
                        self.row_hi[keep], [s for s in self.row_sets if s != dropped],
                        self.lb, self.ub, self.cost_add, self.cost_remove)


def _windows(value: Sequence[float] | float) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(value, dtype=float))
    if arr.size == 0:
        raise PlanInputError("a demand forecast needs at least one window")
    return arr


def _check_nonneg(name: str, values: Iterable[float]) -> None:
    for v in values:
        if not math.isfinite(v) or v < 0:
            raise PlanInputError(f"{name} must be finite and non-negative, got {v}")


def build_model(inp: PlanInput) -> IlpModel:
    """Validate ``inp``, check capacity against demand, and lay the ILP out as matrices."""
    if not 0 < inp.epsilon <= 1:
        raise PlanInputError(f"epsilon must be in (0, 1], got {inp.epsilon}")
    models = sorted(set(inp.demand) | set(inp.current))
    regions = sorted({r for m in inp.demand.values() for r in m}
                     | {r for m in inp.current.values() for r in m} | set(inp.gpus_available))
    for m in models:
        if m not in inp.capacity or not inp.capacity[m]:
            raise PlanInputError(f"no capacity given for model {m!r}")
        _check_nonneg(f"capacity of {m}", inp.capacity[m].values())
        if any(v <= 0 for v in inp.capacity[m].values()):
            raise PlanInputError(f"capacity of {m} must be positive on every GPU listed")
    for m, per_region in inp.demand.items():
        for r, w in per_region.items():
            _check_nonneg(f"demand of {m} in {r}", _windows(w))
    for m, now_region in inp.current.items():
        for r, per_gpu in now_region.items():
            for g, n in per_gpu.items():
                if n < 0 or int(n) != n:
                    raise PlanInputError(f"current count of {m}/{r}/{g} must be a "
                                         f"non-negative integer, got {n}")
                if n and g not in inp.capacity.get(m, {}):
                    raise PlanInputError(f"{m} runs on {g} in {r} but has no capacity "
                                         f"given for {g}")
    for r, avail_gpu in inp.gpus_available.items():
        _check_nonneg(f"GPUs available in {r}", avail_gpu.values())
    for m in models:
        lo, hi = inp.min_instances.get(m, 0), inp.max_instances.get(m)
        if hi is not None and lo > hi:
            raise PlanInputError(f"min_instances of {m} ({lo}) exceeds max_instances ({hi})")
        for r in regions:
            low = inp.min_per_endpoint.get(m, {}).get(r, 0)
            high = inp.max_per_endpoint.get(m, {}).get(r)
            if high is not None and low > high:
                raise PlanInputError(f"min_per_endpoint of {m}/{r} ({low}) exceeds "
                                     f"max_per_endpoint ({high})")

    def gpus_per(m: str, g: str) -> int:
        return int(inp.gpus_per_instance.get(m, {}).get(g, 1))

    def avail(r: str, g: str) -> float:
        return float(inp.gpus_available.get(r, {}).get(g, 0))

    keys: list[Key] = [(m, r, g) for m in models for r in regions
                       for g in sorted(inp.capacity[m])]
    idx = {k: e for e, k in enumerate(keys)}
    cur = np.array([inp.current.get(m, {}).get(r, {}).get(g, 0) for m, r, g in keys],
                   dtype=float)
    theta = np.array([inp.capacity[m][g] for m, _, g in keys], dtype=float)
    # Most instances a key could ever hold: its region's GPUs of that type, the model's
    # and the endpoint's maximum.
    most = np.empty(len(keys))
    for e, (m, r, g) in enumerate(keys):
        bound = avail(r, g) // gpus_per(m, g)
        for cap in (inp.max_instances.get(m), inp.max_per_endpoint.get(m, {}).get(r)):
            if cap is not None:
                bound = min(bound, cap)
        most[e] = max(bound, 0)

    peaks = {(m, r): float(_windows(w).max()) for m in inp.demand
             for r, w in inp.demand[m].items()}
    # Fail early with the numbers a planner wants to see.
    for (m, r), peak in peaks.items():
        need = inp.epsilon * peak
        can = sum(theta[idx[(m, r, g)]] * most[idx[(m, r, g)]] for g in inp.capacity[m])
        if can < need - 1e-9:
            raise PlanInfeasible("regional", (
                f"{m} in {r} must serve {need:.6g} tokens/s (epsilon {inp.epsilon} of its "
                f"peak {peak:.6g}) but at most {can:.6g} fit on that region's GPUs and the "
                f"instance limits"))
    global_peak: dict[str, float] = {}
    for m, per_region in inp.demand.items():
        series = [_windows(w) for w in per_region.values()]
        width = max(len(s) for s in series)
        # A series shorter than the others holds its last value (one window: flat).
        total = sum(np.pad(s, (0, width - len(s)), mode="edge") for s in series)
        global_peak[m] = float(np.max(total))
        can = sum(theta[e] * most[e] for e, k in enumerate(keys) if k[0] == m)
        cap_total = inp.max_instances.get(m)
        if cap_total is not None:
            best = max(inp.capacity[m].values())
            can = min(can, cap_total * best)
        if can < global_peak[m] - 1e-9:
            raise PlanInfeasible("global", (
                f"{m} must serve {global_peak[m]:.6g} tokens/s at its global peak but at "
                f"most {can:.6g} fit across all regions"))

    rows: list[tuple[dict[int, float], float, float, ConstraintSet]] = []
    inf = math.inf
    for (m, r), peak in peaks.items():
        coef = {idx[(m, r, g)]: theta[idx[(m, r, g)]] for g in inp.capacity[m]}
        base = sum(c * cur[e] for e, c in coef.items())
        rows.append((coef, inp.epsilon * peak - base, inf, "regional"))
    for m, peak in global_peak.items():
        coef = {e: theta[e] for e, k in enumerate(keys) if k[0] == m}
        rows.append((coef, peak - sum(c * cur[e] for e, c in coef.items()), inf, "global"))
    for m in models:
        mlo, mhi = inp.min_instances.get(m), inp.max_instances.get(m)
        if mlo is None and mhi is None:
            continue
        coef = {e: 1.0 for e, k in enumerate(keys) if k[0] == m}
        base = sum(cur[e] for e in coef)
        rows.append((coef, (mlo or 0) - base, (mhi - base) if mhi is not None else inf,
                     "model min/max"))
    for m in models:
        for r in regions:
            elo = inp.min_per_endpoint.get(m, {}).get(r)
            ehi = inp.max_per_endpoint.get(m, {}).get(r)
            if elo is None and ehi is None:
                continue
            coef = {idx[(m, r, g)]: 1.0 for g in inp.capacity[m]}
            base = sum(cur[e] for e in coef)
            rows.append((coef, (elo or 0) - base, (ehi - base) if ehi is not None else inf,
                         "endpoint min/max"))
    gpus = sorted({g for m in models for g in inp.capacity[m]})
    for r in regions:
        for g in gpus:
            coef = {idx[(m, r, g)]: float(gpus_per(m, g)) for m in models
                    if (m, r, g) in idx}
            if coef:
                base = sum(c * cur[e] for e, c in coef.items())
                rows.append((coef, -inf, avail(r, g) - base, "GPU availability"))

    # Adding more instances to a key than would cover its model's whole global peak (or
    # its minimum count) on their own never helps; tight bounds make HiGHS much faster.
    useful = np.empty(len(keys))
    for e, (m, r, _) in enumerate(keys):
        need = math.ceil(global_peak.get(m, 0.0) / theta[e] + 1e-9)
        floor_count = max(inp.min_instances.get(m, 0), inp.min_per_endpoint.get(m, {}).get(r, 0))
        useful[e] = max(need, floor_count)
    most = np.minimum(most, np.maximum(useful, cur))

    n = len(keys)
    data: list[float] = []
    ri: list[int] = []
    ci: list[int] = []
    for row, (coef, _, _, _) in enumerate(rows):
        for e, c in coef.items():
            # delta = add - remove: +c on the add column, -c on the remove column.
            ri += [row, row]
            ci += [e, n + e]
            data += [c, -c]
    a = sparse.csr_matrix((data, (ri, ci)), shape=(len(rows), 2 * n))
    alpha = np.array([inp.vm_cost.get(g, 0.0) for _, _, g in keys], dtype=float)
    sigma = np.array([inp.deploy_cost.get(m, {}).get(g, 0.0) for m, _, g in keys], dtype=float)
    _check_nonneg("vm_cost", alpha)
    _check_nonneg("deploy_cost", sigma)
    cost_add, cost_remove = alpha + sigma, -alpha
    churn = inp.churn_cost
    return IlpModel(
        keys=keys, current=cur,
        c=np.concatenate([cost_add + churn, cost_remove + churn]),
        a=a,
        row_lo=np.array([lo for _, lo, _, _ in rows], dtype=float),
        row_hi=np.array([hi for _, _, hi, _ in rows], dtype=float),
        row_sets=[s for _, _, _, s in rows],
        lb=np.zeros(2 * n),
        ub=np.concatenate([np.maximum(most - cur, 0), cur]),
        cost_add=cost_add, cost_remove=cost_remove,
    )


@dataclass(frozen=True)
class _Solution:
    status: str
    x: np.ndarray | None
    seconds: float


# Relative optimality gap at which HiGHS stops: forecasts err by several percent, so
# proving the last 0.5% of an hourly plan's cost is not worth seconds of search.
MIP_REL_GAP = 0.005


def _highs(model: IlpModel, lb: np.ndarray, ub: np.ndarray, *, integer: bool,
           mip_rel_gap: float, time_limit_s: float) -> highspy.Highs:
    """A HiGHS instance holding ``model`` with the given column bounds."""
    lp = highspy.HighsLp()
    ncol = len(model.c)
    lp.num_col_ = ncol
    lp.num_row_ = model.a.shape[0]
    lp.col_cost_ = model.c
    lp.col_lower_ = lb
    lp.col_upper_ = ub
    lp.row_lower_ = np.where(np.isinf(model.row_lo), -highspy.kHighsInf, model.row_lo)
    lp.row_upper_ = np.where(np.isinf(model.row_hi), highspy.kHighsInf, model.row_hi)
    csc = model.a.tocsc()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = csc.indptr
    lp.a_matrix_.index_ = csc.indices
    lp.a_matrix_.value_ = csc.data
    if integer:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * ncol
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    h.passModel(lp)
    return h


def _col_values(h: highspy.Highs) -> np.ndarray:
    return np.asarray(h.getSolution().col_value, dtype=float)


# The LP-guided neighbourhood searched before the full MIP: each delta may move this many
# instances beyond the floor/ceiling of its LP value. +-0 is too narrow (GPU rows filled
# by fractional instances of several models leave no integer point); +-1 finds a plan
# within 0.2-0.3% of the LP bound on the benchmark instances.
NEIGHBOURHOOD = 1
# The neighbourhood sub-MIP stops at this gap to its own bound: tighter than the caller's
# gap so that the incumbent usually proves itself against the LP bound.
_SUB_GAP = 0.001
_INTEGRAL_TOL = 1e-6
# Below this many columns the plain MIP is as fast as the warm-started path (measured:
# 18 and 36 columns, 6-25 ms plain against 7-43 ms with the LP and neighbourhood solves;
# 80 columns and up, the warm start wins), so small models skip it.
WARM_START_MIN_COLUMNS = 64


def relative_gap(objective: float, bound: float) -> float:
    """HiGHS's relative MIP gap: (primal - dual) / |primal| (0 when both are 0)."""
    return max(0.0, objective - bound) / max(abs(objective), 1e-9)


def solve_highs(model: IlpModel, time_limit_s: float = 30.0,
                mip_rel_gap: float = MIP_REL_GAP, warm_start: bool = True) -> _Solution:
    """Solve ``model`` with HiGHS, within ``mip_rel_gap`` of the optimum.

    With ``warm_start`` (the default) the LP relaxation comes first: it is a lower bound
    on every plan. Then the MIP restricted to plans within NEIGHBOURHOOD instances of the
    LP's deltas gives an incumbent; if that is within the gap of the LP bound it is
    returned, proven, without the full MIP. Otherwise the full MIP runs (as the plain
    path does) and the better of its plan and the incumbent is returned. Why: the root
    LP of this ILP is within ~0.2% of the optimum, but HiGHS spends a second or more in
    cut separation and sub-MIP heuristics before it finds a plan that close; the
    neighbourhood is small enough to search in a fraction of that. ``warm_start=False``
    is the plain single HiGHS solve (the old path, kept as the benchmark's baseline), also
    taken for models under WARM_START_MIN_COLUMNS columns.

    The incumbent is not handed to HiGHS as a start (``setSolution``): highspy 1.16.0
    then returns the start itself as "optimal" on some models, with an objective that is
    not the start's own (presolve loses an offset; 1.11-1.15.1 do not): a plan 10-20%
    dearer than the optimum (tests/unit/test_ilp.py keeps such a model). The fallback is
    rare: none of twelve 10 x 8 x 4 benchmark instances needs it.
    """
    t0 = time.perf_counter()
    incumbent: np.ndarray | None = None
    if warm_start and len(model.c) >= WARM_START_MIN_COLUMNS:
        relax = _highs(model, model.lb, model.ub, integer=False, mip_rel_gap=mip_rel_gap,
                       time_limit_s=time_limit_s)
        relax.run()
        status = relax.getModelStatus()
        if status in (highspy.HighsModelStatus.kInfeasible,
                      highspy.HighsModelStatus.kUnboundedOrInfeasible):
            # No fractional plan meets the constraints, so no integer one does.
            return _Solution("infeasible", None, time.perf_counter() - t0)
        if status == highspy.HighsModelStatus.kOptimal:
            x = _col_values(relax)
            bound = float(model.c @ x)
            if np.all(np.abs(x - np.round(x)) <= _INTEGRAL_TOL):
                return _Solution("optimal", np.round(x), time.perf_counter() - t0)
            incumbent = _neighbourhood(model, x, time_limit_s)
            if incumbent is not None and relative_gap(
                    float(model.c @ incumbent), bound) <= mip_rel_gap:
                return _Solution("optimal", incumbent, time.perf_counter() - t0)
    h = _highs(model, model.lb, model.ub, integer=True, mip_rel_gap=mip_rel_gap,
               time_limit_s=max(1e-3, time_limit_s - (time.perf_counter() - t0)))
    h.run()
    sol = _mip_solution(h, time.perf_counter() - t0)
    if incumbent is not None and (sol.x is None
                                  or float(model.c @ incumbent) < float(model.c @ sol.x)):
        # The MIP may stop at its gap or time limit with a dearer plan than one it has
        # not seen: keep the cheaper (it is feasible: _neighbourhood checked its rows).
        return _Solution("feasible" if sol.status == "infeasible" else sol.status,
                         incumbent, sol.seconds)
    return sol


def _mip_solution(h: highspy.Highs, seconds: float) -> _Solution:
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
        return _Solution("optimal", np.round(_col_values(h)), seconds)
    if status in (highspy.HighsModelStatus.kInfeasible,
                  highspy.HighsModelStatus.kUnboundedOrInfeasible):
        return _Solution("infeasible", None, seconds)
    # A time limit may still leave a feasible incumbent.
    info = h.getInfo()
    if info.primal_solution_status == 2:  # kSolutionStatusFeasible
        return _Solution(h.modelStatusToString(status).lower(), np.round(_col_values(h)),
                         seconds)
    return _Solution(h.modelStatusToString(status).lower(), None, seconds)


def _neighbourhood(model: IlpModel, x_lp: np.ndarray, time_limit_s: float) -> np.ndarray | None:
    """The best plan whose deltas lie within NEIGHBOURHOOD of the LP's, or None."""
    n = len(model.keys)
    d = x_lp[:n] - x_lp[n:]
    lo = np.maximum(np.floor(d + _INTEGRAL_TOL) - NEIGHBOURHOOD, -model.current)
    hi = np.minimum(np.ceil(d - _INTEGRAL_TOL) + NEIGHBOURHOOD, model.ub[:n])
    hi = np.maximum(hi, lo)
    # delta in [lo, hi] as bounds on add and remove; a key never both adds and removes.
    lb = np.concatenate([np.maximum(lo, 0), np.maximum(-hi, 0)])
    ub = np.concatenate([np.maximum(hi, 0), np.maximum(-lo, 0)])
    h = _highs(model, lb, ub, integer=True, mip_rel_gap=_SUB_GAP, time_limit_s=time_limit_s)
    h.run()
    if h.getInfo().primal_solution_status != 2:
        return None
    x = np.round(_col_values(h))
    rows = model.a @ x
    if np.any(rows < model.row_lo - 1e-6) or np.any(rows > model.row_hi + 1e-6):
        return None  # guard: never hand the full MIP an infeasible start
    return x


def solve_scipy(model: IlpModel, mip_rel_gap: float = MIP_REL_GAP) -> _Solution:
    """The same model through scipy.optimize.milp (a baseline for the benchmark)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    t0 = time.perf_counter()
    res = milp(model.c, integrality=np.ones(len(model.c)),
               bounds=Bounds(model.lb, model.ub),
               constraints=[LinearConstraint(model.a, model.row_lo, model.row_hi)],
               options={"mip_rel_gap": mip_rel_gap})
    seconds = time.perf_counter() - t0
    if res.status == 0:
        return _Solution("optimal", np.round(res.x), seconds)
    return _Solution("infeasible" if res.status == 2 else str(res.message), None, seconds)


def _diagnose(model: IlpModel) -> PlanInfeasible:
    present = [s for s in CONSTRAINT_SETS if s in model.row_sets]
    for s in present:
        if solve_highs(model.without(s)).x is not None:
            return PlanInfeasible(s, "the plan becomes feasible only when this set is "
                                     "dropped; relax it or add GPUs")
    return PlanInfeasible(" + ".join(present),
                          "no single constraint set is to blame; they conflict together")


def solve(inp: PlanInput, time_limit_s: float = 30.0,
          mip_rel_gap: float = MIP_REL_GAP, warm_start: bool = True) -> Plan:
    """The cheapest instance changes meeting SageServe's constraints, or PlanInfeasible."""
    model = build_model(inp)
    sol = solve_highs(model, time_limit_s, mip_rel_gap, warm_start=warm_start)
    if sol.x is None:
        if sol.status == "infeasible":
            raise _diagnose(model)
        raise PlanInfeasible("solver", f"HiGHS stopped with status {sol.status!r}")
    n = len(model.keys)
    add, remove = sol.x[:n], sol.x[n:]
    delta = (add - remove).astype(int)
    counts = (model.current + delta).astype(int)
    objective = float(model.cost_add @ add + model.cost_remove @ remove)
    return Plan(
        deltas={k: int(d) for k, d in zip(model.keys, delta, strict=True)},
        counts={k: int(c) for k, c in zip(model.keys, counts, strict=True)},
        objective=objective, status=sol.status, solve_seconds=sol.seconds,
        variables=2 * n, constraints=model.a.shape[0],
    )
