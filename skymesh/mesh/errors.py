"""Peering errors. gRPC failures are mapped once, here, to these types (and keep the
gRPC status code), so callers never catch ``grpc.aio.AioRpcError``::

    PeerError                  any failed call to a peer (.peer, .code)
    ├── PeerUnavailable        UNAVAILABLE, or the peer is DOWN (handshake refusals too:
    │                          TLS failures surface as UNAVAILABLE)
    ├── PeerDeadlineExceeded   DEADLINE_EXCEEDED
    ├── PeerRefused            UNAUTHENTICATED / PERMISSION_DENIED
    └── PeerProtocolError      RESOURCE_EXHAUSTED, INVALID_ARGUMENT, FAILED_PRECONDITION:
                               an oversized or malformed message, a second hop
"""

from __future__ import annotations

import grpc


class PeerError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, peer: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"peer {peer}: {message}")
        self.peer = peer
        if code is not None:
            self.code = code


class PeerUnavailable(PeerError):
    code = grpc.StatusCode.UNAVAILABLE


class PeerDeadlineExceeded(PeerError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PeerRefused(PeerError):
    code = grpc.StatusCode.PERMISSION_DENIED


class PeerProtocolError(PeerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


_BY_CODE: dict[grpc.StatusCode, type[PeerError]] = {
    grpc.StatusCode.UNAVAILABLE: PeerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: PeerDeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: PeerRefused,
    grpc.StatusCode.PERMISSION_DENIED: PeerRefused,
    grpc.StatusCode.RESOURCE_EXHAUSTED: PeerProtocolError,
    grpc.StatusCode.INVALID_ARGUMENT: PeerProtocolError,
    grpc.StatusCode.FAILED_PRECONDITION: PeerProtocolError,
}


def from_rpc_error(peer: str, err: grpc.aio.AioRpcError) -> PeerError:
    code = err.code()
    cls = _BY_CODE.get(code, PeerError)
    return cls(peer, f"{code.name}: {err.details() or ''}".rstrip(": "), code)
