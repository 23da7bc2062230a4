"""Malformed, oversized and unauthorised gRPC peer messages against a live mesh node.

A real ``skymesh-lb`` with peering on; the test speaks to its gRPC port over a raw channel
with valid mTLS certificates (so the bytes reach the handlers), sending garbage bytes as
Forward and Heartbeat messages, messages over the size caps, heartbeats naming another
balancer, and calls from a certificate that is valid but not an allowed peer. Each must be
refused with an error status, and the daemon must stay up and keep serving.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import make_pki

from skymesh.mesh.client import channel_options
from skymesh.mesh.proto import pb
from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_lab.faults.cluster import MODEL

pytestmark = pytest.mark.timeout(120)

EXAMPLES = 60
CALL_TIMEOUT_S = 5.0
FORWARD = "/skymesh.v1.Peering/Forward"
HEARTBEAT = "/skymesh.v1.Peering/Heartbeat"
CODES: Counter[str] = Counter()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("mesh-pki"), rogue_id="lb-b")


@pytest.fixture(scope="module")
def node(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    tmp = tmp_path_factory.mktemp("mesh-node")
    rep = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.01"],
                       log_path=tmp / "replica.log")
    grpc_port = free_port()
    cfg = tmp / "lb.yaml"
    cfg.write_text(json.dumps({
        "region": "us", "listen": {"port": 0},
        "replicas": [{"url": rep.url, "models": [MODEL]}],
        "mesh": {"id": "lb-a", "certs_dir": str(pki), "listen_port": grpc_port,
                 # lb-b is allowed but never answers: only its certificate is used here
                 "peers": [{"id": "lb-b", "address": f"127.0.0.1:{free_port()}"}]}}))
    lb = start_daemon("skymesh-lb", ["--config", str(cfg)], log_path=tmp / "lb.log")
    try:
        yield lb, f"127.0.0.1:{grpc_port}"
    finally:
        lb.stop()
        rep.stop()
        print(f"\ngrpc fuzz status codes: {dict(CODES)}")


def creds(pki: Path, name: str | None, ca_dir: Path | None = None
          ) -> grpc.ChannelCredentials:
    ca = (pki / "ca.crt").read_bytes()
    if name is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    d = ca_dir or pki
    return grpc.ssl_channel_credentials(root_certificates=ca,
                                        private_key=(d / f"{name}.key").read_bytes(),
                                        certificate_chain=(d / f"{name}.crt").read_bytes())


async def healthy(lb: Daemon) -> bool:
    async with aiohttp.ClientSession() as s, s.get(lb.url + "/health") as r:
        return r.status == 200 and lb.alive()


async def forward_raw(address: str, cred: grpc.ChannelCredentials, payload: bytes
                      ) -> grpc.StatusCode:
    async with grpc.aio.secure_channel(address, cred, options=channel_options("lb-a")) as ch:
        call = ch.unary_stream(FORWARD)(payload, timeout=CALL_TIMEOUT_S)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return await call.code()


async def heartbeat_raw(address: str, cred: grpc.ChannelCredentials, msgs: list[bytes]
                        ) -> grpc.StatusCode:
    async with grpc.aio.secure_channel(address, cred, options=channel_options("lb-a")) as ch:
        call = ch.stream_stream(HEARTBEAT)(timeout=CALL_TIMEOUT_S)
        try:
            for m in msgs:
                try:
                    await call.write(m)
                except asyncio.InvalidStateError:  # the server already ended the call
                    return await call.code()
            await call.done_writing()
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return await call.code()


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


@SETTINGS
@given(payload=st.binary(max_size=2048))
def test_garbage_forward_messages_are_refused(pki: Path, node: tuple[Daemon, str],
                                              payload: bytes) -> None:
    lb, address = node
    code = _run(forward_raw(address, creds(pki, "lb-b"), payload))
    CODES[f"forward:{code.name}"] += 1
    # Garbage that happens to parse as a ForwardRequest is replayed like any forwarded
    # request and gets an HTTP error back (status OK, error head); anything else is a
    # clean gRPC error. Never a hang, never a dead daemon.
    assert code is not grpc.StatusCode.DEADLINE_EXCEEDED
    assert lb.alive()


@SETTINGS
@given(msgs=st.lists(st.binary(max_size=512), min_size=1, max_size=4))
def test_garbage_heartbeats_are_refused(pki: Path, node: tuple[Daemon, str],
                                        msgs: list[bytes]) -> None:
    lb, address = node
    code = _run(heartbeat_raw(address, creds(pki, "lb-b"), msgs))
    CODES[f"heartbeat:{code.name}"] += 1
    assert code is not grpc.StatusCode.DEADLINE_EXCEEDED
    assert lb.alive()


async def test_oversized_unknown_and_impersonating_messages(
        pki: Path, node: tuple[Daemon, str]) -> None:
    lb, address = node
    good = creds(pki, "lb-b")
    # over gRPC's 4 MiB message cap
    big = pb.ForwardRequest(request_id="big", model=MODEL, path="/v1/chat/completions",
                            body=b"x" * (5 * 2**20)).SerializeToString()
    assert await forward_raw(address, good, big) is grpc.StatusCode.RESOURCE_EXHAUSTED
    # a well-formed heartbeat over the 16 KiB application cap
    hb = pb.HeartbeatMsg(balancer_id="lb-b", epoch=1, seq=1)
    hb.prefix.keys.extend(range(1, 4000))
    assert await heartbeat_raw(address, good, [hb.SerializeToString()]) is \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    # a heartbeat naming a balancer other than the certificate's
    liar = pb.HeartbeatMsg(balancer_id="lb-zz", epoch=1, seq=1).SerializeToString()
    assert await heartbeat_raw(address, good, [liar]) is grpc.StatusCode.PERMISSION_DENIED
    # a valid certificate for an id that is not a peer of this node
    ok_req = pb.ForwardRequest(request_id="x", model=MODEL, path="/v1/chat/completions",
                               body=b"{}").SerializeToString()
    assert await forward_raw(address, creds(pki, "lb-x"), ok_req) is \
        grpc.StatusCode.PERMISSION_DENIED
    # a request that claims to have been forwarded already
    hop2 = pb.ForwardRequest(request_id="h", model=MODEL, path="/v1/chat/completions",
                             body=b"{}", forwarded_hops=2).SerializeToString()
    assert await forward_raw(address, good, hop2) is grpc.StatusCode.FAILED_PRECONDITION
    # a priority that is no class name is not replayed as a header (batch_mesh)
    for bad in ("bat\nch", "x" * 65, "bätch"):
        odd = pb.ForwardRequest(request_id="p", model=MODEL, path="/v1/chat/completions",
                                body=b"{}", priority=bad, batch_deadline_ms=5)
        assert await forward_raw(address, good, odd.SerializeToString()) is \
            grpc.StatusCode.OK, bad
    assert await healthy(lb)


async def test_peers_without_a_valid_certificate_never_reach_a_handler(
        pki: Path, node: tuple[Daemon, str]) -> None:
    lb, address = node
    req = pb.ForwardRequest(request_id="r", model=MODEL, path="/v1/chat/completions",
                            body=b"{}").SerializeToString()
    before = await forwarded_in(lb)
    # no client certificate, and one for an allowed id signed by another CA
    for cred in (creds(pki, None), creds(pki, "lb-b", ca_dir=pki / "rogue")):
        assert await forward_raw(address, cred, req) is grpc.StatusCode.UNAVAILABLE
    assert await forwarded_in(lb) == before  # the handshake failed: no handler ran
    assert await healthy(lb)


async def forwarded_in(lb: Daemon) -> int:
    async with aiohttp.ClientSession() as s, s.get(lb.url + "/status") as r:
        return int((await r.json())["mesh"]["forwarded_in"])


async def test_a_forward_cannot_point_the_balancer_at_another_host(
        pki: Path, node: tuple[Daemon, str]) -> None:
    lb, address = node
    hits: list[bytes] = []

    async def listener(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        hits.append(await r.read(100))
        w.close()

    server = await asyncio.start_server(listener, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for path in (f"@127.0.0.1:{port}/steal", "", "v1/completions", "//x", "/a b"):
            req = pb.ForwardRequest(request_id="s", model=MODEL, path=path,
                                    body=b"{}").SerializeToString()
            assert await forward_raw(address, creds(pki, "lb-b"), req) is \
                grpc.StatusCode.INVALID_ARGUMENT, path
    finally:
        server.close()
        await server.wait_closed()
    assert hits == []
    assert await healthy(lb)
