"""The balancer's decision core: admission queues, replica availability, policy calls.

Pure and synchronous, so the live daemon (``skymesh.balancer.server``) and the simulator
(the lab's simulated cluster) run the same code: the caller offers a :class:`Ticket`, calls
:meth:`Dispatcher.pump` whenever something may have freed capacity (a probe, a first byte,
a completion, a membership change) and carries out the dispatches it returns. Nothing
polls: a request waits at the head of its model's FCFS queue until a pump finds an
available replica (SkyLB Algorithm 1, local layer).

A replica is a candidate for a request when it serves the model, is healthy, its breaker
allows a request, the pushing mode says it is available (``policies.load``), and the
request has not already failed on it. Load counters have one owner, this class: up in
:meth:`pump`, down in :meth:`complete`, whatever the outcome.

With peers (``set_peers``) and forwarding on, routing has two layers (SkyLB Algorithm 1):
a request that finds no available local replica goes to a peer balancer that is alive,
has an available replica and a queue of at most ``tau`` (``policies.peers``), picked by a
separate peer policy. A request a peer forwarded to us (``route.forwarded``) is served
here or waits here: it is never forwarded again.

With ``forwarding_rule`` ``balanced`` (``policies.peers``), a request at the head of the
queue may go to such a peer even while a local replica is available, when the peer's load
per replica (from its heartbeats) is lower than ours by more than the trip and a lost
prefix are worth: SkyLB's overflow rule leaves a region with more clients than replicas
running big, slow batches while its peers idle.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from skymesh.balancer.breaker import Breaker
from skymesh.balancer.errors import Overloaded
from skymesh.mesh.outlook import PeerOutlook
from skymesh.policies.base import Policy, RouteRequest
from skymesh.policies.load import (
    DEFAULT_KV_HEADROOM,
    DEFAULT_MAX_OUTSTANDING,
    DEFAULT_STEP_TOKENS,
    PushMode,
    ReplicaLoad,
    is_available,
    takes_preferred,
)
from skymesh.policies.peers import (
    DEFAULT_FORWARDING_RULE,
    DEFAULT_TAU,
    Balancing,
    ForwardingRule,
    ModelLoad,
    PeerLoad,
    PeerOption,
    balanced_peer,
)

_ids = itertools.count()
# How long a request may wait for the replica its policy prefers (the one holding its
# prefix) while another could take it. Measured in the simulator (tot-gsm8k, 4 x L4,
# prefix-tree, SP-P): 0 s loses locality under load (hit rate 52%, 8.6 req/s at 120
# clients), 2 s keeps most of it (75%, 11.9 req/s), above blind pushing's 12.1 req/s only
# from about 5 s; 2 s bounds the latency it can add.
DEFAULT_HOLD_S = 2.0


@dataclass(eq=False, slots=True)
class Ticket:
    route: RouteRequest
    enqueued_at: float
    deadline: float | None = None
    payload: Any = None
    target: str | None = None
    excluded: set[str] = field(default_factory=set)
    attempts: int = 0
    queued: bool = False
    held_since: float | None = None
    to_peer: bool = False  # the current target is a peer balancer
    key: str = field(default_factory=lambda: f"t{next(_ids)}")
    # When ``route.deadline_s`` started counting: None is ``enqueued_at``. Each dispatch
    # moves it there and shrinks the route's deadline to what was left, so a policy
    # always sees the budget from dispatch (GoodServe's D_r), net of the time spent queued
    # here or on a failed attempt.
    deadline_from: float | None = None

    def route_at(self, now: float) -> RouteRequest:
        """The route with what is left of its deadline at ``now``."""
        d = self.route.deadline_s
        start = self.enqueued_at if self.deadline_from is None else self.deadline_from
        if d is None or now <= start:
            return self.route
        return replace(self.route, deadline_s=d - (now - start))


@dataclass(slots=True)
class Target:
    id: str
    load: ReplicaLoad
    models: frozenset[str]
    healthy: bool = True
    breaker: Breaker = field(default_factory=Breaker)


class Dispatcher:
    def __init__(
        self,
        policy: Policy,
        mode: PushMode = PushMode.SP_P,
        *,
        max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
        kv_headroom: float = DEFAULT_KV_HEADROOM,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        hold_s: float = DEFAULT_HOLD_S,
        window: int = 16,
        max_queue: int = 1024,
        peer_policy: Policy | None = None,
        tau: int = DEFAULT_TAU,
        breaker_threshold: int = 5,
        breaker_open_s: float = 10.0,
        forwarding_rule: ForwardingRule = DEFAULT_FORWARDING_RULE,
        balancing: Balancing | None = None,
        balancers_per_region: int = 1,
        prefer_queue: int = 0,
        hold_queue_max: int | None = None,
    ) -> None:
        self.policy = policy
        # sp-p's queue for the replica holding the prefix (policies.load, takes_preferred)
        # for targets without their own (``ReplicaLoad.prefer_queue``), and the queue
        # length above which nothing is held for its preferred replica (a tree that
        # outgrows its replica spills at once instead of blocking the window).
        self.prefer_queue = prefer_queue
        self.hold_queue_max = hold_queue_max
        self.mode = mode
        # Balancers pushing to the same replicas, this one included: sp-p's n x margin
        # (skymesh.policies.load). Set from the config, or from the controller's membership.
        self.balancers_per_region = balancers_per_region
        self.max_outstanding = max_outstanding
        self.kv_headroom = kv_headroom
        self.step_tokens = step_tokens
        self.window = window
        self.hold_s = hold_s
        self.max_queue = max_queue
        self._breaker_args = (breaker_threshold, breaker_open_s)
        self.targets: dict[str, Target] = {}
        self._loads: dict[str, ReplicaLoad | PeerLoad] = {}
        self.peer_policy = peer_policy
        self.tau = tau
        self.forwarding_rule = ForwardingRule(forwarding_rule)
        self.balancing = balancing or Balancing()
        self.peers: dict[str, PeerLoad] = {}
        # Narrows overflow candidates by the controller's forecasts (skymesh.mesh.outlook).
        self.outlook: PeerOutlook | None = None
        self.queues: dict[str, deque[Ticket]] = {}
        self.queued = 0
        self.now = 0.0  # the LoadView clock, set by every pump

    @property
    def hold_s(self) -> float:
        return self._hold_s

    @hold_s.setter
    def hold_s(self, value: float) -> None:
        self._hold_s = value
        # Only policies that override ``preferred`` name a replica holding the prefix, so
        # only they can hold a request or use a replica's prefer_queue: skip asking the
        # others on every pump (the request path). Set again when the policy changes.
        self._names_preferred = type(self.policy).preferred is not Policy.preferred
        self._prefers = value > 0 and self._names_preferred

    # -- LoadView ------------------------------------------------------------------------
    def load(self, target: str) -> ReplicaLoad | PeerLoad:
        return self._loads[target]

    def outstanding_of(self, targets: Sequence[str]) -> list[int]:
        """``load(t).outstanding`` for each target, in one call (see policies.base)."""
        loads = self._loads
        return [loads[t].outstanding for t in targets]

    def _index_loads(self) -> None:
        # Replicas and peers in one dict: load() is called for every candidate of every
        # decision, and two lookups (replica, then peer) cost more than the rest of it.
        loads: dict[str, ReplicaLoad | PeerLoad] = dict(self.peers)
        loads.update((tid, t.load) for tid, t in self.targets.items())
        self._loads = loads

    # -- peers ---------------------------------------------------------------------------
    @property
    def forwarding(self) -> bool:
        return self.peer_policy is not None and bool(self.peers)

    def set_peers(self, peer_ids: Iterable[str]) -> None:
        """Replace the peer set; state survives for peers that stay."""
        self.peers = {p: self.peers.get(p) or PeerLoad(p) for p in peer_ids}
        self._index_loads()
        if self.peer_policy is not None:
            self.peer_policy.on_membership(sorted(self.peers))

    def on_peer_heartbeat(self, peer: str, now: float, epoch: int, seq: int,
                          models: dict[str, ModelLoad]) -> bool:
        p = self.peers.get(peer)
        return p is not None and p.on_heartbeat(now, epoch, seq, models)

    def set_peer_alive(self, peer: str, alive: bool) -> None:
        if peer in self.peers:
            self.peers[peer].alive = alive

    def set_peer_rtt(self, peer: str, rtt_s: float) -> None:
        if peer in self.peers:
            self.peers[peer].rtt_s = rtt_s

    def model_loads(self, now: float) -> dict[str, ModelLoad]:
        """This balancer's load per model, as its heartbeats tell peers: replicas that could
        take a request now (as this dispatcher would judge it), all replicas, queue, and
        requests outstanding on those replicas (the balanced rule's load figure)."""
        out: dict[str, ModelLoad] = {}
        for model in self.models():
            probe = Ticket(RouteRequest("heartbeat", model=model), now)
            serving = [t for t in self.targets.values() if model in t.models]
            out[model] = ModelLoad(
                available=len(self.candidates(probe, now)),
                total=len(serving),
                queue=self.queue_length(model),
                outstanding=sum(t.load.outstanding for t in serving),
            )
        return out

    def peer_candidates(self, ticket: Ticket) -> list[str]:
        if not self.forwarding or ticket.route.forwarded:
            return []
        model, tau = ticket.route.model, self.tau
        return [pid for pid, p in self.peers.items()
                if pid not in ticket.excluded and p.available_for(model, tau)]

    # -- membership ----------------------------------------------------------------------
    def set_targets(self, models_by_target: dict[str, Iterable[str]]) -> None:
        """Replace the target set; load and breaker state survive for targets that stay."""
        new: dict[str, Target] = {}
        for tid, models in models_by_target.items():
            old = self.targets.get(tid)
            if old is not None:
                old.models = frozenset(models)
                new[tid] = old
            else:
                th, op = self._breaker_args
                new[tid] = Target(tid, ReplicaLoad(tid, step_tokens=self.step_tokens),
                                  frozenset(models), breaker=Breaker(th, op))
        self.targets = new
        self._index_loads()
        self.policy.on_membership(sorted(new))

    def set_models(self, target: str, models: Iterable[str]) -> None:
        if target in self.targets:
            self.targets[target].models = frozenset(models)

    def set_healthy(self, target: str, healthy: bool) -> None:
        if target in self.targets:
            self.targets[target].healthy = healthy

    def models(self) -> set[str]:
        return {m for t in self.targets.values() for m in t.models}

    def serves(self, model: str) -> bool:
        return any(model in t.models for t in self.targets.values())

    def reachable(self, model: str) -> bool:
        """Served here, or by a peer we could forward to (a region may have no replicas)."""
        return self.serves(model) or (self.forwarding and any(
            model in p.models for p in self.peers.values()))

    # -- queue ---------------------------------------------------------------------------
    def offer(self, ticket: Ticket, now: float, *, front: bool = False,
              beyond: int = 0) -> None:
        """Queue a request; a retry goes to the front. Raises Overloaded when full
        (``beyond``: places past ``max_queue`` this request may take)."""
        if not front and self.queued >= self.max_queue + beyond:
            raise Overloaded(
                f"the balancer's queue is full ({self.max_queue} requests waiting)",
                retry_after_s=1.0,
            )
        q = self.queues.setdefault(ticket.route.model, deque())
        if front:
            q.appendleft(ticket)
        else:
            q.append(ticket)
        ticket.queued = True
        self.queued += 1

    def cancel(self, ticket: Ticket) -> bool:
        """Take a still-queued ticket out (timeout, client gone). False if not queued."""
        if not ticket.queued:
            return False
        self.queues[ticket.route.model].remove(ticket)
        ticket.queued = False
        self.queued -= 1
        return True

    def serves_beyond(self, model: str, excluded: set[str]) -> bool:
        """Whether some target outside ``excluded`` serves ``model`` (a retry has
        somewhere to go)."""
        return any(model in t.models and tid not in excluded
                   for tid, t in self.targets.items())

    def queue_length(self, model: str | None = None) -> int:
        if model is None:
            return self.queued
        q = self.queues.get(model)
        return len(q) if q else 0

    def expired(self, now: float) -> list[Ticket]:
        """Queued tickets past their deadline, removed from the queue."""
        out = [t for q in self.queues.values() for t in q
               if t.deadline is not None and t.deadline <= now]
        for t in out:
            self.cancel(t)
        return out

    # -- dispatch ------------------------------------------------------------------------
    def candidates(self, ticket: Ticket, now: float) -> list[str]:
        model = ticket.route.model
        mode, cap, room = self.mode, self.max_outstanding, self.kv_headroom
        tokens, n = ticket.route.prompt_len, self.balancers_per_region
        routable = [(tid, t) for tid, t in self.targets.items()
                    if model in t.models and t.healthy and tid not in ticket.excluded]
        out = [tid for tid, t in routable
               if is_available(t.load, mode, cap, room, tokens, n) and t.breaker.allows(now)]
        if mode is PushMode.SP_P and ticket.route.prefix_keys and self._prefer_queue_on(routable):
            usable = [tid for tid, t in routable if t.breaker.allows(now)]
            pref = self.policy.preferred(ticket.route, usable, self)
            if pref is not None and pref not in out:
                load = self.targets[pref].load
                if takes_preferred(load, self.prefer_queue_of(load), room, tokens):
                    out.append(pref)
        return out

    def prefer_queue_of(self, load: ReplicaLoad) -> int:
        """The replica's queue for requests holding their prefix there: its own, else this
        dispatcher's."""
        return self.prefer_queue if load.prefer_queue is None else load.prefer_queue

    def _prefer_queue_on(self, routable: list[tuple[str, Target]]) -> bool:
        return self._names_preferred and any(
            self.prefer_queue_of(t.load) > 0 for _, t in routable)

    def pump(self, now: float) -> list[Ticket]:
        """Dispatch what can go now; returns the dispatched tickets.

        FCFS per model, with bounded delay scheduling when ``hold_s`` > 0: a request whose
        policy prefers a target that is busy right now (the replica holding its prefix)
        may wait up to ``hold_s`` for it, while the requests behind it, up to ``window``
        deep, take the replicas that are free. Past ``hold_s`` it goes to any candidate.
        """
        self.now = now
        out: list[Ticket] = []
        for q in self.queues.values():
            while q:
                picked = self._pick(q, now)
                if picked is None:
                    break
                i, ticket, target, to_peer = picked
                del q[i]
                ticket.queued = False
                self.queued -= 1
                if to_peer:
                    self._assign_peer(ticket, target, now)
                else:
                    self._assign(ticket, target, now)
                out.append(ticket)
        return out

    def _pick(self, q: deque[Ticket], now: float) -> tuple[int, Ticket, str, bool] | None:
        depth = min(len(q), self.window) if self._hold_s > 0 else 1
        balanced = self.forwarding_rule is ForwardingRule.BALANCED and self.forwarding
        for i in range(depth):
            ticket = q[i]
            if balanced:
                peer = self._balanced_peer(ticket)
                if peer is not None:
                    return i, ticket, peer, True
            cands = self.candidates(ticket, now)
            if not cands:
                # SkyLB Algorithm 1: no local replica can take it now -> an available peer.
                peers = self.peer_candidates(ticket)
                if peers and self.outlook is not None:  # forecast-aware overflow
                    model = ticket.route.model
                    peers = self.outlook.rank(peers, model, {
                        pid: self.peers[pid].models.get(model) for pid in peers})
                if peers:
                    assert self.peer_policy is not None
                    peer = self.peer_policy.select(ticket.route, peers, self)
                    if peer is not None:
                        return i, ticket, peer, True
                if self._hold_s > 0:
                    continue
                return None
            route = ticket.route_at(now)
            holds = self._prefers and (self.hold_queue_max is None
                                       or len(q) <= self.hold_queue_max)
            if holds and (ticket.held_since is None
                          or now - ticket.held_since < self.hold_s):
                serving = [tid for tid, t in self.targets.items()
                           if route.model in t.models and t.healthy]
                pref = self.policy.preferred(route, serving, self)
                if pref is not None and pref not in cands:
                    # The hold counts from the first time another replica could have
                    # taken it: it bounds the delay locality adds, not the queueing.
                    if ticket.held_since is None:
                        ticket.held_since = now
                    continue
            target = self.policy.select(route, cands, self)
            if target is not None:
                return i, ticket, target, False
        return None

    def _balanced_peer(self, ticket: Ticket) -> str | None:
        """The balanced rule's peer for ``ticket``, or None to go on as SkyLB would."""
        route = ticket.route
        peers = self.peer_candidates(ticket)
        if not peers:
            return None
        serving = [tid for tid, t in self.targets.items()
                   if route.model in t.models and t.healthy]
        if serving:
            local = (sum(self.targets[tid].load.outstanding for tid in serving)
                     + self.queue_length(route.model)) / len(serving)
        else:
            local = math.inf
        options = []
        for pid in peers:
            p = self.peers[pid]
            load = p.load_per_replica(route.model)
            if load is not None:
                options.append(PeerOption(pid, load, p.rtt_s))
        if not options:
            return None
        b = self.balancing
        # The prefix lookups are the costly part: skip them when no peer could win even
        # with every locality term in its favour.
        if min(o.load + b.margin + b.rtt_weight * o.rtt_s for o in options) \
                >= local + b.locality:
            return None
        local_prefix = serving and route.prefix_keys and \
            self.policy.preferred(route, serving, self) is not None
        prefix_peer = None
        if route.prefix_keys and self.peer_policy is not None:
            prefix_peer = self.peer_policy.preferred(route, [o.peer for o in options], self)
        return balanced_peer(local, bool(local_prefix), options, prefix_peer, b)

    def _assign_peer(self, ticket: Ticket, peer: str, now: float) -> None:
        assert self.peer_policy is not None
        ticket.target = peer
        ticket.to_peer = True
        ticket.attempts += 1
        self.peers[peer].on_dispatch(ticket.key, ticket.route.model, now)
        self.peer_policy.on_dispatch(ticket.route, peer, self)

    def _assign(self, ticket: Ticket, target: str, now: float) -> None:
        t = self.targets[target]
        if ticket.route.deadline_s is not None:
            ticket.route = ticket.route_at(now)
            ticket.deadline_from = now
        ticket.to_peer = False
        ticket.target = target
        ticket.attempts += 1
        t.load.on_dispatch(ticket.key, now, ticket.route.prompt_len)
        t.breaker.on_dispatch()
        self.policy.on_dispatch(ticket.route, target, self)

    # -- outcomes ------------------------------------------------------------------------
    def first_byte(self, ticket: Ticket) -> None:
        if ticket.to_peer:
            p = self.peers.get(ticket.target or "")
            if p is not None:
                p.on_first_byte(ticket.key)
            return
        t = self.targets.get(ticket.target or "")
        if t is not None:
            t.load.on_first_byte(ticket.key)

    def complete(self, ticket: Ticket, now: float, *, ok: bool, replica_fault: bool = False
                 ) -> None:
        """The attempt on ``ticket.target`` ended. ``replica_fault``: 5xx, connect error or
        timeout (counts against the breaker); a client error or cancellation does not."""
        tid = ticket.target
        if tid is None:
            return
        ticket.target = None
        if ticket.to_peer:
            p = self.peers.get(tid)
            if p is not None:
                p.on_complete(ticket.key)
            if self.peer_policy is not None:
                self.peer_policy.on_complete(ticket.route, tid, ok)
            return
        t = self.targets.get(tid)
        if t is not None:
            t.load.on_complete(ticket.key, now)
            if replica_fault:
                t.breaker.on_failure(now)
            elif ok:
                t.breaker.on_success()
            else:
                t.breaker.on_neutral()
        self.policy.on_complete(ticket.route, tid, ok)

    def cached(self, route: RouteRequest, target: str, keys: Sequence[int]) -> None:
        """``route`` ended well on ``target`` (a replica or a peer balancer), which now
        caches ``keys``: the prefix keys of its prompt and output. Called after
        :meth:`complete` by drivers that see the output."""
        if not keys:
            return
        if target in self.targets:
            self.policy.on_cached(route, target, keys)
        elif target in self.peers and self.peer_policy is not None:
            self.peer_policy.on_cached(route, target, keys)

    def on_probe(self, target: str, now: float, waiting: int, running: int,
                 kv_usage: float, kv_capacity_tokens: int | None = None, *,
                 max_num_seqs: int | None = None, metrics_lag_s: float | None = None,
                 engine_queue: int | None = None, prefer_queue: int | None = None) -> None:
        """A probe of ``target`` published at ``now`` (see ``ReplicaLoad.on_probe``)."""
        t = self.targets.get(target)
        if t is not None:
            t.load.on_probe(now, waiting, running, kv_usage, kv_capacity_tokens,
                            max_num_seqs, metrics_lag_s, engine_queue, prefer_queue)
