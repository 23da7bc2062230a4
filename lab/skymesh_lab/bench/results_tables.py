"""Markdown tables for the results pages (``skymesh_lab.bench.results_pages``), one renderer per
benchmark JSON. A renderer reads only the JSON it is given, so a page changes only when its
data does. Missing values print as "-" rather than 0: no data is not a zero latency.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from skymesh_lab.bench import skylb_macro

Renderer = Callable[[dict[str, Any]], str]


def table(header: Sequence[str], rows: Sequence[Sequence[str]],
          right: Sequence[bool] | None = None) -> str:
    """A Markdown table; ``right[i]`` right-aligns column i (numbers)."""
    right = right or [False] * len(header)
    rule = ["---:" if r else "---" for r in right]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def num(x: Any, fmt: str, scale: float = 1.0, suffix: str = "") -> str:
    if x is None or not isinstance(x, int | float):
        return "-"
    return f"{x * scale if scale != 1.0 else x:{fmt}}{suffix}"


def pct(x: Any, digits: int = 1) -> str:
    return num(x, f",.{digits}f", 100.0, "%")


def secs(x: Any, digits: int = 2) -> str:
    return num(x, f",.{digits}f", 1.0, " s")


def run_note(run: dict[str, Any]) -> str:
    """How the data was measured (``NAME.run.json``), as one sentence."""
    cpus = run.get("cpus")
    return (f"Measured {run.get('date', '?')} on {cpus} CPUs shared with other jobs "
            f"(load average {num(run.get('load_average_1m_at_start'), '.2f')} at start), "
            f"{num(run.get('wall_seconds'), ',.0f')} s of wall time, "
            f"commit `{run.get('commit') or 'unknown'}`.")


def sp_microbench(data: dict[str, Any]) -> str:
    out = []
    paper = data.get("paper", {})
    for clients, block in data.get("by_clients", {}).items():
        rows = [[mode, num(s.get("throughput_rps"), ".2f"), secs(s.get("ttft_p90_s")),
                 secs(s.get("ttft_mean_s")), secs(s.get("e2e_p50_s"), 1),
                 pct(s.get("prefix_hit_rate")), num(s.get("max_balancer_queue"), "d")]
                for mode, s in block.get("systems", {}).items()]
        out += [f"**{clients} clients**", "",
                table(["mode", "req/s", "TTFT p90", "TTFT mean", "E2E p50", "hit rate",
                       "balancer queue max"], rows, [False] + [True] * 6), ""]
        r = block.get("ratios", {})
        out += [f"SP-P against BP: {num(r.get('throughput_x_vs_bp'), '.2f')}x the throughput "
                f"(SkyLB: {num(paper.get('throughput_x_vs_bp'), '.2f')}x), BP's P90 TTFT over "
                f"SP-P's {num(r.get('ttft_p90_x_vs_bp'), '.2f')} (SkyLB: "
                f"{num(paper.get('ttft_p90_x_vs_bp'), '.2f')}); SP-P against SP-O: "
                f"{num(r.get('throughput_x_vs_sp_o'), '.2f')}x the throughput (SkyLB: "
                f"{num(paper.get('throughput_x_vs_sp_o'), '.2f')}x).", ""]
    return "\n".join(out).rstrip()


def diurnal_cost(data: dict[str, Any]) -> str:
    runs = data.get("runs", [])
    systems = list(dict.fromkeys(r["system"] for r in runs))
    counts = sorted({r["replicas"] for r in runs})
    by = {(r["system"], r["replicas"]): r for r in runs}
    meshes = [s for s in systems if s.startswith("mesh")]
    rows = []
    for n in counts:
        row = [str(n)]
        for s in systems:
            r = by.get((s, n), {})
            row.append(f"{num(r.get('throughput_rps'), '.2f')} "
                       f"({secs(r.get('ttft_p90_s'))})")
        row.append(" / ".join(
            num(by.get((s, n), {}).get("region_stats", {}).get("us", {}).get("forwarded_out"),
                ",d") for s in meshes))
        rows.append(row)
    header = ["replicas", *(f"{s}: req/s (TTFT p90)" for s in systems),
              f"forwarded from us ({' / '.join(meshes)})"]
    match = data.get("replicas_to_match_12_by_rule", {})
    said = "; ".join(f"mesh with `{rule}`: {n if n is not None else 'not within the range'}"
                     for rule, n in match.items())
    return "\n".join([table(header, rows, [True] * len(header)), "",
                      f"Replicas needed to match region-local with 12: {said}."])


def plan_ilp(data: dict[str, Any]) -> str:
    rows = [[str(data.get("solver", "planner")), num(data.get("solve_seconds"), ",.0f", 1e3,
                                                     " ms"),
             str(data.get("status", "-")), num(data.get("objective"), ",.2f")]]
    if "old_solve_seconds" in data:
        rows.append([str(data.get("old_solver", "one MIP")),
                     num(data.get("old_solve_seconds"), ",.0f", 1e3, " ms"), "-",
                     num(data.get("old_objective"), ",.2f")])
    if "scipy_milp_seconds" in data:
        rows.append(["scipy.optimize.milp", num(data.get("scipy_milp_seconds"), ",.0f", 1e3,
                                                " ms"),
                     str(data.get("scipy_milp_status", "-")),
                     num(data.get("scipy_milp_objective"), ",.2f")])
    head = (f"{data.get('regions')} regions x {data.get('models')} models x "
            f"{data.get('gpu_types')} GPU types: {data.get('variables')} integer variables, "
            f"{data.get('constraints')} constraints, seed {data.get('seed')}.")
    tail = (f"Planner against one MIP: {num(data.get('speedup_vs_old'), '.1f')}x faster; "
            f"against scipy: {num(data.get('speedup_vs_scipy'), '.1f')}x.")
    return "\n".join([head, "", table(["solver", "solve time", "status", "objective"], rows,
                                      [False, True, False, True]), "", tail])


def forecast_eval(data: dict[str, Any]) -> str:
    rows = [[name, pct(f.get("mean_ape"), 2), pct(f.get("max_ape")),
             num(f.get("n_scored"), "d"), num(f.get("refits"), "d"),
             secs(f.get("fit_seconds"), 1), secs(f.get("walk_seconds"), 1)]
            for name, f in data.get("forecasters", {}).items()]
    series = str(data.get("series", "")).rsplit("/", 1)[-1]
    head = (f"Series `{series}`, column `{data.get('column')}`, "
            f"{data.get('window')} windows, {data.get('protocol')}, horizon "
            f"{data.get('horizon')}; {data.get('n_train')} windows train, "
            f"{data.get('n_test')} test.")
    return "\n".join([head, "", table(["forecaster", "mean APE", "max APE", "windows scored",
                                       "refits", "fit", "walk"], rows,
                                      [False] + [True] * 6)])


def capacity_week(data: dict[str, Any]) -> str:
    strategies = data.get("strategies", {})
    base = strategies.get("reactive", {}).get("gpu_hours")
    rows = []
    for name, s in strategies.items():
        b = s.get("batch", {})
        sub = b.get("submitted_tokens") or 0
        batch = (f"{pct(b.get('served_tokens', 0) / sub)} / "
                 f"{pct(b.get('expired_tokens', 0) / sub)}" if sub else "-")
        ratio = num(s["gpu_hours"] / base, ".3f", suffix="x") if base else "-"
        rows.append([name, num(s.get("gpu_hours"), ",.0f"), ratio,
                     pct(s.get("slo_attainment"), 2), pct(s.get("p95_windows_met")),
                     num(s.get("scaling_events"), ",d"), num(s.get("scaling_gpu_hours"), ",.1f"),
                     batch])
    setup = data.get("setup", {})
    head = (f"{num(setup.get('days'), 'g')} days, {num(setup.get('step_s'), 'g')} s steps, "
            f"seed {setup.get('seed')}, forecaster `{setup.get('forecaster')}`, headroom "
            f"{num(setup.get('headroom'), 'g')}, epsilon {num(setup.get('epsilon'), 'g')}, "
            f"batch share {num(setup.get('batch_share'), 'g')}.")
    out = [head, "", table(["strategy", "GPU-hours", "vs reactive", "SLO attainment",
                            "3-hour windows with p95 in SLO", "scaling events",
                            "GPU-h paid while starting", "batch served / expired"], rows,
                           [False] + [True] * 7)]
    par = data.get("clairvoyant_parity")
    if par:
        out += ["", f"A clairvoyant allocator (fractional instances, no cold starts, no "
                f"forecast error) needs {num(par.get('vs_reactive'), '.3f')}x reactive's "
                f"GPU-hours to match reactive's SLO attainment model by model."]
    return "\n".join(out)


def targets_table(res: dict[str, Any]) -> str:
    comp = res.get("comparisons", {})
    if not comp:
        return ""
    lines = ["| workload | mesh vs best single: throughput (>= 1.3x) | P90 TTFT (<= 10%) |"
             " hit rate vs oracle (>= 95%) |", "| --- | --- | --- | --- |"]
    for w, c in comp.items():
        met: dict[str, bool] = c.get("targets_met", {})

        def mark(key: str, met: dict[str, bool] = met) -> str:
            return "met" if met.get(key) else "not met"

        thr = c.get("throughput_x_vs_best_single")
        p90 = c.get("ttft_p90_frac_of_best_single")
        hit = c.get("hit_frac_of_oracle")
        lines.append(
            f"| {w} | {thr:.2f}x vs {c.get('best_single')} ({mark('throughput_x_vs_best_single')})"
            f" | {100 * p90:.1f}% ({mark('ttft_p90_frac_of_best_single')}) | "
            + (f"{100 * hit:.1f}% ({mark('hit_frac_of_oracle')})" if hit is not None
               else "no oracle in live mode") + " |"
            if thr is not None and p90 is not None else f"| {w} | - | - | - |")
    return "\n".join(lines)


def skylb_macro_runs(data: dict[str, Any]) -> str:
    """``skymesh bench skylb-macro``: per-workload tables, the targets, the ceiling."""
    out = [skylb_macro.format_tables(data.get("runs", []))]
    tt = targets_table(data)
    if tt:
        out += ["", "Targets (mesh = skymesh-prefix):", "", tt]
    ceilings = skylb_macro.format_ceilings(data.get("comparisons", {}))
    if ceilings:
        out += ["", ceilings]
    return "\n".join(out)


def vllm_fidelity(data: dict[str, Any]) -> str:
    """``tools/e2e/fidelity_bench.py``: real vLLM against the emulator fitted to it."""
    m, p, runs = data.get("measured", {}), data.get("profile", {}), data.get("runs", {})
    names = list(runs)

    def us(x: Any, fmt: str) -> str:
        return num(x, fmt, 1e6, " us")

    fit = table(["measured on vLLM", "", "fitted emulator profile", ""], [
        ["decode step, 1 sequence", secs(m.get("decode_step_1_s"), 4),
         "t_overhead (a step)", secs(p.get("t_overhead"), 4)],
        ["decode step, 4 sequences", secs(m.get("decode_step_4_s"), 4),
         "t_kv_token (a context token read)", us(p.get("t_kv_token"), ".2f")],
        [f"1-token completion, {num(m.get('short_prompt_tokens'), 'd')}-token prompt",
         secs(m.get("short_prompt_latency_s"), 3), "t_token (a prompt token)",
         us(p.get("t_token"), ".1f")],
        [f"1-token completion, {num(m.get('long_prompt_tokens'), 'd')}-token prompt",
         secs(m.get("long_prompt_latency_s"), 3), "not modelled: per request",
         secs(m.get("unmodelled_per_request_s"), 3)]], [False, True, False, True])
    rows = [[label, *(fmt(runs[n].get(key)) for n in names)] for key, label, fmt in (
        ("ttft_p50_s", "TTFT p50", secs), ("ttft_p90_s", "TTFT p90", secs),
        ("completion_s", "all done", secs), ("waiting_mean", "waiting, mean", _f2),
        ("waiting_max", "waiting, max", _f2), ("running_mean", "running, mean", _f2),
        ("failed", "failed", _f2), ("loadavg_mean", "load average", _f2))]
    bins = {n: per_second(runs[n].get("series", [])) for n in names}
    series = [[str(s), *(f"{bins[n][s][i]:.1f}" if s in bins[n] else "-"
                         for n in names for i in (0, 1))]
              for s in sorted({s for b in bins.values() for s in b})]
    st = data.get("setup", {})
    head = (f"{st.get('engine')} ({st.get('model')}, max_num_seqs {st.get('max_num_seqs')}); "
            f"measured {m.get('reps')} times each, interleaved (medians). Workload: "
            f"{st.get('requests')} streaming chats at {st.get('rate_per_s')} per second "
            f"(seeded Poisson, seed {st.get('seed')}), max_tokens "
            f"{'..'.join(str(x) for x in st.get('max_tokens', []))}, ignore_eos.")
    return "\n".join([head, "", fit, "",
                      table(["", *names], rows, [False] + [True] * len(names)), "",
                      "Waiting and running per second, as each engine's /metrics showed "
                      "them (mean of the samples in that second):", "",
                      table(["second", *(f"{n} {g}" for n in names
                                         for g in ("waiting", "running"))],
                            series, [True] * (1 + 2 * len(names)))])


def _f2(x: Any) -> str:
    return num(x, ".2f") if isinstance(x, float) else num(x, "d")


def per_second(series: Sequence[Sequence[float]]) -> dict[int, tuple[float, float]]:
    """Mean (waiting, running) per whole second of ``[[t, waiting, running], ...]``."""
    bins: dict[int, list[tuple[float, float]]] = {}
    for t, w, r in series:
        bins.setdefault(int(t), []).append((w, r))
    return {s: (sum(x[0] for x in v) / len(v), sum(x[1] for x in v) / len(v))
            for s, v in sorted(bins.items())}


def predict_eval(data: dict[str, Any]) -> str:
    """``skymesh predict eval``: output-length predictors on the held-out split, overall,
    per source, and PreServe's Table 2 for scale."""
    named = [(f"{name} (all)", p) for name, p in data.get("predictors", {}).items()]
    for src, by in data.get("by_source", {}).items():
        named += [(f"{name} ({src})", p) for name, p in by.items()]
    if data.get("paper_preserve_table2"):
        named.append(("PreServe, Table 2", data["paper_preserve_table2"]))
    rows = [[name, num(p.get("mae_tokens"), ".2f"), pct(p.get("acc25"), 2),
             pct(p.get("acc50"), 2), pct(p.get("acc100"), 2),
             num(p.get("ms_per_request"), ".2f", suffix=" ms")] for name, p in named]
    samples = data.get("samples", {})
    return "\n".join([f"{samples.get('train')} training and {samples.get('test')} test "
                      "samples.", "", table(["predictor", "MAE (tokens)", "Acc-25", "Acc-50",
                                             "Acc-100", "time per request"], rows,
                                            [False] + [True] * 5)])


def security(data: dict[str, Any]) -> str:
    """``skymesh_lab.faults.security_figures``: the adversarial pass's counts and RSS."""
    fuzz = data.get("fuzz", {})
    rows = [[name, num(f.get("cases"), ",d"), num(f.get("2xx"), ",d"), num(f.get("4xx"), ",d"),
             num(f.get("5xx"), ",d")] for name, f in fuzz.items()]
    urls, takeover = data.get("urls", {}), data.get("takeover", {})
    idle = data.get("idle", {})
    rss = idle.get("rss_mb", {})
    checks = [
        ["adversarial URLs refused at registration (422)",
         f"{num(urls.get('refused'), 'd')} of {num(urls.get('tried'), 'd')}"],
        ["record takeovers by another agent refused (409/403)",
         f"{num(takeover.get('refused'), 'd')} of {num(takeover.get('tried'), 'd')}"],
        ["idle keep-alive connections opened by one client",
         num(idle.get("connections"), ",d")],
        [f"served / refused at the per-client cap ({num(idle.get('per_client_cap'), ',d')})",
         f"{num(idle.get('served'), ',d')} / {num(idle.get('refused'), ',d')}"],
        ["held by the balancer at the peak", num(idle.get("open_peak"), ",d")],
        [f"still held after the idle timeout ({secs(idle.get('idle_timeout_s'), 1)})",
         num(idle.get("held_after_idle_timeout"), ",d")],
        ["balancer RSS before / holding / after release",
         " / ".join(num(rss.get(k), ".1f", suffix=" MB")
                    for k in ("before", "holding", "after_release"))],
    ]
    return "\n".join([
        table(["target", "fuzz cases", "2xx", "4xx", "5xx"], rows,
              [False, True, True, True, True]), "",
        table(["check", "result"], checks, [False, True])])
