"""The results page of ``skymesh_lab.bench.request_path_cost``: the request path's CPU per
request now and at a base revision, measured in the same run.

Kept apart from the measurement so the results registry (``results_pages``) renders the
page from the JSON alone.
"""

from __future__ import annotations

from typing import Any

WHAT = {
    "rr": "non-streamed, round-robin + `bp`",
    "stream": "streamed ({events} events), round-robin + `bp`",
    "default": "non-streamed, default policy and push mode, shared prefixes",
}


def _us(s: dict[str, float]) -> str:
    return f"{s['median']:.1f} [{s['min']:.1f}, {s['max']:.1f}]"


def _rps(s: dict[str, float]) -> str:
    return f"{s['median']:,.0f} [{s['min']:,.0f}, {s['max']:,.0f}]"


def _ratio(s: dict[str, float]) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"


def _change(ratio: dict[str, float]) -> str:
    """The paired ratio in words; a spread across 1 is said to be one."""
    r = ratio["median"]
    said = f"{1 - r:.1%} less" if r <= 1 else f"{r - 1:.1%} more"
    said += " (the median of the rounds' ratios)"
    if ratio["min"] < 1 < ratio["max"]:
        said += (f", within this run's noise: the rounds' ratios span 1 "
                 f"({ratio['min']:.3f} to {ratio['max']:.3f})")
    return said


def request_path_cost(doc: dict[str, Any]) -> str:
    setup, summary = doc["setup"], doc["summary"]
    events = setup.get("stream_events", 64)
    base, cur = setup["base"], setup.get("current") or "current"
    out = [f"| configuration | before (`{base}`): CPU us per request | now (`{cur}`) | "
           "now / before, paired by round | req/s before | req/s now |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for config in ("rr", "stream", "default"):
        row = summary.get(config)
        if row is None:
            continue
        out.append(f"| {WHAT[config].format(events=events)} | {_us(row['base_us'])} | "
                   f"{_us(row['current_us'])} | {_ratio(row['ratio'])} | "
                   f"{_rps(row['base_rps'])} | {_rps(row['current_rps'])} |")
    errors = sum(int(row["errors"]) for row in summary.values())
    rr = summary.get("rr")
    headline = ""
    if rr is not None:
        headline = (f"On the round-robin path a request now costs "
                    f"**{rr['current_us']['median']:.1f} us** of the balancer's CPU, "
                    f"{rr['base_us']['median']:.1f} us before: "
                    f"{_change(rr['ratio'])}. ")
    flags = " ".join(setup["common_flags"])
    notes = [
        "\n".join(out),
        headline + f"Medians over {setup['rounds']} rounds [min, max]. In each round the "
        "two builds take four alternating turns (now, before, before, now) of "
        f"{setup['duration_s'] / 4:g} s each, summed, so both see the same stretch of a "
        "machine whose other tenants come and go; the ratio is taken within each round, "
        "which cancels most of that drift. "
        + ("No socket error or non-2xx answer in any turn." if errors == 0 else
           f"{errors} socket errors or non-2xx answers over the run."),
        f"Setup: `skymesh-lb {flags}` plus each configuration's flags, in front of two C "
        f"stub replicas, wrk with {setup['connections']} connections (`stub/post.lua`). "
        "CPU from /proc/PID/task/*/stat (utime + stime of every thread), divided by the "
        f"requests wrk completed. The machine has {setup['cores']} cores shared with "
        f"other sessions (load average {setup['loadavg_before'][0]:.1f} at the start, "
        f"{setup['loadavg_after'][0]:.1f} at the end): CPU per request rises when the "
        "balancer gets less of a core (it wakes for fewer requests at a time), so single "
        "turns move by 10-20%; read the paired ratios and their spread.",
    ]
    return "\n\n".join(notes)
