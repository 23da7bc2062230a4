"""The access-log-cost benchmark's interval of a median (order statistics)."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from skymesh_lab.bench.access_log_cost import median_interval


@pytest.mark.parametrize(("n", "ranks"), [
    (12, (2, 9)),  # P(Binomial(12, 1/2) <= 2) = 0.019, <= 3: 0.073
    (24, (6, 17)),  # <= 6: 0.011, <= 7: 0.032
    (30, (9, 20)),  # <= 9: 0.021, <= 10: 0.049
])
def test_the_interval_is_the_binomial_order_statistics(n: int, ranks: tuple[int, int]) -> None:
    values = [float(i * i) for i in range(n)][::-1]  # any order
    low, high = median_interval(values)
    assert (low, high) == (float(ranks[0] ** 2), float(ranks[1] ** 2))
    assert low <= statistics.median(values) <= high


def test_too_few_values_for_95_percent_give_min_and_max() -> None:
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)


def test_an_outlier_does_not_widen_it() -> None:
    values = [10.0 + i % 3 for i in range(24)]
    assert median_interval([*values[:-1], 1e6]) == median_interval(values)


def test_request_path_cost_counts_the_loops_kernel_time_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: request_path_cost summed every value of ``thread_ticks``, whose
    ``loop_sys`` is part of ``loop`` already: the loop's kernel time counted twice."""
    from types import SimpleNamespace

    from skymesh_lab.bench import access_log_cost as alc
    from skymesh_lab.bench import request_path_cost as rpc

    readings = iter([{alc.LOOP: 0, alc.WRITER: 0, alc.THREADS: 0, alc.LOOP_SYS: 0},
                     {alc.LOOP: 100, alc.WRITER: 5, alc.THREADS: 3, alc.LOOP_SYS: 40}])
    monkeypatch.setattr(alc, "thread_ticks", lambda root: next(readings))
    monkeypatch.setattr(rpc.ro, "run_wrk", lambda url, case, duration_s: "")
    monkeypatch.setattr(rpc.st, "parse_wrk", lambda out: {
        "requests": 1000, "rps": 100.0, "errors": 0, "non_2xx": 0})
    daemon: Any = SimpleNamespace(proc=SimpleNamespace(pid=1), url="http://lb")
    seg = rpc.segment(daemon, "rr", 1.0)
    assert seg["ticks"] == 108  # loop (its kernel time within) + writer + other threads
