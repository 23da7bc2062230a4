"""``skymesh forecast eval``: score the forecasters on a real demand series.

    skymesh forecast eval --series FILE [--column NAME] [--time-column NAME]
        [--window 10m|1h] [--train-frac 0.5] [--horizon 1] [--forecasters a,b]
        [--param mlstm.hidden=64] --json PATH

Bad input (a missing file, an unknown column or forecaster, a bad window) prints one line
and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas and statsmodels load only when a forecast command runs
    from skymesh_controller.planning.series import Series

EXIT_BAD_INPUT = 2


def _params(pairs: list[str] | None) -> dict[str, dict[str, Any]]:
    """``["mlstm.hidden=64"]`` -> ``{"mlstm": {"hidden": 64}}`` (values JSON when they parse)."""
    out: dict[str, dict[str, Any]] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        name, dot, param = key.partition(".")
        if not sep or not dot or not name or not param:
            raise ValueError(f"--param: expected FORECASTER.KEY=VALUE, got {pair!r}")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, list):
            value = tuple(value)
        out.setdefault(name, {})[param] = value
    return out


def _describe(s: Series) -> str:
    return (f"{s.source} | column {s.column} ({s.agg} per window) | time {s.time_column} | "
            f"window {s.window} | {len(s)} windows" + (f" | {s.n_filled} gaps filled"
                                                       if s.n_filled else ""))


def cmd_eval(args: argparse.Namespace) -> int:
    from skymesh.util.jsonio import write_json
    from skymesh_controller.planning.forecast import forecaster_params
    from skymesh_controller.planning.forecast_eval import (
        evaluate,
        format_table,
        parse_forecasters,
        split_point,
    )

    try:
        names = parse_forecasters(args.forecasters)
        params = _params(args.param)
        for name, p in params.items():
            if name not in names:
                raise ValueError(f"--param for {name!r}, which is not being evaluated")
            unknown = sorted(set(p) - set(forecaster_params(name)))
            if unknown:
                raise ValueError(f"--param: {name} has no parameter {', '.join(unknown)} "
                                 f"(it takes {', '.join(forecaster_params(name))})")
        if args.seed is not None and "mlstm" in names:
            params.setdefault("mlstm", {}).setdefault("seed", args.seed)
        from skymesh_controller.planning.series import load_series

        series = load_series(args.series, column=args.column, time_column=args.time_column,
                             window=args.window, agg=args.agg)
        period = args.period or series.daily_period()
        if args.horizon < 1:
            raise ValueError(f"--horizon must be at least 1, got {args.horizon}")
        if args.retrain_every is not None and args.retrain_every < 0:
            raise ValueError("--retrain-every must be >= 0 (0: never refit)")
        n_train = split_point(len(series), args.train_frac)
        print(_describe(series))
        print(f"period {period} windows | train {n_train} | test {len(series) - n_train} | "
              + ("static: one forecast of the whole test part" if args.static
                 else f"walk-forward, horizon {args.horizon}"), flush=True)
        # Index of the first window counted from the Unix epoch, so time-of-day features line
        # up with the wall clock.
        origin = int(series.start // series.window_s)
        results = evaluate(series.values, period, names, train_frac=args.train_frac,
                           horizon=args.horizon, retrain_every=args.retrain_every,
                           params=params, origin=origin,
                           progress=not args.no_progress, static=args.static)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"skymesh forecast eval: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_table(results))
    write_json(args.json, {
        "forecasters": results,
        "series": series.source, "column": series.column, "time_column": series.time_column,
        "agg": series.agg, "window": series.window, "window_s": series.window_s,
        "period": period, "protocol": "static" if args.static else "walk-forward",
        "horizon": None if args.static else args.horizon, "train_frac": args.train_frac,
        "n_train": n_train,
        "n_test": len(series) - n_train - (0 if args.static else args.horizon - 1),
        "gaps_filled": series.n_filled,
    })
    return 0


def register(subparsers: Any) -> None:
    fp = subparsers.add_parser("forecast", help="demand forecasting (planning)")
    fp.set_defaults(extra="planning")
    fsub = fp.add_subparsers(dest="forecast_cmd", required=True)
    ep = fsub.add_parser("eval", help="walk-forward APE of the forecasters on a series")
    ep.add_argument("--series", required=True, metavar="FILE", help="CSV of a demand series "
                    "(or an Azure-2023-style request trace)")
    ep.add_argument("--column", default=None, metavar="NAME",
                    help="value column (default: the first numeric non-time, non-index one)")
    ep.add_argument("--time-column", default=None, metavar="NAME",
                    help="seconds or timestamps (default: guessed from the header)")
    ep.add_argument("--window", default=None, metavar="<int>[smh]",
                    help="resample to this window, e.g. 10m or 1h (default: the file's)")
    ep.add_argument("--agg", choices=["sum", "mean"], default=None,
                    help="how to resample: sum counts, mean rates (default: by column name)")
    ep.add_argument("--train-frac", type=float, default=0.5)
    ep.add_argument("--horizon", type=int, default=1,
                    help="score the prediction this many windows ahead (PreServe: 2)")
    ep.add_argument("--static", action="store_true",
                    help="forecast the whole test part at once from the training part "
                         "(no walk-forward updates)")
    ep.add_argument("--forecasters", default=None, metavar="a,b",
                    help="subset of seasonal-naive,ets,arima,mlstm (default: all)")
    ep.add_argument("--period", type=int, default=None,
                    help="seasonal period in windows (default: one day)")
    ep.add_argument("--retrain-every", type=int, default=None, metavar="WINDOWS",
                    help="refit every N windows, 0 never (default: daily; seasonal naive never)")
    ep.add_argument("--param", action="append", metavar="FORECASTER.KEY=VALUE",
                    help="forecaster parameter (repeatable), e.g. mlstm.hidden=64")
    ep.add_argument("--seed", type=int, default=None, help="mlstm seed (default 0)")
    ep.add_argument("--no-progress", action="store_true")
    ep.add_argument("--json", default=None, metavar="PATH")
    ep.set_defaults(fn=cmd_eval)
