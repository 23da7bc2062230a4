"""A peer region's non-streamed reply is buffered to be answered whole
(``Forwarder.forward_peer``): it stops at ``upstream.max_response_body_bytes`` with a 502,
the gRPC call left (cancelled) rather than read to its end. A scripted call stands in
for the mesh; the balancer around the forwarder is the few attributes it reads."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from skymesh.balancer.config import UpstreamConfig
from skymesh.balancer.errors import UpstreamFailed
from skymesh.balancer.forwarding import Forwarder
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.relay import RequestCore, Switches
from skymesh.mesh import pb

MB = 1 << 20


class ScriptedCall:
    """The chunks of one forwarded request, made as they are read."""

    def __init__(self, chunks: Iterator[Any]) -> None:
        self._chunks = chunks
        self.taken = 0
        self.left = False

    async def __aenter__(self) -> ScriptedCall:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.left = True  # ForwardCall cancels the RPC here

    def __aiter__(self) -> ScriptedCall:
        return self

    async def __anext__(self) -> Any:
        try:
            chunk = next(self._chunks)
        except StopIteration:
            raise StopAsyncIteration from None
        self.taken += 1
        return chunk


def reply(status: int, parts: int) -> Iterator[Any]:
    yield pb.ForwardChunk(head=pb.ForwardChunk.ResponseHead(
        status=status, content_type="application/json"))
    for _ in range(parts):
        yield pb.ForwardChunk(data=b" " * MB)


def forwarder(call: ScriptedCall, cap: int) -> tuple[Forwarder, BalancerMetrics]:
    """A forwarder whose collaborators are the few pieces ``forward_peer`` uses."""
    metrics = BalancerMetrics()
    dispatcher = SimpleNamespace(first_byte=lambda ticket: None,
                                 complete=lambda *a, **k: None)
    core = RequestCore(dispatcher, metrics, lambda: 0.0, lambda: None,  # type: ignore[arg-type]
                       Switches(SimpleNamespace(records_peer=False)))  # type: ignore[arg-type]
    cfg = SimpleNamespace(upstream=UpstreamConfig(max_response_body_bytes=cap), tenants=None)
    mesh = SimpleNamespace(forward=lambda *args, **kwargs: call)
    return Forwarder(core, cfg, None, None, mesh, None, None, {},  # type: ignore[arg-type]
                     lambda model: 1.0), metrics


def request_parts() -> tuple[Any, Any, Any]:
    route = SimpleNamespace(request_id="r1", model="m", affinity_key=None)
    return (SimpleNamespace(path="/v1/chat/completions"), SimpleNamespace(route=route, batch=False),
            SimpleNamespace(stream=False))


@pytest.mark.parametrize("status", [200, 400, 500])
async def test_a_peers_reply_over_the_cap_is_a_502_and_not_read_on(status: int) -> None:
    call = ScriptedCall(reply(status, 64))
    fwd, metrics = forwarder(call, 4 * MB)
    request, ticket, intake = request_parts()
    with pytest.raises(UpstreamFailed, match="exceeds"):
        await fwd.forward_peer(request, ticket, "peer-1", b"{}", intake, 0.0)
    assert call.taken <= 6 and call.left  # the head and about the cap's worth
    assert metrics.replica_limits.labels("peer-1", "body")._value.get() == 1


async def test_a_peers_reply_under_the_cap_is_answered_whole() -> None:
    call = ScriptedCall(reply(200, 2))
    fwd, _ = forwarder(call, 4 * MB)
    request, ticket, intake = request_parts()
    resp, outcome = await fwd.forward_peer(request, ticket, "peer-1", b"{}", intake, 0.0)
    assert outcome == "ok" and resp.status == 200 and len(resp.body) == 2 * MB
