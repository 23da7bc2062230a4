"""The results page of ``skymesh_lab.bench.access_log_cost``: what the access log costs a
request through skymesh-lb, now and at the base revision measured in the same run.

Kept apart from the measurement so the results registry (``results_pages``) renders the
page from the JSON alone.
"""

from __future__ import annotations

import statistics
from typing import Any

TARGET = 0.05  # issue #35 item 3: at most 5% of a request's CPU


def _us(s: dict[str, float]) -> str:
    return f"{s['median']:.1f} [{s['min']:.1f}, {s['max']:.1f}]"


def _share(s: dict[str, float]) -> str:
    return f"{s['median']:.1%} [{s['min']:.1%}, {s['max']:.1%}]"


def _paired(segments: list[dict[str, Any]]) -> str:
    """Now's cost minus before's, round by round (both ran in the same stretch)."""
    cpu = {(s["setup"], s["round"]): s["cpu_us"] for s in segments}
    rounds = sorted({r for _, r in cpu})
    diffs = [(cpu[("current/on", r)] - cpu[("current/off", r)])
             - (cpu[("base/on", r)] - cpu[("base/off", r)])
             for r in rounds if ("base/on", r) in cpu and ("current/on", r) in cpu]
    if not diffs:
        return ""
    return (f" Now's cost minus before's, paired by round: {statistics.median(diffs):+.1f} us "
            f"[{min(diffs):+.1f}, {max(diffs):+.1f}], the noise of this machine next to "
            "changes of a few microseconds.")


def _in_process(doc: dict[str, Any], label: dict[str, str]) -> str:
    """The loop's part measured in process (skymesh_lab.bench.access_log_loop)."""
    runs = doc.get("in_process") or {}
    parts = [f"{label[b]} {_us(runs[b]['cost_us'])} us" for b in ("base", "current")
             if b in runs]
    if not parts:
        return ""
    some = next(iter(runs.values()))
    return (" In process (the same reply through the app's entry point with the access "
            "log as each build installs it for the daemon, its hook and batches, without the "
            "network or aiohttp's server; the loop thread's CPU per "
            f"request on minus off, median of {some['repeats']} repeats of "
            f"{some['requests']:,} requests [min, max]): " + ", ".join(parts) + ".")


def access_log_cost(doc: dict[str, Any]) -> str:
    setup, summary = doc["setup"], doc["summary"]
    base = setup.get("base")
    label = {"current": f"now (`{setup.get('current') or 'current'}`)",
             "base": f"before (`{base}`)"}
    out = ["| build | access log off: CPU us per request | on | cost of the access log "
           "(on - off) | its share of a request | of which the loop | the writer thread |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for build in ("base", "current"):
        row = summary.get(build)
        if row is None:
            continue
        # a base from before the thread was named shows its writer as "other threads"
        writer = row["writer_us"] if row["writer_us"]["max"] > 0 else row["threads_cost_us"]
        out.append(f"| {label[build]} | {_us(row['off_us'])} | {_us(row['on_us'])} | "
                   f"{_us(row['cost_us'])} | {_share(row['share'])} | "
                   f"{_us(row['loop_cost_us'])} | {_us(writer)} |")
    paired = _paired(doc.get("segments", []))
    cur = summary["current"]["share"]["median"]
    verdict = ("within" if cur <= TARGET else "above")
    notes = [
        "\n".join(out),
        f"Medians over {setup['rounds']} rounds [min, max]; a round runs each build's "
        "\"on\" and \"off\" in four alternating turns (on, off, off, on) of "
        f"{setup['duration_s'] / 4:g} s, and the cost is the difference within the round. "
        f"The access log now costs **{cur:.1%}** of a request's CPU, {verdict} the "
        f"{TARGET:.0%} aimed at. \"The loop\" is the balancer's main thread (on minus off); "
        "\"the writer thread\" is the access log's own thread (named `skymesh-access`; "
        "in a base from before it was named, the difference of all threads but the main "
        "one)." + paired + _in_process(doc, label),
        f"Setup: `skymesh-lb {' '.join(setup['lb_flags'])}` in front of two C stub "
        f"replicas, wrk with {setup['connections']} connections, non-streaming chat "
        "completions whose replies carry `usage`; the access log goes to the daemon's "
        "stderr, a file. CPU from /proc/PID/task/*/stat (utime + stime). The machine has "
        f"{setup['cores']} cores shared with other sessions (load average "
        f"{setup['loadavg_before'][0]:.1f} at the start, {setup['loadavg_after'][0]:.1f} "
        "at the end): single turns move by tens of microseconds, so read the medians and "
        "the spreads, not one round.",
    ]
    return "\n\n".join(notes)
