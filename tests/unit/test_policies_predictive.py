"""The predictive routers' scores and state: preserve (look-ahead map), goodserve
(estimates, just-enough, migration), vllm-load; and their use through the simulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import Load, View

from skymesh.policies import RequestTiming, RouteRequest, build_policy
from skymesh.policies.goodserve import GoodServe, just_enough, predict_latency
from skymesh.policies.preserve import LookAheadMap, PreServe, preserve_score
from skymesh.policies.vllm_load import vllm_score
from skymesh_lab.sim.runner import SimConfig, parse_profiles, run


# -- vllm-load ------------------------------------------------------------------------------
def test_vllm_score_weighs_queued_four_times_running() -> None:
    assert vllm_score(Load(outstanding=5, running=3)) == 4 * 2 + 3
    assert vllm_score(Load(outstanding=1, running=3)) == 3  # probe shows more than ours


def test_vllm_load_prefers_running_over_queued() -> None:
    pol = build_policy("vllm-load")
    # a: 4 running (score 4); b: 1 queued + 1 running (score 5)
    view = View({"a": Load(outstanding=4, running=4), "b": Load(outstanding=2, running=1)})
    assert pol.select(RouteRequest("r"), ["a", "b"], view) == "a"


# -- PreServe look-ahead map -----------------------------------------------------------------
def test_map_adds_prompt_plus_generated_tokens_per_iteration() -> None:
    m = LookAheadMap(horizon=10)
    m.add("r", prompt_tokens=100, predicted_tokens=4)
    assert m.usage[:5].tolist() == [100, 101, 102, 103, 0]
    assert m.remaining_decode() == 4
    m.advance(2)
    assert m.usage[:3].tolist() == [102, 103, 0]
    assert m.remaining_decode() == 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "finish", "advance"]),
                          st.integers(0, 5), st.integers(1, 30)), max_size=40))
def test_remaining_decode_and_peak_match_their_definitions(
    ops: list[tuple[str, int, int]]
) -> None:
    m = LookAheadMap(horizon=16)
    for op, rid, n in ops:
        if op == "add":
            m.finish(str(rid))  # a request id is mapped once
            m.add(str(rid), prompt_tokens=10, predicted_tokens=n)
        elif op == "finish":
            m.finish(str(rid))
        else:
            m.advance(m.origin + n)
        o = m.origin
        assert m.remaining_decode() == sum(
            max(0, e.start + e.predicted - max(o, e.start)) for e in m.entries.values())
        for window, prompt, predicted in ((8, 0, 0), (8, 50, 5), (16, 7, 30), (3, 1, 2)):
            cur = m.usage[:window].copy()
            k = min(window, predicted)
            cur[:k] += prompt + np.arange(k)
            assert m.peak(window, prompt, predicted) == cur.max()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5),
                          st.floats(0, 1e5, allow_nan=False)), max_size=40))
def test_goodserve_mean_wait_is_the_mean_over_waiting_requests(
    ops: list[tuple[bool, int, float]]
) -> None:
    from skymesh.policies.goodserve import Speed

    s = Speed(0.0, 0.0, 0.03)
    for start, rid, t in ops:
        if start:
            s.start_wait(str(rid), t)
        else:
            s.end_wait(str(rid))
        now = 2e5
        want = sum(now - v for v in s.waiting.values()) / len(s.waiting) if s.waiting else 0
        assert s.mean_wait(now) == pytest.approx(want, rel=1e-9, abs=1e-6)


def test_map_early_end_removes_the_remainder() -> None:
    m = LookAheadMap(horizon=10)
    m.add("a", 100, 6)
    m.add("b", 50, 3)
    m.advance(1)
    m.finish("a")  # ended after 1 of its 6 predicted iterations
    assert m.usage[:4].tolist() == [51, 52, 0, 0]
    assert m.remaining_decode() == 2


def test_map_long_run_gets_virtual_extensions_of_a_fifth() -> None:
    m = LookAheadMap(horizon=64, extension=0.2)
    m.add("r", 10, 10)
    m.advance(10)  # predicted length used up, request still running
    assert m.extensions == 1
    # 0.2 x 10 = 2 more iterations, continuing the token count where it stopped.
    assert m.usage[:3].tolist() == [20, 21, 0]
    m.advance(12)
    assert m.extensions == 2  # extended again by 0.2 x 12 -> 3
    assert m.usage[:4].tolist() == [22, 23, 24, 0]
    m.finish("r")
    assert not m.usage.any()


def test_map_fills_the_new_tail_when_it_moves() -> None:
    m = LookAheadMap(horizon=4)
    m.add("r", 0, 8)  # longer than the window
    m.advance(3)
    assert m.usage.tolist() == [3, 4, 5, 6]
    m.finish("r")
    assert not m.usage.any()


def test_peak_with_a_virtual_request() -> None:
    m = LookAheadMap(horizon=16)
    m.add("r", 100, 3)
    assert m.peak(8) == 102
    assert m.peak(8, prompt_tokens=50, predicted_tokens=5) == 102 + 52
    assert m.usage[:3].tolist() == [100, 101, 102]  # the virtual add left no trace


def test_preserve_score_terms() -> None:
    assert preserve_score(10, 20, 30, 40, peak_tokens=70, capacity=100) == 100
    # 90% peak: 10% of 100 tokens above the 80% threshold, times beta 2
    assert preserve_score(0, 0, 0, 0, peak_tokens=90, capacity=100, beta=2.0) == \
        pytest.approx(20.0)


def test_preserve_avoids_the_replica_heading_for_kv_overflow() -> None:
    pol = PreServe(kv_capacity_tokens=1000, window=50, rng=None)
    view = View()
    # Same decode tokens ahead on both, but a's requests have long prompts: its map
    # crosses 80% of the KV capacity, b's does not.
    pol.on_dispatch(RouteRequest("a1", prompt_len=700, predicted_output_tokens=40), "a", view)
    pol.on_dispatch(RouteRequest("b1", prompt_len=10, predicted_output_tokens=40), "b", view)
    for t in ("a", "b"):
        pol.on_timing(RouteRequest(f"{t}1"), t, RequestTiming(0.0, 0.0, first_token_at=0.0))
    req = RouteRequest("new", prompt_len=200, predicted_output_tokens=40)
    # Both: L_p 200 + L_d 40 + 40. a's peak: (700 + 39) + (200 + 39) = 978 tokens, 17.8%
    # of 1000 above 80%: L_m 178. b's peak 288 tokens: no penalty.
    assert pol.score(req, "b", view) == pytest.approx(280)
    assert pol.score(req, "a", view) == pytest.approx(280 + 178)
    assert pol.select(req, ["a", "b"], view) == "b"


def test_preserve_learns_iteration_time_and_ends_requests() -> None:
    pol = PreServe(iteration_s=0.1)
    view = View()
    r = RouteRequest("r", prompt_len=10, predicted_output_tokens=100)
    pol.on_dispatch(r, "a", view)
    pol.on_timing(r, "a", RequestTiming(now=6.0, dispatched_at=0.0, first_token_at=1.0,
                                        output_tokens=11, finished=True))
    assert pol.replicas["a"].iteration_s == pytest.approx(0.2 * 0.5 + 0.8 * 0.1)
    pol.on_complete(r, "a", True)
    assert pol.replicas["a"].amap.remaining_decode() == 0
    assert pol.replicas["a"].queued_prefill == 0


# -- GoodServe --------------------------------------------------------------------------------
def test_latency_formula() -> None:
    assert predict_latency(q=1.0, p=0.01, d=0.1, prompt=150, hit=50, output=20) == \
        pytest.approx(1.0 + 1.0 + 2.0)


def test_just_enough_picks_the_slowest_feasible_else_the_fastest() -> None:
    lat = {"h100": 2.0, "a100": 3.0, "l4": 9.0}
    dec = {"h100": 0.005, "a100": 0.008, "l4": 0.06}
    assert just_enough(lat, dec, deadline=10.0) == "l4"
    assert just_enough(lat, dec, deadline=5.0) == "a100"
    assert just_enough(lat, dec, deadline=1.0) == "h100"  # none feasible: least overshoot
    assert just_enough(lat, dec, deadline=None) == "h100"


def _observe(pol: GoodServe, target: str, view: View, rid: str, ttft: float, tpot: float,
             out: int = 11, prompt: int = 100) -> None:
    r = RouteRequest(rid, prompt_len=prompt)
    view.load(target).outstanding = 1  # idle before this one: TTFT is pure prefill
    pol.on_dispatch(r, target, view)
    t0 = view.now
    pol.on_timing(r, target, RequestTiming(t0 + ttft, t0, t0 + ttft, 1, False, prompt))
    end = t0 + ttft + tpot * (out - 1)
    pol.on_timing(r, target, RequestTiming(end, t0, t0 + ttft, out, True, prompt))
    pol.on_complete(r, target, True)


def test_goodserve_learns_speeds_and_routes_just_enough() -> None:
    pol = GoodServe(alpha=1.0)
    view = View()
    _observe(pol, "slow", view, "s", ttft=0.5, tpot=0.06)
    _observe(pol, "fast", view, "f", ttft=0.05, tpot=0.005)
    assert pol.speed("slow").d == pytest.approx(0.06)
    assert pol.speed("fast").p == pytest.approx(0.0005)
    loose = RouteRequest("a", prompt_len=100, predicted_output_tokens=50, deadline_s=10.0)
    tight = RouteRequest("b", prompt_len=100, predicted_output_tokens=50, deadline_s=1.0)
    assert pol.select(loose, ["slow", "fast"], view) == "slow"  # 3.5 s fits 10 s
    assert pol.select(tight, ["slow", "fast"], view) == "fast"


def test_goodserve_learns_decode_speed_from_non_streamed_replies() -> None:
    pol = GoodServe(alpha=1.0)
    view = View()
    _observe(pol, "a", view, "s", ttft=0.1, tpot=0.02)  # p = 0.001 s per token, q = 0
    r = RouteRequest("plain", prompt_len=100)
    view.load("a").outstanding = 1
    pol.on_dispatch(r, "a", view)
    # 2.1 s end to end, 101 tokens: 0.1 s of it is prefill by the estimates, 2.0 s decode.
    pol.on_timing(r, "a", RequestTiming(2.1, 0.0, None, 101, True, 100))
    assert pol.speed("a").d == pytest.approx(0.02)
    pol.on_timing(r, "a", RequestTiming(4.1, 0.0, None, 101, True, 100))
    assert pol.speed("a").d == pytest.approx(0.04)  # slower now: the estimate follows
    # Half the prompt was cached: less prefill, so more of the time was decoding.
    pol.on_timing(r, "a", RequestTiming(2.1, 0.0, None, 101, True, 100, 50))
    assert pol.speed("a").d == pytest.approx((2.1 - 0.05) / 100)
    # Shorter than the estimated prefill alone, or a single token: nothing to learn.
    before = pol.speed("a").d
    pol.on_timing(r, "a", RequestTiming(0.05, 0.0, None, 101, True, 100))
    pol.on_timing(r, "a", RequestTiming(9.0, 0.0, None, 1, True, 100))
    assert pol.speed("a").d == before


def test_goodserve_routes_on_a_conservative_length() -> None:
    # Predicted 50 tokens: the slow replica needs ~3.5 s for 50 but ~6.5 s for 100.
    req = RouteRequest("a", prompt_len=100, predicted_output_tokens=50, deadline_s=5.0)
    picks = {}
    for margin in (1.0, 2.0):
        pol = GoodServe(alpha=1.0, length_margin=margin)
        view = View()
        _observe(pol, "slow", view, "s", ttft=0.5, tpot=0.06)
        _observe(pol, "fast", view, "f", ttft=0.05, tpot=0.005)
        picks[margin] = pol.select(req, ["slow", "fast"], view)
    assert picks == {1.0: "slow", 2.0: "fast"}
    assert GoodServe().length_margin == 2.0
    with pytest.raises(ValueError, match="length_margin"):
        GoodServe(length_margin=0.5)


def test_goodserve_counts_the_wait_of_requests_without_a_first_token() -> None:
    pol = GoodServe(alpha=1.0)
    view = View()
    _observe(pol, "a", view, "x", ttft=0.05, tpot=0.01)
    stuck = RouteRequest("stuck", prompt_len=10)
    view.load("a").outstanding = 2
    pol.on_dispatch(stuck, "a", view)
    view.now = 5.0
    lat, _ = pol.estimates(RouteRequest("n", prompt_len=10, predicted_output_tokens=10),
                           ["a"], view.now)
    assert lat["a"] >= 5.0


def test_goodserve_migrates_a_late_request_to_a_replica_that_makes_it() -> None:
    pol = GoodServe(alpha=1.0)
    view = View()
    _observe(pol, "slow", view, "s", ttft=0.5, tpot=0.1)
    _observe(pol, "fast", view, "f", ttft=0.05, tpot=0.005)
    r = RouteRequest("r", prompt_len=100, predicted_output_tokens=50, deadline_s=8.0)
    # 20 tokens in after 4 s, 30 to go at 0.1 s: 3 s more, inside 8 s: stay.
    on_time = RequestTiming(4.0, 0.0, 0.5, 20, False, 100)
    assert pol.migrate(r, "slow", on_time, ["slow", "fast"], view) is None
    # The prediction was short: 60 tokens done; extended by 0.2 x 50 = 10, then by
    # 0.2 x 60 = 12 to pass 60, so 12 more expected at 0.1 s = 1.2 s beyond 7.5 s: move
    # to fast, which re-prefills 160 tokens and decodes 12.
    late = RequestTiming(7.5, 0.0, 0.5, 60, False, 100)
    assert pol.remaining_output(r, 60) == 12
    assert pol.migrate(r, "slow", late, ["slow", "fast"], view) == "fast"
    assert pol.select(r, ["slow", "fast"], view) == "fast"  # the re-offer follows it
    assert pol.migrations == 1
    # Nowhere to go in time: stay.
    hopeless = RequestTiming(7.99, 0.0, 0.5, 60, False, 100)
    assert pol.migrate(r, "slow", hopeless, ["slow", "fast"], view) is None


def test_bad_parameters_are_refused() -> None:
    from skymesh.policies import PolicyConfigError

    with pytest.raises(PolicyConfigError):
        build_policy("goodserve", {"alpha": 0})
    with pytest.raises(PolicyConfigError):
        build_policy("preserve", {"horizon": 0})
    with pytest.raises(PolicyConfigError):
        build_policy("vllm-load", {"bogus": 1})


# -- through the simulator ----------------------------------------------------------------------
HETERO = parse_profiles("l4=2,a100=1,h100=1", ["us"])


def _hetero(policy: str, **kw: object) -> dict[str, object]:
    cfg = SimConfig(workload="poisson", regions=["us"], replicas={"us": 4}, policy=policy,
                    push_mode="bp", forwarding=False, replica_profiles=HETERO,
                    deadline_scale=2.0, deadline_base_s=2.5, length_predictor="noisy-oracle",
                    duration_s=30.0, workload_params={"rate_rps": 8.0}, seed=1, **kw)
    return run(cfg)


def test_parse_profiles() -> None:
    assert HETERO == {"us": ["llama3.1-8b-l4", "llama3.1-8b-l4", "llama3.1-8b-a100",
                             "llama3.1-8b-h100"]}
    per = parse_profiles("us:h100=1;eu:l4=2", ["us", "eu"])
    assert per == {"us": ["llama3.1-8b-h100"], "eu": ["llama3.1-8b-l4"] * 2}
    with pytest.raises(ValueError, match="unknown"):
        parse_profiles("tpu=2", ["us"])


def test_goodserve_beats_round_robin_goodput_on_a_mixed_fleet() -> None:
    gs = _hetero("goodserve")
    rr = _hetero("round-robin")
    assert gs["requests"] == rr["requests"] and gs["completed"] == gs["requests"]
    assert set(gs["replica_profiles"].values()) == {  # type: ignore[union-attr]
        "llama3.1-8b-l4", "llama3.1-8b-a100", "llama3.1-8b-h100"}
    assert gs["goodput_rps"] > 1.2 * rr["goodput_rps"]  # type: ignore[operator]
    assert gs["slo_violation_rate"] < rr["slo_violation_rate"]  # type: ignore[operator]
    assert gs["migrations"] > 0  # type: ignore[operator]


def test_migration_keeps_one_stream_per_request() -> None:
    res = _hetero("goodserve")
    # Every request finished exactly once, however many times it moved, and the tokens
    # generated add up to the trace's (a migrated request is not replayed from scratch).
    per = res["per_replica"]
    assert sum(v["completed"] for v in per.values()) == res["completed"]  # type: ignore[union-attr]


def test_predicted_lengths_reach_the_policy() -> None:
    noisy = _hetero("preserve")
    assert 0 < noisy["predicted_length_mae"] < 400  # type: ignore[operator]
    exact = run(SimConfig(workload="poisson", regions=["us"], replicas={"us": 2},
                          policy="preserve", forwarding=False, length_predictor="oracle",
                          duration_s=10.0, workload_params={"rate_rps": 2.0}))
    assert exact["predicted_length_mae"] == 0


def test_alone_latency_orders_gpus() -> None:
    from skymesh_lab.sim.deadlines import alone_latency
    from skymesh_replica.engine.profiles import get_profile

    lat = [alone_latency(get_profile(f"llama3.1-8b-{g}"), 500, 200) for g in ("l4", "a100",
                                                                               "h100")]
    assert lat[0] > 4 * lat[1] > 4 * lat[2] > 0
    assert np.isclose(alone_latency(get_profile("llama3.1-8b-a100"), 1, 1),
                      get_profile("llama3.1-8b-a100").step_time(1, 0.5, 0, 0))
