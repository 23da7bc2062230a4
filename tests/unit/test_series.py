"""Demand series: window parsing, CSV loading and resampling, request-trace binning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from skymesh_controller.planning.series import load_series, parse_window, trace_windows
from skymesh_lab.sim.workloads.data import data_file


@pytest.mark.parametrize(("text", "seconds"), [("10m", 600), ("1h", 3600), ("30s", 30),
                                                ("1d", 86_400), (" 2h ", 7200)])
def test_parse_window(text: str, seconds: int) -> None:
    assert parse_window(text) == seconds


@pytest.mark.parametrize("text", ["10x", "0m", "abc", "-5m", "1.5h", ""])
def test_parse_window_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="bad window"):
        parse_window(text)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_timestamps_resampled_to_whole_hours_by_sum(tmp_path: Path) -> None:
    rows = ["when_utc,window_index,requests"]
    # 2h 10m of 10-minute counts: the trailing partial hour must be dropped.
    for i in range(13):
        rows.append(f"2024-05-10T{i // 6:02d}:{(i % 6) * 10:02d}:00Z,{i},{i + 1}")
    s = load_series(_write(tmp_path / "s.csv", "\n".join(rows) + "\n"), window="1h")
    assert s.column == "requests" and s.time_column == "when_utc" and s.agg == "sum"
    assert s.window_s == 3600 and s.window == "1h"
    assert s.values.tolist() == [sum(range(1, 7)), sum(range(7, 13))]
    assert s.start == pytest.approx(1715299200.0)  # 2024-05-10T00:00Z


def test_rates_are_averaged_and_gaps_interpolated(tmp_path: Path) -> None:
    text = "t_seconds,total_rate_rps\n0,10\n600,20\n1800,40\n2400,50\n3000,60\n3600,70\n"
    s = load_series(_write(tmp_path / "r.csv", text), window="1h")
    assert s.agg == "mean" and s.n_filled == 1
    # The missing row at 1200 s is filled with 30 (between 20 and 40).
    assert s.values.tolist() == pytest.approx([35.0])


def test_day_hour_columns_and_headerless_files(tmp_path: Path) -> None:
    s = load_series(_write(tmp_path / "dh.csv", "day,hour,count\n0,22,5\n0,23,6\n1,0,7\n"))
    assert s.time_column == "day+hour" and s.column == "count" and s.window_s == 3600
    assert s.values.tolist() == [5, 6, 7]
    h = load_series(_write(tmp_path / "nh.csv", "0,1.5,x\n600,2.5,y\n1200,3.5,z\n"))
    assert (h.time_column, h.column, h.window_s) == ("c0", "c1", 600)


def test_bad_input_names_the_problem(tmp_path: Path) -> None:
    f = _write(tmp_path / "s.csv", "t_seconds,a\n0,1\n600,2\n1200,3\n")
    with pytest.raises(ValueError, match=r"'nope' is not a column.*t_seconds, a"):
        load_series(f, column="nope")
    with pytest.raises(ValueError, match="not a multiple"):
        load_series(f, window="15m")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_series(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="not numeric"):
        load_series(_write(tmp_path / "w.csv", "t_seconds,w\n0,a\n600,b\n"), column="w")


def test_the_shared_data_files_load_with_sensible_defaults() -> None:
    code = load_series(data_file("azure_llm_2024", "azure2024_code_requests_10min_digitized.csv"))
    assert (code.column, code.window, len(code)) == ("requests_est", "10m", 1008)
    assert code.daily_period() == 144
    hourly = load_series(data_file("aggregated_hourly_diegohommer", "azure2024_conv_hourly.csv"))
    assert (hourly.column, hourly.window, len(hourly)) == ("conversation", "1h", 144)
    assert hourly.values[0] == 91156
    large = load_series(data_file("servegen", "aggregate_language_m-large_10min.csv"),
                        window="1h")
    assert (large.column, large.agg, len(large)) == ("total_rate_rps", "mean", 336)
    conv_hourly = load_series(
        data_file("azure_llm_2024", "azure2024_conv_requests_10min_digitized.csv"),
        window="1h")
    # Digitised 10-minute counts summed to hours track the exact hourly counts (MANIFEST:
    # about 1% mean error).
    err = np.abs(conv_hourly.values[:144] - hourly.values) / hourly.values
    assert err.mean() < 0.03


def test_trace_windows_bins_tokens_and_requests() -> None:
    trace = [(0.0, 100, 10), (5.0, 50, 5), (61.0, 7, 1), (150.0, 1, 1)]
    tw = trace_windows(trace, 60)
    # Two whole windows; the request at 150 s falls in a partial third one and is dropped.
    assert tw.prompt_tokens.tolist() == [150, 7]
    assert tw.output_tokens.tolist() == [15, 1]
    assert tw.requests.tolist() == [2, 1]
    full = trace_windows(trace, 60, start=0.0, end=180.0)
    assert full.requests.tolist() == [2, 1, 1]


def test_request_trace_csv_becomes_a_series(tmp_path: Path) -> None:
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:00:00.5,100,10\n2023-11-16 18:00:30.0,20,2\n"
            "2023-11-16 18:01:10.0,5,1\n2023-11-16 18:02:20.0,1,1\n")
    f = _write(tmp_path / "trace.csv", text)
    s = load_series(f, column="output_tokens", window="1m")
    assert s.values.tolist() == [12, 1]
    with pytest.raises(ValueError, match="request trace"):
        load_series(f, column="bogus", window="1m")
