"""The dispatcher's records: a queued request (:class:`Ticket`), a replica as it routes
to one (:class:`Target`), a model's candidate view and a remembered evaluation (the
incremental state ``skymesh.balancer.dispatch`` keeps; see its ``__init__``)."""

from __future__ import annotations

import itertools
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any

from skymesh.balancer.breaker import Breaker
from skymesh.policies.base import RouteRequest
from skymesh.policies.load import ReplicaLoad

# A ticket's key, "t0", "t1", ...: the default factory in C (str of a count, "t" + it:
# 150 ns against 246 for a lambda's f-string; map with str.format read 276).
_next_key = map("t".__add__, map(str, itertools.count())).__next__
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
    # Targets an attempt failed on. Every ticket starts with the same empty frozenset (a
    # new set per request cost an allocation and a factory call); a failure assigns a
    # new set (``excluded | {target}``), never changes this one.
    excluded: AbstractSet[str] = frozenset()
    attempts: int = 0
    queued: bool = False
    held_since: float | None = None
    to_peer: bool = False  # the current target is a peer balancer
    key: str = field(default_factory=_next_key)
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
    # Its tenancy class, when the tenants' fair queue released it (None: none), for the
    # dispatcher's ``stagger`` (tenants.reserve_stagger).
    tenant_class: str | None = None
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

