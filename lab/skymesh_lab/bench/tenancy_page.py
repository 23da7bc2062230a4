"""The results page of ``skymesh_lab.bench.tenancy``: the interactive tenant beside a
batch flood (simulator, and live when the JSON has a ``live`` section), the share of two
tenants one sending 10x the other, and a tenant at 3x its rate limit through two
balancers. Medians over the seeds."""

from __future__ import annotations

import statistics
from typing import Any

from skymesh_lab.bench.results_tables import num, table

ARMS = {"no_flood": "no flood", "fcfs": "flood, first come first served",
        "fair": "flood, fair queue", "fair_reserve": "flood, fair queue + slot reserve",
        "fair_reserve_fixed": "the same, a fixed reserve of a quarter",
        "fair_reserve_pace2": "the same, `reserve_pace` 2",
        "fair_reserve_nopace": "the same, no pacing",
        "fair_reserve_held": "the same, counting the slots held (`reserve_held`)"}
# The arms the goal lines judge: the fair queue alone, and with each reserve.
GOAL_ARMS = ("fair", "fair_reserve", "fair_reserve_fixed", "fair_reserve_held")
# A live run is quiet when the machine's load average stays within this many per core
# (the page's runs on a shared machine: a busier one moves every figure more than the
# arms differ).
QUIET_LOAD_PER_CPU = 2.0
TAIL_PARTS = (("ttft_s", "TTFT"), ("fair_queue_s", "fair queue"),
              ("dispatch_s", "dispatcher queue and hop"),
              ("engine_wait_s", "engine: admission wait"),
              ("prefill_s", "engine: prefill step(s) and reply"))


def _current(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live rows the page shows: not those a partial rerun replaced (kept only as
    the baselines of the arms measured in the same run)."""
    return [r for r in rows if not r.get("superseded")]


def _in_run(rows: list[dict[str, Any]], r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rows of ``r``'s live run (its seed, in the same repetition), by arm."""
    return {x["arm"]: x for x in rows
            if x.get("seed") == r.get("seed") and x.get("run") == r.get("run")}


def _of_runs(rs: list[dict[str, Any]], rows: list[dict[str, Any]], arm: str
             ) -> list[dict[str, Any]]:
    """The rows of ``arm`` in the runs (seed and repetition) of ``rs``: an arm's
    baselines, each from its own run."""
    runs = {(r.get("seed"), r.get("run")) for r in rs}
    return [x for x in rows if x["arm"] == arm and (x.get("seed"), x.get("run")) in runs]


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(xs) if xs else None


def _by(rows: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def _ratio(rs: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> float | None:
    got, b = _med(rs, key), _med(base, key)
    return got / b if got is not None and b else None


def _idle_share(rs: list[dict[str, Any]], setup: dict[str, Any]) -> float | None:
    """The share of the run's tokens that are the batch tenant's: what first come first
    served's throughput is worth once the interactive tenant takes its own."""
    i_tok, b_tok = setup.get("interactive_request_tokens"), setup.get("batch_request_tokens")
    sent_i, sent_b = _med(rs, "interactive_sent"), _med(rs, "batch_sent")
    if not (i_tok and b_tok and sent_i is not None and sent_b):
        return None
    return float(sent_b * b_tok / (sent_b * b_tok + sent_i * i_tok))


def _label(arm: str, rs: list[dict[str, Any]]) -> str:
    """An arm's name on the page; the default reserve with another headroom, or sized by
    arrivals, or with another fall of its mean, by its value."""
    h = rs[0].get("reserve_headroom") if rs else None
    m = rs[0].get("reserve_miss") if rs else None
    f = rs[0].get("reserve_fall_s") if rs else None
    gaps = rs[0].get("reserve_fall_gaps") if rs else None
    if arm in ARMS:
        return ARMS[arm]
    if m is not None:
        return f"the same, by arrivals, `reserve_miss` {m}"
    if gaps is not None:
        return f"the same, `reserve_fall_gaps` {gaps}"
    if rs and "reserve_fall_gaps" in rs[0]:  # null: the fall over reserve_window_s
        return "the same, its mean falling over `reserve_window_s` (the default before)"
    if f is not None:
        return f"the same, `reserve_fall_s` {f}"
    return f"the same, `reserve_headroom` {h}" if h is not None else arm


def _goal_arms(arms: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The arms the goal lines judge: the fair queue alone, the reserves, the reserve by
    arrivals and with another fall."""
    return [*GOAL_ARMS, *(a for a, rs in arms.items() if a not in GOAL_ARMS and (
        rs[0].get("reserve_miss") is not None or _falls(rs[0])))]


def _falls(r: dict[str, Any]) -> bool:
    """Whether a row's reserve has another fall of its mean (in time, or another number
    of gaps, or none: over reserve_window_s)."""
    return r.get("reserve_fall_s") is not None or "reserve_fall_gaps" in r


def _arms(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows by arm, in the page's order (the named arms first, then the others)."""
    by = _by(rows, "arm")
    return {a: by[a] for a in [*(a for a in ARMS if a in by), *(a for a in by if a not in ARMS)]}


def _paired(rs: list[dict[str, Any]], every: list[dict[str, Any]], pair: str,
            setup: dict[str, Any], quiet: bool) -> tuple[list[dict[str, Any]],
                                                         list[dict[str, Any]]]:
    """``rs`` and the ``pair`` arm's rows of their runs; with ``quiet``, only the runs
    quiet for both (a busy run's baseline moves a ratio more than the arms differ)."""
    if not quiet:
        return rs, _of_runs(rs, every, pair)
    mine, theirs = [], []
    for r in rs:
        p = _in_run(every, r).get(pair)
        if p is not None and _quiet(r, setup) and _quiet(p, setup):
            mine.append(r)
            theirs.append(p)
    return mine, theirs


def _flood(rows: list[dict[str, Any]], setup: dict[str, Any],
           every: list[dict[str, Any]] | None = None, quiet: bool = False) -> list[str]:
    """The arms' table and goal lines; each arm against the first come first served and
    no flood of its own runs, from ``every`` (``rows`` and the rows a partial live rerun
    replaced); with ``quiet`` (live), the goal lines judge only the runs quiet for both
    the arm and its baseline."""
    arms = _arms(rows)
    every = rows if every is None else every
    out = []
    for arm, rs in arms.items():
        label = _label(arm, rs)
        fcfs = _of_runs(rs, every, "fcfs")
        out.append([label, str(len(rs)), num(_med(rs, "ttft_p50_s"), ".3f", suffix=" s"),
                    num(_med(rs, "ttft_p99_s"), ".3f", suffix=" s"),
                    f"{_med(rs, 'batch_completed'):.0f} / {_med(rs, 'batch_sent'):.0f}"
                    if _med(rs, "batch_sent") else "-",
                    num(_med(rs, "batch_tokens_per_s"), ",.0f"),
                    num(_ratio(rs, fcfs, "batch_tokens_per_s"), ".1%"),
                    num(_ratio(rs, fcfs, "batch_tokens_per_s_while_interactive"), ".1%"),
                    num(_med(rs, "batch_longest_wait_s"), ".1f", suffix=" s"),
                    num(_med(rs, "batch_longest_unserved_s"), ".2f", suffix=" s")])
    lines = [table(["arm", "seeds", "interactive TTFT p50", "p99",
                    "batch completed / sent", "batch tokens/s (to its last)",
                    "batch tokens/s vs FCFS", "the same while interactive sends",
                    "batch longest wait", "batch longest unserved"], out,
                   [False, True, True, True, True, True, True, True, True, True]), ""]
    for arm in _goal_arms(arms):
        rs = arms.get(arm, [])
        if not rs:
            continue
        label = _label(arm, rs)
        flooded, base = _paired(rs, every, "no_flood", setup, quiet)
        for key, name in (("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")):
            b, got = _med(base, key), _med(flooded, key)
            if b and got:
                met = "goal met" if got <= 1.2 * b else "goal not met"
                lines.append(f"- {label}: the interactive TTFT {name} under the flood "
                             f"is {got / b:.2f}x the no-flood one{_in_quiet(quiet, len(flooded))} "
                             f"(goal: within 20%): {met}.")
        if quiet and not flooded:
            lines.append(f"- {label}: the interactive TTFT under the flood: no quiet run "
                         "(of the arm and its no flood) to judge.")
        batch, fcfs = _paired(rs, every, "fcfs", setup, quiet)
        share, tps = _idle_share(batch, setup), _ratio(batch, fcfs, "batch_tokens_per_s")
        if quiet and not batch:
            lines.append(f"- {label}: the batch tenant's throughput: no quiet run (of the "
                         "arm and its first come first served) to judge.")
        if share is not None and tps is not None:
            met = "goal met" if tps >= share - 0.01 else "goal not met"
            lines.append(f"- {label}: the batch tenant's throughput to its last is "
                         f"{tps:.1%} of first come first served's{_in_quiet(quiet, len(batch))}, "
                         "where the idle capacity "
                         f"is {share:.1%} of it (the run's tokens less the interactive "
                         f"tenant's; goal: all of it, within a point): {met}.")
    fair = arms.get("fair", [])
    share = _idle_share(fair, setup)
    alone = _ratio(fair, _of_runs(fair, every, "fcfs"), "batch_tokens_per_s")
    if share is not None and alone is not None:
        lines.append(f"- The idle capacity ({share:.1%}) is computed alike in the simulator "
                     "and live, from the tokens sent (the interactive tenant's requests are "
                     "a larger share of a shorter flood). The fair queue alone, which "
                     f"keeps no slot free, gets {alone:.1%}: what a balancer that leaves "
                     "no slot idle gives the batch tenant here.")
    bound = setup.get("max_wait_s", {}).get("batch")
    unserved = [x for a in _goal_arms(arms)
                if (x := _med(arms.get(a, []), "batch_longest_unserved_s")) is not None]
    if bound is not None and unserved:
        verdict = "within" if max(unserved) <= bound else "beyond"
        lines.append(f"- The batch class went unserved for at most {max(unserved):.1f} s, "
                     f"{verdict} its aging bound (`max_wait_s.batch`, {bound:.0f} s).")
    return [*lines, ""]


def _in_quiet(quiet: bool, n: int) -> str:
    return "" if not quiet else " (the quiet run)" if n == 1 else \
        f" (medians of the {n} quiet runs)"


def _tail(rows: list[dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    out = []
    verdicts = []
    slowest = f"slowest {setup.get('tail_share', 0.05):.0%}"
    for arm, rs in _by(rows, "arm").items():
        for which, label in (("all", "all"), ("slowest", slowest)):
            parts = [r[which] for r in rs]
            med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
            out.append([ARMS.get(arm, arm), label, str(len(rs)),
                        *(num(med[k], ".3f", suffix=" s") for k, _ in TAIL_PARTS),
                        num(med["batch_prefills"], ".2f"),
                        num(med["batch_prefill_running"], ".0%")])
            if which == "slowest":
                top = max(TAIL_PARTS[1:], key=lambda kv: med[kv[0]])
                engine = med["engine_wait_s"] + med["prefill_s"]
                balancer = med["fair_queue_s"] + med["dispatch_s"]
                verdicts.append(
                    f"- {ARMS.get(arm, arm)}: of the slowest requests' {med['ttft_s']:.3f} s, "
                    f"the largest part is {top[1]} ({med[top[0]]:.3f} s); inside the engine "
                    f"{engine:.3f} s, at the balancer {balancer:.3f} s.")
    return [
        "### Where the interactive TTFT goes under the flood, simulator", "",
        "Each interactive request's TTFT in parts: waiting in the fair queue; in the "
        "dispatcher's queue until a replica may take it (a replica full of batch and "
        "interactive requests) and the hop there; waiting inside the engine to be "
        "scheduled (the step in progress ends first: a step that prefills batch prompts "
        "takes far longer than a decode step); and its prefill step(s) with the reply's hop. "
        "Batch prefills in its step: how many batch prompts were prefilled in the same "
        "step(s) (the step takes longer with each); batch prefill running: the share that "
        "arrived while such a step ran. Means over all the interactive requests of a seed "
        "and over its slowest ones, medians over the seeds.", "",
        table(["arm", "requests", "seeds", *(name for _, name in TAIL_PARTS),
               "batch prefills in its step", "batch prefill running"], out,
              [False, False, True, True, True, True, True, True, True, True]), "",
        *verdicts, ""]


def _engine(rows: list[dict[str, Any]], flood: list[dict[str, Any]],
            live: list[dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    full = max(rows, key=lambda r: r["seqs"])
    out = [[str(r["seqs"]), num(r["tokens_per_s"], ",.0f"),
            num(r["tokens_per_s"] / full["tokens_per_s"], ".1%"),
            num(r["seqs"] / full["seqs"], ".1%")] for r in sorted(rows, key=lambda r: r["seqs"])]
    idle = setup.get("reserve_idle_s", 0.0)
    window = setup.get("reserve_window_s", idle)

    def held(rs: list[dict[str, Any]], after: float) -> float | None:
        """The median share of the batch run from its start to ``after`` seconds past the
        interactive tenant's last arrival."""
        xs = [min(1.0, (r["interactive_last_arrival_s"] + after) / r["batch_last_done_s"])
              for r in rs if r.get("arm") == "fair_reserve" and r.get("batch_last_done_s")
              and r.get("interactive_last_arrival_s") is not None]
        return statistics.median(xs) if xs else None

    lines = [
        "### Why the batch tenant loses more live than in the simulator", "",
        f"One engine ({full.get('profile', '?')}, the simulator's and `skymesh-replica`'s: "
        "the same `Engine` and step times, live only scaled by `--time-scale`) kept full "
        "with batch requests (400 prompt, 200 output tokens):", "",
        table(["running at once", "batch tokens/s", "vs the full replica",
               "slots vs the full replica"], out, [True, True, True, True]), "",
        "Throughput is below linear in the requests running (each prefill is a fixed "
        "cost a fuller batch does not share), so slots kept free cost the batch tenant "
        "less than their share while the reserve holds. What differs between the two "
        "runs is how much of the batch run the reserve and its pacing cover: they hold "
        f"until `reserve_idle_s` ({idle:.0f} s) and `reserve_window_s` ({window:.0f} s) "
        "after the interactive tenant's last request, wall-clock seconds in both runs, "
        "while the live flood is a third as long and its replicas twice as fast."]
    shares = [(name, held(flood, after), held(live, after))
              for name, after in (("the reserve", idle), ("its pacing", window))]
    said = [f"{name} covers {sim:.0%} of it in the simulator and {lv:.0%} live"
            for name, sim, lv in shares if sim is not None and lv is not None]
    if said:
        lines[-1] += " Here " + "; ".join(said) + "."
    lines.append("")
    lines.append("A live batch request is not streamed: the balancer sees no first byte, "
                 "and the probe shows it started only after the engine's metrics lag (about "
                 "a second). Pacing used to count it as not started until then, so "
                 "`reserve_pace` 1 started about one batch request per replica per second "
                 "while it held; now it counts for eight of the engine's steps after its "
                 "release (the step learnt from finished requests). The fixed reserve's arm "
                 "paces for as long as its reserve holds, as before.")
    return [*lines, ""]


def _phases(rows: list[dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    """Per live arm: batch starts and requests running per replica while pacing may
    hold and after, the share of the batch run the reserve could hold, and the releases
    it held back."""
    out = []
    arms = _arms(rows)

    def ph(rs: list[dict[str, Any]], phase: str, key: str) -> float | None:
        xs = [r[phase][key] for r in rs if r.get(phase)]
        return statistics.median(xs) if xs else None

    for arm, rs in arms.items():
        if arm == "no_flood" or not any(r.get("paced_phase") for r in rs):
            continue
        out.append([_label(arm, rs), str(len(rs)),
                    num(ph(rs, "paced_phase", "batch_starts_per_s_per_replica"), ".2f"),
                    num(ph(rs, "paced_phase", "running_per_replica"), ".1f"),
                    num(ph(rs, "after_phase", "batch_starts_per_s_per_replica"), ".2f"),
                    num(ph(rs, "after_phase", "running_per_replica"), ".1f"),
                    num(_med(rs, "reserve_could_hold_share"), ".0%"),
                    num(_med(rs, "reserve_held_total"), ",.0f")])
    if not out:
        return []
    window = setup.get("reserve_window_s", "?")
    return [
        "Per live arm, while pacing may hold (to `reserve_window_s`, "
        f"{window} s, after the interactive tenant's last request) and after it: batch "
        "requests started per second per replica (the replicas' prompt-token counters, "
        "less the interactive prompts started then) and requests running per replica (the "
        "replicas' gauge, as of its metrics lag ago, sampled every half second); the share "
        "of the batch run the reserve could hold (`reserve_idle_s` after that last "
        "request); and the releases it held back (`skymesh_tenant_reserve_held_total`). "
        "Medians over the runs.", "",
        table(["arm", "runs", "batch starts/s per replica, paced", "running per replica, "
               "paced", "batch starts/s per replica, after", "running per replica, after",
               "reserve could hold", "releases held back"], out,
              [False, True, True, True, True, True, True, True]), "",
        *_phase_notes(arms, ph), ""]


def _phase_notes(arms: dict[str, list[dict[str, Any]]], ph: Any) -> list[str]:
    """What the phases say: pacing's cost (the default arm against no pacing) and what is
    left of the gap to first come first served (requests running per replica)."""
    paced, nopace, fcfs, fair = (arms.get(a, []) for a in (
        "fair_reserve", "fair_reserve_nopace", "fcfs", "fair"))
    got = [ph(rs, phase, key) for rs, phase, key in (
        (paced, "paced_phase", "batch_starts_per_s_per_replica"),
        (nopace, "paced_phase", "batch_starts_per_s_per_replica"),
        (paced, "paced_phase", "running_per_replica"),
        (fcfs, "paced_phase", "running_per_replica"),
        (paced, "after_phase", "running_per_replica"),
        (fcfs, "after_phase", "running_per_replica"))]
    if any(x is None for x in got):
        return []
    s_p, s_n, r_p, r_f, a_p, a_f = got
    # Pacing is judged a cost when it starts a tenth fewer than no pacing (runs differ).
    why = ("not the pacing" if s_p >= 0.9 * s_n else
           "and the pacing, which starts fewer")
    out = []
    after = [ph(rs, "after_phase", "batch_starts_per_s_per_replica")
             for rs in (paced, fcfs, fair)]
    if None not in after:
        t_r, t_f, t_q = after
        # Runs differ by some hundredths of a start per second: a tenth is a difference.
        cost = "does not slow it" if t_r >= 0.9 * min(t_f, t_q) else "slows it"
        out.append(f"- After pacing's window the default reserve starts {t_r:.2f} batch "
                   f"requests per second per replica, first come first served {t_f:.2f}, "
                   f"the fair queue alone {t_q:.2f}: the run's tail, where the reserve "
                   f"keeps a slot per replica free until `reserve_idle_s`, {cost}; the "
                   "batch tenant's loss is made while the interactive tenant sends.")
    return [f"- While pacing may hold, the default reserve starts {s_p:.2f} batch requests "
            f"per second per replica, without pacing {s_n:.2f}; the requests running per "
            f"replica are {r_p:.1f} against first come first served's {r_f:.1f} then, and "
            f"{a_p:.1f} against {a_f:.1f} after: the slots the reserve keeps free (beside "
            "the interactive requests, and at least one per replica for as long as it holds), "
            f"{why}.", *out]


def _figures(rows: list[dict[str, Any]], arm: str,
             every: list[dict[str, Any]] | None = None) -> dict[str, float] | None:
    """An arm's batch throughput vs FCFS and its interactive p50 and p99 vs no flood
    (medians; the baselines of its own runs, from ``every``), or None when the run lacks
    them."""
    every = rows if every is None else every
    rs = _by(rows, "arm").get(arm, [])
    fcfs, base = _of_runs(rs, every, "fcfs"), _of_runs(rs, every, "no_flood")
    got = {"batch": _ratio(rs, fcfs, "batch_tokens_per_s"),
           "p50": _ratio(rs, base, "ttft_p50_s"), "p99": _ratio(rs, base, "ttft_p99_s")}
    return {k: v for k, v in got.items() if v is not None} if None not in got.values() \
        else None


def _alternatives(flood: list[dict[str, Any]]) -> list[str]:
    """The arms that change the default reserve's rule or size: by arrivals, another
    headroom, counting the slots held, another fall of its mean."""
    return list(dict.fromkeys(
        r["arm"] for r in flood if r.get("reserve_miss") is not None
        or r.get("reserve_headroom") is not None or r["arm"] == "fair_reserve_held"
        or _falls(r)))


def _quiet_pairs(live: list[dict[str, Any]], arm: str, setup: dict[str, Any]
                 ) -> list[tuple[dict[str, float], dict[str, float]]]:
    """Per live run quiet for ``arm``, the default reserve and the run's two baselines
    (first come first served, no flood): each one's batch
    throughput vs the run's first come first served and p50 vs its no flood."""
    out = []
    for r in sorted(_current(live), key=lambda r: str(r.get("seed"))):
        run = _in_run(live, r)
        d = run.get("fair_reserve")
        if r["arm"] != arm or d is None or not _all_quiet(
                (r, d, run.get("fcfs"), run.get("no_flood")), setup):
            continue
        got = (_figures(list(run.values()), arm), _figures(list(run.values()), "fair_reserve"))
        if got[0] is not None and got[1] is not None:
            out.append((got[0], got[1]))
    return out


def _against_default(flood: list[dict[str, Any]], live: list[dict[str, Any]],
                     setup: dict[str, Any]) -> list[str]:
    """Each other reserve against the default, in the simulator and live, and whether it
    meets the rule for a new default: the simulator no worse (batch throughput,
    interactive p50 and p99) and live better: in each run quiet for both, more batch
    throughput with the interactive p50 within its goal or no worse than the
    default's (with no quiet run, the same on the medians)."""
    out = []
    for arm in _alternatives(flood):
        label = _label(arm, [r for r in flood if r["arm"] == arm])
        sim, sim0 = _figures(flood, arm), _figures(flood, "fair_reserve")
        if sim is None or sim0 is None:
            continue
        worse = [k for k in ("batch", "p50", "p99")
                 if (sim[k] < sim0[k] if k == "batch" else sim[k] > sim0[k])]
        said = (f"- {label}, simulator: batch {sim['batch']:.1%} of first come first "
                f"served's (the default reserve {sim0['batch']:.1%}), interactive p50 "
                f"{sim['p50']:.2f}x ({sim0['p50']:.2f}x), p99 {sim['p99']:.2f}x "
                f"({sim0['p99']:.2f}x): " + ("no worse" if not worse else
                                             "worse in " + ", ".join(worse)))

        def beats(x: dict[str, float], x0: dict[str, float]) -> bool:
            return x["batch"] > x0["batch"] and (x["p50"] <= 1.2 or x["p50"] <= x0["p50"])

        mine = [r for r in _current(live) if r["arm"] == arm]
        # The default of the same runs (a partial rerun's default is another run's).
        lv, lv0 = (_figures(mine, arm, live),
                   _figures(_of_runs(mine, live, "fair_reserve"), "fair_reserve", live))
        better = None
        busy = False  # loads recorded, and no run quiet for both: not judged live
        if lv is not None and lv0 is not None:
            quiet = _quiet_pairs(live, arm, setup)
            busy = not quiet and any(isinstance(r.get("load_average_1m"), int | float)
                                     for r in mine)
            better = all(beats(x, x0) for x, x0 in quiet) if quiet else beats(lv, lv0)
            said += (f"; live: batch {lv['batch']:.1%} ({lv0['batch']:.1%}), interactive "
                     f"p50 {lv['p50']:.2f}x ({lv0['p50']:.2f}x)")
            if quiet:
                said += (", in the quiet runs batch "
                         + " / ".join(f"{x['batch']:.1%} ({x0['batch']:.1%})"
                                      for x, x0 in quiet)
                         + ", p50 " + " / ".join(f"{x['p50']:.2f}x ({x0['p50']:.2f}x)"
                                                 for x, x0 in quiet))
            said += ": " + ("better" if better else "not better")
            if busy:
                said += (" on the medians, but no run was quiet for both and their "
                         "baselines (load average "
                         f"at most {_quiet_load(setup):.0f})")
        if busy and not worse:
            out.append(f"{said}. The simulator meets the rule for a new default; live it "
                       "awaits quiet runs (the simulator no worse, each quiet live run "
                       "better).")
            continue
        verdict = "meets" if not worse and better else "does not meet"
        out.append(f"{said}. It {verdict} the rule for a new default (the simulator no "
                   "worse, live better).")
    if not out:
        return []
    return ["### Other reserves against the default", "",
            "The default reserve keeps `reserve_headroom` x the interactive requests in "
            "service free beside the slots they hold. The others: another headroom; by "
            "arrivals (`reserve_miss`), the fewest slots that leave at most that share of "
            "the interactive requests finding none, from their arrival rate against the "
            "rate slots free up; counting the slots held (`reserve_held`), headroom x "
            "their mean in service is their part, in service and free together, so the "
            "slots kept free are that less those in service now; another fall of its "
            "mean in service (`reserve_fall_s`; `reserve_fall_gaps`, "
            "over another number of the interactive mean inter-arrival gaps, or null: over "
            "`reserve_window_s`, the default before) (docs: the slot reserve). "
            "Medians of the tables above, and live each quiet run's figures against its "
            "own first come first served and no flood; in brackets the default reserve's. "
            "The simulator's p99 here is over the page's 5 seeds, whose draw moves it by "
            "more than these arms differ: a reserve that meets this rule becomes the "
            "default only once 20 seeds agree ([the 20-seed check]"
            "(../notes/tenancy-sim-p99.md#what-it-means-for-the-comparison-with-the-default)).",
            "", *out, ""]


def _light(rows: list[dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    return [
        "### A light interactive tenant, simulator", "",
        f"The same flood with the interactive tenant at {setup.get('light_rate_per_s', '?')}/s: "
        "a fixed reserve keeps its slots free whatever the interactive load; the adaptive one "
        f"keeps `reserve_headroom` ({setup.get('reserve_headroom', '?')}) x the interactive "
        "requests in service, at least one slot per replica; with `reserve_fall_s` its "
        "mean falls within that long after each interactive request ends. "
        f"{_gaps_said(setup)}", "",
        *_flood(rows, setup)[:-1], *_light_falls(rows), ""]


def _gaps_said(setup: dict[str, Any]) -> str:
    """How the default's mean falls at the light rate, when the run records it."""
    gaps, window = setup.get("reserve_fall_gaps"), setup.get("reserve_window_s", "?")
    if not gaps:
        return ("With `reserve_fall_gaps` its mean falls over that many of the interactive "
                "mean inter-arrival gaps (at this rate, about a fall over "
                "`reserve_window_s`).")
    return (f"The default's mean falls over `reserve_fall_gaps` ({gaps}) of the "
            "interactive mean inter-arrival gaps, at most `reserve_window_s` "
            f"({window} s): at this rate, about the default before's fall over "
            "`reserve_window_s`, so a light tenant keeps the slot its lone requests need.")


def _light_falls(rows: list[dict[str, Any]]) -> list[str]:
    """Each reserve with another fall against the default at the light load: its tail
    is what a reserve that forgets the load sooner risks when requests come one by one."""
    out = []
    for arm, rs in _arms(rows).items():
        if not _falls(rs[0]):
            continue
        got, ref = _figures(rows, arm), _figures(rows, "fair_reserve")
        if got is None or ref is None:
            continue
        worse = [k for k in ("p50", "p99") if got[k] > ref[k]] + \
            (["batch"] if got["batch"] < ref["batch"] else [])
        out.append(f"- {_label(arm, rs)} at this light load: interactive p50 "
                   f"{got['p50']:.2f}x (the default reserve {ref['p50']:.2f}x), p99 "
                   f"{got['p99']:.2f}x ({ref['p99']:.2f}x), batch {got['batch']:.1%} "
                   f"({ref['batch']:.1%}): "
                   + ("worse in " + ", ".join(worse) if worse else "no worse") + ".")
    return out


def _live(rows: list[dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    scale = setup.get("live_time_scale", "?")
    return [
        "### Live: `skymesh-lb` and two emulated replicas over loopback", "",
        f"The same arms on a real `skymesh-lb` (one worker) in front of two `skymesh-replica` "
        f"processes (`--max-num-seqs {setup.get('max_num_seqs', '?')} --time-scale {scale}`: "
        f"the L4 profile at 1/{scale} of its step times), one balancer per arm. The same "
        f"request shapes, the interactive rate scaled with the replicas' speed "
        f"({setup.get('live_rate_per_s', '?')}/s), the flood cut to "
        f"{setup.get('live_flood', '?')} requests so an arm takes about a minute. Wall-clock "
        f"figures, medians of {_runs(rows)} on a machine of "
        f"{setup.get('live_cpus', '?')} cores shared with other work: the TTFT includes the "
        "loopback and the balancer's own time, and varies by some tens of milliseconds "
        "between runs. Longest unserved: the longest gap between two batch completions as "
        "the client sees them (the batch requests are not streamed).", "",
        *_flood(_current(rows), setup, rows, quiet=True), *_spread(rows, setup),
        *_phases(_current(rows), setup)]


def _spread(rows: list[dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    """Per reserve arm and live run, against the same run's first come first served and
    no flood: how far the runs differ, and in how many both goals were met."""
    out: list[list[str]] = []
    verdicts: list[str] = []
    for arm, rs in _arms(_current(rows)).items():
        if arm in ("no_flood", "fcfs"):
            continue
        tps, p50, load, met, quiet, quiet_met = [], [], [], 0, 0, 0
        for r in sorted(rs, key=lambda r: r.get("seed", 0)):
            run = _in_run(rows, r)
            fcfs, base = run.get("fcfs"), run.get("no_flood")
            share = _idle_share([r], setup)
            if not (fcfs and base and fcfs.get("batch_tokens_per_s")
                    and r.get("batch_tokens_per_s") and share is not None):
                continue
            tps.append(r["batch_tokens_per_s"] / fcfs["batch_tokens_per_s"])
            p50.append(r["ttft_p50_s"] / base["ttft_p50_s"])
            load.append(num(r.get("load_average_1m"), ".0f"))
            both = tps[-1] >= share - 0.01 and p50[-1] <= 1.2
            met += both
            if _all_quiet((r, fcfs, base), setup):  # the arm and both its baselines
                quiet += 1
                quiet_met += both
        if tps:
            out.append([_label(arm, rs), " / ".join(f"{x:.1%}" for x in tps),
                        f"{100 * (max(tps) - min(tps)):.1f} points",
                        " / ".join(f"{x:.2f}x" for x in p50),
                        f"{met} of {len(tps)}", f"{quiet_met} of {quiet}",
                        " / ".join(load)])
            if arm in GOAL_ARMS[1:] and quiet:
                verdicts.append(
                    f"- {_label(arm, rs)}: both goals in each quiet run: "
                    + ("goal met" if quiet_met == quiet else "goal not met")
                    + f" ({quiet_met} of {quiet}).")
    if not out:
        return []
    return [
        "Per run (each against the same run's first come first served and no flood): "
        "the batch tenant's throughput, the interactive TTFT p50, and the runs in which "
        "both goals were met (batch within a point of the idle capacity, p50 within 20%); "
        f"and the machine's load average during the arm (its {setup.get('live_cpus', '?')} "
        "cores shared with other work; -: not recorded); quiet runs: those in which the "
        "arm, the run's first come first served and its no flood each had a load "
        f"average of at most {_quiet_load(setup):.0f} ({QUIET_LOAD_PER_CPU:.0f} per core).",
        "", table(["arm", "batch tokens/s vs FCFS, per run", "spread",
                   "interactive TTFT p50 vs no flood, per run", "both goals met",
                   "both goals met, quiet runs", "load average, per run"], out,
                  [False, True, True, True, True, True, True]), "", *verdicts,
        *([""] if verdicts else [])]


def _quiet_load(setup: dict[str, Any]) -> float:
    return QUIET_LOAD_PER_CPU * float(setup.get("live_cpus") or 2)


def _quiet(r: dict[str, Any], setup: dict[str, Any]) -> bool:
    """Whether a live arm's run was quiet (its load average recorded and low)."""
    load = r.get("load_average_1m")
    return isinstance(load, int | float) and load <= _quiet_load(setup)


def _all_quiet(rs: tuple[dict[str, Any] | None, ...], setup: dict[str, Any]) -> bool:
    """Whether every one of a run's arms ``rs`` (a ratio's numerator and baselines) ran
    quiet: a busy baseline moves a ratio as much as a busy arm."""
    return all(r is not None and _quiet(r, setup) for r in rs)


def _runs(rows: list[dict[str, Any]]) -> str:
    n = len({r.get("seed") for r in rows})
    return "one run" if n == 1 else \
        f"{n} runs (each arm once per run, with its own interactive arrivals)"


def _lull(rows: list[dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    by: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in rows:
        idle = r["idle_s"]
        by.setdefault((-1.0 if idle is None else idle, r.get("reserve", "")), []).append(r)
    alone = _med(by.get((-1.0, "auto"), by.get((-1.0, ""), [])), "batch_tokens_per_s")
    out = []
    for (idle, kind), rs in sorted(by.items(), key=lambda kv: (kv[0][1] == "fixed", kv[0][0])):
        tps = _med(rs, "batch_tokens_per_s")
        label = "fair queue alone" if idle < 0 else \
            f"{'fixed reserve' if kind == 'fixed' else 'reserve'}, idle {idle:.0f} s"
        out.append([label,
                    str(len(rs)), num(_med(rs, "ttft_p50_s"), ".3f", suffix=" s"),
                    num(_med(rs, "ttft_after_lull_max_s"), ".2f", suffix=" s"),
                    num(tps, ",.0f"),
                    num(tps / alone if tps is not None and alone else None, ".1%")])
    return [
        "### A lull in the interactive traffic (`reserve_idle_s`), simulator", "",
        f"The same flood; the interactive tenant sends {setup.get('lull_burst', '?')} "
        f"requests, falls silent for {setup.get('lull_s', '?')} s, then sends "
        f"{setup.get('lull_burst', '?')} more. A reserve that lapses during the lull gives "
        "the batch tenant the idle slots, and the first interactive requests after it "
        f"wait for slots to free (worst of the first {setup.get('lull_first', '?')}).", "",
        table(["setting", "seeds", "interactive TTFT p50",
               "worst TTFT just after the lull", "batch tokens/s",
               "vs the fair queue alone"], out, [False, True, True, True, True, True]), ""]


def _share(rows: list[dict[str, Any]]) -> str:
    out = []
    for arm, rs in sorted(_by(rows, "arm").items(), key=lambda kv: kv[0] != "fcfs"):
        out.append([{"fcfs": "first come first served", "fair": "fair queue"}.get(arm, arm),
                    str(len(rs)), num(_med(rs, "both_backlogged_s"), ".0f", suffix=" s"),
                    num(_med(rs, "windows"), ".0f"),
                    num(_med(rs, "light_share"), ".1%"),
                    f"{num(_med(rs, 'light_share_window_min'), '.1%')} - "
                    f"{num(_med(rs, 'light_share_window_max'), '.1%')}"])
    return table(["order", "seeds", "both backlogged for", "windows",
                  "light tenant's share of service", "per window (min - max, medians)"], out,
                 [False, True, True, True, True, False])


def _limits(rows: list[dict[str, Any]]) -> str:
    out = []
    for spread, rs in sorted(_by(rows, "spread").items()):
        adm, lim = _med(rs, "admitted_per_s"), _med(rs, "limit_per_s")
        out.append([{"even": "alternating", "one": "all to one"}.get(spread, spread),
                    str(len(rs)), num(_med(rs, "offered_per_s"), ".1f", suffix="/s"),
                    num(adm, ".2f", suffix="/s"), num(lim, ".0f", suffix="/s"),
                    num(adm / lim if adm is not None and lim else None, ".1%")])
    return table(["requests over the two balancers", "seeds", "offered", "admitted",
                  "limit", "admitted / limit"], out,
                 [False, True, True, True, True, True])


def tenancy(doc: dict[str, Any]) -> str:
    s = doc.get("setup", {})
    return "\n".join([
        "## An interactive tenant beside a batch flood", "",
        f"One region, {s.get('replicas', '?')} replicas, least-load, "
        f"`{s.get('push_mode', '?')}`. The batch tenant sends {s.get('flood', '?')} "
        f"requests (400 prompt, 200 output tokens) in the first second; the interactive "
        f"one {s.get('steady', '?')} requests (200 prompt, 50 output) at "
        f"{s.get('steady_rate_per_s', '?')}/s (Poisson) from 0.5 s. Each replica admits "
        f"{s.get('max_num_seqs', '?')} requests at once (`max_num_seqs`, known "
        "to the balancer as a live engine publishes it). The slot reserve is the default "
        f"(`tenants.reserve` {s.get('reserve', {})}: adaptive, `reserve_headroom` "
        f"{s.get('reserve_headroom', '?')}, `reserve_idle_s` "
        f"{s.get('reserve_idle_s', '?')} s, `reserve_pace` {s.get('reserve_pace', '?')}"
        + (f", its mean falling over `reserve_fall_gaps` {s['reserve_fall_gaps']} of the "
           "interactive mean inter-arrival gaps, at most `reserve_window_s` "
           f"{s.get('reserve_window_s', '?')} s" if s.get("reserve_fall_gaps") else "")
        + "); "
        f"the fixed reserve is {s.get('reserve_fixed', '?')}, the default before. "
        "Medians over the seeds (a seed's p99 is the slowest of its interactive requests, "
        "so the simulator's p99 moves with the seeds: [why it moved between two runs]"
        "(../notes/tenancy-sim-p99.md)); batch tokens/s vs FCFS is the batch tenant's "
        "throughput "
        "against first come first served's, its "
        "share of the capacity the interactive tenant leaves, to its last request and "
        "while the interactive tenant sends (to its last request's arrival). The last "
        "arms keep the default reserve and loosen its pacing (the trade-off of "
        "`reserve_pace`), change its `reserve_headroom` (the slots it keeps free while "
        "the interactive tenant sends), or size it by arrivals (`reserve_miss`: the "
        "fewest slots that leave at most that share of the interactive requests finding "
        "none, from their arrival rate against the rate slots free up), or count the "
        "slots the interactive requests hold against their reserve (`reserve_held`), or "
        "let its mean of the interactive requests in service fall within "
        "`reserve_fall_s` instead of `reserve_window_s` (the slots of a falling "
        "interactive load given back sooner), or over another number of the interactive "
        "tenant's mean inter-arrival gaps (`reserve_fall_gaps`, at most "
        "`reserve_window_s`; null: over `reserve_window_s` whatever its rate).", "",
        "Every knob of the reserve swept from first come first served to no batch "
        "request while an interactive one may arrive, over 20 seeds, with the bound the "
        "engine model sets on the interactive p99 for a balancer that does not preempt: "
        "[the frontier](tenancy-frontier.md).",
        "", "### Simulator", "", *_flood(doc["flood"], s),
        *(_tail(doc["tail"], s) if doc.get("tail") else []),
        *(_live(doc["live"], s) if doc.get("live") else []),
        *_against_default(doc["flood"], doc.get("live") or [], s),
        *(_engine(doc["engine"], doc["flood"], doc.get("live") or [], s)
          if doc.get("engine") else []),
        *(_light(doc["light"], s) if doc.get("light") else []),
        *(_lull(doc["lull"], s) if doc.get("lull") else []),
        "## Two tenants of equal weight, one sending 10x the other", "",
        f"Both in one class, both backlogged from the start ({s.get('heavy', '?')} and "
        f"{s.get('light', '?')} requests of the same size within the first second). "
        f"Service: prompt + output tokens of the requests finished in each "
        f"{s.get('window_s', '?')} s window, over the full windows before the light "
        "tenant's last request finished. Equal service is a 50% share.", "",
        _share(doc["share"]), "",
        "## A tenant at 3x its rate limit through two balancers", "",
        "The pure buckets (`Limiter`, `share` 2: each balancer holds half the limit) on a "
        f"fake clock, {s.get('limit_run_s', 60):.0f} s of Poisson arrivals at "
        f"{s.get('offered_x', 3):.0f}x `requests_per_s`, alternating between the balancers "
        "or all reaching one.", "",
        _limits(doc["limits"]), ""])
