"""The lab's subcommands of ``skymesh``: ``sim``, ``bench`` and ``demo``.

The ``skymesh`` CLI (data plane) discovers them through the ``skymesh.commands`` entry
points this distribution declares (lab/pyproject.toml), so they exist wherever the lab is
installed and are absent from ``skymesh --help`` without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from skymesh.policies import policy_names
from skymesh.policies.load import DEFAULT_HOLD_QUEUE_MAX, PushMode
from skymesh.policies.peers import DEFAULT_FORWARDING_RULE, ForwardingRule
from skymesh.util.jsonio import write_json
from skymesh.util.stats import fmt
from skymesh_replica.engine.core import SCHEDULERS
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, PROFILES


def _kv_params(pairs: list[str] | None, flag: str) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}``; values parsed as JSON when they can be."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag}: expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _count_or_none(value: str) -> int | None:
    """A count >= 0, or None for ``none``; -1 for anything else (the caller reports it)."""
    if value == "none":
        return None
    return int(value) if value.isdigit() else -1


def _print_sim(res: dict[str, Any]) -> None:
    rows = [
        ("requests / completed", f"{res['requests']} / {res['completed']}"),
        ("throughput", f"{res['throughput_rps']:.3f} req/s, "
                       f"{res['output_tokens_per_s']:.0f} output tok/s"),
        ("TTFT mean / p50 / p90", f"{fmt(res['ttft_mean_s'], '.3f')} / "
                                  f"{fmt(res['ttft_p50_s'], '.3f')} / "
                                  f"{fmt(res['ttft_p90_s'], '.3f')} s"),
        ("E2E p50 / p90 / p99", f"{fmt(res['e2e_p50_s'], '.2f')} / "
                                f"{fmt(res['e2e_p90_s'], '.2f')} / "
                                f"{fmt(res['e2e_p99_s'], '.2f')} s"),
        ("TPOT mean", f"{fmt(res['tpot_mean_s'], '.1f', 1000)} ms"),
        ("prefix hit rate", f"{res['prefix_hit_rate'] * 100:.2f} %"),
        ("outstanding std (mean)", f"{res['outstanding_std_mean']:.2f}"),
        ("GPU-hours", f"{res['gpu_hours']:.3f}"),
        ("simulated / wall", f"{res['sim_seconds']:.1f} s / {res['wall_seconds']:.2f} s "
                             f"({res['speedup']:.0f}x real time)"),
    ]
    stats = res.get("region_stats", {})
    if len(stats) > 1:
        rows.append(("per region", ", ".join(
            f"{r}: served {s['served']}, out {s['forwarded_out']}, in {s['forwarded_in']}"
            for r, s in stats.items())))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def cmd_sim(args: argparse.Namespace) -> int:
    if (args.workload is None) == (args.experiment is None):
        print("skymesh sim: give exactly one of --workload and --experiment", file=sys.stderr)
        return 2
    if args.experiment is not None:
        from skymesh_lab.planning.capacity_week import run_cli

        return run_cli(args)
    from skymesh_lab.sim.runner import SimConfig, parse_profiles, parse_replicas, run

    regions = [r.strip() for r in args.regions.split(",") if r.strip()]
    if not regions:
        raise SystemExit("--regions: give at least one region")
    try:
        replicas = parse_replicas(args.replicas, regions)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        profiles = parse_profiles(args.profiles, regions) if args.profiles else None
    except ValueError as exc:
        print(f"skymesh sim: {exc}", file=sys.stderr)
        return 2
    hold_max = _count_or_none(args.hold_queue_max)
    if (args.prefer_queue is not None and args.prefer_queue < 0) or hold_max == -1:
        print("skymesh sim: --prefer-queue and --hold-queue-max take a count >= 0",
              file=sys.stderr)
        return 2
    cfg = SimConfig(
        workload=args.workload,
        regions=regions,
        replicas=replicas,
        policy=args.policy,
        policy_params=_kv_params(args.policy_param, "--policy-param"),
        push_mode=args.push_mode,
        max_outstanding=args.max_outstanding,
        **({"hold_s": args.hold} if args.hold is not None else {}),
        prefer_queue=args.prefer_queue,
        hold_queue_max=hold_max,
        forwarding=not args.region_local,
        workers=args.workers,
        peer_policy=args.peer_policy,
        tau=args.tau,
        forwarding_rule=args.forwarding_rule,
        profile=args.profile,
        scheduler=args.scheduler,
        seed=args.seed,
        duration_s=args.duration,
        probe_interval_s=args.probe_interval,
        workload_params=_kv_params(args.param, "--param"),
        progress=not args.no_progress and sys.stderr.isatty(),
        replica_profiles=profiles,
        deadline_scale=args.deadline_scale,
        length_predictor=args.length_predictor,
    )
    try:
        res = run(cfg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"skymesh sim: {exc}", file=sys.stderr)
        return 2
    print(f"sim {cfg.workload} | policy {cfg.policy} ({cfg.push_mode}) | profile {cfg.profile}"
          f" | replicas {replicas}")
    _print_sim(res)
    write_json(args.json, res)
    return 0


# Experiments of ``skymesh bench``: name -> module whose ``run_experiment(args)`` returns
# the JSON object.
BENCH_EXPERIMENTS: dict[str, str] = {
    "sp-microbench": "skymesh_lab.bench.sp_microbench",
    "diurnal-cost": "skymesh_lab.bench.diurnal",
    "goodput": "skymesh_lab.bench.goodput",
    "lmetric-vs-vllm": "skymesh_lab.bench.lmetric_vllm",
    "preserve-router": "skymesh_lab.bench.preserve_router",
    "skylb-macro": "skymesh_lab.bench.skylb_macro",
    "mooncake": "skymesh_lab.bench.mooncake",
    # [planning]'s experiments, reachable from the same command as the rest.
    "capacity-week": "skymesh_lab.planning.capacity_week",
    "plan-ilp": "skymesh_controller.planning.ilp_bench",
}
# Live-only experiments (real processes, minutes of machine time): reachable from
# ``skymesh bench`` but not in ``make bench``'s loop over the experiments in sim mode.
LIVE_BENCH_EXPERIMENTS: dict[str, str] = {
    "router-overhead": "skymesh_lab.bench.router_overhead",
}

# Modules adding their own subcommands through ``register(subparsers)``.
COMMAND_MODULES: tuple[str, ...] = (
    "skymesh_lab.predict.cli",
    "skymesh_controller.planning.forecast_cli",
    "skymesh.ops.ctl",
    "skymesh.ops.dns_cli",
    "skymesh_controller.planning.plan_cli",
    "skymesh_lab.faults.cli",
)


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module({**BENCH_EXPERIMENTS,
                                      **LIVE_BENCH_EXPERIMENTS}[args.experiment])
    modes = getattr(module, "MODES", ("sim",))
    args.mode = args.mode or modes[0]
    if args.mode not in modes:
        print(f"skymesh bench {args.experiment}: --mode {args.mode} is not available "
              f"(this experiment runs with --mode {'|'.join(modes)})", file=sys.stderr)
        return 2
    res = module.run_experiment(args)
    write_json(args.json, res)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.autopilot:
        from skymesh_lab.demos import autopilot

        opts = autopilot.Options(day_s=args.day_seconds, peak_rps=args.peak_rps,
                                 seed=args.seed)
        return autopilot.main(opts, args.arms.split(","), args.json, args.plot)
    from skymesh_lab.demos.meshdemo import run_demo

    return run_demo(duration=args.duration, seed=args.seed, json_path=args.json)


def register_sim(sub: Any) -> None:
    sp = sub.add_parser("sim", help="run a workload through the discrete-event simulator")
    sp.add_argument("--workload", default=None,
                    help="mooncake-conversation, mooncake-synthetic, azure2023-code, "
                         "azure2023-conv, sharegpt-chat, tot-gsm8k, tot-skylb, "
                         "mixed-tree-skylb, poisson")
    sp.add_argument("--experiment", default=None, choices=["capacity-week"],
                    help="instead of --workload: capacity-week (scaling strategies, a week)")
    sp.add_argument("--days", type=float, default=None,
                    help="capacity-week: simulated days (default 7; --duration also works)")
    sp.add_argument("--forecaster", default=None,
                    help="capacity-week: forecaster name (default seasonal-naive)")
    sp.add_argument("--week-param", action="append", metavar="KEY=VALUE", help="capacity-week: a WeekConfig field, e.g. batch_share=0.14 (repeatable)")  # noqa: E501
    sp.add_argument("--policy", default="prefix-tree", choices=policy_names())
    sp.add_argument("--regions", default="us,eu,asia")
    sp.add_argument("--replicas", default="3", help="N (spread evenly) or us=4,eu=4,asia=4")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--duration", type=float, default=None,
                    help="seconds of simulated time during which clients issue requests")
    sp.add_argument("--json", default=None, metavar="PATH")
    sp.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    sp.add_argument("--push-mode", default="sp-p", choices=[m.value for m in PushMode])
    sp.add_argument("--scheduler", default="vllm", choices=SCHEDULERS,
                    help="the replicas' engine scheduler: vllm (v1) or sglang (v0.4.x)")
    sp.add_argument("--max-outstanding", type=int, default=16, help="cap for --push-mode sp-o")
    sp.add_argument("--hold", type=float, default=None, metavar="SECONDS",
                    help="delay scheduling: how long a request may wait for the replica "
                         "holding its prefix (default 2)")
    sp.add_argument("--prefer-queue", type=int, default=None, metavar="N",
                    help="sp-p: the replica holding a request's prefix may take it while "
                         "fewer than N requests are pending there (0: strict sp-p; default: "
                         "the scheduler's, vllm 3, sglang 8)")
    sp.add_argument("--hold-queue-max", default=str(DEFAULT_HOLD_QUEUE_MAX), metavar="N",
                    help="no request is held for its preferred replica while the balancer's "
                         f"queue is longer than N (default {DEFAULT_HOLD_QUEUE_MAX}; none: no "
                         "limit, SkyLB's)")
    sp.add_argument("--probe-interval", type=float, default=0.1)
    sp.add_argument("--region-local", action="store_true",
                    help="no cross-region forwarding (each region on its own replicas)")
    sp.add_argument("--workers", type=int, default=1, metavar="N",
                    help="each region's skymesh-lb as N workers (listen.workers; needs "
                         "--region-local)")
    sp.add_argument("--peer-policy", default="prefix-tree", choices=policy_names(),
                    help="policy choosing among peer balancers when forwarding")
    sp.add_argument("--tau", type=int, default=2,
                    help="forward only to peers whose queue is at most this long")
    sp.add_argument("--forwarding-rule", default=DEFAULT_FORWARDING_RULE.value,
                    choices=[r.value for r in ForwardingRule],
                    help="overflow: to a peer only when no local replica is available "
                         "(SkyLB); balanced: also when a peer is less loaded per replica")
    sp.add_argument("--param", action="append", metavar="KEY=VALUE",
                    help="workload parameter (repeatable), e.g. clients_per_region=30")
    sp.add_argument("--policy-param", action="append", metavar="KEY=VALUE")
    sp.add_argument("--no-progress", action="store_true")
    sp.add_argument("--profiles", default=None, metavar="MIX",
                    help="mixed GPUs: l4=2,a100=1,h100=1 in every region, or "
                         "us:h100=2;eu:l4=4 (replaces --replicas/--profile where given)")
    sp.add_argument("--deadline-scale", type=float, default=None, metavar="X",
                    help="deadline per request = X times its alone latency on an A100; "
                         "reports goodput_rps and slo_violation_rate")
    sp.add_argument("--length-predictor", default="none", metavar="NAME",
                    help="predicted output lengths for the policy: none, oracle, "
                         "noisy-oracle, history, meta")
    sp.set_defaults(fn=cmd_sim)



def register_bench(sub: Any) -> None:
    bp = sub.add_parser("bench", help="reproduce an experiment and print its figures")
    bp.add_argument("experiment", choices=sorted({**BENCH_EXPERIMENTS,
                                                  **LIVE_BENCH_EXPERIMENTS}))
    bp.add_argument("--mode", choices=["sim", "live"], default=None,
                    help="default: sim, or live for a live-only experiment")
    bp.add_argument("--json", default=None, metavar="PATH")
    bp.add_argument("--duration", type=float, default=None,
                    help="simulated seconds of client activity per run")
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    bp.add_argument("--quick", action="store_true",
                    help="a short subset (skylb-macro: what the tests run)")
    bp.add_argument("--peers", default=None, metavar="ROUTERS",
                    help="live: also run these PyPI routers in front of the same replicas, "
                         "e.g. sglang-router,vllm-router")
    bp.add_argument("--workloads", default=None, metavar="NAMES",
                    help="skylb-macro: only these workloads (comma-separated)")
    bp.add_argument("--load-scale", default=None, metavar="X",
                    help="skylb-macro sim: client multiplier (X, WORKLOAD=X,..., or "
                         "calibrated)")
    bp.add_argument("--scheduler", choices=["vllm", "sglang"], default="vllm",
                    help="skylb-macro, diurnal-cost: the replicas' engine scheduler")
    bp.add_argument("--clients", choices=["ours", "skylb"], default="ours",
                    help="skylb-macro: whose tree-of-thoughts clients (skylb: SkyLB's)")
    from skymesh_lab.predict.cli import BENCH_PREDICTORS, PredictorFlag
    bp.add_argument("--predictor", action=PredictorFlag, choices=BENCH_PREDICTORS,
                    default=None, help="length predictor of goodput and preserve-router "
                                       "(default moe; else $SKYMESH_LENGTH_PREDICTOR)")
    from skymesh_lab.bench.router_overhead import add_arguments as router_overhead_args
    router_overhead_args(bp)
    bp.set_defaults(fn=cmd_bench)



def register_demo(sub: Any) -> None:
    dp = sub.add_parser("demo", help="run the local three-region mesh for real")
    dp.add_argument("--duration", type=float, default=20.0,
                    help="seconds of client load per mode (mesh, then region-local)")
    dp.add_argument("--json", default=None, metavar="PATH")
    dp.add_argument("--seed", type=int, default=0)
    dp.add_argument("--autopilot", action="store_true",
                    help="the planner on a time-compressed day instead (docs/autopilot.md)")
    dp.add_argument("--day-seconds", type=float, default=192.0,
                    help="--autopilot: seconds per compressed day (a multiple of 24)")
    dp.add_argument("--peak-rps", type=float, default=3.0,
                    help="--autopilot: requests/s of a region at its busiest hour")
    dp.add_argument("--arms", default="fixed,reactive,autopilot",
                    help="--autopilot: arms to run (at once): fixed, reactive, autopilot")
    dp.add_argument("--plot", default=None, metavar="PNG", help="--autopilot: the plot")
    dp.set_defaults(fn=cmd_demo)

