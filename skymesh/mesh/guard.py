"""``PortGuard``: admission caps and a handshake deadline in front of the peering port.

gRPC's server accepts every TCP connection and holds it for its TLS handshake until its
own handshake timeout (120 s by default), with no cap per address or in total: a flood
of plain connects that never send a byte fills the process's file table, and the HTTP
side (same process) then fails every accept and every upstream connect. The guard owns
the public peering port instead. It admits a connection or closes it at once, and
splices an admitted one to the gRPC server, which listens on a private unix socket
(a folder only this user can open), so the caps cannot be walked around.

A connection is *handshaking* for its first ``handshake_timeout_s`` (+ 1 s, since
gRPC's timer starts at its own accept, just after ours). gRPC closes it by then unless
the mutual-TLS handshake completed (``grpc.server_handshake_timeout_ms``, see
:func:`grpc_options`); the guard also closes one where either side never spoke, so
plain connects go even if gRPC's option changed meaning. One still open after that
holds a client certificate from the mesh CA: it is *established*. Caps:

- ``max_handshakes`` (64) and ``max_handshakes_per_address`` (8): handshaking
  connections, in total and from one address (the unauthenticated flood);
- ``max_connections`` (256) and ``max_connections_per_address`` (32): every connection,
  handshaking or established (a peer with a valid certificate that opens many).

A connection over a cap is aborted as it is accepted (nothing to say: the client
expects TLS); ``skymesh_mesh_connections_refused_total{reason}`` counts it and a
warning names the cap, at most once per reason every 10 s. Closed at the deadline:
``skymesh_mesh_connections_closed_total{reason="handshake_timeout"}``. Open now:
``skymesh_mesh_connections{state}``. File descriptors: three per admitted connection
(ours, our end of the splice, gRPC's), so at most ``3 * max_connections`` for peering,
far under the process limit whatever is thrown at the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from skymesh.mesh.limits import DEFAULT_GUARD_LIMITS, GuardLimits
from skymesh.obs.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

HANDSHAKE_GRACE_S = 1.0
LOG_EVERY_S = 10.0

TOTAL_LIMIT = "total_limit"
ADDRESS_LIMIT = "address_limit"
HANDSHAKE_LIMIT = "handshake_limit"
HANDSHAKE_ADDRESS_LIMIT = "handshake_address_limit"
REASONS = (TOTAL_LIMIT, ADDRESS_LIMIT, HANDSHAKE_LIMIT, HANDSHAKE_ADDRESS_LIMIT)
HANDSHAKE_TIMEOUT = "handshake_timeout"


def grpc_options(limits: GuardLimits) -> list[tuple[str, Any]]:
    """gRPC server options that go with the guard: its handshake deadline."""
    return [("grpc.server_handshake_timeout_ms", max(1, round(limits.handshake_timeout_s
                                                               * 1000)))]


class Admission:
    """The counts behind the caps. Pure: the guard calls it on accept, at the handshake
    deadline and on close."""

    def __init__(self, limits: GuardLimits) -> None:
        self.limits = limits
        self.open: Counter[str] = Counter()  # by address, every admitted connection
        self.handshaking: Counter[str] = Counter()
        self.total = self.total_handshaking = 0

    def admit(self, address: str) -> str | None:
        """Count a new (handshaking) connection in, or return the cap it would break."""
        lim = self.limits
        if self.total >= lim.max_connections:
            return TOTAL_LIMIT
        if self.open[address] >= lim.max_connections_per_address:
            return ADDRESS_LIMIT
        if self.total_handshaking >= lim.max_handshakes:
            return HANDSHAKE_LIMIT
        if self.handshaking[address] >= lim.max_handshakes_per_address:
            return HANDSHAKE_ADDRESS_LIMIT
        self.total += 1
        self.open[address] += 1
        self.total_handshaking += 1
        self.handshaking[address] += 1
        return None

    def established(self, address: str) -> None:
        """A connection of ``address`` passed its handshake deadline still open."""
        self.total_handshaking -= 1
        _decrement(self.handshaking, address)

    def release(self, address: str, handshaking: bool) -> None:
        self.total -= 1
        _decrement(self.open, address)
        if handshaking:
            self.established(address)


def _decrement(counts: Counter[str], key: str) -> None:
    left = counts[key] - 1
    if left > 0:
        counts[key] = left
    else:
        del counts[key]


class PortGuard(Collector):
    """The public peering listener (see the module docstring); also the Prometheus
    collector of its metrics."""

    def __init__(self, limits: GuardLimits = DEFAULT_GUARD_LIMITS, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.admission = Admission(limits)
        self.refused: Counter[str] = Counter()
        self.closed: Counter[str] = Counter()
        self._log = RateLimitedLog(log, LOG_EVERY_S, clock)
        self._server: asyncio.Server | None = None
        self._dir: str | None = None
        self._conns: set[_ClientSide] = set()

    def private_address(self) -> str:
        """The gRPC server's address (``unix:PATH``), in a folder made for it."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="skymesh-peering-")  # mode 0700
        return f"unix:{self.socket_path}"

    @property
    def socket_path(self) -> str:
        assert self._dir is not None
        return os.path.join(self._dir, "grpc.sock")

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; returns the port (useful with ``port=0``)."""
        self.private_address()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ClientSide(self), host, port,
                                                backlog=1024)
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    def close(self) -> None:
        """Stop accepting; admitted connections stay."""
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        """Stop accepting and cut every connection."""
        if self._server is not None:
            self._server.close()
            for conn in list(self._conns):
                conn.abort()
            await self._server.wait_closed()
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- bookkeeping -------------------------------------------------------------------
    def note_refused(self, reason: str, address: str) -> None:
        self.refused[reason] += 1
        a, lim = self.admission, self.limits
        why = {
            TOTAL_LIMIT: f"{a.total} connections open (max_connections "
                         f"{lim.max_connections})",
            ADDRESS_LIMIT: f"{a.open[address]} connections open from it "
                           f"(max_connections_per_address {lim.max_connections_per_address})",
            HANDSHAKE_LIMIT: f"{a.total_handshaking} connections in their TLS handshake "
                             f"(max_handshakes {lim.max_handshakes})",
            HANDSHAKE_ADDRESS_LIMIT: f"{a.handshaking[address]} connections in their TLS "
                                     "handshake from it (max_handshakes_per_address "
                                     f"{lim.max_handshakes_per_address})",
        }[reason]
        self._log(logging.WARNING, reason,
                  f"peering port: refused a connection from {address}: {why}")

    def note_closed(self, reason: str, address: str) -> None:
        self.closed[reason] += 1
        self._log(logging.INFO, reason, f"peering port: closed a connection from {address}: "
                                        f"no TLS handshake within "
                                        f"{self.limits.handshake_timeout_s:g} s")


    # -- metrics -----------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        a = self.admission
        conns = GaugeMetricFamily("skymesh_mesh_connections",
                                  "Connections open on the peering port", labels=["state"])
        conns.add_metric(["handshaking"], a.total_handshaking)
        conns.add_metric(["established"], a.total - a.total_handshaking)
        yield conns
        refused = CounterMetricFamily("skymesh_mesh_connections_refused",
                                      "Peering connections refused at a cap", labels=["reason"])
        for reason in REASONS:
            refused.add_metric([reason], self.refused[reason])
        yield refused
        closed = CounterMetricFamily("skymesh_mesh_connections_closed",
                                     "Peering connections closed by the guard",
                                     labels=["reason"])
        closed.add_metric([HANDSHAKE_TIMEOUT], self.closed[HANDSHAKE_TIMEOUT])
        yield closed


class _ClientSide(asyncio.Protocol):
    """One connection to the public port; once admitted, spliced to gRPC's socket."""

    def __init__(self, guard: PortGuard) -> None:
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.grpc: _GrpcSide | None = None
        self.address = ""
        self.handshaking = False
        self.spoke = False  # the client sent a byte
        # What arrived before gRPC's end was connected: reading is paused then, but a
        # transport may deliver what it had already read (uvloop does).
        self._early: list[bytes] = []
        self.done = False
        self._timer: asyncio.TimerHandle | None = None
        self._connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else "local"
        guard = self.guard
        reason = guard.admission.admit(self.address)
        if reason is not None:
            self.done = True
            guard.note_refused(reason, self.address)
            self.transport.abort()
            return
        self.handshaking = True
        guard._conns.add(self)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(guard.limits.handshake_timeout_s + HANDSHAKE_GRACE_S,
                                      self._deadline)
        self.transport.pause_reading()  # until gRPC's end is connected
        self._connecting = loop.create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, side = await loop.create_unix_connection(lambda: _GrpcSide(self),
                                                        self.guard.socket_path)
        except OSError as exc:
            log.warning("peering port: cannot reach the gRPC server: %s", exc)
            self.abort()
            return
        if self.done:
            side.abort()
            return
        self.grpc = side
        assert side.transport is not None and self.transport is not None
        for data in self._early:
            side.transport.write(data)
        self._early.clear()
        self.transport.resume_reading()

    def _deadline(self) -> None:
        self._timer = None
        if self.done or not self.handshaking:
            return
        if not (self.spoke and self.grpc is not None and self.grpc.spoke):
            self.guard.note_closed(HANDSHAKE_TIMEOUT, self.address)
            self.abort()
            return
        self.handshaking = False
        self.guard.admission.established(self.address)

    def data_received(self, data: bytes) -> None:
        self.spoke = True
        if self.grpc is not None and self.grpc.transport is not None:
            self.grpc.transport.write(data)
        else:
            self._early.append(data)

    def pause_writing(self) -> None:  # gRPC writes faster than the peer reads
        if self.grpc is not None and self.grpc.transport is not None:
            self.grpc.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.grpc is not None and self.grpc.transport is not None:
            self.grpc.transport.resume_reading()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        if self.grpc is not None:
            self.grpc.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done:
            return
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.guard._conns.discard(self)
        self.guard.admission.release(self.address, self.handshaking)
        if self.grpc is not None and self.grpc.transport is not None:
            self.grpc.transport.close()  # after what the client sent last is written


class _GrpcSide(asyncio.Protocol):
    def __init__(self, client: _ClientSide) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.spoke = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.spoke = True
        t = self.client.transport
        if t is not None and not self.client.done:
            t.write(data)

    def pause_writing(self) -> None:  # the peer sends faster than gRPC reads
        t = self.client.transport
        if t is not None and not self.client.done:
            t.pause_reading()

    def resume_writing(self) -> None:
        t = self.client.transport
        if t is not None and not self.client.done:
            t.resume_reading()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        t = self.client.transport
        if t is not None and not self.client.done:
            with contextlib.suppress(RuntimeError):
                t.close()  # after what gRPC sent last is written
