"""The controller's behaviour: registration, membership, probing and failover.

All state lives in the store; this object holds only caches that are rebuilt from it
(probe counters, the latest telemetry), so a restarted controller picks up where it was.
One writer at a time (an asyncio lock): the controller is a single active process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from controller import placement
from controller.config import ControllerConfig
from controller.models import BalancerIn, ModelIn, PolicyIn, RegionIn, ReplicaIn, TelemetryIn
from controller.store import Obj, Put, Store

log = logging.getLogger("skymesh.controller")

DnsHook = Callable[[list[Obj], list[Obj], bool], Awaitable[dict[str, Any]]]


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def not_found(what: str, key: str) -> ApiError:
    return ApiError(404, "not_found", f"no {what} named {key!r}")


def conflict(message: str) -> ApiError:
    return ApiError(409, "conflict", message)


def replica_id_for(url: str) -> str:
    import hashlib

    return "r-" + hashlib.sha256(url.encode()).hexdigest()[:10]


class Controller:
    def __init__(self, cfg: ControllerConfig, store: Store, dns: DnsHook | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.dns = dns
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._fails: dict[tuple[str, str], int] = {}
        self._oks: dict[tuple[str, str], int] = {}
        self.latest: dict[str, Obj] = {}
        self.started = time.time()
        self._session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task[None] | None = None
        self._dns_task: asyncio.Task[None] | None = None
        self.dns_last: dict[str, Any] | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, probe: bool = True) -> None:
        await self.store.ping()
        self._session = aiohttp.ClientSession(
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
        return [v for _, v in sorted((await self.store.all(kind)).items())]

    async def get(self, kind: str, key: str, what: str) -> Obj:
        obj = await self.store.get(kind, key)
        if obj is None:
            raise not_found(what, key)
        return obj

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
    async def register_balancer(self, body: BalancerIn) -> Obj:
        from skymesh.policies import PolicyConfigError, build_policy

        if body.policy is not None:
            try:
                build_policy(body.policy, body.policy_params)
            except PolicyConfigError as exc:
                raise ApiError(422, "invalid_policy", f"policy: {exc}") from None
        async with self._lock:
            if await self.store.get("regions", body.region) is None:
                raise ApiError(422, "unknown_region", f"region: no region named {body.region!r}")
            old = await self.store.get("balancers", body.id) or {}
            obj = body.model_dump()
            obj["state"] = old.get("state", "unknown")
            obj["registered_at"] = old.get("registered_at", time.time())
            if body.policy is None and "policy" in old:  # re-registration keeps a set policy
                obj["policy"], obj["policy_params"] = old["policy"], old.get("policy_params", {})
            await self._apply_balancers({body.id: obj})
        return obj

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
        for rid, target in placement.assignments(balancers, replicas, regions).items():
            rep = replicas[rid]
            if rep.get("assigned") != target:
                log.info("replica %s (%s): balancer %s -> %s", rid, rep["url"],
                         rep.get("assigned"), target)
                rep["assigned"] = target
                puts.append(("replicas", rid, rep))
        return puts

    # -- replicas --------------------------------------------------------------------------
    async def add_replica(self, body: ReplicaIn) -> Obj:
        async with self._lock:
            if await self.store.get("regions", body.region) is None:
                raise ApiError(422, "unknown_region", f"region: no region named {body.region!r}")
            balancers = await self.store.all("balancers")
            home = body.balancer or placement.home_for(body.region, balancers)
            if body.balancer is not None and body.balancer not in balancers:
                raise ApiError(422, "unknown_balancer",
                               f"balancer: no balancer named {body.balancer!r}")
            rid = body.id or replica_id_for(body.url)
            replicas = await self.store.all("replicas")
            for other in replicas.values():
                if other["url"] == body.url and other["id"] != rid:
                    raise conflict(f"url {body.url} is already replica {other['id']!r}")
            old = replicas.get(rid, {})
            obj = body.model_dump()
            obj.update(id=rid, balancer=home, state=old.get("state", "unknown"),
                       assigned=old.get("assigned"))
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
        async with self._lock:
            obj = await self.get("replicas", rid, "replica")
            if on:
                obj["state"] = "draining"
            elif obj["state"] == "draining":
                obj["state"] = "unknown"  # the next probe decides
            await self._commit([("replicas", rid, obj)])
        return obj

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
        me = await self.get("balancers", bid, "balancer")
        balancers = await self.store.all("balancers")
        replicas = await self.store.all("replicas")
        mine = [{k: r[k] for k in ("id", "url", "model", "gpu", "kind", "region", "balancer")}
                for r in sorted(replicas.values(), key=lambda r: r["id"])
                if r.get("assigned") == bid and placement.serving(r)]
        peers = [{"id": b["id"], "region": b["region"], "url": b["url"],
                  "peer_address": b.get("peer_address")}
                 for b in sorted(balancers.values(), key=lambda b: b["id"])
                 if b["id"] != bid and placement.live(b)]
        return {"revision": rev, "balancer": bid, "state": me.get("state", "unknown"),
                "policy": me.get("policy"), "policy_params": me.get("policy_params", {}),
                "replicas": mine, "peers": peers}

    async def report(self, bid: str, body: TelemetryIn) -> None:
        me = await self.get("balancers", bid, "balancer")
        sample = body.model_dump()
        sample.update(ts=time.time(), balancer=bid, region=me["region"])
        await self.store.append(f"balancer:{bid}", sample, self.cfg.telemetry_keep)
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
            async with self._session.get(url + "/health") as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def _judge(self, key: tuple[str, str], ok: bool, current: str, up: str, down: str) -> str:
        """Consecutive-result thresholds, so one lost probe does not move replicas."""
        p = self.cfg.probe
        if ok:
            self._fails[key] = 0
            self._oks[key] = self._oks.get(key, 0) + 1
            return up if current != up and self._oks[key] >= p.success_threshold else current
        self._oks[key] = 0
        self._fails[key] = self._fails.get(key, 0) + 1
        return down if current != down and self._fails[key] >= p.failure_threshold else current

    async def probe_once(self) -> None:
        balancers = await self.store.all("balancers")
        replicas = await self.store.all("replicas")
        b_ok, r_ok = await asyncio.gather(
            asyncio.gather(*(self._healthy(b["url"]) for b in balancers.values())),
            asyncio.gather(*(self._healthy(r["url"]) for r in replicas.values())))
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
