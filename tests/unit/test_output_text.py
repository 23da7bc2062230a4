"""Reading a reply's text back from the bytes the balancer relayed (skymesh.balancer.
output_text): what the prefix policies record as cached after a request."""

from __future__ import annotations

import json
from typing import Any

from skymesh.balancer.output_text import (
    OutputCapture,
    cached_text,
    parse_json,
    reply_text,
    sse_output_text,
)
from skymesh.prefix.keys import KEYED_CHARS, text_prefix_keys
from skymesh.prefix.prompt import render_chat


def sse(*events: Any) -> bytes:
    out = b""
    for ev in events:
        out += b"data: " + (ev if isinstance(ev, bytes) else json.dumps(ev).encode()) + b"\n\n"
    return out


def delta(text: str | None, role: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if role:
        d["role"] = role
    if text is not None:
        d["content"] = text
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d}]}


def test_chat_stream_text_skips_role_usage_and_done_and_decodes_escapes() -> None:
    raw = sse(delta(None, role="assistant"), delta("Hel"), delta("lo, "), delta("wörld"),
              delta(' "quoted" \\ \n\u00e9 "content": "x"'),
              {"choices": [], "usage": {"total_tokens": 9}}, b"[DONE]")
    assert sse_output_text(raw, "chat") == 'Hello, wörld "quoted" \\ \n\u00e9 "content": "x"'
    # Spaces after the colons (Python's json.dumps default) read the same.
    spaced = b'data: {"choices": [{"index": 0, "delta": {"content": "a b"}}]}\n\n'
    assert sse_output_text(spaced, "chat") == "a b"


def test_completion_stream_and_json_bodies() -> None:
    raw = sse({"choices": [{"index": 0, "text": "4"}]}, {"choices": [{"index": 0, "text": "2"}]},
              b"[DONE]")
    assert sse_output_text(raw, "completion") == "42"
    body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant",
                                                            "content": "Hi there"}}]})
    assert reply_text(parse_json(body.encode()), "chat") == "Hi there"
    assert reply_text(parse_json(b'{"choices": [{"index": 0, "text": "x"}]}'), "completion") \
        == "x"
    assert reply_text(parse_json(b"not json"), "chat") == ""
    assert reply_text(parse_json(b'{"error": {"message": "no"}}'), "chat") == ""


def test_a_cut_or_broken_event_ends_the_text_there() -> None:
    whole = sse(delta("one "), delta("two "), delta("three"))
    # The capture budget cut the stream inside the third event.
    assert sse_output_text(whole[: len(whole) - 12], "chat") == "one two "
    broken = sse(delta("one "), b'{"choices": [{"index": 0, "delta": {"content": "t',
                 delta("three"))
    assert sse_output_text(broken, "chat") == "one "  # never skip a gap: prefix only


def test_events_split_across_chunks_join_back() -> None:
    raw = sse(delta("abc"), delta("def"))
    cap = OutputCapture(1 << 20)
    for i in range(0, len(raw), 7):
        cap.add(raw[i:i + 7])
    assert sse_output_text(cap.raw(), "chat") == "abcdef"


def test_capture_budget_bounds_memory_and_prompt_fills_the_keys() -> None:
    cap = OutputCapture(100)
    for _ in range(50):
        cap.add(b"x" * 40)
    assert len(cap.raw()) == 120  # stops at the first chunk past the budget
    assert OutputCapture.for_request("p" * KEYED_CHARS, {}) is None  # reply adds no key
    small = OutputCapture.for_request("p" * 100, {"n": 1})
    assert small is not None and small.left > 0
    # Several replies interleave in one stream, and echo repeats the prompt: not captured.
    for body in ({"n": 2}, {"best_of": 3}, {"echo": True}):
        assert OutputCapture.for_request("p" * 100, body) is None


def test_prompt_plus_reply_is_the_next_turns_prefix() -> None:
    """The keys recorded after a turn are a prefix of the next turn's keys: what makes the
    next turn match its replica (the reply is long, so the old prompt alone is not)."""
    msgs = [{"role": "user", "content": "Tell me about the sea. " * 4}]
    reply = "The sea is large and deep. " * 40
    recorded = cached_text(render_chat(msgs), {"messages": msgs}, reply)
    assert recorded is not None
    nxt = render_chat([*msgs, {"role": "assistant", "content": reply},
                       {"role": "user", "content": "And rivers?"}])
    rec_keys, next_keys = text_prefix_keys(recorded), text_prefix_keys(nxt)
    assert len(rec_keys) > 0.7 * len(next_keys)
    assert next_keys[: len(rec_keys)] == rec_keys
    old_keys = text_prefix_keys(render_chat(msgs))
    assert len(old_keys) < 0.5 * len(next_keys)


def test_echo_and_empty_replies_record_nothing() -> None:
    assert cached_text("p", {"echo": True}, "p and more") is None
    assert cached_text("p", {}, "") is None
    assert cached_text("p", {}, "q") == "pq"


def test_a_reply_nested_too_deeply_is_not_json_not_an_error() -> None:
    """json's C scanner recurses once per level: a replica's reply nested past the
    recursion limit (2 KB of brackets) raised RecursionError out of the request path."""
    from skymesh.balancer.forwarding import reply_usage

    deep = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b',"choices":[]}'
    assert parse_json(deep) is None
    assert reply_text(parse_json(deep), "chat") == ""
    assert reply_usage(deep) == (0, 0, None)  # usage alone: msgspec refuses, then json
