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
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

from skymesh.engine.profiles import get_profile
from skymesh.sim.deadlines import DEFAULT_DEADLINE_PROFILE, median_alone_latency
from skymesh.sim.runner import SimConfig, Simulation, parse_profiles
from skymesh.sim.workloads.replay import ReplayWorkload, poisson_items

MODES = ("sim",)
PAPER = {"goodput_gain_over_next_best": 0.274}
SYSTEMS = ("goodserve", "least-load", "round-robin", "power-of-two", "prefix-tree", "lmetric",
           "preserve", "vllm-load")
SCALES = (1.0, 1.5, 2.0, 2.5, 3.0)
FLEET = "l4=2,a100=1,h100=1"
RATE_RPS = 9.0
PREDICTOR_ENV = "SKYMESH_LENGTH_PREDICTOR"
PREDICTORS = ("moe", "noisy-oracle", "oracle", "history")


def requests(predictor: str, seed: int) -> list[tuple[int, int, dict[str, object]]]:
    """Held-out prompts in a seeded order, with predicted lengths when the MoE predicts."""
    import random

    from skymesh.predict.store import default_split

    _, test = default_split()
    test = list(test)
    random.Random(f"goodput/{seed}").shuffle(test)
    preds: list[int | None] = [None] * len(test)
    if predictor == "moe":
        from skymesh.predict.store import get_moe

        preds = [int(p) for p in get_moe().predict(test)]
    return [(s.prompt_tokens + s.history_tokens, s.output_tokens,
             {} if p is None else {"predicted_output_tokens": p})
            for s, p in zip(test, preds, strict=True)]


def run_one(policy: str, scale: float, arrivals: list[Any], base_s: float, predictor: str,
            seed: int, params: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = SimConfig(
        workload="replay", regions=["us"], replicas={"us": 4}, policy=policy,
        policy_params=params or {}, push_mode="bp", forwarding=False,
        replica_profiles=parse_profiles(FLEET, ["us"]), deadline_scale=scale,
        deadline_base_s=base_s, seed=seed,
        length_predictor="meta" if predictor == "moe" else predictor,
    )
    r = Simulation(cfg, ReplayWorkload(arrivals)).run()
    keys = ("goodput_rps", "slo_violation_rate", "throughput_rps", "e2e_p50_s", "e2e_p90_s",
            "migrations", "predicted_length_mae", "requests", "completed")
    out = {k: r[k] for k in keys if k in r}
    out["completed_per_replica"] = {k: v["completed"] for k, v in r["per_replica"].items()}
    return out


def main(duration_s: float = 120.0, seed: int = 0, rate_rps: float = RATE_RPS,
         predictor: str = "moe", scales: tuple[float, ...] = SCALES) -> dict[str, Any]:
    if predictor not in PREDICTORS:
        raise ValueError(f"{PREDICTOR_ENV}: unknown predictor {predictor!r}; "
                         f"valid: {', '.join(PREDICTORS)}")
    reqs = requests(predictor, seed)
    arrivals = poisson_items(reqs, rate_rps=rate_rps, duration_s=duration_s, region="us",
                             seed=seed, prefix="goodput")
    base = median_alone_latency(get_profile(DEFAULT_DEADLINE_PROFILE),
                                [(a[1].prompt_len, a[1].output_len) for a in arrivals])
    by_scale: dict[str, dict[str, Any]] = {}
    for scale in scales:
        by_scale[f"{scale:g}x"] = {
            name: run_one(name, scale, arrivals, base, predictor, seed) for name in SYSTEMS}
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
                                          {"migration": False}),
        "goodserve-history-predictor": run_one("goodserve", top, arrivals, base, "history",
                                               seed),
    }
    res: dict[str, Any] = {
        "setup": {"fleet": FLEET, "rate_rps": rate_rps, "duration_s": duration_s,
                  "requests": len(arrivals), "deadline_base_s": base,
                  "deadline_profile": DEFAULT_DEADLINE_PROFILE, "predictor": predictor,
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
    try:
        return main(duration_s=args.duration or 120.0, seed=args.seed, predictor=predictor)
    except ValueError as exc:
        print(f"skymesh bench goodput: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
