"""What the planner's moves (autopilot/moves.py) ask of the control plane: drain a
replica, know when every balancer serving it has applied the drain and the replica is
idle, find it a home in another region, and re-register it there in one commit.

Failures leave the store with the replica where it was: ``move_replica`` moves only a
draining replica, and only to a region with a balancer that may serve it.
"""

from __future__ import annotations

from skymesh_controller import placement
from skymesh_controller.changes import Changes
from skymesh_controller.errors import conflict
from skymesh_controller.membership import Membership
from skymesh_controller.probing import Prober
from skymesh_controller.records import ADMIN, Records
from skymesh_controller.replicas import Replicas
from skymesh_controller.store import Obj, Store


class Relocations:
    def __init__(self, store: Store, changes: Changes, records: Records, replicas: Replicas,
                 membership: Membership, prober: Prober, trust: placement.Trust) -> None:
        self.store, self.changes, self.records, self.replicas = store, changes, records, replicas
        self.membership, self.prober, self.trust = membership, prober, trust

    async def begin_drain(self, rid: str) -> int:
        """Drain ``rid`` as ``POST .../drain`` does; the revision that took it out."""
        return (await self.replicas.drain(rid, True))[1]

    async def undrain(self, rid: str) -> Obj:
        return (await self.replicas.drain(rid, False))[0]

    async def drain_applied(self, rid: str, rev: int) -> bool:
        """Every live balancer serving ``rid`` applied membership ``rev`` or later."""
        return await self.membership.applied(rid, rev)

    async def replica_busy(self, url: str) -> int | None:
        """Running + waiting requests on the replica; None when it cannot be read."""
        return await self.prober.busy(url)

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
        await self.records.check_url("url", url)
        async with self.changes.lock:
            old = await self.records.get("replicas", rid, "replica")
            if old.get("state") != "draining":
                raise conflict(f"replica {rid!r} is {old.get('state')}: only a draining "
                               "replica is moved")
            home = await self.move_home(rid, region)
            if home is None:
                raise conflict(f"region {region!r} has no balancer that may serve {rid!r} "
                               f"(owner {old.get('owner')!r})")
            fields = {**old, "model": model, "region": region, "url": url, "balancer": home}
            # "unknown" serves at once; the next probe confirms it.
            return await self.replicas.write(rid, {**old, "state": "unknown"}, fields, ADMIN)
