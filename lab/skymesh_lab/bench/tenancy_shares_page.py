"""The results page of ``skymesh_lab.bench.tenancy_shares``: a tenant at 3x its global
limit through three balancers in two regions, each holding the part the controller pushed:
an equal ``1/n``, or a fraction weighted by the demand each balancer reports. Medians
over the seeds."""

from __future__ import annotations

import statistics
from typing import Any

from skymesh_lab.bench.results_tables import num, table

SPREAD_NAMES = {"even": "even (round-robin)", "uneven": "uneven", "90/10": "90/10",
                "skewed": "skewed", "one": "all to one balancer",
                "shift": "even, then all to us-a halfway",
                "dies": "uneven; us-b dies halfway"}


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(xs) if xs else None


def _worst(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return max(xs) if xs else None


def _unconverged(rows: list[dict[str, Any]], key: str) -> str:
    """Reports to converge: the worst seed, or how many seeds never did."""
    never = sum(1 for r in rows if r.get(key) is None)
    worst = _worst(rows, key)
    if never:
        return f"never ({never} of {len(rows)} seeds)"
    return "-" if worst is None else f"{worst:.0f}"


def tenancy_shares(doc: dict[str, Any]) -> str:
    s = doc.get("setup", {})
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        by.setdefault((r["spread"], r.get("split", "equal")), []).append(r)
    rows = []
    for (spread, split), rs in by.items():
        weights = s.get("spreads", {}).get(spread, [])
        halfway = spread in ("dies", "shift")
        rows.append([SPREAD_NAMES.get(spread, spread), split, str(len(rs)),
                     " / ".join(f"{w:.0%}" for w in weights),
                     num(_med(rs, "offered_per_s"), ".1f", suffix="/s"),
                     num(_med(rs, "admitted_over_limit"), ".1%"),
                     _unconverged(rs, "reports_to_converge_after" if halfway
                                  else "reports_to_converge"),
                     num(_med(rs, "converged_over_limit"), ".1%"),
                     num(_worst(rs, "worst_window_after"), ".1%"),
                     num(_med(rs, "before_over_limit"), ".1%"),
                     num(_med(rs, "after_over_limit"), ".1%")])
    names = ", ".join(f"{b} ({r})" for b, r in s.get("balancers", []))
    tol = s.get("tolerance", 0.1)
    setup = " ".join([
        f"Balancers {names}; a global limit of {s.get('limit_per_s', '?')} requests/s,",
        f"offered {s.get('offered_x', '?')}x for {s.get('run_s', '?')} s.",
        "**equal**: each live balancer holds 1/n of the limit (a death is pushed",
        f"{s.get('push_s', '?')} s later).",
        f"**weighted**: every {s.get('report_s', '?')} s (the telemetry interval) each",
        "balancer reports the demand its limiter counted, smoothed, and holds the fraction",
        "the controller answers, in proportion to the demand, none under",
        f"{s.get('floor', '?')} / n.",
        "Per window of one report: admitted / limit.",
        "*Reports to converge*: from the start (from halfway in the last two rows) until",
        f"every later window is within {tol:.0%} of the limit, the worst seed;",
        "*converged*: admitted / limit over those windows, median; *worst window*: the",
        "farthest of them from the limit, worst seed. Medians over the seeds otherwise."])
    headers = ["traffic", "split", "seeds", "traffic us-a / us-b / eu-a", "offered",
               "admitted / limit", "reports to converge", "converged", "worst window",
               "first half", "second half"]
    return "\n".join([setup, "", table(headers, rows, [False, False, True, False,
                                                       *[True] * 7]), ""])
