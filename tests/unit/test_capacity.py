"""Per-instance capacity measured on the engine, and PreServe's instance count."""

from __future__ import annotations

import dataclasses

import pytest

from skymesh_lab.planning.capacity import (
    Capacity,
    instances_needed,
    profile_capacity,
    saturated_throughput,
)
from skymesh_replica.engine.profiles import get_profile

CAPS = Capacity(profile="p", model="m", gpu="g", num_gpus=1, mu_p=1000.0, mu_d=200.0,
                mu_t=900.0, prompt_len=1000, output_len=200)


@pytest.mark.parametrize(("p", "d", "n"), [
    (2500.0, 100.0, 3),   # prefill binds: 2.5 -> 3
    (100.0, 700.0, 4),    # decode binds: 3.5 -> 4
    (1800.0, 400.0, 3),   # the mix binds: 2200 / 900 = 2.44 -> 3 (others give 1.8, 2)
    (0.0, 0.0, 0),
    (1000.0, 0.0, 2),     # exactly 1.0 prefill, but the mix needs 1.11
])
def test_instances_needed_is_preserve_n(p: float, d: float, n: int) -> None:
    assert instances_needed(p, d, CAPS) == n


def test_utilisation_target_adds_headroom_and_bad_values_fail() -> None:
    assert instances_needed(1800.0, 0.0, CAPS, utilisation=0.5) == 4
    with pytest.raises(ValueError):
        instances_needed(-1.0, 0.0, CAPS)
    with pytest.raises(ValueError):
        instances_needed(1.0, 0.0, CAPS, utilisation=0.0)


def test_faster_gpus_measure_faster() -> None:
    l4, a100, h100 = (profile_capacity(f"llama3.1-8b-{g}") for g in ("l4", "a100", "h100"))
    assert l4.mu_t < a100.mu_t < h100.mu_t
    assert l4.mu_p < a100.mu_p < h100.mu_p


def test_prefill_capacity_agrees_with_the_step_time_roofline() -> None:
    """A full prefill step of the L4 profile, timed by the profile itself, gives the same
    tokens/s as the saturated engine run (the engine adds a decode token per request)."""
    prof = get_profile("llama3.1-8b-l4")
    measured = saturated_throughput(prof, 512, 1).prompt_tps
    budget = prof.max_num_batched_tokens
    per_step = budget / prof.step_time(budget, attn_units=budget * 256.0, decode_seqs=0,
                                       decode_context=0)
    assert measured == pytest.approx(per_step, rel=0.1)


def test_smaller_kv_cache_lowers_decode_capacity() -> None:
    prof = get_profile("llama3.1-8b-a100")
    small = dataclasses.replace(prof, num_kv_blocks=prof.num_kv_blocks // 8)
    assert saturated_throughput(small, 16, 200).output_tps < \
        saturated_throughput(prof, 16, 200).output_tps


def test_request_larger_than_the_cache_is_refused() -> None:
    prof = dataclasses.replace(get_profile("llama3.1-8b-l4"), num_kv_blocks=10)
    with pytest.raises(ValueError, match="does not fit"):
        saturated_throughput(prof, 150, 50)
