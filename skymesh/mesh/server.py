"""``PeerServer``: the gRPC side of peering that other balancers call.

Mutual TLS with client certificates required and verified against the mesh CA; the
client certificate's CN must be on the allow-list (checked in every RPC from the
connection's auth context; a missing identity is UNAUTHENTICATED, an unknown one
PERMISSION_DENIED). A client without a certificate, or with one from another CA, never
gets past the handshake.

Size limits: gRPC's own message caps (``max_message_bytes``, 4 MiB: a forwarded body
must fit; the balancer's HTTP edge should cap bodies below it) and an app-level cap on
heartbeats (``max_heartbeat_bytes``, 16 KiB): a larger one ends the stream with
RESOURCE_EXHAUSTED.

The public port belongs to a :class:`~skymesh.mesh.guard.PortGuard` (caps per address
and in total, a handshake deadline); gRPC itself listens on a private unix socket behind
it, with the same handshake deadline. ``guard=None`` binds gRPC to the port directly.

Heartbeat: the server answers every heartbeat it receives with its own (stamped, with
the echo for RTT), so one stream per pair serves both ends.

Forward: runs ``forward_handler(request, context)`` and streams its chunks. The gRPC
deadline is visible to the handler as ``context.time_remaining()``; a client that
cancels (or disconnects) cancels the handler's task, so the handler sees
``asyncio.CancelledError`` at its next await. A request that was already forwarded
(``forwarded_hops`` > 1) is refused with FAILED_PRECONDITION.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Collection
from typing import Any

import grpc

from skymesh.mesh.errors import PeerError
from skymesh.mesh.guard import PortGuard, grpc_options
from skymesh.mesh.heartbeat import (
    DEFAULT_MAX_HEARTBEAT_BYTES,
    DEFAULT_SUMMARY_INTERVAL_S,
    HeartbeatSession,
    LocalSummary,
    OnHeartbeat,
)
from skymesh.mesh.limits import DEFAULT_GUARD_LIMITS, GuardLimits
from skymesh.mesh.proto import pb, pb_grpc
from skymesh.mesh.state import PeerState
from skymesh.mesh.tls import TlsFiles

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_HOPS = 1

ForwardHandler = Callable[[pb.ForwardRequest, grpc.aio.ServicerContext],
                          AsyncIterator[pb.ForwardChunk]]


def peer_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The CN of the calling peer's verified client certificate, if any."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else None


def _origin_form(path: str) -> bool:
    """``/a/b`` style: starts with one slash, printable ASCII, no whitespace."""
    return path.startswith("/") and not path.startswith("//") and \
        all(33 <= ord(c) < 127 for c in path)


def _control_char(value: str) -> str | None:
    """The first control character in ``value`` (as U+XXXX), or None."""
    for c in value:
        if ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029":
            return f"U+{ord(c):04X}"
    return None


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Clients ping idle channels (see client.channel_options); without these the
        # server answers frequent pings with GOAWAY "too_many_pings".
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 4000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
    ]


class PeerServer:
    def __init__(
        self,
        state: PeerState,
        tls: TlsFiles,
        *,
        allowed_peers: Collection[str],
        local_summary: LocalSummary,
        forward_handler: ForwardHandler,
        on_heartbeat: OnHeartbeat | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_heartbeat_bytes: int = DEFAULT_MAX_HEARTBEAT_BYTES,
        summary_interval: float = DEFAULT_SUMMARY_INTERVAL_S,
        maximum_concurrent_rpcs: int | None = None,
        guard: GuardLimits | None = DEFAULT_GUARD_LIMITS,
    ) -> None:
        self.state = state
        self.tls = tls
        self.allowed = set(allowed_peers)
        self.local_summary = local_summary
        self.forward_handler = forward_handler
        self.on_heartbeat = on_heartbeat
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.max_heartbeat_bytes = max_heartbeat_bytes
        self.summary_interval = summary_interval
        self.maximum_concurrent_rpcs = maximum_concurrent_rpcs
        self.guard = PortGuard(guard) if guard is not None else None
        self.sessions: dict[str, HeartbeatSession] = {}  # latest stream per peer
        self.refused = 0
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> int:
        """Bind and serve; returns the port (useful with ``port=0``)."""
        ca, cert, key = self.tls.read()
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                            require_client_auth=True)
        options = server_options(self.max_message_bytes)
        guard = self.guard
        if guard is not None:
            options += grpc_options(guard.limits)
        server = grpc.aio.server(options=options,
                                 maximum_concurrent_rpcs=self.maximum_concurrent_rpcs)
        pb_grpc.add_PeeringServicer_to_server(_Servicer(self), server)
        address = f"{self.host}:{self.port}" if guard is None else guard.private_address()
        port = server.add_secure_port(address, creds)
        if port == 0:
            raise OSError(f"peer server: cannot bind {address}")
        await server.start()
        self._server = server
        if guard is not None:
            try:
                port = await guard.start(self.host, self.port)
            except OSError:
                await self.stop(0)
                raise
        self.port = port
        return port

    async def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving; in-flight calls get ``grace`` seconds, then are cancelled."""
        if self.guard is not None:
            self.guard.close()  # no new connections; the spliced ones end with gRPC's
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self.guard is not None:
            await self.guard.stop()

    def set_allowed(self, peers: Collection[str]) -> None:
        """Replace the allow-list (a membership change). A removed peer's heartbeat stream
        ends at its next message; its in-flight forwards run to completion."""
        self.allowed = set(peers)

    async def authorize(self, context: grpc.aio.ServicerContext) -> str:
        ident = peer_identity(context)
        if ident is not None and ident in self.allowed:
            return ident
        self.refused += 1
        if ident is None:
            code, why = grpc.StatusCode.UNAUTHENTICATED, "no verified client certificate"
        else:
            code, why = grpc.StatusCode.PERMISSION_DENIED, f"{ident!r} is not an allowed peer"
        log.warning("refused a peer call: %s", why)
        await context.abort(code, why)
        raise AssertionError("context.abort returned")  # it always raises


class _Servicer(pb_grpc.PeeringServicer):
    def __init__(self, owner: PeerServer) -> None:
        self.owner = owner

    async def Heartbeat(
        self, request_iterator: AsyncIterable[pb.HeartbeatMsg],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.HeartbeatMsg]:
        o = self.owner
        peer = await o.authorize(context)
        session = HeartbeatSession(o.state, peer, o.local_summary, o.on_heartbeat,
                                   max_bytes=o.max_heartbeat_bytes,
                                   summary_interval=o.summary_interval)
        o.sessions[peer] = session
        async for msg in request_iterator:
            if peer not in o.allowed:  # removed from the membership since the stream began
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{peer!r} is no longer an allowed peer")
            try:
                session.incoming(msg)
            except PeerError as exc:
                log.warning("dropping the heartbeat stream from %s: %s", peer, exc)
                await context.abort(exc.code, str(exc))
            yield session.outgoing()

    async def Forward(
        self, request: pb.ForwardRequest, context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ForwardChunk]:
        o = self.owner
        await o.authorize(context)
        if request.forwarded_hops > MAX_HOPS:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"request {request.request_id} was already forwarded "
                                f"{request.forwarded_hops} times")
        for name in ("request_id", "affinity_key"):
            bad = _control_char(getattr(request, name))
            if bad is not None:
                # These end up in HTTP headers and log lines: CR/LF would split them.
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{name} holds a control character ({bad}): only "
                                    "printable characters are allowed")
        if not _origin_form(request.path):
            # The receiving balancer appends the path to its own base URL: "@host/..."
            # would make it an authority and send the request to another host.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "path must be an absolute path such as /v1/completions")
        chunks = o.forward_handler(request, context)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            # Close the handler's generator now, in this task, so its cleanup runs
            # before the call ends rather than whenever it is collected.
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
