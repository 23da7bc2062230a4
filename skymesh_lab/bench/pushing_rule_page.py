"""The ``pushing-rule`` results page: the pushing rule against strict sp-p and blind pushing
on both scheduler modes, from ``docs/results/data/pushing-rule.json``
(``skymesh_lab.bench.rule_grid``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from skymesh_lab.bench.results_tables import num, pct, secs, table

_SYSTEMS = {"bp": "bp (blind)", "sp-p": "sp-p (strict)", "rule": "rule"}


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(xs) if xs else None


def _span(xs: Sequence[float]) -> str:
    if not xs:
        return "-"
    return " / ".join(f"{x:.2f}" for x in xs)


def _vs_strict(runs: list[dict[str, Any]], scheduler: str, cell: str, key: str
               ) -> list[float]:
    """The rule's figure over strict sp-p's, seed by seed."""
    by = {(r["system"], r["seed"]): r for r in runs
          if r["scheduler"] == scheduler and r["cell"] == cell}
    return [by[("rule", s)][key] / by[("sp-p", s)][key] for (n, s) in sorted(by)
            if n == "rule" and ("sp-p", s) in by and by[("sp-p", s)][key]]


DIAGNOSIS = (
    "Why sp-p loses where it does, on this model (the tables below give the figures): "
    "**ToT on vLLM and SGLang** (`tot-skylb`): sp-p's P90 tail is time at the balancer, "
    "most of it *held* for the replica holding the tree's prefix (delay scheduling): a "
    "burst of identical siblings makes that replica show waiting requests, or fills the "
    "step's token budget with prompts that are mostly cached, so sp-p holds the rest a "
    "probe or more while blind pushing hands them to the engine at once. The same hold "
    "is what buys sp-p its throughput (a higher hit rate: siblings admitted one probe "
    "apart find their prefix computed). **`tot-gsm8k` on SGLang**: SGLang publishes "
    "`num_queue_reqs` only at its log points, so a replica keeps showing a queue that "
    "has already drained and sp-p holds requests for it; the P90 sits on the knee of a "
    "distribution whose slowest tenth blind pushing serves far later (compare the "
    "tail means). **The mixed tree** (mesh): the 4-branch trees of one region outgrow "
    "their replica; their requests are held for it one after another, fill the "
    "`window` of requests the dispatcher looks past, and everything behind waits, while "
    "SkyLB's overflow forwards only when *no* local replica is available, which other "
    "local replicas are: hence the long balancer queue and few forwards. "
    "**Chat**: hardly anything waits at the balancers and the rule does what strict sp-p "
    "does; where sp-p's P90 differs from blind pushing's the time is not spent at the "
    "balancer, and it differs in one seed of three.")

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
        rs = [r for r in runs if r["scheduler"] == scheduler and r["cell"] == cell
              and r["system"] == system]
        if not rs:
            continue
        rows.append([_SYSTEMS[system], num(_mean(rs, "throughput_rps"), ".2f"),
                     secs(_mean(rs, "ttft_p50_s")), secs(_mean(rs, "ttft_p90_s")),
                     pct(_mean(rs, "prefix_hit_rate")),
                     secs(_mean(rs, "balancer_wait_mean_s")),
                     secs(_mean(rs, "tail_ttft_mean_s")),
                     secs(_mean(rs, "tail_balancer_wait_mean_s")),
                     secs(_mean(rs, "tail_held_mean_s")),
                     num(_mean(rs, "max_balancer_queue"), ".0f"),
                     num(_mean(rs, "forwarded"), ".0f")])
    return table(["system", "req/s", "TTFT p50", "TTFT p90", "hit rate",
                  "balancer wait, mean", "P90 tail: TTFT", "of it at balancers",
                  "of it held for the prefix's replica", "balancer queue max",
                  "forwarded to peers"], rows)


def pushing_rule(data: dict[str, Any]) -> str:
    setup, rule, crit = data.get("setup", {}), data.get("rule", {}), data.get("criterion", {})
    hold = rule.get("hold_queue_max")
    out = [
        f"Seeds {', '.join(str(s) for s in setup.get('seeds', []))}; single-region cells "
        f"{num(setup.get('single_region_s'), '.0f')} s of clients (SkyLB's SP "
        "microbenchmark: 1 region, 4 L4 replicas, 30 tree clients, prefix-tree), mesh cells "
        f"{num(setup.get('mesh_s'), '.0f')} s (SkyLB's Figure 8 setup with its clients, "
        "`skymesh-prefix`); the first 10% of each run is warm-up. The rule: sp-p, plus "
        f"`prefer_queue` {rule.get('prefer_queue')} (the replica holding a request's prefix "
        "takes it while fewer than that many requests are pending there) and "
        f"`hold_queue_max` {'none' if hold is None else hold} (no request is held for its "
        "preferred replica while the balancer's queue is longer).", "",
        f"Criterion, per cell: the rule's throughput at least "
        f"{num(crit.get('throughput_floor'), '.2f')}x and its P90 TTFT at most "
        f"{num(crit.get('ttft_p90_ceiling'), '.2f')}x those of the better of bp and sp-p "
        "(geometric mean of the per-seed ratios; each seed's ratio listed).", "",
        "### Verdict per cell", ""]
    rows = []
    for v in data.get("verdicts", []):
        rows.append([v["scheduler"], v["cell"],
                     num(v.get("throughput_x_best_gmean"), ".3f") + "x",
                     _span(v.get("throughput_x_best", [])),
                     num(v.get("ttft_p90_x_best_gmean"), ".2f") + "x",
                     _span(v.get("ttft_p90_x_best", [])),
                     _span(v.get("sp_p_throughput_x_bp", [])),
                     _span(v.get("sp_p_ttft_p90_x_bp", [])),
                     "wins or ties" if v.get("wins") else "**loses**"])
        runs_ = data.get("runs", [])
        rows[-1][-1:-1] = [
            _span(_vs_strict(runs_, v["scheduler"], v["cell"], "throughput_rps")),
            _span(_vs_strict(runs_, v["scheduler"], v["cell"], "ttft_p90_s"))]
    out.append(table(["scheduler", "cell", "rule throughput / best", "per seed",
                      "rule P90 TTFT / best", "per seed", "sp-p / bp throughput",
                      "sp-p / bp P90 TTFT", "rule / sp-p throughput",
                      "rule / sp-p P90 TTFT", "verdict"], rows))
    lost = [f"{v['scheduler']} {v['cell']}" for v in data.get("verdicts", [])
            if not v.get("wins")]
    out += ["", ("The rule meets the criterion in every cell." if not lost else
                 "The rule does not meet the criterion in: " + ", ".join(lost) + "."), ""]
    out += ["### Diagnosis", "", DIAGNOSIS, "", REAL_VLLM, ""]
    runs = data.get("runs", [])
    out += ["### Every system, where the requests waited (means over seeds)", "",
            "\"At balancers\": time in the balancers' queues; \"held\": the part of it "
            "spent waiting for the replica holding the prefix while another could take the "
            "request (delay scheduling, `hold_s`). The rest of a TTFT is the network, the "
            "engine's own queue and prefill.", ""]
    for v in data.get("verdicts", []):
        out += [f"**{v['scheduler']} / {v['cell']}**", "",
                _runs_table(runs, v["scheduler"], v["cell"]), ""]
    return "\n".join(out).rstrip()
