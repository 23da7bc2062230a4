"""Results pages of SkyLB's reproduction on the faithful setup (``skylb_faithful``): the
macrobenchmark and the diurnal cost curve per engine scheduler and client, with SkyLB's
figures beside them. Renderers for ``results_pages``; each reads only the JSON it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from skymesh_lab.bench import results_tables as t
from skymesh_lab.bench import skylb_macro
from skymesh_lab.bench.skylb_setup import CLIENT_SETS, MESH, SINGLE, by_system

ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
CLIENT_NAMES = {"skylb": "SkyLB's clients", "ours": "our clients"}


def _label(block: dict[str, Any]) -> str:
    return f"{block.get('scheduler')} / {block.get('clients')}"


def _long_label(block: dict[str, Any]) -> str:
    sched, clients = str(block.get("scheduler")), str(block.get("clients"))
    return (f"{ENGINE_NAMES.get(sched, sched)} mode with "
            f"{CLIENT_NAMES.get(clients, clients)}")


def _span(span: Sequence[float] | None, fmt: str, suffix: str) -> str:
    return "-" if not span else f"{span[0]:{fmt}}-{span[1]:{fmt}}{suffix}"


def _paper_pair(paper: dict[str, Any], key: str, fmt: str, suffix: str = "") -> str:
    v = paper.get(key)
    return _span(v, fmt, suffix) if isinstance(v, list | tuple) else "-"


def _workloads(blocks: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["workload"] for b in blocks for r in b.get("runs", [])))


def macro_headline(data: dict[str, Any]) -> str:
    """The mesh against the baselines, per workload and setup, with SkyLB's ranges."""
    blocks = data.get("setups", [])
    paper = data.get("paper", {})
    rows = []
    for w in _workloads(blocks):
        for b in blocks:
            c = b.get("comparisons", {}).get(w, {})
            if not c:
                continue
            rows.append([w, _label(b), str(c.get("best_single", "-")),
                         t.num(c.get("throughput_x_vs_best_single"), ".2f", suffix="x"),
                         _span(c.get("throughput_x_range"), ".2f", "x"),
                         t.pct(c.get("ttft_p90_frac_of_best_single")),
                         _span(c.get("ttft_p90_pct_of_baselines_range"), ".1f", "%"),
                         _span(c.get("e2e_p50_x_range"), ".2f", "x"),
                         t.pct(c.get("mesh_hit_rate"))])
        kind = "chat" if w.startswith("chat") else "tot"
        best, vs_best = _paper_vs_best(paper, w)
        rows.append([w, "**paper** (SGLang, SkyLB's clients)", best, vs_best,
                     _paper_pair(paper, "throughput_x", ".2f", "x"), "-",
                     _paper_pair(paper, "ttft_p90_pct_of_baselines", ".2f", "%"),
                     _paper_pair(paper, "e2e_p50_x", ".2f", "x"),
                     _paper_pair(paper, f"hit_{kind}_pct", ".2f", "%")])
    return t.table(["workload", "scheduler / clients", "best single (by throughput)",
                    "mesh vs best single",
                    "mesh vs each baseline", "mesh P90 TTFT, % of best single's",
                    "% of each baseline's", "E2E p50, x lower", "mesh hit rate"],
                   rows, [False, False, False] + [True] * 6)


def _paper_vs_best(paper: dict[str, Any], workload: str) -> tuple[str, str]:
    """SkyLB's best single balancer and the mesh's throughput over it (sec. 5.1): LL on
    chat (1.12-1.2x); on uniform ToT CH beats SkyLB by 2%; no such figure for the mixed
    tree."""
    if workload == "mixed-tree":
        return "-", "-"
    if workload.startswith("chat"):
        return "LL", _paper_pair(paper, "throughput_x_vs_single_chat", ".2f", "x")
    return "CH", "0.98x"


def _mean_span(xs: Sequence[float], fmt: str, scale: float, suffix: str) -> str:
    if not xs:
        return "-"
    vals = [x * scale for x in xs]
    return (f"{sum(vals) / len(vals):{fmt}}{suffix} "
            f"({min(vals):{fmt}}-{max(vals):{fmt}}{suffix})")


def seed_spread(data: dict[str, Any]) -> str:
    """The headline ratios (the mesh against the best single balancer) over every seed of
    the run: mean and min-max per workload and setup, SkyLB's figure beside them. Empty
    when the run had one seed."""
    extra = data.get("by_seed", [])
    if not extra:
        return ""
    paper = data.get("paper", {})
    first = data.get("setup", {}).get("seed")
    at_seeds = [(first, data.get("setups", []))] + [(e.get("seed"), e.get("setups", []))
                                                   for e in extra]
    # (scheduler, clients) -> that setup's comparisons at each seed, in seed order
    comps: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for _, bs in at_seeds:
        for b in bs:
            comps.setdefault((b.get("scheduler"), b.get("clients")), []).append(
                b.get("comparisons", {}))
    workloads = list(dict.fromkeys(w for cs in comps.values() for c in cs for w in c))
    rows = []
    for w in workloads:
        for (sched, clients), cs in comps.items():
            mine = [c[w] for c in cs if c.get(w)]
            if not mine:
                continue
            tput = [c["throughput_x_vs_best_single"] for c in mine
                    if c.get("throughput_x_vs_best_single") is not None]
            p90 = [c["ttft_p90_frac_of_best_single"] for c in mine
                   if c.get("ttft_p90_frac_of_best_single") is not None]
            best = ", ".join(dict.fromkeys(str(c.get("best_single", "-")) for c in mine))
            rows.append([w, f"{sched} / {clients}", str(len(mine)), best,
                         _mean_span(tput, ".2f", 1.0, "x"), _mean_span(p90, ".1f", 100.0, "%")])
        best, vs_best = _paper_vs_best(paper, w)
        rows.append([w, "**paper** (SGLang, SkyLB's clients)", "-", best, vs_best, "-"])
    seeds = ", ".join(str(n) for n, _ in at_seeds)
    return "\n".join([
        f"Seeds {seeds}, each a full run of every system; mean (min-max) over the seeds. "
        "The best single balancer is picked per seed, by throughput. SkyLB gives the P90 "
        "TTFT only against each baseline (the table above).", "",
        t.table(["workload", "scheduler / clients", "seeds", "best single (per seed)",
                 "mesh vs best single, throughput", "mesh P90 TTFT, % of best single's"],
                rows, [False, False, True, False, True, True])])


def hit_rates(data: dict[str, Any]) -> str:
    """Prefix hit rate per system: where locality differs from the paper's."""
    blocks = data.get("setups", [])
    paper = data.get("paper", {})
    systems = [*SINGLE, "region-local", MESH, "oracle"]
    rows = []
    for w in _workloads(blocks):
        for b in blocks:
            by = by_system(b.get("runs", []), w)
            if by:
                rows.append([w, _label(b),
                             *(t.pct(by.get(s, {}).get("prefix_hit_rate")) for s in systems)])
        kind = "chat" if w.startswith("chat") else "tot"
        rr = "hit_rr_chat_pct" if kind == "chat" else "hit_rr_ll_tot_pct"
        ll = "hit_ll_chat_pct" if kind == "chat" else "hit_rr_ll_tot_pct"
        rows.append([w, "**paper**", _paper_pair(paper, rr, ".2f", "%"),
                     _paper_pair(paper, ll, ".2f", "%"), "-", "-", "-",
                     _paper_pair(paper, f"hit_{kind}_pct", ".2f", "%"), "-"])
    return t.table(["workload", "scheduler / clients", *systems], rows,
                   [False, False] + [True] * len(systems))


def where_load_waits(data: dict[str, Any]) -> str:
    """Per setup and system: is any replica's pool full, are requests retracted, and where
    do they wait (replica or balancer)?"""
    rows = []
    blocks = data.get("setups", [])
    for w in _workloads(blocks):
        for b in blocks:
            for s, r in by_system(b.get("runs", []), w).items():
                rows.append([w, _label(b), s, t.pct(r.get("kv_usage_mean")),
                             t.pct(r.get("kv_usage_max_replica_mean")),
                             t.pct(r.get("kv_full_fraction")),
                             t.num(r.get("replica_running_mean"), ".1f"),
                             t.num(r.get("replica_waiting_total_mean"), ".1f"),
                             t.num(r.get("balancer_queue_total_mean"), ".1f"),
                             t.num(r.get("max_balancer_queue"), ",d"),
                             t.num(r.get("forwarded"), ",d"),
                             t.num(r.get("preemptions"), ",d"),
                             t.num(r.get("outstanding_max_min_x"), ".1f", suffix="x")])
    return t.table(["workload", "scheduler / clients", "system", "KV used, mean",
                    "fullest replica's KV, mean", "replica-samples >= 95% KV",
                    "running per replica", "waiting at replicas (total)",
                    "queued at balancers (total)", "max", "forwarded to peers",
                    "retractions", "outstanding max/min"], rows,
                   [False, False, False] + [True] * 10)


def side_by_side(data: dict[str, Any]) -> str:
    """Every system's throughput and latency, one column group per setup, so the engine
    modes read across a row."""
    blocks = data.get("setups", [])
    metrics = (("req/s", "throughput_rps", ".2f", ""), ("TTFT p90", "ttft_p90_s", ".2f", " s"),
               ("E2E p50", "e2e_p50_s", ".1f", " s"))
    rows = []
    for w in _workloads(blocks):
        per_block = [by_system(b.get("runs", []), w) for b in blocks]
        systems = list(dict.fromkeys(s for by in per_block for s in by))
        for s in systems:
            rows.append([w, s, *(t.num(by.get(s, {}).get(key), fmt, suffix=suffix)
                                 for _, key, fmt, suffix in metrics for by in per_block)])
    header = ["workload", "system", *(f"{name}, {_label(b)}" for name, *_ in metrics
                                      for b in blocks)]
    return t.table(header, rows, [False, False] + [True] * (len(header) - 2))


def _seeds_note(setup: dict[str, Any]) -> str:
    seeds = setup.get("seeds") or []
    if len(seeds) < 2:
        return f"seed {setup.get('seed')}"
    return (f"seed {setup.get('seed')} in every table but the one over seeds "
            f"({', '.join(str(n) for n in seeds)})")


def skylb_macro_faithful(data: dict[str, Any]) -> str:
    setup = data.get("setup", {})
    blocks = data.get("setups", [])
    out = [f"{t.num(setup.get('duration_s'), 'g')} s of client activity per run (the first "
           f"10% is warm-up), {_seeds_note(setup)}; setups as *scheduler / clients*: "
           "`ours` drives the trees with `tot-gsm8k`, `skylb` with SkyLB's own client "
           "(`tot-skylb`, `mixed-tree-skylb`); chat runs ShareGPT conversations at the "
           "paper's client counts in both. SkyLB's figures: sec. 5.1 and Figure 8 (SGLang "
           "on one L4 per replica).", "", "### The mesh (skymesh-prefix) against the baselines",
           "",
           macro_headline(data)]
    spread = seed_spread(data)
    if spread:
        out += ["", "### The mesh against the best single balancer over seeds", "", spread]
    if len(blocks) > 1:
        out += ["", "### Every system, the setups side by side", "", side_by_side(data)]
    out += ["", "### Prefix hit rate per system", "", hit_rates(data),
            "", "### Where the load waits (sampled every simulated second in the window)", "",
            where_load_waits(data)]
    for b in blocks:
        specs = CLIENT_SETS.get(str(b.get("clients")), skylb_macro.WORKLOADS)
        out += ["", f"### Every system, {_long_label(b)}", "",
                skylb_macro.format_tables(b.get("runs", []), f"({_label(b)})", specs)]
        ceilings = skylb_macro.format_ceilings(b.get("comparisons", {}))
        if ceilings:
            out += ["", ceilings]
    return "\n".join(out)


def diurnal_cost_faithful(data: dict[str, Any]) -> str:
    paper = data.get("paper", {})
    setup = data.get("setup", {})
    out = [f"{t.num(setup.get('duration_s'), 'g')} s of client activity per run, seed "
           f"{setup.get('seed')}."]
    summary = []
    for b in data.get("setups", []):
        runs = b.get("runs", [])
        by = {(r["system"], r["replicas"]): r["throughput_rps"] for r in runs}
        counts = sorted({r["replicas"] for r in runs})
        meshes = list(dict.fromkeys(r["system"] for r in runs if r["system"] != "region-local"))
        for m in meshes:
            xs = [by[(m, n)] / by[("region-local", n)] for n in counts
                  if (m, n) in by and by.get(("region-local", n))]
            match = b.get("replicas_to_match_12_by_rule", {}).get(m.removeprefix("mesh-"))
            summary.append([str(b.get("scheduler")), m,
                            _span([min(xs), max(xs)] if xs else None, ".2f", "x"),
                            str(match) if match is not None else "not within 6-12"])
        out += ["", f"### {b.get('scheduler')} scheduler", "", t.diurnal_cost(b)]
    lo_hi = paper.get("mesh_x_vs_region_local")
    summary.append(["**paper** (SGLang)", "SkyLB", _span(lo_hi, ".2f", "x"),
                    str(paper.get("replicas_to_match_12", "-"))])
    out[1:1] = ["", "### The mesh against region-local, per scheduler, and the paper", "",
                t.table(["scheduler", "system", "mesh / region-local at equal replicas",
                         "replicas to match region-local-12"], summary,
                        [False, False, True, True])]
    return "\n".join(out)
