"""The exact prefix index fed by KV-cache events, and the event wire's pure parts."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.prefix.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedBatch,
    SeqTracker,
    Verdict,
    apply_events,
    decode_batch,
    encode_batch,
)
from skymesh.prefix.kv_index import ReplicaBlockIndex, block_keys, longest_prefix, lost_first

BS = 4


def tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def store_chain(idx: ReplicaBlockIndex, toks: list[int], hashes: list[int],
                parent: int | None = None, start_block: int = 0) -> None:
    lo = start_block * BS
    idx.stored(hashes, parent, toks[lo : lo + len(hashes) * BS], BS)


# -- index ---------------------------------------------------------------------------
def test_longest_run_of_leading_blocks() -> None:
    idx = ReplicaBlockIndex()
    toks = tokens(20)  # 5 full blocks
    store_chain(idx, toks, [101, 102, 103])
    assert idx.match_tokens(toks) == 3
    assert idx.match_tokens(toks[:11]) == 2  # only full blocks count
    other = [999, *toks[1:]]
    assert idx.match_tokens(other) == 0  # first block differs: nothing is shared


def test_store_with_parent_continues_the_chain() -> None:
    idx = ReplicaBlockIndex()
    toks = tokens(16)
    store_chain(idx, toks, [1, 2])
    store_chain(idx, toks, [3, 4], parent=2, start_block=2)
    assert idx.match_tokens(toks) == 4


def test_unknown_parent_is_skipped_not_guessed() -> None:
    idx = ReplicaBlockIndex()
    toks = tokens(16)
    store_chain(idx, toks, [3, 4], parent=77, start_block=2)
    assert len(idx) == 0 and idx.orphans == 2
    assert idx.match_tokens(toks) == 0


def test_removed_block_cuts_the_run() -> None:
    idx = ReplicaBlockIndex()
    toks = tokens(16)
    store_chain(idx, toks, [1, 2, 3, 4])
    idx.removed([3])
    assert idx.match_tokens(toks) == 2
    idx.removed([1, 12345])  # unknown hashes are ignored
    assert idx.match_tokens(toks) == 0
    assert len(idx) == 2


def test_clear_forgets_everything() -> None:
    idx = ReplicaBlockIndex()
    toks = tokens(8)
    store_chain(idx, toks, [1, 2])
    idx.clear()
    assert len(idx) == 0 and idx.match_tokens(toks) == 0


def test_cap_evicts_least_recently_stored() -> None:
    idx = ReplicaBlockIndex(max_blocks=3)
    a, b = tokens(8), tokens(8, base=100)
    store_chain(idx, a, [1, 2])
    store_chain(idx, b, [11, 12])  # 4 blocks > cap 3: block 1 (a's head) goes
    assert len(idx) == 3 and idx.evicted == 1
    assert idx.match_tokens(a) == 0
    assert idx.match_tokens(b) == 2


def test_two_engine_blocks_with_one_key_are_counted() -> None:
    idx = ReplicaBlockIndex()
    toks = tokens(4)
    idx.stored([1], None, toks, BS)
    idx.stored([2], None, toks, BS)  # same tokens under another engine hash (a salt)
    idx.removed([1])
    assert idx.match_tokens(toks) == 1
    idx.removed([2])
    assert idx.match_tokens(toks) == 0


def test_lora_name_separates_keys() -> None:
    idx = ReplicaBlockIndex()
    toks = tokens(4)
    idx.stored([1], None, toks, BS, "adapter")
    assert idx.match_tokens(toks) == 0
    assert idx.match_tokens(toks, "adapter") == 1


def test_malformed_store_is_ignored() -> None:
    idx = ReplicaBlockIndex()
    idx.stored([1, 2], None, tokens(5), BS)  # fewer tokens than two blocks
    idx.stored([1], None, tokens(4), 0)
    assert len(idx) == 0 and idx.orphans == 3


def test_block_size_change_starts_over() -> None:
    idx = ReplicaBlockIndex()
    idx.stored([1], None, tokens(4), BS)
    idx.stored([2], None, tokens(8), 8)
    assert len(idx) == 1 and idx.block_size == 8


def test_longest_prefix_per_replica() -> None:
    a, b, empty = ReplicaBlockIndex(), ReplicaBlockIndex(), ReplicaBlockIndex()
    toks = tokens(16)
    store_chain(a, toks, [1, 2, 3])
    store_chain(b, toks, [7])
    assert longest_prefix({"a": a, "b": b, "c": empty}, toks) == {"a": 3, "b": 1, "c": 0}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]),
                          st.integers(0, 5), st.integers(1, 4)), max_size=40))
def test_index_matches_a_model_of_the_engine(ops: list[tuple[str, int, int]]) -> None:
    """Stores and removals of chains from a few fixed prompts: the index agrees with a
    plain set of (prompt, block) the engine holds, and never exceeds its cap."""
    prompts = [tokens(16, base=1000 * p) for p in range(6)]
    # Prompts 0-2 share their first block (same tokens): engine hashes differ per prompt
    # (the engine hashes by content too, so use one hash per distinct content).
    for p in (1, 2):
        prompts[p][:BS] = prompts[0][:BS]

    def ehash(p: int, j: int) -> int:
        return 0 if j == 0 and p in (0, 1, 2) else p * 100 + j + 1

    idx = ReplicaBlockIndex(max_blocks=1000)
    held: set[int] = set()
    for op, p, n in ops:
        if op == "store":
            # Stores come as chains from the first block the engine did not hold yet.
            start = 0
            while start < n and ehash(p, start) in held:
                start += 1
            if start == n:
                continue
            hs = [ehash(p, j) for j in range(start, n)]
            parent = ehash(p, start - 1) if start else None
            idx.stored(hs, parent, prompts[p][start * BS : n * BS], BS)
            held.update(hs)
        elif op == "remove":
            # The engine evicts tail blocks first (a block whose children are gone).
            victims = {ehash(p, j) for j in range(n, 4)} & held
            idx.removed(sorted(victims))
            held -= victims
        else:
            idx.clear()
            held.clear()
    for p in range(6):
        expect = 0
        while expect < 4 and ehash(p, expect) in held:
            expect += 1
        assert idx.match_tokens(prompts[p]) == expect


def test_block_keys_are_the_index_keys() -> None:
    idx = ReplicaBlockIndex()
    toks = tokens(12)
    store_chain(idx, toks, [1, 2, 3])
    keys = block_keys(toks, BS)
    assert len(keys) == 3 and all(idx.has_key(k) for k in keys)
    assert block_keys(toks, BS, limit=2) == keys[:2]


# -- wire ------------------------------------------------------------------------------
def test_batch_round_trip_in_vllm_map_form() -> None:
    payload = encode_batch(1.5, [BlockStored([b"h" * 32], None, tokens(4), 4, None, "GPU",
                                             None), BlockRemoved([7]), AllBlocksCleared()])
    raw = msgspec.msgpack.decode(payload)
    # vLLM 0.32: the batch is an array, events are maps tagged by "type".
    assert raw[0] == 1.5 and raw[1][0]["type"] == "BlockStored"
    assert set(raw[1][0]) >= {"block_hashes", "parent_block_hash", "token_ids", "block_size",
                              "lora_id", "medium", "lora_name"}
    events, skipped = decode_batch(payload)
    assert skipped == 0
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved",
                                                 "AllBlocksCleared"]


def test_array_form_unknown_tags_and_fields_are_tolerated() -> None:
    payload = msgspec.msgpack.encode([
        2.0,
        [
            # SGLang / older vLLM: arrays, tag first, possibly extra trailing fields
            ["BlockStored", [1, 2], None, tokens(8), 4, None, "GPU", None, "extra"],
            ["BlockRemoved", [1]],
            {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": 2,
             "token_ids": tokens(4), "block_size": 4, "future_field": [1, 2]},
            {"type": "SomethingNew", "x": 1},
            ["AllBlocksCleared"],
        ],
    ])
    events, skipped = decode_batch(payload)
    assert skipped == 1
    idx = ReplicaBlockIndex()
    apply_events(idx, events[:1])
    assert idx.match_tokens(tokens(8)) == 2
    apply_events(idx, events[1:2])
    assert idx.match_tokens(tokens(8)) == 0
    apply_events(idx, events[2:])
    assert len(idx) == 0  # AllBlocksCleared last


def test_garbage_payload_is_malformed() -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(b"\xc1not msgpack")
    with pytest.raises(MalformedBatch):
        decode_batch(msgspec.msgpack.encode({"ts": 1}))


# -- sequence numbers ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("applied", "live_last", "seq", "verdict"),
    [
        (None, None, 0, Verdict.FIRST),
        (None, None, 9, Verdict.FIRST),
        (4, 4, 5, Verdict.APPLY),
        (4, 4, 7, Verdict.GAP),
        (4, 4, 4, Verdict.RESTART),
        (4, 4, 0, Verdict.RESTART),
        (9, 4, 5, Verdict.SKIP),  # already replayed beyond the live stream
    ],
)
def test_live_verdicts(applied: int | None, live_last: int | None, seq: int,
                       verdict: Verdict) -> None:
    t = SeqTracker(live_last=live_last, applied=applied)
    assert t.on_live(seq) is verdict
    assert t.live_last == seq
    if verdict is Verdict.RESTART:
        assert t.applied is None


def test_replayed_verdicts() -> None:
    t = SeqTracker(applied=4)
    assert t.on_replayed(3) is Verdict.SKIP
    assert t.on_replayed(5) is Verdict.APPLY
    assert t.on_replayed(8) is Verdict.GAP  # the buffer no longer reaches back
    assert SeqTracker().on_replayed(8) is Verdict.APPLY


def test_blocks_with_extra_keys_never_match_plain_tokens() -> None:
    idx = ReplicaBlockIndex()
    toks = tokens(12)
    # Block 1 holds image placeholders: the same token ids as a text prompt could have.
    idx.stored([1, 2, 3], None, toks, BS, None, [None, ("mm", "img-hash", 0), None])
    assert idx.match_tokens(toks) == 1
    assert len(idx) == 3


def test_sliding_window_groups_are_skipped() -> None:
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": tokens(4), "block_size": 4, "kv_cache_spec_kind": "sliding_window",
         "group_idx": 1},
        {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": None,
         "token_ids": tokens(4), "block_size": 4, "kv_cache_spec_kind": "full_attention",
         "group_idx": 0},
    ]])
    idx = ReplicaBlockIndex()
    apply_events(idx, decode_batch(payload)[0])
    assert len(idx) == 1 and idx.match_tokens(tokens(4)) == 1


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_kv_events"


def test_batches_encoded_by_vllm_itself() -> None:
    """Payloads made by vLLM 0.32's own KVEventBatch and encoder (tests/fixtures/
    vllm_kv_events/README.json says how): stores with a parent, a removal, a clear."""
    meta = json.loads((FIXTURES / "README.json").read_text())
    toks = meta["token_ids"]
    idx = ReplicaBlockIndex()
    events, skipped = decode_batch((FIXTURES / "stored_removed.msgpack").read_bytes())
    assert skipped == 0 and len(events) == 3
    apply_events(idx, events[:2])
    assert idx.block_size == 16 and idx.match_tokens(toks) == 3
    apply_events(idx, events[2:])
    assert idx.match_tokens(toks) == 2
    events, _ = decode_batch((FIXTURES / "cleared.msgpack").read_bytes())
    apply_events(idx, events)
    assert len(idx) == 0


# -- lost prompts ----------------------------------------------------------------------
def test_a_removed_or_cleared_leading_block_is_lost_until_stored_again() -> None:
    idx = ReplicaBlockIndex()
    doc, other = tokens(12), tokens(8, base=500)
    store_chain(idx, doc, [1, 2, 3])
    store_chain(idx, other, [7, 8])
    first = block_keys(doc, BS, limit=1)[0]
    assert not idx.lost(first)
    assert lost_first({"a": idx}, doc) == set()
    idx.removed([3])  # a tail block: the prompt's head is still held
    assert not idx.lost(first)
    idx.removed([1])
    assert idx.lost(first)
    assert lost_first({"a": idx}, doc + tokens(4, base=900)) == {"a"}
    assert lost_first({"a": idx}, other) == set()
    store_chain(idx, doc, [11, 12])  # stored again (new engine hashes)
    assert not idx.lost(first)
    idx.clear()  # AllBlocksCleared, a restart, a gap the replay buffer lost
    assert idx.lost(first)
    assert lost_first({"a": idx}, other) == {"a"}


def test_the_indexs_own_cap_marks_nothing_lost() -> None:
    idx = ReplicaBlockIndex(max_blocks=2)
    doc = tokens(12)
    store_chain(idx, doc, [1, 2, 3])  # block 1 forgotten by the cap, not by the engine
    assert idx.evicted == 1
    assert lost_first({"a": idx}, doc) == set()


def test_lost_leading_blocks_are_bounded() -> None:
    idx = ReplicaBlockIndex(max_blocks=3)
    for i in range(10):
        store_chain(idx, tokens(4, base=100 * i), [i])
        idx.removed([i])
    assert len(idx._lost) == 3
    assert idx.lost(block_keys(tokens(4, base=900), BS)[0])
    assert not idx.lost(block_keys(tokens(4, base=0), BS)[0])
