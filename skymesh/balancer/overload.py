"""Overload and outage answers a client library can act on.

Two questions the HTTP edge asks before and while a request waits in the dispatcher's
queue:

* **Can anything serve this model now?** (:func:`check_servable`, :func:`can_serve`)
  A healthy replica that
  serves it and that the request has not failed on, or a live peer balancer that serves
  it (not for a request a peer already forwarded here: it is never forwarded again). When
  the answer is no, the request gets a 503 ``no_healthy_replica`` at once instead of
  waiting out the queue timeout, and :func:`stranded` finds the queued requests that the
  last replica's fall left with nowhere to go.
* **When should a turned-away client come back?** (:func:`retry_after_s`) The time the
  model's queue needs to drain at its measured rate (queue length / completions per
  second over the last ``DRAIN_WINDOW_S``, :class:`DrainMeter`), clamped to
  [``RETRY_MIN_S``, ``RETRY_MAX_S``] and spread by up to ``JITTER`` so that the clients a
  burst turned away do not all come back in the same instant (the OpenAI SDK sleeps
  exactly what ``Retry-After`` says when it is at most 60 s).

Parameters (module constants; defaults in brackets):

* ``DRAIN_WINDOW_S`` [10 s]: the completions counted for the drain rate. Long enough to
  hold several completions of minute-long generations at low rates, short enough to
  follow a replica's fall or return.
* ``RETRY_MIN_S`` / ``RETRY_MAX_S`` [1 s / 60 s]: HTTP's Retry-After is in whole seconds,
  and 60 s is the longest the OpenAI SDK honours (it falls back to its own back-off above).
* ``JITTER`` [0.5]: the wait is ``base * (1 + JITTER * u)``, ``u`` uniform in [0, 1).
* ``OUTAGE_RETRY_S`` [2 s]: the base wait when no replica is up: nothing measures when one
  comes back; two seconds is a few probe rounds, and the SDK's two default retries then
  give up within about 7 s instead of three 60 s queue timeouts.

Pure: the clock and the random draw are the caller's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.errors import ModelNotFound, NoHealthyReplica

DRAIN_WINDOW_S = 10.0
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
JITTER = 0.5
OUTAGE_RETRY_S = 2.0


def retry_after_s(queued: int, drain_per_s: float, u: float) -> float:
    """Seconds a client should wait before retrying: ``queued`` requests ahead of it, a
    queue that drains ``drain_per_s`` requests per second (0: not draining), ``u`` a
    uniform draw in [0, 1). In [RETRY_MIN_S, RETRY_MAX_S]."""
    base = queued / drain_per_s if drain_per_s > 0 else RETRY_MAX_S
    # Room for the jitter under the cap: waits at the cap are spread too.
    base = min(max(base, RETRY_MIN_S), RETRY_MAX_S / (1 + JITTER))
    return base * (1 + JITTER * u)


def outage_retry_s(u: float) -> float:
    """The wait to suggest when nothing serves the model: nothing measures when a replica
    returns (see OUTAGE_RETRY_S)."""
    return OUTAGE_RETRY_S * (1 + JITTER * u)


class DrainMeter:
    """Completions per second, per model, over the last ``window_s``: one-second buckets,
    so recording is a dict lookup and an add whatever the request rate."""

    def __init__(self, now: float, window_s: float = DRAIN_WINDOW_S) -> None:
        self.window_s = window_s
        self._started = now
        self._buckets: dict[str, deque[list[int]]] = {}  # model -> [second, count]

    def record(self, model: str, now: float) -> None:
        sec = int(now)
        b = self._buckets.get(model)
        if b is None:
            b = self._buckets[model] = deque()
        if b and b[-1][0] == sec:
            b[-1][1] += 1
            return
        b.append([sec, 1])
        self._prune(b, now)

    def rate(self, model: str, now: float) -> float:
        """Completions per second of ``model`` over the window (0.0: none)."""
        b = self._buckets.get(model)
        if not b:
            return 0.0
        self._prune(b, now)
        # A meter younger than its window divides by its age (at least 1 s: one early
        # completion is not a rate of thousands).
        span = max(1.0, min(self.window_s, now - self._started))
        return sum(n for _, n in b) / span

    def _prune(self, b: deque[list[int]], now: float) -> None:
        oldest = int(now - self.window_s)
        while b and b[0][0] < oldest:
            b.popleft()


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


def unlisted_replicas(d: Dispatcher) -> int:
    """Replicas whose models are not known yet (never answered, none configured): while
    there are some, an unknown model name may be theirs."""
    return sum(1 for t in d.targets.values() if not t.models)


def stranded(d: Dispatcher, eligible: Collection[str]) -> Iterator[Ticket]:
    """Queued tickets, among those keyed in ``eligible``, that nothing can serve now (in
    queue order). One :func:`can_serve` per queued model: cheap enough to call on every
    pump while requests wait."""
    for model, q in d.queues.items():
        if not q:
            continue
        local = can_serve(d, model, forwarded=True)
        if local:
            continue
        via_peer = can_serve(d, model)
        for t in list(q):
            if t.key in eligible and (not via_peer or t.route.forwarded):
                yield t


def outage(d: Dispatcher, model: str, u: float) -> NoHealthyReplica:
    """The 503 for a request whose model nothing up serves (``u``: the jitter's draw)."""
    serving = sum(1 for t in d.targets.values() if model in t.models)
    return NoHealthyReplica(
        f"no healthy replica serves model {model!r} now ({serving} replica(s) serve it "
        "here, none up); retry later", retry_after_s=outage_retry_s(u))


def check_servable(d: Dispatcher, model: str, u: float, *, forwarded: bool = False) -> None:
    """Before a request queues: 404 for a model nobody here serves; a 503 at once when
    nothing that serves it is up, or when replicas that may serve it (their models not
    known yet) have not answered since the start."""
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
