"""Balancer telemetry summed into demand windows per (model, region)."""

from __future__ import annotations

import pytest

from skymesh_controller.series import telemetry_series, to_csv


def sample(ts: float, region: str, **models: tuple[int, int, int]) -> dict[str, object]:
    return {"ts": ts, "region": region, "models": {
        m: {"requests": r, "prompt_tokens": p, "output_tokens": o}
        for m, (r, p, o) in models.items()}}


def test_reports_sum_into_aligned_windows_with_gaps_as_zero() -> None:
    samples = [sample(605, "us", a=(1, 100, 10)), sample(1190, "us", a=(2, 200, 20)),
               sample(2450, "us", a=(4, 400, 40), b=(9, 9, 9)), sample(700, "eu", a=(7, 7, 7))]
    s = telemetry_series(samples, 600, model="a", region="us")
    assert s["start"] == 600
    assert s["requests"] == [3, 0, 0, 4]  # windows 600, 1200, 1800, 2400
    assert s["prompt_tokens"] == [300, 0, 0, 400]
    both = telemetry_series(samples, 600, region="us")
    assert both["requests"][-1] == 13
    everywhere = telemetry_series(samples, 600, model="a")
    assert everywhere["requests"][0] == 10


def test_empty_and_bad_window() -> None:
    assert telemetry_series([], 60)["requests"] == []
    with pytest.raises(ValueError):
        telemetry_series([], 0)


def test_csv_has_one_row_per_window() -> None:
    s = telemetry_series([sample(0, "us", a=(1, 2, 3)), sample(130, "us", a=(4, 5, 6))], 60)
    assert to_csv(s).splitlines() == ["t_seconds,requests,prompt_tokens,output_tokens",
                                      "0,1,2,3", "60,0,0,0", "120,4,5,6"]
