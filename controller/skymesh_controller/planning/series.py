"""Demand series for forecasting: one value per fixed window, read from a CSV or a trace.

Two sources:

- a CSV of an already-windowed series (``load_series``): one value column, one time column
  (seconds, or timestamp strings), resampled to a coarser window when asked. Defaults fit
  the shared data sets: the time column is the first one named like a time (``t_seconds``,
  ``timestamp``, ``window_start_utc``...), else ``day`` + ``hour`` columns, else none (rows
  are consecutive windows); the value column is the first numeric column that is neither
  the time nor an index (``window_index``, ``day``, ``hour``). A CSV without a header row
  (ServeGen's per-client ``trace.csv``) gets columns ``c0, c1, ...`` with ``c0`` as time.
- a request trace (``trace_windows``): ``(timestamp, prompt_tokens, output_tokens)`` per
  request, binned into prompt tokens, output tokens and requests per window. A CSV shaped
  like the Azure 2023 trace (``TIMESTAMP,ContextTokens,GeneratedTokens``) goes through it,
  with ``--column prompt_tokens|output_tokens|requests`` (default ``prompt_tokens``).

Resampling sums counts and averages rates (a column whose name says ``rate``/``rps``);
``agg`` overrides that guess. Only whole windows are kept, so a partial first or last
window never looks like a dip. Interior gaps (missing rows or empty cells) are filled by
linear interpolation and counted in ``Series.n_filled``: a forecaster cannot take NaN, and
a gap in collection is not zero demand.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd

Agg = Literal["sum", "mean"]

SECONDS_PER_DAY = 86_400
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": SECONDS_PER_DAY}
_WINDOW_RE = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")
_TIME_NAMES = {"t", "ts", "time", "timestamp", "t_seconds", "datetime", "date_time", "seconds"}
_INDEX_NAMES = {"index", "day", "hour", "minute", "id", "window", "date", "time_of_day"}
_TRACE_COLUMNS = {"timestamp": "TIMESTAMP", "prompt": "ContextTokens",
                  "output": "GeneratedTokens"}
TRACE_QUANTITIES = ("prompt_tokens", "output_tokens", "requests")


def parse_window(text: str) -> int:
    """``"10m"`` -> 600. Accepts ``<int>[smhd]``; anything else is a ValueError naming it."""
    m = _WINDOW_RE.match(text)
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"bad window {text!r}: expected a positive <int>[s|m|h|d], "
                         "e.g. 10m or 1h")
    return int(m.group(1)) * _UNIT_SECONDS[m.group(2)]


def format_window(seconds: int) -> str:
    for unit, size in (("d", SECONDS_PER_DAY), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


@dataclass(frozen=True)
class Series:
    """A regular series: ``values[i]`` covers ``[start + i*window_s, start + (i+1)*window_s)``."""

    values: np.ndarray
    window_s: int
    start: float
    column: str
    source: str
    time_column: str | None
    agg: Agg
    n_filled: int = 0

    def __len__(self) -> int:
        return len(self.values)

    @property
    def window(self) -> str:
        return format_window(self.window_s)

    def daily_period(self) -> int:
        """Windows per day: the seasonal period the forecasters use by default."""
        if SECONDS_PER_DAY % self.window_s:
            raise ValueError(f"window {self.window} does not divide a day; give a period")
        return SECONDS_PER_DAY // self.window_s


@dataclass(frozen=True)
class TraceWindows:
    """Per-window sums of a request trace, all arrays of the same length."""

    start: float
    window_s: int
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    requests: np.ndarray

    def quantity(self, name: str) -> np.ndarray:
        if name not in TRACE_QUANTITIES:
            raise ValueError(f"unknown trace quantity {name!r}; "
                             f"one of {', '.join(TRACE_QUANTITIES)}")
        arr: np.ndarray = getattr(self, name)
        return arr


def trace_windows(trace: Iterable[tuple[float, float, float]], window_s: int,
                  start: float | None = None, end: float | None = None) -> TraceWindows:
    """Bin requests ``(timestamp_s, prompt_tokens, output_tokens)`` into whole windows.

    ``start`` defaults to the first arrival and ``end`` to the last; a trailing partial
    window is dropped when ``end`` is not given, because it would read as a drop in demand.
    """
    if window_s <= 0:
        raise ValueError("window must be positive")
    arr = np.asarray(list(trace), dtype=float).reshape(-1, 3)
    if len(arr) == 0:
        raise ValueError("empty trace")
    ts = arr[:, 0]
    t0 = float(ts.min()) if start is None else float(start)
    if end is None:
        n = int((ts.max() - t0) // window_s)
        if n == 0:
            raise ValueError(f"trace spans less than one {format_window(window_s)} window")
    else:
        n = int(np.ceil((end - t0) / window_s))
    idx = np.floor((ts - t0) / window_s).astype(int)
    keep = (idx >= 0) & (idx < n)
    idx = idx[keep]
    return TraceWindows(
        start=t0, window_s=window_s,
        prompt_tokens=np.bincount(idx, weights=arr[keep, 1], minlength=n).astype(float),
        output_tokens=np.bincount(idx, weights=arr[keep, 2], minlength=n).astype(float),
        requests=np.bincount(idx, minlength=n).astype(float),
    )


def _read_csv(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise FileNotFoundError(f"series file {path} does not exist")
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a readable CSV: {exc}") from None
    if df.empty:
        raise ValueError(f"{path} has no data rows")
    if _looks_numeric(df.columns[:1]):
        # No header row (a real header does not open with a number): the first line was data.
        df = pd.read_csv(path, header=None)
        df.columns = [f"c{i}" for i in range(df.shape[1])]
    return df


def _looks_numeric(names: Iterable[object]) -> bool:
    try:
        for n in names:
            float(str(n))
    except ValueError:
        return False
    return True


def _default_time_column(df: pd.DataFrame) -> str | None:
    for c in df.columns:
        low = str(c).lower()
        if (low in _TIME_NAMES or low.startswith("window_start") or low.endswith("_utc")
                or low.endswith("timestamp")):
            return str(c)
    if list(df.columns[:1]) == ["c0"]:
        return "c0"
    return None


def _default_value_column(df: pd.DataFrame, exclude: set[str]) -> str:
    for c in df.columns:
        name = str(c)
        low = name.lower()
        if name in exclude or low in _INDEX_NAMES or low.endswith("index"):
            continue
        if pd.api.types.is_numeric_dtype(df[c]):
            return name
    raise ValueError("no numeric value column found; name one with --column "
                     f"(columns: {', '.join(map(str, df.columns))})")


def _times_seconds(col: pd.Series, name: str) -> np.ndarray:
    if pd.api.types.is_numeric_dtype(col):
        return col.to_numpy(dtype=float)
    try:
        ts = pd.to_datetime(col, utc=True, format="mixed")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"time column {name!r} is neither seconds nor timestamps: {exc}") \
            from None
    return (ts - pd.Timestamp(0, tz="UTC")).dt.total_seconds().to_numpy(dtype=float)


def _guess_agg(column: str) -> Agg:
    low = column.lower()
    return "mean" if ("rate" in low or "rps" in low or "per_s" in low) else "sum"


def load_series(path: str | Path, column: str | None = None, time_column: str | None = None,
                window: str | int | None = None, agg: Agg | None = None) -> Series:
    """Read one series from a CSV and return it at ``window`` (default: the file's own)."""
    path = Path(path)
    window_s = parse_window(window) if isinstance(window, str) else window
    df = _read_csv(path)
    if {_TRACE_COLUMNS["timestamp"], _TRACE_COLUMNS["prompt"]} <= set(map(str, df.columns)):
        return _load_trace_csv(df, path, column, window_s)
    for flag, name in (("--column", column), ("--time-column", time_column)):
        if name is not None and name not in df.columns:
            raise ValueError(f"{flag} {name!r} is not a column of {path.name} "
                             f"(columns: {', '.join(map(str, df.columns))})")

    tcol = time_column if time_column is not None else _default_time_column(df)
    if tcol is not None:
        times = _times_seconds(df[tcol], tcol)
        used = {tcol}
    elif {"day", "hour"} <= set(df.columns):
        times = df["day"].to_numpy(float) * SECONDS_PER_DAY + df["hour"].to_numpy(float) * 3600
        tcol, used = "day+hour", {"day", "hour"}
    else:
        times, used = None, set()
    vcol = column if column is not None else _default_value_column(df, used)
    if not pd.api.types.is_numeric_dtype(df[vcol]):
        raise ValueError(f"column {vcol!r} of {path.name} is not numeric")
    values = df[vcol].to_numpy(dtype=float)
    agg = agg or _guess_agg(vcol)

    if times is None:
        if window_s is None:
            raise ValueError(f"{path.name} has no time column: give --time-column, or "
                             "--window for the spacing of its rows")
        times = np.arange(len(values), dtype=float) * window_s
    return _regularise(times, values, window_s, agg, vcol, tcol, path)


def _regularise(times: np.ndarray, values: np.ndarray, window_s: int | None, agg: Agg,
                column: str, tcol: str | None, path: Path) -> Series:
    ok = np.isfinite(times)
    times, values = times[ok], values[ok]
    order = np.argsort(times, kind="stable")
    times, values = times[order], values[order]
    if len(times) < 2:
        raise ValueError(f"{path.name}: fewer than two rows with a time")
    if np.any(np.diff(times) == 0):
        raise ValueError(f"{path.name}: repeated times in {tcol!r}; is it the right column?")
    step = float(np.median(np.diff(times)))
    if step <= 0 or step != round(step):
        raise ValueError(f"{path.name}: rows are {step} s apart; expected whole seconds")
    native = int(step)
    target = native if window_s is None else window_s
    if target % native:
        raise ValueError(f"window {format_window(target)} is not a multiple of the data's "
                         f"spacing ({format_window(native)})")

    # Place rows on the native grid; rows off the grid or missing become NaN, then filled.
    slot = np.round((times - times[0]) / native).astype(int)
    grid = np.full(int(slot[-1]) + 1, np.nan)
    grid[slot] = values
    finite = np.flatnonzero(np.isfinite(grid))
    if len(finite) == 0:
        raise ValueError(f"{path.name}: column {column!r} has no values")
    grid = grid[finite[0]:finite[-1] + 1]
    t0 = times[0] + finite[0] * native
    holes = ~np.isfinite(grid)
    n_filled = int(holes.sum())
    if n_filled:
        idx = np.arange(len(grid))
        grid[holes] = np.interp(idx[holes], idx[~holes], grid[~holes])

    factor = target // native
    n = len(grid) // factor
    if n < 1:
        raise ValueError(f"{path.name}: shorter than one {format_window(target)} window")
    blocks = grid[: n * factor].reshape(n, factor)
    out = blocks.sum(axis=1) if agg == "sum" else blocks.mean(axis=1)
    return Series(values=out, window_s=target, start=float(t0), column=column,
                  source=str(path), time_column=tcol, agg=agg, n_filled=n_filled)


def _load_trace_csv(df: pd.DataFrame, path: Path, column: str | None,
                    window_s: int | None) -> Series:
    quantity = column or "prompt_tokens"
    if quantity not in TRACE_QUANTITIES:
        raise ValueError(f"{path.name} is a request trace; --column must be one of "
                         f"{', '.join(TRACE_QUANTITIES)} (got {quantity!r})")
    if window_s is None:
        raise ValueError(f"{path.name} is a request trace: give --window to bin it")
    ts = _times_seconds(df[_TRACE_COLUMNS["timestamp"]], _TRACE_COLUMNS["timestamp"])
    out = df[_TRACE_COLUMNS["output"]].to_numpy(float) if _TRACE_COLUMNS["output"] in df \
        else np.zeros(len(df))
    tw = trace_windows(zip(ts, df[_TRACE_COLUMNS["prompt"]].to_numpy(float), out,
                           strict=True), window_s)
    return Series(values=tw.quantity(quantity), window_s=window_s, start=tw.start,
                  column=quantity, source=str(path), time_column=_TRACE_COLUMNS["timestamp"],
                  agg="sum")
