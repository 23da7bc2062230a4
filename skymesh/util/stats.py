"""Percentiles and summaries of samples: the one place every report computes them.

Method: numpy's default (``method="linear"``, Hyndman & Fan type 7). No data gives
``None``, never 0.0 or NaN: a report must not print a zero latency for a run in which
nothing completed, and JSON has no NaN. Non-finite samples are refused for the same reason
(an ``inf`` latency would turn neighbouring percentiles into NaN).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

DEFAULT_QS: tuple[float, ...] = (50, 90, 99)


def _samples(values: Iterable[float] | Any) -> np.ndarray:
    a = np.asarray(values if hasattr(values, "__len__") else list(values), dtype=float)
    if not np.isfinite(a).all():
        raise ValueError("percentile of non-finite samples (inf or NaN)")
    return a.ravel()


def _check_q(q: float) -> float:
    q = float(q)
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    return q


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``th percentile (``q`` in [0, 100]) of ``values``; ``None`` when empty."""
    q = _check_q(q)
    a = _samples(values)
    return float(np.percentile(a, q)) if a.size else None


def percentiles(values: Iterable[float], qs: Sequence[float]) -> list[float | None]:
    """``percentile(values, q)`` for each ``q`` of ``qs``, sorting once."""
    checked = [_check_q(q) for q in qs]
    a = _samples(values)
    if not a.size:
        return [None] * len(checked)
    return [float(v) for v in np.percentile(a, checked)] if checked else []


def summary(values: Iterable[float], qs: Sequence[float] = DEFAULT_QS, *, prefix: str = "",
            suffix: str = "") -> dict[str, float | None]:
    """``{prefix}mean{suffix}`` and ``{prefix}p{q}{suffix}`` for each ``q`` of ``qs``
    (e.g. ``summary(ttft, prefix="ttft_", suffix="_s")`` gives ``ttft_p90_s``); every value
    ``None`` when ``values`` is empty."""
    a = _samples(values)
    out: dict[str, float | None] = {
        f"{prefix}mean{suffix}": math.fsum(a.tolist()) / a.size if a.size else None}
    for q, v in zip(qs, percentiles(a, qs), strict=True):
        out[f"{prefix}p{q:g}{suffix}"] = v
    return out


def ratio(num: float | None, den: float | None, floor: float = 1e-9) -> float | None:
    """``num / max(den, floor)`` (the floor keeps a zero latency from dividing by zero);
    ``None`` when either side has no data."""
    if num is None or den is None:
        return None
    return num / max(den, floor)


_WIDTH = re.compile(r"(?:.?[<>=^])?[+\- ]?z?#?0?(\d*)")


def fmt(x: float | None, spec: str = "", scale: float = 1.0, na: str = "n/a") -> str:
    """``x * scale`` formatted with ``spec``; for ``None`` (no data), ``na`` right-aligned to
    the spec's width so that table columns stay aligned."""
    if x is None:
        width = _WIDTH.match(spec)  # every part is optional: it always matches
        return f"{na:>{int(width.group(1) or 0) if width else 0}}"
    return format(x if scale == 1.0 else x * scale, spec)  # ints stay ints for "d"
