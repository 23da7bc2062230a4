"""Balancer records: registration, updates, removal and policy, with their ownership rules.

An agent token registers and changes its own balancers (at most
``max_balancers_per_agent``); a balancer's policy is an admin's. Every write commits the
replica reassignments it causes (membership.py) in the same commit.
"""

from __future__ import annotations

import time

from skymesh_controller.auth import Principal
from skymesh_controller.changes import Changes
from skymesh_controller.config import ControllerConfig
from skymesh_controller.errors import ApiError, conflict, invalid_field
from skymesh_controller.membership import Membership
from skymesh_controller.models import BalancerIn, PolicyIn
from skymesh_controller.records import (
    ADMIN,
    Records,
    given_policy,
    may_modify,
    not_owner,
    owner_after,
)
from skymesh_controller.refusals import Refusals
from skymesh_controller.store import Obj, Put, Store


class Balancers:
    def __init__(self, cfg: ControllerConfig, store: Store, changes: Changes,
                 records: Records, membership: Membership, refused: Refusals) -> None:
        self.cfg, self.store, self.changes = cfg, store, changes
        self.records, self.membership, self.refused = records, membership, refused

    async def _check_fields(self, fields: Obj) -> None:
        if "url" in fields:
            await self.records.check_url("url", fields["url"])
        if fields.get("peer_address"):
            await self.records.check_url("peer_address", f"http://{fields['peer_address']}")

    async def register(self, body: BalancerIn, who: Principal = ADMIN) -> Obj:
        """POST: create, or re-register (a balancer restarting) when the caller owns it."""
        fields = given_policy(body, body.model_dump())
        await self._check_fields(fields)
        async with self.changes.lock:
            old = await self.store.get("balancers", body.id)
            if old is not None and not may_modify(old, who):
                raise conflict(f"balancer {body.id!r} exists and belongs to "
                               f"{old.get('owner')!r}: pick another id")
            if old is None:
                await self._check_quota(who)
            check_policy(body.id, old or {}, fields, who)
            return await self._write(body.id, old, fields, who, keep_policy=True)

    async def update(self, bid: str, fields: Obj, who: Principal) -> Obj:
        """PUT (every field) or PATCH (the fields given) of an existing balancer; the
        policy fields change only when given (``given_policy``)."""
        await self._check_fields(fields)
        async with self.changes.lock:
            old = await self.records.get("balancers", bid, "balancer")
            if not may_modify(old, who):
                raise not_owner("balancer", bid, old)
            check_policy(bid, old, fields, who)
            return await self._write(bid, old, {**old, **fields}, who, keep_policy=False)

    async def _check_quota(self, who: Principal) -> None:
        """An agent token registers at most max_balancers_per_agent balancers: each one
        holds telemetry history, so the cap bounds what one token can make us keep."""
        if who.role == "admin":
            return
        cap = self.cfg.max_balancers_per_agent
        mine = sum(1 for b in (await self.store.all("balancers")).values()
                   if b.get("owner") == who.name)
        if mine >= cap:
            self.refused("balancer_quota", f"token {who.name!r}")
            raise ApiError(403, "quota_exceeded", f"token {who.name!r} owns {mine} "
                           f"balancers already (max_balancers_per_agent: {cap})")

    async def _write(self, bid: str, old: Obj | None, fields: Obj, who: Principal,
                     keep_policy: bool) -> Obj:
        old = old or {}
        await self.records.region_exists(fields["region"])
        obj = {k: fields.get(k) for k in ("region", "url", "peer_address", "policy")}
        obj.update(id=bid, policy_params=fields.get("policy_params") or {},
                   owner=owner_after(old, fields, who),
                   state=old.get("state", "unknown"),
                   registered_at=old.get("registered_at", time.time()))
        if keep_policy and fields.get("policy") is None and "policy" in old:
            # re-registration keeps a policy the operator set
            obj["policy"], obj["policy_params"] = old["policy"], old.get("policy_params", {})
        balancers = await self.store.all("balancers")
        balancers[bid] = obj
        puts: list[Put] = [("balancers", bid, obj)]
        puts += await self.membership.reassign(balancers)
        await self.changes.commit(puts)
        return obj

    async def delete(self, bid: str) -> None:
        async with self.changes.lock:
            await self.records.get("balancers", bid, "balancer")
            homed = sorted(r["id"] for r in (await self.store.all("replicas")).values()
                           if r.get("balancer") == bid)
            if homed:
                raise conflict(f"balancer {bid!r} is home to replicas {', '.join(homed)}; "
                               "remove or move them first")
            await self.changes.commit([], [("balancers", bid)])

    async def set_policy(self, bid: str, body: PolicyIn) -> Obj:
        _build_policy(body.policy, body.params)
        async with self.changes.lock:
            obj = await self.records.get("balancers", bid, "balancer")
            obj["policy"], obj["policy_params"] = body.policy, body.params
            await self.changes.commit([("balancers", bid, obj)])
        return obj


def check_policy(bid: str, old: Obj, fields: Obj, who: Principal) -> None:
    """Policy is an admin's (as ``PUT .../policy``); the policy and its parameters in
    force after this write are checked together, whichever of them is given."""
    changed = [k for k in ("policy", "policy_params")
               if k in fields and (fields[k] or None) != (old.get(k) or None)]
    if not changed:
        return
    if who.role != "admin":
        raise ApiError(403, "forbidden", f"{changed[0]}: only an admin token may change "
                       f"a balancer's policy (PUT /v1/balancers/{bid}/policy)")
    policy = fields.get("policy", old.get("policy"))
    params = fields.get("policy_params", old.get("policy_params")) or {}
    if policy is None:
        if params:
            raise invalid_field("policy_params", "invalid_policy",
                                "given without a policy to apply them to")
        return
    _build_policy(policy, params)


def _build_policy(policy: str, params: Obj) -> None:
    """The data plane's own policy registry builds it, or says why not (a 422)."""
    from skymesh.policies import PolicyConfigError, build_policy

    try:
        build_policy(policy, params)
    except PolicyConfigError as exc:
        raise ApiError(422, "invalid_policy", f"policy: {exc}") from None
