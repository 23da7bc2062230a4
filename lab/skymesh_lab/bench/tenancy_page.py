"""The results page of ``skymesh_lab.bench.tenancy``: the interactive tenant beside a
batch flood, the share of two tenants one sending 10x the other, and a tenant at 3x its
rate limit through two balancers. Medians over the seeds."""

from __future__ import annotations

import statistics
from typing import Any

from skymesh_lab.bench.results_tables import num, table

ARMS = {"no_flood": "no flood", "fcfs": "flood, first come first served",
        "fair": "flood, fair queue"}


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
    out = []
    for arm, label in ARMS.items():
        rs = arms.get(arm)
        if not rs:
            continue
        out.append([label, str(len(rs)), num(_med(rs, "ttft_p50_s"), ".3f", suffix=" s"),
                    num(_med(rs, "ttft_p99_s"), ".3f", suffix=" s"),
                    f"{_med(rs, 'batch_completed'):.0f} / {_med(rs, 'batch_sent'):.0f}"
                    if _med(rs, "batch_sent") else "-",
                    num(_med(rs, "batch_tokens_per_s"), ",.0f"),
                    num(_med(rs, "batch_longest_wait_s"), ".1f", suffix=" s"),
                    num(_med(rs, "batch_longest_unserved_s"), ".2f", suffix=" s")])
    lines = [table(["arm", "seeds", "interactive TTFT p50", "p99",
                    "batch completed / sent", "batch tokens/s (to its last)",
                    "batch longest wait", "batch longest unserved"], out,
                   [False, True, True, True, True, True, True, True]), ""]
    base, fair = _med(arms.get("no_flood", []), "ttft_p50_s"), _med(arms.get("fair", []),
                                                                      "ttft_p50_s")
    if base and fair:
        within = "within" if fair <= 1.2 * base else "not within"
        lines += [f"With the fair queue the interactive TTFT p50 under the flood is "
                  f"{fair / base:.2f}x the no-flood one: {within} 20%.", ""]
    bound = setup.get("max_wait_s", {}).get("batch")
    if bound is not None:
        lines += [f"The batch class's aging bound (`max_wait_s.batch`) is {bound:.0f} s. "
                  "It bounds how long the class goes unserved while better classes have "
                  "work (the last column), not a request's wait behind its own tenant's "
                  "backlog (the column before).", ""]
    return lines


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
        f"{s.get('steady_rate_per_s', '?')}/s (Poisson) from 0.5 s. Medians over the seeds.",
        "", *_flood(doc["flood"], s),
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
