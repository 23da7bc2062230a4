"""``skymesh plan``: solve SageServe's capacity ILP from a file, or time it on a random one.

    skymesh plan bench --json out/plan.json          # 10 regions x 8 models x 4 GPU types
    skymesh plan solve --input plan.json --json out/solved.json

``plan solve`` reads a JSON object with the fields of :class:`PlanInput` (``current``,
``demand``, ``capacity``, ``gpus_available`` required; ``epsilon``, ``min_instances``,
``max_instances``, ``vm_cost``, ``deploy_cost``, ``gpus_per_instance``,
``min_per_endpoint``, ``max_per_endpoint``, ``churn_cost`` optional) and writes the plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # HiGHS and scipy load only when a plan command runs
    from skymesh.planning.ilp import Plan, PlanInput

_REQUIRED = ("current", "demand", "capacity", "gpus_available")


def _write_json(path: str | None, obj: dict[str, Any]) -> None:
    from skymesh.cli import write_json

    write_json(path, obj)


def plan_input_from_json(obj: Any) -> PlanInput:
    from skymesh.planning.ilp import PlanInput, PlanInputError

    if not isinstance(obj, dict):
        raise PlanInputError("the input must be a JSON object")
    known = {f.name for f in fields(PlanInput)}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise PlanInputError(f"unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise PlanInputError(f"missing field(s) {', '.join(missing)}")
    for k, v in obj.items():
        if k in ("epsilon", "churn_cost"):
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise PlanInputError(f"{k} must be a number")
        elif not isinstance(v, dict):
            raise PlanInputError(f"{k} must be an object")
    return PlanInput(**obj)


def plan_to_json(plan: Plan) -> dict[str, Any]:
    return {
        "status": plan.status, "objective": plan.objective,
        "solve_seconds": plan.solve_seconds, "variables": plan.variables,
        "constraints": plan.constraints,
        "changes": [{"model": m, "region": r, "gpu": g, "delta": d}
                    for (m, r, g), d in sorted(plan.changes().items())],
        "counts": [{"model": m, "region": r, "gpu": g, "count": c}
                   for (m, r, g), c in sorted(plan.counts.items()) if c],
    }


def cmd_solve(args: argparse.Namespace) -> int:
    from skymesh.planning.ilp import PlanInfeasible, PlanInputError, solve

    try:
        raw = json.loads(Path(args.input).read_text())
    except OSError as exc:
        print(f"skymesh plan solve: cannot read {args.input}: {exc.strerror}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as exc:
        print(f"skymesh plan solve: {args.input} is not JSON: {exc}", file=sys.stderr)
        return 2
    try:
        plan = solve(plan_input_from_json(raw), time_limit_s=args.time_limit)
    except PlanInfeasible as exc:
        print(f"skymesh plan solve: infeasible: {exc}", file=sys.stderr)
        return 2
    except (PlanInputError, TypeError, ValueError) as exc:
        print(f"skymesh plan solve: bad input: {exc}", file=sys.stderr)
        return 2
    out = plan_to_json(plan)
    print(f"plan {plan.status}: objective {plan.objective:.4g}, "
          f"{len(out['changes'])} changes, solved in {plan.solve_seconds * 1000:.1f} ms")
    for ch in out["changes"]:
        print(f"  {ch['model']:<16} {ch['region']:<12} {ch['gpu']:<12} {ch['delta']:+d}")
    _write_json(args.json, out)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from skymesh.bench.plan_ilp import run

    for name in ("regions", "models", "gpu_types"):
        if getattr(args, name) < 1:
            print(f"skymesh plan bench: --{name.replace('_', '-')} must be at least 1",
                  file=sys.stderr)
            return 2
    if args.gpu_types > 4:
        print("skymesh plan bench: --gpu-types is at most 4", file=sys.stderr)
        return 2
    res = run(args.regions, args.models, args.gpu_types, seed=args.seed,
              baseline=not args.no_baseline)
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
    _write_json(args.json, res)
    return 0


def register(sub: Any) -> None:
    pp = sub.add_parser("plan", help="capacity planning: SageServe's ILP")
    psub = pp.add_subparsers(dest="plan_cmd", required=True)
    sp = psub.add_parser("solve", help="solve the ILP for an input file")
    sp.add_argument("--input", required=True, metavar="FILE")
    sp.add_argument("--json", default=None, metavar="PATH")
    sp.add_argument("--time-limit", type=float, default=30.0, metavar="SECONDS")
    sp.set_defaults(fn=cmd_solve)
    bp = psub.add_parser("bench", help="solve a seeded random instance and time it")
    bp.add_argument("--json", default=None, metavar="PATH")
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--regions", type=int, default=10)
    bp.add_argument("--models", type=int, default=8)
    bp.add_argument("--gpu-types", type=int, default=4)
    bp.add_argument("--no-baseline", action="store_true",
                    help="skip the old-formulation and scipy.optimize.milp comparisons")
    bp.set_defaults(fn=cmd_bench)
