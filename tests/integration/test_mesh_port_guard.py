"""The peering port under abuse (skymesh.mesh.guard, skymesh.mesh.limits): a flood of
plain TCP connects costs the balancer a bounded number of file descriptors and its HTTP
side keeps serving; held connections are closed at the handshake deadline; real peers'
connections pass it and stay; a peer with a valid certificate that announces a huge
heartbeat interval and goes silent stops being forwardable."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from support import eventually, make_pki, until

from skymesh.mesh.guard import HANDSHAKE_TIMEOUT, PortGuard
from skymesh.mesh.limits import GuardLimits
from skymesh.mesh.node import MeshNode
from skymesh.mesh.proto import pb, pb_grpc
from skymesh.mesh.state import Liveness, new_identity
from skymesh.mesh.tls import TlsFiles
from skymesh.util.procs import Daemon, free_port, start_daemon

pytestmark = pytest.mark.timeout(120)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
FLOOD = 3000  # plain connects, from 20 loopback addresses
SOURCES = [f"127.0.0.{i}" for i in range(2, 22)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"), rogue_id="lb-a")


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.05"],
                     log_path=tmp_path_factory.mktemp("replica") / "replica.log")
    yield d
    d.stop()


def start_lb(tmp: Path, pki: Path, replica: Daemon, mesh_port: int,
             peers: list[dict[str, str]]) -> Daemon:
    cfg = {"region": "us", "listen": {"port": 0}, "policy": {"name": "least-load"},
           "replicas": [{"url": replica.url}],
           "mesh": {"id": "lb-a", "certs_dir": str(pki), "listen_port": mesh_port,
                    "heartbeat_interval_s": 0.1, "peers": peers}}
    path = tmp / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(path)], log_path=tmp / "lb.log")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def completion(s: aiohttp.ClientSession, lb: Daemon) -> int:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status


async def closed_by_server(r: asyncio.StreamReader) -> bool:
    """Reads until the server closes (EOF or reset): the bytes a TLS server may have sent
    before are not our concern."""
    with contextlib.suppress(OSError):
        while await r.read(65536):
            pass
    return True


async def metric(s: aiohttp.ClientSession, lb: Daemon, line_start: str) -> float:
    async with s.get(lb.url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {line_start} in /metrics")


async def test_a_flood_of_plain_connects_costs_bounded_fds_and_http_keeps_serving(
        tmp_path: Path, pki: Path, replica: Daemon) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < FLOOD + 512:
        pytest.skip(f"the flood needs {FLOOD + 512} file descriptors, hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 512), hard))
    port = free_port()
    lb = start_lb(tmp_path, pki, replica, port, [])
    held: list[asyncio.StreamWriter] = []
    try:
        async with aiohttp.ClientSession() as s:
            async def ready() -> bool:
                return await completion(s, lb) == 200

            await until(ready, "the balancer serves")

            async def mesh_listens() -> bool:
                with contextlib.suppress(OSError):
                    _, w = await asyncio.open_connection("127.0.0.1", port)
                    w.close()
                    return True
                return False

            await until(mesh_listens, "the peering port accepts")
            before = open_fds(lb.proc.pid)
            readers = []
            for i in range(FLOOD):
                try:
                    r, w = await asyncio.open_connection(
                        "127.0.0.1", port, local_addr=(SOURCES[i % len(SOURCES)], 0))
                except OSError:
                    continue  # refused during the connect: fine, nothing is held
                readers.append(r)
                held.append(w)
            # While the flood is held: the balancer's fds are bounded by the caps (3 per
            # admitted connection, 64 handshaking at most), and HTTP still serves.
            during = open_fds(lb.proc.pid)
            assert during - before < 400, (before, during)
            assert await completion(s, lb) == 200
            refused = await metric(s, lb, 'skymesh_mesh_connections_refused_total{reason="'
                                          'handshake_limit"}')
            assert refused > 0
            # The admitted ones are closed at the handshake deadline (5 s), not held for
            # gRPC's 120 s; the refused ones were closed as they arrived.
            await asyncio.wait_for(asyncio.gather(*(closed_by_server(r) for r in readers)),
                                   20)
            after = open_fds(lb.proc.pid)
            assert after - before < 20, (before, after)
            assert await completion(s, lb) == 200
            assert "peering port: refused a connection from 127.0.0." in lb.log()
    finally:
        for w in held:
            w.close()
        lb.stop()


# -- the guard alone, in front of a stand-in for gRPC ----------------------------------------
async def test_the_guard_splices_bytes_and_cuts_a_silent_connection_itself() -> None:
    # The stand-in echoes what it gets and never closes on its own, so any close at the
    # deadline is the guard's (gRPC's own handshake timer is not there to help).
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()

    guard = PortGuard(GuardLimits(handshake_timeout_s=0.2))
    inner = await asyncio.start_unix_server(echo, guard.private_address()[len("unix:"):])
    port = await guard.start("127.0.0.1", 0)
    try:
        talker_r, talker_w = await asyncio.open_connection("127.0.0.1", port)
        big = bytes(range(256)) * 4096  # 1 MiB: flow control both ways
        talker_w.write(big)
        assert await asyncio.wait_for(talker_r.readexactly(len(big)), 10) == big
        silent_r, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(closed_by_server(silent_r), 10)
        assert guard.closed[HANDSHAKE_TIMEOUT] == 1
        # Both sides spoke: past the deadline it is established, and still spliced.
        await eventually(lambda: guard.admission.total_handshaking == 0, "established")
        assert guard.admission.total == 1
        talker_w.write(b"still there")
        assert await asyncio.wait_for(talker_r.readexactly(11), 10) == b"still there"
        talker_w.close()
        await eventually(lambda: guard.admission.total == 0, "released on close")
    finally:
        await guard.stop()
        inner.close()


# -- real peers through the guard -----------------------------------------------------------
def summary(_: bool) -> pb.HeartbeatMsg:
    msg = pb.HeartbeatMsg()
    msg.models.add(model=MODEL, available_replicas=1, total_replicas=1)
    return msg


async def no_forward(req: pb.ForwardRequest, ctx: Any) -> AsyncIterator[pb.ForwardChunk]:
    yield pb.ForwardChunk()


async def test_peers_pass_the_handshake_deadline_and_stay_connected(pki: Path) -> None:
    limits = GuardLimits(handshake_timeout_s=0.3, max_handshakes=4,
                         max_handshakes_per_address=2, max_connections=8,
                         max_connections_per_address=4)
    nodes = [MeshNode(new_identity(region, bid), TlsFiles.in_dir(pki, bid),
                      local_summary=summary, forward_handler=no_forward, guard=limits)
             for region, bid in (("us", "lb-a"), ("eu", "lb-b"))]
    a, b = nodes
    for n in nodes:
        await n.start()
    try:
        await a.add_peer("lb-b", b.address)
        await b.add_peer("lb-a", a.address)
        guards = [n.server.guard for n in nodes]
        assert all(g is not None for g in guards)
        # Each side's channel to the other: established once past the deadline.
        def one_established() -> bool:
            return all(g is not None and g.admission.total == 1
                       and g.admission.total_handshaking == 0 for g in guards)

        await eventually(one_established, "each port holds one established connection",
                         timeout=10)
        seq = a.state.view("lb-b").seq
        await eventually(lambda: a.state.view("lb-b").seq > seq + 5, "heartbeats go on")
        assert a.state.liveness("lb-b") is Liveness.ALIVE
        assert b.state.liveness("lb-a") is Liveness.ALIVE
        assert all(not g.closed and not g.refused for g in guards if g is not None)
        # A forward over the guarded port arrives.
        async with a.forward("lb-b", pb.ForwardRequest(
                request_id="r1", model=MODEL, path="/v1/completions"), timeout=5) as call:
            chunks = [c async for c in call]
        assert len(chunks) == 1
    finally:
        for n in nodes:
            await n.stop(0)


async def test_a_connection_that_never_handshakes_is_closed_at_the_deadline(
        pki: Path) -> None:
    limits = GuardLimits(handshake_timeout_s=0.3)
    node = MeshNode(new_identity("us", "lb-a"), TlsFiles.in_dir(pki, "lb-a"),
                    local_summary=summary, forward_handler=no_forward, guard=limits)
    await node.start()
    try:
        host, port = node.address.rsplit(":", 1)
        silent = await asyncio.open_connection(host, int(port))
        talker = await asyncio.open_connection(host, int(port))
        talker[1].write(b"\x16\x03\x01\x00\x05hello")  # a TLS record header, then stalls
        for r, _ in (silent, talker):
            assert await asyncio.wait_for(closed_by_server(r), 10)
        guard = node.server.guard
        assert guard is not None
        await eventually(lambda: guard.admission.total == 0, "both released")
    finally:
        await node.stop(0)


# -- a forged peer -------------------------------------------------------------------------
class Forger(pb_grpc.PeeringServicer):
    """lb-x with a valid mesh certificate: one heartbeat announcing a 46-day interval and
    1,000 free replicas, then silence; forwards are never answered."""

    def __init__(self) -> None:
        self.forwards = 0

    async def Heartbeat(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        first = await request_iterator.__anext__()
        msg = pb.HeartbeatMsg(region="ap", balancer_id="lb-x", epoch=1, seq=1,
                              interval_ms=4_000_000_000, echo_epoch=first.epoch,
                              echo_seq=first.seq, echo_sent_ns=first.sent_ns)
        msg.models.add(model=MODEL, available_replicas=1000, total_replicas=1000,
                       outstanding_requests=0)
        yield msg
        async for _ in request_iterator:  # keep the stream open, say nothing more
            pass

    async def Forward(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.forwards += 1
        await asyncio.Event().wait()
        yield pb.ForwardChunk()


async def test_a_forged_peer_with_a_huge_interval_stops_being_forwardable(
        tmp_path: Path, pki: Path, replica: Daemon) -> None:
    ca, cert, key = TlsFiles.in_dir(pki, "lb-x").read()
    server = grpc.aio.server()
    pb_grpc.add_PeeringServicer_to_server(Forger(), server)
    forged_port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True))
    await server.start()
    lb = start_lb(tmp_path, pki, replica, free_port(),
                  [{"id": "lb-x", "address": f"127.0.0.1:{forged_port}"}])
    try:
        async with aiohttp.ClientSession() as s:
            async def forwardable() -> bool | None:
                async with s.get(lb.url + "/status") as r:
                    peers = (await r.json())["mesh"]["peers"]
                return peers[0]["forwardable"] if peers else None

            async def heard() -> bool:
                return await forwardable() is True

            await until(heard, "the forged peer's heartbeat is taken")

            async def dropped() -> bool:
                return await forwardable() is False

            # Silent for 3 capped intervals (2 s each): down, whatever it announced.
            await until(dropped, "the silent forged peer is not forwardable", timeout=20)
    finally:
        lb.stop()
        await server.stop(0)
