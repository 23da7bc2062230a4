"""The pure parts of ``skymesh bench router-overhead``: wrk's output, /proc samples, the
medians and spreads over interleaved rounds, and the summary the page shows.

No I/O here: the harness (``router_overhead``) reads the files and runs the processes.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

WRKJSON = "WRKJSON "
DIRECT = "direct"  # wrk straight at one stub: the generator's ceiling
# The floor proxies (skymesh_lab.bench.proxy_floor), name -> its --kind: no logic at all
# on skymesh-lb's stack, run beside the routers in the non-streaming c=64 cases.
FLOORS = {"aiohttp-floor": "aiohttp", "lb-stack-floor": "stack", "lean-stack-floor": "lean",
          "asyncio-floor": "asyncio"}


# -- wrk -------------------------------------------------------------------------------
_UNITS_US = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 6e7}
_LAT_LINE = re.compile(r"^\s*(50|90|99)(?:\.0+)?%\s+([\d.]+)(us|ms|s|m)\s*$", re.M)


def _us(value: str, unit: str) -> float:
    return float(value) * _UNITS_US[unit]


def parse_wrk(text: str) -> dict[str, float]:
    """Requests, duration, req/s, latency p50/p99 (ms) and errors of one wrk run.

    The ``WRKJSON`` line that the benchmark's Lua script prints is preferred; without it
    (another script, or none) the human summary is read (percentiles only with
    ``--latency``). Raises ValueError when neither is there.
    """
    for line in text.splitlines():
        if line.startswith(WRKJSON):
            d = json.loads(line[len(WRKJSON):])
            dur = d["duration_us"] / 1e6
            errors = sum(int(d[k]) for k in ("connect_errors", "read_errors", "write_errors",
                                              "timeouts"))
            return {"requests": float(d["requests"]), "duration_s": dur,
                    "rps": d["requests"] / dur if dur > 0 else 0.0,
                    "p50_ms": d["lat_p50_us"] / 1e3, "p90_ms": d["lat_p90_us"] / 1e3,
                    "p99_ms": d["lat_p99_us"] / 1e3, "max_ms": d["lat_max_us"] / 1e3,
                    "errors": float(errors), "non_2xx": float(d["status_errors"])}
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m),", text)
    if not m:
        raise ValueError(f"not wrk output: {text[-300:]!r}")
    req, dur = float(m.group(1)), _us(m.group(2), m.group(3)) / 1e6
    out = {"requests": req, "duration_s": dur, "rps": req / dur if dur > 0 else 0.0,
           "errors": 0.0, "non_2xx": 0.0}
    for q, v, u in _LAT_LINE.findall(text):
        out[f"p{q}_ms"] = _us(v, u) / 1e3
    e = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if e:
        out["errors"] = float(sum(int(x) for x in e.groups()))
    n = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    if n:
        out["non_2xx"] = float(n.group(1))
    return out


# -- /proc -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat the benchmark uses (times in clock ticks)."""

    pid: int
    ppid: int
    utime: int
    stime: int
    cutime: int  # of children that exited and were waited for
    cstime: int
    rss_pages: int


def parse_stat(text: str) -> ProcStat:
    """/proc/PID/stat: the command name may hold spaces and parentheses, so the fields
    are counted from the last ')'."""
    head, _, rest = text.rpartition(")")
    pid = int(head.split("(", 1)[0])
    f = rest.split()
    # rest starts at field 3 (state): ppid is field 4, utime 14 ... rss 24 (1-based)
    return ProcStat(pid=pid, ppid=int(f[1]), utime=int(f[11]), stime=int(f[12]),
                    cutime=int(f[13]), cstime=int(f[14]), rss_pages=int(f[21]))


def tree(stats: Iterable[ProcStat], root: int) -> list[ProcStat]:
    """``root`` and its living descendants among ``stats`` (a snapshot of /proc)."""
    by_parent: dict[int, list[ProcStat]] = {}
    mine: ProcStat | None = None
    for s in stats:
        by_parent.setdefault(s.ppid, []).append(s)
        if s.pid == root:
            mine = s
    if mine is None:
        return []
    out, todo = [mine], [root]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child.pid)
    return out


def tree_cpu_ticks(procs: Sequence[ProcStat]) -> int:
    """CPU ticks of a process tree: every living member's own time plus what its exited
    (reaped) children used, which the kernel adds to the parent's cutime/cstime."""
    return sum(p.utime + p.stime + p.cutime + p.cstime for p in procs)


def tree_rss_bytes(procs: Sequence[ProcStat], page_size: int) -> int:
    return sum(p.rss_pages for p in procs) * page_size


def cpu_ms_per_1k(ticks_before: int, ticks_after: int, requests: float, clk_tck: int) -> float:
    """Router CPU milliseconds per 1,000 requests over one segment."""
    if requests <= 0:
        return float("nan")
    return (ticks_after - ticks_before) / clk_tck * 1e3 / requests * 1e3


def machine_busy(before: Sequence[int], after: Sequence[int]) -> float:
    """Busy share of all cores between two /proc/stat "cpu" lines (their numbers)."""
    d = [b - a for a, b in zip(before, after, strict=False)]
    total = sum(d[:8])
    idle = d[3] + (d[4] if len(d) > 4 else 0)
    return (total - idle) / total if total > 0 else 0.0


# -- Prometheus ------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.M)


def prefix_samples(text: str) -> dict[str, float]:
    """skymesh-lb's samples whose name speaks of prefixes and hits (summed over labels):
    whatever the balancer publishes about its prefix hit rate, read without knowing its
    exact name (a later change adds it)."""
    out: dict[str, float] = {}
    for name, _, value in _SAMPLE.findall(text):
        low = name.lower()
        if "prefix" in low and ("hit" in low or "lookup" in low or "quer" in low):
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return out


def prefix_hit_rate(before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
    """Hit rate over a segment: a ``*hit_rate*`` / ``*hit_ratio*`` gauge as read at the end,
    else hits over lookups from counter deltas; None when the balancer publishes neither."""
    for name, v in after.items():
        if "rate" in name or "ratio" in name:
            return v
    hits = {n: v - before.get(n, 0.0) for n, v in after.items() if "hit" in n}
    total = {n: v - before.get(n, 0.0) for n, v in after.items()
             if "lookup" in n or "quer" in n or n.endswith("_requests_total")}
    h, t = sum(hits.values()), sum(total.values())
    if not hits or not total or t <= 0:
        return None
    return h / t


# -- statistics ------------------------------------------------------------------------
def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and the relative spread (max - min) / median of per-round values
    (NaNs dropped); an empty dict when nothing is left."""
    xs = sorted(v for v in values if v == v)
    if not xs:
        return {}
    med = statistics.median(xs)
    return {"median": med, "min": xs[0], "max": xs[-1], "n": float(len(xs)),
            "rel_spread": (xs[-1] - xs[0]) / med if med else 0.0}


METRICS = ("rps", "p50_ms", "p99_ms", "cpu_ms_per_1k", "errors", "non_2xx")


def summarize(segments: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """router -> case -> metric -> spread over the rounds; plus ``added_p50_ms`` /
    ``added_p99_ms`` (the router's percentile minus the direct path's in the same round)
    and ``p99_over_p50``."""
    direct: dict[tuple[str, int], Mapping[str, Any]] = {
        (s["case"], s["round"]): s for s in segments if s["router"] == DIRECT}
    grouped: dict[str, dict[str, list[Mapping[str, Any]]]] = {}
    for s in segments:
        grouped.setdefault(s["router"], {}).setdefault(s["case"], []).append(s)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for router, cases in grouped.items():
        for case, segs in cases.items():
            row: dict[str, Any] = {m: spread([float(s[m]) for s in segs if m in s])
                                   for m in METRICS}
            row["p99_over_p50"] = spread([s["p99_ms"] / s["p50_ms"] for s in segs
                                          if s.get("p50_ms")])
            if router != DIRECT:
                for q in ("p50_ms", "p99_ms"):
                    row[f"added_{q}"] = spread([
                        s[q] - direct[(case, s["round"])][q] for s in segs
                        if (case, s["round"]) in direct])
                rates = [s["prefix_hit_rate"] for s in segs
                         if s.get("prefix_hit_rate") is not None]
                if rates:
                    row["prefix_hit_rate"] = spread(rates)
            out.setdefault(router, {})[case] = {k: v for k, v in row.items() if v}
    return out


def generator_headroom(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], case: str
                       ) -> float | None:
    """The direct path's median req/s over the fastest router's in ``case``: how far the
    generator (with one stub) is above what it measures; None without both."""
    ceiling = summary.get(DIRECT, {}).get(case, {}).get("rps", {}).get("median")
    best = max((c[case]["rps"]["median"] for r, c in summary.items()
                if r != DIRECT and case in c and "rps" in c[case]), default=None)
    if not ceiling or not best:
        return None
    return ceiling / best
