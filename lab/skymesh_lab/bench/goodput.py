"""Goodput under end-to-end deadlines on a heterogeneous fleet (GoodServe sec. 4.2, Fig. 6).

One region, four replicas of Llama-3.1-8B on different GPUs (2 x L4, 1 x A100, 1 x H100 by
default), Poisson arrivals of held-out prompts (the test split of ShareGPT + GSM8K that the
length model never saw: chat and maths tasks mixed, as GoodServe mixes agentic tasks).
Every request has the same deadline, ``scale x`` the median over the requests of their
alone latency on the mid-tier GPU (A100), for scales 1x-3x (GoodServe's SLO setting).
Every router routes at arrival (blind pushing), as the paper's proxies do, and sees the
same predicted lengths: by default GoodServe's MoE-MLP predictions (the cached model,
trained on first use); ``SKYMESH_LENGTH_PREDICTOR=noisy-oracle|oracle|history|moe``
overrides. Goodput: requests done within their deadline per simulated second; violation
rate: the share that missed it.

The JSON's ``systems`` holds each router's mean over the scales (the contract keys),
``by_scale`` the per-scale figures, ``ablations`` GoodServe without migration and with the
history predictor instead of the MoE model (the paper's Fig. 7).

Fleets (``fleet=``; ``$SKYMESH_GOODPUT_FLEET`` for ``skymesh bench goodput``, ``--fleet``
for ``python -m skymesh_lab.bench.goodput``): ``default`` (2 x L4, A100, H100; deadlines from
the A100) or ``paper``, GoodServe's testbed (H800, A800, A40, 2 x V100 with tensor
parallelism; deadlines from the A800, the paper's mid-tier GPU), or any ``parse_profiles``
mix such as ``a40=2,h100=2`` (deadlines from the A100). ``python -m skymesh_lab.bench.goodput``
also takes ``--rate``, ``--duration``, ``--scales``, ``--seed``, ``--predictor`` and
``--json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from skymesh_lab.sim.deadlines import DEFAULT_DEADLINE_PROFILE, median_alone_latency
from skymesh_lab.sim.runner import SimConfig, Simulation, parse_profiles
from skymesh_lab.sim.workloads.replay import ReplayWorkload, poisson_items
from skymesh_replica.engine.profiles import get_profile

MODES = ("sim",)
PAPER = {"goodput_gain_over_next_best": 0.274}
SYSTEMS = ("goodserve", "least-load", "round-robin", "power-of-two", "prefix-tree", "lmetric",
           "preserve", "vllm-load")
SCALES = (1.0, 1.5, 2.0, 2.5, 3.0)
FLEET = "l4=2,a100=1,h100=1"
# Named fleets: (parse_profiles mix, profile whose alone latencies set the deadlines).
FLEETS: dict[str, tuple[str, str]] = {
    "default": (FLEET, DEFAULT_DEADLINE_PROFILE),
    # GoodServe sec. 4.1: H800, A800, A40 and V100 x 2 (TP 2); deadlines from the A800.
    "paper": ("h800=1,a800=1,a40=1,2xv100=1", "llama3.1-8b-a800"),
}
FLEET_ENV = "SKYMESH_GOODPUT_FLEET"
RATE_RPS = 9.0
PREDICTOR_ENV = "SKYMESH_LENGTH_PREDICTOR"
# "moe" and "wordvec" are trained models whose predictions ride on each request (the
# simulator's "meta" predictor); the others the simulator computes itself.
MODEL_PREDICTORS = ("moe", "wordvec")
PREDICTORS = (*MODEL_PREDICTORS, "noisy-oracle", "oracle", "history")


def sim_predictor(predictor: str) -> str:
    return "meta" if predictor in MODEL_PREDICTORS else predictor


def requests(predictor: str, seed: int) -> list[tuple[int, int, dict[str, object]]]:
    """Held-out prompts in a seeded order, with predicted lengths when a trained model
    predicts."""
    import random

    from skymesh_lab.predict.models import default_split, get_moe, get_wordvec

    _, test = default_split()
    test = list(test)
    random.Random(f"goodput/{seed}").shuffle(test)
    preds: list[int | None] = [None] * len(test)
    if predictor in MODEL_PREDICTORS:
        model = get_moe() if predictor == "moe" else get_wordvec()
        preds = [int(p) for p in model.predict(test)]
    return [(s.prompt_tokens + s.history_tokens, s.output_tokens,
             {} if p is None else {"predicted_output_tokens": p})
            for s, p in zip(test, preds, strict=True)]


def resolve_fleet(fleet: str) -> tuple[str, str, list[str]]:
    """A fleet name or ``parse_profiles`` mix -> (mix, deadline profile, profile per replica)."""
    spec, deadline_profile = FLEETS.get(fleet, (fleet, DEFAULT_DEADLINE_PROFILE))
    if ":" in spec:
        raise ValueError(f"fleet {fleet!r}: one region only (no 'region:' parts)")
    try:
        profiles = parse_profiles(spec, ["us"])["us"]
    except ValueError as exc:
        raise ValueError(f"fleet {fleet!r}: {str(exc).removeprefix('--profiles: ')}; named "
                         f"fleets: {', '.join(FLEETS)}") from None
    if not profiles:
        raise ValueError(f"fleet {fleet!r} has no replicas")
    return spec, deadline_profile, profiles


def run_one(policy: str, scale: float, arrivals: list[Any], base_s: float, predictor: str,
            seed: int, params: dict[str, Any] | None = None,
            fleet: str = FLEET) -> dict[str, Any]:
    profiles = resolve_fleet(fleet)[2]
    cfg = SimConfig(
        workload="replay", regions=["us"], replicas={"us": len(profiles)}, policy=policy,
        policy_params=params or {}, push_mode="bp", forwarding=False,
        replica_profiles={"us": profiles}, deadline_scale=scale,
        deadline_base_s=base_s, seed=seed,
        length_predictor=sim_predictor(predictor),
    )
    r = Simulation(cfg, ReplayWorkload(arrivals)).run()
    keys = ("goodput_rps", "slo_violation_rate", "throughput_rps", "e2e_p50_s", "e2e_p90_s",
            "migrations", "predicted_length_mae", "requests", "completed")
    out = {k: r[k] for k in keys if k in r}
    out["completed_per_replica"] = {k: v["completed"] for k, v in r["per_replica"].items()}
    return out


def main(duration_s: float = 120.0, seed: int = 0, rate_rps: float = RATE_RPS,
         predictor: str = "moe", scales: tuple[float, ...] = SCALES,
         fleet: str = "default") -> dict[str, Any]:
    if predictor not in PREDICTORS:
        raise ValueError(f"{PREDICTOR_ENV}: unknown predictor {predictor!r}; "
                         f"valid: {', '.join(PREDICTORS)}")
    spec, deadline_profile, profiles = resolve_fleet(fleet)
    reqs = requests(predictor, seed)
    arrivals = poisson_items(reqs, rate_rps=rate_rps, duration_s=duration_s, region="us",
                             seed=seed, prefix="goodput")
    base = median_alone_latency(get_profile(deadline_profile),
                                [(a[1].prompt_len, a[1].output_len) for a in arrivals])
    by_scale: dict[str, dict[str, Any]] = {}
    for scale in scales:
        by_scale[f"{scale:g}x"] = {
            name: run_one(name, scale, arrivals, base, predictor, seed, fleet=spec)
            for name in SYSTEMS}
    systems = {
        name: {
            "goodput_rps": statistics.fmean(by_scale[s][name]["goodput_rps"] for s in by_scale),
            "slo_violation_rate": statistics.fmean(
                by_scale[s][name]["slo_violation_rate"] for s in by_scale),
        }
        for name in SYSTEMS
    }
    top = max(scales)
    ablations = {
        "goodserve-no-migration": run_one("goodserve", top, arrivals, base, predictor, seed,
                                          {"migration": False}, fleet=spec),
        "goodserve-history-predictor": run_one("goodserve", top, arrivals, base, "history",
                                               seed, fleet=spec),
    }
    res: dict[str, Any] = {
        "setup": {"fleet": spec, "fleet_name": fleet if fleet in FLEETS else None,
                  "profiles": profiles, "rate_rps": rate_rps, "duration_s": duration_s,
                  "requests": len(arrivals), "deadline_base_s": base,
                  "deadline_profile": deadline_profile, "predictor": predictor,
                  "push_mode": "bp", "seed": seed, "scales": list(scales)},
        "systems": systems, "by_scale": by_scale, "ablations": ablations, "paper": PAPER,
    }
    res["goodserve_gain_over_next_best"] = gain(systems)
    print(format_table(res))
    return res


def gain(systems: dict[str, dict[str, float]]) -> float:
    best_other = max(v["goodput_rps"] for k, v in systems.items() if k != "goodserve")
    return systems["goodserve"]["goodput_rps"] / max(best_other, 1e-9) - 1.0


def format_table(res: dict[str, Any]) -> str:
    setup = res["setup"]
    scales = list(res["by_scale"])
    lines = [f"goodput (req/s within deadline) | fleet {setup['fleet']} | "
             f"{setup['rate_rps']} req/s for {setup['duration_s']:.0f} s | deadline = scale x "
             f"{setup['deadline_base_s']:.2f} s | predictor {setup['predictor']}",
             f"  {'system':<14}" + "".join(f"{s:>8}" for s in scales)
             + f"{'mean':>8}{'viol':>8}"]
    for name, agg in res["systems"].items():
        cells = "".join(f"{res['by_scale'][s][name]['goodput_rps']:>8.2f}" for s in scales)
        lines.append(f"  {name:<14}{cells}{agg['goodput_rps']:>8.2f}"
                     f"{agg['slo_violation_rate'] * 100:>7.1f}%")
    for name, r in res["ablations"].items():
        lines.append(f"  {name} at {scales[-1]}: goodput {r['goodput_rps']:.2f}, "
                     f"violations {r['slo_violation_rate'] * 100:.1f}%")
    lines.append(f"  GoodServe vs next best (mean goodput): "
                 f"{res['goodserve_gain_over_next_best'] * 100:+.1f}% (paper: +27.4% at 2x)")
    return "\n".join(lines)


def run_experiment(args: Any) -> dict[str, Any]:
    """``skymesh bench goodput`` entry point."""
    predictor = os.environ.get(PREDICTOR_ENV, "moe")
    fleet = os.environ.get(FLEET_ENV, "default")
    try:
        return main(duration_s=args.duration or 120.0, seed=args.seed, predictor=predictor,
                    fleet=fleet)
    except ValueError as exc:
        print(f"skymesh bench goodput: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cli(argv: list[str] | None = None) -> int:
    """``python -m skymesh_lab.bench.goodput``: the bench with its module-level options."""
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.goodput",
                                 description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--fleet", default=os.environ.get(FLEET_ENV, "default"),
                    help=f"{' | '.join(FLEETS)} | a mix such as a40=2,h100=2")
    ap.add_argument("--rate", type=float, default=RATE_RPS, help="arrivals per second")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    ap.add_argument("--scales", default=",".join(f"{s:g}" for s in SCALES),
                    help="deadline scales, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--predictor", default=os.environ.get(PREDICTOR_ENV, "moe"),
                    help=" | ".join(PREDICTORS))
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    try:
        scales = tuple(float(x) for x in args.scales.split(","))
        if not scales or min(scales) <= 0:
            raise ValueError(f"--scales: need positive numbers, got {args.scales!r}")
        res = main(duration_s=args.duration, seed=args.seed, rate_rps=args.rate,
                   predictor=args.predictor, scales=scales, fleet=args.fleet)
    except ValueError as exc:
        print(f"python -m skymesh_lab.bench.goodput: {exc}", file=sys.stderr)
        return 2
    from skymesh.util.jsonio import write_json

    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
