"""Tenants and their limits, kept by the controller and pushed to the balancers with
membership (issue #37; docs/tenancy.md, "With a controller").

A tenant record is the balancer's ``tenants.members[]`` entry (one schema, in the kernel:
``skymesh.common.tenants.TenantConfig``) plus ``scope``:

- ``global`` (the default): each limit is for the whole mesh, split among the live
  balancers of every region;
- ``region``: each limit holds in every region on its own, split among that region's
  live balancers.

Each balancer's membership carries every tenant with its part of the limits, which the
balancer holds in local token buckets, so no request waits on the network:

- ``share``: the number of live balancers in scope (this one included), the even split
  ``1/share`` that balancers older than the fractions use;
- ``fraction`` and ``tokens_fraction``: this balancer's part of the request limits
  (requests/s, concurrency) and of the token limits (tokens/min, the daily quota), in
  proportion to the demand each balancer of the scope reported for the tenant in its
  telemetry (requests and tokens offered, admitted or refused, smoothed:
  ``skymesh.balancer.tenant_limits.Demand``); :func:`split` is the rule. A balancer whose
  newest report is older than ``tenant_demand_stale_s`` counts as offering nothing;
  with no report in scope the split is even. None falls below ``tenant_share_floor / n``
  (n balancers in scope), so a balancer whose traffic just started admits some of it at
  once, and more at its next report; the balancers at the floor together hold at most
  ``tenant_share_floor`` of a limit, which bounds what a skewed split loses.

A balancer reports at most its busiest tenants (``controller.telemetry_max_tenants``, so
the report stays under ``telemetry_max_bytes``): a tenant its report leaves out counts as
offering nothing there, the floor, like a tenant it has no traffic for. A balancer older
than the demand reports (its fresh reports carry no ``tenants``) still divides every
limit by ``share``: it counts as holding ``1/n``, and the others split the rest by their
demand, so during a rolling upgrade the scope never allows more than the limit.

A balancer that dies is left out at the next push, and the others' parts grow.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from skymesh.common.tenants import TenantConfig
from skymesh_controller import placement
from skymesh_controller.changes import Changes
from skymesh_controller.config import ControllerConfig
from skymesh_controller.errors import ApiError, conflict, invalid_field
from skymesh_controller.records import Records
from skymesh_controller.refusals import Refusals
from skymesh_controller.store import Obj, Store

Scope = Literal["global", "region"]
MAX_KEYS = 256  # digests per tenant


class TenantIn(TenantConfig):
    """The body of ``PUT /v1/tenants/{name}`` (``name`` optional: the path's)."""

    # Strict JSON types, as the admin API's other bodies (models._In).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True,
                              allow_inf_nan=False)

    name: str | None = Field(None, min_length=1, max_length=64)  # type: ignore[assignment]
    keys_sha256: list[str] = Field(default_factory=list, max_length=MAX_KEYS)
    scope: Scope = "global"

    @model_validator(mode="after")
    def _classes(self) -> TenantIn:
        named = [*(self.classes or []), *([self.default_class] if self.default_class else [])]
        for c in named:
            if not (c.isidentifier() and c == c.lower()):
                raise ValueError(f"class {c[:64]!r}: classes are lower-case words")
        if self.classes is not None and self.default_class is not None \
                and self.default_class not in self.classes:
            raise ValueError(f"default_class: {self.default_class!r} is not one of classes")
        if len(set(self.keys_sha256)) != len(self.keys_sha256):
            raise ValueError("keys_sha256: a digest is listed twice")
        return self


# balancer id -> tenant -> (requests/s, tokens/min) offered there, from fresh reports;
# None for a balancer whose fresh reports carry no demand (older than it: it holds 1/n)
Demand = Mapping[str, Mapping[str, tuple[float, float]] | None]
DEFAULT_FLOOR: float = ControllerConfig.model_fields["tenant_share_floor"].default


def split(demand: Mapping[str, float | None], floor: float = DEFAULT_FLOOR
          ) -> dict[str, float]:
    """Each balancer's fraction of a limit: in proportion to its ``demand``, none below
    ``floor / n``, summing to 1; even when nobody offers anything. Water-filling: the
    balancers whose proportional part is under the floor are held at it and the rest is
    shared by the others in proportion (``floor`` at most 0.5 keeps the busiest above it).
    A ``None`` demand is a balancer that reports none (older than the fractions): it uses
    ``1/n`` whatever it is pushed, so it is counted at ``1/n`` and the others share the
    rest, by the same rule (their floor stays ``floor / n`` of the whole limit)."""
    n = len(demand)
    if n == 0:
        return {}
    known = {b: d for b, d in demand.items() if d is not None}
    rest = len(known) / n
    return dict.fromkeys(set(demand) - set(known), 1.0 / n) | {
        b: rest * f for b, f in _split(known, floor).items()}


def _split(demand: Mapping[str, float], floor: float) -> dict[str, float]:
    n = len(demand)
    if n == 0:
        return {}
    total = sum(max(0.0, d) for d in demand.values())
    if total <= 0:
        return dict.fromkeys(demand, 1.0 / n)
    low = floor / n
    pinned: set[str] = set()
    while True:
        free = {b: max(0.0, d) for b, d in demand.items() if b not in pinned}
        rest, free_total = 1.0 - low * len(pinned), sum(free.values())
        out = {b: rest * d / free_total for b, d in free.items()} | dict.fromkeys(pinned, low)
        under = {b for b in free if out[b] < low}
        if not under:
            return out
        pinned |= under


def scopes(me: Obj, balancers: dict[str, Obj]) -> dict[str, list[str]]:
    """The live balancers a limit of each scope is split among, as ``me`` sees them
    (``me`` counts even while the prober has not seen it yet: it is the one asking)."""
    others = [b for b in balancers.values() if b["id"] != me["id"] and placement.live(b)]
    return {"global": sorted([me["id"], *(b["id"] for b in others)]),
            "region": sorted([me["id"], *(b["id"] for b in others
                                          if b["region"] == me["region"])])}


def fractions(tenant: str, me: str, ids: list[str], demand: Demand,
              floor: float = DEFAULT_FLOOR) -> tuple[float, float]:
    """``me``'s (requests, tokens) fraction of ``tenant``'s limits among ``ids``. A
    balancer with no report, or whose report leaves ``tenant`` out, offers nothing; one
    that reports no demand at all (``None``: older) holds ``1/n`` (:func:`split`)."""
    rows: dict[str, tuple[float, float] | None] = {}
    for b in ids:
        mine = demand.get(b, {})
        rows[b] = None if mine is None else mine.get(tenant, (0.0, 0.0))
    return (split({b: None if r is None else r[0] for b, r in rows.items()}, floor)[me],
            split({b: None if r is None else r[1] for b, r in rows.items()}, floor)[me])


def pushed(tenants: dict[str, Obj], me: Obj, balancers: dict[str, Obj],
           demand: Demand | None = None, floor: float = DEFAULT_FLOOR) -> list[Obj]:
    """The tenants as membership carries them to ``me``: each record with its share and
    its fractions (see the module docstring)."""
    scoped = scopes(me, balancers)
    out = []
    for _, t in sorted(tenants.items()):
        ids = scoped["region" if t.get("scope") == "region" else "global"]
        fr, ft = fractions(t["name"], me["id"], ids, demand or {}, floor)
        out.append({**t, "share": len(ids), "fraction": round(fr, 6),
                    "tokens_fraction": round(ft, 6)})
    return out


def demand_of(samples: Iterable[Obj], since: float
              ) -> dict[str, tuple[float, float]] | None:
    """One balancer's demand per tenant from its newest telemetry ``samples`` (any
    order): the newest report of each of its workers made at ``since`` or later, summed.
    Reports without ``tenants`` (a balancer older than them) count for nothing; None
    when there are fresh reports and none carries ``tenants``: a balancer that divides
    by ``share`` (:func:`split`). A tenant a report leaves out offers nothing there."""
    newest: dict[int, Obj] = {}
    fresh = False
    for x in samples:
        if x.get("ts", 0.0) < since:
            continue
        fresh = True
        if not isinstance(x.get("tenants"), dict):
            continue
        w = int(x.get("worker", 0))
        if w not in newest or x["ts"] > newest[w]["ts"]:
            newest[w] = x
    if fresh and not newest:
        return None
    out: dict[str, tuple[float, float]] = {}
    for x in newest.values():
        for name, d in x["tenants"].items():
            r, t = out.get(name, (0.0, 0.0))
            out[name] = (r + d.get("requests_per_s", 0.0), t + d.get("tokens_per_min", 0.0))
    return out


class Tenants:
    def __init__(self, store: Store, changes: Changes, records: Records, refused: Refusals,
                 max_tenants: int) -> None:
        self.store, self.changes, self.records = store, changes, records
        self.refused, self.max_tenants = refused, max_tenants

    async def put(self, name: str, body: TenantIn) -> Obj:
        if body.name is not None and body.name != name:
            raise invalid_field("name", "invalid", f"{body.name!r} is not the name in the "
                                "path; leave it out or give the same")
        obj = body.model_dump() | {"name": name}
        async with self.changes.lock:
            stored = await self.store.all("tenants")
            cap = self.max_tenants
            if name not in stored and len(stored) >= cap:
                self.refused("tenant_quota", f"tenant {name!r}")
                raise ApiError(403, "quota_exceeded", f"{len(stored)} tenants are stored "
                               f"already (max_tenants: {cap}); delete one first")
            mine = set(body.keys_sha256)
            for other, t in sorted(stored.items()):
                both = mine & set(t.get("keys_sha256", []))
                if other != name and both:
                    raise conflict(f"keys_sha256: {min(both)[:16]}... is tenant {other!r}'s "
                                   "key already; a key belongs to one tenant")
            await self.changes.commit([("tenants", name, obj)])
        return obj

    async def delete(self, name: str) -> None:
        async with self.changes.lock:
            await self.records.get("tenants", name, "tenant")
            await self.changes.commit([], [("tenants", name)])


__all__ = ["DEFAULT_FLOOR", "MAX_KEYS", "Demand", "Scope", "TenantIn", "Tenants", "demand_of",
           "fractions", "pushed", "scopes", "split"]
