"""The ``pushing-rule`` results page: the pushing rule against strict sp-p and blind pushing
on both scheduler modes, from ``docs/results/data/pushing-rule.json``
(``skymesh_lab.bench.rule_grid``; statistics in ``skymesh_lab.bench.rule_stats``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from skymesh_lab.bench.results_tables import num, pct, secs, table
from skymesh_lab.bench.rule_stats import gmean, interval

_SYSTEMS = {"bp": "bp (blind)", "sp-p": "sp-p (strict)", "rule": "rule"}


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(xs) if xs else None


def _span(xs: Sequence[float]) -> str:
    if not xs:
        return "-"
    return " / ".join(f"{x:.2f}" for x in xs)


def _ci(g: float | None, ci: Sequence[float | None] | None, fmt: str = ".3f") -> str:
    """``g`` [lo, hi]; an unbounded interval (one seed) shows as such."""
    if g is None:
        return "-"
    if not ci or ci[0] is None or ci[1] is None:
        return f"{g:{fmt}}x [unbounded]"
    return f"{g:{fmt}}x [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def _ratios(runs: list[dict[str, Any]], scheduler: str, cell: str, num_: str, den: str,
            key: str) -> list[float]:
    """``num_``'s figure over ``den``'s, seed by seed (paired)."""
    by = {(r["system"], r["seed"]): r for r in runs
          if r["scheduler"] == scheduler and r["cell"] == cell}
    return [by[(num_, s)][key] / by[(den, s)][key] for (n, s) in sorted(by)
            if n == num_ and (den, s) in by and by[(den, s)][key]]


def _pair(runs: list[dict[str, Any]], scheduler: str, cell: str, num_: str, den: str,
          key: str, fmt: str) -> str:
    xs = _ratios(runs, scheduler, cell, num_, den, key)
    if not xs:
        return "-"
    lo, hi = interval(xs)
    return _ci(gmean(xs), [lo, hi] if len(xs) > 1 else None, fmt)


def _verdict(data: dict[str, Any], scheduler: str, cell: str) -> dict[str, Any]:
    return next((v for v in data.get("verdicts", [])
                 if v["scheduler"] == scheduler and v["cell"] == cell), {})


def _runs_of(runs: list[dict[str, Any]], scheduler: str, cell: str, system: str
             ) -> list[dict[str, Any]]:
    return [r for r in runs if r["scheduler"] == scheduler and r["cell"] == cell
            and r["system"] == system]


def _per_engine(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{v} on {k}" for k, v in value.items())
    return str(value)


def _criterion(data: dict[str, Any]) -> str:
    crit, setup = data.get("criterion", {}), data.get("setup", {})
    floor, ceiling = crit.get("throughput_floor"), crit.get("ttft_p90_ceiling")
    level = crit.get("confidence", 0.95)
    tuned = setup.get("tuning_seeds")
    return (
        "First criterion (per seed; fixed before seeds 7-14 ran, kept as it was). Per cell "
        "and seed: the rule's "
        "throughput over the better of bp's and sp-p's, and its P90 TTFT over the better "
        "one's (the seeds are paired: every system sees the same workload). Per cell: the "
        f"geometric mean of those ratios with its {num(level * 100, '.0f')}% interval "
        "(Student's t over the log ratios, n - 1 degrees of freedom). A metric **loses** "
        "when its interval lies entirely beyond its bar (throughput below "
        f"{num(floor, '.2f')}x, P90 above {num(ceiling, '.2f')}x), **wins** when it lies "
        "entirely on the good side, and **ties** otherwise; the cell loses when either "
        "metric loses, wins when both win, ties otherwise. The point verdict of the "
        "earlier page (both geometric means within their bars, no interval) stays beside "
        "it. "
        + (f"The rule's parameters were chosen on seeds "
           f"{', '.join(str(s) for s in tuned)}, "
           + ("disjoint from the verdict's." if not set(tuned) & set(setup.get("seeds", []))
              else "**which overlap the verdict's: this is no fair verdict**.")
           if tuned else "")
        + _fresh(setup))


def _fresh(setup: dict[str, Any]) -> str:
    """Whether the verdict's seeds are new to every earlier verdict too."""
    before, seeds = setup.get("judged_before"), setup.get("seeds", [])
    if not before:
        return ""
    seen = sorted(set(before) & set(seeds))
    return (f" Earlier verdicts used seeds {_seeds(before)}; "
            + (f"**these overlap them ({_seeds(seen)})**." if seen
               else "these seeds are new to all of them, and nothing was tuned on them."))


def _seeds(xs: Sequence[int]) -> str:
    return ", ".join(str(s) for s in xs)


SECOND_CRITERION = (
    "Second criterion (written down before seeds 15-22 ran, issue #24 item 4). The first "
    "criterion's comparator, the better of bp and sp-p on each seed, is biased where the "
    "two are equal within noise: the smaller of two noisy P90s lies below either one's "
    "typical value, so a rule equal to both \"loses\" to it. The second criterion chooses "
    "the comparator ONCE per cell and metric: whichever of bp and sp-p has the better "
    "geometric mean over the cell's seeds (higher throughput, lower P90 TTFT; bp on an "
    "exact tie), so the throughput and the P90 comparators may differ. Then, as in the "
    "first: the rule's paired per-seed ratios to that one system, their geometric mean "
    "and 95% interval (Student's t over the logs), the same bars and the same "
    "wins / ties / loses. Both verdicts are shown; neither replaces the other.")


def _decision(data: dict[str, Any]) -> str:
    """The registered decision rule and what it gives on this page's seeds."""
    verdicts = data.get("verdicts", [])
    rule = data.get("rule", {})
    head = ("Written down before this page's seeds ran "
            "([notes](../notes/pushing-rule-default.md)): the rule becomes the default "
            "if no cell loses under the second criterion (per cell). ")
    if not verdicts:
        return head + "No verdicts in this data."
    losing = [f"{v['scheduler']} {v['cell']}" for v in verdicts
              if v.get("verdict_per_cell") == "loses"]
    if losing:
        return head + ("It loses in " + ", ".join(losing)
                       + ": strict sp-p stays the default.")
    return head + (
        "No cell loses: sp-p with `prefer_queue` "
        f"{_per_engine(rule.get('prefer_queue'))} and `hold_queue_max` "
        f"{rule.get('hold_queue_max')} is the default (`pushing.prefer_queue` by replica "
        "kind, the emulator's as vLLM's; `prefer_queue: 0, hold_queue_max: null` is "
        "SkyLB's strict rule, which the SP microbenchmark pages run).")


def _diagnosis(data: dict[str, Any]) -> str:
    runs = data.get("runs", [])
    parts = []
    chat, systematic = [], []
    for sc in ("vllm", "sglang"):
        v = _verdict(data, sc, "chat-arena")
        if v:
            lo, hi = v.get("sp_p_ttft_p90_x_bp_ci") or (None, None)
            if lo is not None and hi is not None and not lo <= 1.0 <= hi:
                systematic.append(sc)
            chat.append(
                f"{sc}: sp-p / bp P90 "
                f"{_ci(v.get('sp_p_ttft_p90_x_bp_gmean'), v.get('sp_p_ttft_p90_x_bp_ci'), '.2f')}"
                f", the rule / sp-p P90 "
                f"{_pair(runs, sc, 'chat-arena', 'rule', 'sp-p', 'ttft_p90_s', '.2f')}, "
                f"the rule / bp P90 "
                f"{_pair(runs, sc, 'chat-arena', 'rule', 'bp', 'ttft_p90_s', '.2f')}")
    if chat:
        parts.append(
            "**Chat** (`chat-arena`): hardly anything waits at the balancers, and the rule "
            "does what strict sp-p does. "
            + ("sp-p's P90 against blind pushing's is noise, not a systematic loss: its "
               "interval holds 1 on both engines (" if not systematic else
               "sp-p's P90 against blind pushing's differs systematically on "
               + ", ".join(systematic) + " (its interval excludes 1; ")
            + "; ".join(chat)
            + "). The comparator \"the better of bp and sp-p\" is the smaller of two noisy "
            "P90s of equal systems, which lies below either one's typical value; a rule "
            "equal to both then shows a P90 ratio above 1 against it on most seeds. Read "
            "the chat cells with the second criterion and the table against each system "
            "separately above.")
    hold = data.get("rule", {}).get("hold_queue_max")
    v = _verdict(data, "sglang", "tot-gsm8k")
    if v:
        shares = ", ".join(
            f"{n} {pct(_mean(_runs_of(runs, 'sglang', 'tot-gsm8k', n), 'slow_share'))}"
            for n in _SYSTEMS)
        tails = ", ".join(
            f"{n} {secs(_mean(_runs_of(runs, 'sglang', 'tot-gsm8k', n), 'tail_ttft_mean_s'))}"
            for n in _SYSTEMS)
        ratios = v.get("ttft_p90_x_best", [])
        worst = max(range(len(ratios)), key=lambda i: ratios[i]) if ratios else None
        detail = ""
        if worst is not None:
            seed = v["seeds"][worst]
            rs = {r["system"]: r for r in runs if r["scheduler"] == "sglang"
                  and r["cell"] == "tot-gsm8k" and r["seed"] == seed}
            rule, bp = rs.get("rule", {}), rs.get("bp", {})
            detail = (
                f" Its worst seed here, {seed} (the rule's P90 {ratios[worst]:.2f}x the "
                f"better one's): blind pushing's P90 {secs(bp.get('ttft_p90_s'))} with "
                f"{pct(bp.get('slow_share'))} slow, the rule's "
                f"{secs(rule.get('ttft_p90_s'))} with {pct(rule.get('slow_share'))} slow; "
                f"of the rule's P90-tail TTFT ({secs(rule.get('tail_ttft_mean_s'))} mean) "
                f"{secs(rule.get('tail_balancer_wait_mean_s'))} was at the balancer, "
                f"{secs(rule.get('tail_held_mean_s'))} of it held for the prefix's replica, "
                f"with the balancer queue at most {num(rule.get('max_balancer_queue'), '.0f')}"
                + (" (not above `hold_queue_max`: the holds stayed on)"
                   if hold is None or (rule.get("max_balancer_queue") or 0) <= hold else "")
                + "; blind pushing's tail "
                f"({secs(bp.get('tail_ttft_mean_s'))} mean) waited inside the engines.")
        parts.append(
            "**`tot-gsm8k` on SGLang**: the TTFT is bimodal. Most requests start in about "
            "one prefill; a minority wait seconds, under blind pushing inside SGLang (its "
            "admission reserves decode room for the long gsm8k outputs), under sp-p and "
            "the rule at the balancer, held for the replica holding the prefix while it "
            "shows a queue (mostly a real one, not SGLang's stale snapshot: "
            "[notes](../notes/pushing-rule-default.md)). Share of requests slower than "
            "twice their run's median (mean over "
            f"seeds): {shares}. The P90 lands on the fast mode when fewer than a tenth are "
            "slow and in the slow one otherwise, so a seed whose slow share crosses 10% "
            "multiplies the ratio (the earlier page's seed-5 outlier was such a seed: "
            "rerun with these figures, its rule crossed a tenth and blind pushing did "
            "not), while the mean TTFT of the slowest tenth "
            f"({tails}) does not follow the P90. {_crossed(runs)}" + detail)
    parts.append(
        "**ToT** (`tot-skylb`): sp-p's P90 tail is time at the balancer, most of it held "
        "for the replica holding the tree's prefix (delay scheduling): a burst of identical "
        "siblings makes that replica show waiting requests, so sp-p holds the rest a probe "
        "or more while blind pushing hands them to the engine at once. The same hold buys "
        "sp-p its throughput (a higher hit rate: siblings admitted one probe apart find "
        "their prefix computed). The rule queues a few of them inside the preferred "
        "replica instead (`prefer_queue`) and stops holding when the balancer's queue is "
        "long (`hold_queue_max`): a lower P90, and a slightly lower hit rate. Tuning (on "
        "the tuning seeds only): the throughput the earlier rule gave up on vLLM came from "
        "both halves. Past a short `hold_queue_max` identical siblings spilled to other "
        "replicas and computed their prompt again, so the trigger went up (it still ends "
        "the mixed tree's blocked window, with less of its P90 gain); and every request "
        "queued for the prefix beyond a few on vLLM cost hit rate (presumably siblings "
        "admitted together computing the same prompt twice), so vLLM gets 3. SGLang "
        "prefills what waits at its next step unless its memory latch is set, so a queue "
        "there costs less: 4 on SGLang lost `tot-gsm8k`'s P90 on the previous page's seeds "
        "(15-22, git 37246a2), 8 keeps it (chosen on seeds 4-11, before these ran). "
        "Holding an identical sibling at the balancer until its twin's first byte (a cache "
        "hit guaranteed) was tried both ways and dropped: instead of queueing it on the "
        "replica it gave back ToT's P90 gain, and instead of spilling it past the trigger "
        "it brought back most of the mixed tree's P90.")
    parts.append(
        "**The mixed tree** (mesh): the 4-branch trees of one region outgrow their "
        "replica; under strict sp-p their requests are held for it one after another, fill "
        "the `window` of requests the dispatcher looks past, and everything behind waits "
        "(SkyLB's overflow forwards only when *no* local replica is available). "
        "`hold_queue_max` ends the holds once the queue is long, and the requests spill "
        "to free local replicas and to peers.")
    return "\n\n".join(parts)


def _crossed(runs: list[dict[str, Any]]) -> str:
    """On how many seeds each system's slow share crossed a tenth (its P90 in the slow mode)."""
    parts = []
    for n in _SYSTEMS:
        rs = sorted(_runs_of(runs, "sglang", "tot-gsm8k", n), key=lambda r: r["seed"])
        over = [r["seed"] for r in rs if (r.get("slow_share") or 0.0) > 0.1]
        parts.append(f"{n} {len(over)} of {len(rs)}"
                     + (f" ({_seeds(over)})" if over else ""))
    return "Seeds on which more than a tenth were slow: " + ", ".join(parts) + "."


REAL_VLLM = (
    "Real vLLM ([the burst run](vllm_burst.md)): with the admission limit known, a "
    "strict sp-p refills a freed slot only after the stream's end has reached the "
    "balancer and the next request has crossed the API server; `engine_queue` (1 on "
    "vLLM) keeps one request of ours waiting inside instead. The rule is the same idea "
    "for the replica holding the prefix, bounded the same way: `takes_preferred` never "
    "lets a replica hold more than `max_num_seqs` plus the larger of `engine_queue` and "
    "`prefer_queue` of ours. The burst run has no shared prefixes (least load, no "
    "preferred replica), so there the rule is sp-p with `engine_queue` and its figures "
    "stand as they are; it was not rerun (this page is simulator only).")


def _runs_table(runs: list[dict[str, Any]], scheduler: str, cell: str) -> str:
    rows = []
    for system in _SYSTEMS:
        rs = _runs_of(runs, scheduler, cell, system)
        if not rs:
            continue
        rows.append([_SYSTEMS[system], num(_mean(rs, "throughput_rps"), ".2f"),
                     secs(_mean(rs, "ttft_p50_s")), secs(_mean(rs, "ttft_p90_s")),
                     secs(_mean(rs, "ttft_p99_s")), pct(_mean(rs, "slow_share")),
                     pct(_mean(rs, "prefix_hit_rate")),
                     secs(_mean(rs, "balancer_wait_mean_s")),
                     secs(_mean(rs, "tail_ttft_mean_s")),
                     secs(_mean(rs, "tail_balancer_wait_mean_s")),
                     secs(_mean(rs, "tail_held_mean_s")),
                     num(_mean(rs, "max_balancer_queue"), ".0f"),
                     num(_mean(rs, "forwarded"), ".0f")])
    return table(["system", "req/s", "TTFT p50", "TTFT p90", "TTFT p99",
                  "slower than 2x median", "hit rate", "balancer wait, mean",
                  "P90 tail: TTFT", "of it at balancers",
                  "of it held for the prefix's replica", "balancer queue max",
                  "forwarded to peers"], rows)


def _chosen(v: dict[str, Any], metric: str, fmt: str) -> str:
    name = v.get(f"{metric}_comparator")
    if name is None:
        return "-"
    return f"{name}: " + _ci(v.get(f"{metric}_x_chosen_gmean"), v.get(f"{metric}_x_chosen_ci"),
                             fmt)


def _bold_loss(verdict: str | None) -> str:
    return "**loses**" if verdict == "loses" else (verdict or "-")


def _verdict_table(data: dict[str, Any]) -> str:
    rows = []
    for v in data.get("verdicts", []):
        rows.append([
            v["scheduler"], v["cell"], str(len(v.get("seeds", []))),
            _ci(v.get("throughput_x_best_gmean"), v.get("throughput_x_best_ci")),
            _ci(v.get("ttft_p90_x_best_gmean"), v.get("ttft_p90_x_best_ci"), ".2f"),
            _bold_loss(v.get("verdict")),
            _chosen(v, "throughput", ".3f"), _chosen(v, "ttft_p90", ".2f"),
            _bold_loss(v.get("verdict_per_cell")),
            "within both bars" if v.get("wins") else "outside a bar"])
    return table(["scheduler", "cell", "seeds", "rule throughput / best per seed [95%]",
                  "rule P90 TTFT / best per seed [95%]", "verdict (per seed)",
                  "rule throughput / the cell's better [95%]",
                  "rule P90 TTFT / the cell's better [95%]", "verdict (per cell)",
                  "point verdict (earlier page)"], rows)


def _summary(verdicts: list[dict[str, Any]], key: str, label: str) -> str:
    by = {k: [f"{v['scheduler']} {v['cell']}" for v in verdicts if v.get(key) == k]
          for k in ("loses", "ties", "wins")}
    counts = ", ".join(f"{k} {len(by[k])}" for k in ("wins", "ties", "loses"))
    if not by["loses"]:
        return (f"{label}: {counts}; the rule wins or ties every cell"
                + (f" (ties: {', '.join(by['ties'])})." if by["ties"] else "."))
    return f"{label}: {counts}; the rule loses in: " + ", ".join(by["loses"]) + "."


def _per_seed_table(data: dict[str, Any]) -> str:
    rows = [[v["scheduler"], v["cell"], " / ".join(str(s) for s in v.get("seeds", [])),
             _span(v.get("throughput_x_best", [])), _span(v.get("ttft_p90_x_best", [])),
             _span(v.get("sp_p_throughput_x_bp", [])), _span(v.get("sp_p_ttft_p90_x_bp", []))]
            for v in data.get("verdicts", [])]
    return table(["scheduler", "cell", "seeds", "rule throughput / best",
                  "rule P90 TTFT / best", "sp-p / bp throughput", "sp-p / bp P90 TTFT"], rows)


def _each_table(data: dict[str, Any]) -> str:
    runs, rows = data.get("runs", []), []
    for v in data.get("verdicts", []):
        sc, cell = v["scheduler"], v["cell"]
        rows.append([sc, cell] + [
            _pair(runs, sc, cell, a, b, key, fmt)
            for a, b in (("rule", "bp"), ("rule", "sp-p"), ("sp-p", "bp"))
            for key, fmt in (("throughput_rps", ".3f"), ("ttft_p90_s", ".2f"))])
    return table(["scheduler", "cell", "rule / bp throughput", "rule / bp P90",
                  "rule / sp-p throughput", "rule / sp-p P90", "sp-p / bp throughput",
                  "sp-p / bp P90"], rows)


def pushing_rule(data: dict[str, Any]) -> str:
    setup, rule = data.get("setup", {}), data.get("rule", {})
    hold = rule.get("hold_queue_max")
    verdicts = data.get("verdicts", [])
    out = [
        f"Seeds {', '.join(str(s) for s in setup.get('seeds', []))}; single-region cells "
        f"{num(setup.get('single_region_s'), '.0f')} s of clients (SkyLB's SP "
        "microbenchmark: 1 region, 4 L4 replicas, 30 tree clients, prefix-tree), mesh cells "
        f"{num(setup.get('mesh_s'), '.0f')} s (SkyLB's Figure 8 setup with its clients, "
        "`skymesh-prefix`); the first 10% of each run is warm-up. The rule: sp-p, plus "
        f"`prefer_queue` {_per_engine(rule.get('prefer_queue'))} (the replica holding a "
        "request's prefix "
        "takes it while fewer than that many requests are pending there) and "
        f"`hold_queue_max` {'none' if hold is None else hold} (no request is held for its "
        "preferred replica while the balancer's queue is longer).", "",
        "### Decision", "", _decision(data), "",
        "### Criterion", "", _criterion(data), "", SECOND_CRITERION, "",
        "### Verdict per cell", "", _verdict_table(data), ""]
    if verdicts:
        out += [_summary(verdicts, "verdict", "First criterion (per seed)"), "",
                _summary(verdicts, "verdict_per_cell", "Second criterion (per cell)")]
    out += ["", "Each seed's ratios:", "", _per_seed_table(data), "",
            "### Against each system separately", "",
            "Not the criterion, a reading aid: the same paired ratios and 95% intervals "
            "against bp alone and sp-p alone, and sp-p against bp.", "",
            _each_table(data), "",
            "### Diagnosis", "", _diagnosis(data), "", REAL_VLLM, ""]
    runs = data.get("runs", [])
    out += ["### Every system, where the requests waited (means over seeds)", "",
            "\"At balancers\": time in the balancers' queues; \"held\": the part of it "
            "spent waiting for the replica holding the prefix while another could take the "
            "request (delay scheduling, `hold_s`). The rest of a TTFT is the network, the "
            "engine's own queue and prefill. \"Slower than 2x median\": the share of "
            "requests whose TTFT is above twice their run's median.", ""]
    for v in verdicts:
        out += [f"**{v['scheduler']} / {v['cell']}**", "",
                _runs_table(runs, v["scheduler"], v["cell"]), ""]
    return "\n".join(out).rstrip()
