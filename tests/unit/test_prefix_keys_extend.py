"""A request's text is hashed once: the keys of prompt + reply continue the prompt's."""

from __future__ import annotations

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
