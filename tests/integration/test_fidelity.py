"""Simulator vs. real replicas on the same workload (skymesh_lab.bench.fidelity), small size.

Two ``skymesh-replica`` processes at time scale 0.5 take 30 requests (about 15 s of wall
time with start-up). The benchmark reports against the issue's 10% target; here the bound
is 25% because CI runs the client and both replicas on two noisy cores.
"""

from __future__ import annotations

from typing import Any

import pytest

from skymesh_lab.bench.fidelity import (
    FidelityRequest,
    build_requests,
    compare,
    main,
    run_live,
    run_sim,
)
from skymesh_replica.engine.profiles import DEFAULT_PROFILE

pytestmark = pytest.mark.timeout(180)

REPLICAS = 2
REQUESTS = 30
RATE = 3.0
TIME_SCALE = 0.5
SEED = 0
TOLERANCE = 0.25
SHARED = 256


@pytest.fixture(scope="module")
def requests_() -> list[FidelityRequest]:
    return build_requests(REQUESTS, RATE, SEED, shared_prefix_tokens=SHARED)


@pytest.fixture(scope="module")
def results(requests_: list[FidelityRequest]) -> tuple[dict[str, Any], dict[str, Any]]:
    sim = run_sim(requests_, REPLICAS, DEFAULT_PROFILE, TIME_SCALE)
    live = run_live(requests_, REPLICAS, DEFAULT_PROFILE, TIME_SCALE, SEED)
    return sim, live


def test_workload_is_deterministic_and_one_token_per_word(
    requests_: list[FidelityRequest],
) -> None:
    again = build_requests(REQUESTS, RATE, SEED, shared_prefix_tokens=SHARED)
    assert again == requests_
    arrivals = [r.arrival_s for r in requests_]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    head = requests_[0].prompt_ids[:SHARED]
    for r in requests_:
        # The tokenizer's count is the truth; with " word" pieces it equals the word count.
        assert r.prompt_len == r.num_words
        assert 64 <= r.prompt_len - SHARED <= 512
        assert 16 <= r.output_len <= 160
        assert r.prompt_ids[:SHARED] == head


@pytest.mark.slow
def test_all_requests_complete_with_exact_token_counts(
    results: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    sim, live = results
    assert sim["completed"] == REQUESTS and sim["failed"] == 0
    assert live["completed"] == REQUESTS, live["detail"]["errors"]
    assert live["failed"] == 0
    assert live["detail"]["token_mismatches"] == 0
    # Same prompt lengths on both sides: the replica tokenised each prompt as we did.
    assert live["detail"]["prompt_token_mismatches"] == 0


@pytest.mark.slow
def test_prefix_cache_hits_on_both_sides(
    results: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    sim, live = results
    assert sim["prefix_hit_rate"] > 0
    assert live["prefix_hit_rate"] > 0


@pytest.mark.slow
def test_throughput_and_ttft_agree(results: tuple[dict[str, Any], dict[str, Any]]) -> None:
    sim, live = results
    diff = compare(sim, live)
    for key in ("throughput_rps", "ttft_p50_s"):
        d = diff[key]
        assert d is not None and abs(d) <= TOLERANCE, (
            f"{key}: sim {sim[key]:.4f} live {live[key]:.4f} ({d})")


def test_compare_is_relative_to_the_simulator() -> None:
    keys = ("completed", "throughput_rps", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
            "e2e_mean_s", "e2e_p50_s", "e2e_p90_s", "prefix_hit_rate")
    sim = dict.fromkeys(keys, 2.0) | {"prefix_hit_rate": 0.0}
    live = dict.fromkeys(keys, 2.5) | {"prefix_hit_rate": 0.0}
    diff = compare(sim, live)
    assert diff["ttft_p50_s"] == pytest.approx(0.25)
    assert diff["prefix_hit_rate"] == 0.0
    assert compare(sim, live | {"prefix_hit_rate": 0.1})["prefix_hit_rate"] is None


def test_cli_rejects_unknown_profile() -> None:
    with pytest.raises(ValueError, match="unknown profile"):
        main(["--profile", "no-such-gpu", "--requests", "1"])
