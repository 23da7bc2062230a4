"""The controller's behaviour: registration, membership, probing and failover.

All state lives in the store; this object holds only caches that are rebuilt from it
(probe counters, the latest telemetry), so a restarted controller picks up where it was.
One writer at a time (an asyncio lock): the controller is a single active process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from skymesh.common.health import HealthRule, Streak
from skymesh.net import urlpolicy
from skymesh.net.urlpolicy import PolicyResolver, Resolver, UrlRejected
from skymesh_controller import placement
from skymesh_controller.auth import Principal
from skymesh_controller.config import ControllerConfig
from skymesh_controller.models import (
    MAX_RECORD_DEPTH,
    BalancerIn,
    ModelIn,
    PolicyIn,
    RegionIn,
    ReplicaIn,
    TelemetryIn,
    json_problem,
)
from skymesh_controller.store import Obj, Put, Store

ADMIN = Principal("controller", "admin")  # callers inside the process (tests, actuators)

log = logging.getLogger("skymesh.controller")
LOG_EVERY_S = 10.0  # the least time between two log lines for one kind of refusal

DnsHook = Callable[[list[Obj], list[Obj], bool], Awaitable[dict[str, Any]]]


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str,
                 fields: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.fields = status, kind, message, fields


def not_found(what: str, key: str) -> ApiError:
    return ApiError(404, "not_found", f"no {what} named {key!r}")


def conflict(message: str) -> ApiError:
    return ApiError(409, "conflict", message)


def invalid_field(field: str, kind: str, why: str) -> ApiError:
    return ApiError(422, kind, f"{field}: {why}", [{"field": field, "message": why}])


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


def given_policy(body: Any, fields: Obj) -> Obj:
    """``fields`` without the policy fields the body did not name: a balancer that
    re-registers or is PUT without them keeps the policy an admin set."""
    return {k: v for k, v in fields.items()
            if k not in ("policy", "policy_params") or k in body.model_fields_set}


def replica_id_for(url: str) -> str:
    import hashlib

    return "r-" + hashlib.sha256(url.encode()).hexdigest()[:10]


class Controller:
    def __init__(self, cfg: ControllerConfig, store: Store, dns: DnsHook | None = None,
                 resolver: Resolver = urlpolicy.system_resolver) -> None:
        self.cfg = cfg
        self.store = store
        self.dns = dns
        self.url_policy = cfg.url_policy.policy()
        self.resolver = resolver
        # Placement mixes owners only where an admin allowed it (placement.Trust).
        self.trust = placement.Trust(
            admins=frozenset({t.name for t in cfg.tokens if t.role == "admin"}
                             | {ADMIN.name, "env-admin"}),
            shared=frozenset(cfg.shared_balancer_owners))
        self._refused: set[str] = set()  # URLs whose probe refusal was logged already
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        # The balancer's health rule (skymesh.balancer.health), one streak per object.
        self._rule = HealthRule(cfg.probe.failure_threshold, cfg.probe.success_threshold)
        self._streaks: dict[tuple[str, str], Streak] = {}
        self.probe_counts: dict[tuple[str, bool], int] = {}  # (kind, ok): for /metrics
        self.latest: dict[str, Obj] = {}
        self.started = time.time()
        self._session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task[None] | None = None
        self._dns_task: asyncio.Task[None] | None = None
        self.dns_last: dict[str, Any] | None = None
        # Per balancer, the newest revision it long-polled after: it has applied that
        # membership (a move waits for it before it trusts the replica's idle count).
        self.polled: dict[str, int] = {}
        # Requests refused by a limit, by reason (for /metrics), and when each reason was
        # last logged: one line per reason per LOG_EVERY_S, however many an attacker sends.
        self.refusals: dict[str, int] = {}
        self._refusal_logged: dict[str, float] = {}

    def refused(self, reason: str, detail: str = "") -> None:
        """Count a request a limit refused; log it, rate-limited per reason."""
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._refusal_logged.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._refusal_logged[reason] = now
            log.warning("refused a request: %s%s (%d so far)", reason,
                        f": {detail}" if detail else "", self.refusals[reason])

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, probe: bool = True) -> None:
        await self.store.ping()
        # The connector checks every address DNS gives it: a name that passed at
        # registration and resolves to a denied address now is refused at connect time.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                resolver=PolicyResolver(self.url_policy, self.resolver)),
            timeout=aiohttp.ClientTimeout(total=self.cfg.probe.timeout_s))
        if probe:
            self._prober = asyncio.create_task(self._probe_loop(), name="controller-probe")

    async def stop(self) -> None:
        for task in (self._prober, self._dns_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._session is not None:
            await self._session.close()
        await self.store.close()

    # -- change notification ---------------------------------------------------------------
    async def _commit(self, puts: list[Put], deletes: list[tuple[str, str]] | None = None
                      ) -> int:
        rev = await self.store.commit(puts, deletes)
        old, self._changed = self._changed, asyncio.Event()
        old.set()
        return rev

    async def wait_change(self, after: int, timeout: float) -> int:
        """Return the revision once it is past ``after``, or when ``timeout`` runs out."""
        deadline = time.monotonic() + min(timeout, self.cfg.long_poll_max_s)
        while True:
            event = self._changed
            rev = await self.store.revision()
            left = deadline - time.monotonic()
            if rev > after or left <= 0:
                return rev
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), left)

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

    # -- regions ---------------------------------------------------------------------------
    async def put_region(self, body: RegionIn) -> Obj:
        obj = body.model_dump()
        async with self._lock:
            await self._commit([("regions", body.name, obj)])
        return obj

    async def delete_region(self, name: str) -> None:
        async with self._lock:
            await self.get("regions", name, "region")
            users = [b["id"] for b in (await self.store.all("balancers")).values()
                     if b["region"] == name]
            users += [r["id"] for r in (await self.store.all("replicas")).values()
                      if r["region"] == name]
            if users:
                raise conflict(f"region {name!r} is still used by {', '.join(sorted(users))}")
            await self._commit([], [("regions", name)])

    # -- balancers -------------------------------------------------------------------------
    async def check_url(self, field: str, url: str) -> None:
        """The outbound URL policy, with DNS: a 422 naming ``field`` when refused."""
        try:
            await urlpolicy.check(url, self.url_policy, self.resolver)
        except UrlRejected as exc:
            raise invalid_field(field, "url_not_allowed", str(exc)) from None

    async def _check_balancer_fields(self, fields: Obj) -> None:
        if "url" in fields:
            await self.check_url("url", fields["url"])
        if fields.get("peer_address"):
            await self.check_url("peer_address", f"http://{fields['peer_address']}")

    async def register_balancer(self, body: BalancerIn, who: Principal = ADMIN) -> Obj:
        """POST: create, or re-register (a balancer restarting) when the caller owns it."""
        fields = given_policy(body, body.model_dump())
        await self._check_balancer_fields(fields)
        async with self._lock:
            old = await self.store.get("balancers", body.id)
            if old is not None and not may_modify(old, who):
                raise conflict(f"balancer {body.id!r} exists and belongs to "
                               f"{old.get('owner')!r}: pick another id")
            if old is None:
                await self._check_quota(who)
            self._check_policy(body.id, old or {}, fields, who)
            return await self._write_balancer(body.id, old, fields, who, keep_policy=True)

    async def update_balancer(self, bid: str, fields: Obj, who: Principal) -> Obj:
        """PUT (every field) or PATCH (the fields given) of an existing balancer; the
        policy fields change only when given (``given_policy``)."""
        await self._check_balancer_fields(fields)
        async with self._lock:
            old = await self.get("balancers", bid, "balancer")
            if not may_modify(old, who):
                raise not_owner("balancer", bid, old)
            self._check_policy(bid, old, fields, who)
            return await self._write_balancer(bid, old, {**old, **fields}, who,
                                              keep_policy=False)

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

    @staticmethod
    def _check_policy(bid: str, old: Obj, fields: Obj, who: Principal) -> None:
        """Policy is an admin's (as ``PUT .../policy``); the policy and its parameters in
        force after this write are checked together, whichever of them is given."""
        from skymesh.policies import PolicyConfigError, build_policy

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
        try:
            build_policy(policy, params)
        except PolicyConfigError as exc:
            raise ApiError(422, "invalid_policy", f"policy: {exc}") from None

    async def _write_balancer(self, bid: str, old: Obj | None, fields: Obj, who: Principal,
                              keep_policy: bool) -> Obj:
        old = old or {}
        if await self.store.get("regions", fields["region"]) is None:
            raise invalid_field("region", "unknown_region",
                                f"no region named {fields['region']!r}")
        obj = {k: fields.get(k) for k in ("region", "url", "peer_address", "policy")}
        obj.update(id=bid, policy_params=fields.get("policy_params") or {},
                   owner=self._owner(old, fields, who),
                   state=old.get("state", "unknown"),
                   registered_at=old.get("registered_at", time.time()))
        if keep_policy and fields.get("policy") is None and "policy" in old:
            # re-registration keeps a policy the operator set
            obj["policy"], obj["policy_params"] = old["policy"], old.get("policy_params", {})
        await self._apply_balancers({bid: obj})
        return obj

    def _owner(self, old: Obj, fields: Obj, who: Principal) -> str:
        """Who owns the record after this write; only an admin hands it to someone else."""
        current = old.get("owner") or who.name
        wanted = fields.get("owner") or current
        if wanted != current and who.role != "admin":
            raise ApiError(403, "not_owner", "owner: only an admin token may change it")
        return str(wanted)

    async def delete_balancer(self, bid: str) -> None:
        async with self._lock:
            await self.get("balancers", bid, "balancer")
            homed = sorted(r["id"] for r in (await self.store.all("replicas")).values()
                           if r.get("balancer") == bid)
            if homed:
                raise conflict(f"balancer {bid!r} is home to replicas {', '.join(homed)}; "
                               "remove or move them first")
            balancers = await self.store.all("balancers")
            del balancers[bid]
            await self._commit([], [("balancers", bid)])

    async def set_policy(self, bid: str, body: PolicyIn) -> Obj:
        from skymesh.policies import PolicyConfigError, build_policy

        try:
            build_policy(body.policy, body.params)
        except PolicyConfigError as exc:
            raise ApiError(422, "invalid_policy", f"policy: {exc}") from None
        async with self._lock:
            obj = await self.get("balancers", bid, "balancer")
            obj["policy"], obj["policy_params"] = body.policy, body.params
            await self._commit([("balancers", bid, obj)])
        return obj

    async def _apply_balancers(self, changed: dict[str, Obj]) -> None:
        """Commit balancer changes together with the replica moves they cause."""
        balancers = await self.store.all("balancers")
        balancers.update(changed)
        puts: list[Put] = [("balancers", k, v) for k, v in changed.items()]
        puts += await self._moves(balancers)
        await self._commit(puts)

    async def _moves(self, balancers: dict[str, Obj],
                     replicas: dict[str, Obj] | None = None) -> list[Put]:
        if replicas is None:
            replicas = await self.store.all("replicas")
        regions = await self.store.all("regions")
        puts: list[Put] = []
        for rid, target in placement.assignments(balancers, replicas, regions,
                                                 self.trust).items():
            rep = replicas[rid]
            if rep.get("assigned") != target:
                log.info("replica %s (%s): balancer %s -> %s", rid, rep["url"],
                         rep.get("assigned"), target)
                rep["assigned"] = target
                puts.append(("replicas", rid, rep))
        return puts

    # -- replicas --------------------------------------------------------------------------
    async def add_replica(self, body: ReplicaIn, who: Principal = ADMIN) -> Obj:
        """POST: create, or re-register when the caller may change the existing record."""
        await self.check_url("url", body.url)
        rid = body.id or replica_id_for(body.url)
        async with self._lock:
            old = await self.store.get("replicas", rid)
            if old is not None and not may_modify(old, who, await self.store.all("balancers")):
                raise conflict(f"replica {rid!r} exists and belongs to {old.get('owner')!r}")
            return await self._write_replica(rid, old, body.model_dump(), who)

    async def update_replica(self, rid: str, fields: Obj, who: Principal) -> Obj:
        """PUT (every field) or PATCH (the fields given) of an existing replica."""
        if "url" in fields:
            await self.check_url("url", fields["url"])
        async with self._lock:
            old = await self.get("replicas", rid, "replica")
            if not may_modify(old, who, await self.store.all("balancers")):
                raise not_owner("replica", rid, old)
            merged = {**old, **fields}
            if "balancer" not in fields and merged.get("region") != old.get("region"):
                merged["balancer"] = None  # a new region: a home there, not the old one
            return await self._write_replica(rid, old, merged, who)

    async def _write_replica(self, rid: str, old: Obj | None, fields: Obj, who: Principal
                             ) -> Obj:
        old = old or {}
        if await self.store.get("regions", fields["region"]) is None:
            raise invalid_field("region", "unknown_region",
                                f"no region named {fields['region']!r}")
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
        obj = {k: fields.get(k) for k in ("url", "model", "region", "gpu", "kind")}
        obj.update(id=rid, balancer=home, owner=self._owner(old, fields, who),
                   state=old.get("state", "unknown"), assigned=old.get("assigned"))
        replicas[rid] = obj
        puts = await self._moves(balancers, replicas)
        if all(p[1] != rid for p in puts):
            puts.append(("replicas", rid, obj))
        await self._commit(puts)
        return obj

    async def remove_replica(self, rid: str) -> None:
        async with self._lock:
            await self.get("replicas", rid, "replica")
            await self._commit([], [("replicas", rid)])

    async def drain(self, rid: str, on: bool) -> Obj:
        return (await self._drain(rid, on))[0]

    async def _drain(self, rid: str, on: bool) -> tuple[Obj, int]:
        async with self._lock:
            obj = await self.get("replicas", rid, "replica")
            if on:
                obj["state"] = "draining"
            elif obj["state"] == "draining":
                obj["state"] = "unknown"  # the next probe decides
            rev = await self._commit([("replicas", rid, obj)])
        return obj, rev

    # -- moves (the planner's, skymesh_controller/autopilot/moves.py) ---------------------
    async def begin_drain(self, rid: str) -> int:
        """Drain ``rid`` as ``POST .../drain`` does; the revision that took it out."""
        return (await self._drain(rid, True))[1]

    def note_poll(self, bid: str, after: int) -> None:
        self.polled[bid] = max(after, self.polled.get(bid, -1))

    async def drain_applied(self, rid: str, rev: int) -> bool:
        """Whether every live balancer serving ``rid`` has applied membership ``rev`` or
        later. Balancers that never long-polled this process do not follow membership
        from it (or have not since it started) and are not waited for."""
        rep = await self.store.get("replicas", rid)
        if rep is None:
            return True
        balancers = await self.store.all("balancers")
        return all(self.polled[bid] >= rev for bid, b in balancers.items()
                   if bid in self.polled and placement.live(b)
                   and placement.shares(bid, rep.get("assigned"), balancers))

    async def replica_busy(self, url: str) -> int | None:
        """Running + waiting requests from the replica's own ``/metrics`` (every
        balancer's and any direct client's); None when it cannot be read."""
        from skymesh.common.probe import ProbeParseError, parse_metrics

        assert self._session is not None
        try:
            urlpolicy.check_static(url, self.url_policy)
            async with self._session.get(urlpolicy.join(url, "/metrics"),
                                         allow_redirects=False) as r:
                if r.status != 200:
                    return None
                load = parse_metrics(await r.text())
        except (UrlRejected, ProbeParseError, aiohttp.ClientError, TimeoutError, OSError):
            return None
        return load.running + load.waiting

    async def move_home(self, rid: str, region: str) -> str | None:
        """The balancer a move of ``rid`` to ``region`` would home it at: one in the
        region that may serve it (its owner's, or one an admin allowed), else None."""
        rep = await self.store.get("replicas", rid)
        if rep is None:
            return None
        return placement.home_for(region, await self.store.all("balancers"),
                                  {**rep, "balancer": None}, self.trust)

    async def move_replica(self, rid: str, *, model: str, region: str, url: str) -> Obj:
        """Re-register a draining replica at another (model, region), homed at a
        balancer there, and undrain it: one commit, so balancers never see it half moved."""
        await self.check_url("url", url)
        async with self._lock:
            old = await self.get("replicas", rid, "replica")
            if old.get("state") != "draining":
                raise conflict(f"replica {rid!r} is {old.get('state')}: only a draining "
                               "replica is moved")
            home = await self.move_home(rid, region)
            if home is None:
                raise conflict(f"region {region!r} has no balancer that may serve {rid!r} "
                               f"(owner {old.get('owner')!r})")
            fields = {**old, "model": model, "region": region, "url": url, "balancer": home}
            # "unknown" serves at once; the next probe confirms it.
            return await self._write_replica(rid, {**old, "state": "unknown"}, fields, ADMIN)

    # -- models ----------------------------------------------------------------------------
    async def put_model(self, body: ModelIn) -> Obj:
        if body.max_replicas is not None and body.max_replicas < body.min_replicas:
            raise ApiError(422, "invalid", "max_replicas: must be at least min_replicas")
        obj = body.model_dump()
        async with self._lock:
            await self._commit([("models", body.name, obj)])
        return obj

    async def delete_model(self, name: str) -> None:
        async with self._lock:
            await self.get("models", name, "model")
            await self._commit([], [("models", name)])

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

    # -- balancer sync ---------------------------------------------------------------------
    async def membership(self, bid: str) -> Obj:
        rev = await self.store.revision()
        me = await self.read("balancers", bid, "balancer")
        balancers = await self.store.all("balancers")
        replicas = await self.store.all("replicas")
        mine = [{k: r[k] for k in ("id", "url", "model", "gpu", "kind", "region", "balancer")}
                for r in sorted(replicas.values(), key=lambda r: r["id"])
                if placement.shares(bid, r.get("assigned"), balancers) and placement.serving(r)]
        peers = [{"id": b["id"], "region": b["region"], "url": b["url"],
                  "peer_address": b.get("peer_address")}
                 for b in sorted(balancers.values(), key=lambda b: b["id"])
                 if b["id"] != bid and placement.live(b)]
        # Live balancers sharing this one's replicas, itself included: sp-p's n x margin
        # (pushing.balancers_per_region: auto).
        siblings = sum(1 for b in balancers.values() if b["id"] != bid and placement.live(b)
                       and b["region"] == me["region"] and b.get("owner") == me.get("owner"))
        return {"revision": rev, "balancer": bid, "state": me.get("state", "unknown"),
                "policy": me.get("policy"), "policy_params": me.get("policy_params", {}),
                "replicas": mine, "peers": peers, "region_balancers": 1 + siblings}

    async def report(self, bid: str, body: TelemetryIn, who: Principal = ADMIN) -> None:
        me = await self.get("balancers", bid, "balancer")
        if not may_modify(me, who):
            raise not_owner("balancer", bid, me)
        cfg = self.cfg
        if len(body.models) > cfg.telemetry_max_models:
            self.refused("telemetry_models", f"balancer {bid!r}: {len(body.models)}")
            raise invalid_field("models", "too_many_models", f"{len(body.models)} models: at "
                                f"most {cfg.telemetry_max_models} (telemetry_max_models)")
        sample = body.model_dump()
        sample.update(ts=time.time(), balancer=bid, region=me["region"])
        size = len(json.dumps(sample))
        if size > cfg.telemetry_max_bytes:
            self.refused("telemetry_too_large", f"balancer {bid!r}: {size} bytes")
            raise ApiError(413, "too_large", f"telemetry report of {size} bytes: at most "
                           f"{cfg.telemetry_max_bytes} (telemetry_max_bytes)")
        # The history is bounded in bytes too: large reports keep fewer of them. The size
        # is rounded up to a power of two so the count kept does not change every report.
        rounded = 1 << (size - 1).bit_length()
        keep = max(1, min(cfg.telemetry_keep, cfg.telemetry_balancer_bytes // rounded))
        await self.store.append(f"balancer:{bid}", sample, keep)
        self.latest[bid] = sample

    async def telemetry(self, balancer: str | None, region: str | None, limit: int
                        ) -> list[Obj]:
        names = [s for s in await self.store.series() if s.startswith("balancer:")]
        out: list[Obj] = []
        for s in names:
            if balancer is not None and s != f"balancer:{balancer}":
                continue
            out += [x for x in await self.store.tail(s, limit)
                    if region is None or x.get("region") == region]
        out.sort(key=lambda x: x["ts"])
        return out[-limit:]

    async def status(self) -> Obj:
        regions = await self.store.all("regions")
        balancers = await self.store.all("balancers")
        replicas = await self.store.all("replicas")
        per_region: dict[str, Obj] = {}
        for name in sorted(regions):
            bs = [b for b in balancers.values() if b["region"] == name]
            rs = [r for r in replicas.values() if r["region"] == name]
            tel = [self.latest[b["id"]] for b in bs if b["id"] in self.latest]
            per_region[name] = {
                "balancers": {b["id"]: b.get("state", "unknown") for b in bs},
                "replicas": len(rs),
                "replicas_healthy": sum(1 for r in rs if r.get("state") == "healthy"),
                "queue_length": sum(t["queue_length"] for t in tel),
                "in_flight": sum(t["in_flight"] for t in tel),
                "requests_per_s": sum(sum(m["requests"] for m in t["models"].values())
                                      / t["window_s"] for t in tel),
            }

        def count(objs: Any, key: str) -> dict[str, int]:
            out: dict[str, int] = {}
            for o in objs:
                out[o.get(key, "unknown")] = out.get(o.get(key, "unknown"), 0) + 1
            return out

        return {
            "revision": await self.store.revision(),
            "uptime_s": time.time() - self.started,
            "regions": len(regions),
            "balancers": count(balancers.values(), "state"),
            "replicas": count(replicas.values(), "state"),
            "unassigned_replicas": sorted(r["id"] for r in replicas.values()
                                          if not r.get("assigned")),
            "moved_replicas": sorted(r["id"] for r in replicas.values()
                                     if r.get("assigned") and r["assigned"] != r["balancer"]),
            "per_region": per_region,
            "dns": self.dns_last,
        }

    # -- probing and failover --------------------------------------------------------------
    async def _probe_loop(self) -> None:
        while True:
            try:
                await self.probe_once()
            except Exception:  # a store outage must not end probing for good
                log.exception("probe round failed")
            await asyncio.sleep(self.cfg.probe.interval_s)

    async def _healthy(self, url: str) -> bool:
        assert self._session is not None
        try:
            # Checked again at every probe: the policy may have changed since registration,
            # and IP literals never reach the connector's checking resolver.
            urlpolicy.check_static(url, self.url_policy)
            target = urlpolicy.join(url, "/health")
        except UrlRejected as exc:
            if url not in self._refused:
                self._refused.add(url)
                log.warning("not probing %s: %s", url, exc)
            return False
        try:
            # No redirects: a 3xx to another host would bypass the check above.
            async with self._session.get(target, allow_redirects=False) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if "URL policy" in str(exc) and url not in self._refused:
                self._refused.add(url)
                log.warning("not probing %s: %s", url, exc)
            return False

    def _judge(self, key: tuple[str, str], ok: bool, current: str, up: str, down: str) -> str:
        """Consecutive-result thresholds, so one lost probe does not move replicas: the
        balancer's own rule, on the stored state (``up``, ``down`` or anything else,
        which the rule treats as unknown)."""
        was = True if current == up else False if current == down else None
        now = self._rule.step(self._streaks.setdefault(key, Streak()), ok, was)
        return current if now is was else up if now else down

    async def probe_once(self) -> None:
        balancers = await self.store.all("balancers")
        replicas = await self.store.all("replicas")
        b_ok, r_ok = await asyncio.gather(
            asyncio.gather(*(self._healthy(b["url"]) for b in balancers.values())),
            asyncio.gather(*(self._healthy(r["url"]) for r in replicas.values())))
        for kind, oks in (("balancer", b_ok), ("replica", r_ok)):
            for ok in oks:
                self.probe_counts[kind, ok] = self.probe_counts.get((kind, ok), 0) + 1
        async with self._lock:
            # Re-read under the lock: an API write may have landed while we probed.
            cur_b = await self.store.all("balancers")
            cur_r = await self.store.all("replicas")
            changed_b: dict[str, Obj] = {}
            for b, ok in zip(balancers.values(), b_ok, strict=True):
                now = cur_b.get(b["id"])
                if now is None:
                    continue
                state = self._judge(("b", b["id"]), ok, now.get("state", "unknown"), "up", "down")
                if state != now.get("state"):
                    log.warning("balancer %s is %s", b["id"], state)
                    now["state"] = state
                    changed_b[b["id"]] = now
            puts: list[Put] = [("balancers", k, v) for k, v in changed_b.items()]
            for r, ok in zip(replicas.values(), r_ok, strict=True):
                now = cur_r.get(r["id"])
                if now is None or now.get("state") == "draining":
                    continue
                state = self._judge(("r", r["id"]), ok, now.get("state", "unknown"),
                                    "healthy", "unhealthy")
                if state != now.get("state"):
                    log.warning("replica %s is %s", r["id"], state)
                    now["state"] = state
                    puts.append(("replicas", r["id"], now))
            if changed_b:
                moved = await self._moves(cur_b, cur_r)
                done = {p[1] for p in puts if p[0] == "replicas"}
                puts += [p for p in moved if p[1] not in done]
            if puts:
                await self._commit(puts)
        if changed_b:
            self.schedule_dns()

    # -- DNS -------------------------------------------------------------------------------
    async def dns_sync(self, dry_run: bool) -> dict[str, Any]:
        if self.dns is None:
            raise ApiError(409, "dns_not_configured",
                           "DNS is not configured (add a dns section to the controller config)")
        report = await self.dns(await self.list_kind("balancers"), await self.list_kind("regions"),
                                dry_run)
        if not dry_run:
            self.dns_last = {"at": time.time(), **report}
        return report

    def schedule_dns(self) -> None:
        if self.dns is None or (self.cfg.dns is not None and not self.cfg.dns.auto_sync):
            return
        if self._dns_task is not None and not self._dns_task.done():
            return

        async def run() -> None:
            try:
                await self.dns_sync(dry_run=False)
            except Exception:
                log.exception("automatic DNS sync failed")

        self._dns_task = asyncio.create_task(run(), name="controller-dns")
