"""Balancer telemetry: reports taken in within bounds, a history bounded in count and
bytes per balancer (the store's ``balancer:<id>`` series), and the newest of each.

A report is refused when it names more than ``telemetry_max_models`` models (422) or
is larger than ``telemetry_max_bytes`` (413), so one agent token cannot make the
controller keep more than ``telemetry_balancer_bytes`` for each balancer it owns.
"""

from __future__ import annotations

import json
import time

from skymesh_controller.auth import Principal
from skymesh_controller.config import ControllerConfig
from skymesh_controller.errors import ApiError, invalid_field, not_found
from skymesh_controller.models import TelemetryIn
from skymesh_controller.records import ADMIN, may_modify, not_owner
from skymesh_controller.refusals import Refusals
from skymesh_controller.store import Obj, Store


def keep_for(size: int, keep: int, budget: int) -> int:
    """How many reports of ``size`` bytes a balancer's history keeps. The size is rounded
    up to a power of two so the count kept does not change every report."""
    rounded = 1 << (size - 1).bit_length()
    return max(1, min(keep, budget // rounded))


class Telemetry:
    def __init__(self, cfg: ControllerConfig, store: Store, refused: Refusals) -> None:
        self.cfg, self.store, self.refused = cfg, store, refused
        self.latest: dict[str, Obj] = {}  # balancer id -> its newest report

    async def report(self, bid: str, body: TelemetryIn, who: Principal = ADMIN) -> None:
        me = await self.store.get("balancers", bid)
        if me is None:
            raise not_found("balancer", bid)
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
        keep = keep_for(size, cfg.telemetry_keep, cfg.telemetry_balancer_bytes)
        await self.store.append(f"balancer:{bid}", sample, keep)
        self.latest[bid] = sample

    async def samples(self, balancer: str | None, region: str | None, limit: int
                      ) -> list[Obj]:
        """The newest ``limit`` reports, oldest first, of one balancer or region or all."""
        names = [s for s in await self.store.series() if s.startswith("balancer:")]
        out: list[Obj] = []
        for s in names:
            if balancer is not None and s != f"balancer:{balancer}":
                continue
            out += [x for x in await self.store.tail(s, limit)
                    if region is None or x.get("region") == region]
        out.sort(key=lambda x: x["ts"])
        return out[-limit:]
