"""Simulated replicas and regional balancers, driven by the event loop in virtual time.

``SimReplica`` runs the same :class:`~skymesh_replica.engine.core.Engine` as ``skymesh-replica``;
only the clock differs. It fast-forwards through steady decoding and cuts a fast-forwarded
batch short when a request arrives, so batches stay step-exact.

``SimBalancer`` is the regional balancer of the simulator around the same
:class:`~skymesh.balancer.dispatch.Dispatcher` the live ``skymesh-lb`` uses (FCFS queue per
model, pushing mode, policy from the shared registry); only the I/O differs: a probe of
every replica's engine each ``probe_interval`` stands for the live balancer's HTTP probe,
and network hops are event-loop delays.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import cast

from skymesh.balancer.batch_routing import DEFAULT_ROOM_PER_REPLICA
from skymesh.balancer.dispatch import DEFAULT_HOLD_S, Dispatcher, Ticket
from skymesh.balancer.tenancy import FairQueue, Reserve, Waiter, release_into
from skymesh.policies.base import Policy, RequestTiming, RouteRequest
from skymesh.policies.load import PushMode
from skymesh.policies.peers import (
    DEFAULT_FORWARDING_RULE,
    DEFAULT_TAU,
    Balancing,
    ForwardingRule,
    ModelLoad,
)
from skymesh_lab.sim.events import EventLoop
from skymesh_lab.sim.kv_view import EventView
from skymesh_lab.sim.network import Network
from skymesh_lab.sim.workload import WorkItem
from skymesh_replica.engine.core import Batch, Engine, Sequence, StepEvent
from skymesh_replica.engine.hashing import BLOCK_SIZE
from skymesh_replica.engine.profiles import Profile


@dataclass(slots=True)
class RequestRecord:
    item: WorkItem
    route: RouteRequest
    t_arrival: float  # client sends
    t_first: float = -1.0  # client receives the first token
    t_done: float = -1.0  # client receives the last token
    replica: str = ""
    served_region: str = ""
    hit_tokens: int = 0
    ok: bool = False
    error: str = ""
    # The balancers the request went through, with their tickets: the origin first, then
    # the peer it was forwarded to, if any.
    path: list[tuple[SimBalancer, Ticket]] = field(default_factory=list)
    # End-to-end deadline (seconds after t_arrival) and predicted output tokens, if any.
    deadline_s: float | None = None
    predicted_output: int | None = None
    # Migration (GoodServe): tokens generated on earlier replicas, which the current one
    # re-prefills as prompt; how many times the request moved.
    generated_before: int = 0
    migrations: int = 0
    # Prefix hit of the current replica's admission (the first one's is ``hit_tokens``).
    segment_hit_tokens: int = 0


@dataclass
class SimTenancy:
    """The fair queue a :class:`SimBalancer` orders its requests with: ``classify`` gives
    a request's (tenant, class); ``bound``: ``tenants.dispatch_queue``; ``reserve``: the
    slot reserve (``tenants.reserve``; None: none)."""

    queue: FairQueue
    classify: Callable[[RequestRecord], tuple[str, str]]
    bound: int = 2
    reserve: Reserve | None = None
    # Released, by ticket key, until done: the queue's occupancy (the adaptive reserve).
    released: dict[str, Waiter] = field(default_factory=dict)


@dataclass
class SimBatch:
    """Batch across the mesh (``tenants.batch_mesh``): ``is_batch`` says which requests
    are batch; ``deadline_s``: their deadline after arrival (None: none); ``forward``
    False keeps batch at home (the lane's local order only)."""

    is_batch: Callable[[RequestRecord], bool]
    deadline_s: float | None = None
    forward: bool = True
    reserve: float = 0.0  # tenants.batch_mesh.reserve
    urgent_s: float = 0.0  # tenants.batch_mesh.urgent_h, in seconds
    max_per_replica: int = 1 << 30  # tenants.batch_mesh.max_per_replica
    room_per_replica: int = DEFAULT_ROOM_PER_REPLICA  # tenants.batch_mesh.room_per_replica


class SimReplica:
    def __init__(
        self,
        rid: str,
        region: str,
        profile: Profile,
        loop: EventLoop,
        on_event: Callable[[SimReplica, RequestRecord, StepEvent], None],
        max_fast_forward: int = 4096,
        scheduler: str = "vllm",
    ) -> None:
        self.id = rid
        self.region = region
        self.profile = profile
        self.engine_model = "default"
        self.scheduler = scheduler
        self.engine = Engine(profile, scheduler=scheduler)
        self.loop = loop
        self._on_event = on_event
        self._max_ff = max_fast_forward
        self._batch: Batch | None = None
        self._start = 0.0
        self._gen = 0
        # What balancers following this replica's KV events know (follow_events).
        self.kv_view: EventView | None = None

    def follow_events(self, transit_s: float, delay_s: float | None = None) -> EventView:
        """Record the cache's stores and evictions and publish them once per step."""
        self.kv_view = EventView(self.loop, transit_s, delay_s)
        self.engine.kv.recorder = self.kv_view
        return self.kv_view

    def published_load(self) -> tuple[int, int]:
        """(waiting, running) as a probe reads them: vLLM's live counts, or SGLang's
        ``num_queue_reqs``/``num_running_reqs`` as of its last log point."""
        e = self.engine
        if self.scheduler == "sglang":
            return e.published_waiting, e.published_running
        return e.num_waiting, e.num_running

    def submit(self, rec: RequestRecord) -> str | None:
        """Hand a request to the engine now; an error message if the engine refuses it."""
        item = rec.item
        done = rec.generated_before
        seq = Sequence(item.request_id, item.prompt_len + done, item.output_len - done,
                       item.block_hashes,
                       max_new_tokens=0 if item.max_new_tokens is None
                       else item.max_new_tokens - done)
        seq.payload = rec
        try:
            self.engine.add(seq)
        except ValueError as exc:
            return str(exc)
        batch = self._batch
        if batch is None:
            self._start_step()
        elif batch.num_steps > 1:
            old = batch.duration
            new = self.engine.truncate(batch, self.loop.now - self._start)
            if new < old:
                self._gen += 1
                self.loop.at(self._start + new, self._end_step, self._gen)
        return None

    def _start_step(self) -> None:
        batch = self.engine.schedule(self._max_ff)
        self._batch = batch
        if batch is None:
            return
        self._start = self.loop.now
        self._gen += 1
        self.loop.at(self._start + batch.duration, self._end_step, self._gen)

    def _end_step(self, gen: int) -> None:
        if gen != self._gen or self._batch is None:
            return  # superseded by a truncation
        batch = self._batch
        events = self.engine.complete(batch)
        self._batch = None
        if self.kv_view is not None:
            self.kv_view.publish(batch.duration / max(1, batch.num_steps))
        for ev in events:
            self._on_event(self, cast("RequestRecord", ev.seq.payload), ev)
        self._start_step()


class SimBalancer:
    def __init__(
        self,
        name: str,
        region: str,
        replicas: list[SimReplica],
        policy: Policy,
        loop: EventLoop,
        net: Network,
        mode: PushMode = PushMode.SP_P,
        max_outstanding: int = 16,
        probe_interval: float = 0.1,
        is_active: Callable[[], bool] = lambda: True,
        on_rejected: Callable[[RequestRecord], None] = lambda rec: None,
        hold_s: float = DEFAULT_HOLD_S,
        peer_policy: Policy | None = None,
        tau: int = DEFAULT_TAU,
        heartbeat_interval: float = 0.2,
        forwarding_rule: ForwardingRule = DEFAULT_FORWARDING_RULE,
        balancing: Balancing | None = None,
        prefer_queue: int = 0,
        hold_queue_max: int | None = None,
    ) -> None:
        self.name = name
        self.region = region
        self.replicas = {r.id: r for r in replicas}
        self.loop = loop
        self.net = net
        # One-way delay to each replica in another region (probes cross the WAN); the
        # fleet is fixed, so it is worked out once, not on every probe round.
        self._remote_one_way = {
            r.id: d for r in replicas
            if (d := net.one_way(region, r.region)) > net.local_one_way_s}
        self.probe_interval = probe_interval
        self.heartbeat_interval = heartbeat_interval
        # The simulator never refuses for a full queue: experiments measure queueing.
        step_tokens = min((r.profile.max_num_batched_tokens for r in replicas), default=2048)
        self.dispatcher = Dispatcher(policy, mode, max_outstanding=max_outstanding,
                                     step_tokens=step_tokens, hold_s=hold_s,
                                     max_queue=1 << 62, peer_policy=peer_policy, tau=tau,
                                     forwarding_rule=forwarding_rule, balancing=balancing,
                                     prefer_queue=prefer_queue, hold_queue_max=hold_queue_max)
        self.dispatcher.set_targets({r.id: (r.engine_model,) for r in replicas})
        self.peers: dict[str, SimBalancer] = {}
        self._is_active = is_active
        self._on_rejected = on_rejected
        self._probing = False
        self._hb_seq = 0
        self.max_queue = 0
        self.forwarded_out = 0
        self.forwarded_in = 0
        self.migrations = 0
        # Tickets sent to a local replica and not done: key -> (ticket, dispatched at,
        # first token at or None); what timing-aware and migrating policies observe.
        self._sent: dict[str, tuple[Ticket, float, float | None]] = {}
        self._rechecking = False
        # Tenancy's fair queue in front of the dispatcher (skymesh.balancer.tenancy), as
        # the live balancer's with a tenants section; None: first come, first served.
        self.tenancy: SimTenancy | None = None
        self.batch: SimBatch | None = None

    def set_batch(self, batch: SimBatch) -> None:
        """Batch requests wait in the dispatcher's batch lane, as the live balancer's."""
        self.batch = batch
        d = self.dispatcher
        d.batch_lane, d.batch_forward, d.batch_reserve = True, batch.forward, batch.reserve
        d.batch_urgent_s, d.batch_max_per_replica = batch.urgent_s, batch.max_per_replica
        d.batch_room_per_replica = batch.room_per_replica
        d.better_waiting = lambda model: self.tenancy.queue.waiting if self.tenancy else 0

    @property
    def policy(self) -> Policy:
        return self.dispatcher.policy

    def connect(self, peers: list[SimBalancer]) -> None:
        self.peers = {p.name: p for p in peers if p is not self}
        self.dispatcher.set_peers(self.peers)
        for p in self.peers.values():
            # What the live balancer measures from heartbeat echoes; the network is fixed.
            self.dispatcher.set_peer_rtt(p.name, 2 * self.net.one_way(self.region, p.region))

    # -- arrivals ------------------------------------------------------------------------
    def arrive(self, rec: RequestRecord) -> None:
        self._enqueue(rec, rec.route)

    def arrive_forwarded(self, rec: RequestRecord) -> None:
        self.forwarded_in += 1
        self._enqueue(rec, replace(rec.route, forwarded=True))

    def _enqueue(self, rec: RequestRecord, route: RouteRequest) -> None:
        ticket = Ticket(route, self.loop.now, payload=rec)
        rec.path.append((self, ticket))
        ten = self.tenancy
        if self.batch is not None and self._mark_batch(ticket, rec):
            self.dispatcher.offer(ticket, self.loop.now)  # the lane, not the fair queue
        elif ten is not None and not route.forwarded:  # forwarded: ordered at its origin
            tenant, cls = ten.classify(rec)
            ten.queue.push(Waiter(route.model, tenant, cls, route.prompt_len,
                                  self.loop.now, ticket))
        else:
            self.dispatcher.offer(ticket, self.loop.now)
        if not self._probing:
            self._probing = True
            self._probe()
            if self.peers:
                self._heartbeat()
        else:
            self._pump()

    def _mark_batch(self, ticket: Ticket, rec: RequestRecord) -> bool:
        b = self.batch
        assert b is not None
        if not b.is_batch(rec):
            return False
        ticket.batch = True
        ticket.batch_due = None if b.deadline_s is None else rec.t_arrival + b.deadline_s
        return True

    # -- periodic signals ------------------------------------------------------------------
    def _probe(self) -> None:
        now = self.loop.now
        remote = self._remote_one_way
        for rid, rep in self.replicas.items():
            d = remote.get(rid)
            if d is not None:
                # A replica in another region (a single balancer's fleet) answers as of
                # half a round trip after the probe left, and the answer lands a round
                # trip after it: what the live balancer's probe through the WAN sees.
                self.loop.after(d, self._probe_remote, rep, now, d)
                continue
            waiting, running = rep.published_load()
            self.dispatcher.on_probe(rid, now, waiting, running, rep.engine.kv_usage,
                                     rep.profile.kv_capacity_tokens)
        self._pump()
        if self._is_active():
            self.loop.after(self.probe_interval, self._probe)
        else:
            self._probing = False

    def _probe_remote(self, rep: SimReplica, sent: float, one_way: float) -> None:
        waiting, running = rep.published_load()
        self.loop.after(one_way, self._probe_answer, rep, sent,
                        (waiting, running, rep.engine.kv_usage))

    def _probe_answer(self, rep: SimReplica, sent: float,
                      state: tuple[int, int, float]) -> None:
        if self.replicas.get(rep.id) is not rep:
            return  # the replica left while the answer was on its way
        waiting, running, kv_usage = state
        self.dispatcher.on_probe(rep.id, sent, waiting, running, kv_usage,
                                 rep.profile.kv_capacity_tokens)
        self._pump()

    def _heartbeat(self) -> None:
        self._hb_seq += 1
        models = self.dispatcher.model_loads(self.loop.now)
        for peer in self.peers.values():
            self.loop.after(self.net.one_way(self.region, peer.region), peer.on_heartbeat,
                            self.name, self._hb_seq, models)
        if self._is_active():
            self.loop.after(self.heartbeat_interval, self._heartbeat)

    def on_heartbeat(self, peer: str, seq: int, models: dict[str, ModelLoad]) -> None:
        if self.dispatcher.on_peer_heartbeat(peer, self.loop.now, 0, seq, models):
            self._pump()

    # -- dispatch --------------------------------------------------------------------------
    def _release(self) -> None:
        ten = self.tenancy
        if ten is not None and ten.queue.waiting:
            now, d = self.loop.now, self.dispatcher
            if ten.reserve is not None and ten.reserve.stagger and d.stagger is None:
                d.stagger = ten.queue.stagger  # as the live balancer wires it
            for w in release_into(ten.queue, d.queue_length, {}, ten.bound, now,
                                  reserve=ten.reserve, slots=d.slots):
                ten.released[w.payload.key] = w
                w.payload.tenant_class = w.cls
                d.offer(w.payload, now)

    def _pump(self) -> None:
        self._release()
        for ticket in self.dispatcher.pump(self.loop.now):
            rec: RequestRecord = ticket.payload
            target = ticket.target or ""
            if ticket.to_peer:
                peer = self.peers[target]
                self.forwarded_out += 1
                self.loop.after(self.net.one_way(self.region, peer.region),
                                peer.arrive_forwarded, rec)
                continue
            rec.replica = target
            self._sent[ticket.key] = (ticket, self.loop.now, None)
            rep = self.replicas[target]
            self.loop.after(self.net.one_way(self.region, rep.region), self._deliver, rec, rep)
        self._release()  # refilled: the next pump places them
        queued = self.dispatcher.queued
        if queued > self.max_queue:
            self.max_queue = queued

    def _deliver(self, rec: RequestRecord, rep: SimReplica) -> None:
        err = rep.submit(rec)
        if err is not None:
            # The replica answers 4xx at once (e.g. longer than the model's context).
            rec.error = err
            self._on_rejected(rec)

    def on_first_byte(self, ticket: Ticket) -> None:
        self.dispatcher.first_byte(ticket)
        sent = self._sent.get(ticket.key)
        if sent is not None:
            self._sent[ticket.key] = (sent[0], sent[1], self.loop.now)
            self.policy.on_timing(ticket.route, ticket.target or "", self._timing(sent[0]))
            if self.policy.wants_migration and not self._rechecking:
                self._rechecking = True
                self.loop.after(self.policy.migration_interval_s, self._recheck)
        self._pump()

    def on_done(self, ticket: Ticket, ok: bool) -> None:
        if ticket.key in self._sent:
            if ok:
                self.policy.on_timing(ticket.route, ticket.target or "",
                                      self._timing(ticket, finished=True))
            del self._sent[ticket.key]
        target = ticket.target
        ten = self.tenancy
        if ten is not None and (w := ten.released.pop(ticket.key, None)) is not None:
            rec_done: RequestRecord = ticket.payload
            ten.queue.finished(w, self.loop.now, rec_done.item.output_len if ok else 0)
        if ten is not None and ok and not ticket.route.forwarded:
            rec_: RequestRecord = ticket.payload  # its output: service received (VTC)
            ten.queue.charge(ten.classify(rec_)[0], rec_.item.output_len)
        self.dispatcher.complete(ticket, self.loop.now, ok=ok)
        if ok and target is not None:
            # The replica (or the peer region's) cache now holds prompt and output.
            rec: RequestRecord = ticket.payload
            self.dispatcher.cached(ticket.route, target, rec.item.block_hashes)
        self._pump()

    # -- timings and migration (policies that learn speeds, GoodServe) ---------------------
    def _timing(self, ticket: Ticket, finished: bool = False) -> RequestTiming:
        _, sent_at, first_at = self._sent[ticket.key]
        rec: RequestRecord = ticket.payload
        if finished:
            generated = rec.item.output_len - rec.generated_before
        else:
            seq = self.replicas[ticket.target or ""].engine.get(rec.item.request_id)
            generated = seq.num_output if seq is not None else 0
        return RequestTiming(
            now=self.loop.now, dispatched_at=sent_at, first_token_at=first_at,
            output_tokens=generated, finished=finished, prompt_tokens=ticket.route.prompt_len,
            hit_tokens=rec.segment_hit_tokens if first_at is not None else None,
        )

    def _recheck(self) -> None:
        """Ask the policy about every running request (GoodServe's periodic re-check)."""
        now = self.loop.now
        policy = self.policy
        moved = False
        for key, (ticket, _, first_at) in list(self._sent.items()):
            target = ticket.target
            if target is None or first_at is None or key not in self._sent:
                continue  # only requests streaming on a local replica move
            rec: RequestRecord = ticket.payload
            rep = self.replicas[target]
            seq = rep.engine.get(rec.item.request_id)
            if seq is None:
                continue  # finished; its completion is on the way
            cands = self.dispatcher.candidates(ticket, now)
            new = policy.migrate(ticket.route, target, self._timing(ticket), cands,
                                 self.dispatcher)
            if new is not None and new != target and new in self.replicas:
                self._migrate(ticket, rec, rep, seq.num_output)
                moved = True
        if moved:
            self._pump()
        if self._sent and self._is_active():
            self.loop.after(policy.migration_interval_s, self._recheck)
        else:
            self._rechecking = False

    def _migrate(self, ticket: Ticket, rec: RequestRecord, rep: SimReplica,
                 generated: int) -> None:
        """Move a streaming request: abort it where it runs and re-offer prompt + generated
        tokens, with what is left of its output and deadline, at the head of the queue.
        The client's stream continues: its first token stays the first one it saw."""
        now = self.loop.now
        _, sent_at, _ = self._sent.pop(ticket.key)
        rep.engine.abort(rec.item.request_id)
        self.dispatcher.complete(ticket, now, ok=False)
        route = ticket.route
        deadline = route.deadline_s
        predicted = route.predicted_output_tokens
        new_route = replace(
            route,
            prompt_len=route.prompt_len + generated,
            prefix_keys=rec.item.block_hashes[: (route.prompt_len + generated) // BLOCK_SIZE],
            predicted_output_tokens=None if predicted is None else (
                predicted - generated if predicted > generated
                else max(1, math.ceil(0.2 * predicted))),
            output_len_hint=None,
            deadline_s=None if deadline is None else deadline - (now - sent_at),
            forwarded=True,  # the stream continues on this region's replicas
        )
        rec.generated_before += generated
        rec.migrations += 1
        self.migrations += 1
        new_ticket = Ticket(new_route, now, payload=rec)
        new_ticket.excluded = {ticket.target or rep.id}
        rec.path[-1] = (self, new_ticket)
        self.dispatcher.offer(new_ticket, now, front=True)
