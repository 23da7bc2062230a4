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


def _label(block: dict[str, Any]) -> str:
    return f"{block.get('scheduler')} / {block.get('clients')}"


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
        # SkyLB sec. 5.1: LL is the best single balancer on chat (SkyLB 1.12-1.2x over the
        # single balancers); on uniform ToT CH beats SkyLB by 2%; no such figure for the
        # mixed tree.
        best, vs_best = {"chat": ("LL", _paper_pair(paper, "throughput_x_vs_single_chat",
                                                    ".2f", "x")),
                         "tot": ("CH", "0.98x")}.get(kind, ("-", "-"))
        if w == "mixed-tree":
            best, vs_best = "-", "-"
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


def skylb_macro_faithful(data: dict[str, Any]) -> str:
    setup = data.get("setup", {})
    blocks = data.get("setups", [])
    out = [f"{t.num(setup.get('duration_s'), 'g')} s of client activity per run (the first "
           "10% is warm-up), seed "
           f"{setup.get('seed')}; setups as *scheduler / clients*: `ours` drives the trees "
           "with `tot-gsm8k`, `skylb` with SkyLB's own client (`tot-skylb`, "
           "`mixed-tree-skylb`); chat runs ShareGPT conversations at the paper's client "
           "counts in both. SkyLB's figures: sec. 5.1 and Figure 8 (SGLang on one L4 per "
           "replica).", "", "### The mesh (skymesh-prefix) against the baselines", "",
           macro_headline(data), "", "### Prefix hit rate per system", "", hit_rates(data),
           "", "### Where the load waits (sampled every simulated second in the window)", "",
           where_load_waits(data)]
    faithful = [b for b in blocks if b.get("scheduler") == "sglang"
                and b.get("clients") == "skylb"]
    for b in faithful:
        specs = CLIENT_SETS.get(str(b.get("clients")), skylb_macro.WORKLOADS)
        out += ["", "### Every system, SGLang mode with SkyLB's clients", "",
                skylb_macro.format_tables(b.get("runs", []), "(sglang / skylb)", specs)]
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
