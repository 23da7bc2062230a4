"""``skymesh plan``: solve SageServe's capacity ILP from a file, or time it on a random one.

    skymesh plan bench --json out/plan.json          # 10 regions x 8 models x 4 GPU types
    skymesh plan solve --input plan.json --json out/solved.json
    skymesh plan apply --plan out/solved.json [--reserve] [--json out/applied.json]

``plan solve`` reads a JSON object with the fields of :class:`PlanInput` (``current``,
``demand``, ``capacity``, ``gpus_available`` required; ``epsilon``, ``min_instances``,
``max_instances``, ``vm_cost``, ``deploy_cost``, ``gpus_per_instance``,
``min_per_endpoint``, ``max_per_endpoint``, ``churn_cost`` optional) and writes the plan.

``plan apply`` is the AWS reconciler: it reads a plan ``plan solve`` wrote and sets each
(region, model, GPU type)'s Auto Scaling group to the plan's count (``--reserve``: and
holds that many instances in a capacity reservation), with boto3's usual credentials
(``--endpoint-url`` points it at another endpoint, such as moto's server). Applying the
same plan twice changes nothing. Exit 1 when some key failed (each is reported).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # HiGHS and scipy load only when a plan command runs
    from skymesh_controller.planning.ilp import Plan, PlanInput

_REQUIRED = ("current", "demand", "capacity", "gpus_available")


def _write_json(path: str | None, obj: dict[str, Any]) -> None:
    from skymesh.util.jsonio import write_json

    write_json(path, obj)


def plan_input_from_json(obj: Any) -> PlanInput:
    from skymesh_controller.planning.ilp import PlanInput, PlanInputError

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
    from skymesh_controller.planning.ilp import PlanInfeasible, PlanInputError, solve

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


def counts_from_plan_json(obj: Any) -> dict[tuple[str, str, str], int]:
    """Desired instances per (model, region, gpu) from ``plan solve``'s JSON: its
    ``counts`` (non-zero), and 0 for each key its ``changes`` scale away."""
    if not isinstance(obj, dict) or not isinstance(obj.get("counts"), list):
        raise ValueError("not a plan: expected an object with a 'counts' list "
                         "(what `skymesh plan solve --json` writes)")
    out: dict[tuple[str, str, str], int] = {}
    for name in ("changes", "counts"):
        rows = obj.get(name, [])
        if not isinstance(rows, list):
            raise ValueError(f"'{name}' must be a list")
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or not all(
                    isinstance(row.get(k), str) and row.get(k) for k in ("model", "region",
                                                                          "gpu")):
                raise ValueError(f"{name}[{i}]: needs string model, region and gpu")
            key = (row["model"], row["region"], row["gpu"])
            if name == "changes":
                out.setdefault(key, 0)
                continue
            count = row.get("count")
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"counts[{i}]: count must be an integer >= 0")
            out[key] = count
    return out


def _region_map(text: str | None) -> dict[str, str] | None:
    if not text:
        return None
    pairs = [p.partition("=") for p in text.split(",") if p.strip()]
    if not pairs or any(not a.strip() or not b.strip() or sep != "=" for a, sep, b in pairs):
        raise ValueError(f"--regions: expected REGION=AWS_REGION[,...], got {text!r}")
    return {a.strip(): b.strip() for a, _, b in pairs}


def cmd_apply(args: argparse.Namespace) -> int:
    try:
        counts = counts_from_plan_json(json.loads(Path(args.plan).read_text()))
        regions = _region_map(args.regions)
    except OSError as exc:
        print(f"skymesh plan apply: cannot read {args.plan}: {exc.strerror}", file=sys.stderr)
        return 2
    except ValueError as exc:  # JSONDecodeError included
        print(f"skymesh plan apply: {args.plan}: {exc}", file=sys.stderr)
        return 2
    import boto3

    from skymesh_controller.planning.actuate_aws import DEFAULT_REGIONS, AwsActuator

    def factory(service: str, aws_region: str) -> Any:
        return boto3.client(service, region_name=aws_region,
                            endpoint_url=args.endpoint_url)

    act = AwsActuator(client_factory=factory, regions=regions or dict(DEFAULT_REGIONS),
                      reserve=args.reserve)
    report = act.apply_counts(counts)

    def row(c: Any) -> dict[str, Any]:
        return {"model": c.model, "region": c.region, "gpu": c.gpu, "before": c.before,
                "after": c.after}

    for c in report.changed:
        print(f"  group    {c.model:<16} {c.region:<8} {c.gpu:<10} "
              f"{'-' if c.before is None else c.before} -> {c.after}")
    for c in report.reserved:
        print(f"  reserved {c.model:<16} {c.region:<8} {c.gpu:<10} "
              f"{'-' if c.before is None else c.before} -> {c.after}")
    for (m, r, g), err in sorted(report.errors.items()):
        print(f"skymesh plan apply: {m} {r} {g}: {err}", file=sys.stderr)
    print(f"{len(report.changed)} groups changed, {len(report.unchanged)} unchanged, "
          f"{len(report.reserved)} reservations changed, {len(report.errors)} failed")
    _write_json(args.json, {
        "changed": [row(c) for c in report.changed],
        "unchanged": [{"model": m, "region": r, "gpu": g} for m, r, g in report.unchanged],
        "reserved": [row(c) for c in report.reserved],
        "errors": [{"model": m, "region": r, "gpu": g, "error": e}
                   for (m, r, g), e in sorted(report.errors.items())]})
    return 0 if report.ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from skymesh_controller.planning.ilp_bench import print_result, run

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
    print_result(res)
    _write_json(args.json, res)
    return 0


def register(sub: Any) -> None:
    pp = sub.add_parser("plan", help="capacity planning: SageServe's ILP")
    pp.set_defaults(extra="planning")
    psub = pp.add_subparsers(dest="plan_cmd", required=True)
    sp = psub.add_parser("solve", help="solve the ILP for an input file")
    sp.add_argument("--input", required=True, metavar="FILE")
    sp.add_argument("--json", default=None, metavar="PATH")
    sp.add_argument("--time-limit", type=float, default=30.0, metavar="SECONDS")
    sp.set_defaults(fn=cmd_solve)
    ap = psub.add_parser("apply", help="apply a solved plan to AWS Auto Scaling groups")
    ap.add_argument("--plan", required=True, metavar="FILE",
                    help="a plan `skymesh plan solve --json` wrote")
    ap.add_argument("--reserve", action="store_true",
                    help="also hold each count in an EC2 capacity reservation")
    ap.add_argument("--regions", default=None, metavar="MAP",
                    help="region names to AWS regions, e.g. us=us-east-1,eu=eu-west-1 "
                         "(default: us, eu, asia to us-east-1, eu-west-1, ap-northeast-1)")
    ap.add_argument("--endpoint-url", default=None, metavar="URL",
                    help="AWS endpoint to call instead of AWS's (e.g. a moto server)")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.set_defaults(fn=cmd_apply)
    bp = psub.add_parser("bench", help="solve a seeded random instance and time it")
    bp.add_argument("--json", default=None, metavar="PATH")
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--regions", type=int, default=10)
    bp.add_argument("--models", type=int, default=8)
    bp.add_argument("--gpu-types", type=int, default=4)
    bp.add_argument("--no-baseline", action="store_true",
                    help="skip the old-formulation and scipy.optimize.milp comparisons")
    bp.set_defaults(fn=cmd_bench)
