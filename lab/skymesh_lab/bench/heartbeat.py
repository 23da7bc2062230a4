"""Heartbeat bandwidth per peer pair (target: at most 10 KB/s).

Two balancers on loopback with mutual TLS, each with a full prefix trie (100,000 keys)
and a few models, heartbeating at the default interval (0.2 s) for ``--duration``
seconds. Both channels of the pair (A->B, which carries the heartbeat stream, and B->A,
kept warm for forwarding) go through counting TCP proxies, so the figure is what
crosses the wire: TLS records, HTTP/2 frames, gRPC framing, keepalive pings. TCP/IP
headers are not in it (about 52 bytes a segment on a real link).

Worst case by default (``--churn``): every prefix summary differs from the last, so one
goes out every summary interval (2 s) from each side; without churn an unchanged summary
is resent only every 10 s. Also reported: the protobuf sizes of a load-only and a
full heartbeat (``ByteSize``), and what sending the full summary on every heartbeat
would cost (the design this throttling avoids).

    python -m skymesh_lab.bench.heartbeat [--duration 10] [--no-churn] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from skymesh.mesh import certs
from skymesh.mesh.heartbeat import DEFAULT_SUMMARY_INTERVAL_S, prefix_summary
from skymesh.mesh.node import MeshNode
from skymesh.mesh.proto import pb
from skymesh.mesh.state import DEFAULT_INTERVAL_S, Liveness, new_identity
from skymesh.mesh.summary import DEFAULT_MAX_KEYS
from skymesh.mesh.tls import TlsFiles
from skymesh.prefix import PrefixTrie

TARGET_BYTES_PER_S = 10_000
_M64 = (1 << 64) - 1
TCP_IP_HEADER_BYTES = 52


class CountingProxy:
    """A loopback TCP relay that counts the bytes (and reads) in each direction."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.bytes = {"up": 0, "down": 0}
        self.reads = {"up": 0, "down": 0}
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    def reset(self) -> None:
        self.bytes = {"up": 0, "down": 0}
        self.reads = {"up": 0, "down": 0}

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()  # the far end is gone (shutting down): refuse like it would
            return
        pipes = [asyncio.create_task(self._pipe(reader, up_w, "up")),
                 asyncio.create_task(self._pipe(up_r, writer, "down"))]
        self._tasks += pipes
        await asyncio.gather(*pipes, return_exceptions=True)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, way: str) -> None:
        try:
            while data := await r.read(1 << 16):
                self.bytes[way] += len(data)
                self.reads[way] += 1
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # either end went away: so does the relay
        finally:
            w.close()


def _chain(seq: list[int]) -> list[int]:
    out, h = [], 0
    for x in seq:
        h = hash((h, x)) & _M64
        out.append(h)
    return out


class _Side:
    def __init__(self, pki: Path, region: str, bid: str, *, models: int, churn: bool,
                 max_keys: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.trie = PrefixTrie(100_000)
        while len(self.trie) < 100_000:
            self._add_path()
        self.models = models
        self.churn = churn
        self.max_keys = max_keys
        self.node = MeshNode(new_identity(region, bid), TlsFiles.in_dir(pki, bid),
                             local_summary=self.local_summary, forward_handler=self.forward)

    def _add_path(self) -> None:
        system = self.rng.randrange(30)
        path = _chain([system] * 12 + [self.rng.randrange(1 << 40)
                                       for _ in range(self.rng.randrange(4, 80))])
        self.trie.insert(path, f"replica-{self.rng.randrange(8)}")

    def local_summary(self, include_prefix: bool) -> pb.HeartbeatMsg:
        msg = pb.HeartbeatMsg()
        for i in range(self.models):
            msg.models.add(model=f"meta-llama/Llama-3.1-8B-Instruct-{i}", available_replicas=3,
                           total_replicas=8, queue_length=12, pending_prefill_tokens=123_456,
                           outstanding_requests=4096)
        if include_prefix:
            if self.churn:
                self._add_path()  # a new hot conversation: the summary changes
            msg.prefix.CopyFrom(prefix_summary(self.trie, self.max_keys))
        return msg

    async def forward(self, req: pb.ForwardRequest, ctx: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.ForwardChunk]:
        yield pb.ForwardChunk(error=pb.ForwardChunk.Error(code="unused", status=503))


async def measure(duration: float = 10.0, *, churn: bool = True, models: int = 4,
                  max_keys: int = DEFAULT_MAX_KEYS) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="skymesh-hb-") as tmp:
        pki = Path(tmp)
        certs.create_ca(pki)
        for name in ("lb-a", "lb-b"):
            certs.issue_cert(pki, name)
        a = _Side(pki, "us", "lb-a", models=models, churn=churn, max_keys=max_keys, seed=1)
        b = _Side(pki, "eu", "lb-b", models=models, churn=churn, max_keys=max_keys, seed=2)
        await a.node.start()
        await b.node.start()
        host, port = b.node.address.rsplit(":", 1)
        to_b = CountingProxy(host, int(port))
        host, port = a.node.address.rsplit(":", 1)
        to_a = CountingProxy(host, int(port))
        try:
            await a.node.add_peer("lb-b", await to_b.start())
            await b.node.add_peer("lb-a", await to_a.start())
            deadline = time.monotonic() + 10
            while not (a.node.state.liveness("lb-b") is Liveness.ALIVE
                       and b.node.state.liveness("lb-a") is Liveness.ALIVE):
                if time.monotonic() > deadline:
                    raise RuntimeError("peers did not come up")
                await asyncio.sleep(0.05)
            # Start counting after the handshakes and the first full summaries.
            await asyncio.sleep(2 * DEFAULT_SUMMARY_INTERVAL_S)
            to_a.reset()
            to_b.reset()
            client = a.node.clients["lb-b"].session
            server = b.node.server.sessions["lb-a"]
            assert client is not None
            c0 = (client.bytes_sent, client.sent, client.summaries_sent)
            s0 = (server.bytes_sent, server.sent, server.summaries_sent)
            t0 = time.monotonic()
            await asyncio.sleep(duration)
            elapsed = time.monotonic() - t0
            wire = sum(to_b.bytes.values()) + sum(to_a.bytes.values())
            reads = sum(to_b.reads.values()) + sum(to_a.reads.values())
            proto = (client.bytes_sent - c0[0]) + (server.bytes_sent - s0[0])
            msgs = (client.sent - c0[1]) + (server.sent - s0[1])
            summaries = (client.summaries_sent - c0[2]) + (server.summaries_sent - s0[2])
            rtt = a.node.state.rtt_s("lb-b")
        finally:
            await a.node.stop(grace=0)
            await b.node.stop(grace=0)
            await to_a.stop()
            await to_b.stop()
        load_only = a.local_summary(False)
        full = a.local_summary(True)
        a.node.state.stamp(load_only, "lb-b")
        a.node.state.stamp(full, "lb-b")
    every = 2 * full.ByteSize() / DEFAULT_INTERVAL_S
    return {
        "duration_s": round(elapsed, 2),
        "interval_s": DEFAULT_INTERVAL_S,
        "summary_interval_s": DEFAULT_SUMMARY_INTERVAL_S,
        "churn": churn,
        "models": models,
        "summary_keys": len(full.prefix.keys),
        "heartbeat_load_only_bytes": load_only.ByteSize(),
        "heartbeat_full_bytes": full.ByteSize(),
        "messages_per_s": round(msgs / elapsed, 2),
        "summaries_per_s": round(summaries / elapsed, 2),
        "proto_bytes_per_s": round(proto / elapsed),
        "wire_bytes_per_s": round(wire / elapsed),
        "wire_bytes_per_s_a_to_b": round((to_b.bytes["up"] + to_a.bytes["down"]) / elapsed),
        "wire_bytes_per_s_b_to_a": round((to_b.bytes["down"] + to_a.bytes["up"]) / elapsed),
        "wire_plus_tcpip_bytes_per_s_est": round((wire + TCP_IP_HEADER_BYTES * reads) / elapsed),
        "full_summary_every_heartbeat_bytes_per_s": round(every),
        "rtt_ms": None if rtt is None else round(rtt * 1000, 3),
        "target_bytes_per_s": TARGET_BYTES_PER_S,
        "meets_target": wire / elapsed <= TARGET_BYTES_PER_S,
    }


def report(r: dict[str, Any]) -> None:
    print(f"== Heartbeat bandwidth per peer pair: interval {r['interval_s']} s, summary every "
          f"{r['summary_interval_s']} s ({'changing every time' if r['churn'] else 'unchanged'})"
          f", {r['summary_keys']} summary keys, {r['models']} models, {r['duration_s']} s ==")
    rows = [
        ("heartbeat size, load only", f"{r['heartbeat_load_only_bytes']} B"),
        ("heartbeat size, with summary", f"{r['heartbeat_full_bytes']} B (bound 16384 B)"),
        ("messages / s (both ways)", f"{r['messages_per_s']} ({r['summaries_per_s']} with a "
                                     "summary)"),
        ("protobuf bytes / s", f"{r['proto_bytes_per_s']} B/s"),
        ("wire bytes / s (TLS+HTTP/2+gRPC)",
         f"{r['wire_bytes_per_s']} B/s = {r['wire_bytes_per_s'] / 1000:.2f} KB/s "
         f"(A->B {r['wire_bytes_per_s_a_to_b']}, B->A {r['wire_bytes_per_s_b_to_a']}); "
         f"target <= {r['target_bytes_per_s'] / 1000:.0f} KB/s: "
         f"{'met' if r['meets_target'] else 'MISSED'}"),
        ("  + TCP/IP headers (est.)", f"{r['wire_plus_tcpip_bytes_per_s_est']} B/s"),
        ("full summary on every beat", f"{r['full_summary_every_heartbeat_bytes_per_s']} B/s "
                                       "(protobuf only; what the throttle avoids)"),
        ("RTT (loopback, EMA)", f"{r['rtt_ms']} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.heartbeat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    ap.add_argument("--no-churn", action="store_true",
                    help="keep the prefix summary unchanged (the idle case)")
    ap.add_argument("--models", type=int, default=4)
    ap.add_argument("--max-keys", type=int, default=DEFAULT_MAX_KEYS)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    r = asyncio.run(measure(args.duration, churn=not args.no_churn, models=args.models,
                            max_keys=args.max_keys))
    report(r)
    if args.json:
        from skymesh.util.jsonio import write_json

        write_json(args.json, r)
    return 0 if r["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
