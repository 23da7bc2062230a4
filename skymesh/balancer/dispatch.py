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

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from skymesh.balancer.batch_routing import DEFAULT_ROOM_PER_REPLICA
from skymesh.balancer.breaker import Breaker, BreakerState
from skymesh.balancer.dispatch_lanes import BatchLanes
from skymesh.balancer.dispatch_state import (
    _UNSEEN,
    DEFAULT_HOLD_S,
    Target,
    Ticket,
    _Entry,
    _ModelView,
)
from skymesh.balancer.errors import Overloaded
from skymesh.mesh.outlook import PeerOutlook
from skymesh.policies.base import Policy, RouteRequest
from skymesh.policies.load import (
    DEFAULT_KV_HEADROOM,
    DEFAULT_MAX_OUTSTANDING,
    DEFAULT_STEP_TOKENS,
    PushMode,
    ReplicaLoad,
)
from skymesh.policies.peers import (
    DEFAULT_FORWARDING_RULE,
    DEFAULT_TAU,
    Balancing,
    ForwardingRule,
    PeerLoad,
)
from skymesh.prefix.trie import PrefixTrie


class Staggering(Protocol):
    """Where the tenants' lower-class requests are pending their start
    (``skymesh.balancer.tenancy.Stagger``, tenants.reserve_stagger)."""

    def narrow(self, model: str, cls: str | None, candidates: Sequence[str],
               now: float) -> Sequence[str]: ...

    def placed(self, key: str, model: str, cls: str | None, replica: str,
               now: float) -> None: ...

    def started(self, key: str) -> None: ...

# Enum members as module globals: on Python 3.11 ``ForwardingRule.BALANCED`` is a lookup
# through the enum class (about 0.1 us), paid on every pick and completion.
_BALANCED, _CLOSED, _HALF_OPEN = (ForwardingRule.BALANCED, BreakerState.CLOSED,
                                   BreakerState.HALF_OPEN)

# What other modules import from here (the parts live in dispatch_state, dispatch_view,
# dispatch_peers and dispatch_lanes).
__all__ = ["DEFAULT_HOLD_S", "Dispatcher", "PushMode", "Staggering", "Target", "Ticket"]


class Dispatcher(BatchLanes):
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
        # tenants.reserve_stagger: narrows a classed request's candidates before the
        # policy chooses (to replicas with no other class's request pending its start)
        # and is told where each went and when it started. None: off.
        self.stagger: Staggering | None = None

    # -- settings (each change drops what was derived from the old value) --------------
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
        # Most policies keep nothing per completion: no call of the base's no-op then.
        self._told_complete = type(value).on_complete is not Policy.on_complete
        self._select_follows = self._names_preferred and type(value).select_follows_preferred
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

    def set_models(self, target: str, models: Iterable[str]) -> None:
        if target in self.targets:
            self.targets[target].models = frozenset(models)
            self._changed()

    def set_healthy(self, target: str, healthy: bool) -> None:
        t = self.targets.get(target)
        if t is not None and t.healthy != healthy:
            t.healthy = healthy
            self._changed()

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
            # (``set_tie``'s own test is the one above: set in place, without its call.)
            route.tie = self._policy.tie_for(route.request_id)
        q = self._enqueue(ticket, front)
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
                    if self.stagger is not None:
                        self.stagger.placed(ticket.key, ticket.route.model,
                                            ticket.tenant_class, target, now)
                out.append(ticket)
        if self.lanes:  # and last onto what the better classes left here
            self._pump_lanes(now, out, local=True)
        return out

    def _pick(self, q: deque[Ticket], now: float) -> tuple[int, Ticket, str, bool] | None:
        if self._dirty:  # (pump refreshed already unless a dispatch since changed a load)
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
        balanced = forwarding and self.forwarding_rule is _BALANCED
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
            if quiet is not None and quiet[0] == self._stir and quiet[1] == depth \
                    and quiet[2] == holds and quiet[3] == epoch and (
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
            if balanced:
                peer = self._balanced_peer(ticket)
                if peer is not None:
                    return i, ticket, peer, True
            if memo_ok:  # what a preferred() call inside leaves, if one is made
                policy.considered, policy.memo_keys = (), ()
            self._seen_pref = _UNSEEN
            cands = self._candidates(ticket, now, view)
            # What the evaluation read, as lists only where it is remembered: most
            # evaluations dispatch, and need neither.
            seen_watch, seen_keys = policy.considered, policy.memo_keys
            if not cands:
                watch, keys = [*seen_watch], [*seen_keys]
                # SkyLB Algorithm 1: no local replica can take it now -> an available peer.
                peers = self.peer_candidates(ticket) if forwarding else []
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
                    all_pref = not watch if pref is None else watch.count(pref) == len(watch)
                    if not ticket.excluded and (seen is not _UNSEEN or not watch) and all_pref:
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
            route = ticket.route
            if route.deadline_s is not None:  # (route_at's own test, without its call)
                route = ticket.route_at(now)
            if holds and (ticket.held_since is None
                          or now - ticket.held_since < self.hold_s):
                # The same question as candidates' (same targets, nothing changed, no
                # draw, and memo-safe answers ignore the deadline): its answer stands.
                seen = self._seen_pref
                pref = seen if memo_ok and (seen is None or isinstance(seen, str)) \
                    else policy.preferred(route, view.serving, self)
                if pref is not None and pref not in cands and self._may_take(
                        ticket, pref, now):
                    # The hold counts from the first time another replica could have
                    # taken it: it bounds the delay locality adds, not the queueing.
                    if ticket.held_since is None:
                        ticket.held_since = now
                    if memo_ok:
                        watch, keys = [*seen_watch], [*seen_keys]
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
            if self.stagger is not None:
                # A filter before the policy's choice, never to none: it only moves the
                # request among replicas that may take it now, so nothing remembered
                # (a request with no candidate, or held) depends on it.
                cands = self.stagger.narrow(route.model, ticket.tenant_class, cands, now)
            elif len(cands) > 1 and self._select_follows \
                    and len(cands) == len(view.serving) and (
                        cands is view.ready or route.exact_prefix is None):
                # Every replica serving the model is a candidate (the candidates are
                # distinct, and among them), and _candidates asked preferred() over them
                # all just now: where it named one, select() would too
                # (``Policy.select_follows_preferred``). One candidate, select() answers
                # at once: the length is asked first.
                seen = self._seen_pref
                if isinstance(seen, str):
                    return i, ticket, seen, False
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

    def _may_take(self, ticket: Ticket, pref: str, now: float) -> bool:
        """Whether a hold for ``pref`` can end with ``ticket`` there: not a replica it
        failed on, nor one whose breaker lets nothing through now (open, or half-open
        with its trial out). A hold for those only ends at ``hold_s``, and nothing pumps
        then: queued requests waited seconds while the other replica stood idle (the
        stall of ``rss_soak --leave-hold-ms 5``, session 26). The policy is asked over
        every serving replica (``view.serving``), those included."""
        if pref in ticket.excluded:
            return False
        t = self.targets.get(pref)
        if t is None:
            return False
        b = t.breaker
        # Asked without moving the breaker (``allows`` would turn a due one half-open
        # outside the dispatcher's notice of a change): closed, due for its trial, or
        # half-open with the trial free.
        return b.state is _CLOSED or (not b.shut(now) and not (
            b.state is _HALF_OPEN and b.trial_in_flight))

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
        if self.stagger is not None:
            self.stagger.started(ticket.key)

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
        if self.stagger is not None:
            self.stagger.started(ticket.key)  # ended: no longer pending its start
        if ticket.batch and (n := self.batch_on.pop(tid, 0)) > 1:
            self.batch_on[tid] = n - 1
        t = self.targets.get(tid)
        if t is not None:
            t.load.on_complete(ticket.key, now)
            b = t.breaker
            if ok and not replica_fault and b.state is _CLOSED \
                    and not b.failures and not b.trial_in_flight:
                pass  # on_success would change nothing (the usual completion)
            else:
                before = (b.state, b.trial_in_flight)
                if replica_fault:
                    b.on_failure(now)
                elif ok:
                    b.on_success()
                else:
                    b.on_neutral()
                if (b.state, b.trial_in_flight) != before:
                    self._changed()
        if self._told_complete:
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
