"""Which balancer serves which replica, what each balancer is told, and what it applied.

``reassign`` turns a change of balancers or replicas into the replica records to rewrite
(placement.py decides: home balancer, else failover by distance, within what owners
trust); ``view`` is one balancer's membership, the answer to its long poll; ``note_poll``
and ``applied`` keep the newest revision each balancer long-polled after, which is the
membership it has applied (a move waits for it before it trusts a replica's idle count);
``tenants_for`` is the tenants part of a view alone, the answer to a telemetry report
(their fractions follow the demand the balancers report: tenants.py).
"""

from __future__ import annotations

import logging
import time

from skymesh_controller import placement, tenants
from skymesh_controller.records import Records
from skymesh_controller.store import Obj, Put, Store

log = logging.getLogger("skymesh.controller")


class Membership:
    # The newest reports read per balancer for its workers' tenant demand, and how long
    # what was read serves other views (every long poll and report asks for all of it).
    DEMAND_TAIL = 32
    DEMAND_CACHE_S = 1.0

    def __init__(self, store: Store, records: Records, trust: placement.Trust, *,
                 share_floor: float = tenants.DEFAULT_FLOOR,
                 demand_stale_s: float = 20.0) -> None:
        self.store, self.records, self.trust = store, records, trust
        self.share_floor, self.demand_stale_s = share_floor, demand_stale_s
        self.polled: dict[str, int] = {}
        # balancer -> (monotonic time read, its demand per tenant; None: an older one)
        self._demand: dict[str, tuple[float, dict[str, tuple[float, float]] | None]] = {}

    async def reassign(self, balancers: dict[str, Obj],
                       replicas: dict[str, Obj] | None = None) -> list[Put]:
        """The replica records whose serving balancer changes with ``balancers`` (and
        ``replicas``, the stored ones when not given), updated in place."""
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

    async def view(self, bid: str) -> Obj:
        rev = await self.store.revision()
        me = await self.records.read("balancers", bid, "balancer")
        balancers = await self.store.all("balancers")
        replicas = await self.store.all("replicas")
        # kv_events: records stored before it have none.
        mine = [{**{k: r[k] for k in ("id", "url", "model", "gpu", "kind", "region",
                                      "balancer")}, "kv_events": r.get("kv_events")}
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
        pushed = await self._tenants(me, balancers)
        return {"revision": rev, "balancer": bid, "state": me.get("state", "unknown"),
                "policy": me.get("policy"), "policy_params": me.get("policy_params", {}),
                "replicas": mine, "peers": peers, "region_balancers": 1 + siblings,
                "tenants": pushed}

    async def tenants_for(self, bid: str) -> Obj:
        """``bid``'s tenants with its fractions of their limits, and the revision they
        were read at (the balancer ignores an answer older than its membership), after a
        report of ``bid``: its demand is read again."""
        self._demand.pop(bid, None)
        rev = await self.store.revision()
        me = await self.records.read("balancers", bid, "balancer")
        return {"revision": rev,
                "tenants": await self._tenants(me, await self.store.all("balancers"))}

    async def _tenants(self, me: Obj, balancers: dict[str, Obj]) -> list[Obj]:
        """The tenants and ``me``'s part of their limits (tenants.py), split by the demand
        the live balancers reported within ``demand_stale_s`` (read from the store, so
        every controller of an HA pair computes the same)."""
        stored = await self.store.all("tenants")
        if not stored:
            return []
        ids = tenants.scopes(me, balancers)["global"]
        demand = {bid: await self._demand_of(bid) for bid in ids}
        for gone in set(self._demand) - set(balancers):
            del self._demand[gone]
        return tenants.pushed(stored, me, balancers, demand, self.share_floor)

    async def _demand_of(self, bid: str) -> dict[str, tuple[float, float]] | None:
        now = time.monotonic()
        cached = self._demand.get(bid)
        if cached is not None and now - cached[0] < self.DEMAND_CACHE_S:
            return cached[1]
        since = time.time() - self.demand_stale_s
        got = tenants.demand_of(await self.store.tail(f"balancer:{bid}", self.DEMAND_TAIL),
                                since)
        self._demand[bid] = (now, got)
        return got

    def note_poll(self, bid: str, after: int) -> None:
        self.polled[bid] = max(after, self.polled.get(bid, -1))

    async def record_poll(self, bid: str, after: int) -> None:
        """``note_poll``, and in the store too: with several controllers, the balancer
        may long-poll one that does not run the move waiting for it."""
        self.note_poll(bid, after)
        await self.store.note_max("polled", bid, after)

    async def applied(self, rid: str, rev: int) -> bool:
        """Whether every live balancer serving ``rid`` has applied membership ``rev`` or
        later. Balancers that never long-polled this process do not follow membership
        from it (or have not since it started) and are not waited for."""
        rep = await self.store.get("replicas", rid)
        if rep is None:
            return True
        balancers = await self.store.all("balancers")
        polled = await self.store.notes("polled")
        for bid, n in self.polled.items():
            polled[bid] = max(n, polled.get(bid, -1))
        return all(polled[bid] >= rev for bid, b in balancers.items()
                   if bid in polled and placement.live(b)
                   and placement.shares(bid, rep.get("assigned"), balancers))
