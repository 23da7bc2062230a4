"""The balancer's pump skips the drain meter on a pass that sends nothing out of a
standing backlog (``Balancer._pump``): the meter reads the same as one told of every
pass, because its weights compose."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.balancer.overload import DrainMeter

# (seconds since the last pass, requests sent, requests left queued)
passes = st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(0, 3), st.integers(0, 4)),
                  min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(passes)
def test_skipping_passes_that_send_nothing_from_a_backlog_reads_the_same(
        seq: list[tuple[float, int, int]]) -> None:
    every, skipping = DrainMeter(), DrainMeter()
    now = 0.0
    for dt, sent, queued in seq:
        now += dt
        every.observe(now, sent, queued)
        if sent or not queued or skipping.backlog_since is None:  # as the pump does
            skipping.observe(now, sent, queued)
        assert skipping.backlog_since == every.backlog_since
        for later in (now, now + 0.5, now + 30.0):
            a, b = every.rate(later), skipping.rate(later)
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert math.isclose(a, b, rel_tol=1e-9)
