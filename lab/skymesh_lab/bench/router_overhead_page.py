"""The results page of ``skymesh bench router-overhead``, from its JSON alone."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

from skymesh_lab.bench import router_overhead_stats as st

ROUTER_ORDER = ("skymesh-lb", "sglang-router", "vllm-router")
FLOOR_WHAT = {
    "aiohttp-floor": "aiohttp's server and a pooled `aiohttp.ClientSession`",
    "lb-stack-floor": "aiohttp's server and skymesh-lb's own httptools client "
                      "(`skymesh.balancer.upstream`): skymesh-lb's HTTP stack with "
                      "`listen.http_server: aiohttp`",
    "lean-stack-floor": "skymesh-lb's serving path (its connection guard and lean server, "
                        "`skymesh.net.serving`) and its own httptools client: "
                        "skymesh-lb's default HTTP stack",
    "asyncio-floor": "asyncio protocols and httptools, no aiohttp",
}
# The floors that keep aiohttp's server, and the one on skymesh-lb's default stack (runs
# from before session 25 have none): the stacks the target question is about.
AIOHTTP_FLOORS = ("aiohttp-floor", "lb-stack-floor")
LEAN_FLOOR = "lean-stack-floor"
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


# The focused run of Show 1 (attached: results_pages.Source.attach): skymesh-lb and
# sglang-router alone, the default case, more rounds than the whole benchmark's.
FOCUSED = "router-overhead-default"
PAIRED_CASES = (("default-c64", "default (cache-aware)"), ("rr-c64", "round-robin"))


def paired_ratios(segments: list[Mapping[str, Any]], case: str, metric: str,
                  ours: str = "skymesh-lb", theirs: str = "sglang-router") -> list[float]:
    """``ours`` over ``theirs`` in each round that has both: two routers measured
    minutes apart on a shared machine differ by the machine's drift as much as by
    themselves, their two segments of one round by much less."""
    by_round: dict[tuple[str, int], float] = {
        (s["router"], s["round"]): float(s[metric]) for s in segments
        if s["case"] == case and s["router"] in (ours, theirs) and s.get(metric)}
    rounds = sorted({r for _, r in by_round})
    return [by_round[(ours, r)] / by_round[(theirs, r)] for r in rounds
            if (ours, r) in by_round and (theirs, r) in by_round]


def paired_lines(segments: list[Mapping[str, Any]]) -> list[str]:
    """skymesh-lb over sglang-router per round, req/s and CPU per request, per case."""
    out = []
    for case, name in PAIRED_CASES:
        rps = paired_ratios(segments, case, "rps")
        if not rps:
            continue
        cpu = st.spread(paired_ratios(segments, case, "cpu_ms_per_1k"))
        r = st.spread(rps)
        above = sum(x >= 1.0 for x in rps)
        out.append(f"{name}, c=64: skymesh-lb's req/s over sglang-router's in the same "
                   f"round {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}], at or "
                   f"above 1 in {above} of {len(rps)} rounds; its CPU per request over "
                   f"sglang-router's {cpu['median']:.2f} [{cpu['min']:.2f}, "
                   f"{cpu['max']:.2f}].")
    return out


def focused_section(data: Mapping[str, Any]) -> list[str]:
    """The attached focused run: the default case alone, skymesh-lb beside
    sglang-router, many rounds."""
    segs = data["segments"]
    summary = st.summarize(segs)
    setup = data["setup"]
    lb, la = setup.get("loadavg_before", [0]), setup.get("loadavg_after", [0])
    rows = []
    for router in ("skymesh-lb", "sglang-router"):
        row = summary.get(router, {}).get("default-c64", {})
        rows.append(f"| {router} | {cell(row, 'rps', _n0)} "
                    f"| {cell(row, 'cpu_ms_per_1k', _n0)} |")
    return ["## The default case alone, more rounds", "",
            "Only skymesh-lb and sglang-router, only the default case (non-streaming, "
            f"c=64, shared-prefix bodies), {setup['rounds']} interleaved rounds of "
            f"{setup['duration_s']:g} s, run {setup.get('started', '?')} to "
            f"{setup.get('finished', '?')}, 1-minute load average {lb[0]:.2f} at the "
            f"start and {la[0]:.2f} at the end: `{setup.get('command', '')}`.", "",
            "| router | req/s | CPU, ms per 1,000 requests |", "| --- | ---: | ---: |",
            *rows, "", *paired_lines(segs), ""]


def routers_of(summary: Mapping[str, Any]) -> list[str]:
    """The routers of the main table (not the generator's ceiling, not the floors)."""
    known = [r for r in ROUTER_ORDER if r in summary]
    return known + sorted(r for r in summary
                          if r not in known and r != st.DIRECT and r not in st.FLOORS)


def _median(summary: Mapping[str, Any], router: str, case: str, metric: str
            ) -> float | None:
    return summary.get(router, {}).get(case, {}).get(metric, {}).get("median")


def floor_table(summary: Mapping[str, Any]) -> str:
    """skymesh-lb, the floors and the peers in the two non-streaming c=64 cases."""
    arms = [r for r in ("skymesh-lb", *st.FLOORS, "sglang-router", "vllm-router")
            if r in summary]
    out = ["| | what | rr-c64 req/s | CPU ms per 1,000 | default-c64 req/s "
           "| CPU ms per 1,000 |", "|---|---|---:|---:|---:|---:|"]
    for r in arms:
        rr, dflt = summary[r].get("rr-c64", {}), summary[r].get("default-c64", {})
        what = FLOOR_WHAT.get(r, "round-robin; its default (cache-aware)")
        out.append(f"| {r} | {what} | {cell(rr, 'rps', _n0)} | "
                   f"{cell(rr, 'cpu_ms_per_1k', _n0)} | {cell(dflt, 'rps', _n0)} | "
                   f"{cell(dflt, 'cpu_ms_per_1k', _n0)} |")
    return "\n".join(out)


def floor_placement(setup: Mapping[str, Any]) -> str:
    """Where the floors' workers ran: ``floor_cpus`` is skymesh-lb's ``listen.pin_workers:
    auto`` rule applied to them (a list of cores, or null: left to the kernel); runs from
    before the floors followed it have no such key."""
    if "floor_cpus" not in setup:
        return "unpinned (this run is from before the floors followed skymesh-lb's pinning)"
    cpus = setup["floor_cpus"]
    if cpus:
        return (f"each pinned to a core of its own (cores {', '.join(map(str, cpus))}) by "
                "skymesh-lb's own rule for `listen.pin_workers: auto`")
    return ("unpinned: skymesh-lb's rule for `listen.pin_workers: auto` leaves them to the "
            "kernel here (more usable cores than workers)")


def floor_lines(summary: Mapping[str, Any]) -> list[str]:
    """What the floors say about the target (skymesh-lb's default at or above
    sglang-router's cache-aware req/s, non-streaming c=64): sentences from the medians."""
    floors = [f for f in (*AIOHTTP_FLOORS, LEAN_FLOOR)
              if _median(summary, f, "default-c64", "rps")]
    target = _median(summary, "sglang-router", "default-c64", "rps")
    if not floors:
        return []
    lean = LEAN_FLOOR in floors
    stacks = "skymesh-lb's HTTP stacks" if lean else "aiohttp's server"
    best = max(floors, key=lambda f: _median(summary, f, "default-c64", "rps") or 0.0)
    best_rps = _median(summary, best, "default-c64", "rps") or 0.0
    ours = {c: _median(summary, "skymesh-lb", f"{c}-c64", "rps") for c in ("default", "rr")}
    parts = [f"{f} {_median(summary, f, 'default-c64', 'rps'):,.0f}" for f in floors]
    out = [("Non-streaming c=64 with the default case's bodies, medians: "
            + (f"sglang-router's cache-aware path {target:,.0f} req/s; " if target else "")
            + f"the floors on {stacks} " + ", ".join(parts) + " req/s"
            + (f"; skymesh-lb's default {ours['default']:,.0f}" if ours["default"] else "")
            + (f" (its round-robin {ours['rr']:,.0f} with the fixed bodies)"
               if ours["rr"] else "") + ".")]
    stack = next((f for f in (LEAN_FLOOR, "lb-stack-floor")
                  if _median(summary, f, "rr-c64", "cpu_ms_per_1k")), "aiohttp-floor")
    for case, name in (("rr-c64", "round-robin"), ("default-c64", "default")):
        lb = _median(summary, "skymesh-lb", case, "cpu_ms_per_1k")
        fl = _median(summary, stack, case, "cpu_ms_per_1k")
        if lb and fl:
            out.append(f"Of skymesh-lb's {name} CPU ({lb:,.0f} ms per 1,000 requests), the "
                       f"HTTP stack alone ({stack}: {fl:,.0f} ms) is {fl / lb:.0%}; the "
                       f"other {lb - fl:,.0f} ms ({1 - fl / lb:.0%}) is SkyMesh's own logic.")
    if target:
        goal = "the target (skymesh-lb's default at or above sglang-router's cache-aware req/s)"
        if best_rps < target:
            verdict = (f"By this measurement {goal} is out of reach on this stack: "
                       f"a proxy with no logic at all on {stacks} and uvloop "
                       f"({best}) serves {best_rps:,.0f} req/s, {best_rps / target:.0%} of "
                       f"sglang-router's cache-aware {target:,.0f}, before SkyMesh adds "
                       "anything.")
        else:
            verdict = (f"By this measurement {goal} is within this stack's reach: "
                       f"{best} serves {best_rps:,.0f} req/s, {best_rps / target:.0%} of "
                       f"sglang-router's cache-aware {target:,.0f}; what SkyMesh's own "
                       "logic adds must fit in the difference.")
        bare = _median(summary, "asyncio-floor", "default-c64", "rps")
        if bare:
            verdict += (f" Without aiohttp (asyncio-floor) the floor is {bare:,.0f} req/s "
                        f"({bare / target:.0%} of sglang-router's).")
        out.append(verdict)
    out += _cpu_budget(summary, stack)
    out += _aiohttp_cost(summary)
    return out


def _aiohttp_cost(summary: Mapping[str, Any]) -> list[str]:
    """Where aiohttp's cost lies: its server (lb-stack-floor over asyncio-floor, the same
    httptools client) and its client (aiohttp-floor over lb-stack-floor, the same server)."""
    cpu = {f: _median(summary, f, "rr-c64", "cpu_ms_per_1k") for f in st.FLOORS}
    parts = []
    if cpu["lb-stack-floor"] and cpu["asyncio-floor"]:
        parts.append(f"aiohttp's server {cpu['lb-stack-floor'] - cpu['asyncio-floor']:,.0f} "
                     "(lb-stack-floor over asyncio-floor)")
    if cpu["aiohttp-floor"] and cpu["lb-stack-floor"]:
        parts.append(f"aiohttp's `ClientSession` against skymesh-lb's client "
                     f"{cpu['aiohttp-floor'] - cpu['lb-stack-floor']:,.0f} (aiohttp-floor "
                     "over lb-stack-floor)")
    on_aiohttp, on_lean = cpu["lb-stack-floor"], cpu[LEAN_FLOOR]
    if on_aiohttp and on_lean:
        parts.append("skymesh-lb's lean server and connection guard against aiohttp's server "
                     f"{on_aiohttp - on_lean:,.0f} (lb-stack-floor over {LEAN_FLOOR})")
    if not parts:
        return []
    return ["Where aiohttp's cost lies, in ms of CPU per 1,000 round-robin requests: "
            + "; ".join(parts) + "."]


def _cpu_budget(summary: Mapping[str, Any], stack: str) -> list[str]:
    """The target in CPU per request, which a shared machine's load does not move: what
    is left for SkyMesh's own logic once the HTTP stack is paid for."""
    case = "default-c64"
    target = _median(summary, "sglang-router", case, "cpu_ms_per_1k")
    floor = _median(summary, stack, case, "cpu_ms_per_1k")
    ours = _median(summary, "skymesh-lb", case, "cpu_ms_per_1k")
    if not target or not floor:
        return []
    head = (f"In CPU per request (the figure a shared machine's load moves least): {stack} "
            f"costs {floor:,.0f} ms per 1,000 requests with the default case's bodies, "
            f"sglang-router's whole cache-aware path {target:,.0f}; ")
    if floor >= target:
        return [head + "the HTTP stack alone costs as much as sglang-router's whole path, "
                "so no SkyMesh logic fits."]
    today = f" (its default path's logic costs {ours - floor:,.0f} today)" if ours else ""
    return [head + f"to match it, SkyMesh's own logic may cost {target - floor:,.0f} ms per "
            f"1,000 requests{today}."]


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


def prefix_lines(summary: Mapping[str, Any], setup: Mapping[str, Any]) -> list[str]:
    """The prefix hit rate at the stubs in the default case, per router and floor."""
    rates = [(r, summary[r]["default-c64"]) for r in (*routers_of(summary), *st.FLOORS)
             if "prefix_hit_rate" in summary.get(r, {}).get("default-c64", {})]
    if not rates:
        return ["No prefix hit rate in this run: skymesh-lb's /metrics publishes no prefix "
                "hit counter and this run's stubs modelled no prefix cache (the stubs count "
                "hits since `stub_prefix_cache` is in the JSON's setup)."]
    cache, groups = setup.get("stub_prefix_cache", "?"), setup.get("prefix_groups", "?")
    def pct(x: float) -> str:
        return f"{x:.1%}"

    return [f"Prefix hit rate at the stubs in the default case (each stub keeps the {cache} "
            f"most recently used of the {groups} shared prefixes, so a prefix hits only "
            "while a router keeps sending it to the same stub; the floors, round-robin, "
            "show the rate without any affinity): "
            + ", ".join(f"{r} {cell(row, 'prefix_hit_rate', pct)}" for r, row in rates)
            + "."]


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
           *[line + "\n" for line in paired_lines(data["segments"])],
           "## The generator's ceiling", "",
           "wrk with the same script and connections straight at one stub, in every round "
           "beside the routers (the routers spread over two stubs).", "",
           ceiling_table(summary), ""]
    if any(f in summary for f in st.FLOORS):
        out += ["## The floor: what a Python proxy on this stack can do", "",
                "Reverse proxies with no logic at all (round-robin over the two stubs, the "
                "body passed through; no parsing, metrics or log: "
                "`lab/skymesh_lab/bench/proxy_floor.py`), on uvloop, "
                f"{setup.get('floor_workers', '?')} worker processes on one port with "
                f"`SO_REUSEPORT` as skymesh-lb's default, {floor_placement(setup)}, in the "
                "same rounds as the routers.", "", floor_table(summary), "",
                " ".join(floor_lines(summary)), ""]
    if data.get(FOCUSED):
        out += focused_section(data[FOCUSED])
    out += ["## Memory", "", rss_table(data.get("rss", {})), ""]
    if data.get("long_run"):
        out += ["Long run (non-streaming, prefix and streaming segments in turn):", "",
                long_run_table(data["long_run"]), ""]
    trouble = {k: v for k, v in setup.get("notes", {}).items()
               if v.startswith(("left out", "exited", "stopped early"))}
    if trouble:
        out += ["Not measured as planned: " + "; ".join(
            f"{k}: {v.splitlines()[0]}" for k, v in sorted(trouble.items())) + ".", ""]
    out += prefix_lines(summary, setup)
    out += ["", "vllm-router's default (cache_aware) asks each backend for "
            "`/v1/chat/completions/render` and `/tokenize` before every request; the stub "
            "answers both with a fast 404 and the request is routed anyway. "
            "sglang-router's default is cache_aware too; skymesh-lb's is its configured "
            "default policy and push mode (no flags).", "",
            "Where skymesh-lb's c=256 tail came from (new connections accepted one per "
            "event-loop iteration under uvloop) and its before/after: "
            "[the c=256 tail note](../notes/c256-tail.md)."]
    return "\n".join(out)
