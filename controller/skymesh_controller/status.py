"""``GET /v1/status``: the mesh at a glance, from the records and the newest telemetry,
and which controller leads (``control``: leadership.Leadership.info)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from skymesh_controller.store import Obj, Store


async def mesh_status(store: Store, latest: Mapping[str, Obj], dns_last: Obj | None,
                      started: float, leadership: Any = None) -> Obj:
    regions = await store.all("regions")
    balancers = await store.all("balancers")
    replicas = await store.all("replicas")
    out = {"revision": await store.revision(), "uptime_s": time.time() - started,
           **summary(regions, balancers, replicas, latest), "dns": dns_last}
    if leadership is not None:
        out["control"] = await leadership.info()
    return out


def summary(regions: Mapping[str, Obj], balancers: Mapping[str, Obj],
            replicas: Mapping[str, Obj], latest: Mapping[str, Obj]) -> Obj:
    per_region: dict[str, Obj] = {}
    for name in sorted(regions):
        bs = [b for b in balancers.values() if b["region"] == name]
        rs = [r for r in replicas.values() if r["region"] == name]
        tel = [latest[b["id"]] for b in bs if b["id"] in latest]
        per_region[name] = {
            "balancers": {b["id"]: b.get("state", "unknown") for b in bs},
            "replicas": len(rs),
            "replicas_healthy": sum(1 for r in rs if r.get("state") == "healthy"),
            "queue_length": sum(t["queue_length"] for t in tel),
            "in_flight": sum(t["in_flight"] for t in tel),
            "requests_per_s": sum(sum(m["requests"] for m in t["models"].values())
                                  / t["window_s"] for t in tel),
        }
    return {
        "regions": len(regions),
        "balancers": _count(balancers.values(), "state"),
        "replicas": _count(replicas.values(), "state"),
        "unassigned_replicas": sorted(r["id"] for r in replicas.values()
                                      if not r.get("assigned")),
        "moved_replicas": sorted(r["id"] for r in replicas.values()
                                 if r.get("assigned") and r["assigned"] != r["balancer"]),
        "per_region": per_region,
    }


def _count(objs: Iterable[Any], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in objs:
        out[o.get(key, "unknown")] = out.get(o.get(key, "unknown"), 0) + 1
    return out
