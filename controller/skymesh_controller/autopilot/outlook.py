"""``GET /v1/outlook``: per region, the planner's forecast of its load for the next windows,
relative to the capacity running there now (issue #25 item 4).

Balancers read it on their telemetry cadence (``skymesh.balancer.controller_link``) and
prefer, when they overflow, peer regions whose load is forecast to fall
(``skymesh.mesh.outlook``). The figures come from the newest recorded round that has a
forecast, so a restarted controller publishes the same outlook as before.

Capacity of a (model, region) is the sum over GPU types of the instances the round saw
running (``inputs.current``) times ``planner.capacity[model][gpu]`` tokens/s. It is the
capacity *now*, not the plan's: a region about to peak shows a load above 1 until the
plan's instances arrive, which is what a balancer choosing where to send work should
see. Pairs with no capacity are left out (nothing to forward to there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Obj = dict[str, Any]


def capacities(current: Iterable[Mapping[str, Any]],
               per_instance: Mapping[str, Mapping[str, float]]) -> dict[tuple[str, str], float]:
    """Tokens/s per (model, region) from the running counts and the per-instance figures."""
    out: dict[tuple[str, str], float] = {}
    for row in current:
        tps = per_instance.get(row["model"], {}).get(row["gpu"])
        if tps and row["count"] > 0:
            key = (row["model"], row["region"])
            out[key] = out.get(key, 0.0) + row["count"] * tps
    return out


def outlook(records: Iterable[Obj], per_instance: Mapping[str, Mapping[str, float]]) -> Obj:
    """The outlook from the newest round (``records`` newest first) with a forecast."""
    rec = next((r for r in records if r.get("forecast")), None)
    if rec is None:
        return {"plan": None, "ts": None, "window_s": None, "regions": []}
    window_s = rec["inputs"]["window_s"]
    cap = capacities(rec["inputs"]["current"], per_instance)
    regions = []
    for f in rec["forecast"]:
        c = cap.get((f["model"], f["region"]), 0.0)
        if c <= 0:
            continue
        tps = [max(0.0, float(v)) for v in f["tokens_per_s"]]
        regions.append({"region": f["region"], "model": f["model"], "start": f["start"],
                        "window_s": window_s, "capacity_tokens_per_s": c,
                        "forecast_tokens_per_s": tps,
                        "load": [round(v / c, 4) for v in tps]})
    return {"plan": rec["id"], "ts": rec["ts"], "window_s": window_s, "regions": regions}
