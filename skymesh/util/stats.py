"""Percentiles and summaries of samples: the one place every report computes them.

Method: linear interpolation between closest ranks, numpy's default (``method="linear"``,
Hyndman & Fan type 7): for ``n`` sorted values and ``q`` in [0, 100] the rank is
``h = (n - 1) * q / 100`` and the result ``s[floor(h)]`` moved towards the next value by
the fractional part of ``h``. It is computed here with the standard library, in numpy's
arithmetic order, so the product needs no numpy for it and results match
``numpy.percentile`` (a property test pins that).

No data gives ``None``, never 0.0 or NaN: a report must not print a zero latency for a run
in which nothing completed, and JSON has no NaN. Non-finite samples are refused for the
same reason (an ``inf`` latency would turn neighbouring percentiles into NaN).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

DEFAULT_QS: tuple[float, ...] = (50, 90, 99)


def _sorted_samples(values: Iterable[float] | Any) -> list[float]:
    # numpy arrays (and anything else with ``tolist``) give Python floats in one C call.
    items = values.tolist() if hasattr(values, "tolist") else values
    out = sorted(float(v) for v in items)
    if not all(map(math.isfinite, out)):  # NaN sorts anywhere: check every sample
        raise ValueError("percentile of non-finite samples (inf or NaN)")
    return out


def _check_q(q: float) -> float:
    q = float(q)
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    return q


def _at(s: list[float], q: float) -> float:
    """The ``q``th percentile of the sorted, non-empty ``s``, as numpy computes it."""
    h = (len(s) - 1) * (q / 100.0)
    lo = math.floor(h)
    hi = min(lo + 1, len(s) - 1)
    a, b, t = s[lo], s[hi], h - lo
    diff = b - a
    # numpy's _lerp: from the nearer end, so the result stays inside [a, b] when rounding.
    return b - diff * (1.0 - t) if t >= 0.5 else a + diff * t


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``th percentile (``q`` in [0, 100]) of ``values``; ``None`` when empty."""
    q = _check_q(q)
    s = _sorted_samples(values)
    return _at(s, q) if s else None


def percentiles(values: Iterable[float], qs: Sequence[float]) -> list[float | None]:
    """``percentile(values, q)`` for each ``q`` of ``qs``, sorting once."""
    checked = [_check_q(q) for q in qs]
    s = _sorted_samples(values)
    return [_at(s, q) if s else None for q in checked]


def summary(values: Iterable[float], qs: Sequence[float] = DEFAULT_QS, *, prefix: str = "",
            suffix: str = "") -> dict[str, float | None]:
    """``{prefix}mean{suffix}`` and ``{prefix}p{q}{suffix}`` for each ``q`` of ``qs``
    (e.g. ``summary(ttft, prefix="ttft_", suffix="_s")`` gives ``ttft_p90_s``); every value
    ``None`` when ``values`` is empty."""
    checked = [_check_q(q) for q in qs]
    s = _sorted_samples(values)
    out: dict[str, float | None] = {f"{prefix}mean{suffix}": math.fsum(s) / len(s) if s
                                    else None}
    for q in checked:
        out[f"{prefix}p{q:g}{suffix}"] = _at(s, q) if s else None
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
