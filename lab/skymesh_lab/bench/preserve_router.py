"""PreServe's anticipating router vs least load (PreServe sec. 5.4, Fig. 10).

Four Llama-3.1-8B replicas on L4s (PreServe serves four LLaMA-2-7B instances), Poisson
arrivals of held-out ShareGPT + GSM8K prompts at a sweep of rates, every request routed at
arrival (blind pushing, PreServe's router in front of its instances) with the same
predicted lengths (GoodServe's MoE-MLP by default; ``SKYMESH_LENGTH_PREDICTOR`` overrides,
as for ``skymesh bench goodput``). Metric: P99 normalised latency (end-to-end latency per
output token), the paper's headline: -41.3% against its best baseline.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from skymesh.util.stats import fmt, ratio, summary
from skymesh_lab.bench.goodput import PREDICTOR_ENV, PREDICTORS, requests, sim_predictor
from skymesh_lab.sim.runner import SimConfig, Simulation
from skymesh_lab.sim.workloads.replay import ReplayWorkload, poisson_items

MODES = ("sim",)
PAPER = {"p99_normalized_latency_change": -0.413}
SYSTEMS = ("preserve", "least-load", "round-robin")
RATES = (2.0, 3.0, 4.0, 5.0)


def run_one(policy: str, arrivals: list[Any], predictor: str, seed: int) -> dict[str, Any]:
    cfg = SimConfig(workload="replay", regions=["us"], replicas={"us": 4}, policy=policy,
                    push_mode="bp", forwarding=False, profile="llama3.1-8b-l4", seed=seed,
                    length_predictor=sim_predictor(predictor))
    sim = Simulation(cfg, ReplayWorkload(arrivals))
    r = sim.run()
    norm = [(x.t_done - x.t_arrival) / x.item.output_len for x in sim.records if x.ok]
    s = summary(norm, (99,))
    return {
        "p99_normalized_latency_s": s["p99"],
        "mean_normalized_latency_s": s["mean"],
        **{k: r[k] for k in ("throughput_rps", "ttft_mean_s", "e2e_p99_s", "preemptions",
                             "completed", "requests")},
    }


def main(duration_s: float = 300.0, seed: int = 0, predictor: str = "moe",
         rates: tuple[float, ...] = RATES) -> dict[str, Any]:
    if predictor not in PREDICTORS:
        raise ValueError(f"{PREDICTOR_ENV}: unknown predictor {predictor!r}; "
                         f"valid: {', '.join(PREDICTORS)}")
    reqs = requests(predictor, seed)
    by_rate: dict[str, dict[str, Any]] = {}
    print(f"PreServe router vs least load | 4 x L4 | {duration_s:.0f} s | predictor {predictor}")
    print(f"  {'rate':>6} {'system':<12}{'P99 norm':>10}{'mean norm':>11}{'TTFT mean':>11}"
          f"{'preempt':>9}")
    for rate in rates:
        arrivals = poisson_items(reqs, rate_rps=rate, duration_s=duration_s, region="us",
                                 seed=seed, prefix="preserve")
        row = {name: run_one(name, arrivals, predictor, seed) for name in SYSTEMS}
        for name, s in row.items():
            print(f"  {rate:>6g} {name:<12}{fmt(s['p99_normalized_latency_s'], '>9.3f')}s"
                  f"{fmt(s['mean_normalized_latency_s'], '>10.3f')}s"
                  f"{fmt(s['ttft_mean_s'], '>10.2f')}s"
                  f"{s['preemptions']:>9}")
        x = ratio(row["preserve"]["p99_normalized_latency_s"],
                  row["least-load"]["p99_normalized_latency_s"])
        change = None if x is None else x - 1.0
        row["preserve_vs_least_load"] = {"p99_normalized_latency_change": change}
        print(f"  {'':>6} PreServe vs least load, P99 normalised latency: "
              f"{fmt(change, '+.1f', 100)}% "
              "(paper -41.3% vs its best baseline)")
        by_rate[f"{rate:g}"] = row
    top = f"{max(rates):g}"
    return {"setup": {"replicas": 4, "profile": "llama3.1-8b-l4", "push_mode": "bp",
                      "duration_s": duration_s, "predictor": predictor, "seed": seed,
                      "rates": list(rates)},
            "systems": {n: by_rate[top][n] for n in SYSTEMS},
            "preserve_vs_least_load": by_rate[top]["preserve_vs_least_load"],
            "by_rate": by_rate, "paper": PAPER}


def run_experiment(args: Any) -> dict[str, Any]:
    """``skymesh bench preserve-router`` entry point."""
    try:
        return main(duration_s=args.duration or 300.0, seed=args.seed,
                    predictor=os.environ.get(PREDICTOR_ENV, "moe"))
    except ValueError as exc:
        print(f"skymesh bench preserve-router: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
