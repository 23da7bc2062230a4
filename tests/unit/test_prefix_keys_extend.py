"""A request's text is hashed once: the keys of prompt + reply continue the prompt's."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.prefix.keys import (
    CHUNK_CHARS,
    MAX_KEYS,
    cached_keys,
    extend_prefix_keys,
    text_prefix_keys,
)

text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
               max_size=700)


@settings(max_examples=150, deadline=None)
@given(text, text, st.sampled_from([1, 2, 7, 64]), st.sampled_from([0, 3, 40, MAX_KEYS]))
def test_extending_a_prefix_gives_the_keys_of_the_whole(
        prompt: str, reply: str, chunk: int, cap: int) -> None:
    whole = prompt + reply
    expected = text_prefix_keys(whole, chunk, cap)
    assert extend_prefix_keys(whole, text_prefix_keys(prompt, chunk, cap), chunk, cap) \
        == expected


def test_cached_keys_reuse_the_prompts_keys_and_only_when_they_are_the_prompts() -> None:
    prompt = "system: be brief. " * 40
    reply = "an answer that goes on for a while. " * 10
    keys = text_prefix_keys(prompt)
    assert cached_keys(prompt + reply, prompt, keys) == text_prefix_keys(prompt + reply)
    # A policy that reads no keys leaves the route none: the whole text is hashed.
    assert cached_keys(prompt + reply, prompt, ()) == text_prefix_keys(prompt + reply)
    assert len(keys) == len(prompt) // CHUNK_CHARS


@settings(max_examples=100, deadline=None)
@given(text, st.sampled_from([1, 2, 7, 64]))
def test_short_texts_key_as_the_vectorised_path_does(s: str, chunk: int) -> None:
    """A few chunks are hashed with plain integers (numpy's fixed cost dominates there):
    the same keys as the vectorised path, which is the one before it."""
    from skymesh.prefix import keys as k

    fast = text_prefix_keys(s, chunk)
    small = k._SMALL
    k._SMALL = -1
    try:
        assert text_prefix_keys(s, chunk) == fast
    finally:
        k._SMALL = small


def _plain_keys(s: str, chunk: int, cap: int = MAX_KEYS) -> list[int]:
    """The keys as the module docstring defines them, one chunk at a time in plain
    integers: each chunk's code points (two to a 64-bit word when the chunk size is
    even) weighted and finalised, chained as h_i = h_(i-1) * P + c_i, finalised."""
    import struct

    from skymesh.prefix import keys as k

    m64 = (1 << 64) - 1
    out: list[int] = []
    h = 0
    for i in range(min(len(s) // chunk, cap)):
        data = s[i * chunk:(i + 1) * chunk].encode("utf-32-le", "surrogatepass")
        words = (struct.unpack(f"<{chunk // 2}Q", data) if chunk % 2 == 0
                 else struct.unpack(f"<{chunk}I", data))
        weights = [k._splitmix64(k._SEED + j) | 1 for j in range(len(words))]
        c = sum(w * x for w, x in zip(weights, words, strict=True)) & m64
        h = (h * k._P + k._splitmix_out(c)) & m64
        out.append(k._splitmix_out(h))
    return out


@settings(max_examples=100, deadline=None)
@given(text, text, st.sampled_from([1, 2, 7, 64]))
def test_keys_match_a_plain_chunk_by_chunk_hash(prompt: str, reply: str, chunk: int) -> None:
    """Differential: the vectorised path, the small path and the extension from the
    remembered chained sum (``_chained``) all give the keys of the plain definition."""
    from skymesh.prefix import keys as k

    whole = prompt + reply
    expected = _plain_keys(whole, chunk)
    assert text_prefix_keys(whole, chunk) == expected
    head = text_prefix_keys(prompt, chunk)  # remembers its last chained sum
    assert extend_prefix_keys(whole, head, chunk) == expected
    k._chained.clear()  # the same extension by inverting the finaliser
    assert extend_prefix_keys(whole, head, chunk) == expected


def test_the_remembered_chained_sums_stay_bounded() -> None:
    from skymesh.prefix import keys as k

    k._chained.clear()
    for i in range(k._CHAINED_MAX + 50):
        text_prefix_keys(f"{i:08d}" * 8)  # one 64-character chunk each
    assert 0 < len(k._chained) <= k._CHAINED_MAX


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["", "x", "é" * 70, "shared system prompt " * 20,
                                 "\ud800" * 65, "q" * 63]), min_size=1, max_size=4),
       st.lists(text, min_size=1, max_size=3))
def test_prompt_keys_are_the_text_keys_however_often_a_prompt_repeats(
        heads: list[str], tails: list[str]) -> None:
    """``prompt_keys`` (the request path's, remembered by keyed text) gives
    ``text_prefix_keys`` for prompts that share their keyed text or only part of it."""
    from skymesh.prefix import keys as k

    for _ in range(2):
        for tail in tails:
            prompt = "".join(heads) + tail
            assert k.prompt_keys(prompt) == tuple(text_prefix_keys(prompt))
    assert len(k._prompts) <= k._PROMPTS_MAX


def test_prompt_keys_remember_a_bounded_number_of_prompts() -> None:
    from skymesh.prefix import keys as k

    for i in range(3 * k._PROMPTS_MAX):
        prompt = f"{i:064d}" + "tail"
        assert k.prompt_keys(prompt) == tuple(text_prefix_keys(prompt))
        assert len(k._prompts) <= k._PROMPTS_MAX
    again = f"{0:064d}" + "another tail"  # the same keyed text: the same tuple
    assert k.prompt_keys(again) is k.prompt_keys(f"{0:064d}")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["", "x", "é" * 70, "shared system prompt " * 20,
                                 "\ud800" * 65, "q" * 63, "y" * 64]), min_size=1, max_size=4),
       st.lists(text, min_size=1, max_size=4))
def test_a_new_prompt_continues_the_keys_of_a_recent_one_it_shares_chunks_with(
        heads: list[str], tails: list[str]) -> None:
    """A prompt whose keyed text is new but whose leading chunks a recent prompt had
    (``_heads``: the same system prompt, a question of its own) hashes only the rest:
    its keys are still those of the plain definition, whatever came before."""
    from skymesh.prefix import keys as k

    for tail in tails:
        prompt = "".join(heads) + tail
        assert k.prompt_keys(prompt) == tuple(_plain_keys(prompt, CHUNK_CHARS))
    assert len(k._heads) <= k._PROMPTS_MAX


def test_a_question_after_a_shared_system_prompt_hashes_only_its_own_chunks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from skymesh.prefix import keys as k

    system = "You are a helpful assistant. Context: " + "w1234 " * 320  # ~30 chunks
    k.prompt_keys(system + "question 0-1 " * 10)
    hashed: list[int] = []
    chain = k._chain

    def counting(text: str, m: int, n: int, *rest: Any) -> tuple[list[int], list[int]]:
        hashed.append(n - m)
        return chain(text, m, n, *rest)

    monkeypatch.setattr(k, "_chain", counting)
    prompt = system + "question 1-2 " * 10
    keys = k.prompt_keys(prompt)
    assert keys == tuple(_plain_keys(prompt, CHUNK_CHARS))
    shared = len(system) // CHUNK_CHARS
    assert hashed == [len(prompt) // CHUNK_CHARS - shared]


def test_the_prompts_remembered_by_first_chunk_stay_bounded() -> None:
    from skymesh.prefix import keys as k

    for i in range(3 * k._PROMPTS_MAX):
        prompt = f"{i:064d}" * 2 + "tail"
        assert k.prompt_keys(prompt) == tuple(text_prefix_keys(prompt))
        assert len(k._heads) <= k._PROMPTS_MAX


@settings(max_examples=150, deadline=None)
@given(text, text, st.sampled_from([0, 1, 5, 64, 100]))
def test_reply_keys_are_the_keys_of_the_joined_text(prompt: str, reply: str,
                                                    repeat: int) -> None:
    """The relay keys prompt + reply without joining them: the same keys as hashing the
    joined text, with the prompt's keys as the daemon has them (``prompt_keys``' tuple),
    none (a policy that reads none), or too few."""
    from skymesh.prefix.keys import prompt_keys, reply_keys

    prompt = prompt * repeat  # up to past MAX_KEYS chunks
    whole = text_prefix_keys(prompt + reply)
    assert list(reply_keys(prompt, prompt_keys(prompt), reply)) == whole
    assert list(reply_keys(prompt, (), reply)) == whole
    assert list(reply_keys(prompt, prompt_keys(prompt)[:-1], reply)) == whole


def test_a_reply_that_completes_no_chunk_gives_back_the_prompts_keys() -> None:
    from skymesh.prefix.keys import prompt_keys, reply_keys

    prompt = "x" * (3 * CHUNK_CHARS + 10)
    keys = prompt_keys(prompt)
    assert reply_keys(prompt, keys, "ok") is keys  # no copy on the common short reply
    longer = reply_keys(prompt, keys, "y" * CHUNK_CHARS)
    assert list(longer[:3]) == list(keys) and len(longer) == 4
