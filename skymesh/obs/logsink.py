"""Log lines written by the event loop itself to a descriptor that never blocks it.

The access log's batches go to a thread of their own, so a stuck log sink (a full
pipe, a paused log shipper) blocks that thread and not the loop. For a pipe, a
:class:`LineSink` writes on the loop instead, to an open file description of its own
that does not block: no hand-off between threads per batch (measured live, about as
costly either way: docs/operations-logs.md#cost), and writes of whole lines that a pipe
takes whole, so the lines of a balancer's workers, which share its stderr, never cut
into each other:

- a pipe (or a terminal): ``/proc/self/fd/N`` opened anew, which on Linux gives a new
  open file description, so its ``O_NONBLOCK`` does not leak to the process's stderr;
  each write is at most ``PIPE_BUF`` bytes of whole lines, which a pipe takes whole or
  not at all, so lines stay whole among other writers of the same pipe;
- anything else: no sink, and the caller keeps its thread. That includes a regular
  file: it never says "full" as a pipe does, but a write to it can sleep in the kernel
  when the machine has too many dirty pages (writeback throttling), which is a
  thread's to wait out, not the loop's; measured live, writing a file's batches on
  the loop cost no less CPU than the thread did. Also a socket (journald's stderr), a
  stream without a descriptor, a system without /proc.

What the sink cannot write at once waits, in order, until the descriptor is writable
again (the loop's ``add_writer``); past ``max_lines`` waiting lines a batch is refused
and the caller counts it dropped: memory stays bounded and the loop never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import stat
from collections import deque
from collections.abc import Callable
from typing import IO, Any

PIPE_BUF = select.PIPE_BUF  # a pipe's atomic write: all of it or nothing
_RETRY_S = 0.05  # a descriptor the loop cannot watch (a full disk's file) is tried again


class LineSink:
    """Batches of whole lines written to ``fd`` without blocking (see the module).

    ``atomic``: write at most ``PIPE_BUF`` bytes at a time, cut after a line's end (a
    pipe). ``on_drained``: called on the loop when what waited has all been written."""

    def __init__(self, fd: int, *, atomic: bool, max_lines: int, newline: bytes = b"\n",
                 on_drained: Callable[[], None] | None = None,
                 write: Callable[[int, Any], int] = os.write) -> None:
        self.fd = fd
        self.atomic = atomic
        self.max_lines = max_lines
        self.newline = newline
        self.on_drained = on_drained
        self._write = write
        # What waits, in order: (bytes, the lines they end); the first may be part-written.
        self._waiting: deque[tuple[memoryview, int]] = deque()
        self.lines_waiting = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # while armed
        self._retry: asyncio.TimerHandle | None = None  # armed by a timer, not the fd
        self.closed = False

    def write(self, data: bytes, lines: int) -> bool:
        """Write ``data`` (``lines`` whole lines) now, or keep what the descriptor does
        not take for later; False, and nothing kept, when ``max_lines`` lines would then
        be waiting (the caller drops them)."""
        if self.closed:
            return False
        if self._waiting:  # behind what waits already: after it, in order
            if self.lines_waiting + lines > self.max_lines:
                return False
            self._keep(memoryview(data), lines)
            return True
        view = memoryview(data)
        while view:
            size = self._chunk(view)
            try:
                done = self._write(self.fd, view[:size])
            except BlockingIOError:
                done = 0
            except InterruptedError:
                continue
            except OSError:  # a sink gone (EPIPE, EBADF, ENOSPC): nothing to wait for
                return False
            if done < size:  # full: the rest waits (its lines, one at least)
                rest = view[done:]
                left = lines if done == 0 and len(rest) == len(data) else max(
                    1, bytes(rest).count(self.newline))
                if left > self.max_lines:
                    return False
                self._keep(rest, left)
                self._arm()
                return True
            view = view[size:]
        return True

    def _chunk(self, view: memoryview) -> int:
        """How much of ``view`` to write at once: all of it, or for a pipe at most
        ``PIPE_BUF`` bytes ending after a line (a longer line alone goes whole)."""
        if not self.atomic or len(view) <= PIPE_BUF:
            return len(view)
        cut = bytes(view[:PIPE_BUF]).rfind(self.newline)
        if cut < 0:  # one line longer than PIPE_BUF: to its end, not atomic
            end = bytes(view).find(self.newline)
            return len(view) if end < 0 else end + len(self.newline)
        return cut + len(self.newline)

    def _keep(self, view: memoryview, lines: int) -> None:
        self._waiting.append((view, lines))
        self.lines_waiting += lines

    def _arm(self) -> None:
        """Write what waits when the descriptor takes it (one the loop cannot watch
        is tried again shortly)."""
        if self._loop is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop: what waits goes with the next drain()
            return
        try:
            loop.add_writer(self.fd, self._drain)
            self._retry = None
        except (OSError, ValueError):  # not pollable
            self._retry = loop.call_later(_RETRY_S, self._drain)
        self._loop = loop

    def _disarm(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        else:
            with contextlib.suppress(Exception):
                loop.remove_writer(self.fd)

    def _drain(self) -> None:
        """The descriptor is writable: write what waits, in order, as far as it goes."""
        waiting = self._waiting
        while waiting:
            view, lines = waiting[0]
            size = self._chunk(view)
            try:
                done = self._write(self.fd, view[:size])
            except (BlockingIOError, InterruptedError):
                done = 0
            except OSError:  # the sink is gone: what waits is lost
                waiting.clear()
                self.lines_waiting = 0
                break
            if done < len(view):  # counted as waiting until the whole of it is out
                waiting[0] = (view[done:], lines)
                if done < size:  # full again
                    if self._retry is not None:
                        self._loop = None
                        self._arm()
                    return
                continue
            waiting.popleft()
            self.lines_waiting -= lines
        self._disarm()
        if self.on_drained is not None:
            self.on_drained()

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for what waits to be written; whether it was."""
        loop = asyncio.get_running_loop()
        if self._waiting:
            self._drain()
        deadline = loop.time() + timeout_s
        while self._waiting and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return not self._waiting

    def close(self) -> int:
        """Stop writing; the number of lines that were still waiting (lost)."""
        self._disarm()
        lost, self.lines_waiting = self.lines_waiting, 0
        self._waiting.clear()
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                os.close(self.fd)
        return lost


def open_sink(stream: IO[str], max_lines: int, newline: bytes = b"\n",
              on_drained: Callable[[], None] | None = None) -> LineSink | None:
    """A :class:`LineSink` onto where ``stream`` writes, or None (no descriptor, or one
    that cannot be made non-blocking without touching the stream's own: see the module)."""
    try:
        fd = stream.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None
    if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        return None
    try:
        own = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENXIO, errno.EACCES, errno.EPERM):
            raise
        return None
    return LineSink(own, atomic=stat.S_ISFIFO(mode), max_lines=max_lines, newline=newline,
                    on_drained=on_drained)
