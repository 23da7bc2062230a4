"""Tenants pushed by the controller, merged with ``lb.yaml``'s ``tenants:`` section, and
the limiter rebuilt for them without losing what it counted (docs/tenancy.md, "With a
controller"). Pure: the controller link hands the pushed records in, the gate swaps.

The merge rule: a tenant the controller defines replaces the ``lb.yaml`` tenant of the
same name, whole, and takes its key digests from any ``lb.yaml`` tenant that names them
too; ``lb.yaml`` keeps everything else (classes, aging bounds, headers, fallback, its other
tenants). A pushed tenant naming a class this balancer does not have loses that class
(it may then use all of them); its limits still hold.

Shares: an ``lb.yaml`` tenant's limits are divided by this balancer's local share (the
region's balancers x workers, as before); a pushed tenant's by the ``share`` the
controller sent (the live balancers its limits are split among).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.tenancy import Limiter, Tenant, tenants_of
from skymesh.common.tenants import TenantConfig

log = logging.getLogger("skymesh.balancer.tenants")


@dataclass(frozen=True)
class Merged:
    cfg: TenantsConfig  # lb.yaml's section with the pushed tenants in its members
    shares: dict[str, int]  # pushed tenant -> the balancers its limits are split among


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
        shares[t.name] = max(1, share)
    kept = [t.model_copy(update={"keys_sha256": [h for h in t.keys_sha256
                                                 if h not in digests]})
            for t in base.members if t.name not in shares]
    return Merged(base.model_copy(update={"members": kept + mine}), shares)


def limiter_of(merged: Merged, local_share: int, now: float,
               old: Limiter | None = None) -> Limiter:
    """The limiter for ``merged``: each tenant's limits divided by its share. What
    ``old`` counted for a tenant (requests in flight, the day's tokens, what its buckets
    hold, at most the new burst) carries over, so a push is no reset of anyone's limits."""
    groups: dict[int, list[Tenant]] = {}
    for t in tenants_of(merged.cfg):
        groups.setdefault(merged.shares.get(t.name, local_share), []).append(t)
    new = Limiter([], share=1, now=now)
    for share, tenants in groups.items():
        new.state.update(Limiter(tenants, share=share, now=now).state)
    if old is None:
        return new
    for name, st in new.state.items():
        was = old.state.get(name)
        if was is None:
            continue
        st.in_flight, st.day, st.day_tokens = was.in_flight, was.day, was.day_tokens
        for bucket, before in ((st.requests, was.requests), (st.tokens, was.tokens)):
            if bucket is not None and before is not None:
                before.wait_for(0.0, now)  # refilled up to now
                bucket.level = min(bucket.burst, before.level)
    return new


__all__ = ["Merged", "limiter_of", "merge"]
