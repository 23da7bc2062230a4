"""The results page of ``skymesh bench router-overhead``, from its JSON alone."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

from skymesh_lab.bench import router_overhead_stats as st

ROUTER_ORDER = ("skymesh-lb", "sglang-router", "vllm-router")
Row = tuple[str, str, str, Callable[[float], str]]  # label, case, metric, format


def _n0(x: float) -> str:
    return f"{x:,.0f}"


def _n2(x: float) -> str:
    return f"{x:,.2f}"


def _signed(x: float) -> str:
    return f"{x:+.2f}"


ROWS: tuple[Row, ...] = (
    ("non-stream, c=64, round-robin: req/s", "rr-c64", "rps", _n0),
    ("... its router CPU, ms per 1,000 requests", "rr-c64", "cpu_ms_per_1k", _n0),
    ("non-stream, c=64, default (cache-aware): req/s", "default-c64", "rps", _n0),
    ("... its router CPU, ms per 1,000 requests", "default-c64", "cpu_ms_per_1k", _n0),
    ("stream (64 events), c=64: req/s", "stream-c64", "rps", _n0),
    ("... its router CPU, ms per 1,000 requests", "stream-c64", "cpu_ms_per_1k", _n0),
    ("added latency p50, stream c=1: ms", "stream-c1", "added_p50_ms", _signed),
    ("added latency p99, stream c=1: ms", "stream-c1", "added_p99_ms", _signed),
    ("non-stream, c=256: p50 ms", "tail-c256", "p50_ms", _n2),
    ("non-stream, c=256: p99 ms", "tail-c256", "p99_ms", _n2),
    ("non-stream, c=256: p99 / p50", "tail-c256", "p99_over_p50", _n2),
    ("non-stream, c=256: req/s", "tail-c256", "rps", _n0),
)


def cell(row: Mapping[str, Any], metric: str, fmt: Callable[[float], str]) -> str:
    """``median [min, max]`` over the rounds, or "-"."""
    s = row.get(metric)
    if not s:
        return "-"
    if s.get("n", 1) < 2:
        return fmt(s["median"])
    return f"{fmt(s['median'])} [{fmt(s['min'])}, {fmt(s['max'])}]"


def routers_of(summary: Mapping[str, Any]) -> list[str]:
    known = [r for r in ROUTER_ORDER if r in summary]
    return known + sorted(r for r in summary if r not in known and r != st.DIRECT)


def main_table(summary: Mapping[str, Any]) -> str:
    routers = routers_of(summary)
    out = ["| | " + " | ".join(routers) + " |", "|---|" + "---:|" * len(routers)]
    for label, case, metric, fmt in ROWS:
        cells = [cell(summary[r].get(case, {}), metric, fmt) for r in routers]
        if all(c == "-" for c in cells):
            continue
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ceiling_table(summary: Mapping[str, Any]) -> str:
    direct = summary.get(st.DIRECT, {})
    out = ["| case | wrk straight at one stub, req/s | p50 ms | p99 ms "
           "| over the fastest router |", "|---|---:|---:|---:|---:|"]
    for case, row in direct.items():
        head = st.generator_headroom(summary, case)
        out.append(f"| {case} | {cell(row, 'rps', _n0)} | {cell(row, 'p50_ms', _n2)} "
                   f"| {cell(row, 'p99_ms', _n2)} | "
                   f"{'-' if head is None else f'{head:.1f}x'} |")
    return "\n".join(out)


def errors_line(segments: list[Mapping[str, Any]]) -> str:
    bad: dict[str, float] = {}
    for s in segments:
        n = s.get("errors", 0) + s.get("non_2xx", 0)
        if n:
            bad[s["router"]] = bad.get(s["router"], 0.0) + n
    if not bad:
        return "No socket error, timeout or non-2xx answer in any segment."
    return "Socket errors, timeouts and non-2xx answers (all segments): " + ", ".join(
        f"{r} {n:,.0f}" for r, n in sorted(bad.items())) + "."


def rss_table(rss: Mapping[str, Mapping[str, float]]) -> str:
    out = ["| router / configuration | RSS after warm-up, MB | RSS at the end, MB "
           "| requests served between |", "|---|---:|---:|---:|"]
    for name, v in rss.items():
        out.append(f"| {name} | {v.get('before_mb', 0):.1f} | {v.get('after_mb', 0):.1f} "
                   f"| {v.get('requests', 0):,.0f} |")
    return "\n".join(out)


def long_run_table(long_run: Mapping[str, list[Mapping[str, float]]]) -> str:
    out = ["| router (default configuration) | requests | RSS at start, MB | RSS at the "
           "end, MB | highest, MB |", "|---|---:|---:|---:|---:|"]
    for router, trace in long_run.items():
        peak = max(t["rss_mb"] for t in trace)
        out.append(f"| {router} | {trace[-1]['requests']:,.0f} | {trace[0]['rss_mb']:.1f} "
                   f"| {trace[-1]['rss_mb']:.1f} | {peak:.1f} |")
    return "\n".join(out)


def load_lines(data: Mapping[str, Any]) -> list[str]:
    setup, segs = data["setup"], data["segments"]
    busy = statistics.median(s["machine_busy"] for s in segs)
    foreign = [s["foreign_cores"] for s in segs]
    lb, la = setup.get("loadavg_before", [0]), setup.get("loadavg_after", [0])
    return [
        f"Run {setup.get('started', '?')} to {setup.get('finished', '?')} on "
        f"{setup.get('cores', '?')} cores shared with other work; {setup['rounds']} "
        f"interleaved rounds of {setup['duration_s']:g} s per segment, "
        f"{len(segs)} segments; {setup.get('wrk', 'wrk')}.",
        f"Machine load: 1-minute load average {lb[0]:.2f} at the start, {la[0]:.2f} at "
        f"the end; during the segments the machine was {busy:.0%} busy (median), and "
        f"processes outside the benchmark used {statistics.median(foreign):.2f} cores "
        f"(median; max {max(foreign):.2f}). The client (wrk), the stubs and the router "
        "share the same cores, so req/s is bounded by the machine; CPU per 1,000 "
        "requests is the figure that carries over to another machine.",
    ]


def prefix_lines(summary: Mapping[str, Any], segments: list[Mapping[str, Any]]) -> list[str]:
    row = summary.get("skymesh-lb", {}).get("default-c64", {})
    if "prefix_hit_rate" in row:
        return [f"skymesh-lb's prefix hit rate in the default case (from its /metrics): "
                f"{cell(row, 'prefix_hit_rate', lambda x: f'{x:.1%}')}."]
    seen = any(s.get("prefix_samples") for s in segments)
    return ["skymesh-lb's /metrics published " + ("prefix samples but no hit rate"
                                                   if seen else "no prefix hit rate")
            + " in this run."]


def router_overhead(data: dict[str, Any]) -> str:
    summary = st.summarize(data["segments"])
    setup = data["setup"]
    versions = ", ".join(f"{r} {v}" for r, v in setup.get("versions", {}).items())
    flags = "; ".join(f"{r} {c}: `{' '.join(f) or '(none)'}`"
                      for r, cfg in setup.get("routers", {}).items() for c, f in cfg.items())
    lines = load_lines(data)
    out = [lines[0], "", lines[1], "",
           f"Routers: {versions or 'skymesh-lb only'}; flags per configuration: {flags}."
           + (f" skymesh-lb workers: {setup['skymesh_workers']}."
              if setup.get("skymesh_workers") else ""), "",
           "Figures are medians over the rounds with [min, max]; added latency is the "
           "router's percentile minus wrk's straight at a stub in the same round.", "",
           main_table(summary), "", errors_line(data["segments"]), "",
           "## The generator's ceiling", "",
           "wrk with the same script and connections straight at one stub, in every round "
           "beside the routers (the routers spread over two stubs).", "",
           ceiling_table(summary), "", "## Memory", "", rss_table(data.get("rss", {})), ""]
    if data.get("long_run"):
        out += ["Long run (non-streaming, prefix and streaming segments in turn):", "",
                long_run_table(data["long_run"]), ""]
    trouble = {k: v for k, v in setup.get("notes", {}).items()
               if v.startswith(("left out", "exited", "stopped early"))}
    if trouble:
        out += ["Not measured as planned: " + "; ".join(
            f"{k}: {v.splitlines()[0]}" for k, v in sorted(trouble.items())) + ".", ""]
    out += prefix_lines(summary, data["segments"])
    out += ["", "vllm-router's default (cache_aware) asks each backend for "
            "`/v1/chat/completions/render` and `/tokenize` before every request; the stub "
            "answers both with a fast 404 and the request is routed anyway. "
            "sglang-router's default is cache_aware too; skymesh-lb's is its configured "
            "default policy and push mode (no flags).", "",
            "Where skymesh-lb's c=256 tail came from (new connections accepted one per "
            "event-loop iteration under uvloop) and its before/after: "
            "[the c=256 tail note](../notes/c256-tail.md)."]
    return "\n".join(out)
