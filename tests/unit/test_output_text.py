"""Reading a reply's text back from the bytes the balancer relayed (skymesh.balancer.
output_text): what the prefix policies record as cached after a request."""

from __future__ import annotations

import json
from typing import Any

import pytest

from skymesh.balancer import output_text
from skymesh.balancer.output_text import (
    OutputCapture,
    cached_text,
    parse_json,
    reply_record,
    reply_text,
    sse_output_text,
)
from skymesh.net.jsonbody import NOT_DECODED, fast_usage
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


# reply_record against the whole decode it replaces (parse_json then reply_text): bodies
# the typed decode takes and bodies it hands back to the whole decode.
CHAT = (b'{"id":"chatcmpl-stub","object":"chat.completion","created":1700000000,'
        b'"model":"stub","choices":[{"index":0,"message":{"role":"assistant",'
        b'"content":"ok"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}')
USAGE = {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}
RECORD_CASES: list[tuple[str, bytes, str, Any, str]] = [
    ("chat", CHAT, "chat", USAGE, "ok"),
    ("completion", b'{"choices":[{"index":0,"text":"4 2","logprobs":null}],"usage":{"a":1}}',
     "completion", {"a": 1}, "4 2"),
    ("chat read as completion", CHAT, "completion", USAGE, ""),
    ("n>1: choice 0 wherever it is",
     b'{"choices":[{"index":1,"message":{"content":"b"}},{"index":0,"message":'
     b'{"content":"a"}}]}', "chat", None, "a"),
    ("n>1 without choice 0", b'{"choices":[{"index":2,"text":"x"}]}', "completion", None, ""),
    ("index missing is 0", b'{"choices":[{"text":"x"}]}', "completion", None, "x"),
    ("index null", b'{"choices":[{"index":null,"text":"x"}]}', "completion", None, ""),
    ("index 0.0 equals 0", b'{"choices":[{"index":0.0,"text":"x"}]}', "completion",
     None, "x"),
    ("index false equals 0", b'{"choices":[{"index":false,"text":"y"}]}', "completion", None, "y"),
    ("index as a string", b'{"choices":[{"index":"0","text":"x"}]}', "completion", None, ""),
    ("no choices", b'{"usage":{"a":1}}', "chat", {"a": 1}, ""),
    ("choices null", b'{"choices":null}', "chat", None, ""),
    ("empty choices", b'{"choices":[]}', "chat", None, ""),
    ("no message", b'{"choices":[{"index":0}]}', "chat", None, ""),
    ("message null", b'{"choices":[{"index":0,"message":null}]}', "chat", None, ""),
    ("content null", b'{"choices":[{"index":0,"message":{"content":null}}]}', "chat", None, ""),
    ("content not a string", b'{"choices":[{"message":{"content":[1]}}]}', "chat", None, ""),
    ("text not a string", b'{"choices":[{"text":7}]}', "completion", None, ""),
    ("usage null", b'{"usage":null,"choices":[]}', "chat", None, ""),
    ("usage not an object", b'{"usage":[1,2]}', "chat", [1, 2], ""),
    ("choices an object", b'{"choices":{"index":0,"text":"x"},"usage":3}', "completion", 3, ""),
    ("a choice not an object", b'{"choices":["x",{"index":0,"text":"y"}]}', "completion",
     None, "y"),
    ("message a string", b'{"choices":[{"message":"hi"}]}', "chat", None, ""),
    ("a later choice of another shape",
     b'{"choices":[{"index":0,"text":"x"},{"index":1,"message":7}]}', "completion", None, "x"),
    ("duplicate keys: the last", b'{"usage":1,"usage":2,"choices":[{"text":"a"}],'
     b'"choices":[{"text":"b"}]}', "completion", 2, "b"),
    ("escapes and non-ASCII", '{"choices":[{"message":{"content":"w\\u00f6rld \\"q\\" '
     'é"}}]}'.encode(), "chat", None, 'wörld "q" é'),
    ("a lone surrogate (json takes it)", b'{"id":"\\ud800","choices":[{"text":"x"}]}',
     "completion", None, "x"),
    ("NaN (json takes it)", b'{"x":NaN,"choices":[{"text":"x"}]}', "completion", None, "x"),
    ("a big integer stays exact", b'{"usage":{"n":123456789012345678901234567890}}', "chat",
     {"n": 123456789012345678901234567890}, ""),
    ("a JSON list", b'[{"choices":[{"text":"x"}]}]', "completion", NOT_DECODED, ""),
    ("a JSON string", b'"hello"', "chat", NOT_DECODED, ""),
    ("a JSON number", b"42", "chat", NOT_DECODED, ""),
    ("JSON null", b"null", "chat", NOT_DECODED, ""),
    ("not JSON", b"not json", "chat", NOT_DECODED, ""),
    ("empty", b"", "chat", NOT_DECODED, ""),
    ("cut short", CHAT[:-20], "chat", NOT_DECODED, ""),
    ("trailing bytes", CHAT + b" x", "chat", NOT_DECODED, ""),
    ("invalid bytes", b"\xff\xfe\x00garbage", "chat", NOT_DECODED, ""),
    ("invalid UTF-8 in the text", b'{"choices":[{"text":"o\xffk"}]}', "completion",
     NOT_DECODED, ""),
    ("nested too deeply", b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b',"choices":[]}',
     "chat", NOT_DECODED, ""),
]


@pytest.mark.parametrize(("body", "kind", "usage", "text"),
                         [c[1:] for c in RECORD_CASES], ids=[c[0] for c in RECORD_CASES])
def test_reply_record_reads_what_the_whole_decode_read(body: bytes, kind: str, usage: Any,
                                                       text: str) -> None:
    whole = parse_json(body)
    before = (whole.get("usage") if isinstance(whole, dict) else NOT_DECODED,
              reply_text(whole, kind))
    assert before == (usage, text)  # the table states the whole decode's reading
    got = reply_record(body, kind)
    assert got == before
    assert got[0] is NOT_DECODED or before[0] is not NOT_DECODED


def test_reply_record_skips_the_whole_decode_for_a_usual_reply(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("msgspec")

    def whole(body: bytes) -> Any:
        raise AssertionError("decoded whole")

    monkeypatch.setattr(output_text, "parse_json", whole)
    assert reply_record(CHAT, "chat") == (USAGE, "ok")
    assert reply_record('{"choices":[{"text":"é"}]}'.encode(), "completion") == (None, "é")


@pytest.mark.parametrize("unread", [b"9" * 5000, b'"\xff"'],
                         ids=["an integer too long for int", "invalid UTF-8"])
def test_reply_record_does_not_check_a_field_it_does_not_read(unread: bytes) -> None:
    """The reading that differs from the whole decode (module docstring): as fast_usage
    does, the typed decode skips the field unbuilt, so the rest of the reply is read."""
    pytest.importorskip("msgspec")
    body = b'{"x":' + unread + b',"choices":[{"text":"x"}],"usage":{"a":1}}'
    assert parse_json(body) is None
    assert reply_record(body, "completion") == ({"a": 1}, "x")
    assert fast_usage(body) == {"a": 1}


def test_a_reply_nested_too_deeply_is_not_json_not_an_error() -> None:
    """json's C scanner recurses once per level: a replica's reply nested past the
    recursion limit (2 KB of brackets) raised RecursionError out of the request path."""
    from skymesh.balancer.forwarding import reply_usage

    deep = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b',"choices":[]}'
    assert parse_json(deep) is None
    assert reply_text(parse_json(deep), "chat") == ""
    assert reply_usage(deep) == (0, 0, None)  # usage alone: msgspec refuses, then json
