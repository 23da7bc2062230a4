"""The emulator's load gauges trail the engine as vLLM's do (fake clock)."""

from __future__ import annotations

from skymesh_replica.metrics import LaggedLoad


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_gauges_show_the_state_of_lag_seconds_ago() -> None:
    clock = _Clock()
    state = [(0, 0, 0.0, 0)]
    load = LaggedLoad(lambda: state[0], 1.0, clock)
    load.record()
    clock.now = 101.0
    state[0] = (2, 4, 0.5, 800)  # a burst lands
    load.record()
    clock.now = 101.5
    assert load.published() == (0, 0, 0.0, 0)  # half a lag later: not shown yet
    clock.now = 102.0
    assert load.published() == (2, 4, 0.5, 800)
    state[0] = (0, 1, 0.25, 100)
    load.record()
    clock.now = 102.75
    assert load.published() == (2, 4, 0.5, 800)
    clock.now = 103.0
    assert load.published() == (0, 1, 0.25, 100)
    assert len(load._history) == 1  # nothing older than the lag is kept


def test_no_lag_reads_the_engine() -> None:
    state = [(1, 2, 0.25, 64)]
    load = LaggedLoad(lambda: state[0], 0.0, _Clock())
    assert load.published() == (1, 2, 0.25, 64)
    state[0] = (0, 3, 0.5, 96)
    assert load.published() == (0, 3, 0.5, 96)


def test_before_any_sample_reaches_the_lag_it_shows_an_idle_engine() -> None:
    clock = _Clock()
    load = LaggedLoad(lambda: (3, 4, 0.5, 10), 0.9, clock)
    assert load.published() == (0, 0, 0.0, 0)
    clock.now += 1.0
    assert load.published() == (3, 4, 0.5, 10)
