"""The routing-policy contract shared by the live balancer and the simulator.

A policy is a small, pure object: ``select(request, candidates, view)`` picks one target
id (a replica URL, or later a peer balancer) from ``candidates`` or returns ``None`` to
wait; hooks with no-op defaults hear about dispatches, completions and membership changes.
No sockets, no sleeps, no clock or randomness of its own: time comes from ``view.now`` and
ties break with the ``random.Random`` handed to the constructor, so a run is reproducible.
A driver that asks about the same request more than once (the dispatcher re-asks a queued
one at each pump) gives the request a ``tie`` key when it first queues it
(:meth:`Policy.tie_for`: a hash of the request's id keyed by a draw from that RNG): every
later tie for the request breaks by that key, so an answer is a pure function of the
request and the state the policy read, and repeats may be skipped.

Policies register under a stable name by subclassing::

    class LeastLoad(Policy, name="least-load"): ...

and :func:`build_policy` is the one way to construct them from config: an unknown name or
parameter fails at once and names the culprit. There is no second table to keep in sync.
"""

from __future__ import annotations

import random
import zlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


# Not frozen, though nothing changes a field after construction but ``set_tie``: built
# once per request on the daemon's path, and a frozen dataclass's __init__ sets each of
# the 14 fields through object.__setattr__ (1.19 us against 0.33). ``unsafe_hash`` keeps
# the hash a frozen one had (over the compared fields); derive with ``replace``.
@dataclass(slots=True, unsafe_hash=True)
class RouteRequest:
    """What a router may know about a request before it runs. A value: never assign to
    a field (``dataclasses.replace`` makes a changed copy), save the tie key, once
    (``set_tie``)."""

    request_id: str
    model: str = "default"
    prompt_len: int = 0
    # Chained hashes of the prompt's leading blocks (engine blocks in the simulator,
    # fixed-size text chunks in the live balancer): equal prefixes give equal keys.
    prefix_keys: Sequence[int] = ()
    affinity_key: str | None = None
    output_len_hint: int | None = None
    deadline_s: float | None = None
    # Set on a request a peer balancer forwarded to us: it is served by our replicas only
    # and never forwarded again (one hop).
    forwarded: bool = False
    # Output tokens a length predictor expects (skymesh.predict), or None when nothing
    # predicted it; predictive policies fall back to ``output_len_hint`` then a default.
    predicted_output_tokens: int | None = None
    # Exact prefix state from the engines' KV-cache events (skymesh.balancer.kv_feed):
    # leading full blocks of the prompt cached per target whose events are live, out of
    # ``exact_blocks``; None when no such target.
    exact_prefix: Mapping[str, int] | None = None
    exact_blocks: int = 0
    # The prompt's full-block keys per (scoring key, block size) computed for that state
    # (skymesh.prefix.kv_index.BlockKeys): probed against peers' exact summaries.
    block_keys: Mapping[tuple[str, int], Sequence[int]] | None = None
    # Targets whose events say they dropped the prompt's leading block (evicted, cleared,
    # restarted) and have not stored it again: the trie's record of them is stale.
    exact_lost: frozenset[str] = frozenset()
    # The request's tie-break key, set once by the driver that queues it
    # (skymesh.balancer.dispatch.Dispatcher.offer, Policy.tie_for): a tie among equally good
    # targets goes to the same one at every ask while the tie stands. None: each tie
    # draws from the RNG anew (drivers that ask once per request). The one field a
    # driver may set after construction (``set_tie``), so it takes no part in equality.
    tie: int | None = field(default=None, compare=False)

    def set_tie(self, tie: int) -> None:
        """Give a request without one its tie-break key, in place: ``replace`` copies
        every field (several us per request on the daemon's path), and nothing has read
        the key before the request is first queued."""
        if self.tie is None:
            self.tie = tie


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """What the balancer observed of one request on one target, for policies that learn
    the targets' speed (GoodServe's black-box estimates). Times are on the view's clock."""

    now: float
    dispatched_at: float
    first_token_at: float | None = None  # None: no token yet
    output_tokens: int = 0  # generated so far
    finished: bool = False
    prompt_tokens: int = 0
    # Prompt tokens the target served from its prefix cache, when it reports them
    # (vLLM's usage.prompt_tokens_details.cached_tokens); None: unknown.
    hit_tokens: int | None = None


class TargetLoad(Protocol):
    """Read-only load of one target as the balancer sees it (see policies.load)."""

    @property
    def outstanding(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...


class LoadView(Protocol):
    """Read-only view of the targets' load, handed to ``select``."""

    @property
    def now(self) -> float: ...
    def load(self, target: str) -> TargetLoad: ...


def outstanding(view: LoadView, targets: Sequence[str]) -> list[int]:
    """Each target's ``outstanding``, in order. Views that offer ``outstanding_of`` (the
    dispatcher does) answer in one call: policies that score every candidate pay a
    Python call per candidate otherwise, the largest part of a 64-replica decision."""
    bulk = getattr(view, "outstanding_of", None)
    if bulk is not None:
        out: list[int] = bulk(targets)
        return out
    load = view.load
    return [load(t).outstanding for t in targets]


_M64 = (1 << 64) - 1


class PolicyConfigError(ValueError):
    """Unknown policy name or bad parameter; the message names the culprit."""


# name -> class: every subclass declared with ``name=`` adds itself (one table, no second
# list to keep in sync). Read it through skymesh.policies.registry.
POLICY_CLASSES: dict[str, type[Policy]] = {}


class Policy(ABC):
    name: ClassVar[str] = ""
    # Whether select() reads request.prefix_keys: the live balancer only hashes the prompt
    # into keys for policies that use them (about 150 us per request saved otherwise).
    uses_prefix_keys: ClassVar[bool] = False
    # Whether select() reads request.predicted_output_tokens: the live balancer runs a
    # length predictor (about 0.5 ms per request) only for policies that use it.
    uses_length_prediction: ClassVar[bool] = False
    # Whether the driver should ask ``migrate`` about running requests, and how often
    # (seconds on the view's clock); a policy may switch it per instance.
    wants_migration: bool = False
    migration_interval_s: float = 1.0
    # Memo support (skymesh.balancer.dispatch): a dispatcher re-asks ``preferred`` about
    # the same queued request on every pump, so a policy may declare that, after each
    # call, its answer depends only on the request, on the loads of the targets it names
    # in ``considered``, on no ``on_dispatch``/``on_cached`` that changes the record of a
    # key in ``memo_keys`` (a trie tells which: ``PrefixTrie.on_keys``; () when no key
    # matters), and on nothing that leaves ``memo_epoch`` as
    # it was; that it draws from the RNG only through ``_argmin`` (counted in ``draws``;
    # never for a request that carries a ``tie`` key);
    # and that a call changes nothing a decision reads (a prefix trie's recency is
    # allowed: the dispatcher's docstring says why). The dispatcher then skips calls
    # whose inputs did not change, with the same answers and the same RNG stream.
    memo_preferred: ClassVar[bool] = False
    # Whether ``select`` over the targets of a ``preferred`` call just made for the same
    # request (in the same order; in any order for a request without ``exact_prefix``),
    # with nothing changed in between, answers what that call answered when it named a
    # target (the request's deadline aside), and changes nothing a decision reads that
    # the call did not: then the dispatcher takes that answer without the second call
    # (the default's arrival where every replica may take the request: a trie match and
    # a least-loaded choice fewer). A subclass that overrides ``select`` or ``preferred``
    # without declaring it again does not inherit it (``__init_subclass__``).
    select_follows_preferred: ClassVar[bool] = False
    draws: int = 0
    _tie_salt: int | None = None  # tie_for's hash key, drawn from the RNG at first use
    considered: tuple[str, ...] = ()
    memo_keys: tuple[int, ...] = ()

    def __init_subclass__(cls, name: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "select_follows_preferred" not in cls.__dict__ and (
                "select" in cls.__dict__ or "preferred" in cls.__dict__):
            cls.select_follows_preferred = False
        if name:
            if name in POLICY_CLASSES:
                raise RuntimeError(f"policy name {name!r} registered twice")
            cls.name = name
            POLICY_CLASSES[name] = cls

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self.rng = rng if rng is not None else random.Random(0)

    @abstractmethod
    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        """One of ``candidates``, or None to keep the request queued."""

    def preferred(self, request: RouteRequest, targets: Sequence[str], view: LoadView
                  ) -> str | None:
        """The target this request would go to if every target were available, when the
        policy has a locality reason to prefer one (None: no preference). The dispatcher
        may hold a request briefly for its preferred target (delay scheduling)."""
        return None

    def on_dispatch(self, request: RouteRequest, target: str, view: LoadView) -> None:
        """``request`` was sent to ``target``."""

    def on_complete(self, request: RouteRequest, target: str, ok: bool) -> None:
        """``request`` ended on ``target`` (``ok`` False: failed or cancelled)."""

    def on_cached(self, request: RouteRequest, target: str, keys: Sequence[int]) -> None:
        """``request`` finished on ``target``, which now caches ``keys``: the prefix keys
        of its prompt *and* its output (the next turn of a conversation resends both).
        Drivers that know the output call it after ``on_complete``; others never do."""

    def on_membership(self, targets: Sequence[str]) -> None:
        """The full target set changed to ``targets`` (prune state for departed ones)."""

    def on_timing(self, request: RouteRequest, target: str, timing: RequestTiming) -> None:
        """Progress of ``request`` on ``target``: its first token, and its end (before
        ``on_complete``). Drivers that cannot observe timings never call it."""

    def migrate(self, request: RouteRequest, target: str, timing: RequestTiming,
                candidates: Sequence[str], view: LoadView) -> str | None:
        """Asked periodically for a running request: a target among ``candidates`` to move
        it to (re-sent as prompt + generated tokens), or None to leave it. Only drivers
        that can move requests ask; see ``wants_migration``."""
        return None

    def tie_for(self, request_id: str) -> int:
        """The tie-break key of the request ``request_id`` (``RouteRequest.tie``): a hash
        of the id (CRC-32, then splitmix64's mix, which spreads it over the low bits that
        ``tie % n`` reads) keyed by 64 bits drawn once from this policy's RNG. Not a
        secret: a client choosing its ids can only choose how ties among equally loaded
        replicas break for its own requests. A function of the
        id, not of the order requests arrive in, so two simulated runs of one workload
        (two pushing modes, say) give a request the same key and differ only where their
        decisions do; keys drawn in arrival order would shuffle once one decision
        differed, and blur every comparison."""
        salt = self._tie_salt
        if salt is None:
            salt = self._tie_salt = self.rng.getrandbits(64)
        x = (zlib.crc32(request_id.encode()) ^ salt) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        return x ^ (x >> 31)

    def memo_epoch(self) -> int:
        """Bumped by any change of the state ``preferred`` reads beyond the hooks'
        per-prefix updates (see ``memo_preferred``)."""
        return 0

    def _least(self, candidates: Sequence[str], key: Any,
               request: RouteRequest | None = None) -> str | None:
        """The candidate minimising ``key``, ties broken by ``request``'s tie key, else by
        the seeded RNG."""
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        return self._argmin(candidates, [key(c) for c in candidates], request)

    def _least_loaded(self, candidates: Sequence[str], view: LoadView,
                      request: RouteRequest | None = None) -> str | None:
        """The candidate with the fewest outstanding requests, ties broken as ``_argmin``
        breaks them."""
        n = len(candidates)
        if n < 2:
            return candidates[0] if candidates else None
        vals = outstanding(view, candidates)
        if n == 2:
            # Two replicas (the live benchmark's, the holders of a shared prompt): a
            # unique minimum by one comparison; a tie as ``_argmin`` breaks it.
            a, b = vals
            if a != b:
                return candidates[0] if a < b else candidates[1]
        return self._argmin(candidates, vals, request)

    def _argmin(self, candidates: Sequence[str], vals: Sequence[float],
                request: RouteRequest | None = None) -> str:
        """The candidate with the smallest value (aligned lists). Ties: by ``request``'s
        ``tie`` key when it has one (the same tie, the same answer, however often it is
        asked), else by a draw from the RNG."""
        # C-level passes beat one Python loop with branches (hot path); a unique minimum,
        # the common case under load, needs no list of the ties.
        low = min(vals)
        n = vals.count(low)
        if n == 1:
            return candidates[vals.index(low)]
        # strict=False: the lists are aligned by contract, and strict's check costs
        # ~12 ns per element, a fifth of this loop.
        tie = request.tie if request is not None else None
        if tie is not None:
            if n == len(vals):  # all tied (an idle fleet): no list to build
                return candidates[tie % n]
            return [c for c, v in zip(candidates, vals, strict=False) if v == low][tie % n]
        self.draws += 1
        return self.rng.choice([c for c, v in zip(candidates, vals, strict=False) if v == low])
