"""``PeerClient``: this balancer's one persistent channel to one peer.

One ``grpc.aio.secure_channel`` per peer, opened at :meth:`PeerClient.start` and kept
connected (keepalive pings, and a watcher that reconnects an idle channel), so no
forwarded request pays for a TCP or TLS handshake. The channel verifies the peer's
certificate against the mesh CA *for the peer's balancer id* (``ssl_target_name_override``),
so the address may be an IP or a load-balanced name and the identity still holds.

Heartbeats: one bidirectional stream per pair of balancers is enough, since the server
answers each heartbeat with its own. By convention the balancer whose id sorts first
opens it (:func:`initiates_heartbeat`); the other side's client keeps its channel for
forwarding only. The stream sends every ``interval`` (0.2 s) and feeds replies into the
shared :class:`PeerState`; on any error it reconnects with jittered exponential backoff
(``backoff_initial`` 0.05 s, doubling to ``backoff_max`` 1 s). Liveness follows from the
heartbeats that arrive, not from the stream's status.

Forward: :meth:`PeerClient.forward` returns a :class:`ForwardCall`, an async iterator
of response chunks that owns the RPC: the timeout becomes the gRPC deadline (the server
sees it as ``context.time_remaining()``), and a consumer that is cancelled, calls
``aclose()``/``cancel()``, leaves ``async with``, or drops the call cancels the RPC, which
cancels the server's handler. gRPC errors surface as :mod:`skymesh.mesh.errors` types.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import weakref
from types import TracebackType
from typing import Any

import grpc

from skymesh.mesh.errors import PeerError, PeerUnavailable, from_rpc_error
from skymesh.mesh.heartbeat import (
    DEFAULT_MAX_HEARTBEAT_BYTES,
    DEFAULT_SUMMARY_INTERVAL_S,
    HeartbeatSession,
    LocalSummary,
    OnHeartbeat,
)
from skymesh.mesh.proto import pb, pb_grpc
from skymesh.mesh.server import DEFAULT_MAX_MESSAGE_BYTES
from skymesh.mesh.state import Liveness, PeerState, PeerView
from skymesh.mesh.tls import TlsFiles

log = logging.getLogger(__name__)

DEFAULT_KEEPALIVE_S = 10.0


def initiates_heartbeat(local_id: str, peer_id: str) -> bool:
    """Whether ``local_id`` opens the pair's heartbeat stream (the smaller id does)."""
    return local_id < peer_id


def channel_options(peer_id: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                    keepalive_s: float = DEFAULT_KEEPALIVE_S) -> list[tuple[str, Any]]:
    return [
        ("grpc.ssl_target_name_override", peer_id),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Find a dead connection on an idle channel within keepalive + timeout.
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC's defaults (1 s doubling to 120 s) would keep a restarted peer DOWN for
        # minutes; peers are few, so retry connecting at least every second.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        # Never drop the connection for idleness: it must be warm for the next forward.
        ("grpc.client_idle_timeout_ms", 2**31 - 1),
    ]


class ForwardCall:
    """The response chunks of one forwarded request (see the module docstring)."""

    def __init__(self, peer: str, call: grpc.aio.UnaryStreamCall) -> None:
        self.peer = peer
        self._call = call
        self._aborted: str | None = None

    def __aiter__(self) -> ForwardCall:
        return self

    async def __anext__(self) -> pb.ForwardChunk:
        if self._aborted is not None:
            raise PeerUnavailable(self.peer, self._aborted)
        try:
            msg = await self._call.read()
        except asyncio.CancelledError:
            self._call.cancel()
            task = asyncio.current_task()
            if self._aborted is not None and (task is None or not task.cancelling()):
                # Cancelled by abort(), not by our consumer: an error it can act on.
                raise PeerUnavailable(self.peer, self._aborted) from None
            raise
        except grpc.aio.AioRpcError as exc:
            if self._aborted is not None:
                raise PeerUnavailable(self.peer, self._aborted) from None
            raise from_rpc_error(self.peer, exc) from None
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        chunk: pb.ForwardChunk = msg
        return chunk

    def abort(self, reason: str) -> None:
        """Fail the call from outside: its reader gets :class:`PeerUnavailable`."""
        if self._aborted is None and not self._call.done():
            self._aborted = reason
            self._call.cancel()

    def cancel(self) -> bool:
        """Cancel the RPC (a no-op once it finished); the server's handler is cancelled."""
        return bool(self._call.cancel())

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> ForwardCall:
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.cancel()


class PeerClient:
    def __init__(
        self,
        peer_id: str,
        address: str,
        state: PeerState,
        tls: TlsFiles,
        *,
        local_summary: LocalSummary | None = None,
        on_heartbeat: OnHeartbeat | None = None,
        heartbeat: bool = True,
        interval: float | None = None,
        summary_interval: float = DEFAULT_SUMMARY_INTERVAL_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_heartbeat_bytes: int = DEFAULT_MAX_HEARTBEAT_BYTES,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        backoff_initial: float = 0.05,
        backoff_max: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        if heartbeat and local_summary is None:
            raise ValueError("a heartbeating client needs local_summary")
        self.peer_id = peer_id
        self.address = address
        self.state = state
        self.tls = tls
        self.local_summary = local_summary
        self.on_heartbeat = on_heartbeat
        self.heartbeat = heartbeat
        self.interval = interval if interval is not None else state.interval
        self.summary_interval = summary_interval
        self.max_message_bytes = max_message_bytes
        self.max_heartbeat_bytes = max_heartbeat_bytes
        self.keepalive_s = keepalive_s
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.rng = rng or random.Random()
        self.session: HeartbeatSession | None = None  # the current stream's, for metrics
        self.stream_errors = 0
        self.last_error: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._calls: weakref.WeakSet[ForwardCall] = weakref.WeakSet()  # in flight

    def view(self) -> PeerView:
        return self.state.view(self.peer_id)

    async def start(self) -> None:
        ca, cert, key = self.tls.read()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                             certificate_chain=cert)
        self._channel = grpc.aio.secure_channel(
            self.address, creds,
            options=channel_options(self.peer_id, self.max_message_bytes, self.keepalive_s))
        self._stub = pb_grpc.PeeringStub(self._channel)
        self.state.add_peer(self.peer_id)
        name = f"peer-{self.peer_id}"
        self._tasks.append(asyncio.create_task(self._keep_connected(), name=f"{name}-channel"))
        self._tasks.append(asyncio.create_task(self._abort_forwards_when_down(),
                                               name=f"{name}-forward-watch"))
        if self.heartbeat:
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(),
                                                   name=f"{name}-heartbeat"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def channel_state(self) -> grpc.ChannelConnectivity | None:
        return None if self._channel is None else self._channel.get_state()

    # -- forwarding --------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether the channel is connected now (a forward would not wait for a handshake
        or fail fast in reconnect backoff)."""
        ch = self._channel
        return ch is not None and \
            ch.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY

    def forward(self, request: pb.ForwardRequest, timeout: float | None = None, *,
                check_liveness: bool = True) -> ForwardCall:
        """Send ``request`` to the peer; iterate the result for the response chunks.

        Sets ``forwarded_hops`` to 1 and ``origin_region`` (if empty) on ``request``, so
        retrying the same request on another peer is safe. Never call this for a request
        that came from a peer: that is the dispatcher's rule (one hop), which the peer's
        server only backs up for ``forwarded_hops`` > 1. Raises :class:`PeerUnavailable`
        at once if the peer is DOWN.
        """
        if self._stub is None:
            raise PeerUnavailable(self.peer_id, "client not started")
        if check_liveness and self.state.liveness(self.peer_id) is Liveness.DOWN:
            raise PeerUnavailable(self.peer_id, "peer is DOWN")
        request.forwarded_hops = 1
        if not request.origin_region:
            request.origin_region = self.state.identity.region
        call = ForwardCall(self.peer_id, self._stub.Forward(request, timeout=timeout))
        if self.state.liveness(self.peer_id) is not Liveness.DOWN:
            self._calls.add(call)
        return call

    # -- background tasks --------------------------------------------------------------------
    async def _keep_connected(self) -> None:
        # An idle channel whose connection dropped stays IDLE until the next call;
        # reconnect it now so a forward never waits for a handshake.
        channel = self._channel
        assert channel is not None
        state = channel.get_state(try_to_connect=True)
        while True:
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=True)

    async def _abort_forwards_when_down(self) -> None:
        # A partition leaves the TCP connection open (packets vanish), so gRPC notices only
        # when a keepalive ping goes unanswered (keepalive_s + 5 s), and a forward waiting
        # for its first chunk waits that long. The heartbeats mark the peer DOWN much
        # sooner (down_after): fail the forwards in flight then, so the balancer retries
        # one that has no byte yet elsewhere and ends a started stream with an error.
        while True:
            await asyncio.sleep(self.interval)
            if self._calls and self.state.liveness(self.peer_id) is Liveness.DOWN:
                calls = list(self._calls)
                self._calls.clear()
                log.warning("peer %s is DOWN: failing %d forwarded request(s) in flight",
                            self.peer_id, len(calls))
                for call in calls:
                    call.abort("peer went DOWN (no heartbeat) while the request was on it")

    async def _heartbeat_loop(self) -> None:
        delay = self.backoff_initial
        while True:
            assert self.local_summary is not None
            session = HeartbeatSession(self.state, self.peer_id, self.local_summary,
                                       self.on_heartbeat, max_bytes=self.max_heartbeat_bytes,
                                       summary_interval=self.summary_interval)
            self.session = session
            try:
                await self._run_stream(session)
                self.last_error = "stream ended by the peer"
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                self.last_error = f"{exc.code().name}: {exc.details()}"
            except PeerError as exc:
                self.last_error = str(exc)
            except Exception as exc:  # keep heartbeating whatever went wrong
                log.exception("heartbeat stream to %s failed", self.peer_id)
                self.last_error = repr(exc)
            self.stream_errors += 1
            log.debug("heartbeat stream to %s: %s", self.peer_id, self.last_error)
            if session.received:
                delay = self.backoff_initial  # it worked for a while: retry promptly
            await asyncio.sleep(delay * self.rng.uniform(0.8, 1.2))
            delay = min(delay * 2, self.backoff_max)

    async def _run_stream(self, session: HeartbeatSession) -> None:
        # Wait for the connection first: the first heartbeat's send time would otherwise
        # include the handshake and spoil the first RTT sample. While the peer is
        # unreachable this waits on the channel's own reconnect backoff.
        assert self._channel is not None
        await self._channel.channel_ready()
        call = self._stub.Heartbeat(wait_for_ready=True)

        async def send() -> None:
            loop = asyncio.get_running_loop()
            due = loop.time()
            while True:
                await call.write(session.outgoing())
                due += self.interval
                now = loop.time()
                if due < now:
                    due = now  # fell behind (a stalled loop): no burst to catch up
                await asyncio.sleep(due - now)

        async def receive() -> None:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    return
                session.incoming(msg)

        tasks = [asyncio.create_task(send()), asyncio.create_task(receive())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # raises the first failure
        finally:
            call.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
