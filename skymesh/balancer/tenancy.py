"""Tenants, priority classes and the fair queue in front of the
dispatcher (issue #37; configured by ``tenants:`` in ``lb.yaml``, docs/tenancy.md).

Pure: no sockets, no sleeps; every clock is passed in, so tests drive a fake one.

- :class:`TenantBook` says whose a request is: the tenant of its client key (keys are
  named by their SHA-256 digest, never stored here), or the tenant an upstream gateway
  names in ``tenants.header`` when the request comes from ``tenants.trusted_sources``;
  and its class: ``tenants.priority_header`` or the tenant's default, bounded by the
  classes the tenant may use.
- :class:`FairQueue`: requests wait here, per model, class and tenant, and are released
  into the dispatcher only while its queue for the model is short, so the routing policy
  still chooses the replica and this queue chooses the order: strict priority between
  classes, except that a lower class that has gone unserved for ``max_wait_s[class]``
  (since its oldest request arrived, or since it was last served if later) goes first
  (the aging guard: no class goes unserved much longer than that while the replicas
  serve); within a class the backlogged tenant with the least service first, a virtual
  token counter over prompt + output tokens divided by the tenant's weight (Sheng et al.,
  "Fairness in Serving Large Language Models", OSDI'24): a tenant that becomes backlogged
  is lifted to the least counter of those already backlogged (with none, to the counter
  last served there), so idle time is not credit.
- The slot reserve (:class:`Reserve`, ``tenants.reserve``): a class with a reserve is
  released only while the replicas of the model have free slots beyond it on each, at
  most all but one (slots: the replica's ``max_num_seqs`` under sp-p, when known, or
  sp-o's ``max_outstanding``). The reserve is ``auto`` (the default): ``reserve_headroom``
  x the better classes' recent mean in service per replica (:class:`Occupancy`; Little's
  law: their arrival rate x their time in service), at least one slot, so the idle
  capacity goes to the lower class (with ``reserve_held``, that less the better requests
  in service now: their part, in service and free together); or, with ``reserve_miss``,
  by arrivals: the fewest
  slots that leave at most that share of the better requests finding none, from their
  arrival rate against the rate slots free up by themselves (:class:`Flow`,
  :func:`buffer_slots`): slots for the better requests that arrive before a slot frees,
  not for their time in service; or a fixed fraction ``f``: ``ceil(f x slots)``. So a
  better class arriving finds a slot free instead of waiting for a long batch request to
  finish (the fair queue orders, but a slot once taken is held for the whole request).
  The reserve lapses
  while no request of a better class has arrived for ``reserve_idle_s``: then the lower
  class may fill every slot, and the first better request after the lull waits for one
  to free. While it holds, such a class also goes to a replica only while fewer than
  ``reserve_pace`` requests wait to start there (the probe's waiting plus ours not yet
  admitted): a burst of its prefills, queued first come first served inside the engine,
  would otherwise stall the better request that arrives next; pacing holds only while a
  better request arrived within ``reserve_window_s`` (it is what costs the lower class
  most). ``reserve_pace`` 0 releases none of the class then, but paces it as at 1 once
  it has gone unserved for its aging bound: it runs in the better classes' lulls. A
  request the probe cannot show yet counts as not started only while it could
  be (:class:`Starts`): for eight of the engine's steps after its release, the step as this
  balancer sees it (a finished request's time from release to end over its output
  tokens). A request that is not streamed shows no first byte, and the probe shows it
  only after the engine's metrics lag (about a second on vLLM): counted until then,
  pacing let one batch request start per replica per second, a fraction of what the
  replica's free slots turn over.
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skymesh.balancer.config import AUTO_RESERVE, TenantsConfig
from skymesh.balancer.errors import BadRequest, Overloaded

# The tenant of requests no key or header names, when tenants.fallback names none.
DEFAULT_TENANT = "default"


# -- who and which class ---------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    name: str
    default_class: str
    classes: tuple[str, ...]  # the classes it may use, best rank first
    weight: float = 1.0
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    max_concurrency: int | None = None
    tokens_per_day: float | None = None


class TenantBook:
    """Which tenant and class a request is (see the module docstring)."""

    def __init__(self, tenants: Iterable[Tenant], classes: Iterable[str], *,
                 keys: Mapping[bytes, str], fallback: Tenant,
                 header: str | None = None, trusted_sources: Iterable[str] = (),
                 priority_header: str | None = None) -> None:
        self.classes = tuple(classes)
        self.rank = {c: i for i, c in enumerate(self.classes)}  # 0 is served first
        self.tenants = {t.name: t for t in tenants}
        self.tenants.setdefault(fallback.name, fallback)
        self.fallback = fallback
        self.keys = dict(keys)  # key digest -> tenant name
        self.header = header
        self.trusted = tuple(ipaddress.ip_network(s, strict=False) for s in trusted_sources)
        self.priority_header = priority_header

    def _trusted(self, peer_ip: str | None) -> bool:
        if not peer_ip or not self.trusted:
            return False
        try:
            ip = ipaddress.ip_address(peer_ip)
        except ValueError:
            return False
        return any(ip in net for net in self.trusted)

    def tenant_of(self, digest: bytes | None, headers: Mapping[str, str],
                  peer_ip: str | None) -> Tenant:
        if self.header is not None and self._trusted(peer_ip):
            named = headers.get(self.header)
            if named:
                tenant = self.tenants.get(named.strip())
                if tenant is None:
                    raise BadRequest(f"{self.header}: no tenant {named.strip()[:64]!r} "
                                     "is configured here")
                return tenant
        if digest is not None:
            name = self.keys.get(digest)
            if name is not None:
                return self.tenants[name]
        return self.fallback

    def class_of(self, tenant: Tenant, headers: Mapping[str, str]) -> str:
        """The asked-for class, or the tenant's default; a class better than the tenant may
        use becomes the best it may use at or below the asked rank."""
        asked = headers.get(self.priority_header) if self.priority_header else None
        if not asked:
            return tenant.default_class
        asked = asked.strip().lower()
        rank = self.rank.get(asked)
        if rank is None:
            raise BadRequest(f"{self.priority_header}: {asked[:64]!r} is not a class "
                             f"(one of {', '.join(self.classes)})")
        for c in tenant.classes:  # best first
            if self.rank[c] >= rank:
                return c
        return tenant.default_class


# -- the fair queue ----------------------------------------------------------------------


class Occupancy:
    """Per model and class, how many requests are in service (released by the fair queue
    and not ended) and their recent mean: a time average that follows a rise within
    ``rise_s`` and a fall within ``fall_s`` (exponentially), so the adaptive reserve grows
    with a burst of better requests at once and gives their slots back slowly. By
    Little's law the mean is the class's arrival rate times its time in service.

    Both by the class's own arrivals (its mean inter-arrival gap as of its last arrival,
    :meth:`arrived`): with ``fall_gaps`` (tenants.reserve_fall_gaps) the mean falls over
    that many gaps, at most ``fall_s``: over a few arrivals, not a fixed time, so a busy
    class's slots come back within seconds of its load falling while a light one keeps
    the slot its lone requests need between them."""

    def __init__(self, rise_s: float = 1.0, fall_s: float = 10.0,
                 fall_gaps: float | None = None) -> None:
        self.rise_s = rise_s
        self.fall_s = fall_s
        self.fall_gaps = fall_gaps
        # (model, class) -> [in service, mean, as of, its mean gap]
        self._s: dict[tuple[str, str], list[float]] = {}

    def _at(self, key: tuple[str, str], now: float) -> list[float]:
        st = self._s.get(key)
        if st is None:
            st = self._s[key] = [0, 0.0, now, math.inf]
        n, mean, then, gap = st
        if now > then:
            fall = self.fall_s if self.fall_gaps is None else \
                min(self.fall_s, self.fall_gaps * gap)
            st[1] = self._toward(n, mean, now - then, self.rise_s if n > mean else fall)
            st[2] = now
        return st

    @staticmethod
    def _toward(n: float, mean: float, dt: float, tau: float) -> float:
        if dt <= 0:
            return mean
        return n + (mean - n) * math.exp(-dt / tau) if tau > 0 else n

    def arrived(self, model: str, cls: str, now: float, rate: float | None) -> None:
        """A request of ``cls`` arrived; ``rate``: the class's recent arrivals per second
        (:meth:`Flow.rate`, this one counted), whose gap sets the fall until the next."""
        if self.fall_gaps is None:
            return
        self._at((model, cls), now)[3] = 1.0 / rate if rate else math.inf

    def start(self, model: str, cls: str, now: float) -> None:
        self._at((model, cls), now)[0] += 1

    def end(self, model: str, cls: str, now: float) -> None:
        st = self._at((model, cls), now)
        st[0] = max(0, st[0] - 1)

    def now_in(self, model: str, classes: Iterable[str]) -> int:
        """How many of ``classes`` are in service for ``model`` now."""
        return sum(int(st[0]) for c in classes if (st := self._s.get((model, c))))

    def mean(self, model: str, classes: Iterable[str], now: float) -> float:
        """The recent mean in service of ``classes`` together, for ``model``."""
        total = 0.0
        for c in classes:
            key = (model, c)
            if key not in self._s:
                continue
            st = self._at(key, now)
            if st[0] == 0 and st[1] < 0.01:
                del self._s[key]  # idle: forgotten (models come and go)
                continue
            total += st[1]
        return total


class Starts:
    """Pacing's view of which released requests have started, per model. The engine's
    step time (``step_s``) as this balancer sees it: a recent mean (weight ``alpha`` for
    the newest) of a finished request's time from its release to its end over its output
    tokens, a slight overestimate (its wait and prefill count in it). A request released
    into a free slot starts at the engine's next step and has done its prefill by the end
    of the one after; ``steps`` (8) leaves room for the hop, the dispatcher and a short
    queue inside the engine (in the simulator, 4 let a burst after a lull in the better
    class's traffic delay its first requests). So :meth:`unstarted` counts the releases
    of the last ``steps`` step times (None until a step time is known). At most ``keep``
    release times are kept per model and class."""

    def __init__(self, alpha: float = 0.2, steps: float = 8.0, keep: int = 256) -> None:
        self.alpha = alpha
        self.steps = steps
        self.keep = keep
        self.step_s: dict[str, float] = {}  # model -> its engine's step time
        # (model, class) -> release times, oldest first
        self._at: dict[tuple[str, str], deque[float]] = {}

    def released(self, model: str, cls: str, now: float) -> None:
        at = self._at.get((model, cls))
        if at is None:
            at = self._at[(model, cls)] = deque(maxlen=self.keep)
        at.append(now)

    def finished(self, model: str, released_at: float, output_tokens: int, now: float) -> None:
        if output_tokens <= 0 or now <= released_at:
            return
        x = (now - released_at) / output_tokens
        old = self.step_s.get(model)
        self.step_s[model] = x if old is None else old + self.alpha * (x - old)

    def unstarted(self, model: str, classes: Iterable[str], now: float) -> int | None:
        """Releases of ``classes`` for ``model`` within the last ``steps`` step times
        (None: no step time known for the model yet)."""
        step = self.step_s.get(model)
        if step is None:
            return None
        since = now - self.steps * step
        n = 0
        for c in classes:
            at = self._at.get((model, c))
            if not at:
                continue
            while at and at[0] < since:
                at.popleft()
            n += len(at)
        return n


class Stagger:
    """Which replica has a request of which class placed and not yet started, per model
    (``tenants.reserve_stagger``): the batch prefills in flight, so that the lower
    classes are released one at a time over the replicas (:func:`release_into`) and a
    better request goes to a replica with none of theirs pending (:meth:`narrow`, the
    dispatcher's filter before the policy's choice). A step runs to its end, so a better
    request that lands on a replica while a batch prompt is being prefilled waits out
    that step (the frontier's engine bound); with two replicas or more the balancer can
    keep one of them out of such steps, as it knows where it sent each lower request and
    when it started (its first byte).

    A request counts as pending from its release (:meth:`released`, no replica yet) or
    its placement (:meth:`placed`) until its first byte or its end, and for at most
    ``steps`` of the engine's step times (:class:`Starts`) after its release or placement
    (a request that is not streamed shows no first byte before its end); before a step
    time is known, for at most ``unknown_s`` (a released request whose client left before
    it was offered would otherwise hold the lower classes for good). At most ``keep`` are
    kept."""

    def __init__(self, classes: Sequence[str], step_s: Mapping[str, float] | None = None,
                 steps: float = 8.0, keep: int = 1024, unknown_s: float = 1.0) -> None:
        self.rank = {c: i for i, c in enumerate(classes)}  # 0 is the best
        self.step_s = step_s if step_s is not None else {}  # model -> its step (Starts)
        self.steps = steps
        self.keep = keep
        self.unknown_s = unknown_s
        # model -> release times of lower-class requests not yet placed, oldest first
        self._released: dict[str, deque[float]] = {}
        # ticket key -> (model, replica, class rank, placed at): placed, not yet started
        self._placed: dict[str, tuple[str, str, int, float]] = {}
        # (model, replica) -> when a lower-class request was last placed there (rotation)
        self._last: dict[tuple[str, str], float] = {}

    def released(self, model: str, cls: str, now: float) -> None:
        """The fair queue let a request of ``cls`` go (only the lower classes count)."""
        if self.rank.get(cls, 0) > 0:
            at = self._released.setdefault(model, deque(maxlen=self.keep))
            at.append(now)

    def placed(self, key: str, model: str, cls: str | None, replica: str, now: float) -> None:
        """The dispatcher sent request ``key`` of ``cls`` (None: no tenant class) to
        ``replica``."""
        rank = self.rank.get(cls) if cls is not None else None
        if rank is None:
            return
        if rank > 0:
            at = self._released.get(model)
            if at:
                at.popleft()
            self._last[(model, replica)] = now
        if len(self._placed) >= self.keep:  # ends never told (bounded): the oldest goes
            del self._placed[next(iter(self._placed))]
        self._placed[key] = (model, replica, rank, now)

    def started(self, key: str) -> None:
        """Request ``key`` showed its first byte, or ended (or failed) on its replica."""
        self._placed.pop(key, None)

    def _expire(self, model: str, now: float) -> None:
        step_s = self.step_s.get(model)
        since = now - (self.steps * step_s if step_s is not None else self.unknown_s)
        at = self._released.get(model)
        while at and at[0] < since:
            at.popleft()
        old = [k for k, (m, _, _, t) in self._placed.items() if m == model and t < since]
        for k in old:
            del self._placed[k]

    def lower_pending(self, model: str, now: float) -> int:
        """Lower-class requests of ``model`` released or placed and not yet started."""
        self._expire(model, now)
        return len(self._released.get(model, ())) + sum(
            1 for m, _, rank, _ in self._placed.values() if m == model and rank > 0)

    def narrow(self, model: str, cls: str | None, candidates: Sequence[str],
               now: float) -> Sequence[str]:
        """The replicas among ``candidates`` a request of ``cls`` should choose from: those
        with no request of another class pending its start (a better request keeps clear
        of lower prefills; a lower one of the better requests about to prefill); among
        them, for a lower class, those given a lower-class request least recently (the
        stagger rotates). All of them when none is clear, or with one candidate or no
        class."""
        rank = self.rank.get(cls) if cls is not None else None
        if rank is None or len(candidates) < 2:
            return candidates
        self._expire(model, now)
        busy = {r for m, r, other, _ in self._placed.values() if m == model and other != rank}
        clear = [r for r in candidates if r not in busy] if busy else list(candidates)
        if not clear:
            return candidates
        if rank > 0 and len(clear) > 1:
            first = min(self._last.get((model, r), -math.inf) for r in clear)
            clear = [r for r in clear if self._last.get((model, r), -math.inf) == first]
        return clear


class Flow:
    """Per model, two recent rates (events per second, all replicas together): the
    arrivals of each class, and the ends of the requests the queue released (all classes:
    the rate at which slots free up by themselves). Each is an exponentially decayed count
    over ``tau_s``, corrected for how long the model has been seen (its first arrival):
    else a rate reads low for ``tau_s`` after the start. Bounded: a rate that has decayed
    to nothing is forgotten, and a model with none left (models come and go)."""

    def __init__(self, tau_s: float = 10.0) -> None:
        self.tau_s = tau_s
        # model -> class (None: the ends) -> [decayed count, as of]
        self._r: dict[str, dict[str | None, list[float]]] = {}
        self._seen: dict[str, float] = {}  # model -> its first arrival

    def _decayed(self, st: list[float], now: float) -> float:
        if now > st[1]:
            st[0] *= math.exp(-(now - st[1]) / self.tau_s)
            st[1] = now
        return st[0]

    def _add(self, model: str, cls: str | None, now: float) -> None:
        self._seen.setdefault(model, now)
        by = self._r.setdefault(model, {})
        st = by.get(cls)
        if st is None:
            by[cls] = [1.0, now]
        else:
            st[0] = self._decayed(st, now) + 1.0

    def arrived(self, model: str, cls: str, now: float) -> None:
        self._add(model, cls, now)

    def ended(self, model: str, now: float) -> None:
        self._add(model, None, now)

    def rate(self, model: str, cls: str | None, now: float,
             corrected: bool = True) -> float | None:
        """Arrivals per second of ``cls`` for ``model`` (None: its ends); None before the
        first, or long after the last. Not ``corrected``: the count over the whole
        ``tau_s`` even in the model's first ``tau_s`` (low then, never high: the first
        arrival alone would read as a rate of thousands)."""
        by = self._r.get(model)
        st = by.get(cls) if by is not None else None
        if by is None or st is None:
            return None
        n = self._decayed(st, now)
        if n < 1e-3:  # about seven tau_s since the last: forgotten
            del by[cls]
            if not by:
                del self._r[model], self._seen[model]
            return None
        # The share of the window the count could have filled since the model was seen.
        filled = -math.expm1(-max(now - self._seen[model], 1e-3) / self.tau_s) \
            if corrected else 1.0
        return n / (self.tau_s * filled)

    def ratio(self, model: str, better: Iterable[str], now: float) -> float | None:
        """The better classes' arrival rate over the rate slots free up, ``rho`` (the same
        per replica as for all of them); None while no request has ended lately."""
        ends = self.rate(model, None, now)
        if not ends:
            return None
        return sum(self.rate(model, c, now) or 0.0 for c in better) / ends


def buffer_slots(rho: float, miss: float, capacity: int) -> int:
    """The fewest free slots ``k`` (at least one) a replica keeps so that at most ``miss``
    of the better requests find none: the free slots as a buffer that better arrivals
    (rate ``lambda``) empty one at a time and that the replica's own ends (rate ``mu``,
    ``rho = lambda / mu``) refill, each end going back to the buffer while it is short (the
    lower class is held until then). A birth-death chain on the slots missing from the
    buffer; by PASTA an arrival finds it empty with probability
    ``rho^k (1 - rho) / (1 - rho^(k+1))`` (``1 / (k + 1)`` at ``rho = 1``). At most
    ``capacity``."""
    for k in range(1, capacity + 1):
        if abs(rho - 1.0) < 1e-9:
            p = 1.0 / (k + 1)
        elif rho > 1.0:  # the same, divided through by rho^k (no overflow)
            p = (rho - 1.0) / (rho - rho ** -k)
        else:
            p = rho ** k * (1.0 - rho) / (1.0 - rho ** (k + 1))
        if p <= miss:
            return k
    return capacity


@dataclass(eq=False)
class Waiter:
    """One request waiting in the :class:`FairQueue`; ``payload`` is the caller's (a
    future the live balancer wakes)."""

    model: str
    tenant: str
    cls: str
    cost: float  # charged to the tenant's counter when released (prompt tokens)
    since: float
    payload: Any = None
    seq: int = field(default=0)
    released_at: float | None = None  # when the queue let it go (FairQueue.pop)
    request_id: str = ""  # named in the log line when it is failed at once


class FairQueue:
    """See the module docstring. ``max_wait_s``: the aging bound per class (a class
    absent has none); ``weights``: per tenant (default 1); ``capacity``: waiters in all,
    beyond it :meth:`push` raises :class:`Overloaded`; ``started``: when the queue began,
    counted as an arrival of every class (a balancer that just started keeps the slot
    reserve for ``reserve_idle_s``, as it cannot know the better classes are absent)."""

    def __init__(self, classes: Iterable[str], *, max_wait_s: Mapping[str, float] | None = None,
                 weights: Mapping[str, float] | None = None, capacity: int = 1024,
                 started: float = -math.inf) -> None:
        self.classes = tuple(classes)
        self.max_wait_s = dict(max_wait_s or {})
        self.weights = dict(weights or {})
        self.capacity = capacity
        self.counters: dict[str, float] = {}  # tenant -> service / weight (VTC)
        # class -> its latest arrival (the reserve)
        self.arrived: dict[str, float] = dict.fromkeys(self.classes, started)
        # model -> class -> tenant -> waiters in arrival order (keyed by seq)
        self._q: dict[str, dict[str, dict[str, OrderedDict[int, Waiter]]]] = {}
        self._seq = 0
        self.waiting = 0
        # (model, class) -> the counter of the tenant last served there (bounded: models
        # are the replicas', classes configured)
        self._last: dict[tuple[str, str], float] = {}
        # (model, class) -> when a request of it was last released (the aging guard counts
        # from there, so a class's own backlog does not make it overdue for ever)
        self._served_at: dict[tuple[str, str], float] = {}
        # The released and not finished, per model and class (the adaptive reserve).
        self.occupancy = Occupancy()
        self.starts = Starts()  # the released not yet started (the reserve's pacing)
        self.flow = Flow()  # arrivals and ends per second (the reserve by arrivals)
        # Pending starts per replica (reserve_stagger), judged by the same step time.
        self.stagger = Stagger(self.classes, self.starts.step_s)

    def __len__(self) -> int:
        return self.waiting

    def models(self) -> list[str]:
        return list(self._q)

    def depths(self) -> dict[tuple[str, str], int]:
        """Waiters per (tenant, class), all models together (read at scrape time)."""
        out: dict[tuple[str, str], int] = {}
        for by_cls in self._q.values():
            for cls, by_tenant in by_cls.items():
                for tenant, fifo in by_tenant.items():
                    out[tenant, cls] = out.get((tenant, cls), 0) + len(fifo)
        return out

    def has(self, model: str, cls: str) -> bool:
        """Whether a request of ``cls`` waits for ``model``."""
        return cls in self._q.get(model, {})

    def push(self, w: Waiter) -> None:
        if self.waiting >= self.capacity:
            raise Overloaded(f"the balancer's tenant queue is full ({self.capacity} "
                             "requests waiting)")
        by_cls = self._q.setdefault(w.model, {})
        by_tenant = by_cls.setdefault(w.cls, {})
        if w.since > self.arrived.get(w.cls, -math.inf):
            self.arrived[w.cls] = w.since
        self.flow.arrived(w.model, w.cls, w.since)
        occupancy = self.occupancy
        if occupancy.fall_gaps is not None:
            # Its gap is judged by the rate over the whole window: a class that just
            # began counts as a slow one (its slots kept longer), not as one of thousands
            # a second. Not taken with the setting off: no work per request for it.
            occupancy.arrived(w.model, w.cls, w.since,
                              self.flow.rate(w.model, w.cls, w.since, corrected=False))
        fifo = by_tenant.get(w.tenant)
        if fifo is None:
            # Newly backlogged here: lifted to the least counter of the backlogged ones,
            # so a tenant that was idle gets no credit for it (VTC's lift).
            # With none backlogged, to the counter last served here (VTC's rule for an
            # empty queue), so a newcomer cannot run alone for the service others had.
            others = [self.counters.get(t, 0.0) for t in by_tenant]
            floor = min(others) if others else self._last.get((w.model, w.cls), 0.0)
            mine = max(self.counters.get(w.tenant, 0.0), floor)
            self.counters[w.tenant] = mine
            fifo = by_tenant[w.tenant] = OrderedDict()
        self._seq += 1
        w.seq = self._seq
        fifo[w.seq] = w
        self.waiting += 1

    def remove(self, w: Waiter) -> bool:
        """Take out a waiter that timed out or whose client left (False: not here)."""
        by_cls = self._q.get(w.model)
        by_tenant = by_cls.get(w.cls) if by_cls else None
        fifo = by_tenant.get(w.tenant) if by_tenant else None
        if fifo is None or fifo.pop(w.seq, None) is None:
            return False
        self._prune(w)
        return True

    def _prune(self, w: Waiter) -> None:
        self.waiting -= 1
        by_cls = self._q[w.model]
        by_tenant = by_cls[w.cls]
        if not by_tenant[w.tenant]:
            del by_tenant[w.tenant]
            if not by_tenant:
                del by_cls[w.cls]
                if not by_cls:
                    del self._q[w.model]

    def drain(self, model: str) -> list[Waiter]:
        """Take out every waiter for ``model`` (nothing can serve it), uncharged."""
        by_cls = self._q.pop(model, {})
        out = [w for by_tenant in by_cls.values() for fifo in by_tenant.values()
               for w in fifo.values()]
        self.waiting -= len(out)
        return out

    def charge(self, tenant: str, tokens: float) -> None:
        """Service received (tokens) by ``tenant``: output tokens as the response ends."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + \
            tokens / self.weights.get(tenant, 1.0)

    def _class_to_serve(self, model: str,
                        by_cls: dict[str, dict[str, OrderedDict[int, Waiter]]],
                        now: float, held: Container[str]) -> str | None:
        present = [c for c in self.classes if c in by_cls and c not in held]
        if not present:
            return None
        # Aging: of the classes unserved past their bound, the one past it by most;
        # otherwise the best class.
        overdue: tuple[float, str] | None = None
        for c in present[1:]:
            late = self._late(model, c, by_cls[c], now)
            if late is not None and late >= 0 and (overdue is None or late > overdue[0]):
                overdue = (late, c)
        return overdue[1] if overdue is not None else present[0]

    def _late(self, model: str, cls: str, by_tenant: dict[str, OrderedDict[int, Waiter]],
              now: float) -> float | None:
        """How far past its aging bound ``cls`` has gone unserved (negative: not yet;
        None: no bound)."""
        bound = self.max_wait_s.get(cls)
        if bound is None:
            return None
        oldest = min(next(iter(f.values())).since for f in by_tenant.values())
        # Unserved since its oldest arrived or it was last served, whichever is later:
        # the bound is on the class going unserved, not on the wait behind its own
        # backlog (else a long flood is overdue for ever and outranks every class).
        return now - max(oldest, self._served_at.get((model, cls), oldest)) - bound

    def overdue(self, model: str, cls: str, now: float) -> bool:
        """Whether ``cls`` waits for ``model`` and has gone unserved past its aging bound."""
        by_tenant = self._q.get(model, {}).get(cls)
        late = self._late(model, cls, by_tenant, now) if by_tenant else None
        return late is not None and late >= 0

    def pop(self, model: str, now: float, held: Container[str] = ()) -> Waiter | None:
        """The next waiter for ``model`` of a class not ``held`` (None: none), removed
        and charged its cost."""
        by_cls = self._q.get(model)
        if not by_cls:
            return None
        cls = self._class_to_serve(model, by_cls, now, held)
        if cls is None:
            return None
        by_tenant = by_cls[cls]
        # Least counter first; ties by arrival, so equal tenants alternate.
        tenant = min(by_tenant, key=lambda t: (self.counters.get(t, 0.0),
                                               next(iter(by_tenant[t]))))
        _, w = by_tenant[tenant].popitem(last=False)
        self._last[(model, w.cls)] = self.counters.get(tenant, 0.0)
        self._served_at[(model, w.cls)] = now
        self._prune(w)
        self.charge(tenant, w.cost)
        w.released_at = now
        self.occupancy.start(model, w.cls, now)
        self.starts.released(model, w.cls, now)
        return w

    def finished(self, w: Waiter, now: float, output_tokens: int = 0) -> None:
        """A released request ended (its slot is free again) with ``output_tokens``
        generated; once per waiter."""
        if w.released_at is not None:
            self.starts.finished(w.model, w.released_at, output_tokens, now)
            w.released_at = None
            self.occupancy.end(w.model, w.cls, now)
            self.flow.ended(w.model, now)


def tenants_of(cfg: TenantsConfig) -> list[Tenant]:
    """The configured tenants, and the fallback one when ``tenants.fallback`` is unset."""
    out = []
    for t in cfg.members:
        allowed = tuple(c for c in cfg.classes if t.classes is None or c in t.classes)
        out.append(Tenant(t.name, t.default_class or cfg.default_class, allowed,
                          weight=t.weight, requests_per_s=t.requests_per_s,
                          tokens_per_min=t.tokens_per_min, max_concurrency=t.max_concurrency,
                          tokens_per_day=t.tokens_per_day))
    if cfg.fallback is None:
        out.append(Tenant(DEFAULT_TENANT, cfg.default_class, tuple(cfg.classes)))
    return out


def book_of(cfg: TenantsConfig) -> TenantBook:
    tenants = tenants_of(cfg)
    by_name = {t.name: t for t in tenants}
    keys = {bytes.fromhex(h): t.name for t in cfg.members for h in t.keys_sha256}
    return TenantBook(tenants, cfg.classes, keys=keys,
                      fallback=by_name[cfg.fallback or DEFAULT_TENANT], header=cfg.header,
                      trusted_sources=cfg.trusted_sources,
                      priority_header=cfg.priority_header)


def queue_of(cfg: TenantsConfig, capacity: int, now: float = -math.inf) -> FairQueue:
    q = FairQueue(cfg.classes, max_wait_s=cfg.max_wait_s,
                  weights={t.name: t.weight for t in cfg.members}, capacity=capacity,
                  started=now)
    q.flow.tau_s = cfg.reserve_window_s
    q.occupancy.fall_s = cfg.reserve_window_s if cfg.reserve_fall_s is None \
        else cfg.reserve_fall_s
    q.occupancy.fall_gaps = cfg.reserve_fall_gaps
    return q


# -- the slot reserve --------------------------------------------------------------------


@dataclass(frozen=True)
class Reserve:
    """Per class, the slots of each replica it leaves free for the better classes (a
    class absent leaves none), while one of them arrived within ``idle_s``; and while it
    does, at most ``pace`` requests not yet started per replica. A class in ``adaptive``
    leaves ``headroom`` x the better classes' recent mean in service per replica
    (:class:`Occupancy`; with ``held``, less those in service now), at least one slot;
    the others their fixed fraction."""

    classes: tuple[str, ...]  # best first
    fractions: Mapping[str, float]
    idle_s: float
    pace: int = 1 << 30
    adaptive: frozenset[str] = frozenset()
    headroom: float = 1.0
    # Pacing holds while a better class arrived within this long (at most idle_s): it
    # costs the lower class throughput, and guards only better requests that arrive soon.
    pace_s: float = math.inf
    # The reserve by arrivals (tenants.reserve_miss): an adaptive class keeps the fewest
    # slots free that leave at most this share of better requests finding none
    # (:func:`buffer_slots`, from :meth:`Flow.ratio`); by occupancy (``headroom``) until
    # a request has ended. None: by occupancy.
    miss: float | None = None
    # The reserve by load counts the slots the better classes hold (tenants.reserve_held):
    # ``headroom`` x their mean in service is their share of each replica, in service and
    # free together, so the free slots kept are that less those in service now, at least
    # one. False: that many slots free beside the ones they hold.
    held: bool = False
    # tenants.reserve_stagger: while pacing holds, a class with a better one is released
    # only while no request of a lower class is pending its start on any replica of the
    # model, one at a time over them (:class:`Stagger`); the dispatcher sends a better
    # request to a replica with none pending.
    stagger: bool = False

    def better(self, cls: str) -> tuple[str, ...]:
        return self.classes[:self.classes.index(cls)]

    def slots(self, cls: str, capacity: int, better: float = 0.0, replicas: int = 1,
              rho: float | None = None, busy: int = 0) -> int:
        """Slots of a replica with ``capacity`` that ``cls`` leaves free (``better``: the
        better classes' mean in service on the ``replicas`` together; ``busy``: how many
        of them are in service now; ``rho``: their arrival rate over the rate slots free
        up), rounded up, but never the last one, so the reserve cannot starve the
        class."""
        if cls in self.adaptive:
            if self.miss is not None and rho is not None:
                # A better request finds no slot only when every replica's buffer is
                # empty (it goes to one with a free slot): one buffer of them all.
                n = max(1, replicas)
                want = -(-buffer_slots(rho, self.miss, n * capacity) // n)
            else:
                share = self.headroom * better - (busy if self.held else 0)
                want = max(1, math.ceil(share / max(1, replicas) - 1e-9))
        else:
            f = self.fractions.get(cls, 0.0)
            if f <= 0:
                return 0
            want = math.ceil(f * capacity - 1e-9)
        return max(0, min(capacity - 1, want))

    def applies(self, cls: str, arrived: Mapping[str, float], now: float) -> bool:
        """Whether a better class than ``cls`` arrived within ``idle_s`` (else it lapses)."""
        if cls not in self.adaptive and self.fractions.get(cls, 0.0) <= 0:
            return False
        since = now - self.idle_s
        return any(arrived.get(c, -math.inf) >= since for c in self.better(cls))

    def paces(self, cls: str, arrived: Mapping[str, float], now: float) -> bool:
        """Whether pacing holds for ``cls``: a better class arrived within ``pace_s``."""
        since = now - min(self.pace_s, self.idle_s)
        return any(arrived.get(c, -math.inf) >= since for c in self.better(cls))

    def room(self, cls: str, free: Sequence[tuple[int, int, int]], better: float = 0.0,
             paced: bool = True, unstarted: int | None = None,
             rho: float | None = None, busy: int = 0, overdue: bool = False) -> int:
        """Requests of ``cls`` the replicas (``(free, capacity, not started)`` each) may
        take now: their free slots beyond what it leaves free, and on each, ``paced``, at
        most ``pace`` not started at a time. ``unstarted``: how many of the not started
        still can be (:meth:`Starts.unstarted`; None: unknown); fewer than the replicas
        show, pacing counts that many, over the replicas together (``pace`` each).
        ``pace`` 0 releases none while pacing holds, but for a class ``overdue`` (unserved
        past its aging bound, :meth:`FairQueue.overdue`), paced as at 1: the aging guard
        still bounds its wait."""
        n = len(free)
        pace = max(1, self.pace) if overdue else self.pace
        if not paced or unstarted is None or unstarted >= sum(p for _, _, p in free):
            cap = pace if paced else 1 << 30
            return sum(min(max(0, f - self.slots(cls, c, better, n, rho, busy)),
                           max(0, cap - pending)) for f, c, pending in free)
        beyond = sum(max(0, f - self.slots(cls, cap, better, n, rho, busy))
                     for f, cap, _ in free)
        return min(beyond, max(0, pace * n - unstarted))


# Replicas' (free slots, slots, not started) for a model: the dispatcher's view
# (Dispatcher.slots).
Slots = Callable[[str], Sequence[tuple[int, int, int]]]


def reserve_of(cfg: TenantsConfig) -> Reserve:
    given = cfg.reserve_fractions()
    return Reserve(tuple(cfg.classes),
                   {c: float(f) for c, f in given.items() if f != AUTO_RESERVE},
                   cfg.reserve_idle_s, cfg.reserve_pace,
                   adaptive=frozenset(c for c, f in given.items() if f == AUTO_RESERVE),
                   headroom=cfg.reserve_headroom, pace_s=cfg.reserve_window_s,
                   miss=cfg.reserve_miss, held=cfg.reserve_held, stagger=cfg.reserve_stagger)


def release_into(queue: FairQueue, queued: Callable[[str], int], reserved: Mapping[str, int],
                 bound: int, now: float, *, reserve: Reserve | None = None,
                 slots: Slots | None = None,
                 held_out: set[str] | None = None) -> list[Waiter]:
    """Waiters to let into the dispatcher now: per model, while its dispatcher queue
    (``queued(model)``) plus those released but not yet offered (``reserved``) is below
    ``bound``; with a ``reserve`` (and the replicas' ``slots``), a class it applies to only
    while the free slots beyond its reserve, paced (:meth:`Reserve.room`), outnumber
    those pending (queued, reserved and released here). A replica whose slots are
    unknown is not counted; with none known the reserve cannot be judged and nothing is
    held. The classes held back that had waiters are added to ``held_out``. The one
    release rule of the live balancer and the simulator."""
    out: list[Waiter] = []
    for model in queue.models():
        pending = queued(model) + reserved.get(model, 0)
        room = bound - pending
        free = slots(model) if reserve is not None and slots is not None else ()
        # class -> free slots beyond its reserve, for the classes the reserve binds now
        beyond = {c: reserve.room(c, free, queue.occupancy.mean(model, reserve.better(c), now),
                                  reserve.paces(c, queue.arrived, now),
                                  queue.starts.unstarted(model, queue.classes, now),
                                  queue.flow.ratio(model, reserve.better(c), now)
                                  if reserve.miss is not None else None,
                                  queue.occupancy.now_in(model, reserve.better(c))
                                  if reserve.held else 0,
                                  reserve.pace == 0 and queue.overdue(model, c, now))
                  for c in queue.classes
                  if reserve is not None and reserve.applies(c, queue.arrived, now)} \
            if free else {}
        # The stagger: the lower classes pacing holds for, all held while one of theirs
        # is pending its start anywhere; one released at a time.
        staggered: set[str] = set()
        stagger_held: set[str] = set()
        if reserve is not None and reserve.stagger:
            staggered = {c for c in queue.classes[1:] if reserve.paces(c, queue.arrived, now)}
            if staggered and queue.stagger.lower_pending(model, now):
                stagger_held = staggered
        while room > 0:
            held = {c for c, n in beyond.items() if n <= pending}
            held |= stagger_held
            w = queue.pop(model, now, held)
            if w is None:
                if held_out is not None:
                    held_out.update(c for c in held if queue.has(model, c))
                break
            if w.cls in staggered:
                queue.stagger.released(model, w.cls, now)
                stagger_held = staggered
            out.append(w)
            room -= 1
            pending += 1
    return out


__all__ = ["DEFAULT_TENANT", "FairQueue", "Flow", "Occupancy", "Reserve", "Slots", "Stagger",
           "Starts", "Tenant", "TenantBook", "Waiter", "book_of", "buffer_slots", "queue_of",
           "release_into", "reserve_of", "tenants_of"]
