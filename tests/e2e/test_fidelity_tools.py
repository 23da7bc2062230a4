"""The fidelity benchmark's pure parts, without vLLM: the profile fit, the arrival
schedule and the side-by-side tables."""

from __future__ import annotations

import argparse
import itertools

import fidelity_bench
import pytest

from skymesh_replica.engine.hashing import BLOCK_SIZE


def measured(d1: float, d4: float, short: float, long: float) -> dict[str, float | int]:
    return {"decode_step_1_s": d1, "decode_step_4_s": d4, "decode_tokens": 64,
            "short_prompt_tokens": 50, "short_prompt_latency_s": short,
            "long_prompt_tokens": 1500, "long_prompt_latency_s": long}


def test_the_fitted_profile_steps_as_measured() -> None:
    # Made from a known engine: 10 ms a step, 5 us per context token a decoding sequence
    # reads, 0.07 ms a prompt token, 20 ms per request outside the steps.
    o, kv, tok, api = 0.010, 5e-6, 7e-5, 0.020
    ctx = 50 + 64 / 2
    m = measured(o + kv * ctx, o + 4 * kv * ctx, api + o + tok * 50, api + o + tok * 1500)
    p, per_request = fidelity_bench.fit_profile(m, kv_capacity_tokens=1 << 20)
    assert p.t_overhead == pytest.approx(o) and p.t_kv_token == pytest.approx(kv)
    assert p.t_token == pytest.approx(tok) and per_request == pytest.approx(api)
    # The emulator's own step function gives back what was measured.
    assert p.step_time(0, 0, 4, round(4 * ctx)) == pytest.approx(m["decode_step_4_s"])
    assert p.step_time(1500, 0, 0, 0) == pytest.approx(o + tok * 1500)
    assert p.max_num_seqs == 4 and p.kv_capacity_tokens == (1 << 20) // BLOCK_SIZE * BLOCK_SIZE


def test_noise_never_fits_negative_step_costs() -> None:
    # Four streams decoding faster than one (a quieter moment of a shared machine), and a
    # long prompt no slower than a short one.
    p, per_request = fidelity_bench.fit_profile(measured(0.030, 0.025, 0.05, 0.04), 1 << 20)
    assert p.t_token > 0 and p.t_kv_token == 0 and per_request >= 0
    # The full batch's step is the one the workload's queue sees.
    assert p.t_overhead == pytest.approx(0.025)


def test_schedule_is_seeded_and_starts_at_zero() -> None:
    args = argparse.Namespace(seed=3, requests=8, rate=2.0, min_tokens=10, max_tokens=20)
    a, b = fidelity_bench.schedule(args), fidelity_bench.schedule(args)
    assert a == b and a[0][0] == 0.0 and len(a) == 8
    assert all(x[0] <= y[0] for x, y in itertools.pairwise(a))
    assert all(10 <= n <= 20 for _, n in a)


def test_markdown_bins_both_runs_per_second_side_by_side() -> None:
    run = {"ttft_p50_s": 0.5, "ttft_p90_s": 1.0, "completion_s": 3.0, "waiting_mean": 0.5,
           "waiting_max": 2, "running_mean": 3.0, "failed": 0, "loadavg_mean": 4.0,
           "series": [[0.1, 0, 2], [0.6, 2, 4], [1.2, 1, 4]]}
    other = {**run, "series": [[0.0, 0, 1]]}
    text = fidelity_bench.markdown({"runs": {"vllm": run, "emulator": other}})
    assert "| 0 | 1.0 | 3.0 | 0.0 | 1.0 |" in text
    assert "| 1 | 1.0 | 4.0 | - | - |" in text
    assert "| TTFT p50 | 0.50 s | 0.50 s |" in text
