"""Tenants and their limits, kept by the controller and pushed to the balancers with
membership (issue #37; docs/tenancy.md, "With a controller").

A tenant record is the balancer's ``tenants.members[]`` entry (one schema, in the kernel:
``skymesh.common.tenants.TenantConfig``) plus ``scope``:

- ``global`` (the default): each limit is for the whole mesh, split evenly among the live
  balancers of every region;
- ``region``: each limit holds in every region on its own, split among that region's
  live balancers.

Each balancer's membership carries every tenant with ``share``, the number of live
balancers its limits are divided by (this one included): local token buckets sized
``limit / share``, so no request waits on the network. A balancer that dies is left out
at the next push, and the others' shares grow.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from skymesh.common.tenants import TenantConfig
from skymesh_controller import placement
from skymesh_controller.changes import Changes
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


def shares(me: Obj, balancers: dict[str, Obj]) -> dict[str, int]:
    """The live balancers a limit of each scope is divided by, as ``me`` sees them (``me``
    counts even while the prober has not seen it yet: it is the one asking)."""
    others = [b for b in balancers.values() if b["id"] != me["id"] and placement.live(b)]
    return {"global": 1 + len(others),
            "region": 1 + sum(1 for b in others if b["region"] == me["region"])}


def pushed(tenants: dict[str, Obj], me: Obj, balancers: dict[str, Obj]) -> list[Obj]:
    """The tenants as membership carries them to ``me``: each record with its share."""
    n = shares(me, balancers)
    return [{**t, "share": n["region"] if t.get("scope") == "region" else n["global"]}
            for _, t in sorted(tenants.items())]


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


__all__ = ["MAX_KEYS", "Scope", "TenantIn", "Tenants", "pushed", "shares"]
