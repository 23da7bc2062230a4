"""skymesh.net.jsonbody's fast path (msgspec) gives what the json decoder gives: the same
value, of the same types, or the same error message, for every body."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.net.jsonbody import JsonBodyError, loads_body, loads_strict


def outcome(fn: Any, raw: bytes) -> tuple[str, Any]:
    try:
        value = fn(raw)
    except JsonBodyError as exc:
        return "error", str(exc)
    # repr: 1 and 1.0 and True compare equal; the types must match too
    return "value", repr(value)


def same(raw: bytes) -> None:
    assert outcome(loads_body, raw) == outcome(loads_strict, raw), raw[:200]


values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers() | st.integers(min_value=-(2**80), max_value=2**80) | st.text(),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(values, st.booleans())
def test_any_json_text_parses_the_same(value: Any, ascii_only: bool) -> None:
    same(json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"))


@settings(max_examples=300, deadline=None)
@given(values, st.integers(min_value=0, max_value=200), st.binary(max_size=3))
def test_broken_json_fails_the_same(value: Any, at: int, junk: bytes) -> None:
    raw = json.dumps(value).encode()
    at = min(at, len(raw))
    same(raw[:at] + junk + raw[at:])
    same(raw[:at])


@pytest.mark.parametrize("raw", [
    b'{"seed": 123456789012345678901234567890}',  # exact, as json keeps it
    b'{"seed": 18446744073709551616}', b'{"seed": -9223372036854775809}',
    b'["\\ud800"]', b'["\\udc00 lone"]',  # msgspec refuses lone surrogates; json takes them
    b"[" * 1100 + b"]" * 1100, b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"user": "\xff\xfe"}', b'{"model": "m\xe2\x82"}',  # bad UTF-8 in a string
    b"NaN", b"[Infinity]", b'{"t": -Infinity}', b"1e999", b"-1E400", b"0.1e-999",
    b"\xef\xbb\xbf{}", b"\xff", b'"\x01"', b"{}x", b" {} ", b'{"a": 1, "a": 2}', b"-0",
    b"", b"   ", b'"\\u00e9"', "\u00e9".encode(), b"1.7976931348623157e308",
])
def test_the_edges_parse_the_same(raw: bytes) -> None:
    same(raw)


def test_without_msgspec_json_decides_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lean core has no msgspec (it comes with the ``fast`` extra)."""
    from skymesh.net import jsonbody

    monkeypatch.setattr(jsonbody, "_FAST", None)
    assert loads_body(b'{"a": [1, 2.5, "\\u00e9"]}') == {"a": [1, 2.5, "\u00e9"]}
    with pytest.raises(JsonBodyError, match="NaN is not a JSON value"):
        loads_body(b"[NaN]")
