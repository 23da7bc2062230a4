"""The results page of ``skymesh_lab.bench.access_log_cost``: what the access log costs a
request through skymesh-lb, now and at the base revision measured in the same run.

Kept apart from the measurement so the results registry (``results_pages``) renders the
page from the JSON alone.
"""

from __future__ import annotations

import statistics
from typing import Any

TARGET = 0.05  # issue #35 item 3: at most 5% of a request's CPU
ABLATION = "access-log-ablation"  # the attached --ablate run (results_pages.Source.attach)
FLOOR = "access-log-floor"  # the attached --ablate run of the floor and its parts
LEAN = "access-log-cost-lean"  # the attached run with --http-server lean
LEAN_PIPE = "access-log-cost-lean-pipe"  # the same with --sink pipe
# The same as LEAN with --config default: the daemon's own policy, shared-prefix bodies.
LEAN_DEFAULT = "access-log-cost-lean-default"
# The ablation's builds, least of the log first (access_log_cost.ABLATION_ORDER), and
# what each runs with the log on (skymesh_lab.bench.access_log_ablate).
_PARTS = {
    "floor": "the least a log made in Python does (access_log_floor): a list per request, "
             "the same line for a whole reply; no prepare hook, no other cases",
    "floor-nonotes": "the floor with the balancer's notes returning at once",
    "floor-nolines": "the floor with its batches dropped, no line made or written",
    "record": "the request's record, the wrapper around the app, the balancer's notes, "
              "the prepare hook; no line made",
    "lines": "and the lines made on the loop in batches, then discarded",
    "current": "and written: the full log, its batches written by the loop itself",
    "thread": "the full log, its batches handed to the writer thread to write",
    "tlines": "the full log, its batches' lines made and written by the writer thread",
}
_STEPS = {"lines-record": "making the lines", "current-lines": "writing them",
          "current-record": "making and writing the lines",
          "thread-current": "handing them to the thread instead",
          "tlines-thread": "making the lines in the thread instead of on the loop",
          "tlines-current": "making the lines in the thread instead of on the loop",
          "current-floor": "the full log above the floor",
          "floor-floor-nolines": "the floor's lines, made and written",
          "floor-floor-nonotes": "the floor's three notes"}


def _bounds(s: dict[str, float]) -> tuple[float, float]:
    """The median's 95% confidence interval; min and max in runs from before it was
    recorded."""
    return s.get("ci_low", s["min"]), s.get("ci_high", s["max"])


def _us(s: dict[str, float]) -> str:
    low, high = _bounds(s)
    return f"{s['median']:.1f} [{low:.1f}, {high:.1f}]"


def _share(s: dict[str, float]) -> str:
    low, high = _bounds(s)
    return f"{s['median']:.1%} [{low:.1%}, {high:.1%}]"


def _verdict(share: dict[str, float]) -> str:
    """Whether the target holds, from the median share and its interval."""
    low, high = _bounds(share)
    text = f"The access log now costs **{share['median']:.1%}** of a request's CPU"
    if high <= TARGET:
        return f"{text}: the {TARGET:.0%} aimed at **holds** (the whole interval is below it)."
    if low > TARGET:
        return (f"{text}: the {TARGET:.0%} aimed at is **not met** (the whole interval is "
                "above it).")
    side = "below" if share["median"] <= TARGET else "above"
    return (f"{text}, {side} the {TARGET:.0%} aimed at, but the interval "
            f"[{low:.1%}, {high:.1%}] holds {TARGET:.0%}: **not shown** either way "
            "on this machine.")


def _remainder(doc: dict[str, Any]) -> str:
    """Where the live cost goes: the loop's user and kernel time, the writer thread, and
    the part of the loop's that the log's own functions take (in process)."""
    row = doc["summary"]["current"]
    if "loop_sys_cost_us" not in row:
        return ""
    loop, kernel = row["loop_cost_us"]["median"], row["loop_sys_cost_us"]["median"]
    own = (doc.get("in_process") or {}).get("current", {}).get("cost_us", {}).get("median")
    text = (f" Where it goes (medians): the loop {loop:.1f} us, of which "
            f"{kernel:.1f} us in the kernel (system calls) and {loop - kernel:.1f} us in "
            f"user space; the writer thread {row['writer_us']['median']:.1f} us")
    if own is None:
        return text + "."
    return (text + f". In process the log's own work on the loop is {own:.1f} us, so "
            f"{loop - own:+.1f} us of the live loop's difference is more than the same "
            "code costs in a tight loop ([the access log's cost](../operations-logs.md"
            "#cost) says what was ruled out; the last section, where the log's parts "
            "are switched off live, where it goes).")


def _fresh(setup: dict[str, Any]) -> str:
    """How often the run started new balancer processes (``--fresh-every``)."""
    every = setup.get("fresh_every") or 0
    toggled = ("; each build's \"on\" and \"off\" in one balancer process, its access "
               "log switched between turns (`--toggle`: that process's own offset is common "
               "to both and cancels from their difference)" if setup.get("toggle") else "")
    if every <= 0:
        return toggled
    when = "each round" if every == 1 else f"every {every} rounds"
    return (f", on new balancer processes {when} (a process carries an offset of its own, "
            "several microseconds per request, that one set of processes for the whole "
            "run would add to every round)" + toggled)


def _paired(doc: dict[str, Any]) -> str:
    """Now's cost minus before's, round by round (both ran in the same stretch)."""
    paired = doc["summary"].get("paired_vs_base_us")
    if paired is not None:
        return (f" Now's cost minus before's, paired by round: {_us(paired)} us (min "
                f"{paired['min']:+.1f}, max {paired['max']:+.1f}).")
    cpu = {(s["setup"], s["round"]): s["cpu_us"] for s in doc.get("segments", [])}
    rounds = sorted({r for _, r in cpu})
    diffs = [(cpu[("current/on", r)] - cpu[("current/off", r)])
             - (cpu[("base/on", r)] - cpu[("base/off", r)])
             for r in rounds if ("base/on", r) in cpu and ("current/on", r) in cpu]
    if not diffs:
        return ""
    return (f" Now's cost minus before's, paired by round: {statistics.median(diffs):+.1f} us "
            f"[{min(diffs):+.1f}, {max(diffs):+.1f}].")


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


def _ablation(doc: dict[str, Any], key: str = ABLATION,
              title: str = "Where it goes: parts of the log switched off",
              labels: dict[str, str] | None = None) -> str:
    """Where the cost goes: the same checkout with parts of the log switched off, each
    against ``--no-access-log`` in the same rounds (``--ablate``): the run attached as
    ``key``, in a section named ``title``; ``labels``: rows described otherwise than in
    ``_PARTS``."""
    abl = doc.get(key)
    if not abl:
        return ""
    setup, summary = abl["setup"], abl["summary"]
    runs = abl.get("in_process") or {}
    out = [f"### {title}", "",
           "| what runs with the access log on | its cost (on - off): CPU us per request "
           "| its share of a request | of which the loop | the writer thread "
           "| in process: the loop [min, max] |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for build, what in (_PARTS | (labels or {})).items():
        row = summary.get(build)
        if row is None:
            continue
        own = runs.get(build, {}).get("cost_us")
        inproc = (f"{own['median']:.1f} [{own['min']:.1f}, {own['max']:.1f}]"
                  if own else "-")
        out.append(f"| `{build}`: {what} | {_us(row['cost_us'])} | {_share(row['share'])} "
                   f"| {_us(row['loop_cost_us'])} | {_us(row['writer_us'])} | {inproc} |")
    steps = summary.get("ablation_steps_us") or {}
    said = [f"{_STEPS.get(name, name)} {_us(s)} us" for name, s in steps.items()]
    text = (f"The checkout `{setup.get('current') or 'current'}` run with parts of the "
            "access log switched off (`--ablate`: a `sitecustomize` patch of the daemon, no "
            "product switch), each build on and off in rounds of their own (a run apart "
            "from the table above), "
            f"{setup['rounds']} rounds of {setup['duration_s']:g} s (load average "
            f"{setup['loadavg_before'][0]:.1f} at the start, "
            f"{setup['loadavg_after'][0]:.1f} at the end). What each part adds, paired by "
            "round: " + ("; ".join(said) if said else "-") + ". Reproduce: `"
            + setup["command"] + f" --json docs/results/data/{key}.json`.")
    return "\n".join(out) + "\n\n" + text + _live_vs_in_process(summary, runs)


def _live_vs_in_process(summary: dict[str, Any], runs: dict[str, Any]) -> str:
    """How much more each part costs live than in process: the request's own part (its
    record, the wrapper, the notes) runs once per request among everything else; the
    lines are made for a batch at once."""
    steps = summary.get("ablation_steps_us") or {}
    rec, lines = runs.get("record"), runs.get("lines")
    if "record" not in summary or rec is None or lines is None or "lines-record" not in steps:
        return ""
    own = rec["cost_us"]["median"]
    made = lines["cost_us"]["median"] - own
    if own <= 0 or made <= 0:
        return ""
    return (f" Live, the request's own part (`record`) costs "
            f"{summary['record']['cost_us']['median'] / own:.1f}x what it costs in process, "
            f"making the lines {steps['lines-record']['median'] / made:.1f}x.")


def _cpu_source(setup: dict[str, Any]) -> str:
    if setup.get("cpu_source") == "schedstat":
        return ("CPU from /proc/PID/task/*/schedstat (each thread's run time in "
                "nanoseconds; /proc's `stat`, in 10 ms ticks, only for the loop's kernel "
                "share).")
    return "CPU from /proc/PID/task/*/stat (utime + stime)."


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
        if not isinstance(row, dict) or "off_us" not in row:
            continue
        # a base from before the thread was named shows its writer as "other threads"
        writer = row["writer_us"] if row["writer_us"]["max"] > 0 else row["threads_cost_us"]
        out.append(f"| {label[build]} | {_us(row['off_us'])} | {_us(row['on_us'])} | "
                   f"{_us(row['cost_us'])} | {_share(row['share'])} | "
                   f"{_us(row['loop_cost_us'])} | {_us(writer)} |")
    paired = _paired(doc)
    notes = [
        "\n".join(out),
        f"Medians over {setup['rounds']} rounds [95% confidence interval of the median, "
        "from order statistics]; a round runs each build's "
        "\"on\" and \"off\" in four alternating turns (on, off, off, on) of "
        f"{setup['duration_s'] / 4:g} s, and the cost is the difference within the round"
        + _fresh(setup) + ". "
        + _verdict(summary["current"]["share"]) + _remainder(doc) +
        " \"The loop\" is the balancer's main thread (on minus off); "
        "\"the writer thread\" is the access log's own thread (named `skymesh-access`; "
        "in a base from before it was named, the difference of all threads but the main "
        "one)." + paired + _in_process(doc, label),
        f"Setup: `skymesh-lb {' '.join(setup['lb_flags'])}` in front of two C stub "
        f"replicas, wrk with {setup['connections']} connections, non-streaming chat "
        "completions whose replies carry `usage`; the access log goes to the daemon's "
        "stderr, a file. " + _cpu_source(setup) + " The machine has "
        f"{setup['cores']} cores shared with other sessions (load average "
        f"{setup['loadavg_before'][0]:.1f} at the start, {setup['loadavg_after'][0]:.1f} "
        "at the end): single turns move by tens of microseconds, so read the medians and "
        "the spreads, not one round.",
    ]
    for key in (LEAN, LEAN_DEFAULT, LEAN_PIPE):
        lean = _lean(doc, key)
        if lean:
            notes.append(lean)
    for ablation in (_ablation(doc), _ablation(
            doc, FLOOR, "The floor and its parts: the least a log made in Python does",
            {"current": "the full log of the same checkout, as the daemon runs it"})):
        if ablation:
            notes.append(ablation)
    return "\n\n".join(notes)


# Where a run's daemons wrote the access log (``--sink``; runs from before it: a file).
_SINKS = {
    "file": "the access log goes to the daemon's stderr, a file, which the writer thread "
            "writes",
    "pipe": "the access log goes to the daemon's stderr, a pipe that a child of the "
            "benchmark drains (its CPU not counted), so the loop writes the batches itself "
            "(`skymesh.obs.logsink`) and the writer thread idles",
}


def _sink(setup: dict[str, Any]) -> str:
    return _SINKS[setup.get("sink") or "file"]


def _floor(summary: dict[str, Any]) -> str:
    """Where the floor's share stands against the target (``--ablate floor``)."""
    row = summary.get("floor")
    if not isinstance(row, dict) or "share" not in row:
        return ""
    return " " + _verdict(row["share"]).replace(
        "The access log now costs", "The floor (`floor`, the least a log made in Python "
        "does) costs", 1)


def _config(setup: dict[str, Any]) -> str:
    """What the daemons ran and wrk sent (``--config``; runs from before it: rr)."""
    if setup.get("config", "rr") == "rr":
        return ""
    return (f"The daemon's default configuration: `skymesh-lb {' '.join(setup['lb_flags'])}` "
            "(its own policy and push mode: no `--policy`, no `--push-mode`), wrk sending "
            "shared-prefix bodies as router-overhead's `default-c64` case does, at "
            f"{setup['connections']} connections: what the log costs on the path users "
            "run, beside the cheapest request above. ")


def _lean(doc: dict[str, Any], key: str = LEAN) -> str:
    """The same measurement with every daemon on the lean HTTP server (a run of its own,
    ``--http-server lean``), with its ablation builds if it had any; ``key``: the run
    with the log to a file (``LEAN``), on the default configuration (``LEAN_DEFAULT``)
    or to a pipe (``LEAN_PIPE``)."""
    run = doc.get(key)
    if not run:
        return ""
    setup, summary = run["setup"], run["summary"]
    pipe = setup.get("sink") == "pipe"
    default = setup.get("config", "rr") == "default"
    label = {"base": f"before (`{setup.get('base')}`)",
             "current": f"now (`{setup.get('current') or 'current'}`)",
             **{b: f"`{b}`: {_PARTS.get(b, b)}" for b in setup.get("ablate", [])}}
    title = ("### With the lean HTTP server, the log to a pipe (`--sink pipe`)" if pipe
             else "### The default configuration, with the lean HTTP server "
                  "(`--config default`)" if default
             else "### With the lean HTTP server (`listen.http_server: lean`)")
    out = [title, "",
           "| build | access log off: CPU us per request | on | cost of the access log "
           "(on - off) | its share of a request | of which the loop | the writer thread |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for build in ("base", "current", *setup.get("ablate", [])):
        row = summary.get(build)
        if not isinstance(row, dict) or "off_us" not in row:
            continue
        out.append(f"| {label[build]} | {_us(row['off_us'])} | {_us(row['on_us'])} | "
                   f"{_us(row['cost_us'])} | {_share(row['share'])} | "
                   f"{_us(row['loop_cost_us'])} | {_us(row['writer_us'])} |")
    paired = summary.get("paired_vs_base_us")
    steps = summary.get("ablation_steps_us") or {}
    said = [f"{_STEPS.get(name, name)}: {_us(s)} us" for name, s in steps.items()]
    text = (_config(setup)
            + "Every daemon with `listen.http_server: lean` (the default since session 25), "
            f"{setup['rounds']} rounds of {setup['duration_s']:g} s in a run of its own"
            + _fresh(setup) + "; " + _sink(setup) + " "
            f"(load average {setup['loadavg_before'][0]:.1f} at the start, "
            f"{setup['loadavg_after'][0]:.1f} at the end). "
            + _verdict(summary["current"]["share"]).replace("now costs", "costs here")
            + (f" Now's cost minus before's, paired by round: {_us(paired)} us."
               if paired else "")
            + _floor(summary)
            + (" Paired by round, " + "; ".join(said) + "." if said else "")
            + _in_process(run, label)
            + " Reproduce: `" + setup["command"] + f" --json docs/results/data/{key}.json`.")
    return "\n".join(out) + "\n\n" + text
