"""A streaming client that disconnects as its first chunk is written: no ERROR traceback
from skymesh-lb, one ``client_disconnected`` outcome (and, when the write found it gone,
a count in ``skymesh_client_disconnects_total``) and an access line.

The race is made exact rather than waited for: the balancer is stopped (SIGSTOP) while
the replica sends its first chunk and the client resets its connection, and continued
once the kernel holds both (the replica's bytes in the balancer's upstream socket, the
client's socket gone). On waking the balancer reads the replica's bytes first (they were
ready first) and writes them to a connection that is already closing, which is what a
loaded balancer sees when both arrive in one turn of its loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from support import eventually, get_metrics, until

from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux")

_METRICS = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
_MODELS = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
_FIRST = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'


class HeldReplica:
    """Answers probes; holds each generation request until the test sends its first
    chunk (:meth:`first_chunk`)."""

    def __init__(self) -> None:
        self.held: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                path = head.split(b" ", 2)[1]
                if path.startswith(b"/v1/chat"):
                    await self.held.put(writer)
                    return  # the test writes the answer
                body = _METRICS if path == b"/metrics" else _MODELS
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()  # cancelled: the test is over

    @staticmethod
    def first_chunk(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(_FIRST), _FIRST))


def _tcp() -> list[tuple[int, int, int, int]]:
    """(local port, remote port, state, receive queue) of the IPv4 TCP sockets."""
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        rx = int(f[4].split(":")[1], 16)
        rows.append((int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16),
                     int(f[3], 16), rx))
    return rows


_ESTABLISHED = 1


async def _until_ready(s: aiohttp.ClientSession, lb: Daemon) -> None:
    async def ready() -> bool:
        async with s.get(lb.url + "/ready") as r:
            return r.status == 200
    await until(ready, "the replica is healthy")


def _post(lb: Daemon, request_id: str, body: bytes) -> socket.socket:
    """A chat completion sent on a raw socket (the test decides how it goes away)."""
    client = socket.create_connection(("127.0.0.1", int(lb.url.rsplit(":", 1)[1])))
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\n"
                   b"Content-Type: application/json\r\nX-Request-Id: %s\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (request_id.encode(), len(body), body))
    return client


def _reset(client: socket.socket) -> None:
    # SO_LINGER 0: close sends a reset, as a client killed mid-request does.
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()


@pytest.fixture(params=["aiohttp", "lean"])  # listen.http_server
async def lb_and_replica(request: pytest.FixtureRequest, tmp_path: Path
                         ) -> AsyncIterator[tuple[Daemon, HeldReplica]]:
    replica = HeldReplica()
    server = await asyncio.start_server(replica.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = tmp_path / "lb.yaml"
    config.write_text(f"listen:\n  http_server: {request.param}\n")
    lb = await asyncio.to_thread(start_daemon, "skymesh-lb", [
        "--port", "0", "--replicas", f"http://127.0.0.1:{port}", "--policy", "round-robin",
        # One process: the test stops the process that serves the stream (SIGSTOP).
        "--workers", "1", "--config", str(config)])
    try:
        yield lb, replica
    finally:
        os.kill(lb.proc.pid, signal.SIGCONT)
        lb.stop()
        server.close()


async def test_a_client_gone_as_the_first_chunk_is_written_is_counted_not_an_error(
        lb_and_replica: tuple[Daemon, HeldReplica]) -> None:
    lb, replica = lb_and_replica
    lb_port = int(lb.url.rsplit(":", 1)[1])
    async with aiohttp.ClientSession() as s:
        await _until_ready(s, lb)
        body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "x"}]}'
        client = _post(lb, "gone-1", body)
        client_port = client.getsockname()[1]
        writer = await asyncio.wait_for(replica.held.get(), 15)
        upstream_port = writer.get_extra_info("peername")[1]  # the balancer's end

        os.kill(lb.proc.pid, signal.SIGSTOP)
        try:
            replica.first_chunk(writer)
            await writer.drain()
            _reset(client)

            def both_pending() -> bool:
                rows = _tcp()
                chunk_in = any(lp == upstream_port and rx > 0 for lp, _, _, rx in rows)
                client_gone = not any(lp == lb_port and rp == client_port
                                      and st == _ESTABLISHED for lp, rp, st, _ in rows)
                return chunk_in and client_gone
            await eventually(both_pending, "the chunk and the reset queued at the stopped "
                             "balancer", timeout=10)
        finally:
            os.kill(lb.proc.pid, signal.SIGCONT)

        await eventually(lambda: "request_id=gone-1" in lb.log(), "the request's access line",
                         timeout=15)
        metrics = await get_metrics(s, lb.url)
    log = lb.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    line = next(x for x in log.splitlines() if "request_id=gone-1" in x)
    assert "disconnected=True" in line, line
    # Which of the two the loop takes first is its own affair: the write of the first chunk
    # to the closing connection (the phase counted), or the handler's cancellation by the
    # reset (aiohttp's handler_cancellation, before the handler resumes with the chunk).
    # Either way the departure is counted once, as the client's, never as an error.
    outcomes = {k: v for k, v in metrics.items() if k.startswith("skymesh_requests_total{")}
    assert outcomes == {'skymesh_requests_total{model="m",outcome="client_disconnected"}': 1.0}
    assert metrics.get('skymesh_client_disconnects_total{phase="first_chunk"}') in (0.0, 1.0)
    assert not metrics.get('skymesh_client_disconnects_total{phase="mid_stream"}')


async def test_a_client_gone_while_its_request_is_at_a_replica_is_counted_as_gone(
        lb_and_replica: tuple[Daemon, HeldReplica]) -> None:
    """A whole (not streamed) reply: the client leaves while the replica holds its
    request, the balancer's handler is cancelled (aiohttp's ``handler_cancellation``). Its
    outcome is ``client_disconnected``, not ``error`` (the rss soak's leave-at-once clients
    were thousands of ``error`` in a million requests)."""
    lb, replica = lb_and_replica
    async with aiohttp.ClientSession() as s:
        await _until_ready(s, lb)
        client = _post(lb, "gone-2",
                       b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
        writer = await asyncio.wait_for(replica.held.get(), 15)
        _reset(client)
        await eventually(lambda: "request_id=gone-2" in lb.log(), "the request's access line",
                         timeout=15)
        metrics = await get_metrics(s, lb.url)
        writer.close()
    outcomes = {k: v for k, v in metrics.items() if k.startswith("skymesh_requests_total{")}
    assert outcomes == {'skymesh_requests_total{model="m",outcome="client_disconnected"}': 1.0}
    assert "Traceback" not in lb.log()
