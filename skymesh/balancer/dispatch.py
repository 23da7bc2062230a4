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

With ``batch_lane`` on (``tenants.batch_mesh``), tickets marked ``batch`` wait in a lane of
their own per model, earliest deadline first, placed by ``skymesh.balancer.batch_routing``:
forwarded to a peer with room before the ordinary queues are placed, admitted locally after
them onto quiet replicas only (fewer than ``batch_room_per_replica`` better-class requests,
fewer than ``batch_max_per_replica`` batch), and within ``batch_urgent_s`` of their deadline
sent to a far lighter peer or moved to the ordinary queue (never forwarded again).
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from skymesh.balancer.batch_routing import (
    DEFAULT_ROOM_PER_REPLICA,
    BatchMove,
    PeerRoom,
    batch_move,
    lane_order,
    peer_room,
    quiet,
    reserved,
)
from skymesh.balancer.breaker import Breaker, BreakerState
from skymesh.balancer.errors import Overloaded
from skymesh.mesh.outlook import PeerOutlook
from skymesh.policies.base import Policy, RouteRequest
from skymesh.policies.load import (
    AVAILABLE,
    DEFAULT_KV_HEADROOM,
    DEFAULT_MAX_OUTSTANDING,
    DEFAULT_STEP_TOKENS,
    IF_TOKENS_FIT,
    PushMode,
    ReplicaLoad,
    availability,
    fits_tokens,
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
from skymesh.prefix.trie import PrefixTrie

_ids = itertools.count()
# Index entries of remembered evaluations before they are all dropped (stale entries, of
# tickets evaluated again or gone, leave the indexes only when their event comes).
_MAX_MEMO_ENTRIES = 1 << 16


_UNSEEN = object()


def _drop(entries: list[_Entry]) -> None:
    for ticket, memo in entries:
        if ticket.memo is memo:
            ticket.memo = None
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
    # The batch class under ``tenants.batch_mesh``: waits in the batch lane until placed
    # (``skymesh.balancer.batch_routing``); ``batch_due``: its deadline on this clock;
    # ``stay``: never forwarded (past that deadline, served where it is).
    batch: bool = False
    batch_due: float | None = None
    stay: bool = False
    # The dispatcher's record of this ticket's last evaluation that dispatched nothing,
    # while its inputs stay unchanged (``Dispatcher._pick``); None: none.
    memo: _Memo | None = field(default=None, repr=False)

    def route_at(self, now: float) -> RouteRequest:
        """The route with what is left of its deadline at ``now``."""
        d = self.route.deadline_s
        start = self.enqueued_at if self.deadline_from is None else self.deadline_from
        if d is None or now <= start:
            return self.route
        return replace(self.route, deadline_s=d - (now - start))


# eq=False: memos are compared by identity only, and a generated __eq__ would run for
# every memo of the window each time ``_pick`` asks whether one is missing.
@dataclass(slots=True, eq=False)
class _Memo:
    """A queued ticket's evaluation that dispatched nothing. The events that could change
    it drop it (``Dispatcher._remember`` says which); what is left to check when it is
    used: the generation, the policy's epoch, whether holds were allowed, and the end of
    a hold for the preferred replica."""

    gen: int
    epoch: int
    holds: bool
    held_since: float | None  # None: it had no candidate
    # Without a candidate: the replicas then available (or if the prompt fits) and
    # whether some had a queue for their prefix. It stays without one while no other
    # replica is available and none has gained such a queue: a replica that frees and
    # fills again between two pumps costs the queue no new evaluations.
    avail: frozenset[str] = frozenset()
    prefer_on: bool = True
    # A hold whose policy answer read no load (one replica holds the prefix): when that
    # replica's load changes, only whether it can take the request now needs a look
    # (``Dispatcher._still_held``), not the policy.
    pref: str | None = None
    suspect: bool = False
    # No candidate, and the policy's answer read no load but its own preferred replica's:
    # the replicas whose change needs a recheck (``Dispatcher._still_blocked``).
    recheck: tuple[str, ...] = ()


_Entry = tuple[Ticket, _Memo]


@dataclass(slots=True)
class _ModelView:
    """One model's replicas as ``candidates`` sees them, rebuilt when a replica's
    availability, health, breaker or membership changes (never per request)."""

    gen: int
    routable: tuple[Target, ...]  # healthy, serving the model, in membership order
    serving: tuple[str, ...]  # their ids
    ready: tuple[str, ...]  # AVAILABLE with a closed breaker
    tokens: tuple[str, ...]  # IF_TOKENS_FIT: available if the request's prompt fits
    plain: bool  # every breaker closed and nothing IF_TOKENS_FIT: ``ready`` is the answer
    timeless: bool  # every breaker closed: nothing depends on the clock
    prefer_on: bool  # some replica has a queue for requests holding their prefix
    avail: frozenset[str]  # ready and tokens


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
        # Incremental state, so a pump does not rescan every replica for every queued
        # request: each replica's availability (``policies.load.availability``) is
        # recomputed only after its load changed (``ReplicaLoad.on_change``), each
        # model's candidates only after an availability did (``_ModelView``), and a
        # queued request is evaluated again only when something it depended on changed
        # (``_Memo``): the events that can change an evaluation drop the memos that
        # depend on them through the indexes below. ``_gen`` bumps on anything broad
        # (membership, health, breakers, settings, the policy), dropping every memo.
        self.targets: dict[str, Target] = {}
        self._gen = 0
        self._codes: dict[str, int] = {}
        self._pq: dict[str, bool] = {}
        # Replicas that sp-p finds unavailable but that may take a request holding its
        # prefix there (``takes_preferred`` for the smallest prompt): with none of them
        # and no replica available, no queued request can go anywhere (``_pick``).
        self._takers: set[str] = set()
        # Replicas that are available or may be if a prompt fits (code not UNAVAILABLE):
        # with none, and no taker, no queue can dispatch anything (``pump``).
        self._open: set[str] = set()
        self._dirty: set[str] = set()
        self._views: dict[str, _ModelView] = {}
        # model -> (_gen, routable targets, their ids, every breaker closed): _view's part
        # that only a broad change (_gen) can change.
        self._serving: dict[str, tuple[int, tuple[Target, ...], tuple[str, ...], bool]] = {}
        self._by_target: dict[str, list[_Entry]] = {}  # memos that read a replica's load
        self._by_key: dict[int, list[_Entry]] = {}  # memos an insert of the key may change
        self._by_pref: dict[str, list[_Entry]] = {}  # holds for a replica (_Memo.pref)
        self._entries = 0  # index entries since the last reset (a bound on memory)
        self._told: Sequence[int] | None = None  # the keys _inserted was last told
        # Bumped by whatever may end a memo or change a queue: a queue whose last pick
        # found every request remembered, with nothing stirred since, is passed at once.
        self._stir = 0
        self._quiet: dict[str, tuple[int, int, bool, int, float | None]] = {}
        self._seen_pref: object = _UNSEEN
        # (_gen, models a healthy replica serves, some breaker open): ``health_summary``.
        self._health: tuple[int, frozenset[str], bool] = (-1, frozenset(), False)
        self._mode = PushMode(mode)
        self._max_outstanding = max_outstanding
        self._balancers = balancers_per_region
        self._kv_headroom = kv_headroom
        self._prefer_queue = prefer_queue
        self._policy = policy
        self.policy = policy
        # sp-p's queue for the replica holding the prefix (policies.load, takes_preferred)
        # for targets without their own (``ReplicaLoad.prefer_queue``), and the queue
        # length above which nothing is held for its preferred replica (a tree that
        # outgrows its replica spills at once instead of blocking the window).
        self.hold_queue_max = hold_queue_max
        self.step_tokens = step_tokens
        self.window = window
        self.hold_s = hold_s
        self.max_queue = max_queue
        self._breaker_args = (breaker_threshold, breaker_open_s)
        self._loads: dict[str, ReplicaLoad | PeerLoad] = {}
        self.peer_policy = peer_policy
        self.tau = tau
        self.forwarding_rule = ForwardingRule(forwarding_rule)
        self.balancing = balancing or Balancing()
        self.peers: dict[str, PeerLoad] = {}
        # Narrows overflow candidates by the controller's forecasts (skymesh.mesh.outlook).
        self.outlook: PeerOutlook | None = None
        self.queues: dict[str, deque[Ticket]] = {}
        self.queued = 0  # the ordinary queues and the batch lanes
        self.now = 0.0  # the LoadView clock, set by every pump
        # Batch across the mesh (skymesh.balancer.batch_routing): off unless configured.
        # ``better_waiting``: requests of better classes waiting in front of this
        # dispatcher (the tenants' fair queue), beside its own ordinary queue.
        self.batch_lane = False
        self.batch_forward = True
        self.batch_reserve = 0.0  # share of the replicas kept free for better classes
        self.batch_urgent_s = 0.0  # before its deadline a batch request is served anyway
        self.batch_max_per_replica = 1 << 30  # batch requests on one quiet replica
        self.batch_room_per_replica = DEFAULT_ROOM_PER_REPLICA  # batch_routing.room
        self.batch_on: dict[str, int] = {}  # batch requests of ours on each replica
        self.better_waiting: Callable[[str], int] | None = None
        self.lanes: dict[str, deque[Ticket]] = {}

    # -- settings (each change drops what was derived from the old value) --------------
    def _changed(self, *, availability: bool = False) -> None:
        """Something broad changed: every memo goes."""
        self._gen += 1
        self._stir += 1
        self._by_target.clear()
        self._by_key.clear()
        self._by_pref.clear()
        self._entries = 0
        if availability:
            self._dirty.update(self.targets)

    @property
    def policy(self) -> Policy:
        return self._policy

    @policy.setter
    def policy(self, value: Policy) -> None:
        old = getattr(self, "_policy", None)
        for p, hook in ((old, None), (value, self._inserted)):
            # Inserts that do not pass through this dispatcher (a sibling worker's
            # decisions, applied to the trie directly) must drop the memos they change
            # too: the trie tells its keys, whoever inserts.
            trie = getattr(p, "trie", None)
            if isinstance(trie, PrefixTrie):
                trie.on_keys = hook
        self._policy = value
        # Only policies that override ``preferred`` name a replica holding the prefix, so
        # only they can hold a request or use a replica's prefer_queue: skip asking the
        # others on every pump (the request path).
        self._names_preferred = type(value).preferred is not Policy.preferred
        self._memo_ok = not self._names_preferred or type(value).memo_preferred
        self._prefers = getattr(self, "_hold_s", 0.0) > 0 and self._names_preferred
        self._changed()

    @property
    def hold_s(self) -> float:
        return self._hold_s

    @hold_s.setter
    def hold_s(self, value: float) -> None:
        self._hold_s = value
        self._prefers = value > 0 and self._names_preferred
        self._changed()

    @property
    def mode(self) -> PushMode:
        return self._mode

    @mode.setter
    def mode(self, value: PushMode | str) -> None:
        self._mode = PushMode(value)
        self._changed(availability=True)

    @property
    def max_outstanding(self) -> int:
        return self._max_outstanding

    @max_outstanding.setter
    def max_outstanding(self, value: int) -> None:
        self._max_outstanding = value
        self._changed(availability=True)

    @property
    def balancers_per_region(self) -> int:
        """Balancers pushing to the same replicas, this one included: sp-p's n x margin
        (skymesh.policies.load). Set from the config, or from the controller's
        membership."""
        return self._balancers

    @balancers_per_region.setter
    def balancers_per_region(self, value: int) -> None:
        self._balancers = value
        self._changed(availability=True)

    @property
    def kv_headroom(self) -> float:
        return self._kv_headroom

    @kv_headroom.setter
    def kv_headroom(self, value: float) -> None:
        self._kv_headroom = value
        self._changed(availability=True)  # the takers (``_refresh``) read it

    @property
    def prefer_queue(self) -> int:
        return self._prefer_queue

    @prefer_queue.setter
    def prefer_queue(self, value: int) -> None:
        self._prefer_queue = value
        self._changed(availability=True)

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
        self._changed()
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
            probe = Ticket(RouteRequest("heartbeat", model=model, tie=0), now)
            serving = [t for t in self.targets.values() if model in t.models]
            out[model] = ModelLoad(
                available=len(self.candidates(probe, now)),
                total=len(serving),
                queue=self.queue_length(model),
                outstanding=sum(t.load.outstanding for t in serving),
            )
        return out

    def peer_candidates(self, ticket: Ticket) -> list[str]:
        if not self.forwarding or ticket.route.forwarded or ticket.stay:
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
                new[tid].load.on_change = self._watcher(tid)
        for tid, t in self.targets.items():
            if tid not in new:
                t.load.on_change = None
                for d in (self._codes, self._pq):
                    d.pop(tid, None)
                self._takers.discard(tid)
                self._open.discard(tid)
        self.targets = new
        self._dirty = set(new)
        self._changed()
        self._index_loads()
        self.policy.on_membership(sorted(new))

    def _watcher(self, tid: str) -> Callable[[], None]:
        """The replica's ``on_change``: its availability is recomputed at the next pump,
        and requests whose decision read its load are evaluated again."""
        by_target, by_pref = self._by_target, self._by_pref

        def changed() -> None:
            self._dirty.add(tid)
            entries = by_target.pop(tid, None)
            if entries:
                self._stir += 1
                _drop(entries)
            held = by_pref.pop(tid, None)
            if held:
                self._stir += 1
                for ticket, memo in held:
                    if ticket.memo is memo:
                        memo.suspect = True

        return changed

    def set_models(self, target: str, models: Iterable[str]) -> None:
        if target in self.targets:
            self.targets[target].models = frozenset(models)
            self._changed()

    def set_healthy(self, target: str, healthy: bool) -> None:
        t = self.targets.get(target)
        if t is not None and t.healthy != healthy:
            t.healthy = healthy
            self._changed()

    def health_summary(self) -> tuple[frozenset[str], bool]:
        """The models some healthy replica serves, and whether some breaker is open:
        what ``overload.may_strand`` asks at every pump. Health, models, membership and
        breaker states change only with ``_gen`` (an open breaker may half-open with the
        clock, which only shuts fewer), so this is recomputed only after a broad change."""
        h = self._health
        if h[0] != self._gen:
            targets = self.targets.values()
            h = self._health = (
                self._gen, frozenset(m for t in targets if t.healthy for m in t.models),
                any(t.breaker.state is BreakerState.OPEN for t in targets))
        return h[1], h[2]

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
        route = ticket.route
        if route.tie is None:
            # The request's tie-break, fixed once (policies.base): a re-ask at a later
            # pump breaks a tie as the first did, so its answer may be remembered.
            route.set_tie(self._policy.tie_for(route.request_id))
        lane = ticket.batch and self.batch_lane and not ticket.stay
        if lane:
            q = self.lanes.setdefault(ticket.route.model, deque())
        else:
            q = self.queues.setdefault(ticket.route.model, deque())
        if front:
            q.appendleft(ticket)
        elif lane:  # earliest deadline first (batch_routing.lane_order)
            q.insert(bisect_right(q, lane_order(ticket.batch_due),
                                  key=lambda t: lane_order(t.batch_due)), ticket)
        else:
            q.append(ticket)
        ticket.queued = True
        self.queued += 1
        # A pick reads only the first ``window`` requests (and whether the queue is over
        # ``hold_queue_max``, part of a quiet queue's record): one joining behind them
        # leaves a quiet queue quiet, so the pump at each arrival passes it at once.
        if front or len(q) <= self.window:
            self._stir += 1

    def cancel(self, ticket: Ticket) -> bool:
        """Take a still-queued ticket out (timeout, client gone). False if not queued."""
        if not ticket.queued:
            return False
        lane = self.lanes.get(ticket.route.model)
        if lane is not None and ticket in lane:
            lane.remove(ticket)
        else:
            self.queues[ticket.route.model].remove(ticket)
        ticket.queued = False
        self.queued -= 1
        self._stir += 1
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

    def slots(self, model: str) -> list[tuple[int, int, int]]:
        """(free, slots, not started) of each healthy replica serving ``model`` whose
        slots are known: sp-p's ``max_num_seqs`` less ``slots_taken``, sp-o's
        ``max_outstanding`` less ours in flight; not started: waiting in the last probe
        plus ours pushed and not yet admitted (tenancy's slot reserve reads it)."""
        out = []
        for t in self.targets.values():
            if not t.healthy or model not in t.models:
                continue
            load = t.load
            if self._mode is PushMode.SP_O:
                cap, used = self._max_outstanding, load.in_flight
            elif self._mode is PushMode.SP_P and load.max_num_seqs:
                cap, used = load.max_num_seqs, load.slots_taken
            else:
                continue
            out.append((max(0, cap - used), cap, load.waiting + load.unadmitted))
        return out

    def expired(self, now: float) -> list[Ticket]:
        """Queued tickets past their deadline, removed from the queue."""
        out = [t for q in (*self.queues.values(), *self.lanes.values()) for t in q
               if t.deadline is not None and t.deadline <= now]
        for t in out:
            self.cancel(t)
        return out

    # -- dispatch ------------------------------------------------------------------------
    def candidates(self, ticket: Ticket, now: float) -> list[str]:
        """The targets that may take ``ticket`` now (see the module docstring)."""
        self._refresh()
        return list(self._candidates(ticket, now, self._view(ticket.route.model)))

    def _refresh(self) -> None:
        """Recompute the availability of the replicas whose load changed."""
        dirty = self._dirty
        if not dirty:
            return
        codes, pqs, targets = self._codes, self._pq, self.targets
        mode, cap, n = self._mode, self._max_outstanding, self._balancers
        takers, room, opened = self._takers, self._kv_headroom, self._open
        sp_p, default_pq = mode is PushMode.SP_P, self._prefer_queue
        changed = False
        for tid in dirty:
            t = targets.get(tid)
            if t is None:
                continue
            load = t.load
            code = availability(load, mode, cap, n)
            allowance = default_pq if load.prefer_queue is None else load.prefer_queue
            pq = allowance > 0
            if code:
                opened.add(tid)
            else:
                opened.discard(tid)
            if pq and sp_p and code != AVAILABLE and takes_preferred(load, allowance, room):
                takers.add(tid)
            else:
                takers.discard(tid)
            old = codes.get(tid, -1)
            old_pq = pqs.get(tid, False)
            if code != old or pq != old_pq:
                codes[tid], pqs[tid] = code, pq
                changed = True
        dirty.clear()
        if changed:
            self._views.clear()
            self._stir += 1

    def _view(self, model: str) -> _ModelView:
        v = self._views.get(model)
        if v is not None and v.gen == self._gen:
            return v
        codes, pqs = self._codes, self._pq
        # Views go whenever an availability changes (most completions under load), while
        # who serves the model, healthy and with which breakers, changes only with _gen.
        base = self._serving.get(model)
        if base is None or base[0] != self._gen:
            routable = tuple(t for t in self.targets.values()
                             if model in t.models and t.healthy)
            base = self._serving[model] = (
                self._gen, routable, tuple(t.id for t in routable),
                all(t.breaker.state is BreakerState.CLOSED for t in routable))
        _, routable, serving, timeless = base
        tokens = tuple(t.id for t in routable if codes[t.id] == IF_TOKENS_FIT)
        v = _ModelView(
            gen=self._gen, routable=routable,
            serving=serving,
            ready=tuple(t.id for t in routable if codes[t.id] == AVAILABLE),
            tokens=tokens, plain=timeless and not tokens, timeless=timeless,
            prefer_on=any(pqs[t.id] for t in routable),
            avail=frozenset(t.id for t in routable if codes[t.id]))
        self._views[model] = v
        return v

    def _candidates(self, ticket: Ticket, now: float, view: _ModelView) -> Sequence[str]:
        route = ticket.route
        excluded = ticket.excluded
        out: Sequence[str]
        usable: Sequence[str] | None
        if view.plain and not excluded:
            # Every breaker closed (allows() is True and changes nothing) and no replica
            # whose answer depends on the prompt: the view's list is the answer.
            out, usable, prefer_on = view.ready, view.serving, view.prefer_on
            routable: Sequence[Target] = view.routable
        else:
            routable = view.routable
            if excluded:
                routable = [t for t in routable if t.id not in excluded]
            codes, room, tokens = self._codes, self._kv_headroom, route.prompt_len
            if view.timeless:  # every breaker closed: allows() is True, no need to ask
                out = [t.id for t in routable
                       if (c := codes[t.id]) == AVAILABLE
                       or (c == IF_TOKENS_FIT and fits_tokens(t.load, room, tokens))]
            else:
                out = [t.id for t in routable
                       if ((c := codes[t.id]) == AVAILABLE
                           or (c == IF_TOKENS_FIT and fits_tokens(t.load, room, tokens)))
                       and t.breaker.allows(now)]
            pqs = self._pq
            prefer_on = view.prefer_on if not excluded else any(pqs[t.id] for t in routable)
            # Every breaker closed and nothing excluded: every routable target is usable.
            usable = view.serving if view.timeless and not excluded else None
        if self._mode is PushMode.SP_P and route.prefix_keys and self._names_preferred \
                and prefer_on:
            if usable is None:
                usable = [t.id for t in routable if t.breaker.allows(now)]
            policy = self._policy
            draws = policy.draws
            pref = policy.preferred(route, usable, self)
            if usable is view.serving and policy.draws == draws:
                self._seen_pref = pref  # what the hold would ask again (``_pick``)
            if pref is not None and pref not in out:
                load = self.targets[pref].load
                if takes_preferred(load, self.prefer_queue_of(load), self._kv_headroom,
                                   route.prompt_len):
                    out = [*out, pref]
        return out

    def prefer_queue_of(self, load: ReplicaLoad) -> int:
        """The replica's queue for requests holding their prefix there: its own, else this
        dispatcher's."""
        return self._prefer_queue if load.prefer_queue is None else load.prefer_queue

    def pump(self, now: float) -> list[Ticket]:
        """Dispatch what can go now; returns the dispatched tickets.

        FCFS per model, with bounded delay scheduling when ``hold_s`` > 0: a request whose
        policy prefers a target that is busy right now (the replica holding its prefix)
        may wait up to ``hold_s`` for it, while the requests behind it, up to ``window``
        deep, take the replicas that are free. Past ``hold_s`` it goes to any candidate.
        """
        self.now = now
        out: list[Ticket] = []
        if not self.lanes:
            self._refresh()
            if not self._open and not self._takers and not self.forwarding:
                # No replica may take any request (``_pick``'s first check, for every
                # queue at once): the pump after most events under a standing queue.
                return out
        else:  # batch first to an idle peer, before the better classes overflow
            self._pump_lanes(now, out, local=False)
        for q in self.queues.values():
            while q:
                picked = self._pick(q, now)
                if picked is None:
                    break
                i, ticket, target, to_peer = picked
                del q[i]
                ticket.queued = False
                ticket.memo = None
                self.queued -= 1
                if to_peer:
                    self._assign_peer(ticket, target, now)
                else:
                    self._assign(ticket, target, now)
                out.append(ticket)
        if self.lanes:  # and last onto what the better classes left here
            self._pump_lanes(now, out, local=True)
        return out

    def _pump_lanes(self, now: float, out: list[Ticket], *, local: bool) -> None:
        """Place the batch lanes' first ``window`` tickets (``batch_routing.batch_move``)."""
        for model, lane in self.lanes.items():
            k = 0
            while k < min(len(lane), self.window):
                ticket = lane[k]
                self._refresh()
                view = self._view(model)
                cands = self._batch_room(self._candidates(ticket, now, view))
                q = self.queues.get(model)
                better = (len(q) if q else 0) + (
                    self.better_waiting(model) if self.better_waiting is not None else 0)
                up = bool(view.serving)  # healthy replicas serving the model
                move, peer = batch_move(
                    now=now, deadline_at=ticket.batch_due, forwarded=ticket.route.forwarded,
                    quiet=len(cands), better_waiting=better,
                    peers=self._idle_peers(ticket) if up else (), local=local,
                    keep=reserved(len(view.serving), self.batch_reserve),
                    urgent_s=self.batch_urgent_s, local_up=up,
                    live_peers=() if up else self._live_peers(ticket),
                    here_load=sum(self.targets[t].load.outstanding for t in view.serving)
                    / len(view.serving) if up else None,
                    lighter_by=self.batch_room_per_replica)
                if move is BatchMove.WAIT:
                    k += 1  # the next differs only by its deadline or its exclusions
                    continue
                target = peer
                if move is BatchMove.LOCAL:
                    target = self._policy.select(ticket.route_at(now), cands, self)
                    if target is None:
                        k += 1
                        continue
                del lane[k]
                if move is BatchMove.DUE:  # served where it is, in turn with the rest
                    ticket.stay = True
                    self.queues.setdefault(model, deque()).append(ticket)
                    self._stir += 1
                    continue
                assert target is not None
                ticket.queued = False
                ticket.memo = None
                self.queued -= 1
                if move is BatchMove.PEER:
                    self._assign_peer(ticket, target, now)
                else:
                    self._assign(ticket, target, now)
                out.append(ticket)

    def _batch_room(self, cands: Sequence[str]) -> list[str]:
        """The candidates batch may join (``batch_routing.quiet``): what is on each, as
        far as we can tell, less our batch there."""
        on, cap, targets = self.batch_on, self.batch_max_per_replica, self.targets
        return [tid for tid in cands
                if quiet(targets[tid].load.outstanding - (b := on.get(tid, 0)), b, cap,
                         self.batch_room_per_replica)]

    def _idle_peers(self, ticket: Ticket) -> list[PeerRoom]:
        """Peers that may take a forward, with their room for batch and their load
        (``batch_routing.peer_room``), net of what was sent to them since."""
        if not self.batch_forward or ticket.stay:
            return []
        return [peer_room(pid, self.peers[pid], ticket.route.model, self.batch_reserve,
                          self.batch_room_per_replica)
                for pid in self.peer_candidates(ticket)]

    def _live_peers(self, ticket: Ticket) -> list[PeerRoom]:
        """Live peers serving the ticket's model, busy or not: where batch goes when no
        local replica is up (it would otherwise wait for one until its deadline)."""
        if not self.batch_forward or not self.forwarding or ticket.stay:
            return []
        model = ticket.route.model
        return [PeerRoom(pid, p.rtt_s) for pid, p in self.peers.items()
                if p.alive and model in p.models and pid not in ticket.excluded]

    def _pick(self, q: deque[Ticket], now: float) -> tuple[int, Ticket, str, bool] | None:
        self._refresh()
        model = q[0].route.model
        view = self._view(model)
        any_avail = bool(view.ready or view.tokens)
        forwarding = self.forwarding
        if not any_avail and not forwarding and (
                not view.prefer_on or not self._names_preferred
                or self._takers.isdisjoint(view.serving)):
            # No replica may take any request (none available, none that would take one
            # holding its prefix there, no peer): every candidate list is empty, so no
            # evaluation could dispatch or hold anything. The memos that events dropped
            # are made again at a pump where something can take a request.
            return None
        hold = self._hold_s > 0
        depth = min(len(q), self.window) if hold else 1
        balanced = self.forwarding_rule is ForwardingRule.BALANCED and forwarding
        holds = self._prefers and (self.hold_queue_max is None
                                   or len(q) <= self.hold_queue_max)
        policy = self._policy
        # Evaluations are remembered only where nothing but the inputs a memo watches can
        # change them: no peers (their state moves with heartbeats and time), no breaker
        # that the clock may half-open, and a policy whose preferred() is memo-safe.
        memo_ok = self._memo_ok and view.timeless and not forwarding
        epoch = policy.memo_epoch() if memo_ok else 0
        gen, hold_s = self._gen, self._hold_s
        if memo_ok:
            quiet = self._quiet.get(model)
            if quiet is not None and quiet[:4] == (self._stir, depth, holds, epoch) and (
                    quiet[4] is None or now - quiet[4] < hold_s):
                return None
        for i in range(depth):
            ticket = q[i]
            m = ticket.memo
            if m is not None and memo_ok and m.gen == gen and m.epoch == epoch \
                    and m.holds == holds and (
                        now - m.held_since < hold_s if m.held_since is not None
                        else (not any_avail or view.avail <= m.avail)
                        and (m.prefer_on or not view.prefer_on)) \
                    and (not m.suspect or (self._still_held(ticket, m, view)
                                           if m.held_since is not None
                                           else self._still_blocked(ticket, m, view))):
                if hold:
                    continue
                break
            draws = policy.draws
            watch: list[str] = []
            keys: list[int] = []
            if balanced:
                peer = self._balanced_peer(ticket)
                if peer is not None:
                    return i, ticket, peer, True
            if memo_ok:  # what a preferred() call inside leaves, if one is made
                policy.considered, policy.memo_keys = (), ()
            self._seen_pref = _UNSEEN
            cands = self._candidates(ticket, now, view)
            if memo_ok:
                watch.extend(policy.considered)
                keys.extend(policy.memo_keys)
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
                if memo_ok:
                    seen = self._seen_pref
                    pref = seen if isinstance(seen, str) else None
                    if not ticket.excluded and (seen is not _UNSEEN or not watch) \
                            and all(t == pref for t in watch):
                        # The policy read no load but its own answer's: a change of the
                        # replicas that might take the request needs a recheck of them
                        # (``_still_blocked``), not the policy.
                        self._remember(ticket, draws, epoch, holds, None, [], keys, view,
                                       pref, recheck=(*view.tokens, *watch))
                    else:
                        watch.extend(view.tokens)  # whether they take it: their load
                        self._remember(ticket, draws, epoch, holds, None, watch, keys, view)
                if hold:
                    continue
                return None
            route = ticket.route_at(now)
            if holds and (ticket.held_since is None
                          or now - ticket.held_since < self.hold_s):
                # The same question as candidates' (same targets, nothing changed, no
                # draw, and memo-safe answers ignore the deadline): its answer stands.
                seen = self._seen_pref
                pref = seen if memo_ok and (seen is None or isinstance(seen, str)) \
                    else policy.preferred(route, view.serving, self)
                if pref is not None and pref not in cands:
                    # The hold counts from the first time another replica could have
                    # taken it: it bounds the delay locality adds, not the queueing.
                    if ticket.held_since is None:
                        ticket.held_since = now
                    if memo_ok:
                        watch.extend(policy.considered)
                        keys.extend(policy.memo_keys)
                        watch.append(pref)
                        if ticket.excluded:
                            # Then the two preferred() calls see different targets, and
                            # losing every candidate changes which of them is made.
                            watch.extend(cands)
                        self._remember(ticket, draws, epoch, holds, ticket.held_since,
                                       watch, keys, view, pref)
                    continue
            target = policy.select(route, cands, self)
            if target is not None:
                return i, ticket, target, False
        if memo_ok:
            memos = [q[i].memo for i in range(depth)]
            if None not in memos:  # every request remembered: quiet until stirred
                held = [m.held_since for m in memos if m is not None and m.held_since is not None]
                self._quiet[model] = (self._stir, depth, holds, epoch,
                                      min(held) if held else None)
        return None

    def _still_held(self, ticket: Ticket, m: _Memo, view: _ModelView) -> bool:
        """A hold whose preferred replica's load changed: it stands while that replica
        still cannot take the request (as ``_candidates`` would judge it); then it is
        watched again. The policy's answer read no load, so it is the same."""
        pref = m.pref or ""
        t = self.targets.get(pref)
        if t is None or not t.healthy or pref in ticket.excluded:
            return False
        code, load, route = self._codes.get(pref, 0), t.load, ticket.route
        if code == AVAILABLE or (code == IF_TOKENS_FIT and fits_tokens(
                load, self._kv_headroom, route.prompt_len)):
            return False
        if self._mode is PushMode.SP_P and view.prefer_on and takes_preferred(
                load, self.prefer_queue_of(load), self._kv_headroom, route.prompt_len):
            return False
        m.suspect = False
        self._by_pref.setdefault(pref, []).append((ticket, m))
        return True

    def _still_blocked(self, ticket: Ticket, m: _Memo, view: _ModelView) -> bool:
        """A request without a candidate, after a change of a replica it watches: it
        stays without one while no replica is available to it (as ``_candidates``
        judges it) and its preferred replica, if any, cannot take it; then it is watched
        again. The policy's answer read no load that changed, so it is the same."""
        if not m.recheck:
            return False
        if view.ready:  # the view's own lists: no routable replica's code to look up
            return False
        room, tokens = self._kv_headroom, ticket.route.prompt_len
        for tid in view.tokens:
            if fits_tokens(self.targets[tid].load, room, tokens):
                return False
        if m.pref is not None:
            home = self.targets.get(m.pref)
            if home is None or not home.healthy:
                return False
            if self._mode is PushMode.SP_P and view.prefer_on and takes_preferred(
                    home.load, self.prefer_queue_of(home.load), room, tokens):
                return False
        m.suspect = False
        entry = (ticket, m)
        for tid in m.recheck:
            self._by_pref.setdefault(tid, []).append(entry)
        return True

    def _remember(self, ticket: Ticket, draws: int, epoch: int, holds: bool,
                  held_since: float | None, watch: list[str], keys: list[int],
                  view: _ModelView, pref: str | None = None,
                  recheck: tuple[str, ...] | None = None) -> None:
        """Keep ``ticket``'s evaluation, indexed by what may change it: the loads of
        ``watch`` (``on_change``), an insert of one of ``keys`` into the policy's state
        (``_inserted``); without a candidate, it also lapses when another replica is
        available at a pump (``_pick``). Not when it drew from the policy's RNG: a repeat might draw
        differently, and skipping it would shift every later draw."""
        if self._policy.draws != draws:
            ticket.memo = None
            return
        if self._entries > _MAX_MEMO_ENTRIES:  # stale entries pile up: start afresh
            self._changed()
        if held_since is None:
            m = ticket.memo = _Memo(self._gen, epoch, holds, None, view.avail, view.prefer_on)
        else:
            m = ticket.memo = _Memo(self._gen, epoch, holds, held_since)
        entry = (ticket, m)
        by_target, by_key = self._by_target, self._by_key
        if recheck is not None:  # no candidate; the policy read no other load
            m.pref, m.recheck = pref, recheck
            for tid in recheck:
                self._by_pref.setdefault(tid, []).append(entry)
        elif held_since is not None and pref is not None and all(t == pref for t in watch):
            m.pref, watch = pref, []
            self._by_pref.setdefault(pref, []).append(entry)
        for tid in watch:
            lst = by_target.get(tid)
            if lst is None:
                by_target[tid] = [entry]
            else:
                lst.append(entry)
        for key in keys:
            lst2 = by_key.get(key)
            if lst2 is None:
                by_key[key] = [entry]
            else:
                lst2.append(entry)
        self._entries += len(watch) + len(keys) + 1

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
        if ticket.batch:
            self.batch_on[target] = self.batch_on.get(target, 0) + 1
        if t.breaker.state is not BreakerState.CLOSED:
            t.breaker.on_dispatch()
            self._changed()
        keys = ticket.route.prefix_keys
        self._told = None
        self._policy.on_dispatch(ticket.route, target, self)
        if self._told is not keys:  # (a trie's on_keys hook has told these already)
            self._inserted(keys)

    def _inserted(self, keys: Sequence[int], start: int = 0) -> None:
        """The policy may have recorded ``keys``: a queued request whose policy answer
        depended on one of them is evaluated again (``Policy.memo_keys``). ``start``: a
        trie's first prefix whose record changed (``PrefixTrie.on_keys``); the keys
        before it were recorded already, so no answer that depends on them alone moved."""
        self._told = keys
        by_key = self._by_key
        if len(keys) > start and by_key:
            for key in by_key.keys() & (keys[start:] if start else keys):
                self._stir += 1
                _drop(by_key.pop(key))

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
        if ticket.batch and (n := self.batch_on.pop(tid, 0)) > 1:
            self.batch_on[tid] = n - 1
        t = self.targets.get(tid)
        if t is not None:
            t.load.on_complete(ticket.key, now)
            b = t.breaker
            before = (b.state, b.trial_in_flight)
            if replica_fault:
                b.on_failure(now)
            elif ok:
                b.on_success()
            else:
                b.on_neutral()
            if (b.state, b.trial_in_flight) != before:
                self._changed()
        self._policy.on_complete(ticket.route, tid, ok)

    def cached(self, route: RouteRequest, target: str, keys: Sequence[int]) -> None:
        """``route`` ended well on ``target`` (a replica or a peer balancer), which now
        caches ``keys``: the prefix keys of its prompt and output. Called after
        :meth:`complete` by drivers that see the output."""
        if not keys:
            return
        if target in self.targets:
            self._told = None
            self._policy.on_cached(route, target, keys)
            if self._told is not keys:
                self._inserted(keys)
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
