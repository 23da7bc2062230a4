"""Peering over real gRPC on loopback with mutual TLS: heartbeats, liveness across a
restart, forwarding (order, cancellation, deadlines) and refusals."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from support import chain, eventually, make_pki

from skymesh.mesh.client import PeerClient, channel_options
from skymesh.mesh.errors import (
    PeerDeadlineExceeded,
    PeerProtocolError,
    PeerRefused,
    PeerUnavailable,
    from_rpc_error,
)
from skymesh.mesh.heartbeat import prefix_summary
from skymesh.mesh.node import MeshNode
from skymesh.mesh.proto import pb, pb_grpc
from skymesh.mesh.state import Identity, Liveness, PeerState, Verdict, new_identity
from skymesh.mesh.summary import PeerSnapshot
from skymesh.mesh.tls import TlsFiles
from skymesh.prefix import PrefixTrie

pytestmark = pytest.mark.timeout(60)

INTERVAL = 0.2  # the default heartbeat interval




@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"), rogue_id="lb-a")


def chunk_bytes(i: int) -> bytes:
    return bytes([i % 251]) * (1 + (i * 977) % 65536)


class FakeBalancer:
    """A balancer's peering side with fake load, a prefix trie and fake replicas."""

    def __init__(self, pki: Path, region: str, bid: str, port: int = 0) -> None:
        self.trie = PrefixTrie()
        self.paths = [chain([hash(bid) & 0xFFFF, i, *range(30)]) for i in range(5)]
        for p in self.paths:
            self.trie.insert(p, "replica-0")
        self.snapshot = PeerSnapshot()
        self.heard: list[pb.HeartbeatMsg] = []
        self.requests: list[pb.ForwardRequest] = []
        self.peers_seen: list[str] = []
        self.deadlines: list[float | None] = []
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.node = MeshNode(new_identity(region, bid), TlsFiles.in_dir(pki, bid),
                             local_summary=self.local_summary, forward_handler=self.handle,
                             on_heartbeat=self.on_heartbeat, port=port)

    def local_summary(self, include_prefix: bool) -> pb.HeartbeatMsg:
        msg = pb.HeartbeatMsg()
        msg.models.add(model="llama-8b", available_replicas=2, total_replicas=3,
                       queue_length=1, pending_prefill_tokens=4096)
        if include_prefix:
            msg.prefix.CopyFrom(prefix_summary(self.trie))
        return msg

    def on_heartbeat(self, msg: pb.HeartbeatMsg) -> None:
        self.heard.append(msg)
        if msg.HasField("prefix"):
            self.snapshot.insert_summary(msg.balancer_id, msg.prefix.keys, msg.prefix.depths)

    async def handle(self, req: pb.ForwardRequest, ctx: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.ForwardChunk]:
        self.requests.append(req)
        self.peers_seen.append(ctx.peer())
        self.deadlines.append(ctx.time_remaining())
        mode = json.loads(req.body)["mode"]
        yield pb.ForwardChunk(head=pb.ForwardChunk.ResponseHead(
            status=200, content_type="text/event-stream"))
        if mode == "stream":
            for i in range(100):
                yield pb.ForwardChunk(data=chunk_bytes(i))
            yield pb.ForwardChunk(data=b"\xab" * (1 << 20))
        elif mode == "hang":
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise

    async def start(self) -> FakeBalancer:
        await self.node.start()
        return self

    def alive(self, peer: str) -> bool:
        return self.node.state.liveness(peer) is Liveness.ALIVE


def request(mode: str, hops: int = 0) -> pb.ForwardRequest:
    return pb.ForwardRequest(request_id=f"req-{mode}", model="llama-8b",
                             path="/v1/chat/completions", stream=True,
                             body=json.dumps({"mode": mode}).encode(), forwarded_hops=hops)


@pytest.fixture
async def pair(pki: Path) -> AsyncIterator[tuple[FakeBalancer, FakeBalancer]]:
    a = await FakeBalancer(pki, "us", "lb-a").start()
    b = await FakeBalancer(pki, "eu", "lb-b").start()
    await a.node.add_peer("lb-b", b.node.address)
    await b.node.add_peer("lb-a", a.node.address)
    try:
        await eventually(lambda: a.alive("lb-b") and b.alive("lb-a"), "both ALIVE")
        yield a, b
    finally:
        await a.node.stop(grace=0)
        await b.node.stop(grace=0)


async def test_heartbeats_make_peers_alive_with_rtt_load_and_summary(
        pair: tuple[FakeBalancer, FakeBalancer]) -> None:
    a, b = pair
    assert a.node.clients["lb-b"].heartbeat and not b.node.clients["lb-a"].heartbeat
    await eventually(lambda: a.node.state.rtt_s("lb-b") is not None
                     and b.node.state.rtt_s("lb-a") is not None, "RTT on both sides")
    for me, peer in ((a, "lb-b"), (b, "lb-a")):
        view = me.node.state.view(peer)
        assert view.liveness is Liveness.ALIVE
        assert view.rtt_s is not None and 0 < view.rtt_s < 0.1  # loopback
        assert [(m.model, m.available_replicas) for m in view.models] == [("llama-8b", 2)]
    # each side's prefix summary reached the other's snapshot
    assert a.snapshot.match(b.paths[-1], ["lb-b"])[1] == ("lb-b",)
    assert b.snapshot.match(a.paths[-1], ["lb-a"])[1] == ("lb-a",)
    # and the stream keeps going at the interval
    n = len(a.heard)
    await eventually(lambda: len(a.heard) >= n + 3, "three more heartbeats")


async def test_stopped_peer_goes_suspected_then_down_and_returns_with_a_new_epoch(
        pki: Path, pair: tuple[FakeBalancer, FakeBalancer]) -> None:
    a, b = pair
    old = pb.HeartbeatMsg()
    old.CopyFrom(a.node.state.latest("lb-b") or pb.HeartbeatMsg())
    port = b.node.server.port
    await b.node.stop(grace=0)
    stopped = time.monotonic()
    suspected = await eventually(
        lambda: a.node.state.liveness("lb-b") is not Liveness.ALIVE, "lb-b SUSPECTED")
    assert a.node.state.liveness("lb-b") is Liveness.SUSPECTED
    down = await eventually(lambda: a.node.state.liveness("lb-b") is Liveness.DOWN,
                            "lb-b DOWN")
    assert down - stopped <= 3 * INTERVAL + 0.15
    assert suspected < down
    assert "lb-b" not in a.node.state.usable()
    with pytest.raises(PeerUnavailable, match="DOWN"):
        a.node.forward("lb-b", request("stream"))

    b2 = await FakeBalancer(pki, "eu", "lb-b", port=port).start()
    try:
        await b2.node.add_peer("lb-a", a.node.address)
        await eventually(lambda: a.alive("lb-b") and b2.alive("lb-a"), "lb-b back", 8.0)
        view = a.node.state.view("lb-b")
        assert view.epoch == b2.node.identity.epoch > old.epoch
        rejected = view.rejected
        assert a.node.state.observe(old) is Verdict.STALE  # the past life's last word
        old.seq += 1000
        assert a.node.state.observe(old) is Verdict.STALE  # any seq of an older epoch
        assert a.node.state.view("lb-b").rejected == rejected + 2
        async with a.node.forward("lb-b", request("stream"), timeout=5) as call:
            assert len([c async for c in call]) == 102
    finally:
        await b2.node.stop(grace=0)


async def test_the_accepting_side_also_sees_its_peer_go_down(
        pair: tuple[FakeBalancer, FakeBalancer]) -> None:
    a, b = pair
    await a.node.stop(grace=0)  # lb-a opened the stream; lb-b only answers
    stopped = time.monotonic()
    down = await eventually(lambda: b.node.state.liveness("lb-a") is Liveness.DOWN,
                            "lb-a DOWN at lb-b")
    assert down - stopped <= 3 * INTERVAL + 0.15


async def test_forward_streams_chunks_intact_and_in_order_over_one_channel(
        pair: tuple[FakeBalancer, FakeBalancer]) -> None:
    a, b = pair
    for _ in range(3):
        chunks = [c async for c in a.node.forward("lb-b", request("stream"), timeout=5)]
        assert chunks[0].WhichOneof("kind") == "head" and chunks[0].head.status == 200
        assert [c.data for c in chunks[1:-1]] == [chunk_bytes(i) for i in range(100)]
        assert chunks[-1].data == b"\xab" * (1 << 20)
    req = b.requests[-1]
    assert (req.forwarded_hops, req.origin_region, req.model) == (1, "us", "llama-8b")
    assert all(d is not None and 0 < d <= 5.1 for d in b.deadlines), b.deadlines  # it travelled
    assert len(set(b.peers_seen)) == 1  # one persistent connection, no set-up per request


async def test_client_cancel_reaches_the_server_handler(
        pair: tuple[FakeBalancer, FakeBalancer]) -> None:
    a, b = pair
    call = a.node.forward("lb-b", request("hang"), timeout=30)
    got: list[pb.ForwardChunk] = []

    async def consume() -> None:
        async for chunk in call:
            got.append(chunk)

    task = asyncio.create_task(consume())
    await eventually(lambda: b.started.is_set() and len(got) == 1, "head received")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(b.cancelled.is_set, "handler cancelled")

    # a consumer that just stops reading and closes the call does the same
    b.started.clear()
    b.cancelled.clear()
    call = a.node.forward("lb-b", request("hang"), timeout=30)
    assert (await anext(call)).WhichOneof("kind") == "head"
    await eventually(b.started.is_set, "handler started again")
    await call.aclose()
    await eventually(b.cancelled.is_set, "handler cancelled after aclose")


async def test_deadline_expiry_surfaces_as_deadline_exceeded(
        pair: tuple[FakeBalancer, FakeBalancer]) -> None:
    a, b = pair
    call = a.node.forward("lb-b", request("hang"), timeout=0.3)
    with pytest.raises(PeerDeadlineExceeded) as info:
        async for _ in call:
            pass
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(b.cancelled.is_set, "handler cancelled at the deadline")


async def test_a_second_hop_is_refused(
        pki: Path, pair: tuple[FakeBalancer, FakeBalancer]) -> None:
    _, b = pair
    n = len(b.requests)
    ca, cert, key = TlsFiles.in_dir(pki, "lb-a").read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                         certificate_chain=cert)
    async with grpc.aio.secure_channel(b.node.address, creds,
                                       options=channel_options("lb-b")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in pb_grpc.PeeringStub(ch).Forward(request("stream", hops=2), timeout=5):
                pass
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert len(b.requests) == n
    assert isinstance(from_rpc_error("lb-b", info.value), PeerProtocolError)


async def test_a_removed_peer_is_cut_off(pair: tuple[FakeBalancer, FakeBalancer]) -> None:
    a, b = pair
    b.node.server.set_allowed(set())
    await eventually(lambda: a.node.state.liveness("lb-b") is Liveness.DOWN, "lb-b DOWN", 3)
    assert "PERMISSION_DENIED" in (a.node.clients["lb-b"].last_error or "")
    req = request("stream")
    for _ in range(2):  # the client's stamping is retry-safe: hops stays 1
        with pytest.raises(PeerRefused):
            async for _ in a.node.clients["lb-b"].forward(req, 5, check_liveness=False):
                pass
        assert req.forwarded_hops == 1


async def _raw_forward(target: str, creds: grpc.ChannelCredentials) -> None:
    async with grpc.aio.secure_channel(target, creds, options=channel_options("lb-b")) as ch:
        stub = pb_grpc.PeeringStub(ch)
        try:
            async for _ in stub.Forward(request("stream"), timeout=5):
                pass
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error("lb-b", exc) from None


async def test_unauthenticated_and_unknown_peers_are_refused(
        pki: Path, pair: tuple[FakeBalancer, FakeBalancer]) -> None:
    _, b = pair
    target = b.node.address
    ca = (pki / "ca.crt").read_bytes()
    n = len(b.requests)

    # no client certificate: the TLS handshake fails
    with pytest.raises(PeerUnavailable):
        await _raw_forward(target, grpc.ssl_channel_credentials(root_certificates=ca))

    # a certificate for an allowed id, but from another CA: the handshake fails
    rogue = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=(pki / "rogue" / "lb-a.key").read_bytes(),
        certificate_chain=(pki / "rogue" / "lb-a.crt").read_bytes())
    with pytest.raises(PeerUnavailable):
        await _raw_forward(target, rogue)

    # a good certificate whose CN is not on the allow-list: PERMISSION_DENIED, for
    # forwards and heartbeats alike
    state = PeerState(Identity("ap", "lb-x", 1))
    x = PeerClient("lb-b", target, state, TlsFiles.in_dir(pki, "lb-x"),
                   local_summary=lambda _: pb.HeartbeatMsg())
    await x.start()
    try:
        with pytest.raises(PeerRefused) as info:
            async for _ in x.forward(request("stream"), timeout=5, check_liveness=False):
                pass
        assert info.value.code is grpc.StatusCode.PERMISSION_DENIED
        await eventually(lambda: x.stream_errors > 0, "heartbeat stream refused")
        assert "PERMISSION_DENIED" in (x.last_error or "")
    finally:
        await x.close()
    assert "lb-x" not in b.node.state.peers()
    assert len(b.requests) == n  # no refused call reached the handler
    assert b.node.server.refused >= 2


async def test_oversized_or_impersonating_heartbeats_are_rejected(
        pki: Path, pair: tuple[FakeBalancer, FakeBalancer]) -> None:
    _, b = pair
    tls = TlsFiles.in_dir(pki, "lb-a")
    ca, cert, key = tls.read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                         certificate_chain=cert)
    latest = b.node.state.latest("lb-a")
    assert latest is not None

    big = pb.HeartbeatMsg(balancer_id="lb-a", epoch=latest.epoch, seq=latest.seq + 10**6)
    big.prefix.keys.extend(range(1, 4000))  # ~32 KiB, twice the bound
    liar = pb.HeartbeatMsg(balancer_id="lb-b", epoch=latest.epoch + 1, seq=1)
    for msg, code in ((big, grpc.StatusCode.RESOURCE_EXHAUSTED),
                      (liar, grpc.StatusCode.PERMISSION_DENIED)):
        async with grpc.aio.secure_channel(b.node.address, creds,
                                           options=channel_options("lb-b")) as ch:
            call = pb_grpc.PeeringStub(ch).Heartbeat()
            await call.write(msg)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() is code
    latest = b.node.state.latest("lb-a")
    assert latest is not None and latest.seq < 10**6  # neither was applied
