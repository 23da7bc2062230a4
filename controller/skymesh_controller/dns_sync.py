"""Keeping DNS in step with the balancers: ``POST /v1/dns/sync``, and a sync after every
probe round that changed a balancer's state (``dns.auto_sync``), one at a time.

The hook (dns_hook.py: Route53) gets the balancers and regions the API can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from skymesh_controller.config import ControllerConfig
from skymesh_controller.errors import ApiError
from skymesh_controller.records import Records
from skymesh_controller.store import Obj

log = logging.getLogger("skymesh.controller")

DnsHook = Callable[[list[Obj], list[Obj], bool], Awaitable[dict[str, Any]]]


class DnsSync:
    def __init__(self, cfg: ControllerConfig, hook: DnsHook | None, records: Records) -> None:
        self.cfg, self.hook, self.records = cfg, hook, records
        self.last: dict[str, Any] | None = None  # the newest applied sync, for /v1/status
        self.task: asyncio.Task[None] | None = None
        self.acts: Callable[[], bool] = lambda: True  # the leader lease (leadership.py)

    async def sync(self, dry_run: bool) -> dict[str, Any]:
        if self.hook is None:
            raise ApiError(409, "dns_not_configured",
                           "DNS is not configured (add a dns section to the controller config)")
        report = await self.hook(await self.records.list_kind("balancers"),
                                 await self.records.list_kind("regions"), dry_run)
        if not dry_run:
            self.last = {"at": time.time(), **report}
        return report

    def schedule(self) -> None:
        if self.hook is None or (self.cfg.dns is not None and not self.cfg.dns.auto_sync):
            return
        if self.task is not None and not self.task.done():
            return
        if not self.acts():  # only the leader syncs on its own
            return

        async def run() -> None:
            try:
                await self.sync(dry_run=False)
            except Exception:
                log.exception("automatic DNS sync failed")

        self.task = asyncio.create_task(run(), name="controller-dns")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
