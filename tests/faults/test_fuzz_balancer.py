"""Hypothesis-generated OpenAI request bodies and headers against a live ``skymesh-lb``.

Bad input must get a 4xx with an OpenAI error body (never a 5xx, never a dropped
connection) and the daemon must stay up. Four strategies: arbitrary JSON documents,
OpenAI-shaped bodies with every field mutated (types, ranges, nesting, unicode), raw
bytes (invalid UTF-8, truncated JSON), each with generated headers (deadline, session,
content type, authorization); and a valid chat body mutated as text (numbers past the
digit limit, NaN and the infinities, broken strings and escapes, deep nesting), sent to
the balancer and to a replica. Examples are bounded so the module runs in about 30 s.
"""

from __future__ import annotations

import http.client
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from skymesh.util.procs import Daemon, start_daemon
from skymesh_lab.faults.cluster import MODEL

pytestmark = pytest.mark.timeout(180)

EXAMPLES = 150  # per strategy
REQUEST_TIMEOUT_S = 20.0  # a request that takes longer than this is a hang
SEEN: Counter[str] = Counter()  # status classes per run, printed at the end


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("fuzz-replica")
    rep = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.01"],
                       log_path=tmp / "replica.log")
    try:
        yield rep
    finally:
        rep.stop()


@pytest.fixture(scope="module")
def lb(tmp_path_factory: pytest.TempPathFactory, replica: Daemon) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("fuzz-lb")
    rep = replica
    cfg = tmp / "lb.yaml"
    cfg.write_text(json.dumps({
        "listen": {"port": 0}, "probe": {"interval_s": 0.05},
        "limits": {"max_body_bytes": 65536},
        "replicas": [{"url": rep.url, "models": [MODEL]}]}))
    lb = start_daemon("skymesh-lb", ["--config", str(cfg)], log_path=tmp / "lb.log")
    try:
        yield lb
    finally:
        lb.stop()
        print(f"\nfuzz status classes: {dict(SEEN)}")


def post(lb: Daemon, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    u = urlsplit(lb.url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port,
                                      timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def check(lb: Daemon, path: str, body: bytes, headers: dict[str, str]) -> int:
    status, raw = post(lb, path, body, headers)
    SEEN[f"{status // 100}xx"] += 1
    assert status < 500, (status, raw[:300], body[:300], headers)
    if status >= 400:
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] and err["code"]
    assert lb.alive()
    return status


# -- strategies ------------------------------------------------------------------------------
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                      st.text(max_size=30))
json_doc = st.recursive(json_leaf, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=10), c, max_size=4)),
    max_leaves=12)
junk = st.one_of(json_leaf, st.lists(json_leaf, max_size=3),
                 st.dictionaries(st.text(max_size=8), json_leaf, max_size=3))

message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), junk),
     "content": st.one_of(st.text(max_size=200), junk,
                          st.lists(st.fixed_dictionaries(
                              {"type": st.sampled_from(["text", "image_url", "x"]),
                               "text": st.one_of(st.text(max_size=50), junk)}), max_size=3))},
    optional={"name": junk})

# Generation stays small when the body is otherwise valid: a long answer is not bad input.
small_int = st.one_of(st.integers(-5, 8), st.sampled_from([0, -1, 2**31, 2**63, 10**30]))
openai_body = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), st.text(max_size=20), junk),
     "messages": st.one_of(st.lists(message, max_size=3), junk)},
    optional={"max_tokens": st.one_of(small_int, junk),
              "max_completion_tokens": st.one_of(small_int, junk),
              "stream": st.one_of(st.booleans(), junk),
              "temperature": st.one_of(st.floats(allow_nan=False), junk),
              "n": st.one_of(small_int, junk), "stop": junk, "user": junk,
              "min_tokens": st.one_of(small_int, junk),
              "stream_options": junk, "prompt": junk, "extra": json_doc})

headers = st.fixed_dictionaries({}, optional={
    "X-SkyMesh-Deadline-Ms": st.one_of(st.sampled_from(["-1", "nan", "inf", "1e309", "",
                                                        "60000", "abc"]),
                                       st.integers(1000, 10**12).map(str)),
    "X-Session-ID": st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=80),
    "Content-Type": st.sampled_from(["application/json", "text/plain", "", "a/b; x=\"y"]),
    "Authorization": st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60),
    "X-SkyMesh-Forwarded": st.text(st.characters(min_codepoint=48, max_codepoint=102),
                                   max_size=32)})

paths = st.sampled_from(["/v1/chat/completions", "/v1/completions"])
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@SETTINGS
@given(doc=json_doc, hdrs=headers, path=paths)
def test_arbitrary_json_gets_4xx_not_5xx(lb: Daemon, doc: Any, hdrs: dict[str, str],
                                         path: str) -> None:
    check(lb, path, json.dumps(doc).encode(), hdrs)


@SETTINGS
@given(body=openai_body, hdrs=headers, path=paths)
def test_mutated_openai_bodies_get_4xx_not_5xx(lb: Daemon, body: dict[str, Any],
                                               hdrs: dict[str, str], path: str) -> None:
    check(lb, path, json.dumps(body).encode(), hdrs)


@SETTINGS
@given(raw=st.one_of(st.binary(max_size=300),
                     openai_body.map(lambda b: json.dumps(b).encode()[:-3])),
       hdrs=headers, path=paths)
def test_raw_bytes_get_4xx_not_5xx(lb: Daemon, raw: bytes, hdrs: dict[str, str],
                                   path: str) -> None:
    check(lb, path, raw, hdrs)


# -- textual mutations of a valid chat body: numbers, strings, nesting --------------------
# json.dumps cannot write what these are after (NaN and the infinities as bare words, an
# integer past Python's 4,300-digit parse limit, invalid UTF-8, a lone surrogate escape,
# nesting past the parser's recursion limit), so the body is assembled as text.
BAD_CONSTANTS = ("NaN", "Infinity", "-Infinity")
number_token = st.one_of(
    st.sampled_from([*BAD_CONSTANTS, "1e999", "-1e999", "1E400", "4e-400", "-0", "0.0",
                     "00", "01", "1.", ".5", "+1", "0x10", "1e", "--1", "2" * 4300]),
    st.integers(4301, 6000).map(lambda n: "9" * n),  # past the digit limit: a ValueError
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr))
string_token = st.one_of(
    st.text(max_size=40).map(lambda t: json.dumps(t, ensure_ascii=False).encode()),
    st.sampled_from([b'"\\ud800"', b'"a\\udc00b"', b'"\\ud83d\\ude00"', b'"\\u00"',
                     b'"\\x41"', b'"a\x00b"', b'"\xff\xfe"', b'"\xed\xa0\x80"',
                     b'"\xc3"', b'"\\"', b'"\xf0\x9f\x98\x80"']),
    st.binary(max_size=12).map(lambda b: b'"' + b.replace(b'"', b"") + b'"'))
NUMBER_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "n", "presence_penalty")
NEST_FIELDS = ("content", "messages", "max_tokens", "stop")


@st.composite
def mutated_chat(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A chat body with one number, one string and one nesting depth mutated; and whether
    it must be refused as a 400 (a non-standard constant or an over-long integer)."""
    number = draw(number_token)
    number_field = draw(st.sampled_from(NUMBER_FIELDS))
    content = draw(string_token)
    depth = draw(st.one_of(st.just(0), st.integers(1, 40), st.integers(900, 3000)))
    nest_field = draw(st.sampled_from(NEST_FIELDS))

    def nest(field: str, value: bytes) -> bytes:
        return b"[" * depth + value + b"]" * depth if field == nest_field else value

    message = b'{"role": "user", "content": ' + nest("content", content) + b"}"
    body = (b'{"model": ' + json.dumps(MODEL).encode()
            + b', "messages": ' + nest("messages", b"[" + message + b"]")
            + b', "max_tokens": ' + nest("max_tokens", b"2")
            + b', "stop": ' + nest("stop", b"null")
            # A second "max_tokens" is a duplicate key: JSON parsers keep the last one.
            + b', "' + number_field.encode() + b'": ' + number.encode() + b"}")
    digits = number.lstrip("-")
    must_400 = number in BAD_CONSTANTS or (digits.isdigit() and len(digits) > 4300)
    return body, must_400


def _chat(extra: bytes) -> bytes:
    return (b'{"model": ' + json.dumps(MODEL).encode()
            + b', "messages": [{"role": "user", "content": "hi"}], ' + extra + b"}")


# The regressions of issue #23, whatever hypothesis draws besides.
REGRESSIONS = [((_chat(b'"max_tokens": ' + b"9" * 4301), True), "lb"),
               ((_chat(b'"max_tokens": ' + b"9" * 4301), True), "replica"),
               ((_chat(b'"temperature": NaN'), True), "lb"),
               ((_chat(b'"temperature": NaN'), True), "replica"),
               ((_chat(b'"top_p": -Infinity'), True), "lb"),
               ((_chat(b'"stop": ' + b"[" * 3000 + b"]" * 3000), False), "lb"),
               ((_chat(b'"user": "\xff"'), False), "replica")]


def with_regressions(test: Any) -> Any:
    for case, target in REGRESSIONS:
        test = example(case=case, target=target)(test)
    return test


@SETTINGS
@with_regressions
@given(case=mutated_chat(), target=st.sampled_from(["lb", "replica"]))
def test_mutated_numbers_strings_and_nesting_get_4xx_not_5xx(
        lb: Daemon, replica: Daemon, case: tuple[bytes, bool], target: str) -> None:
    body, must_400 = case
    daemon = lb if target == "lb" else replica
    status = check(daemon, "/v1/chat/completions", body, {"Content-Type": "application/json"})
    if must_400:
        assert status == 400, (target, status, body[:200])


def test_oversized_and_deep_bodies_are_refused_cleanly(lb: Daemon) -> None:
    big = json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "x" * 70_000}]}).encode()
    status, raw = post(lb, "/v1/chat/completions", big, {})
    assert status == 413 and json.loads(raw)["error"]["code"]
    deep = b"[" * 50_000 + b"]" * 50_000  # over the body limit: refused unread
    status, raw = post(lb, "/v1/chat/completions", deep, {})
    assert status == 413, status
    assert lb.alive()
    assert Path(lb.log_path).read_text().count("Traceback") == 0


def test_a_deeply_nested_body_is_a_400_at_the_replica(replica: Daemon) -> None:
    # json.loads recurses once per nesting level and raises RecursionError past about
    # a thousand: bad input, not a server error (skymesh.net.jsonbody, shared with the
    # balancer's intake).
    nested = '{"content":' * 2000 + '"x"' + "}" * 2000  # too deep for json.dumps to build
    body = f'{{"model": "{MODEL}", "messages": [{nested}]}}'.encode()
    status, raw = post(replica, "/v1/chat/completions", body, {})
    assert status == 400, (status, raw[:200])
    assert "nested too deeply" in json.loads(raw)["error"]["message"]
    assert replica.alive()
