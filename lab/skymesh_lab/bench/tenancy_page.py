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
        "fair_reserve_pace2": "the same, `reserve_pace` 2",
        "fair_reserve_nopace": "the same, no pacing"}


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(xs) if xs else None


def _by(rows: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def _flood(rows: list[dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    arms = _by(rows, "arm")
    fcfs_tps = _med(arms.get("fcfs", []), "batch_tokens_per_s")
    out = []
    for arm, label in ARMS.items():
        rs = arms.get(arm)
        if not rs:
            continue
        tps = _med(rs, "batch_tokens_per_s")
        out.append([label, str(len(rs)), num(_med(rs, "ttft_p50_s"), ".3f", suffix=" s"),
                    num(_med(rs, "ttft_p99_s"), ".3f", suffix=" s"),
                    f"{_med(rs, 'batch_completed'):.0f} / {_med(rs, 'batch_sent'):.0f}"
                    if _med(rs, "batch_sent") else "-",
                    num(tps, ",.0f"),
                    num(tps / fcfs_tps if tps is not None and fcfs_tps else None, ".1%"),
                    num(_med(rs, "batch_longest_wait_s"), ".1f", suffix=" s"),
                    num(_med(rs, "batch_longest_unserved_s"), ".2f", suffix=" s")])
    lines = [table(["arm", "seeds", "interactive TTFT p50", "p99",
                    "batch completed / sent", "batch tokens/s (to its last)",
                    "batch tokens/s vs FCFS", "batch longest wait",
                    "batch longest unserved"], out,
                   [False, True, True, True, True, True, True, True, True]), ""]
    base = arms.get("no_flood", [])
    for arm in ("fair", "fair_reserve"):  # the default settings
        rs = arms.get(arm, [])
        for key, name in (("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")):
            b, got = _med(base, key), _med(rs, key)
            if b and got:
                within = "within" if got <= 1.2 * b else "not within"
                lines.append(f"- {ARMS[arm]}: the interactive TTFT {name} under the flood "
                             f"is {got / b:.2f}x the no-flood one: {within} 20%.")
    bound = setup.get("max_wait_s", {}).get("batch")
    unserved = [x for a in ("fair", "fair_reserve")
                if (x := _med(arms.get(a, []), "batch_longest_unserved_s")) is not None]
    if bound is not None and unserved:
        verdict = "within" if max(unserved) <= bound else "beyond"
        lines.append(f"- The batch class went unserved for at most {max(unserved):.1f} s, "
                     f"{verdict} its aging bound (`max_wait_s.batch`, {bound:.0f} s).")
    return [*lines, ""]


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
        f"figures from one run on a machine of {setup.get('live_cpus', '?')} cores shared "
        "with other work: the TTFT includes the loopback and the balancer's own time, and "
        "varies by some tens of milliseconds between runs. Longest unserved: the longest "
        "gap between two batch completions as the client sees them (the batch requests "
        "are not streamed).", "",
        *_flood(rows, setup)]


def _lull(rows: list[dict[str, Any]], setup: dict[str, Any]) -> list[str]:
    by = _by(rows, "idle_s")
    alone = _med(by.get(None, []), "batch_tokens_per_s")
    out = []
    for idle, rs in sorted(by.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        tps = _med(rs, "batch_tokens_per_s")
        out.append(["fair queue alone" if idle is None else f"reserve, idle {idle:.0f} s",
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
        f"(`tenants.reserve` {s.get('reserve', {})}, `reserve_idle_s` "
        f"{s.get('reserve_idle_s', '?')} s, `reserve_pace` {s.get('reserve_pace', '?')}). "
        "Medians over the seeds; batch tokens/s vs FCFS is the batch tenant's throughput "
        "against first come first served's, its "
        "share of the capacity the interactive tenant leaves. The last two arms keep the "
        "reserve and loosen its pacing (the trade-off of `reserve_pace`).",
        "", "### Simulator", "", *_flood(doc["flood"], s),
        *(_live(doc["live"], s) if doc.get("live") else []),
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
