"""Listening sockets whose waiting connections are accepted in batches.

Why not the event loop's own server: libuv (under uvloop) accepts ONE connection each
time the listening socket polls readable, since libuv 1.45 ("unix: don't accept()
connections in a loop", libuv PR 3696), and relies on the next loop iteration for the
next one. A balancer's loop iteration serving 256 busy connections lasts 10-30 ms, so a
burst of 256 new clients took 3-5 s to be accepted, one per iteration, while each
client's first request waited in the kernel's accept queue: that was skymesh-lb's c=256
tail (docs/notes/c256-tail.md). Here every readable event accepts what is waiting, up to
:data:`ACCEPT_BATCH`, on either loop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
from collections.abc import Callable, Iterable

log = logging.getLogger("skymesh.net.accept")

# Connections accepted per readable event of one listening socket: bounds the work one
# loop iteration spends on new clients, while a burst of hundreds is taken in a few
# iterations rather than one iteration each.
ACCEPT_BATCH = 256
# After running out of descriptors (EMFILE and kin), wait this long before accepting
# again, as asyncio's own servers do, rather than spin on a readable socket.
RETRY_DELAY_S = 1.0
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def accept_waiting(sock: socket.socket, limit: int) -> tuple[list[socket.socket], OSError | None]:
    """Accept up to ``limit`` connections waiting on the non-blocking ``sock``.

    Returns the accepted sockets (non-blocking) and the error that stopped the batch, if
    it was not simply an empty queue.
    """
    out: list[socket.socket] = []
    while len(out) < limit:
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            return out, None
        except ConnectionAbortedError:
            continue  # the client left before we took it: the next one may be there
        except OSError as exc:
            return out, exc
        conn.setblocking(False)
        out.append(conn)
    return out, None


def listen_sockets(host: str | None, port: int, backlog: int) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for ``host:port`` (every address the name
    resolves to, as ``loop.create_server`` binds them; port 0: one free port for all)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    seen: set[tuple[int, str | int]] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr[0]) in seen:
                continue
            seen.add((family, addr[0]))
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # Like asyncio: an IPv6 socket does not take IPv4 too (its own socket does).
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            s.bind(addr)
            s.listen(backlog)
            s.setblocking(False)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


class BatchAcceptServer(asyncio.AbstractServer):
    """Serves ``protocol_factory`` on listening sockets, accepting in batches.

    Each accepted socket is handed to ``loop.connect_accepted_socket`` (TLS included), so
    transports and protocols are the loop's own, as with ``loop.create_server``.
    """

    def __init__(self, socks: Iterable[socket.socket],
                 protocol_factory: Callable[[], asyncio.BaseProtocol], *,
                 ssl_context: ssl.SSLContext | None = None,
                 ssl_handshake_timeout: float | None = None,
                 batch: int = ACCEPT_BATCH) -> None:
        self._loop = asyncio.get_running_loop()
        self._socks = tuple(socks)
        self._factory = protocol_factory
        self._ssl = ssl_context
        self._handshake = ssl_handshake_timeout if ssl_context is not None else None
        self._batch = batch
        self._serving = False
        self._adopting: set[asyncio.Task[None]] = set()

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return self._socks

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        if self._serving:
            return
        self._serving = True
        for s in self._socks:
            self._loop.add_reader(s.fileno(), self._on_readable, s)

    def close(self) -> None:
        if self._serving:
            for s in self._socks:
                self._loop.remove_reader(s.fileno())
        self._serving = False
        for s in self._socks:
            s.close()

    async def wait_closed(self) -> None:
        # Connections already accepted belong to the application (aiohttp's Server
        # closes them); only those still being set up are waited for.
        if self._adopting:
            await asyncio.gather(*self._adopting, return_exceptions=True)

    async def serve_forever(self) -> None:
        await self.start_serving()
        await asyncio.Event().wait()

    def _on_readable(self, sock: socket.socket) -> None:
        conns, exc = accept_waiting(sock, self._batch)
        for conn in conns:
            task = self._loop.create_task(self._adopt(conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)
        if exc is None:
            return
        if exc.errno in _OUT_OF_RESOURCES and self._serving:
            log.warning("accept on %s failed (%s); accepting again in %.0f s",
                        sock.getsockname(), exc, RETRY_DELAY_S)
            self._loop.remove_reader(sock.fileno())
            self._loop.call_later(RETRY_DELAY_S, self._resume, sock)
        else:
            log.warning("accept on %s failed: %s", sock.getsockname(), exc)

    def _resume(self, sock: socket.socket) -> None:
        if self._serving:
            self._loop.add_reader(sock.fileno(), self._on_readable, sock)

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(
                self._factory, conn, ssl=self._ssl, ssl_handshake_timeout=self._handshake)
        except (OSError, ssl.SSLError) as exc:  # TimeoutError is an OSError
            # A client gone mid-way or a failed TLS handshake: that connection only.
            log.debug("connection not set up: %s", exc)
            conn.close()
