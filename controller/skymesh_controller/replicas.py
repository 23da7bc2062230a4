"""Replica records: registration, updates, removal and draining.

A replica's home is the balancer it names, else one of its region's (placement.py); an
agent token homes replicas only at its own balancers. Every write commits the
reassignments it causes (membership.py) with it, so balancers never see half of it.
"""

from __future__ import annotations

from skymesh_controller import placement
from skymesh_controller.auth import Principal
from skymesh_controller.changes import Changes
from skymesh_controller.errors import ApiError, conflict, invalid_field
from skymesh_controller.membership import Membership
from skymesh_controller.models import ReplicaIn
from skymesh_controller.records import (
    ADMIN,
    Records,
    may_modify,
    not_owner,
    owner_after,
    replica_id_for,
)
from skymesh_controller.store import Obj, Store


class Replicas:
    def __init__(self, store: Store, changes: Changes, records: Records,
                 membership: Membership) -> None:
        self.store, self.changes = store, changes
        self.records, self.membership = records, membership

    async def add(self, body: ReplicaIn, who: Principal = ADMIN) -> Obj:
        """POST: create, or re-register when the caller may change the existing record."""
        await self.records.check_url("url", body.url)
        rid = body.id or replica_id_for(body.url)
        async with self.changes.lock:
            old = await self.store.get("replicas", rid)
            if old is not None and not may_modify(old, who, await self.store.all("balancers")):
                raise conflict(f"replica {rid!r} exists and belongs to {old.get('owner')!r}")
            return await self.write(rid, old, body.model_dump(), who)

    async def update(self, rid: str, fields: Obj, who: Principal) -> Obj:
        """PUT (every field) or PATCH (the fields given) of an existing replica."""
        if "url" in fields:
            await self.records.check_url("url", fields["url"])
        async with self.changes.lock:
            old = await self.records.get("replicas", rid, "replica")
            if not may_modify(old, who, await self.store.all("balancers")):
                raise not_owner("replica", rid, old)
            merged = {**old, **fields}
            if "balancer" not in fields and merged.get("region") != old.get("region"):
                merged["balancer"] = None  # a new region: a home there, not the old one
            return await self.write(rid, old, merged, who)

    async def write(self, rid: str, old: Obj | None, fields: Obj, who: Principal) -> Obj:
        """Validate and commit one replica record with the reassignments it causes; the
        caller holds ``changes.lock``."""
        old = old or {}
        await self.records.region_exists(fields["region"])
        balancers = await self.store.all("balancers")
        if fields.get("balancer") is not None and fields["balancer"] not in balancers:
            raise invalid_field("balancer", "unknown_balancer",
                                f"no balancer named {fields['balancer']!r}")
        home = fields.get("balancer") or placement.home_for(fields["region"], balancers)
        if (who.role != "admin" and home is not None and home != old.get("balancer")
                and balancers[home].get("owner") not in (None, who.name)):
            # Homing a replica at someone else's balancer would put it in their membership
            # and send their region's prompts to it.
            raise ApiError(403, "not_owner", f"balancer: {home!r} belongs to "
                           f"{balancers[home].get('owner')!r}; an agent token may home "
                           "replicas only at its own balancers")
        replicas = await self.store.all("replicas")
        for other in replicas.values():
            if other["url"] == fields["url"] and other["id"] != rid:
                raise conflict(f"url {fields['url']} is already replica {other['id']!r}")
        obj = {k: fields.get(k) for k in ("url", "model", "region", "gpu", "kind", "kv_events")}
        obj.update(id=rid, balancer=home, owner=owner_after(old, fields, who),
                   state=old.get("state", "unknown"), assigned=old.get("assigned"))
        replicas[rid] = obj
        puts = await self.membership.reassign(balancers, replicas)
        if all(p[1] != rid for p in puts):
            puts.append(("replicas", rid, obj))
        await self.changes.commit(puts)
        return obj

    async def remove(self, rid: str) -> None:
        async with self.changes.lock:
            await self.records.get("replicas", rid, "replica")
            await self.changes.commit([], [("replicas", rid)])

    async def drain(self, rid: str, on: bool) -> tuple[Obj, int]:
        """Take ``rid`` out of service (``on``) or back; the record and its revision."""
        async with self.changes.lock:
            obj = await self.records.get("replicas", rid, "replica")
            if on:
                obj["state"] = "draining"
            elif obj["state"] == "draining":
                obj["state"] = "unknown"  # the next probe decides
            rev = await self.changes.commit([("replicas", rid, obj)])
        return obj, rev
