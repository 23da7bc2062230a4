"""What both runners of SkyLB's macrobenchmark share (``skylb_macro`` runs the simulator,
``skylb_live`` real processes): workloads, systems, options, the per-window statistics and
the comparisons of the mesh against the baselines. A module of its own so that neither
runner imports the other back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from skymesh.util.stats import ratio

MODES = ("sim", "live")
REGIONS = ["us", "eu", "asia"]
EVEN = {"us": 4, "eu": 4, "asia": 4}
# SkyLB's unbalanced fleet: 3 in the US, 3 in Asia, 2 in Europe.
UNEVEN = {"us": 3, "eu": 2, "asia": 3}

# SkyLB's figures (sec. 5.1), to print next to ours.
PAPER: dict[str, Any] = {
    "throughput_x": (1.12, 2.06),  # over all baselines, GKE Gateway included
    "throughput_x_vs_single_chat": (1.12, 1.2),
    "latency_x_lower": (1.74, 6.30),
    "ttft_mean_p50_pct_of_baselines": (15.87, 57.63),
    "ttft_p90_pct_of_baselines": (10.08, 23.38),
    "e2e_p50_x": (1.05, 2.14),
    "hit_chat_pct": (36.96, 46.55),
    "hit_tot_pct": (89.56, 90.01),
    "hit_rr_chat_pct": (10.78, 16.57),
    "hit_ll_chat_pct": (28.29, 31.13),
    "hit_rr_ll_tot_pct": (58.66, 59.32),
    "spread_sgl_x": (2.33, 5.08),
    "spread_ch_x": (2.54, 4.92),
    "spread_ch_mixed_x": 3.36,
    "spread_sgl_mixed_x": 2.22,
}
# Targets of the [bench] issue for the mesh (skymesh-prefix).
TARGETS = {"throughput_x_vs_best_single": 1.3, "ttft_p90_frac_of_best_single": 0.10,
           "hit_frac_of_oracle": 0.95}


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    sim_workload: str
    replicas: dict[str, int]
    params: dict[str, Any]
    kind: str  # "chat" or "tot": which of the paper's hit-rate ranges applies
    paper: str
    profile: str = "llama3.1-8b-l4"
    # The client's max_tokens on every request when the workload sets none (None: none).
    max_tokens: int | None = None


WORKLOADS: dict[str, WorkloadSpec] = {
    "chat-arena": WorkloadSpec(
        "chat-arena", "sharegpt-chat", EVEN, {"clients_per_region": 80}, "chat",
        "Fig. 8a/8e/8i (ChatBot Arena, 80 clients per region)"),
    "chat-wildchat": WorkloadSpec(
        "chat-wildchat", "sharegpt-chat", UNEVEN,
        {"clients_per_region": {"us": 40, "eu": 30, "asia": 30}}, "chat",
        "Fig. 8b/8f/8j (WildChat, 40/30/30 clients)"),
    "tot": WorkloadSpec(
        "tot", "tot-gsm8k", EVEN,
        {"clients_per_region": {"us": 40, "eu": 20, "asia": 20}, "branching": 2, "depth": 4,
         "output_scale": 3.0}, "tot",
        "Fig. 8c/8g/8k (tree of thoughts, 2-branch, 40/20/20 clients)"),
    "mixed-tree": WorkloadSpec(
        "mixed-tree", "tot-gsm8k", EVEN,
        {"clients_per_region": {"us": 2, "eu": 20, "asia": 20}, "branching": 2,
         "branching_per_region": {"us": 4}, "depth": 4, "output_scale": 3.0}, "tot",
        "Fig. 8d/8h/8l (mixed tree: US 4-branch x 2 clients, others 2-branch x 20)"),
}

# SkyLB's own clients (lab/skymesh_lab/sim/workloads/tot_skylb.py, ported from its lbbench):
# the trees run ``tot-skylb`` / ``mixed-tree-skylb`` (virtual root, identical siblings,
# max_tokens 256, up to b**4 requests of a tree at once, ``x-hash-key`` = the region as
# SkyLB's client sends it) with the paper's client counts. The chat workloads keep
# ShareGPT conversations at the paper's counts (neither ChatBot Arena nor WildChat is in
# the data set here) with the max_tokens of SkyLB's chat client, 512 (its wildchat.py;
# lab/skymesh_lab/bench/max_tokens.py), which SGLang's admission reserves for.
SKYLB_CHAT_MAX_TOKENS = 512
SKYLB_CLIENT_WORKLOADS: dict[str, WorkloadSpec] = {
    **{w: replace(WORKLOADS[w], max_tokens=SKYLB_CHAT_MAX_TOKENS)
       for w in ("chat-arena", "chat-wildchat")},
    "tot": WorkloadSpec(
        "tot", "tot-skylb", EVEN,
        {"clients_per_region": {"us": 40, "eu": 20, "asia": 20}, "branching": 2}, "tot",
        "Fig. 8c/8g/8k (tree of thoughts, 2-branch, 40/20/20 clients; SkyLB's client)"),
    "mixed-tree": WorkloadSpec(
        "mixed-tree", "mixed-tree-skylb", EVEN,
        {"clients_per_region": {"us": 2, "eu": 20, "asia": 20}, "branching": 2,
         "branching_per_region": {"us": 4}}, "tot",
        "Fig. 8d/8h/8l (mixed tree: US 4-branch x 2 clients, others 2-branch x 20; "
        "SkyLB's client)"),
}
# ``--clients``: whose clients drive the trees.
CLIENT_SETS: dict[str, dict[str, WorkloadSpec]] = {"ours": WORKLOADS,
                                                    "skylb": SKYLB_CLIENT_WORKLOADS}
SCHEDULERS = ("vllm", "sglang")
# SkyLB's own pushing modes, as its paper defines them: no queue for the replica holding
# the prefix and no limit on the hold (the simulator's default is SkyMesh's rule,
# skymesh.policies.load.DEFAULT_PREFER_QUEUE); the SP microbenchmarks reproduce these.
STRICT: dict[str, Any] = {"prefer_queue": 0, "hold_queue_max": None}

# System name -> SimConfig fields. Blind pushing for the single-balancer baselines: the
# routers SkyLB compares with push every request at once (SkyLB sec. 5.1).
SYSTEMS: dict[str, dict[str, Any]] = {
    "single-rr": {"single_balancer": "us", "forwarding": False, "policy": "round-robin",
                  "push_mode": "bp"},
    "single-ll": {"single_balancer": "us", "forwarding": False, "policy": "least-load",
                  "push_mode": "bp"},
    "single-ch": {"single_balancer": "us", "forwarding": False, "policy": "consistent-hash",
                  "push_mode": "bp"},
    "single-sgl": {"single_balancer": "us", "forwarding": False,
                   "policy": "sglang-cache-aware", "push_mode": "bp"},
    "region-local": {"forwarding": False, "policy": "prefix-tree", "push_mode": "sp-p"},
    "skymesh-ch": {"forwarding": True, "policy": "consistent-hash",
                   "peer_policy": "consistent-hash", "push_mode": "sp-p"},
    "skymesh-prefix": {"forwarding": True, "policy": "prefix-tree",
                       "peer_policy": "prefix-tree", "push_mode": "sp-p"},
    "skymesh-lmetric": {"forwarding": True, "policy": "lmetric", "peer_policy": "prefix-tree",
                        "push_mode": "sp-p"},
    # The policy named here is replaced by GlobalCacheOracle once the engines exist.
    "oracle": {"single_balancer": "us", "forwarding": False, "rtt_scale": 0.0,
               "policy": "least-load", "push_mode": "bp"},
}
SINGLE = ("single-rr", "single-ll", "single-ch", "single-sgl")
MESH = "skymesh-prefix"

# Per workload, the client multiplier at which the single US balancers' P90 TTFT reaches
# seconds, as in SkyLB's Figure 8 (sweep in docs/notes/bench.md, "Calibration (session 2,
# later)").
CALIBRATED_LOAD_SCALE: dict[str, float] = {"chat-arena": 2.0, "chat-wildchat": 3.0,
                                           "tot": 3.0, "mixed-tree": 5.0}

DEFAULT_DURATION_S = 600.0
QUICK_DURATION_S = 60.0
QUICK_WORKLOADS = ("chat-wildchat", "mixed-tree")
WARMUP_FRACTION = 0.1
# The contract's keys, then the rest of what we report per run.
CONTRACT_KEYS = ("workload", "system", "throughput_rps", "ttft_mean_s", "ttft_p90_s",
                 "e2e_p50_s", "prefix_hit_rate")


@dataclass
class Options:
    mode: str = "sim"
    duration_s: float = DEFAULT_DURATION_S
    seed: int = 0
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    systems: tuple[str, ...] = tuple(SYSTEMS)
    plots: Path | None = None
    progress: bool = True
    peers: tuple[str, ...] = ()
    # Workload -> client multiplier (missing: 1.0); see parse_load_scale.
    load_scale: dict[str, float] = field(default_factory=dict)
    # The replicas' engine scheduler (SimConfig.scheduler) and whose clients run the trees
    # (a key of CLIENT_SETS).
    scheduler: str = "vllm"
    clients: str = "ours"
    # With the oracle: also run the throughput ceiling (the oracle on 16x the replicas).
    ceiling: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- metrics
# The percentiles of each window: Figure 8's boxes (whiskers p10/p90, box p25/p75).
BOX_QS = (10, 25, 50, 75, 90)


def spread_stats(samples: Sequence[Sequence[int]]) -> dict[str, float]:
    """Outstanding requests per replica across samples: std across replicas and
    max / max(min, 1), each averaged over the samples in which anything was outstanding."""
    rows = [s for s in samples if sum(s) > 0]
    if not rows:
        return {"outstanding_std": 0.0, "outstanding_max_min_x": 0.0}
    a = np.asarray(rows, dtype=float)
    return {"outstanding_std": float(a.std(axis=1).mean()),
            "outstanding_max_min_x": float((a.max(axis=1) / np.maximum(a.min(axis=1), 1.0))
                                           .mean())}


# ---------------------------------------------------------------------------- analysis
def _span(values: Iterable[float | None], scale: float = 1) -> list[float] | None:
    """``[min, max]`` (times ``scale``) of the values that have data; None when none has."""
    have = [v for v in values if v is not None]
    return [scale * min(have), scale * max(have)] if have else None


def by_system(rows: Sequence[dict[str, Any]], workload: str) -> dict[str, dict[str, Any]]:
    return {r["system"]: r for r in rows if r["workload"] == workload}


def comparisons(rows: Sequence[dict[str, Any]], mesh: str = MESH) -> dict[str, dict[str, Any]]:
    """Per workload: the mesh against the best single balancer (by throughput), against
    every baseline, and its hit rate against the oracle's; with the targets' verdicts."""
    out: dict[str, dict[str, Any]] = {}
    for w in dict.fromkeys(r["workload"] for r in rows):
        by = by_system(rows, w)
        if mesh not in by:
            continue
        m = by[mesh]
        singles = [by[s] for s in SINGLE if s in by]
        c: dict[str, Any] = {"mesh": mesh, "mesh_hit_rate": m["prefix_hit_rate"]}
        if singles:
            best = max(singles, key=lambda r: r["throughput_rps"])
            c["best_single"] = best["system"]
            c["throughput_x_vs_best_single"] = ratio(m["throughput_rps"],
                                                     best["throughput_rps"])
            c["ttft_p90_frac_of_best_single"] = ratio(m["ttft_p90_s"], best["ttft_p90_s"])
            c["ttft_mean_frac_of_best_single"] = ratio(m["ttft_mean_s"], best["ttft_mean_s"])
        baselines = [by[s] for s in (*SINGLE, "region-local") if s in by]
        if baselines:
            c["throughput_x_range"] = _span(ratio(m["throughput_rps"], b["throughput_rps"])
                                            for b in baselines)
            c["ttft_mean_x_lower_range"] = _span(ratio(b["ttft_mean_s"], m["ttft_mean_s"])
                                                 for b in baselines)
            c["ttft_p90_pct_of_baselines_range"] = _span(
                (ratio(m["ttft_p90_s"], b["ttft_p90_s"]) for b in baselines), scale=100)
            c["e2e_p50_x_range"] = _span(ratio(b["e2e_p50_s"], m["e2e_p50_s"])
                                         for b in baselines)
        if "oracle" in by:
            c["hit_frac_of_oracle"] = m["prefix_hit_rate"] / max(
                by["oracle"]["prefix_hit_rate"], 1e-9)
        # A ratio without data (None) meets no target.
        thr, p90, hit = (c.get(k) for k in ("throughput_x_vs_best_single",
                                            "ttft_p90_frac_of_best_single",
                                            "hit_frac_of_oracle"))
        c["targets_met"] = {
            "throughput_x_vs_best_single": thr is not None
            and thr >= TARGETS["throughput_x_vs_best_single"],
            "ttft_p90_frac_of_best_single": p90 is not None
            and p90 <= TARGETS["ttft_p90_frac_of_best_single"],
            "hit_frac_of_oracle": hit is not None and hit >= TARGETS["hit_frac_of_oracle"],
        }
        out[w] = c
    return out
