"""A seeded random capacity-planning instance and the ILP's solve time on it.

``skymesh plan bench`` solves a 10-region x 8-model x 4-GPU instance with HiGHS and, in the
same run, with ``scipy.optimize.milp`` as a baseline (same matrices, same machine).

The instance is feasible by construction: GPUs per (region, GPU type) are sized so every
model's regional and global peaks fit with room to spare, current counts are a random
perturbation of a feasible allocation, and costs follow GPU price order.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from skymesh_controller.planning.ilp import PlanInput, build_model, solve, solve_highs, solve_scipy

GPU_TYPES = ("L4", "A10G", "A100-80GB", "H100-80GB")
# Relative speed and hourly price per GPU (rough public on-demand ratios).
_GPU_SPEED = {"L4": 1.0, "A10G": 1.3, "A100-80GB": 6.0, "H100-80GB": 13.0}
_GPU_PRICE = {"L4": 0.8, "A10G": 1.2, "A100-80GB": 4.1, "H100-80GB": 9.8}
# GPUs of each type per region as a fraction of what the region's own peak would need on
# that type alone (so no single type is everywhere scarce).
AVAIL_LO, AVAIL_HI = 0.5, 1.0


def random_instance(regions: int = 10, models: int = 8, gpu_types: int = 4, seed: int = 0,
                    windows: int = 6, epsilon: float = 0.6) -> PlanInput:
    if not 1 <= gpu_types <= len(GPU_TYPES):
        raise ValueError(f"gpu_types must be in 1..{len(GPU_TYPES)}")
    rng = random.Random(seed)
    region_names = [f"r{j}" for j in range(regions)]
    model_names = [f"m{i}" for i in range(models)]
    gpus = GPU_TYPES[:gpu_types]
    capacity: dict[str, dict[str, float]] = {}
    gpus_per: dict[str, dict[str, int]] = {}
    for m in model_names:
        size = rng.choice((1, 1, 2, 4))  # GPUs per instance: small and large models
        base = rng.uniform(800, 1500) / size
        capacity[m] = {g: base * _GPU_SPEED[g] * size for g in gpus}
        gpus_per[m] = {g: size for g in gpus}
    demand: dict[str, dict[str, list[float]]] = {}
    current: dict[str, dict[str, dict[str, int]]] = {}
    for m in model_names:
        demand[m] = {}
        current[m] = {}
        top = max(capacity[m].values())
        for r in region_names:
            level = rng.uniform(1, 12) * top
            demand[m][r] = [level * rng.uniform(0.6, 1.0) for _ in range(windows)]
            current[m][r] = {g: rng.randint(0, 3) for g in gpus}
    available: dict[str, dict[str, int]] = {}
    for r in region_names:
        # Enough of every GPU type that each region alone could host its own peak twice.
        available[r] = {}
        for g in gpus:
            need = sum(max(demand[m][r]) / capacity[m][g] * gpus_per[m][g]
                       for m in model_names)
            available[r][g] = int(need * rng.uniform(AVAIL_LO, AVAIL_HI)) + 8
    return PlanInput(
        current=current, demand=demand, capacity=capacity, gpus_available=available,
        epsilon=epsilon,
        min_instances={m: regions for m in model_names},
        max_instances={m: 10_000 for m in model_names},
        vm_cost={g: _GPU_PRICE[g] for g in gpus},
        deploy_cost={m: {g: _GPU_PRICE[g] * 10 / 60 * gpus_per[m][g] for g in gpus}
                     for m in model_names},
        gpus_per_instance=gpus_per,
    )


def run(regions: int = 10, models: int = 8, gpu_types: int = 4, seed: int = 0,
        repeats: int = 3, baseline: bool = True) -> dict[str, Any]:
    """Time the planner's solve (LP bound + neighbourhood warm start) against the old
    single HiGHS MIP solve and scipy's milp, all on the same matrices at the same gap.

    The runs are interleaved so that load from other processes hits both alike.
    """
    inp = random_instance(regions, models, gpu_types, seed)
    plan = solve(inp)
    model = build_model(inp)
    n = len(model.keys)

    def cost(x: np.ndarray) -> float:  # the plan's objective, tie-breaker excluded
        return float(model.cost_add @ x[:n] + model.cost_remove @ x[n:])

    new_times = [plan.solve_seconds]
    old_times: list[float] = []
    old_objective = None
    for _ in range(repeats):
        new_times.append(solve_highs(model).seconds)
        if baseline:
            old = solve_highs(model, warm_start=False)
            old_times.append(old.seconds)
            if old.x is not None:
                old_objective = cost(old.x)
    out: dict[str, Any] = {
        "regions": regions, "models": models, "gpu_types": gpu_types,
        "solve_seconds": float(np.median(new_times)),
        "status": plan.status,
        "variables": plan.variables, "constraints": plan.constraints,
        "objective": plan.objective,
        "instances_before": int(model.current.sum()),
        "instances_after": int(sum(plan.counts.values())),
        "moves": int(sum(abs(d) for d in plan.deltas.values())),
        "seed": seed,
        "solver": f"highspy, LP bound + neighbourhood warm start (median of {len(new_times)})",
    }
    if baseline:
        out["old_solve_seconds"] = float(np.median(old_times))
        out["old_objective"] = old_objective
        out["old_solver"] = f"highspy, one MIP solve (median of {len(old_times)})"
        out["speedup_vs_old"] = out["old_solve_seconds"] / out["solve_seconds"]
        sp = solve_scipy(model)
        out["scipy_milp_seconds"] = sp.seconds
        out["scipy_milp_status"] = sp.status
        if sp.x is not None:
            out["scipy_milp_objective"] = cost(sp.x)
        out["speedup_vs_scipy"] = sp.seconds / out["solve_seconds"]
    return out


def print_result(res: dict[str, Any]) -> None:
    """The solve times, as ``skymesh plan bench`` and ``skymesh bench plan-ilp`` print them."""
    print(f"capacity ILP {res['regions']} regions x {res['models']} models x "
          f"{res['gpu_types']} GPU types: {res['variables']} integer variables, "
          f"{res['constraints']} constraints")
    print(f"  highspy       {res['solve_seconds'] * 1000:8.1f} ms  ({res['status']}, "
          f"objective {res['objective']:.2f})")
    if "old_solve_seconds" in res:
        old_obj = res["old_objective"]
        print(f"  old (one MIP) {res['old_solve_seconds'] * 1000:8.1f} ms  (objective "
              f"{'-' if old_obj is None else f'{old_obj:.2f}'}; new "
              f"{res['speedup_vs_old']:.2f}x faster)")
    if "scipy_milp_seconds" in res:
        print(f"  scipy milp    {res['scipy_milp_seconds'] * 1000:8.1f} ms  "
              f"({res['scipy_milp_status']}; highspy {res['speedup_vs_scipy']:.2f}x faster)")


def run_experiment(args: Any) -> dict[str, Any]:
    """``skymesh bench plan-ilp``: the issue's 10 regions x 8 models x 4 GPU types."""
    res = run(seed=args.seed)
    print_result(res)
    return res
