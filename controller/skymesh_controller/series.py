"""Demand series from balancer telemetry: per (model, region), tokens and requests per window.

This is what the forecasters train on; the same shape can be built offline from a trace
(skymesh_controller.planning.series). A report's counts go to the window holding its timestamp.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

QUANTITIES = ("requests", "prompt_tokens", "output_tokens")


def telemetry_series(samples: Iterable[Mapping[str, Any]], window_s: int,
                     model: str | None = None, region: str | None = None) -> dict[str, Any]:
    """Sum reports into ``window_s`` windows aligned to multiples of ``window_s``.

    Windows with no report inside the observed span are zero: a balancer that reported
    nothing for a while served nothing it could tell us about.
    """
    if window_s <= 0:
        raise ValueError("window must be positive")
    sums: dict[int, list[int]] = {}
    for s in samples:
        if region is not None and s.get("region") != region:
            continue
        slot = math.floor(float(s["ts"]) / window_s)
        acc = sums.setdefault(slot, [0, 0, 0])
        for name, stats in s.get("models", {}).items():
            if model is not None and name != model:
                continue
            for i, q in enumerate(QUANTITIES):
                acc[i] += int(stats.get(q, 0))
    if not sums:
        return {"window_s": window_s, "start": None, **{q: [] for q in QUANTITIES}}
    first, last = min(sums), max(sums)
    rows = [sums.get(k, [0, 0, 0]) for k in range(first, last + 1)]
    return {"window_s": window_s, "start": first * window_s,
            **{q: [r[i] for r in rows] for i, q in enumerate(QUANTITIES)}}


def to_csv(series: Mapping[str, Any]) -> str:
    """``t_seconds,requests,prompt_tokens,output_tokens``: what ``skymesh forecast eval
    --series FILE --column prompt_tokens`` reads."""
    lines = ["t_seconds," + ",".join(QUANTITIES)]
    start, w = series["start"], series["window_s"]
    for i in range(len(series["requests"])):
        lines.append(",".join([str(start + i * w), *(str(series[q][i]) for q in QUANTITIES)]))
    return "\n".join(lines) + "\n"
