"""The loop's own log sink (skymesh.obs.logsink): a pipe nobody reads never blocks it,
what waits stays in order and bounded, lines stay whole among other writers."""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import eventually
from test_obs_access import restore_logging  # noqa: F401 - the fixture, shared

from skymesh.obs.access import BATCH, AccessRecord, AccessWriter
from skymesh.obs.logs import ACCESS_LOGGER, setup_logging
from skymesh.obs.logsink import PIPE_BUF, LineSink, open_sink

LINE = b"x" * 99 + b"\n"  # 100 bytes


def finished(request_id: str = "r1") -> AccessRecord:
    """A record as the middleware hands it to the writer at a request's end."""
    rec = AccessRecord(100.0, request_id)
    rec.method, rec.path, rec.code, rec.end = "POST", "/v1/chat/completions", 200, 100.04
    rec.client, rec.first_byte_at = "127.0.0.1", 100.01
    rec.prompt_tokens = rec.completion_tokens = None
    return rec


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        with contextlib.suppress(OSError):
            os.close(fd)


def read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    while True:
        try:
            got = os.read(fd, 1 << 16)
        except BlockingIOError:
            return out
        if not got:
            return out
        out += got


def _stream(fd: int) -> io.TextIOWrapper:
    return open(fd, "w", closefd=False)


def test_a_pipes_sink_is_a_new_description_so_stderr_stays_blocking(
        pipe: tuple[int, int]) -> None:
    _r, w = pipe
    with _stream(w) as stream:
        sink = open_sink(stream, max_lines=10)
        assert sink is not None and sink.atomic
        try:
            assert not os.get_blocking(sink.fd)
            assert os.get_blocking(w)  # the process's own descriptor: untouched
            assert fcntl.fcntl(w, fcntl.F_GETFL) & os.O_NONBLOCK == 0
        finally:
            sink.close()


def test_a_regular_file_keeps_the_thread(tmp_path: Path) -> None:
    """A file's write may sleep in writeback throttling: the thread's to wait out."""
    with open(tmp_path / "log", "w") as stream:
        assert open_sink(stream, max_lines=10) is None


def test_no_descriptor_no_sink() -> None:
    assert open_sink(io.StringIO(), max_lines=10) is None


async def test_a_pipe_nobody_reads_never_blocks_and_bounds_what_waits(
        pipe: tuple[int, int]) -> None:
    r, w = pipe
    with _stream(w) as stream:
        sink = open_sink(stream, max_lines=5 * BATCH)
    assert sink is not None
    batch = LINE * BATCH
    taken = refused = 0
    # Far more than the pipe holds (64 KiB): every call returns at once.
    for _ in range(40):
        if sink.write(batch, BATCH):
            taken += 1
        else:
            refused += 1
    assert refused > 0
    assert sink.lines_waiting <= sink.max_lines
    # What was taken comes out whole and in order once someone reads.
    data = bytearray()

    def drained() -> bool:  # reading makes room; the loop's add_writer writes the rest
        data.extend(read_all(r))
        return sink.lines_waiting == 0

    await eventually(drained, "what waited written")
    data.extend(read_all(r))
    sink.close()
    assert data == batch * taken


async def test_a_partial_write_keeps_order_and_the_rest_waits() -> None:
    """A descriptor that takes a few bytes at a time: everything arrives, in order."""
    written: list[bytes] = []
    budget = [150]

    def stingy(fd: int, data: memoryview) -> int:
        n = min(len(data), budget[0])
        if n == 0:
            raise BlockingIOError
        budget[0] -= n
        written.append(bytes(data[:n]))
        return n

    r, w = os.pipe()
    try:
        sink = LineSink(w, atomic=False, max_lines=100, write=stingy)
        first, second = b"".join(b"a%d\n" % i for i in range(50)), b"b\n" * 10
        assert sink.write(first, 50)
        assert sink.lines_waiting == first[150:].count(b"\n")  # those not yet out
        assert sink.write(second, 10)  # behind the first, not before it
        budget[0] = 10 ** 6
        sink._drain()
        assert sink.lines_waiting == 0
        assert b"".join(written) == first + second
    finally:
        os.close(r)
        os.close(w)


def test_writes_to_a_pipe_are_whole_lines_of_at_most_pipe_buf() -> None:
    sizes: list[bytes] = []

    def record(fd: int, data: memoryview) -> int:
        sizes.append(bytes(data))
        return len(data)

    sink = LineSink(-1, atomic=True, max_lines=10 ** 4, write=record)
    long_line = b"y" * (PIPE_BUF + 10) + b"\n"
    data = LINE * 100 + long_line + LINE * 3
    assert sink.write(data, 104)
    assert b"".join(sizes) == data
    for chunk in sizes:
        assert chunk.endswith(b"\n")
        assert len(chunk) <= PIPE_BUF or chunk == long_line


def test_a_gone_reader_refuses_the_batch(pipe: tuple[int, int]) -> None:
    r, w = pipe
    with _stream(w) as stream:
        sink = open_sink(stream, max_lines=10)
    assert sink is not None
    os.close(r)
    assert not sink.write(LINE, 1)  # EPIPE: dropped, never raised
    sink.close()


@pytest.mark.usefixtures("restore_logging")
async def test_the_access_writer_writes_a_pipes_batches_on_the_loop_not_the_thread(
        pipe: tuple[int, int]) -> None:
    """The daemons' set-up with stderr a pipe: the loop writes each batch itself and the
    thread is never handed one; a stuck pipe drops lines (counted) and never blocks."""
    r, w = pipe
    with _stream(w) as stream:
        # Only the daemons' handler (pytest's own would send lines through logging).
        logging.getLogger().handlers[:] = [setup_logging("warning", "text", stream=stream)]
        writer = AccessWriter(logging.getLogger(ACCESS_LOGGER), linger_s=0.0,
                              max_backlog=4 * BATCH)
        writer.start()
        try:
            assert writer._sink is not None
            for i in range(BATCH):
                assert writer.put(finished(request_id=f"r{i}"), None)
            assert writer._queue.qsize() == 0  # nothing crossed to the thread
            got = read_all(r).decode().splitlines()
            assert [x.split("request_id=")[1].split()[0] for x in got] == [
                f"r{i}" for i in range(BATCH)]
            # Nobody reads now: the pipe fills, lines wait up to the backlog, then drop.
            sent = 0
            while writer.dropped == 0:
                for _ in range(BATCH):
                    writer.put(finished(), None)
                sent += BATCH
                assert sent < 10 ** 5
            assert writer._sink.lines_waiting <= writer.max_backlog
            out = bytearray()  # the reader is back: what waited comes out

            def drained() -> bool:
                out.extend(read_all(r))
                return writer._sink is not None and writer._sink.lines_waiting == 0

            await eventually(drained, "what waited written")
        finally:
            await writer.settle()
            writer.stop()
        stream.flush()
    out.extend(read_all(r))
    lines = out.decode().splitlines()
    logged = [x for x in lines if "skymesh.access:" in x]
    assert len(logged) + writer.dropped == sent  # each line written or counted
    assert f"access log: {writer.dropped} line(s) dropped" in out.decode()


def test_stderr_as_a_pipe_or_file_gets_a_sink(tmp_path: Path) -> None:
    """Whatever stderr is here, open_sink answers without touching it."""
    import sys

    try:
        mode = os.fstat(sys.stderr.fileno()).st_mode
    except (OSError, ValueError, io.UnsupportedOperation):
        pytest.skip("stderr has no descriptor here")
    before = os.get_blocking(sys.stderr.fileno())
    sink = open_sink(sys.stderr, max_lines=10)
    if sink is not None:
        sink.close()
    assert os.get_blocking(sys.stderr.fileno()) == before
    assert (sink is not None) == (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode))
