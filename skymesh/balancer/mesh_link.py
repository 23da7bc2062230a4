"""Joins ``skymesh-lb`` to its peers: heartbeats in and out, liveness, forwarding.

Outgoing: the dispatcher's peer layer (SkyLB Algorithm 1) picks a peer; the request's
original body goes over that peer's persistent mTLS channel (``skymesh.mesh``) and the
response chunks stream back to the client as they arrive.

Incoming: a peer's forwarded request is replayed on this balancer's own HTTP edge over
loopback, marked with a per-process secret header. It then takes exactly the path a local
request takes (queue, pushing mode, policy, retries) with one difference: it is marked
forwarded, so it is served by this region's replicas and never forwarded again. The
loopback hop costs well under a millisecond against a cross-region round trip of tens,
and keeps one request path instead of two.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp

from skymesh.balancer.batch_routing import BATCH_DEADLINE_HEADER
from skymesh.policies.peers import ModelLoad

if TYPE_CHECKING:
    import grpc

    from skymesh.balancer.config import BalancerConfig
    from skymesh.balancer.dispatch import Dispatcher
    from skymesh.balancer.kv_feed import KVFeeds
    from skymesh.mesh.proto import pb as pb_t
    from skymesh.mesh.summary import PeerSnapshot

log = logging.getLogger("skymesh.lb.mesh")
FORWARDED_HEADER = "X-SkyMesh-Forwarded"


FORWARDABLE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Each peer's heartbeat stream asks for the prefix summary (every 2 s by default); one
# build serves all the streams that ask within this long, so its cost (a walk of the
# trie and of the block indexes) does not grow with the number of peers.
SUMMARY_REUSE_S = 1.0


def add_model_loads(msg: pb_t.HeartbeatMsg, loads: dict[str, ModelLoad]) -> None:
    """Write the dispatcher's per-model loads into an outgoing heartbeat."""
    for model, ld in loads.items():
        m = msg.models.add(model=model, available_replicas=ld.available,
                           total_replicas=ld.total, queue_length=ld.queue,
                           pending_prefill_tokens=ld.pending_prefill_tokens)
        if ld.outstanding is not None:
            m.outstanding_requests = ld.outstanding


def read_model_loads(msg: pb_t.HeartbeatMsg) -> dict[str, ModelLoad]:
    """A heartbeat's per-model loads; ``outstanding`` stays None when the sender predates
    the field, so the balanced rule cannot take an old peer for an idle one."""
    return {m.model: ModelLoad(
        m.available_replicas, m.total_replicas, m.queue_length, m.pending_prefill_tokens,
        m.outstanding_requests if m.HasField("outstanding_requests") else None,
    ) for m in msg.models}


class MeshLink:
    def __init__(self, cfg: BalancerConfig, dispatcher: Dispatcher, wake: Any) -> None:
        from skymesh.mesh import MeshNode, TlsFiles, new_identity

        assert cfg.mesh is not None
        self.cfg = cfg
        self.mesh = cfg.mesh
        self.dispatcher = dispatcher
        self._wake = wake  # the balancer's pump
        self.secret = secrets.token_hex(16)
        self.local_url = ""  # set once the HTTP edge is bound
        self.forwarded_out = 0
        self.forwarded_in = 0
        self._session: aiohttp.ClientSession | None = None
        self._liveness: asyncio.Task[None] | None = None
        # The replicas' KV-event feeds (set by the server): the exact prefix summary.
        self.feeds: KVFeeds | None = None
        # The last prefix summary built, and when: every peer's stream asks for one.
        self._summary: tuple[float, pb_t.PrefixSummary | None] = (-math.inf, None)
        self.node = MeshNode(
            new_identity(cfg.region, self.mesh.id),
            TlsFiles.in_dir(self.mesh.certs_dir, self.mesh.id),
            local_summary=self._local_summary, forward_handler=self._handle_forward,
            on_heartbeat=self._on_heartbeat,
            peers={p.id: p.address for p in self.mesh.peers},
            host=self.mesh.listen_host, port=self.mesh.listen_port,
            interval=self.mesh.heartbeat_interval_s,
            heartbeat_limits=self.mesh.limits.heartbeats(), guard=self.mesh.limits.guard(),
        )
        dispatcher.set_peers([p.id for p in self.mesh.peers])
        for p in self.mesh.peers:  # unreachable until the liveness loop says otherwise
            dispatcher.set_peer_alive(p.id, False)

    async def start(self, local_url: str) -> None:
        self.local_url = local_url
        # Forwarded requests are replayed on our own edge, over loopback: with HTTPS there
        # the certificate names the public address, not this one, and nothing is in
        # between to verify it against.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=False) if local_url.startswith("https:")
            else None,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False)
        await self.node.start()
        self._liveness = asyncio.create_task(self._liveness_loop(), name="skymesh-liveness")
        log.info("mesh node %s on %s, peers %s", self.mesh.id, self.node.address,
                 [p.id for p in self.mesh.peers])

    async def stop(self) -> None:
        if self._liveness is not None:
            self._liveness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._liveness
        await self.node.stop()
        if self._session is not None:
            await self._session.close()

    async def set_peers(self, peers: dict[str, str]) -> None:
        """Replace the peer set (from the controller): ``{balancer_id: grpc_address}``."""
        current = {pid: c.address for pid, c in self.node.clients.items()}
        if current == peers:
            return
        for pid in set(current) - set(peers):
            await self.node.remove_peer(pid)
        for pid, addr in peers.items():
            if current.get(pid) != addr:
                await self.node.add_peer(pid, addr)
        self.dispatcher.set_peers(peers)
        for pid in set(peers) - set(current):  # unusable until heard from
            self.dispatcher.set_peer_alive(pid, False)
        log.info("mesh peers: %s", sorted(peers))

    # -- heartbeats ------------------------------------------------------------------------
    def _local_summary(self, include_prefix: bool) -> pb_t.HeartbeatMsg:
        from skymesh.mesh import pb, prefix_summary
        from skymesh.prefix.trie import PrefixTrie

        msg = pb.HeartbeatMsg()
        add_model_loads(msg, self.dispatcher.model_loads(time.monotonic()))
        if not include_prefix:
            return msg
        now = time.monotonic()
        built_at, summary = self._summary
        if now - built_at >= SUMMARY_REUSE_S:
            trie = getattr(self.dispatcher.policy, "trie", None)
            # Scoring keys whose replicas all have live events also get an exact summary
            # from their block indexes; the trie's stays for the rest, and for receivers
            # (or requests) without block keys.
            exact = self.feeds.exact_groups() if self.feeds is not None else []
            summary = None
            if isinstance(trie, PrefixTrie) or exact:
                summary = prefix_summary(trie if isinstance(trie, PrefixTrie) else (),
                                         exact=exact)
            self._summary = (now, summary)
        if summary is not None:
            msg.prefix.CopyFrom(summary)
        return msg

    def _on_heartbeat(self, msg: pb_t.HeartbeatMsg) -> None:
        models = read_model_loads(msg)
        self.dispatcher.on_peer_heartbeat(msg.balancer_id, time.monotonic(), msg.epoch,
                                          msg.seq, models)
        rtt = self.node.state.rtt_s(msg.balancer_id)
        if rtt is not None:  # the balanced rule charges a forward this round trip
            self.dispatcher.set_peer_rtt(msg.balancer_id, rtt)
        snapshot = self._snapshot()
        if msg.HasField("prefix") and snapshot is not None:
            from skymesh.mesh.heartbeat import read_block_summaries

            snapshot.insert_summary(msg.balancer_id, msg.prefix.keys, msg.prefix.depths)
            # A summary without blocks (an old peer, or events gone stale there) drops
            # the peer's exact summaries: its text summary speaks for it again.
            snapshot.insert_block_summaries(msg.balancer_id, read_block_summaries(msg.prefix))
        self._wake()

    def _snapshot(self) -> PeerSnapshot | None:
        from skymesh.mesh.summary import PeerSnapshot

        snapshot = getattr(self.dispatcher.peer_policy, "trie", None)
        return snapshot if isinstance(snapshot, PeerSnapshot) else None

    async def _liveness_loop(self) -> None:
        from skymesh.mesh import Liveness

        while True:
            for view in self.node.state.views():
                client = self.node.clients.get(view.balancer_id)
                # Usable: heard from recently, and our own channel to it is up (the pair's
                # heartbeat may run over the peer's channel to us, not ours to it).
                usable = view.liveness is not Liveness.DOWN and client is not None \
                    and client.ready()
                self.dispatcher.set_peer_alive(view.balancer_id, usable)
            await asyncio.sleep(self.mesh.heartbeat_interval_s)

    def peer_views(self) -> list[dict[str, Any]]:
        out = []
        snapshot = self._snapshot()
        for v in self.node.state.views():
            # The pair's heartbeat stream runs on one side's channel: count both ends.
            sessions = [self.node.server.sessions.get(v.balancer_id)]
            client = self.node.clients.get(v.balancer_id)
            if client is not None:
                sessions.append(client.session)
            live = [x for x in sessions if x is not None]
            load = self.dispatcher.peers.get(v.balancer_id)
            out.append({"id": v.balancer_id, "liveness": v.liveness.name.lower(),
                        "rtt_s": v.rtt_s,
                        "heartbeat_bytes_sent": sum(x.bytes_sent for x in live),
                        "heartbeat_bytes_received": sum(x.bytes_received for x in live),
                        # Whether routing may forward to it now (heard from, and our
                        # own channel to it is up), and its last heartbeat's loads.
                        "forwardable": load is not None and load.alive,
                        # Keys of its exact prefix summaries, per "scoring key/block size"
                        "exact_summary": {} if snapshot is None else {
                            f"{key}/{bs}": n for (key, bs), n in
                            snapshot.exact_of(v.balancer_id).items()},
                        "models": {} if load is None else {
                            m: {"available": ml.available, "total": ml.total,
                                "queue": ml.queue, "outstanding": ml.outstanding}
                            for m, ml in load.models.items()}})
        return out

    # -- forwarding out --------------------------------------------------------------------
    def forward(self, peer: str, request_id: str, model: str, path: str, body: bytes,
                stream: bool, affinity: str | None, timeout: float, *, priority: str = "",
                batch_deadline_ms: int = 0) -> Any:
        from skymesh.mesh import pb

        self.forwarded_out += 1
        req = pb.ForwardRequest(request_id=request_id, origin_region=self.cfg.region,
                                model=model, path=path, body=body, stream=stream,
                                affinity_key=affinity or "", priority=priority,
                                batch_deadline_ms=batch_deadline_ms)
        return self.node.forward(peer, req, timeout)

    # -- forwarding in ---------------------------------------------------------------------
    async def _handle_forward(self, req: pb_t.ForwardRequest, ctx: grpc.aio.ServicerContext
                              ) -> AsyncIterator[pb_t.ForwardChunk]:
        from skymesh.mesh import pb

        assert self._session is not None
        if req.path not in FORWARDABLE_PATHS:
            # Only generation is forwarded: a peer must not reach our other endpoints.
            yield pb.ForwardChunk(error=pb.ForwardChunk.Error(
                code="bad_path", message=f"path {req.path[:80]!r} is not forwardable",
                status=400))
            return
        self.forwarded_in += 1
        headers = {"Content-Type": "application/json", FORWARDED_HEADER: self.secret,
                   "X-Request-Id": req.request_id}
        if req.affinity_key:
            headers["X-Session-ID"] = req.affinity_key
        # Batch across the mesh: admitted last here too. Only a class name (lower-case
        # word) is replayed: a peer's bytes never become a broken header line.
        if req.priority and len(req.priority) <= 64 and req.priority.isascii() \
                and req.priority.isidentifier():
            ten = self.cfg.tenants
            headers[ten.priority_header if ten else "X-SkyMesh-Priority"] = req.priority
            if req.batch_deadline_ms:
                headers[BATCH_DEADLINE_HEADER] = str(req.batch_deadline_ms)
        remaining = ctx.time_remaining()
        timeout = aiohttp.ClientTimeout(total=remaining) if remaining else None
        try:
            async with self._session.post(self.local_url + req.path, data=req.body,
                                          headers=headers, timeout=timeout) as r:
                yield pb.ForwardChunk(head=pb.ForwardChunk.ResponseHead(
                    status=r.status, content_type=r.headers.get("Content-Type", "")))
                async for data in r.content.iter_any():
                    yield pb.ForwardChunk(data=data)
        except (aiohttp.ClientError, TimeoutError) as exc:
            yield pb.ForwardChunk(error=pb.ForwardChunk.Error(
                code="upstream_failed", message=str(exc) or type(exc).__name__, status=502))
