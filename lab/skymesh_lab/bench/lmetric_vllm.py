"""LMETRIC vs vLLM's load-only router on prefix-heavy workloads (LMETRIC sec. 6).

Every request is routed at arrival (blind pushing, as LMETRIC's router in front of vLLM
instances does); policies ``lmetric`` (new prefill tokens x batch size, with the hotspot
detector) and ``vllm-load`` (vLLM's 4 x queued + running). The paper reports -92% mean
TTFT and -24% mean TPOT for LMETRIC against vLLM's policy on its ChatBot trace. Runs:

- ``tot-gsm8k``: SkyLB's tree-of-thoughts clients (branching 2, outputs x3), one region of
  4 L4 replicas, at 30 and 80 clients (the headline: 80, near saturation);
- ``mooncake-conversation``: the Mooncake FAST'25 conversation trace at its own pace, on
  8 A100s (its prompts run to tens of thousands of tokens, beyond an L4's context).
"""

from __future__ import annotations

from typing import Any

from skymesh.util.stats import fmt, ratio
from skymesh_lab.sim.runner import SimConfig, run

MODES = ("sim",)
PAPER = {"ttft_mean_change": -0.92, "tpot_mean_change": -0.24}
SYSTEMS = ("lmetric", "vllm-load")
KEYS = ("requests", "completed", "throughput_rps", "ttft_mean_s", "ttft_p90_s", "tpot_mean_s",
        "tpot_p90_s", "e2e_p50_s", "prefix_hit_rate", "preemptions")
RUNS: tuple[tuple[str, str, int, dict[str, Any]], ...] = (
    ("tot-gsm8k/30", "llama3.1-8b-l4", 4,
     {"clients_per_region": 30, "branching": 2, "output_scale": 3.0}),
    ("tot-gsm8k/80", "llama3.1-8b-l4", 4,
     {"clients_per_region": 80, "branching": 2, "output_scale": 3.0}),
    ("mooncake-conversation", "llama3.1-8b-a100", 8, {}),
)
HEADLINE = "tot-gsm8k/80"


def compare(systems: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    lm, vl = systems["lmetric"], systems["vllm-load"]

    def change(key: str) -> float | None:
        x = ratio(lm[key], vl[key])
        return None if x is None else x - 1.0

    return {"ttft_mean_change": change("ttft_mean_s"), "tpot_mean_change": change("tpot_mean_s")}


def main(duration_s: float = 300.0, seed: int = 0) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    print(f"LMETRIC vs vLLM's load score, blind pushing, {duration_s:.0f} s of arrivals")
    print(f"  {'run':<22}{'system':<11}{'req/s':>7}{'TTFT mean':>11}{'TTFT p90':>10}"
          f"{'TPOT mean':>11}{'hit rate':>10}")
    for label, profile, replicas, params in RUNS:
        workload = label.split("/")[0]
        systems: dict[str, dict[str, Any]] = {}
        for name in SYSTEMS:
            cfg = SimConfig(workload=workload, regions=["us"], replicas={"us": replicas},
                            policy=name, push_mode="bp", forwarding=False, profile=profile,
                            seed=seed, duration_s=duration_s, workload_params=params)
            r = run(cfg)
            systems[name] = {k: r[k] for k in KEYS}
            print(f"  {label:<22}{name:<11}{r['throughput_rps']:>7.2f}"
                  f"{fmt(r['ttft_mean_s'], '>10.3f')}s{fmt(r['ttft_p90_s'], '>9.3f')}s"
                  f"{fmt(r['tpot_mean_s'], '>9.1f', 1000)}ms"
                  f"{r['prefix_hit_rate'] * 100:>9.1f}%")
        change = compare(systems)
        print(f"  {'':<22}LMETRIC vs vLLM: mean TTFT "
              f"{fmt(change['ttft_mean_change'], '+.1f', 100)}%, mean TPOT "
              f"{fmt(change['tpot_mean_change'], '+.1f', 100)}% (paper -92%, -24%)")
        runs[label] = {"profile": profile, "replicas": replicas, "params": params,
                       "systems": systems, "lmetric_vs_vllm": change}
    return {"setup": {"push_mode": "bp", "duration_s": duration_s, "seed": seed},
            "systems": runs[HEADLINE]["systems"],
            "lmetric_vs_vllm": runs[HEADLINE]["lmetric_vs_vllm"],
            "runs": runs, "paper": PAPER}


def run_experiment(args: Any) -> dict[str, Any]:
    """``skymesh bench lmetric-vs-vllm`` entry point."""
    return main(duration_s=args.duration or 300.0, seed=args.seed)
