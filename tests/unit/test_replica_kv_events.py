"""The emulated engine's KV-cache events: what they say matches what the engine caches."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.prefix.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    apply_events,
    decode_batch,
    encode_batch,
)
from skymesh.prefix.kv_index import ReplicaBlockIndex
from skymesh_replica.engine.core import Engine, Sequence
from skymesh_replica.engine.hashing import BLOCK_SIZE, hash_token_blocks
from skymesh_replica.engine.profiles import get_profile
from skymesh_replica.kv_events import EventRecorder, KVEventsConfig

L4 = get_profile("llama3.1-8b-l4")


def engine_with_recorder(blocks: int) -> tuple[Engine, EventRecorder]:
    e = Engine(dataclasses.replace(L4, num_kv_blocks=blocks, max_num_seqs=8,
                                   max_num_batched_tokens=64))
    rec = EventRecorder()
    e.kv.recorder = rec
    return e, rec


def add(e: Engine, rid: str, toks: list[int], out: int) -> None:
    full = toks + [7] * out
    e.add(Sequence(rid, len(toks), out, hash_token_blocks(full, BLOCK_SIZE), token_ids=full))


def step_all(e: Engine, rec: EventRecorder, idx: ReplicaBlockIndex) -> int:
    """Run to completion, shipping each step's events through the wire into ``idx``."""
    batches = 0
    while True:
        # One flush per step, and one for a reset made while idle (the replica's
        # /reset_prefix_cache handler flushes too).
        events = rec.take()
        if events:
            batches += 1
            decoded, skipped = decode_batch(encode_batch(0.0, events))
            assert skipped == 0
            apply_events(idx, decoded)
        if not e.has_work:
            return batches
        b = e.schedule()
        assert b is not None
        e.complete(b)


def test_stores_carry_tokens_parent_and_block_size() -> None:
    e, rec = engine_with_recorder(64)
    toks = list(range(100, 140))  # 2 full blocks of prompt + 8 tokens
    add(e, "a", toks, 1)
    b = e.schedule()
    assert b is not None
    e.complete(b)
    [ev] = rec.take()
    assert isinstance(ev, BlockStored)
    hashes = hash_token_blocks([*toks, 7], BLOCK_SIZE)
    assert ev.block_hashes == hashes[:2]
    assert ev.parent_block_hash is None
    assert ev.token_ids == toks[:32] and ev.block_size == BLOCK_SIZE


def test_reset_emits_all_blocks_cleared_only() -> None:
    e, rec = engine_with_recorder(64)
    rec.removed(5)
    e.reset_prefix_cache()
    assert rec.take() == [AllBlocksCleared()]


def test_eviction_emits_block_removed() -> None:
    e, rec = engine_with_recorder(6)  # 96 token slots: the second prompt evicts the first
    idx = ReplicaBlockIndex()
    first = list(range(1000, 1064))
    add(e, "a", first, 1)
    step_all(e, rec, idx)
    assert idx.match_tokens(first) == 4
    add(e, "b", list(range(5000, 5080)), 1)
    e.schedule()
    removed = [ev for ev in rec.take() if isinstance(ev, BlockRemoved)]
    assert removed and set(removed[0].block_hashes) <= set(hash_token_blocks(first, 16))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(10, 40))
def test_index_from_events_equals_engine_cache(seed: int, blocks: int) -> None:
    """After any run, for every prompt the index says what the engine would hit: exactly,
    or less after a reset that left blocks of running requests to be stored under parents
    the subscriber was told are gone (never more)."""
    rng = random.Random(seed)
    e, rec = engine_with_recorder(blocks)
    idx = ReplicaBlockIndex()
    heads = [[rng.randrange(50_000) for _ in range(rng.choice((16, 32, 48)))]
             for _ in range(3)]
    prompts = []
    reset = False
    for i in range(rng.randrange(2, 10)):
        toks = rng.choice(heads) + [rng.randrange(50_000) for _ in range(rng.randrange(1, 40))]
        prompts.append(toks)
        try:
            add(e, f"r{i}", toks, rng.randrange(1, 20))
        except ValueError:
            continue
        if rng.random() < 0.3:
            step_all(e, rec, idx)
        if rng.random() < 0.05:
            e.reset_prefix_cache()
            reset = True
    step_all(e, rec, idx)
    for toks in prompts + heads:
        lookup = hash_token_blocks(toks, BLOCK_SIZE)
        got, want = idx.match_tokens(toks), len(e.kv.match_prefix(lookup))
        assert got <= want if reset else got == want


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "JSON object"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ('{"endpoint": "udp://x:1"}', "endpoint"),
        ('{"bogus": 1}', "unknown key 'bogus'"),
        ('{"buffer_steps": 0}', "buffer_steps"),
    ],
)
def test_config_errors_name_the_key(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(text)


def test_config_in_vllm_shape() -> None:
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", '
                               '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}')
    assert cfg.enabled and cfg.replay_endpoint == "tcp://*:5558"
    assert not KVEventsConfig.parse("{}").enabled


def test_endpoint_shorthand_puts_replay_on_the_next_port() -> None:
    from skymesh_replica.cli import build_parser, kv_events_from_endpoint

    cfg = kv_events_from_endpoint("tcp://127.0.0.1:5557")
    assert cfg.enabled and cfg.endpoint == "tcp://127.0.0.1:5557"
    assert cfg.replay_endpoint == "tcp://127.0.0.1:5558"
    for bad in ("tcp://127.0.0.1", "udp://h:1", "tcp://h:x"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            kv_events_from_endpoint(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "1", "--kv-events-config", '{"bogus": 1}'])
