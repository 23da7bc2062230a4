"""Every way a request body can fail to parse is a BadRequest (the balancer's 400), never
another exception (a 500): issue #23, item 4."""

from __future__ import annotations

import json

import pytest

from skymesh.balancer.errors import BadRequest
from skymesh.balancer.intake import parse_request
from skymesh.net.jsonbody import JsonBodyError, loads_body

MESSAGES = '[{"role": "user", "content": "hi"}]'


def body(extra: str) -> bytes:
    return f'{{"model": "m", "messages": {MESSAGES}, {extra}}}'.encode()


BAD = [
    ("huge integer", body('"max_tokens": ' + "9" * 4301), "number json cannot take"),
    ("huge negative integer", body('"seed": -' + "1" * 5000), "number json cannot take"),
    ("huge integer deep inside", body('"x": [[{"y": ' + "7" * 9000 + "}]]"),
     "number json cannot take"),
    ("NaN", body('"temperature": NaN'), "NaN is not a JSON value"),
    ("Infinity", body('"top_p": Infinity'), "Infinity is not a JSON value"),
    ("-Infinity", body('"presence_penalty": -Infinity'), "-Infinity is not a JSON value"),
    ("NaN in a list", body('"logit_bias": [1, NaN]'), "NaN is not a JSON value"),
    ("float overflow", body('"temperature": 1e999'), "out of range"),
    ("negative float overflow", body('"temperature": -2.5e400'), "out of range"),
    ("deep nesting", b'{"model": "m", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
     "nested too deeply"),
    ("invalid UTF-8", body('"user": "') + b'\xff\xfe"}', "not valid UTF-8"),
    ("truncated UTF-8", b'{"model": "m\xe2\x82"}', "not valid UTF-8"),
    ("UTF-16", json.dumps({"model": "m", "messages": []}).encode("utf-16"),
     "not valid UTF-8"),
    ("UTF-8 BOM", b"\xef\xbb\xbf" + body('"n": 1'), "not valid JSON"),
    ("truncated JSON", body('"n": 1')[:-5], "not valid JSON"),
    ("trailing garbage", body('"n": 1') + b"}", "not valid JSON"),
    ("empty", b" ", "not valid JSON"),
    ("not an object", b"[1, 2]", "must be a JSON object"),
]


@pytest.mark.parametrize("raw,match", [(r, m) for _, r, m in BAD], ids=[n for n, _, _ in BAD])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_unparsable_bodies_are_bad_requests(kind: str, raw: bytes, match: str) -> None:
    with pytest.raises(BadRequest, match=match) as caught:
        parse_request(kind, raw, {})
    assert caught.value.status == 400
    err = caught.value.body()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_request"


GOOD = [
    ("plain", body('"max_tokens": 8')),
    ("4300-digit integer", body('"seed": ' + "9" * 4300)),
    ("largest double", body('"temperature": 1.7976931348623157e308')),
    ("underflow to zero", body('"temperature": 1e-400')),
    ("strings naming the constants", body('"user": "NaN", "stop": ["Infinity"]')),
    ("surrogate pair escape", body('"user": "\\ud83d\\ude00"')),
    ("lone surrogate escape", body('"user": "a\\ud800b"')),
    ("nesting a few hundred deep", body('"x": ' + "[" * 300 + "]" * 300)),
]


@pytest.mark.parametrize("raw", [r for _, r in GOOD], ids=[n for n, _ in GOOD])
def test_valid_json_still_parses(raw: bytes) -> None:
    intake = parse_request("chat", raw, {})
    assert intake.model == "m" and "hi" in intake.prompt_text
    assert intake.body == json.loads(raw)


def test_the_parser_keeps_numbers_exact() -> None:
    value = loads_body(b'{"a": 12345678901234567890, "b": 0.1, "c": -0.0, "d": 1E+2}')
    assert value == {"a": 12345678901234567890, "b": 0.1, "c": -0.0, "d": 100.0}
    assert isinstance(value["a"], int) and isinstance(value["d"], float)


def test_parse_errors_are_value_errors_with_a_message() -> None:
    with pytest.raises(JsonBodyError) as caught:
        loads_body(b"NaN")
    assert isinstance(caught.value, ValueError) and str(caught.value)
