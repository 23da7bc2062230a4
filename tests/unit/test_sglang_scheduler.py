"""The engine's SGLang mode: admission reserve, latch, ratio, retraction, lpm, gauges."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh_replica.engine.core import Engine, Sequence, Status
from skymesh_replica.engine.hashing import BLOCK_SIZE, hash_token_blocks
from skymesh_replica.engine.profiles import get_profile
from skymesh_replica.engine.sglang import (
    CLIP_MAX_NEW_TOKENS,
    DECODE_LOG_INTERVAL,
    LPM_MAX_QUEUE,
    RETRACT_DECODE_STEPS,
    SGLangParams,
    SGLangScheduler,
)

L4 = get_profile("llama3.1-8b-l4")


def profile(blocks: int, chunk: int = 4096) -> object:
    return dataclasses.replace(L4, num_kv_blocks=blocks, max_num_batched_tokens=chunk,
                               max_num_seqs=8)


def engine(blocks: int, chunk: int = 4096) -> Engine:
    return Engine(profile(blocks, chunk), scheduler="sglang")  # type: ignore[arg-type]


def sgl(e: Engine) -> SGLangScheduler:
    assert e._sgl is not None
    return e._sgl


def seq(rid: str, prompt: int, out: int, max_new: int = 0, prefix: list[int] | None = None,
        salt: int = 0) -> Sequence:
    rng = random.Random(f"{rid}/{salt}")
    toks = (prefix or []) + [rng.randrange(50_000) for _ in range(prompt - len(prefix or []))]
    full = toks + [rng.randrange(50_000) for _ in range(out)]
    return Sequence(rid, prompt, out, hash_token_blocks(full, BLOCK_SIZE), max_new_tokens=max_new)


def step(e: Engine, max_steps: int = 1) -> list[str]:
    batch = e.schedule(max_steps)
    assert batch is not None
    e.complete(batch)
    return [s.request_id for s, _ in batch.entries]


def drain(e: Engine, max_steps: int = 1) -> dict[str, tuple[float, float]]:
    t = 0.0
    out: dict[str, tuple[float, float]] = {}
    first: dict[str, float] = {}
    while e.has_work:
        batch = e.schedule(max_steps)
        assert batch is not None, "engine has work but scheduled nothing"
        if batch.prefill_tokens:
            assert batch.decode_seqs == 0, "SGLang runs prefill and decode apart"
        t += batch.duration
        for ev in e.complete(batch):
            if ev.first_token:
                first[ev.seq.request_id] = t
            if ev.finished:
                out[ev.seq.request_id] = (first[ev.seq.request_id], t)
        e.kv.check_invariants()
    return out


# -- intake ----------------------------------------------------------------------------------
def test_unknown_scheduler_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown scheduler"):
        Engine(L4, scheduler="trt")


def test_max_new_tokens_defaults_to_the_context_left_and_bounds_the_output() -> None:
    e = Engine(L4)
    s = seq("a", 100, 10)
    e.add(s)
    assert s.max_new_tokens == L4.max_model_len - 100
    with pytest.raises(ValueError, match="max_new_tokens"):
        e.add(seq("b", 100, 50, max_new=20))


# -- admission -------------------------------------------------------------------------------
@pytest.mark.parametrize(("b_max_new", "admitted"), [(200, True), (560, True), (600, False)])
def test_a_request_is_admitted_only_if_prompt_and_reserve_fit(b_max_new: int,
                                                              admitted: bool) -> None:
    # 100 blocks = 1600 tokens. A (160-token prompt, max_new 1000) runs; it reserves
    # 0.7 x 999 = 699.3 tokens; 90 blocks = 1440 tokens are free, so B (160 + max_new)
    # fits iff 160 + max_new < 1440 - 699.3 (one decode step decays the ratio a little).
    e = engine(100)
    e.add(seq("a", 160, 500, max_new=1000))
    assert step(e) == ["a"]
    assert step(e) == ["a"]  # one decode step: ratio decays once
    ratio = sgl(e).new_token_ratio
    free = e.kv.num_free * BLOCK_SIZE
    reserve = ratio * min(1000 - 2, CLIP_MAX_NEW_TOKENS)
    assert (160 + b_max_new < free - reserve) is admitted
    e.add(seq("b", 160, 10, max_new=b_max_new))
    assert (step(e) == ["b"]) is admitted
    assert sgl(e).batch_is_full is not admitted


def test_the_latch_holds_until_a_running_request_leaves() -> None:
    e = engine(100)
    e.add(seq("a", 160, 500, max_new=1000))
    step(e)
    e.add(seq("big", 160, 10, max_new=900))
    assert step(e) == ["a"]  # big does not fit the reserve: latched, decode runs
    assert sgl(e).batch_is_full
    e.add(seq("tiny", 16, 2, max_new=4))  # would fit, but the latch skips prefill
    for _ in range(5):
        assert step(e) == ["a"]
    assert e.get("tiny").status is Status.WAITING  # type: ignore[union-attr]
    e.abort("a")
    assert step(e) == ["big", "tiny"]  # the running batch emptied: the latch is off


def test_prefill_batches_hold_no_decodes_and_at_most_the_chunk_budget() -> None:
    e = engine(400, chunk=256)
    e.add(seq("a", 100, 50, max_new=64))
    step(e)
    e.add(seq("long", 600, 4, max_new=8))
    e.add(seq("short", 40, 4, max_new=8))
    batch = e.schedule()
    assert batch is not None
    assert batch.decode_seqs == 0 and batch.prefill_tokens <= 256
    # "long" is split: its first chunk fills the budget, the rest continues first.
    assert [(s.request_id, n) for s, n in batch.entries] == [("long", 256)]
    e.complete(batch)
    assert [(s.request_id, n) for s, n in _batch(e)] == [("long", 256)]
    assert [(s.request_id, n) for s, n in _batch(e)] == [("long", 88), ("short", 40)]


def _batch(e: Engine) -> list[tuple[Sequence, int]]:
    batch = e.schedule()
    assert batch is not None
    e.complete(batch)
    return batch.entries


# -- new_token_ratio -------------------------------------------------------------------------
def test_ratio_decays_per_decode_step_to_its_floor_and_resets_when_idle() -> None:
    e = engine(2000)
    s = sgl(e)
    assert s.new_token_ratio == pytest.approx(0.7)
    e.add(seq("a", 32, 700, max_new=700))
    step(e)  # prefill
    for _ in range(10):
        step(e)
    assert s.new_token_ratio == pytest.approx(0.7 - 10 * (0.7 - 0.098) / 600)
    while e.has_work:
        step(e, max_steps=64)
    assert s.new_token_ratio == pytest.approx(0.098)  # 699 decode steps > 600
    assert e.schedule() is None
    assert s.new_token_ratio == pytest.approx(0.7)


# -- retraction ------------------------------------------------------------------------------
@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000))
def test_retraction_takes_the_fewest_outputs_first_and_resets_the_ratio(seed: int) -> None:
    rng = random.Random(seed)
    e = engine(60)
    s = sgl(e)
    for i in range(12):
        e.add(seq(f"r{i}", rng.randrange(20, 60), rng.randrange(150, 250), max_new=256))
    seen_retraction = False
    while e.has_work:
        # Over-admit (no reserve for running requests, no latch), so decoding runs out.
        s.new_token_ratio = 0.0
        s.batch_is_full = False
        before = {q.request_id: (q.num_output, q.prompt_len) for q in e.running
                  if q is not s.chunked}
        n0 = s.num_retractions
        batch = e.schedule()
        assert batch is not None
        if s.num_retractions > n0:
            seen_retraction = True
            gone = [r for r in before if e.get(r).status is Status.WAITING]  # type: ignore[union-attr]
            kept = [r for r in before if r not in gone]
            assert gone and kept
            key = {r: (before[r][0], -before[r][1]) for r in before}
            assert max(key[r] for r in gone) <= min(key[r] for r in kept)
            decoded = sum(before[r][0] for r in kept)
            assert s.new_token_ratio == pytest.approx(
                min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept)) / (256 * len(kept))))
            # To the back of the queue, as SGLang's waiting_queue.extend.
            assert {q.request_id for q in list(e.waiting)[-len(gone):]} == set(gone)
        e.complete(batch)
        e.kv.check_invariants()
    assert seen_retraction


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(14, 60), st.sampled_from(["lpm", "fcfs"]))
def test_every_request_gets_exactly_its_tokens(seed: int, blocks: int, policy: str) -> None:
    rng = random.Random(seed)
    e = engine(blocks, chunk=64)
    e._sgl = SGLangScheduler(e, SGLangParams(schedule_policy=policy))
    shared = [7] * 48
    want = {}
    for i in range(rng.randrange(1, 12)):
        out = rng.randrange(1, 60)
        s = seq(f"r{i}", rng.randrange(50, 150), out, max_new=out + rng.randrange(0, 40),
                prefix=shared if rng.random() < 0.5 else None)
        want[s.request_id] = s
        e.add(s)
    done = drain(e)
    assert set(done) == set(want)
    assert all(s.num_output == s.output_len for s in want.values())
    assert e.kv.num_free == e.kv.num_blocks


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000))
def test_fast_forward_changes_no_timing(seed: int) -> None:
    def run(max_steps: int) -> dict[str, tuple[float, float]]:
        rng = random.Random(seed)
        e = engine(120, chunk=128)
        for i in range(8):
            out = rng.randrange(5, 120)
            e.add(seq(f"r{i}", rng.randrange(30, 200), out, max_new=out + 16))
        return drain(e, max_steps)

    one, many = run(1), run(256)
    assert one.keys() == many.keys()
    for rid, (ttft, end) in one.items():
        assert many[rid][0] == pytest.approx(ttft) and many[rid][1] == pytest.approx(end)


# -- queue order -----------------------------------------------------------------------------
def _warm(e: Engine, prefix: list[int]) -> None:
    e.add(seq("warm", len(prefix) + 16, 1, max_new=1, prefix=prefix))
    while e.has_work:
        step(e)


@pytest.mark.parametrize(("policy", "fillers", "first"), [
    ("lpm", 0, "hit"),  # the longest cached prefix goes first
    ("fcfs", 0, "cold"),
    ("lpm", LPM_MAX_QUEUE, "cold"),  # more than 128 waiting: the queue order stands
])
def test_waiting_queue_order(policy: str, fillers: int, first: str) -> None:
    e = engine(4000, chunk=64)
    e._sgl = SGLangScheduler(e, SGLangParams(schedule_policy=policy))
    prefix = [3] * 64
    _warm(e, prefix)
    e.add(seq("cold", 80, 4, max_new=4))
    e.add(seq("hit", 80, 4, max_new=4, prefix=prefix))
    for i in range(fillers):
        e.add(seq(f"f{i}", 80, 4, max_new=4))
    assert step(e)[0] == first


def test_a_request_sharing_a_queued_prompt_goes_behind_the_rest() -> None:
    e = engine(4000, chunk=4096)
    twin = [9] * 64
    e.add(seq("t1", 80, 4, max_new=4, prefix=twin))
    e.add(seq("t2", 80, 4, max_new=4, prefix=twin))
    e.add(seq("other", 80, 4, max_new=4))
    assert step(e) == ["t1", "other", "t2"]


# -- the published queue gauge ---------------------------------------------------------------
def test_queue_gauge_is_a_snapshot_taken_at_log_points() -> None:
    e = engine(100)
    e.add(seq("a", 160, 300, max_new=1000))
    step(e)  # prefill: a log point, nothing left waiting
    assert (e.published_waiting, e.published_running) == (0, 0)
    e.add(seq("big", 160, 10, max_new=900))
    step(e)  # latched: "big" waits, and decoding is not a log point before step 40
    assert e.num_waiting == 1 and e.published_waiting == 0
    s = sgl(e)
    while s.forward_ct_decode % DECODE_LOG_INTERVAL != DECODE_LOG_INTERVAL - 1:
        step(e)
        assert e.published_waiting == 0
    e.add(seq("late", 16, 2, max_new=4))
    step(e)  # the 40th decode step logs the queue it started with
    assert s.forward_ct_decode % DECODE_LOG_INTERVAL == 0
    assert e.published_waiting == 2 and e.published_running == 1


def test_fast_forward_stops_at_a_log_point_that_changes_the_gauge() -> None:
    e = engine(100)
    e.add(seq("a", 160, 300, max_new=1000))
    step(e)
    e.add(seq("big", 160, 10, max_new=900))
    batch = e.schedule(max_steps=1000)
    assert batch is not None and batch.num_steps == DECODE_LOG_INTERVAL
    e.complete(batch)
    assert e.published_waiting == 1


def test_vllm_mode_publishes_live_counts() -> None:
    e = Engine(L4)
    e.add(seq("a", 100, 5))
    assert e.published_waiting == 1 == e.num_waiting
