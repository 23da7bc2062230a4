"""The request path's per-request shortcuts (session 26, issue #35) give what the general
path gives: the upstream request's header lines made once per shape of the client's
headers (the same bytes, the request id its own per request), a whole reply taken and
capped without a coroutine (the same refusals in the same words), the reply's headers
copied from our client's pairs (the same dict as from its multidict), and tracing's
per-attempt work skipped only when tracing is off."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from skymesh.balancer.config import BalancerConfig
from skymesh.balancer.forwarding import Forwarder
from skymesh.balancer.relay import (
    FORWARD_HEADERS,
    MAX_HEADER_SHAPES,
    UpstreamHeaders,
    copy_headers,
    reply_response,
)
from skymesh.balancer.upstream import (
    ReplyTooLarge,
    UpstreamReply,
    _Conn,
    header_lines,
    read_capped,
    whole_capped,
)
from skymesh.obs.config import TracingConfig

PATH = "/v1/chat/completions"


def general(h: UpstreamHeaders, request: Any) -> bytes:
    """What the forwarder sent before: for_request's dict, JSON by default, as lines."""
    headers = h.for_request(request)
    headers.setdefault("Content-Type", "application/json")
    return header_lines(headers)


def req(**headers: str) -> Any:
    return make_mocked_request("POST", PATH, headers=CIMultiDict(
        {k.replace("_", "-"): v for k, v in headers.items()}))


SHAPES = [
    {},
    {"Content_Type": "application/json"},
    {"Content_Type": "application/json", "X_Request_Id": "client-id-1"},
    {"X_Request_Id": "client-id-2", "Accept": "text/event-stream"},
    {"Authorization": "Bearer k1", "Content_Type": "application/json; charset=utf-8"},
    {"X_Request_Id": ""},  # an empty id is no id: a new one, where an absent one goes
    {"X_Request_Id": "x" * 200},  # too long to echo: a new one, in the client's place
]


@pytest.mark.parametrize("auth", [{}, {"Authorization": "Bearer replica-key"}])
@pytest.mark.parametrize("forwarded", [FORWARD_HEADERS, ("Content-Type", "X-Trace"),
                                       ("x-request-id", "Content-Type")])
def test_the_lines_made_once_per_shape_are_the_general_paths_bytes(
        auth: dict[str, str], forwarded: tuple[str, ...]) -> None:
    lean = UpstreamHeaders(forwarded, auth, traced=False)
    traced = UpstreamHeaders(forwarded, auth)  # the general path, every request
    for _ in range(2):  # the second time from the kept lines
        for shape in SHAPES:
            r = req(**shape)
            assert lean.lines_for(r) == general(traced, r) == traced.lines_for(r)
    # each request its own id, on lines kept from another request of its shape
    a, b = req(Content_Type="application/json"), req(Content_Type="application/json")
    assert lean.lines_for(a) != lean.lines_for(b)
    assert lean.lines_for(b) == general(traced, b)


def test_a_line_break_is_refused_on_every_request_and_nothing_is_kept() -> None:
    lean = UpstreamHeaders(FORWARD_HEADERS, {}, traced=False)
    bad = req(Accept="a\r\nX-Evil: 1")
    for _ in range(2):
        with pytest.raises(ValueError, match="line break"):
            lean.lines_for(bad)
    assert not lean._lines


def test_the_kept_lines_are_bounded() -> None:
    lean = UpstreamHeaders(FORWARD_HEADERS, {}, traced=False)
    for i in range(MAX_HEADER_SHAPES + 10):
        r = req(Authorization=f"Bearer k{i}")
        assert lean.lines_for(r) == general(lean, r)
    assert len(lean._lines) <= MAX_HEADER_SHAPES


def whole(body: bytes, headers: dict[str, str], complete: bool = True) -> UpstreamReply:
    reply = UpstreamReply(_Conn(("h", 1, False), 1 << 16), cast(Any, None), 5.0)
    reply.raw_headers = list(headers.items())
    reply.status = 200
    reply.feed(body)
    reply.complete = complete
    return reply


@pytest.mark.parametrize("body, headers", [
    (b'{"a": 1}', {"Content-Length": "8"}),
    (b"", {"Content-Length": "0"}),
    (b"12345", {"Content-Length": "5"}),  # over a cap of 4: the declared size named
    (b"12345", {"Transfer-Encoding": "chunked"}),  # over, no size declared
    (b"1234", {"Transfer-Encoding": "chunked"}),  # at the cap: taken
])
async def test_a_whole_reply_is_taken_or_refused_as_read_capped_does(
        body: bytes, headers: dict[str, str]) -> None:
    try:
        expected: bytes | str = await read_capped(whole(body, headers), 4)
    except ReplyTooLarge as exc:
        expected = f"{exc.what}: {exc}"
    try:
        got: bytes | str | None = whole_capped(whole(body, headers), 4)
    except ReplyTooLarge as exc:
        got = f"{exc.what}: {exc}"
    assert got == expected


def test_a_reply_still_arriving_or_failed_or_not_ours_is_left_to_read_capped() -> None:
    arriving = whole(b"part", {"Transfer-Encoding": "chunked"}, complete=False)
    assert whole_capped(arriving, 100) is None
    assert arriving._buf  # nothing taken
    failed = whole(b"part", {})
    failed.fail(ConnectionError("gone"))
    assert whole_capped(failed, 100) is None
    other = SimpleNamespace(complete=True, _error=None, headers={})
    assert whole_capped(cast(Any, other), 100) is None


@pytest.mark.parametrize("pairs", [
    [("Content-Type", "application/json"), ("Content-Length", "8")],
    [("content-type", "a"), ("Content-Type", "b"), ("X-A", "1"), ("x-a", "2"),
     ("X-A", "3"), ("Connection", "keep-alive"), ("Date", "d"), ("Server", "s"),
     ("Transfer-Encoding", "chunked"), ("Keep-Alive", "5"), ("Content-Encoding", "gzip")],
    [],
])
def test_the_reply_headers_copied_from_our_clients_pairs_are_the_multidicts(
        pairs: list[tuple[str, str]]) -> None:
    ours = whole(b"", dict.fromkeys(()))
    ours.raw_headers = pairs
    general = SimpleNamespace(headers=CIMultiDict(pairs))  # aiohttp's reply: its multidict
    assert copy_headers(ours) == copy_headers(cast(Any, general))
    assert list(copy_headers(ours).items()) == list(copy_headers(cast(Any, general)).items())


def _as_built(resp: web.Response) -> dict[str, Any]:
    """A response's attributes, its headers as their pairs in order."""
    attrs = dict(vars(resp))
    attrs["_headers"] = list(attrs["_headers"].items())
    return attrs


@pytest.mark.parametrize("status", [200, 201, 400, 404, 429])
@pytest.mark.parametrize("pairs", [
    [("Content-Type", "application/json"), ("Content-Length", "8"), ("X-Request-Id", "r")],
    [("content-type", "a"), ("Content-Type", "b"), ("X-A", "1"), ("x-a", "2"),
     ("Date", "d"), ("Server", "s")],
    [],
])
@pytest.mark.parametrize("body", [b'{"a": 1}', b"", bytearray(b"xy")])
def test_the_reply_response_is_the_one_web_response_would_build(
        status: int, pairs: list[tuple[str, str]], body: bytes) -> None:
    up = whole(b"", dict.fromkeys(()))
    up.raw_headers = pairs
    ours = reply_response(status, body, up)
    theirs = web.Response(status=status, body=body, headers=copy_headers(up))
    assert type(ours) is web.Response
    assert _as_built(ours) == _as_built(theirs)
    assert ours._body is body
    # Each its own: the item dict and the headers are not shared with another response.
    again = reply_response(status, body, up)
    again["k"] = 1
    again.headers["X-New"] = "1"
    assert "k" not in ours and "X-New" not in ours.headers


@pytest.mark.parametrize("enabled", [False, True])
def test_tracing_off_is_read_once_from_the_config(enabled: bool) -> None:
    endpoint = "http://127.0.0.1:4318" if enabled else None
    cfg = BalancerConfig(tracing=TracingConfig(otlp_endpoint=endpoint))
    headers = UpstreamHeaders(FORWARD_HEADERS, {})
    fwd = Forwarder(cast(Any, None), cfg, headers, cast(Any, None), None, cast(Any, None),
                    cast(Any, None), {}, lambda model: 1.0)
    assert fwd.traced is enabled
    assert fwd.headers.traced is enabled
    assert headers.traced  # the caller's (the mover's) is left as it was


def test_a_configuration_without_the_setting_keeps_the_general_path() -> None:
    fwd = Forwarder(cast(Any, None), cast(Any, SimpleNamespace()),
                    UpstreamHeaders(FORWARD_HEADERS, {}), cast(Any, None), None,
                    cast(Any, None), cast(Any, None), {}, lambda model: 1.0)
    assert fwd.traced and fwd.headers.traced
