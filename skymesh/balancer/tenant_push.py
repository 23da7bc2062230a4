"""Tenants pushed by the controller, merged with ``lb.yaml``'s ``tenants:`` section, and
the limiter rebuilt for them without losing what it counted (docs/tenancy.md, "With a
controller"). Pure: the controller link hands the pushed records in, the gate swaps.

The merge rule: a tenant the controller defines replaces the ``lb.yaml`` tenant of the
same name, whole, and takes its key digests from any ``lb.yaml`` tenant that names them
too; ``lb.yaml`` keeps everything else (classes, aging bounds, headers, fallback, its other
tenants). A pushed tenant naming a class this balancer does not have loses that class
(it may then use all of them); its limits still hold.

Shares: an ``lb.yaml`` tenant's limits are divided by this balancer's local share (the
region's balancers x workers, as before); a pushed tenant's limits are multiplied by the
``fraction`` (requests) and ``tokens_fraction`` (tokens) the controller sent, this
balancer's part by the demand it reported (a controller older than them: ``1/share``,
the live balancers its limits are split among), and divided among this balancer's
workers: the controller splits per balancer, each worker holds its part.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Gauge
from pydantic import ValidationError

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.tenancy import tenants_of
from skymesh.balancer.tenant_limits import Limiter
from skymesh.common.tenants import TenantConfig

log = logging.getLogger("skymesh.balancer.tenants")


@dataclass(frozen=True)
class Merged:
    cfg: TenantsConfig  # lb.yaml's section with the pushed tenants in its members
    shares: dict[str, int]  # pushed tenant -> the balancers its limits are split among
    # pushed tenant -> this balancer's (requests, tokens) fraction of its limits
    fractions: dict[str, tuple[float, float]] = field(default_factory=dict)


def _fraction(raw: Mapping[str, Any], key: str, share: int) -> float:
    """The pushed fraction ``key``, or ``1/share`` when absent or not in (0, 1]."""
    f = raw.get(key)
    if isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1:
        return float(f)
    return 1.0 / share


def _fit(t: TenantConfig, base: TenantsConfig) -> TenantConfig:
    """``t`` with only the classes this balancer has (see the module docstring)."""
    dropped = [c for c in t.classes or [] if c not in base.classes]
    classes = [c for c in t.classes or [] if c in base.classes] or None
    allowed = classes or base.classes
    default = t.default_class or base.default_class
    if default not in allowed:
        default = base.default_class if base.default_class in allowed else allowed[0]
    if dropped or (t.default_class is not None and default != t.default_class):
        log.warning("tenant %s from the controller names classes this balancer lacks "
                    "(it has %s): using %s, default %s", t.name, ", ".join(base.classes),
                    ", ".join(allowed), default)
    return t.model_copy(update={"classes": classes, "default_class": default})


def merge(base: TenantsConfig, pushed: Iterable[Mapping[str, Any]]) -> Merged:
    """``base`` (lb.yaml's section) with the controller's tenants in it."""
    fields = set(TenantConfig.model_fields)
    mine: list[TenantConfig] = []
    shares: dict[str, int] = {}
    fractions: dict[str, tuple[float, float]] = {}
    digests: set[str] = set()
    for raw in pushed:
        try:
            t = TenantConfig.model_validate({k: v for k, v in raw.items() if k in fields})
            share = int(raw.get("share", 1))
        except (ValidationError, TypeError, ValueError) as exc:
            log.warning("ignoring a tenant from the controller: %s", exc)
            continue
        if t.name in shares:
            continue
        # A key belongs to one tenant (the controller refuses two; an old record may not).
        t = t.model_copy(update={"keys_sha256": [h for h in t.keys_sha256
                                                 if h not in digests]})
        digests |= set(t.keys_sha256)
        mine.append(_fit(t, base))
        shares[t.name] = share = max(1, share)
        fractions[t.name] = (_fraction(raw, "fraction", share),
                             _fraction(raw, "tokens_fraction", share))
    kept = [t.model_copy(update={"keys_sha256": [h for h in t.keys_sha256
                                                 if h not in digests]})
            for t in base.members if t.name not in shares]
    return Merged(base.model_copy(update={"members": kept + mine}), shares, fractions)


def limiter_of(merged: Merged, local_share: int, now: float,
               old: Limiter | None = None, *, workers: int = 1) -> Limiter:
    """The limiter for ``merged``: an ``lb.yaml`` tenant's limits divided by
    ``local_share``, a pushed one's this balancer's fractions divided by its ``workers``.
    What ``old`` counted for a tenant (requests in flight, the day's tokens, what its
    buckets hold, at most the new burst, the times told to refused clients, the demand
    offered) carries over, so a push is no reset of anyone's limits."""
    w = max(1, workers)
    new = Limiter(tenants_of(merged.cfg), share=local_share, now=now,
                  fractions={name: (fr / w, ft / w)
                             for name, (fr, ft) in merged.fractions.items()})
    if old is None:
        return new
    new.demand = old.demand
    for name, st in new.state.items():
        was = old.state.get(name)
        if was is None:
            continue
        st.in_flight, st.day, st.day_tokens = was.in_flight, was.day, was.day_tokens
        for bucket, before in ((st.requests, was.requests), (st.tokens, was.tokens)):
            if bucket is not None and before is not None:
                before.wait_for(0.0, now)  # refilled up to now
                bucket.level = min(bucket.burst, before.level)
                # The times told to refused clients stand: a refresh of the fractions
                # (every telemetry report) must not send the next ones back together.
                bucket.promised = before.promised
    return new


def show_shares(gauge: Gauge, merged: Merged, workers: int = 1) -> None:
    """``skymesh_tenant_share{tenant,limit}``: each pushed tenant's part of its request and
    token limits this worker holds (the balancer's fraction divided among its workers);
    the series of tenants no longer pushed go."""
    w = max(1, workers)
    now = {(name, limit): f / w for name, (fr, ft) in merged.fractions.items()
           for limit, f in (("requests", fr), ("tokens", ft))}
    for metric in gauge.collect():
        for sample in metric.samples:
            key = (sample.labels["tenant"], sample.labels["limit"])
            if key not in now:
                gauge.remove(*key)
    for (name, limit), f in now.items():
        gauge.labels(name, limit).set(round(f, 6))


FRACTIONS = ("fraction", "tokens_fraction")


def without_fractions(pushed: Mapping[str, Any]) -> dict[str, Any]:
    """A pushed tenant but for its fractions (which follow the traffic)."""
    return {k: v for k, v in pushed.items() if k not in FRACTIONS}


def described(pushed: Iterable[Mapping[str, Any]]) -> str:
    """The pushed tenants and this balancer's part of each, for a log line."""
    out = []
    for t in pushed:
        share = t.get("share", 1)
        f = _fraction(t, "fraction", share if isinstance(share, int) and share >= 1 else 1)
        out.append(f"{t.get('name')} ({f:.1%} of its limits here)")
    return ", ".join(out) or "none"


__all__ = ["FRACTIONS", "Merged", "described", "limiter_of", "merge", "show_shares",
           "without_fractions"]
