"""The dispatcher's view of its replicas: availability, candidates, memos, load.

:class:`DispatchView` is the part of :class:`~skymesh.balancer.dispatch.Dispatcher` that
keeps the incremental state its ``__init__`` describes: each replica's availability
(``_refresh``), each model's candidates (``_view``, ``_candidates``), and the remembered
evaluations of queued requests with the indexes that drop them (``_remember``,
``_watcher``, ``_inserted``). The dispatcher sets every attribute declared here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import TypeVar

from skymesh.balancer.breaker import BreakerState
from skymesh.balancer.dispatch_state import (
    _MAX_MEMO_ENTRIES,
    Target,
    Ticket,
    _drop,
    _Entry,
    _Memo,
    _ModelView,
)
from skymesh.policies.base import Policy
from skymesh.policies.load import (
    AVAILABLE,
    IF_TOKENS_FIT,
    PushMode,
    ReplicaLoad,
    availability,
    fits_tokens,
    takes_preferred,
)
from skymesh.policies.peers import PeerLoad

_K = TypeVar("_K")
# Enum members as module globals: on Python 3.11 ``PushMode.SP_P`` is a lookup through the
# enum class (about 0.1 us), paid on every candidate list and dispatch.
_SP_P, _CLOSED = PushMode.SP_P, BreakerState.CLOSED


class DispatchView:
    targets: dict[str, Target]
    peers: dict[str, PeerLoad]
    queues: dict[str, deque[Ticket]]
    queued: int
    now: float  # the LoadView clock, set by every pump
    batch_on: dict[str, int]
    _gen: int
    _stir: int
    _codes: dict[str, int]
    _pq: dict[str, bool]
    _takers: set[str]
    _open: set[str]
    _dirty: set[str]
    _views: dict[str, _ModelView]
    _serving: dict[str, tuple[int, tuple[Target, ...], tuple[str, ...], bool]]
    _by_target: dict[str, list[_Entry]]
    _by_key: dict[int, list[_Entry]]
    _by_pref: dict[str, list[_Entry]]
    _entries: int
    _told: Sequence[int] | None
    _seen_pref: object
    _health: tuple[int, frozenset[str], bool]
    _loads: dict[str, ReplicaLoad | PeerLoad]
    _mode: PushMode
    _max_outstanding: int
    _balancers: int
    _kv_headroom: float
    _prefer_queue: int
    _policy: Policy
    _names_preferred: bool

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

    # -- LoadView ----------------------------------------------------------------------
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

    # -- membership --------------------------------------------------------------------
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

    def serves_beyond(self, model: str, excluded: AbstractSet[str]) -> bool:
        """Whether some target outside ``excluded`` serves ``model`` (a retry has
        somewhere to go)."""
        return any(model in t.models and tid not in excluded
                   for tid, t in self.targets.items())

    def queue_length(self, model: str | None = None) -> int:
        if model is None:
            return self.queued
        q = self.queues.get(model)
        return len(q) if q else 0

    # -- candidates --------------------------------------------------------------------
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
        sp_p, default_pq = mode is _SP_P, self._prefer_queue
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
        if self._mode is _SP_P and route.prefix_keys and self._names_preferred \
                and prefer_on:
            if usable is None:
                usable = [t.id for t in routable if t.breaker.allows(now)]
            policy = self._policy
            draws = policy.draws
            pref = policy.preferred(route, usable, self)
            if usable is view.serving and policy.draws == draws:
                self._seen_pref = pref  # what the hold would ask again (``_pick``)
            if pref is not None and pref not in out and self._takes(pref, route.prompt_len):
                out = [*out, pref]
        return out

    def _takes(self, pref: str, tokens: int) -> bool:
        """``takes_preferred`` for the replica ``pref``, a request of ``tokens`` prompt
        tokens, sp-p. ``_refresh`` asked it already for a prompt of none of the replicas
        it finds unavailable (``_takers``): a request's tokens only count against a
        published KV capacity, so without one its answer is this one's, and with one
        a replica that takes no prompt takes none larger."""
        load = self.targets[pref].load
        if self._codes.get(pref) != AVAILABLE:
            if pref not in self._takers:
                return False
            if load.kv_capacity_tokens is None:
                return True
        return takes_preferred(load, self.prefer_queue_of(load), self._kv_headroom, tokens)

    def prefer_queue_of(self, load: ReplicaLoad) -> int:
        """The replica's queue for requests holding their prefix there: its own, else this
        dispatcher's."""
        return self._prefer_queue if load.prefer_queue is None else load.prefer_queue

    # -- memos -------------------------------------------------------------------------
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
        if recheck is not None:  # no candidate; the policy read no other load
            m.pref, m.recheck = pref, recheck
            for tid in recheck:
                self._by_pref.setdefault(tid, []).append(entry)
        elif held_since is not None and pref is not None and all(t == pref for t in watch):
            m.pref, watch = pref, []
            self._by_pref.setdefault(pref, []).append(entry)
        _file_under(self._by_target, watch, entry)
        _file_under(self._by_key, keys, entry)
        self._entries += len(watch) + len(keys) + 1

    # -- dispatch ----------------------------------------------------------------------
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
        if t.breaker.state is not _CLOSED:
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


def _file_under(index: dict[_K, list[_Entry]], keys: Iterable[_K], entry: _Entry) -> None:
    """Append ``entry`` to each of ``keys``' lists in ``index`` (one call per index, not per
    key: this runs for every request the dispatcher remembers)."""
    for key in keys:
        lst = index.get(key)
        if lst is None:
            index[key] = [entry]
        else:
            lst.append(entry)
