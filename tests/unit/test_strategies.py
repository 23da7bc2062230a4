"""Scaling strategies' rules and the batch queue manager, driven by hand-made inputs."""

from __future__ import annotations

import pytest

from skymesh_controller.planning.batch_queue import BatchQueue, BatchRequest
from skymesh_controller.planning.strategies import (
    COOLDOWN_S,
    LongTermImmediate,
    LongTermUtilisation,
    LongTermUtilisationAdjusted,
    Observation,
    PreServeScaler,
    Reactive,
    make_strategy,
)

EP = ("m", "us")
LAST_20_MIN = 3600.0 - 600.0  # 10 minutes before the hour ends
EARLY = 600.0


def obs(**kw: object) -> Observation:
    args: dict[str, object] = dict(now=EARLY, utilisation=0.5, load_tps=100.0, ready=4)
    args.update(kw)
    return Observation(**args)  # type: ignore[arg-type]


def test_reactive_thresholds() -> None:
    assert Reactive().decide(EP, obs(utilisation=0.71)).delta == 1
    assert Reactive().decide(EP, obs(utilisation=0.70)).delta == 0
    assert Reactive().decide(EP, obs(utilisation=0.29)).delta == -1
    assert Reactive().decide(EP, obs(utilisation=0.30)).delta == 0


def test_reactive_cooldown_is_per_endpoint() -> None:
    s = Reactive()
    assert s.decide(EP, obs(now=100.0, utilisation=0.9)).delta == 1
    assert s.decide(EP, obs(now=100.0 + COOLDOWN_S - 0.1, utilisation=0.9)).delta == 0
    assert s.decide(("m", "eu"), obs(now=101.0, utilisation=0.9)).delta == 1
    assert s.decide(EP, obs(now=100.0 + COOLDOWN_S, utilisation=0.9)).delta == 1


def test_min_and_max_bound_every_strategy() -> None:
    assert Reactive().decide(EP, obs(utilisation=0.9, ready=3, starting=1,
                                     max_instances=4)).delta == 0
    assert Reactive().decide(EP, obs(utilisation=0.1, ready=1, min_instances=1)).delta == 0
    assert LongTermImmediate().decide(EP, obs(target=10, max_instances=6)).delta == 2
    # Only serving instances can be stopped.
    assert LongTermImmediate().decide(EP, obs(target=0, ready=2, starting=3,
                                              min_instances=0)).delta == -2


def test_lt_i_jumps_to_the_target_at_once() -> None:
    s = LongTermImmediate()
    assert s.decide(EP, obs(target=9, ready=4, starting=1)).delta == 4
    assert s.decide(EP, obs(target=2, utilisation=0.9)).delta == -2
    assert s.decide(EP, obs(target=4)).delta == 0
    assert s.decide(EP, obs(target=None)).delta == 0


def test_lt_u_moves_towards_the_target_only_on_utilisation() -> None:
    s = LongTermUtilisation()
    assert s.decide(EP, obs(target=8, utilisation=0.5)).delta == 0
    assert s.decide(EP, obs(target=8, utilisation=0.75)).delta == 1
    assert LongTermUtilisation().decide(EP, obs(target=4, utilisation=0.95)).delta == 0
    assert LongTermUtilisation().decide(EP, obs(target=2, utilisation=0.2)).delta == -1
    assert LongTermUtilisation().decide(EP, obs(target=4, utilisation=0.1)).delta == 0
    assert LongTermUtilisation().decide(EP, obs(target=2, utilisation=0.5)).delta == 0


def test_lt_ua_keeps_scaling_out_on_5x_traffic_only_in_the_last_20_minutes() -> None:
    burst = dict(target=4, utilisation=0.5, load_tps=500.0, forecast_tps=100.0)
    assert LongTermUtilisationAdjusted().decide(EP, obs(now=EARLY, **burst)).delta == 0
    assert LongTermUtilisationAdjusted().decide(
        EP, obs(now=LAST_20_MIN, **burst)).delta == 1
    # 4.9x is not enough; the next hour's 10th minute is not the last 20 either.
    assert LongTermUtilisationAdjusted().decide(
        EP, obs(now=LAST_20_MIN, **{**burst, "load_tps": 490.0})).delta == 0
    assert LongTermUtilisationAdjusted().decide(
        EP, obs(now=3600.0 + EARLY, **burst)).delta == 0
    # Not until the memory-based goal (the target) is reached.
    assert LongTermUtilisationAdjusted().decide(
        EP, obs(now=LAST_20_MIN, **{**burst, "target": 6})).delta == 0


def test_lt_ua_keeps_scaling_in_under_half_the_forecast() -> None:
    quiet = dict(target=4, utilisation=0.4, load_tps=40.0, forecast_tps=100.0)
    assert LongTermUtilisationAdjusted().decide(EP, obs(now=EARLY, **quiet)).delta == 0
    assert LongTermUtilisationAdjusted().decide(
        EP, obs(now=LAST_20_MIN, **quiet)).delta == -1
    assert LongTermUtilisationAdjusted().decide(
        EP, obs(now=LAST_20_MIN, **{**quiet, "load_tps": 51.0})).delta == 0
    # Would push the remaining 3 instances over 70%: hold.
    assert LongTermUtilisationAdjusted().decide(
        EP, obs(now=LAST_20_MIN, **{**quiet, "utilisation": 0.6})).delta == 0


def test_preserve_applies_n_once_per_window_then_follows_the_anticipator() -> None:
    s = PreServeScaler()
    assert s.decide(EP, obs(needed=7, window_start=0.0)).delta == 3
    assert s.decide(EP, obs(now=EARLY + 20, needed=7, window_start=0.0, ready=4,
                            starting=3, projected_utilisation=0.5)).delta == 0
    assert s.decide(EP, obs(now=EARLY + 40, needed=7, window_start=0.0, ready=7,
                            projected_utilisation=0.97)).delta == 1
    # Under 30% over the whole look-ahead: shed down to what keeps it at 30%, once.
    assert s.decide(EP, obs(now=EARLY + 80, needed=8, window_start=0.0, ready=8,
                            projected_utilisation=0.1)).delta == -5
    assert s.decide(EP, obs(now=EARLY + 120, needed=8, window_start=0.0, ready=3,
                            projected_utilisation=0.05)).delta == 0
    assert s.decide(EP, obs(now=EARLY + 600, needed=2, window_start=600.0,
                            ready=3)).delta == -1


def test_unknown_strategy_is_named() -> None:
    with pytest.raises(ValueError, match="lt-x"):
        make_strategy("lt-x")


def test_batch_queue_feeds_one_under_60_two_under_50() -> None:
    q = BatchQueue()
    for i in range(5):
        q.submit(BatchRequest(f"b{i}", "m", arrival=float(i)))
    assert q.on_signal("m", "us", 0.60, now=10.0) == []
    one = q.on_signal("m", "us", 0.55, now=10.0)
    assert [d.request.request_id for d in one] == ["b0"]
    two = q.on_signal("m", "eu", 0.49, now=10.0)
    assert [d.request.request_id for d in two] == ["b1", "b2"]
    assert all(d.region == "eu" and d.priority == 1 for d in two)
    assert q.on_signal("other", "us", 0.1, now=10.0) == []
    assert q.waiting("m") == 2


def test_batch_requests_are_promoted_after_10_hours_and_expire_at_24() -> None:
    q = BatchQueue()
    hour = 3600.0
    q.submit(BatchRequest("old", "m", arrival=0.0))
    q.submit(BatchRequest("young", "m", arrival=5 * hour))
    q.submit(BatchRequest("late", "m", arrival=6 * hour))
    out = q.on_signal("m", "us", 0.1, now=10 * hour + 1)
    assert [(d.request.request_id, d.priority) for d in out] == [("old", 0), ("young", 1)]
    assert q.expire(now=30 * hour - 1) == []
    assert [r.request_id for r in q.expire(now=30 * hour)] == ["late"]
    assert q.expired == 1 and len(q) == 0


def test_batch_queue_rejects_out_of_order_submissions() -> None:
    q = BatchQueue()
    q.submit(BatchRequest("a", "m", arrival=5.0))
    with pytest.raises(ValueError):
        q.submit(BatchRequest("b", "m", arrival=4.0))


def test_batch_queue_fill_tops_an_endpoint_up_to_60_percent() -> None:
    q = BatchQueue()
    q.submit(BatchRequest("a", "m", arrival=0.0, prompt_tokens=600, output_tokens=200))
    q.submit(BatchRequest("b", "m", arrival=1.0, prompt_tokens=1_500, output_tokens=500))
    assert q.fill("m", "us", 0.60, capacity_tokens=10_000, now=2.0) == []
    assert q.fill("m", "us", 0.75, capacity_tokens=10_000, now=2.0) == []
    # 40% used of 10,000 tokens: room for 2,000 more -> all of "a", 1,200 of "b".
    out = q.fill("m", "us", 0.40, capacity_tokens=10_000, now=2.0)
    assert [(d.request.request_id, d.request.prompt_tokens, d.request.output_tokens)
            for d in out] == [("a", 600, 200), ("b", 900, 300)]
    assert all(d.region == "us" and d.priority == 1 for d in out)
    # The rest of "b" waits, with its own arrival time.
    assert [(r.request_id, r.arrival, r.prompt_tokens, r.output_tokens)
            for r in q.pending()] == [("b", 1.0, 600, 200)]


def test_batch_queue_fill_splits_the_oldest_request_and_keeps_its_age() -> None:
    q = BatchQueue()
    q.submit(BatchRequest("big", "m", arrival=0.0, prompt_tokens=9_000, output_tokens=1_000))
    out = q.fill("m", "eu", 0.50, capacity_tokens=10_000, now=11 * 3600.0)
    assert len(out) == 1
    part = out[0].request
    assert part.prompt_tokens + part.output_tokens == 1_000
    assert (part.prompt_tokens, part.output_tokens) == (900, 100)  # same prompt share
    assert out[0].priority == 0  # older than 10 hours: promoted
    (rest,) = q.pending()
    assert (rest.request_id, rest.arrival, rest.prompt_tokens, rest.output_tokens) \
        == ("big", 0.0, 8_100, 900)
    assert q.fill("other", "eu", 0.0, capacity_tokens=10_000, now=0.0) == []
