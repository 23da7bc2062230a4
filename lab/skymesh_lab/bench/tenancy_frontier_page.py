"""The results page of ``skymesh_lab.bench.tenancy_frontier``: each setting's interactive
TTFT p50 and p99 against no flood and the batch tenant's throughput against first come
first served (medians over the seeds of each seed's ratios), which settings are on the
frontier and which meet the goals; the engine bound; and the live check when the JSON has
a ``live`` section."""

from __future__ import annotations

import statistics
from typing import Any

from skymesh_lab.bench.results_tables import num, table

NO_FLOOD, FCFS = "no_flood", "fcfs"
# A live run counts as quiet when the machine's load average stays within this many per
# core (as on the tenancy page).
QUIET_LOAD_PER_CPU = 2.0


def _label(p: dict[str, Any], setup: dict[str, Any]) -> str:
    """A setting's name on the page: its knob and value; the default marked."""
    knob, v = p["knob"], p["value"]
    if p["name"] == FCFS:
        return "first come first served"
    if p["name"] == "fair":
        return "fair queue, no reserve"
    if knob == "fixed slots per replica":
        return f"a fixed reserve of {v:g} of {setup.get('max_num_seqs', '?')} slots per replica"
    if knob == "reserve_pace" and v is None:
        return "no pacing"
    if knob == "reserve_stagger":
        if v is None:
            return "`reserve_stagger` on, no slot reserve (`reserve: {}`)"
        if v == setup.get("reserve_headroom"):
            return "`reserve_stagger` on, the default reserve"
        return f"`reserve_stagger` on, `reserve_headroom` {v:g}"
    default = {"reserve_headroom": setup.get("reserve_headroom"),
               "reserve_pace": setup.get("reserve_pace")}.get(knob)
    said = f"`{knob}` {v:g}" if knob in ("reserve_headroom", "reserve_pace") else \
        f"`reserve_pace` 0, `reserve_window_s` {v:g}" if knob.startswith("reserve_pace 0") \
        else f"{knob} {v}"
    if knob == "reserve_pace" and v == 0:
        said += f" (`reserve_window_s` {num(setup.get('reserve_window_s'), 'g')})"
    return said + (" (the default)" if default is not None and v == default else "")


def _ratio(x: Any, base: Any) -> float | None:
    if isinstance(x, int | float) and isinstance(base, int | float) and base:
        return float(x) / float(base)
    return None


def _med(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per setting: the medians over the seeds of each seed's interactive p50 and p99
    over its no flood's, and of its batch throughput (to its last, and while the
    interactive tenant sends) over its first come first served's."""
    by_seed: dict[Any, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_seed.setdefault(r.get("seed"), {})[r["arm"]] = r
    ratios: dict[str, dict[str, list[float | None]]] = {}
    for arms in by_seed.values():
        nf, fc = arms.get(NO_FLOOD, {}), arms.get(FCFS, {})
        for name, r in arms.items():
            if name == NO_FLOOD:
                continue
            got = ratios.setdefault(name, {"p50": [], "p99": [], "batch": [], "while": []})
            got["p50"].append(_ratio(r.get("ttft_p50_s"), nf.get("ttft_p50_s")))
            got["p99"].append(_ratio(r.get("ttft_p99_s"), nf.get("ttft_p99_s")))
            got["batch"].append(_ratio(r.get("batch_tokens_per_s"),
                                       fc.get("batch_tokens_per_s")))
            got["while"].append(_ratio(r.get("batch_tokens_per_s_while_interactive"),
                                       fc.get("batch_tokens_per_s_while_interactive")))
    return {name: {k: _med(v) for k, v in got.items()} | {"seeds": float(len(got["p99"]))}
            for name, got in ratios.items()}


def meets(s: dict[str, float | None], goal_x: float, batch_goal: float) -> bool:
    """p50 and p99 within ``goal_x`` of no flood's and the batch tenant's throughput at
    least ``batch_goal`` of first come first served's, as the page prints them."""
    p50, p99, batch = s.get("p50"), s.get("p99"), s.get("batch")
    return (p50 is not None and p99 is not None and batch is not None
            and round(p50, 2) <= goal_x and round(p99, 2) <= goal_x
            and round(batch, 3) >= round(batch_goal, 3))


def on_frontier(summary: dict[str, dict[str, float | None]]) -> set[str]:
    """The settings no other beats in both the interactive p99 and batch throughput."""
    pts = {n: (s["p99"], s["batch"]) for n, s in summary.items()
           if s.get("p99") is not None and s.get("batch") is not None}
    out = set()
    for n, (p99, batch) in pts.items():
        assert p99 is not None and batch is not None
        if not any(q <= p99 and b >= batch and (q < p99 or b > batch)
                   for m, (q, b) in pts.items() if m != n and q is not None and b is not None):
            out.add(n)
    return out


STAGGER_KNOB = "reserve_stagger"


def _stagger(summary: dict[str, dict[str, float | None]], points: list[dict[str, Any]],
             labels: dict[str, str], goal_x: float, goal: float) -> list[str]:
    """The stagger's settings against the goals and against the same reserve without
    it: the path the engine bound leaves open, met or not."""
    names = [p["name"] for p in points if p["knob"] == STAGGER_KNOB and p["name"] in summary]
    if not names:
        return []
    at_goal = [n for n in names if (b := summary[n]["batch"]) is not None
               and round(b, 3) >= round(goal, 3) and summary[n]["p99"] is not None]
    best = min(at_goal, key=lambda n: summary[n]["p99"] or 0.0) if at_goal else None
    met = [n for n in names if meets(summary[n], goal_x, goal)]
    default = next((p["name"] for p in points if p["knob"] == "reserve_pace"
                    and p["name"] in summary and "(the default)" in labels[p["name"]]), None)
    said = [f"{labels[n]}: p99 {num(summary[n]['p99'], '.2f', suffix='x')}, batch "
            f"{num(summary[n]['batch'], '.1%')} ({num(summary[n]['while'], '.1%')} while the "
            "interactive tenant sends)" for n in names]
    out = ["- The stagger (`reserve_stagger`), the path the engine bound below leaves "
           "open. " + "; ".join(said) + "."]
    if default is not None:
        out[0] += (f" The default reserve without it: "
                   f"{num(summary[default]['p99'], '.2f', suffix='x')} (batch "
                   f"{num(summary[default]['batch'], '.1%')}).")
    if met:
        out.append(f"- It meets all three goals in the simulator: "
                   f"{', '.join(labels[n] for n in met)}.")
    else:
        out.append("- It meets all three goals in no setting: at the simulator's batch goal "
                   f"({goal:.1%}) its lowest p99 is "
                   + (f"{num(summary[best]['p99'], '.2f', suffix='x')} ({labels[best]})"
                      if best is not None else "none (no setting keeps the batch goal)")
                   + f", against the {goal_x:.1f}x goal.")
    return out


def _verdict(summary: dict[str, dict[str, float | None]], labels: dict[str, str],
             goal_x: float, goal: float, which: str) -> str:
    ok = [n for n in labels if n in summary and meets(summary[n], goal_x, goal)]
    head = (f"Against {which} (p50 and p99 within {goal_x:.1f}x, batch at least "
            f"{goal:.1%} of first come first served's)")
    if not ok:
        return f"- {head}: no setting meets all three."
    said = "; ".join(f"{labels[n]} (p50 {summary[n]['p50']:.2f}x, p99 "
                     f"{summary[n]['p99']:.2f}x, batch {summary[n]['batch']:.1%}, while "
                     f"the interactive tenant sends {summary[n]['while'] or 0:.1%})"
                     for n in ok)
    return f"- {head}: {len(ok)} meet all three: {said}."


def _bound(bounds: list[dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    if not bounds:
        return []
    shares = setup.get("bound_shares") or [x["share"] for x in bounds[0]["by_share"]]

    def at(i: int, key: str) -> float | None:
        return _med([b["by_share"][i].get(key) for b in bounds if i < len(b["by_share"])])

    rows = [[f"{s:.0%}", num(at(i, "in_batch_prefill"), ".1%"),
             num(at(i, "ttft_p99_x"), ".2f", suffix="x"),
             num(at(i, "ttft_p99_x_alone"), ".2f", suffix="x"),
             num(at(i, "p99_within_goal_chance"), ".0%"),
             num(at(i, "batch_vs_fcfs_at_best"), ".1%")] for i, s in enumerate(shares)]
    need = _med([b.get("share_needed") for b in bounds])
    at_need = {k: _med([b["at_share_needed"].get(k) for b in bounds])
               for k in ("in_batch_prefill", "ttft_p99_x", "ttft_p99_x_alone",
                         "p99_within_goal_chance", "batch_vs_fcfs_at_best")}
    rows.append([f"{need:.0%} (what the batch goal needs)" if need is not None else "-",
                 num(at_need["in_batch_prefill"], ".1%"),
                 num(at_need["ttft_p99_x"], ".2f", suffix="x"),
                 num(at_need["ttft_p99_x_alone"], ".2f", suffix="x"),
                 num(at_need["p99_within_goal_chance"], ".0%"),
                 num(at_need["batch_vs_fcfs_at_best"], ".1%")])
    step = _med([b.get("batch_prefill_step_s") for b in bounds])
    rate = _med([b.get("batch_rate_fcfs") for b in bounds])
    goal_x = setup.get("goal_x", 1.2)
    x = at_need["ttft_p99_x"]
    reach = ("out of reach" if x is not None and round(x, 2) > goal_x else "not ruled out")
    return [
        "### The engine bound", "",
        "A step runs to its end (the engine, like vLLM V1, does not preempt by priority), "
        f"and each of the flood's batch prefills takes at least {num(step, '.3f', suffix=' s')} of "
        "a step (its 400-token prompt alone in the step, whole: it fits the step's token "
        "budget). At first come first served's rate, "
        f"{num(rate, '.2f')} batch prefills per second per replica, a replica that gives "
        "the batch tenant a share of them while the interactive tenant sends spends at "
        "least that share x the rate x the step in steps that prefill a batch prompt. For "
        "a balancer that releases and routes without knowing where the engine's step is, "
        "a Poisson interactive arrival lands in such a step with that probability (PASTA) "
        "and waits for its remainder. The bound adds only that wait, uniform over the "
        "step, to each interactive request's TTFT with the same arrivals served alone "
        "(the flood's draw without its batch requests), and takes each seed's slowest "
        "of its 60 requests (its p99) at its median over the draws of where the steps "
        "fall; it counts nothing else the flood costs (fuller replicas' longer steps, a "
        "batch prefill sharing the interactive request's own step): a lower bound. The "
        "batch tenant's throughput to its last is at best first come first served's "
        "with the share's loss while the interactive tenant sends made up afterwards. "
        "Medians over the seeds; the chance is that of a seed's p99 being within "
        f"{goal_x:.1f}x.", "",
        table(["share of FCFS's batch prefills while interactive sends",
               "time in batch prefill steps", "p99 bound vs no flood",
               "vs the same arrivals alone", f"chance p99 within {goal_x:.1f}x",
               "batch vs FCFS at best"], rows, [False, True, True, True, True, True]),
        "",
        f"- At the share the simulator's batch goal needs ({num(need, '.0%')} of first "
        "come first served's batch prefills while the interactive tenant sends), the "
        f"engine alone puts the interactive p99 at {num(x, '.2f', suffix='x')} the no-flood one "
        f"(goal: within {goal_x:.1f}x): {reach} for a balancer that does not preempt and "
        "does not route by the engine's step in progress.", ""]


def _quiet(r: dict[str, Any], cpus: float) -> bool:
    load = r.get("load_average_1m")
    return isinstance(load, int | float) and load <= QUIET_LOAD_PER_CPU * cpus


def _in_sim(name: str, sim_met: set[str] | None) -> str:
    """Whether a setting run live met the goals in the simulator (the live batch goal)."""
    if sim_met is None:
        return "."
    return (" (in the simulator, against the live batch goal: "
            + ("all three)." if name in sim_met else "not all three)."))


def _live(rows: list[dict[str, Any]], setup: dict[str, Any], labels: dict[str, str],
          sim_window: float | None, live_s: float | None = None,
          walls: dict[str, float] | None = None,
          sim_met: set[str] | None = None) -> list[str]:
    if not rows:
        return []
    cpus = float(setup.get("live_cpus") or 2)
    goal_x = setup.get("goal_x", 1.2)
    goal = setup.get("live_batch_goal")
    # Each live run (``run``: a partial rerun, tenancy.merge_live) has its own baselines;
    # a setting rerun on a seed shows its latest run only.
    by_seed: dict[tuple[int, Any], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r.get("superseded") and r["arm"] not in (NO_FLOOD, FCFS):
            continue
        by_seed.setdefault((r.get("run", 0), r.get("seed")), {})[r["arm"]] = r
    by_seed = {k: v for k, v in by_seed.items() if set(v) - {NO_FLOOD, FCFS}}
    commands = []
    for run in sorted({k[0] for k in by_seed}):
        names = list(dict.fromkeys(a for (n, _), got in by_seed.items() if n == run
                                   for a in got if a not in (NO_FLOOD, FCFS)))
        seeds = sorted({s for n, s in by_seed if n == run}, key=str)
        took = (walls or {}).get(str(run)) if walls else (live_s if run == 0 else None)
        commands.append(
            "`.venv/bin/python -m skymesh_lab.bench.tenancy_frontier --json "
            f"docs/results/data/tenancy-frontier.json --live-only --live-points "
            f"{','.join(names)} --live-seeds {','.join(str(x) for x in seeds)}`"
            + (f" ({num(took, ',.0f', suffix=' s')} of wall time)" if took else ""))
    out = []
    # setting -> per run: (all three goals met, quiet, batch vs FCFS)
    runs: dict[str, list[tuple[bool, bool, float | None]]] = {}
    window: list[float | None] = []  # the interactive tenant's sending over FCFS's run
    for (_, seed), arms in sorted(by_seed.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        nf, fc = arms.get(NO_FLOOD, {}), arms.get(FCFS, {})
        window.append(_ratio(fc.get("interactive_last_arrival_s"),
                             fc.get("batch_last_done_s")))
        for name, r in arms.items():
            if name in (NO_FLOOD, FCFS):
                continue
            s = {"p50": _ratio(r.get("ttft_p50_s"), nf.get("ttft_p50_s")),
                 "p99": _ratio(r.get("ttft_p99_s"), nf.get("ttft_p99_s")),
                 "batch": _ratio(r.get("batch_tokens_per_s"), fc.get("batch_tokens_per_s")),
                 "while": _ratio(r.get("batch_tokens_per_s_while_interactive"),
                                 fc.get("batch_tokens_per_s_while_interactive"))}
            quiet = all(_quiet(x, cpus) for x in (r, nf, fc))
            ok = goal is not None and meets(s, goal_x, goal)
            runs.setdefault(name, []).append((ok, quiet, s["batch"]))
            out.append([str(seed), labels.get(name, name), num(s["p50"], ".2f", suffix="x"),
                        num(s["p99"], ".2f", suffix="x"), num(s["batch"], ".1%"),
                        num(s["while"], ".1%"),
                        " / ".join(num(x.get("load_average_1m"), ".1f")
                                   for x in (r, fc, nf)),
                        "yes" if quiet else "no", "yes" if ok else "no"])
    return [
        "### Live", "",
        f"Settings run live (those that met the goals in the simulator against the live "
        f"batch goal, and any the note names beside them), on a real `skymesh-lb` before "
        f"two emulated replicas (the tenancy page's live arm: `--max-num-seqs "
        f"{setup.get('max_num_seqs', '?')} --time-scale {setup.get('live_time_scale', '?')}`, "
        f"the flood cut to {setup.get('live_flood', '?')} requests, the interactive rate "
        f"{setup.get('live_rate_per_s', '?')}/s), each run against its own first come "
        "first served and no flood; the live batch goal is the live run's idle capacity "
        f"within a point ({num(goal, '.1%')}). Load average: the setting's, first come "
        "first served's and no flood's; quiet: each at most "
        f"{QUIET_LOAD_PER_CPU:g} per core. Run with " + "; then ".join(commands) + ".", "",
        table(["seed", "setting", "interactive p50 vs no flood", "p99", "batch vs FCFS",
               "the same while interactive sends", "load average", "quiet",
               "all three goals"], out,
              [True, False, True, True, True, True, True, False, False]), "",
        *(f"- {labels.get(name, name)}: all three goals in {sum(ok for ok, _, _ in rs)} of "
          f"{len(rs)} runs ({sum(ok for ok, q, _ in rs if q)} of "
          f"{sum(q for _, q, _ in rs)} quiet); batch "
          f"{' / '.join(num(b, '.1%') for _, _, b in rs)} of first come first served's"
          + _in_sim(name, sim_met) for name, rs in runs.items()),
        f"- The interactive tenant sends for {num(_med(window), '.0%')} of first come first "
        "served's batch run live (medians over the runs), "
        f"{num(sim_window, '.0%')} in the simulator: a setting that gives the batch tenant "
        "nothing while the interactive tenant sends loses that much more of its "
        "throughput to its last live.", ""]


def frontier(doc: dict[str, Any]) -> str:
    s = doc.get("setup", {})
    goal_x = float(s.get("goal_x", 1.2))
    goal = float(s.get("batch_goal", 0.95))
    live_goal = s.get("live_batch_goal")
    summary = summarise(doc.get("flood", []))
    labels = {p["name"]: _label(p, s) for p in doc.get("points", [])}
    best = on_frontier(summary)
    rows = [["no batch at all (no flood)", "1.00x", "1.00x", "0.0%", "0.0%", "-", "-", "-"]]
    for name, label in labels.items():
        x = summary.get(name)
        if x is None:
            continue
        rows.append([label, num(x["p50"], ".2f", suffix="x"), num(x["p99"], ".2f", suffix="x"),
                     num(x["batch"], ".1%"), num(x["while"], ".1%"),
                     "yes" if name in best else "",
                     "yes" if meets(x, goal_x, goal) else "no",
                     ("yes" if meets(x, goal_x, float(live_goal)) else "no")
                     if live_goal is not None else "-"])
    seeds = s.get("seeds", [])
    return "\n".join([
        "## The settings, simulator", "",
        f"The tenancy page's flood ({s.get('flood', '?')} batch requests of 400 prompt and "
        f"200 output tokens in the first second beside {s.get('steady', '?')} interactive "
        f"ones of 200 and 50 at {s.get('steady_rate_per_s', '?')}/s; "
        f"{s.get('replicas', '?')} replicas of {s.get('max_num_seqs', '?')} slots, "
        f"{s.get('profile', '?')}) over {len(seeds)} seeds, each setting one knob of the "
        f"default reserve (`reserve_headroom` {s.get('reserve_headroom', '?')}, "
        f"`reserve_pace` {s.get('reserve_pace', '?')}, `reserve_window_s` "
        f"{s.get('reserve_window_s', '?')} s, `reserve_idle_s` {s.get('reserve_idle_s', '?')} "
        "s) moved: the slots kept free per interactive request in service; a fixed "
        "number of slots per replica; `reserve_pace`, the batch requests not yet started "
        "per replica while an interactive request arrived within `reserve_window_s` "
        "(the balancer's cap on batch prefill work waiting at a replica, in whole "
        "prompts; 0: none, so no batch request is released then); and with "
        "`reserve_pace` 0, that window. And `reserve_stagger`, the path the engine "
        "bound below leaves open: while an interactive request arrived within "
        "`reserve_window_s`, a batch request is released only while no batch request is "
        "pending its start on any replica (one at a time over the replicas, in turn), and "
        "an interactive request goes to a replica with none pending (its first byte, or "
        "a few engine steps, ends the wait). Medians over the seeds of each seed's figure "
        "against its own no flood and first come first served (a seed's p99 is the "
        "slowest of its interactive requests). On the frontier: no other setting has "
        "both a lower p99 and more batch throughput. The goals: p50 and p99 within "
        f"{goal_x:.1f}x; batch at least the simulator's idle capacity within a point "
        f"({goal:.1%})" + (f", and at the live run's ({float(live_goal):.1%}, the "
                           "tenancy page's live goal)" if live_goal is not None else "")
        + ".", "",
        table(["setting", "interactive p50 vs no flood", "p99", "batch vs FCFS (to its last)",
               "the same while interactive sends", "on the frontier", "all three goals",
               "all three, live batch goal"], rows,
              [False, True, True, True, True, False, False, False]), "",
        _verdict(summary, labels, goal_x, goal, "the simulator's goals"),
        *([_verdict(summary, labels, goal_x, float(live_goal),
                    "the live batch goal instead")] if live_goal is not None else []),
        *_stagger(summary, doc.get("points", []), labels, goal_x, goal),
        "", *_bound(doc.get("bound", []), s),
        *_live(doc.get("live", []), s, labels, _sim_window(doc.get("flood", [])),
               doc.get("live_wall_seconds"), doc.get("live_wall_seconds_by_run"),
               {n for n, x in summary.items() if live_goal is not None
                and meets(x, goal_x, float(live_goal))})])


def _sim_window(rows: list[dict[str, Any]]) -> float | None:
    """The interactive tenant's sending over first come first served's batch run, the
    median over the simulator's seeds."""
    return _med([_ratio(r.get("interactive_last_arrival_s"), r.get("batch_last_done_s"))
                 for r in rows if r["arm"] == FCFS])
