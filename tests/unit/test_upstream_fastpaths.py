"""The request path's shortcuts in the upstream client and the forwarder: the read timeout
as one deadline timer per connection (on a fake loop), a whole reply taken without async
iteration, and the reply's ``usage`` decoded alone."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from skymesh.balancer.forwarding import reply_usage, usage
from skymesh.balancer.output_text import parse_json
from skymesh.balancer.upstream import (
    ReplyTooLarge,
    Upstream,
    UpstreamReply,
    _Conn,
    read_capped,
)


class FakeTimer:
    def __init__(self, when: float, fn: Any, args: tuple[Any, ...]) -> None:
        self._when, self.fn, self.args, self.cancelled = when, fn, args, False

    def when(self) -> float:
        return self._when

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """The two calls the deadline timer makes of a loop, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[FakeTimer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, fn: Any, *args: Any) -> FakeTimer:
        t = FakeTimer(when, fn, args)
        self.timers.append(t)
        return t

    def live(self) -> list[FakeTimer]:
        return [t for t in self.timers if not t.cancelled]

    def advance(self, to: float) -> None:
        """Run every live timer due by ``to`` (in order), as the loop would."""
        self.now = to
        while due := sorted((t for t in self.live() if t.when() <= to), key=FakeTimer.when):
            t = due[0]
            t.cancelled = True  # run once
            t.fn(*t.args)


def waiting_reply(loop: FakeLoop, timeout: float) -> tuple[_Conn, UpstreamReply,
                                                             asyncio.Future[None]]:
    conn = _Conn(("h", 1, False), 1024)
    reply = UpstreamReply(conn, cast(Upstream, None), timeout)
    conn.reply = reply
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    reply._waiter = waiter
    conn.arm(cast(asyncio.AbstractEventLoop, loop), timeout)
    return conn, reply, waiter


async def test_a_wait_without_bytes_times_out_at_its_deadline() -> None:
    loop = FakeLoop()
    _, _, waiter = waiting_reply(loop, 5.0)
    loop.advance(4.9)
    assert not waiter.done()
    loop.advance(5.0)
    with pytest.raises(TimeoutError, match="no bytes from the replica for 5 s"):
        waiter.result()


async def test_each_wait_moves_the_deadline_without_a_timer_of_its_own() -> None:
    """Bytes that keep coming (a new wait each time) never time out; the one timer
    re-arms for the latest deadline when it fires early."""
    loop = FakeLoop()
    conn, _, waiter = waiting_reply(loop, 5.0)
    for t in (1.0, 2.0, 3.0, 4.0):  # a chunk arrived, the next wait starts
        loop.now = t
        conn.arm(cast(asyncio.AbstractEventLoop, loop), 5.0)
    assert len(loop.timers) == 1  # no timer per wait
    loop.advance(8.9)  # the first timer fired at 5 and re-armed for 9
    assert not waiter.done()
    assert len(loop.live()) == 1
    loop.advance(9.0)
    assert isinstance(waiter.exception(), TimeoutError)


async def test_nobody_waiting_stops_the_timer_and_a_shorter_wait_replaces_it() -> None:
    loop = FakeLoop()
    conn, _, waiter = waiting_reply(loop, 5.0)
    conn.deadline = 0.0  # the wait ended (what UpstreamReply._expected does)
    loop.advance(100.0)
    assert not waiter.done() and not loop.live()  # fired, found nobody, not re-armed
    conn.arm(cast(asyncio.AbstractEventLoop, loop), 5.0)  # next wait: 105
    conn.arm(cast(asyncio.AbstractEventLoop, loop), 1.0)  # a shorter one: 101
    assert [t.when() for t in loop.live()] == [101.0]
    conn.abort()  # a dropped connection leaves no timer behind
    assert not loop.live() and conn.deadline == 0.0


async def test_a_timer_left_from_a_pooled_connections_last_reply_finds_no_one() -> None:
    loop = FakeLoop()
    conn, _, waiter = waiting_reply(loop, 5.0)
    conn.deadline = 0.0
    conn.reply = None  # released to the pool
    loop.advance(5.0)
    assert not waiter.done()


class Whole:
    """A reply with its body in hand, as read_capped sees it."""

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        self.reply = UpstreamReply(_Conn(("h", 1, False), 1024), cast(Upstream, None), 5.0)
        self.reply.raw_headers = list(headers.items())
        self.reply.status = 200
        self.reply.feed(body)
        self.reply.complete = True


async def test_a_whole_reply_is_taken_as_is_and_still_capped() -> None:
    assert await read_capped(Whole(b'{"a": 1}', {}).reply, 100) == b'{"a": 1}'
    assert await read_capped(Whole(b"", {}).reply, 100) == b""
    with pytest.raises(ReplyTooLarge, match="exceeds the 4-byte cap") as info:
        await read_capped(Whole(b"12345", {"Transfer-Encoding": "chunked"}).reply, 4)
    assert info.value.what == "body"
    failed = Whole(b"part", {}).reply
    failed.fail(ConnectionError("gone"))
    assert failed.whole() is None  # an error is read the slow way, and raised there


@pytest.mark.parametrize("body", [
    b'{"id":"x","choices":[{"message":{"content":"hi"}}],'
    b'"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}',
    b'{"usage":{"prompt_tokens":"7","prompt_tokens_details":{"cached_tokens":3}}}',
    b'{"usage":{"prompt_tokens":1.5,"completion_tokens":null}}',
    b'{"usage":null}', b'{"usage":5}', b'{"usage":[]}', b'{"other":1}', b"[1, 2]",
    b"not json", b"", b'{"usage":{"prompt_tokens":NaN}}',
    b'{"usage":{}, "usage":{"prompt_tokens":4}}',  # the last one counts, as in json
    b'{"s":"\\ud800","usage":{"prompt_tokens":2}}',  # a lone surrogate: msgspec refuses
])
def test_the_usage_alone_reads_as_the_whole_reply_does(body: bytes) -> None:
    assert reply_usage(body) == usage(parse_json(body))
