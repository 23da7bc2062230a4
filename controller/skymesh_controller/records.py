"""The records the admin API serves: reading them, regions and models, and the rules on
who may change a record and which URLs it may name.

Balancers (balancers.py) and replicas (replicas.py) are written by their own parts, on
the reading, ownership and URL rules of this one.
"""

from __future__ import annotations

import hashlib
from typing import Any

from skymesh.net import urlpolicy
from skymesh.net.urlpolicy import Resolver, UrlPolicy, UrlRejected
from skymesh_controller import placement
from skymesh_controller.auth import Principal
from skymesh_controller.changes import Changes
from skymesh_controller.errors import ApiError, conflict, invalid_field, not_found
from skymesh_controller.models import MAX_RECORD_DEPTH, ModelIn, RegionIn, json_problem
from skymesh_controller.refusals import Refusals
from skymesh_controller.store import Obj, Store

ADMIN = Principal("controller", "admin")  # callers inside the process (tests, actuators)


# -- ownership (pure) -----------------------------------------------------------------------
def may_modify(obj: Obj, who: Principal, balancers: dict[str, Obj] | None = None) -> bool:
    """Admin may change anything; an agent what it owns, or a replica its balancer owns.
    A record without an owner (written before owners existed) goes to the first agent
    that writes it."""
    if who.role == "admin" or obj.get("owner") in (None, who.name):
        return True
    home = (balancers or {}).get(obj.get("balancer") or "")
    return home is not None and home.get("owner") == who.name


def not_owner(what: str, key: str, obj: Obj) -> ApiError:
    return ApiError(403, "not_owner", f"{what} {key!r} belongs to {obj.get('owner')!r}; "
                                      "only its owner or an admin token may change it")


def owner_after(old: Obj, fields: Obj, who: Principal) -> str:
    """Who owns the record after this write; only an admin hands it to someone else."""
    current = old.get("owner") or who.name
    wanted = fields.get("owner") or current
    if wanted != current and who.role != "admin":
        raise ApiError(403, "not_owner", "owner: only an admin token may change it")
    return str(wanted)


def given_policy(body: Any, fields: Obj) -> Obj:
    """``fields`` without the policy fields the body did not name: a balancer that
    re-registers or is PUT without them keeps the policy an admin set."""
    return {k: v for k, v in fields.items()
            if k not in ("policy", "policy_params") or k in body.model_fields_set}


def replica_id_for(url: str) -> str:
    return "r-" + hashlib.sha256(url.encode()).hexdigest()[:10]


class Records:
    def __init__(self, store: Store, changes: Changes, refused: Refusals,
                 url_policy: UrlPolicy, resolver: Resolver) -> None:
        self.store, self.changes, self.refused = store, changes, refused
        self.url_policy, self.resolver = url_policy, resolver

    # -- reading ---------------------------------------------------------------------------
    async def list_kind(self, kind: str) -> list[Obj]:
        """Every record of ``kind`` the API can serve; one it cannot is left out (and
        logged) rather than failing the list for everyone."""
        return [v for k, v in sorted((await self.store.all(kind)).items())
                if self._unreadable(kind, k, v) is None]

    async def get(self, kind: str, key: str, what: str) -> Obj:
        obj = await self.store.get(kind, key)
        if obj is None:
            raise not_found(what, key)
        return obj

    async def read(self, kind: str, key: str, what: str) -> Obj:
        """``get`` for an answer to a client: a stored record the API cannot serve (one
        written before writes were bounded) is a 409 naming it, never a 500."""
        obj = await self.get(kind, key, what)
        why = self._unreadable(kind, key, obj)
        if why is not None:
            raise ApiError(409, "unreadable_record", f"{what} {key!r} is stored in a form "
                           f"the API cannot serve ({why}): an admin may PUT or DELETE it")
        return obj

    def _unreadable(self, kind: str, key: str, obj: Obj) -> str | None:
        why = json_problem(obj, MAX_RECORD_DEPTH)
        if why is not None:
            self.refused("unreadable_record", f"{kind} {key!r}: {why}")
        return why

    async def check_url(self, field: str, url: str) -> None:
        """The outbound URL policy, with DNS: a 422 naming ``field`` when refused."""
        try:
            await urlpolicy.check(url, self.url_policy, self.resolver)
        except UrlRejected as exc:
            raise invalid_field(field, "url_not_allowed", str(exc)) from None

    async def region_exists(self, name: str) -> None:
        if await self.store.get("regions", name) is None:
            raise invalid_field("region", "unknown_region", f"no region named {name!r}")

    # -- regions ---------------------------------------------------------------------------
    async def put_region(self, body: RegionIn) -> Obj:
        obj = body.model_dump()
        async with self.changes.lock:
            await self.changes.commit([("regions", body.name, obj)])
        return obj

    async def delete_region(self, name: str) -> None:
        async with self.changes.lock:
            await self.get("regions", name, "region")
            users = [b["id"] for b in (await self.store.all("balancers")).values()
                     if b["region"] == name]
            users += [r["id"] for r in (await self.store.all("replicas")).values()
                      if r["region"] == name]
            if users:
                raise conflict(f"region {name!r} is still used by {', '.join(sorted(users))}")
            await self.changes.commit([], [("regions", name)])

    # -- models ----------------------------------------------------------------------------
    async def put_model(self, body: ModelIn) -> Obj:
        if body.max_replicas is not None and body.max_replicas < body.min_replicas:
            raise ApiError(422, "invalid", "max_replicas: must be at least min_replicas")
        obj = body.model_dump()
        async with self.changes.lock:
            await self.changes.commit([("models", body.name, obj)])
        return obj

    async def delete_model(self, name: str) -> None:
        async with self.changes.lock:
            await self.get("models", name, "model")
            await self.changes.commit([], [("models", name)])

    async def models(self) -> list[Obj]:
        declared = await self.store.all("models")
        replicas = (await self.store.all("replicas")).values()
        names = sorted(set(declared) | {r["model"] for r in replicas})
        out = []
        for name in names:
            mine = [r for r in replicas if r["model"] == name]
            d = declared.get(name, {})
            out.append({
                "name": name, "declared": name in declared,
                "min_replicas": d.get("min_replicas", 0), "max_replicas": d.get("max_replicas"),
                "ttft_slo_s": d.get("ttft_slo_s"), "replicas": len(mine),
                "serving": sum(1 for r in mine if placement.serving(r) and r.get("assigned")),
                "regions": sorted({r["region"] for r in mine}),
            })
        return out
