"""Overload and outage answers a client library can act on.

Two questions the HTTP edge asks before and while a request waits in the dispatcher's
queue:

* **Can anything serve this model now?** (:func:`check_servable`, :func:`can_serve`)
  A healthy replica that
  serves it and that the request has not failed on, or a live peer balancer that serves
  it (not for a request a peer already forwarded here: it is never forwarded again). When
  the answer is no, the request gets a 503 ``no_healthy_replica`` at once instead of
  waiting out the queue timeout, and :func:`stranded` finds the queued requests that the
  last replica's fall left with nowhere to go. A *retry* also has nowhere to go when every
  replica it has not failed on is behind an open breaker (:func:`can_retry`; queued:
  :func:`dead_retries`): it ends with a 502 rather than wait for the breaker's trial. A
  new request whose every replica is behind an open breaker, with no peer to take it,
  gets a 503 at once, its ``Retry-After`` the first breaker's trial, spread upward
  (:func:`breakers_open`, :func:`breaker_retry_s`);
  so do the requests already queued when the last breaker opens (:func:`stranded` with a
  time, :func:`stranded_error`), and the passthrough routes (``skymesh.balancer.passthrough``,
  :func:`breakers_wait`).
* **When should a turned-away client come back?** (:class:`RetryBook`) When the queue
  will have room for it, so that a client that honours ``Retry-After`` is served. Each
  429 (queue full) or queue-timeout 503 books a time to come back (:func:`next_slot`):
  once the queue has drained to half its capacity at the measured rate, one drain
  interval after the client booked before it, and after the clients told a cold wait.
  The clients a burst turned away thus come back one by one as fast as the queue takes
  them: not all at once, and not long after it has emptied. A booked client that comes
  back when told and finds the queue full anyway (the rate was read high) is queued past
  the cap, up to twice it (:meth:`RetryBook.claim`; the HTTP edge lets only requests
  marked as retries claim, ``skymesh.balancer.handlers``).

  The drain rate (:class:`DrainMeter`) counts the requests that leave the queue while it
  holds some, over the time it holds some: with a queue, that is the replicas' capacity;
  without one it would only be the arrival rate, and idle time would read as a slow
  queue. It is exponentially weighted over that backlogged time, so the first seconds of
  a burst after a quiet hour read as they are. Before it is measured (the first second of
  the first backlog), nothing says when there will be room: the wait is the backlog's age,
  at least ``COLD_RETRY_S`` (:func:`cold_retry_s`), so a client that comes back early
  meets a measured answer on its next try.

Parameters (module constants; defaults in brackets):

* ``DRAIN_TAU_S`` [10 s of backlog]: the drain rate's time constant. Long enough to hold
  several completions of minute-long generations, short enough to follow a replica's fall
  or return.
* ``DRAIN_MIN_SPAN_S`` [1 s]: backlogged time before the rate counts as measured. The
  first requests to leave a queue that filled at once are the short ones: less would read
  the rate high.
* ``RETRY_MIN_S`` / ``RETRY_MAX_S`` [1 s / 60 s]: HTTP's Retry-After is in whole seconds
  (``retry-after-ms`` carries the fraction); the OpenAI Python SDK sleeps what the server
  says up to a limit (60 s in 1.x, 120 s in later releases) and above it falls back to its
  own back-off or gives up, so a wait over 60 s is no promise: it is not booked.
* ``PLAN_FRACTION`` [0.9]: bookings are spaced at this share of the measured rate. A
  client that comes back early finds the queue full and has spent a retry; one that comes
  back late only leaves a replica slot idle for a moment.
* ``JITTER`` [0.5]: waits that are not a place in line (cold, at the ceiling, outages)
  are ``base * (1 + JITTER * u)``, ``u`` uniform in [0, 1), so the clients they turn away
  do not all come back in the same instant.
* ``COLD_RETRY_S`` [2 s]: the shortest wait while nothing has drained yet.
* ``BREAKER_SPREAD_S`` [2 s]: clients turned away while every breaker is open are told
  the first trial's time plus up to this (:func:`breaker_retry_s`), never less: earlier,
  they would be refused again. A queue's worth is turned away at once when the last
  breaker opens; told the same instant, one would take the trial and the rest queue
  behind it or be refused again. The trial's answer (a replica's first response, or its
  failure) comes in about a second or two; spread over that, most come back once the
  breaker is closed again, or open with its next trial known. More would leave a
  recovered replica idle longer.
* ``CLAIM_WINDOW_S`` [10 s]: a booked place not claimed this long after it fell due is
  dropped (its client gave up).
* ``MAX_BOOKED`` [100,000]: booked places remembered at once (a float each); past it the
  wait is the ceiling, spread, and not booked.
* ``OUTAGE_RETRY_S`` [2 s]: the base wait when no replica is up: nothing measures when one
  comes back; two seconds is a few probe rounds, and the SDK's two default retries then
  give up within about 7 s instead of three 60 s queue timeouts.
* ``STRANDED_IDS_SHOWN`` [5]: request ids named in the log line for queued requests failed
  at once (:func:`stranded_line`): enough to find their access-log lines, a bounded line.

No I/O and no clock of its own: the time and the random draw are the caller's.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Collection, Iterator

from skymesh.balancer.breaker import Breaker
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.errors import ModelNotFound, NoHealthyReplica

DRAIN_TAU_S = 10.0
DRAIN_MIN_SPAN_S = 1.0
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
PLAN_FRACTION = 0.9
JITTER = 0.5
COLD_RETRY_S = 2.0
BREAKER_SPREAD_S = 2.0
OUTAGE_RETRY_S = 2.0
CLAIM_WINDOW_S = 10.0
MAX_BOOKED = 100_000
STRANDED_IDS_SHOWN = 5


def next_slot(now: float, queued: int, capacity: int, ahead: int, drain_per_s: float,
              last_due: float, cold_until: float) -> float:
    """When a client turned away at ``now`` should come back, for the queue to have room
    for it (a pure rule, see the module docstring): once the ``queued`` requests have
    drained to ``ahead`` at ``drain_per_s`` (> 0); one drain interval after the last client
    promised a place (due at ``last_due``), so that promised clients come back no faster
    than the queue drains; and after the clients told a cold wait (the last one due at
    ``cold_until``): they take whatever room opens until then, so the queue is taken to be
    full (``capacity``) at ``cold_until``."""
    return max(now + (queued - ahead) / drain_per_s, last_due + 1 / drain_per_s,
               cold_until + (capacity - ahead) / drain_per_s)


def jittered(base: float, u: float) -> float:
    """``base`` spread by up to JITTER (``u`` in [0, 1)), within RETRY_MAX_S."""
    return min(base, RETRY_MAX_S / (1 + JITTER)) * (1 + JITTER * u)


def cold_retry_s(backlog_age_s: float, u: float) -> float:
    """The wait while nothing has drained in a backlog ``backlog_age_s`` old: as long
    again, at least COLD_RETRY_S (see the module docstring)."""
    return jittered(max(COLD_RETRY_S, backlog_age_s), u)


def outage_retry_s(u: float) -> float:
    """The wait to suggest when nothing serves the model: nothing measures when a replica
    returns (see OUTAGE_RETRY_S)."""
    return OUTAGE_RETRY_S * (1 + JITTER * u)


def breaker_retry_s(trial_in_s: float, u: float) -> float:
    """The wait to suggest when the first open breaker lets its trial through in
    ``trial_in_s``: that, spread upward by up to BREAKER_SPREAD_S (``u`` in [0, 1))."""
    return trial_in_s + BREAKER_SPREAD_S * u


class DrainMeter:
    """Requests per second that leave the queue while it holds some: dispatches out of a
    backlogged queue weighted by ``exp(-age / tau_s)``, age counted in backlogged time,
    over the backlogged time weighted the same way. Idle time neither counts nor ages the
    estimate: a burst after a quiet hour reads its first seconds as they are."""

    def __init__(self, tau_s: float = DRAIN_TAU_S,
                 min_span_s: float = DRAIN_MIN_SPAN_S) -> None:
        self.tau_s = tau_s
        self.min_span_s = min_span_s
        self._events = 0.0  # weighted dispatches
        self._span = 0.0    # weighted backlogged seconds
        self._at: float | None = None  # the backlog's clock, last read; None: no backlog
        self.backlog_since: float | None = None

    def observe(self, now: float, dispatched: int, queued: int) -> None:
        """A pass of the dispatcher at ``now`` sent ``dispatched`` requests and left
        ``queued``. Dispatches count only out of a backlog that was there before the
        pass; the backlog's clock runs while requests stay queued."""
        if self._at is not None:
            self._events, self._span = self._aged(now)
            self._events += dispatched
            self._at = now
        elif queued:
            self._at = self.backlog_since = now
        if not queued:
            self._at = self.backlog_since = None

    def rate(self, now: float) -> float | None:
        """Requests drained per second, or None before it is measured (too little
        backlogged time yet, or nothing drained in it)."""
        events, span = self._aged(now)
        if span < self.min_span_s or events <= 0:
            return None
        return events / span

    def _aged(self, now: float) -> tuple[float, float]:
        if self._at is None or now <= self._at:
            return self._events, self._span
        decay = math.exp(-(now - self._at) / self.tau_s)
        # The weighted span grows by the integral of the weight over the new interval.
        return self._events * decay, self._span * decay + self.tau_s * (1 - decay)


class RetryBook:
    """The clients told to come back: when each booked client is due, and when the last
    one told a cold wait is. A booked client that comes back when told is let in even
    over the queue's cap (:meth:`claim`): a drain rate read high must not cost it its
    retry."""

    def __init__(self) -> None:
        self.last_due = -math.inf
        self.cold_until = -math.inf
        self._due: deque[float] = deque()  # booked and not claimed yet, in order

    def promise(self, now: float, queued: int, capacity: int, meter: DrainMeter,
                u: float) -> float:
        """The Retry-After for a request turned away at ``now`` with ``queued`` requests
        queued (of ``capacity``); ``u``: a uniform draw for the waits that are not a place
        in line. In [RETRY_MIN_S, RETRY_MAX_S]."""
        rate = meter.rate(now)
        if rate is None:
            since = meter.backlog_since
            wait = cold_retry_s(0.0 if since is None else now - since, u)
            self.cold_until = max(self.cold_until, now + wait)
            return wait
        due = next_slot(now, queued, capacity, capacity // 2, rate * PLAN_FRACTION,
                        self.last_due, self.cold_until)
        due = max(due, now + RETRY_MIN_S)
        self._expire(now)
        if due - now > RETRY_MAX_S or len(self._due) >= MAX_BOOKED:
            return jittered(RETRY_MAX_S, u)  # not a place in line: not booked
        self.last_due = due
        self._due.append(due)
        return due - now

    def claim(self, now: float) -> bool:
        """Whether a booked client is due at ``now`` (the place is taken: once each)."""
        self._expire(now)
        if self._due and self._due[0] <= now:
            self._due.popleft()
            return True
        return False

    def booked(self, now: float) -> int:
        self._expire(now)
        return len(self._due)

    def _expire(self, now: float) -> None:
        due = self._due
        while due and due[0] < now - CLAIM_WINDOW_S:  # never came back: gave up
            due.popleft()


def can_serve(d: Dispatcher, model: str, excluded: Collection[str] = (), *,
              forwarded: bool = False) -> bool:
    """Whether a healthy replica (or a live peer, unless ``forwarded``) outside
    ``excluded`` serves ``model``. Load and breakers are not asked: those clear by
    themselves, while the queue waits; health comes back only with a replica."""
    for tid, t in d.targets.items():
        if t.healthy and model in t.models and tid not in excluded:
            return True
    if forwarded or not d.forwarding:
        return False
    return any(p.alive and model in p.models and pid not in excluded
               for pid, p in d.peers.items())


def can_retry(d: Dispatcher, model: str, excluded: Collection[str], now: float, *,
              forwarded: bool = False) -> bool:
    """Whether a request that failed on the replicas in ``excluded`` has somewhere to go
    now: :func:`can_serve`, less the replicas whose breaker is open (``Breaker.shut``).

    Unlike a new request, a retry must not wait for a breaker: it holds the front of the
    queue, and when the breaker's trial comes it takes it, though it has just failed
    elsewhere. A request that fails on every replica (a bad prompt answered with a 500)
    then fails the trial too and opens the breaker again, every ``open_s``, for good,
    while the retries behind it fill the window of the queue and nothing else is
    dispatched (issue #35). Such a retry ends with the upstream's failure instead."""
    shut = [tid for tid, t in d.targets.items() if t.breaker.shut(now)]
    if shut:
        excluded = {*excluded, *shut}
    return can_serve(d, model, excluded, forwarded=forwarded)


def dead_retries(d: Dispatcher, eligible: Collection[str], now: float) -> Iterator[Ticket]:
    """Queued retries, among those keyed in ``eligible``, that :func:`can_retry` finds
    nowhere to go now (the breaker of every replica left opened after they were queued),
    in queue order. Nothing to look at unless a breaker is open; then only each queue's
    first ``window`` requests, those a pump reads: one further back is found when it gets
    there, and a deep queue costs no more per pump."""
    if not any(t.breaker.shut(now) for t in d.targets.values()):
        return
    for model, q in d.queues.items():
        for t in list(itertools.islice(q, d.window)):
            if t.excluded and t.key in eligible and not can_retry(
                    d, model, t.excluded, now, forwarded=t.route.forwarded):
                yield t


def may_strand(d: Dispatcher) -> bool:
    """Whether :func:`stranded` or :func:`dead_retries` may find anything: some queued
    model that no healthy replica here serves (then a peer's state decides), or some
    breaker open. False under an ordinary backlog, so a pump under a standing queue does
    not look at every queue and every breaker (``Dispatcher.health_summary`` changes only
    with health, membership, models and breakers)."""
    served, some_open = d.health_summary()
    if some_open:
        return True
    for model, q in itertools.chain(d.queues.items(), d.lanes.items()):
        if q and model not in served:
            return True
    return False


def unlisted_replicas(d: Dispatcher) -> int:
    """Replicas whose models are not known yet (never answered, none configured): while
    there are some, an unknown model name may be theirs."""
    return sum(1 for t in d.targets.values() if not t.models)


def stranded(d: Dispatcher, eligible: Collection[str], now: float | None = None
             ) -> Iterator[Ticket]:
    """Queued tickets, among those keyed in ``eligible``, that nothing can serve now (in
    queue order). One :func:`can_serve` per queued model: cheap enough to call on every
    pump while requests wait. The batch lanes too: batch waits there for hours, and a
    model nothing here serves any more would keep it until its deadline; and a due batch
    request (``stay``), which no peer may take.

    With ``now``, also those whose model's every healthy replica is behind an open breaker
    (:func:`breakers_open`), which a new request would not have been queued for: queued,
    they would wait for the first trial or the queue timeout. Retries aside: their answer
    is :func:`dead_retries`' 502. The peer rule is the same: a request a live peer may
    take waits for it."""
    for model, q in itertools.chain(d.queues.items(), d.lanes.items()):
        if not q:
            continue
        shut = False
        if can_serve(d, model, forwarded=True):
            if now is None or breakers_open(d, model, now, forwarded=True) is None:
                continue
            shut = True
            via_peer = breakers_open(d, model, now) is None
        else:
            via_peer = can_serve(d, model)
        for t in list(q):
            if t.key in eligible and (not via_peer or t.route.forwarded or t.stay) \
                    and not (shut and t.excluded):
                yield t


def stranded_error(d: Dispatcher, model: str, now: float, u: float) -> NoHealthyReplica:
    """The 503 for a ticket :func:`stranded` found: :func:`breakers_open`'s when replicas
    serving ``model`` are up behind open breakers (Retry-After: the first trial, spread),
    else :func:`outage`'s (``u``: the jitter's draw, one per ticket)."""
    return breakers_open(d, model, now, u, forwarded=True) or outage(d, model, u)


def stranded_line(model: str, request_ids: list[str], error: NoHealthyReplica) -> str:
    """The log line for queued requests failed at once: how many, which (the first few
    ids, to find their access-log lines), and why."""
    shown = ", ".join(request_ids[:STRANDED_IDS_SHOWN])
    more = len(request_ids) - STRANDED_IDS_SHOWN
    if more > 0:
        shown += f" and {more} more"
    return (f"{len(request_ids)} queued request(s) for model {model!r} ended at once with "
            f"503 no_healthy_replica (request ids {shown}): {error.message}")


def outage(d: Dispatcher, model: str, u: float) -> NoHealthyReplica:
    """The 503 for a request whose model nothing up serves (``u``: the jitter's draw)."""
    serving = sum(1 for t in d.targets.values() if model in t.models)
    return NoHealthyReplica(
        f"no healthy replica serves model {model!r} now ({serving} replica(s) serve it "
        "here, none up); retry later", retry_after_s=outage_retry_s(u))


def breakers_open(d: Dispatcher, model: str, now: float, u: float = 0.0, *,
                  forwarded: bool = False) -> NoHealthyReplica | None:
    """The 503 for a new request when every healthy replica serving ``model`` is behind
    an open breaker (``Breaker.shut``) and no peer may take it; None otherwise. Queued, it
    would wait for the first trial or the queue timeout, whichever comes first, and then
    most likely fail anyway; told when the first trial is due (spread by the draw ``u``:
    :func:`breaker_retry_s`), a client comes back when there is a replica to try. Free
    unless some breaker is open (``Dispatcher.health_summary``)."""
    if not d.health_summary()[1] or can_retry(d, model, (), now, forwarded=forwarded):
        return None
    shut = [t.breaker for t in d.targets.values() if t.healthy and model in t.models]
    if not shut:  # nothing up at all: ``outage``'s answer
        return None
    return breakers_wait(f"model {model!r}", shut, now, u)


def breakers_wait(what: str, shut: Collection[Breaker], now: float, u: float
                  ) -> NoHealthyReplica:
    """The 503 when the replicas up that serve ``what`` are all behind the open breakers
    ``shut``: come back when the first lets its trial through, spread by the draw ``u``
    (:func:`breaker_retry_s`) so that those turned away together do not all come back in
    the same instant."""
    trial = min(b.trial_in(now) for b in shut)
    return NoHealthyReplica(
        f"every replica serving {what} ({len(shut)} up) has its circuit breaker "
        f"open after repeated failures; the first may be tried again in {trial:.1f} s",
        retry_after_s=breaker_retry_s(trial, u))


def check_servable(d: Dispatcher, model: str, u: float, *, forwarded: bool = False,
                   now: float | None = None) -> None:
    """Before a request queues: 404 for a model nobody here serves; a 503 at once when
    nothing that serves it is up, or when replicas that may serve it (their models not
    known yet) have not answered since the start; with ``now``, also when every replica
    that serves it is behind an open breaker (:func:`breakers_open`)."""
    healthy, some_open = d.health_summary()
    if model in healthy and (now is None or not some_open):
        # The usual case, from the dispatcher's cached summary: a healthy replica serves
        # it (so it is reachable and servable), and no breaker is open to shut them all.
        return
    servable_fully(d, model, u, forwarded=forwarded, now=now)


def servable_fully(d: Dispatcher, model: str, u: float, *, forwarded: bool = False,
                   now: float | None = None) -> None:
    """:func:`check_servable` without its shortcut for the usual case: every check."""
    if not d.reachable(model):
        unlisted = unlisted_replicas(d)
        if unlisted:
            raise NoHealthyReplica(
                f"model {model!r} is not known yet: {unlisted} replica(s) have not answered "
                "since the balancer started; retry later", retry_after_s=outage_retry_s(u))
        raise ModelNotFound(f"model {model!r} is not served here; see /v1/models",
                            param="model")
    if not can_serve(d, model, forwarded=forwarded):
        raise outage(d, model, u)
    if now is not None:
        shut = breakers_open(d, model, now, u, forwarded=forwarded)
        if shut is not None:
            raise shut

