"""Per-tenant limits at the balancer (issue #37; ``tenants:`` in ``lb.yaml``,
docs/tenancy.md). Pure: every clock is passed in, so tests drive a fake one.

:class:`Limiter`: per tenant a requests/s and a tokens/min token bucket, a concurrency
cap and a daily token quota, all local to this process; each configured limit is
divided by ``share`` (the balancers of the region x this balancer's workers, the share
sp-p uses), so the region's sum is the configured limit; with a controller, a tenant's
``fractions`` (of requests and of tokens) replace ``1/share``: the controller splits each
limit among the balancers by the demand they report (:class:`Demand`, the requests and
tokens offered here, admitted or not). Tokens are prompt + output
from the engine's ``usage``: the prompt estimate is taken at admission, the rest when
the response ends (the bucket may go below zero, and the tenant waits it out).
Retry-After is the time until the tenant's own bucket holds the request's cost, and
no earlier than the times already told to the tenant's refused requests, one refill
apart (up to a horizon of one burst's refill, at least 1 s): clients refused together
come back in turn rather than together, where only one of them would be admitted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from skymesh.balancer.errors import Overloaded
from skymesh.balancer.tenancy import Tenant

DAY_S = 86_400.0


class TenantLimited(Overloaded):
    """A tenant over one of its limits (429; ``reason`` is the metric label)."""

    def __init__(self, message: str, *, reason: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.reason = reason


class TokenBucket:
    """``rate`` per second up to ``burst``; ``debit`` may take it below zero (tokens
    counted after the fact), and a request then waits until it is refilled."""

    __slots__ = ("burst", "level", "promised", "rate", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.stamp = now
        self.promised = now  # the latest time told to a refused request

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_for(self, cost: float, now: float) -> float:
        """Seconds until the bucket holds ``cost`` (0: it does now). A cost above the
        burst is asked as the burst, or it would never pass."""
        self._refill(now)
        need = min(cost, self.burst) - self.level
        return 0.0 if need <= 0 else need / self.rate

    def retry_in(self, cost: float, now: float) -> float:
        """Seconds a refused request of ``cost`` should wait (0: it passes now): until
        the bucket holds it, and one refill of its cost after the last time told, so
        refused clients come back in turn. The stagger reaches at most one burst's
        refill (at least 1 s) past the earliest time: beyond that, clients that never
        return would push every later one out for nothing."""
        wait = self.wait_for(cost, now)
        if wait <= 0:
            return 0.0
        earliest = now + wait
        step = min(cost, self.burst) / self.rate
        horizon = max(1.0, self.burst / self.rate)
        self.promised = min(max(earliest, self.promised + step), earliest + horizon)
        return self.promised - now

    def debit(self, cost: float, now: float) -> None:
        self._refill(now)
        self.level -= cost


@dataclass
class _TenantState:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    max_concurrency: int | None
    tokens_per_day: float | None
    in_flight: int = 0
    day: int = -1
    day_tokens: float = 0.0


class Demand:
    """Per tenant, the requests and tokens offered to this process (admitted and
    limited: what its clients asked, not what its share let through), as rates smoothed
    over ``half_life_s``; reported to the controller, which splits each tenant's limits
    among the balancers in proportion (docs/tenancy.md, "Shares follow the traffic").
    Tokens are the prompt estimate of every request plus the output of those served."""

    def __init__(self, now: float, half_life_s: float = 2.0) -> None:
        self.half_life_s = half_life_s
        self.counts: dict[str, list[float]] = {}  # tenant -> [requests, tokens] since last
        self.smoothed: dict[str, tuple[float, float]] = {}  # tenant -> (per s, per min)
        self.since = now

    def add(self, tenant: str, requests: float, tokens: float) -> None:
        c = self.counts.get(tenant)
        if c is None:
            c = self.counts[tenant] = [0.0, 0.0]
        c[0] += requests
        c[1] += tokens

    def rates(self, now: float) -> dict[str, tuple[float, float]]:
        """Fold the counts since the last call in; per tenant (requests/s, tokens/min).
        A tenant no longer offered fades out and is dropped below 0.1% of a request/s,
        so the map holds only tenants recently seen (bounded by the configured ones)."""
        dt = now - self.since
        if dt <= 0:
            return dict(self.smoothed)
        self.since = now
        keep = 0.5 ** (dt / self.half_life_s)  # of the old rate: exponential smoothing
        counts, self.counts = self.counts, {}
        out: dict[str, tuple[float, float]] = {}
        for name in set(self.smoothed) | set(counts):
            old_r, old_t = self.smoothed.get(name, (0.0, 0.0))
            req, tok = counts.get(name, (0.0, 0.0))
            r = keep * old_r + (1 - keep) * req / dt
            # Usage below the prompt estimate is given back later: never below 0.
            t = max(0.0, keep * old_t + (1 - keep) * tok * 60.0 / dt)
            if r >= 1e-3 or name in counts:
                out[name] = (r, t)
        self.smoothed = out
        return dict(out)


class Limiter:
    """Per-tenant limits of this process: ``share`` of the configured ones, or the
    tenant's ``fractions`` (of requests: rate and concurrency; of tokens: rate and daily
    quota) where given (see the module docstring). ``now`` is monotonic seconds; ``wall``
    is Unix time, for the UTC day."""

    def __init__(self, tenants: Iterable[Tenant], *, share: int, now: float,
                 fractions: Mapping[str, tuple[float, float]] | None = None) -> None:
        self.share = max(1, share)
        self.state: dict[str, _TenantState] = {}
        self.demand = Demand(now)
        even = (1.0 / self.share, 1.0 / self.share)
        for t in tenants:
            fr, ft = (fractions or {}).get(t.name, even)
            rps = t.requests_per_s * fr if t.requests_per_s else None
            tpm = t.tokens_per_min * ft if t.tokens_per_min else None
            self.state[t.name] = _TenantState(
                requests=TokenBucket(rps, max(1.0, rps), now) if rps else None,
                # One minute's worth of tokens as the burst, as the limit is per minute.
                tokens=TokenBucket(tpm / 60.0, tpm, now) if tpm else None,
                max_concurrency=(max(1, math.ceil(t.max_concurrency * fr - 1e-9))
                                 if t.max_concurrency else None),
                tokens_per_day=t.tokens_per_day * ft if t.tokens_per_day else None)

    def admit(self, tenant: str, prompt_tokens: int, now: float, wall: float) -> None:
        """Take one request of ``tenant`` (raises :class:`TenantLimited`); the caller
        then owes one :meth:`release`."""
        st = self.state.get(tenant)
        if st is None:
            return
        self.demand.add(tenant, 1.0, prompt_tokens)
        if st.max_concurrency is not None and st.in_flight >= st.max_concurrency:
            raise TenantLimited(f"tenant {tenant!r} has {st.in_flight} requests in flight "
                                "here, its limit (max_concurrency)", reason="concurrency",
                                retry_after_s=1.0)
        if st.tokens_per_day is not None:
            day = int(wall // DAY_S)
            if day != st.day:
                st.day, st.day_tokens = day, 0.0
            if st.day_tokens >= st.tokens_per_day:
                raise TenantLimited(f"tenant {tenant!r} has used its daily token quota "
                                    "(tokens_per_day); it renews at 00:00 UTC",
                                    reason="daily_quota",
                                    retry_after_s=(day + 1) * DAY_S - wall)
        if st.requests is not None:
            wait = st.requests.retry_in(1.0, now)
            if wait > 0:
                raise TenantLimited(f"tenant {tenant!r} is over its request rate "
                                    "(requests_per_s)", reason="requests",
                                    retry_after_s=wait)
        if st.tokens is not None:
            wait = st.tokens.retry_in(max(1, prompt_tokens), now)
            if wait > 0:
                raise TenantLimited(f"tenant {tenant!r} is over its token rate "
                                    "(tokens_per_min)", reason="tokens", retry_after_s=wait)
        if st.requests is not None:
            st.requests.debit(1.0, now)
        if st.tokens is not None:
            st.tokens.debit(prompt_tokens, now)
        st.in_flight += 1

    def release(self, tenant: str, tokens: float, prompt_estimate: int, now: float,
                wall: float) -> None:
        """The request of :meth:`admit` ended having used ``tokens`` (prompt + output
        from ``usage``; the estimate taken at admission is given back first)."""
        st = self.state.get(tenant)
        if st is None:
            return
        st.in_flight = max(0, st.in_flight - 1)
        self.demand.add(tenant, 0.0, tokens - prompt_estimate)
        if st.tokens is not None:
            st.tokens.debit(tokens - prompt_estimate, now)
        if st.tokens_per_day is not None:
            day = int(wall // DAY_S)
            if day != st.day:
                st.day, st.day_tokens = day, 0.0
            st.day_tokens += tokens


__all__ = ["DAY_S", "Demand", "Limiter", "TenantLimited", "TokenBucket"]
