"""The results page of ``skymesh_lab.bench.tenancy_shares``: a tenant at 3x its global
limit through three balancers in two regions, each holding the share the controller
pushed. Medians over the seeds."""

from __future__ import annotations

import statistics
from typing import Any

from skymesh_lab.bench.results_tables import num, table

SPREAD_NAMES = {"even": "even", "uneven": "uneven", "skewed": "skewed",
                "dies": "uneven; us-b dies halfway"}


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(xs) if xs else None


def tenancy_shares(doc: dict[str, Any]) -> str:
    s = doc.get("setup", {})
    by: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        by.setdefault(r["spread"], []).append(r)
    rows = []
    for spread, rs in by.items():
        weights = s.get("spreads", {}).get(spread, [])
        rows.append([SPREAD_NAMES.get(spread, spread), str(len(rs)),
                     " / ".join(f"{w:.0%}" for w in weights),
                     num(_med(rs, "offered_per_s"), ".1f", suffix="/s"),
                     num(_med(rs, "admitted_per_s"), ".2f", suffix="/s"),
                     num(_med(rs, "admitted_over_limit"), ".1%"),
                     num(_med(rs, "ideal_over_limit"), ".1%"),
                     num(_med(rs, "before_death_over_limit"), ".1%"),
                     num(_med(rs, "after_death_over_limit"), ".1%")])
    names = ", ".join(f"{b} ({r})" for b, r in s.get("balancers", []))
    return "\n".join([
        f"Balancers {names}; a global limit of {s.get('limit_per_s', '?')} requests/s, "
        f"offered {s.get('offered_x', '?')}x for {s.get('run_s', '?')} s; each live "
        f"balancer holds 1/n of it, refreshed {s.get('push_s', '?')} s after a death. "
        "Ideal: what equal shares can admit, each balancer the lesser of its share and "
        "what reaches it. Medians over the seeds.", "",
        table(["traffic", "seeds", "split us-a / us-b / eu-a", "offered", "admitted",
               "admitted / limit", "ideal / limit", "before death", "after death"], rows,
              [False, True, False, True, True, True, True, True, True]), ""])
