"""SkyLB's macrobenchmark (SkyLB sec. 5.1, Figure 8): ``skymesh bench skylb-macro``.

Three regions (us, eu, asia; the simulator's RTTs: us-eu 75 ms, us-asia 160 ms, eu-asia
225 ms), 12 Llama-3.1-8B replicas on L4, closed-loop clients in every region, one program
(a conversation or a tree) at a time per client. Workloads, mapped to our generators:

===============  ==============================================  ==============  ========
name             SkyLB's                                         clients         replicas
===============  ==============================================  ==============  ========
chat-arena       ChatBot Arena multi-turn chat (Fig. 8a, 8e, 8i)  80 / 80 / 80    4 / 4 / 4
chat-wildchat    WildChat multi-turn chat (Fig. 8b, 8f, 8j)       40 / 30 / 30    3 / 2 / 3
tot              tree of thoughts, 2-branch, depth 4 (Fig. 8c)    40 / 20 / 20    4 / 4 / 4
mixed-tree       US 4-branch trees, others 2-branch (Fig. 8d)     2 / 20 / 20     4 / 4 / 4
===============  ==============================================  ==============  ========

(clients and replicas as us / eu / asia; SkyLB's unbalanced fleet is 3 US, 3 Asia, 2 EU.)
Both chat workloads run ``sharegpt-chat`` (ShareGPT conversations: neither ChatBot Arena
nor WildChat is in the data set here), keyed by conversation; the trees run ``tot-gsm8k``
with ``output_scale`` 3 (an 8B model's reasoning steps, see that module), keyed by
question, the mixed tree through its ``branching_per_region``.

Systems (one policy object per balancer, the same classes ``skymesh-lb`` runs):

- ``single-rr``, ``single-ll``, ``single-ch``, ``single-sgl``: SkyLB's baselines, one
  balancer in the US in front of all 12 replicas with round robin, least load, consistent
  hashing and sglang-router's cache-aware policy, blind pushing as those routers do;
  clients of eu and asia reach it across their RTT, and it reaches remote replicas
  across theirs.
- ``region-local``: a balancer per region on its own replicas only (prefix tree, SP-P).
- ``skymesh-ch``, ``skymesh-prefix``, ``skymesh-lmetric``: the mesh (a balancer per region,
  SP-P, forwarding to peers when its own replicas are full) with consistent hashing, the
  prefix tree (SkyLB) and LMETRIC at the replica layer; the peer layer uses consistent
  hashing for ``skymesh-ch`` (SkyLB-CH) and the prefix tree otherwise.
- ``oracle``: the upper bound for the prefix hit rate. One balancer in front of all 12
  replicas with no network cost between regions (RTTs scaled to 0) and a global, exact
  view of prefix state: :class:`GlobalCacheOracle` reads every replica's KV cache (the
  simulator's engines) and sends the request to the replica caching the longest prefix of
  it, the least loaded among equals, blind pushing (it never defers locality to load).
  Nothing else in the sweep sees more prefix state or gives up more for locality, so its
  hit rate bounds theirs (tested); its throughput and latency are *not* a bound.
  Sim only: no live balancer can read replicas' caches. (A prefix *tree* would be the
  wrong oracle: it records a prefix at dispatch, so with a shared system prompt and no
  load limit the first replica to get one attracts every later tree.)

Metrics are taken over a window: from ``warmup`` (10% of the client activity) to the end
of client activity (``--duration``). Throughput is requests completed in the window per
second; TTFT, E2E (mean, p10/p25/p50/p75/p90) and the prefix hit rate (cached prompt
tokens at admission over prompt tokens) cover the requests issued in the window, which
all complete (the simulator drains). The spread of outstanding requests (running +
waiting per replica, sampled every second in the window) is given as the standard
deviation across replicas and as max / max(min, 1), averaged over samples (SkyLB's
"variance in outstanding request counts" of 2.33-5.08x).

Simplification that favours the single-balancer baselines: the simulator's balancer
probes a remote replica's engine without the round trip a real probe takes (blind
pushing barely uses probes; least load counts its own outstanding requests).

Load calibration (sim only): ``--load-scale X`` multiplies every region's client count
(``--load-scale chat-arena=2,tot=3`` per workload; ``--load-scale calibrated`` is
:data:`CALIBRATED_LOAD_SCALE`). At the paper's counts our 12 L4 replicas are not
saturated (the single balancers' P90 TTFT is 0.35-1.0 s, the paper's reaches seconds);
:data:`CALIBRATED_LOAD_SCALE` is, per workload, the smallest multiplier of a sweep at which
the single balancers' P90 TTFT reaches seconds (docs/notes/bench.md, "Calibration
(session 2, later)").
Only client counts change: request sizes, think time (none, closed loop) and the systems
stay as they are. The JSON's ``setup`` records ``load_scale`` and the scaled counts.

Faithful model (issue #24): ``--scheduler sglang`` runs every replica on SGLang's scheduler
(sim; live: ``skymesh-replica --scheduler sglang``), ``--clients skylb`` SkyLB's own clients
(:data:`~skymesh_lab.bench.skylb_setup.SKYLB_CLIENT_WORKLOADS`: ``tot-skylb``,
``mixed-tree-skylb``, chats with ``max_tokens`` 512). Each run also reports where the load
waited (:mod:`skymesh_lab.bench.engine_probe`). ``skymesh_lab.bench.skylb_faithful`` runs
the sweep per setup for the results pages.

    skymesh bench skylb-macro --mode sim --json out/macro.json --plots out/plots
    python -m skymesh_lab.bench.skylb_macro --mode sim --quick --json out/q.json
    python -m skymesh_lab.bench.skylb_macro --mode live --peers sglang-router,vllm-router
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from skymesh.policies.base import LoadView, Policy, RouteRequest
from skymesh.util.stats import fmt, ratio, summary
from skymesh_lab.bench.engine_probe import EngineProbe
from skymesh_lab.bench.max_tokens import MaxTokens
from skymesh_lab.bench.skylb_setup import (
    BOX_QS,
    CALIBRATED_LOAD_SCALE,
    CLIENT_SETS,
    MESH,
    MODES,
    PAPER,
    QUICK_DURATION_S,
    QUICK_WORKLOADS,
    REGIONS,
    SCHEDULERS,
    SYSTEMS,
    TARGETS,
    WARMUP_FRACTION,
    WORKLOADS,
    Options,
    WorkloadSpec,
    by_system,
    comparisons,
    spread_stats,
)
from skymesh_lab.bench.skylb_setup import (
    CONTRACT_KEYS as CONTRACT_KEYS,  # re-exported: the contract test reads it here
)
from skymesh_lab.sim.runner import SimConfig, Simulation
from skymesh_lab.sim.workloads import build_workload
from skymesh_replica.engine.core import Engine


# ---------------------------------------------------------------------------- load scale
def parse_load_scale(text: str | None) -> dict[str, float]:
    """``--load-scale``: ``"2"`` (every workload), ``"chat-arena=2,tot=3"`` (the rest 1)
    or ``"calibrated"`` (:data:`CALIBRATED_LOAD_SCALE`). Returns a multiplier for every
    workload; raises ``ValueError`` on unknown workloads and non-positive multipliers."""
    out = dict.fromkeys(WORKLOADS, 1.0)
    text = (text or "").strip()
    if not text:
        return out
    if text == "calibrated":
        out.update(CALIBRATED_LOAD_SCALE)
        return out
    if "=" not in text:
        pairs = [(w, text) for w in WORKLOADS]
    else:
        pairs = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name.strip() not in WORKLOADS:
                raise ValueError(f"load scale {part!r}: expected WORKLOAD=X with WORKLOAD in "
                                 f"{list(WORKLOADS)}")
            pairs.append((name.strip(), value))
    for name, value in pairs:
        x = float(value)
        if not x > 0:
            raise ValueError(f"load scale for {name} must be positive, got {value!r}")
        out[name] = x
    return out


def scale_clients(spec: WorkloadSpec, x: float) -> WorkloadSpec:
    """``spec`` with every region's ``clients_per_region`` multiplied by ``x`` (rounded;
    a region that had clients keeps at least one). Nothing else changes."""
    if x == 1.0:
        return spec

    def one(n: int) -> int:
        return max(1, round(n * x)) if n > 0 else 0

    params = dict(spec.params)
    c = params["clients_per_region"]
    params["clients_per_region"] = ({r: one(n) for r, n in c.items()} if isinstance(c, dict)
                                    else one(int(c)))
    return replace(spec, params=params)


# ---------------------------------------------------------------------------- metrics
def window_metrics(sim: Simulation, t0: float, t1: float) -> dict[str, Any]:
    """Throughput, latencies, hit rate and spread over client activity ``[t0, t1)``."""
    recs = [r for r in sim.records if r.ok]
    done_in = sum(1 for r in recs if t0 <= r.t_done < t1)
    issued = [r for r in recs if t0 <= r.t_arrival < t1]
    prompt = sum(r.item.prompt_len for r in issued)
    hits = sum(r.hit_tokens for r in issued)
    out: dict[str, Any] = {"throughput_rps": done_in / max(t1 - t0, 1e-9)}
    out.update(summary([r.t_first - r.t_arrival for r in issued], BOX_QS, prefix="ttft_",
                       suffix="_s"))
    out.update(summary([r.t_done - r.t_arrival for r in issued], BOX_QS, prefix="e2e_",
                       suffix="_s"))
    out["prefix_hit_rate"] = hits / prompt if prompt else 0.0
    interval = sim.cfg.sample_interval_s
    samples = [s for i, s in enumerate(sim.spread_samples) if t0 <= i * interval < t1]
    out.update(spread_stats(samples))
    out["requests"] = len(issued)
    out["failed"] = sum(1 for r in sim.records if r.error)
    return out


# ---------------------------------------------------------------------------- sim runs
class GlobalCacheOracle(Policy):
    """Longest prefix actually cached, over every replica's engine; least loaded among
    equals. Deliberately unregistered: it needs the simulator's engines, so no config can
    name it."""

    def __init__(self, engines: Mapping[str, Engine], *, rng: random.Random | None = None
                 ) -> None:
        super().__init__(rng=rng)
        self.engines = dict(engines)

    def select(self, request: RouteRequest, candidates: Sequence[str], view: LoadView
               ) -> str | None:
        keys = request.prefix_keys
        best: list[str] = []
        depth = -1
        for c in candidates:
            d = len(self.engines[c].kv.match_prefix(keys)) if keys else 0
            if d > depth:
                depth, best = d, [c]
            elif d == depth:
                best.append(c)
        return self._least(best, lambda c: view.load(c).outstanding)


def install_oracle(sim: Simulation, seed: int) -> None:
    engines = {r.id: r.engine for r in sim.replicas}
    for bal in sim.balancers.values():
        disp = bal.dispatcher
        disp.policy = GlobalCacheOracle(engines, rng=random.Random(seed))
        disp.hold_s = disp.hold_s  # re-derive whether the (new) policy can hold requests


def sim_config(spec: WorkloadSpec, system: str, duration_s: float, seed: int,
               scheduler: str = "vllm") -> SimConfig:
    fields = dict(SYSTEMS[system])
    return SimConfig(workload=spec.sim_workload, regions=list(REGIONS),
                     replicas=dict(spec.replicas), seed=seed, duration_s=duration_s,
                     workload_params=dict(spec.params), profile=spec.profile,
                     scheduler=scheduler, **fields)


def run_sim(spec: WorkloadSpec, system: str, duration_s: float, seed: int,
            scheduler: str = "vllm") -> dict[str, Any]:
    cfg = sim_config(spec, system, duration_s, seed, scheduler)
    workload = build_workload(cfg.workload, regions=list(REGIONS), seed=seed,
                              duration_s=duration_s, **cfg.workload_params)
    if spec.max_tokens is not None:
        workload = MaxTokens(workload, spec.max_tokens)
    sim = Simulation(cfg, workload)
    if system == "oracle":
        install_oracle(sim, seed)
    t0, t1 = WARMUP_FRACTION * duration_s, duration_s
    probe = EngineProbe(sim, t0, t1)
    res = sim.run()
    row: dict[str, Any] = {"workload": spec.name, "system": system}
    row.update(window_metrics(sim, t0, t1))
    row.update(probe.summary())
    row["forwarded"] = sum(s["forwarded_out"] for s in res["region_stats"].values())
    row["preemptions"] = res["preemptions"]
    row["max_balancer_queue"] = res["max_balancer_queue"]
    row["wall_seconds"] = res["wall_seconds"]
    return row


# The ceiling's fleet, per region, as a multiple of the workload's: enough that no request
# queues and every batch stays small (4x and 16x differ by under 4% in throughput).
CEILING_REPLICAS_X = 16


def throughput_ceiling(spec: WorkloadSpec, duration_s: float, seed: int,
                       scheduler: str = "vllm") -> dict[str, Any]:
    """What any placement could serve this client population at most: the oracle (every
    prefix found, no WAN) in front of ``CEILING_REPLICAS_X`` times the replicas, so no
    request waits and decode runs at its small-batch speed. Closed-loop clients send their
    next request only after the reply, so no router on the real fleet does more."""
    big = replace(spec, replicas={r: CEILING_REPLICAS_X * n for r, n in spec.replicas.items()})
    row = run_sim(big, "oracle", duration_s, seed, scheduler)
    return {"throughput_rps": row["throughput_rps"], "ttft_p90_s": row["ttft_p90_s"],
            "e2e_p50_s": row["e2e_p50_s"], "replicas_x": CEILING_REPLICAS_X}


def add_ceilings(comp: dict[str, dict[str, Any]], rows: Sequence[dict[str, Any]],
                 ceilings: Mapping[str, dict[str, Any]]) -> None:
    """Each workload's ceiling against its best single balancer, beside the mesh's ratio."""
    for w, ceil in ceilings.items():
        c = comp.get(w)
        if c is None or "best_single" not in c:
            continue
        best = by_system(rows, w)[c["best_single"]]
        c["ceiling_throughput_x_vs_best_single"] = ratio(ceil["throughput_rps"],
                                                         best["throughput_rps"])
        c["ceiling_ttft_p90_frac_of_best_single"] = ratio(ceil["ttft_p90_s"],
                                                          best["ttft_p90_s"])


def format_ceilings(comp: Mapping[str, dict[str, Any]]) -> str:
    rows = [(w, c) for w, c in comp.items() if "ceiling_throughput_x_vs_best_single" in c]
    if not rows:
        return ""
    lines = ["### Throughput ceiling and TTFT floor (any placement, this client population)", "",
             f"The oracle with {CEILING_REPLICAS_X}x the replicas and no WAN: what no router "
             "on the real fleet can beat. Ratios are to the best single balancer.", "",
             "| workload | best single | throughput: mesh | ceiling | target |"
             " P90 TTFT: mesh | ceiling | target |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for w, c in rows:
        lines.append(f"| {w} | {c['best_single']} |"
                     f" {fmt(c['throughput_x_vs_best_single'], '.3f')}x |"
                     f" {fmt(c['ceiling_throughput_x_vs_best_single'], '.3f')}x |"
                     f" >= {TARGETS['throughput_x_vs_best_single']:g}x |"
                     f" {fmt(c['ttft_p90_frac_of_best_single'], '.1f', 100)}% |"
                     f" {fmt(c['ceiling_ttft_p90_frac_of_best_single'], '.1f', 100)}% |"
                     f" <= {100 * TARGETS['ttft_p90_frac_of_best_single']:g}% |")
    return "\n".join(lines)


def sweep(opts: Options, runner: Callable[[WorkloadSpec, str], dict[str, Any]],
          specs: Mapping[str, WorkloadSpec] | None = None) -> list[dict[str, Any]]:
    from tqdm import tqdm

    specs = WORKLOADS if specs is None else specs
    jobs = [(w, s) for w in opts.workloads for s in opts.systems]
    rows: list[dict[str, Any]] = []
    with tqdm(jobs, desc=f"skylb-macro {opts.mode}", unit="run", file=sys.stderr,
              disable=not opts.progress) as bar:
        for w, s in bar:
            bar.set_postfix_str(f"{w} / {s}")
            rows.append(runner(specs[w], s))
    return rows


# ---------------------------------------------------------------------------- analysis
def _range(span: Sequence[float] | None, spec: str) -> str:
    return "n/a" if span is None else f"{span[0]:{spec}}-{span[1]:{spec}}"


def _paper_hit(kind: str) -> str:
    lo, hi = PAPER["hit_chat_pct" if kind == "chat" else "hit_tot_pct"]
    return f"{lo:.2f}-{hi:.2f}%"


def format_tables(rows: Sequence[dict[str, Any]], label: str = "",
                  specs: Mapping[str, WorkloadSpec] | None = None) -> str:
    """Markdown: one table per workload, then the mesh against the paper and the targets."""
    specs = WORKLOADS if specs is None else specs
    lines: list[str] = []
    comp = comparisons(rows)
    for w in dict.fromkeys(r["workload"] for r in rows):
        spec = specs.get(w)
        by = by_system(rows, w)
        head = f"### {w}" + (f": {spec.paper}" if spec else "") + (f" {label}" if label else "")
        lines += ["", head, "",
                  "| system | req/s | TTFT mean | TTFT p50 | TTFT p90 | E2E mean | E2E p50 |"
                  " E2E p90 | hit rate | outstanding std | max/min |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for s, r in by.items():
            lines.append(
                f"| {s} | {r['throughput_rps']:.2f} | {fmt(r['ttft_mean_s'], '.2f')} s |"
                f" {fmt(r['ttft_p50_s'], '.2f')} s | {fmt(r['ttft_p90_s'], '.2f')} s |"
                f" {fmt(r['e2e_mean_s'], '.1f')} s | {fmt(r['e2e_p50_s'], '.1f')} s |"
                f" {fmt(r['e2e_p90_s'], '.1f')} s |"
                f" {100 * r['prefix_hit_rate']:.1f}% | {r.get('outstanding_std', 0.0):.1f} |"
                f" {r.get('outstanding_max_min_x', 0.0):.1f}x |")
        c = comp.get(w)
        if c and "best_single" in c:
            kind = spec.kind if spec else ""
            lines += ["", f"{MESH} vs best single balancer ({c['best_single']}): throughput "
                      f"{fmt(c['throughput_x_vs_best_single'], '.2f')}x (target >= 1.3x), P90 "
                      f"TTFT {fmt(c['ttft_p90_frac_of_best_single'], '.1f', 100)}% of it "
                      "(target <= 10%; "
                      f"paper 10.08-23.38% of baselines), hit rate "
                      f"{100 * c['mesh_hit_rate']:.1f}%"
                      + (f" (paper {_paper_hit(kind)})" if kind else "")
                      + (f", {100 * c['hit_frac_of_oracle']:.1f}% of the oracle's "
                         "(target >= 95%)" if "hit_frac_of_oracle" in c else "") + "."]
    if comp:
        lines += ["", "### The mesh against SkyLB's figures" + (f" {label}" if label else ""),
                  "", "| workload | throughput vs baselines | mean TTFT, x lower |"
                  " P90 TTFT, % of baselines | E2E p50, x lower | hit rate | vs oracle |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for w, c in comp.items():
            if "throughput_x_range" not in c:
                continue
            t, lat, p90, e2e = (c["throughput_x_range"], c["ttft_mean_x_lower_range"],
                                c["ttft_p90_pct_of_baselines_range"], c["e2e_p50_x_range"])
            vs = (f"{100 * c['hit_frac_of_oracle']:.1f}%" if "hit_frac_of_oracle" in c
                  else "-")
            lines.append(f"| {w} | {_range(t, '.2f')}x | {_range(lat, '.2f')}x |"
                         f" {_range(p90, '.1f')}% | {_range(e2e, '.2f')}x |"
                         f" {100 * c['mesh_hit_rate']:.1f}% | {vs} |")
        lines.append("| paper (SkyLB) | 1.12-2.06x | 1.74-6.30x | 10.08-23.38% | 1.05-2.14x |"
                     " chat 36.96-46.55%, ToT 89.56-90.01% | - |")
    return "\n".join(lines).lstrip("\n")


# ---------------------------------------------------------------------------- plots
def write_plots(rows: Sequence[dict[str, Any]], outdir: Path, prefix: str = "skylb-macro"
                ) -> list[str]:
    """Per workload, Figure 8's panels: throughput, TTFT (log) and E2E boxes (whiskers
    p10/p90, box p25/p75, line p50, triangle mean), plus the hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        by = by_system(rows, w)
        names = list(by)
        fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
        x = np.arange(len(names))
        axes[0].bar(x, [by[n]["throughput_rps"] for n in names], color="tab:blue")
        axes[0].set_ylabel("requests / s")
        axes[0].set_title("throughput")
        for ax, key, title in ((axes[1], "ttft", "TTFT (s, log)"), (axes[2], "e2e", "E2E (s)")):
            # No data (None) plots as NaN: an empty box, not a zero latency.
            box = {n: {k: np.nan if v is None else v for k, v in by[n].items()}
                   for n in names}
            stats: list[dict[str, Any]] = [
                {"label": n, "whislo": box[n][f"{key}_p10_s"], "q1": box[n][f"{key}_p25_s"],
                 "med": box[n][f"{key}_p50_s"], "q3": box[n][f"{key}_p75_s"],
                 "whishi": box[n][f"{key}_p90_s"], "mean": box[n][f"{key}_mean_s"],
                 "fliers": []} for n in names]
            ax.bxp(stats, showmeans=True, showfliers=False,
                   meanprops={"marker": "v", "markerfacecolor": "k", "markeredgecolor": "k"},
                   medianprops={"color": "red"})
            if key == "ttft":
                ax.set_yscale("log")
            ax.set_title(title)
        axes[3].bar(x, [100 * by[n]["prefix_hit_rate"] for n in names], color="tab:green")
        axes[3].set_ylabel("%")
        axes[3].set_title("prefix hit rate")
        for ax in axes:
            ax.set_xticks(x if ax in (axes[0], axes[3]) else x + 1)
            ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        fig.suptitle(f"{prefix}: {w}")
        fig.tight_layout()
        path = outdir / f"{prefix}-{w}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


# ---------------------------------------------------------------------------- entry
def run_sim_sweep(opts: Options, specs: Mapping[str, WorkloadSpec] | None = None
                  ) -> dict[str, Any]:
    base = CLIENT_SETS[opts.clients] if specs is None else specs
    scale = {w: float(opts.load_scale.get(w, 1.0)) for w in opts.workloads}
    specs = {w: scale_clients(base[w], scale.get(w, 1.0)) for w in base}

    def one(spec: WorkloadSpec, system: str) -> dict[str, Any]:
        return run_sim(spec, system, opts.duration_s, opts.seed, opts.scheduler)

    t0 = time.perf_counter()
    rows = sweep(opts, one, specs)
    comp = comparisons(rows)
    ceilings: dict[str, dict[str, Any]] = {}
    if "oracle" in opts.systems and opts.ceiling:
        ceilings = {w: throughput_ceiling(specs[w], opts.duration_s, opts.seed,
                                          opts.scheduler)
                    for w in opts.workloads}
        add_ceilings(comp, rows, ceilings)
    return {
        "runs": rows,
        "comparisons": comp,
        "ceiling": ceilings,
        "paper": PAPER,
        "targets": TARGETS,
        "setup": {"mode": "sim", "regions": REGIONS, "scheduler": opts.scheduler,
                  "clients": opts.clients,
                  "duration_s": opts.duration_s, "warmup_s": WARMUP_FRACTION * opts.duration_s,
                  "seed": opts.seed, "load_scale": scale,
                  "workloads": {w: {"sim_workload": specs[w].sim_workload,
                                    "profile": specs[w].profile,
                                    "max_tokens": specs[w].max_tokens,
                                    "replicas": specs[w].replicas,
                                    "params": specs[w].params} for w in opts.workloads},
                  "systems": {s: SYSTEMS[s] for s in opts.systems}},
        "wall_seconds": time.perf_counter() - t0,
    }


def run(opts: Options, specs: Mapping[str, WorkloadSpec] | None = None) -> dict[str, Any]:
    if opts.mode == "live":
        from skymesh_lab.bench import skylb_live

        res = skylb_live.run(opts)
        label = "(live, scaled down, 2 shared cores)"
    else:
        res = run_sim_sweep(opts, specs)
        specs = CLIENT_SETS[opts.clients] if specs is None else specs
        scaled = {w: x for w, x in res["setup"]["load_scale"].items() if x != 1.0}
        label = (f"(simulator, {opts.scheduler} scheduler, {opts.clients} clients"
                 + (", clients x " + ", ".join(f"{x:g} on {w}" for w, x in scaled.items())
                    if scaled else "") + ")")
    print(format_tables(res["runs"], label, specs))
    ceilings = format_ceilings(res.get("comparisons", {}))
    if ceilings:
        print("\n" + ceilings)
    extra = res.get("peers_table")
    if extra:
        print("\n" + extra)
    if opts.plots is not None:
        res["plots"] = write_plots(res["runs"], opts.plots,
                                   prefix=f"skylb-macro-{opts.mode}")
        print("\nplots: " + ", ".join(res["plots"]))
    return res


def options_from_args(args: Any) -> Options:
    """``skymesh bench`` passes its namespace; flags it lacks take their defaults."""
    quick = bool(getattr(args, "quick", False))
    mode = getattr(args, "mode", "sim") or "sim"
    duration = getattr(args, "duration", None)
    workloads = getattr(args, "workloads", None)
    peers = getattr(args, "peers", None) or ""
    plots = getattr(args, "plots", None)
    load_scale = getattr(args, "load_scale", None)
    try:
        scale = parse_load_scale(load_scale)
    except ValueError as e:
        raise SystemExit(f"skylb-macro: {e}") from None
    scheduler = getattr(args, "scheduler", None) or "vllm"
    clients = getattr(args, "clients", None) or "ours"
    if scheduler not in SCHEDULERS:
        raise SystemExit(f"skylb-macro: unknown scheduler {scheduler!r}; known: "
                         f"{list(SCHEDULERS)}")
    if clients not in CLIENT_SETS:
        raise SystemExit(f"skylb-macro: unknown clients {clients!r}; known: "
                         f"{list(CLIENT_SETS)}")
    if mode == "live" and clients != "ours":
        raise SystemExit("skylb-macro: --clients applies to --mode sim only (live mode has "
                         "its own clients)")
    if mode == "live" and any(x != 1.0 for x in scale.values()):
        raise SystemExit("skylb-macro: --load-scale applies to --mode sim only (live mode "
                         "has its own scaled-down client counts)")
    opts = Options(
        mode=mode, seed=int(getattr(args, "seed", 0) or 0),
        workloads=tuple(workloads.split(",")) if workloads else
        (QUICK_WORKLOADS if quick else tuple(WORKLOADS)),
        plots=Path(plots) if plots else None,
        progress=not getattr(args, "no_progress", False),
        peers=tuple(p.strip() for p in peers.split(",") if p.strip()),
        load_scale=scale, scheduler=scheduler, clients=clients,
        extra={"quick": quick, "duration_given": duration is not None,
               "workloads_given": bool(workloads)},
    )
    if duration is not None:
        opts.duration_s = float(duration)
    elif quick:
        opts.duration_s = QUICK_DURATION_S
    unknown = [w for w in opts.workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"skylb-macro: unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    return opts


def run_experiment(args: Any) -> dict[str, Any]:
    """``skymesh bench skylb-macro`` entry point."""
    return run(options_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.skylb_macro",
                                 description="SkyLB's macrobenchmark (see the module doc)")
    ap.add_argument("--mode", choices=MODES, default="sim")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--plots", default=None, metavar="DIR")
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds of client activity per run (sim default 600, quick 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="two workloads (chat-wildchat, mixed-tree), short runs")
    ap.add_argument("--workloads", default=None, help=f"comma list of {list(WORKLOADS)}")
    ap.add_argument("--peers", default=None,
                    help="live: PyPI routers to run too, e.g. sglang-router,vllm-router")
    ap.add_argument("--load-scale", default=None, metavar="X",
                    help="sim: multiply client counts by X, per workload as "
                         "chat-arena=2,tot=3, or 'calibrated' (see the module doc)")
    ap.add_argument("--scheduler", choices=SCHEDULERS, default="vllm",
                    help="the replicas' engine scheduler (sim; live: skymesh-replica's)")
    ap.add_argument("--clients", choices=tuple(CLIENT_SETS), default="ours",
                    help="whose tree-of-thoughts clients: ours (tot-gsm8k) or skylb "
                         "(tot-skylb, mixed-tree-skylb; SkyLB's lbbench client)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    from skymesh.util.jsonio import write_json

    args = build_parser().parse_args(argv)
    res = run_experiment(args)
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
