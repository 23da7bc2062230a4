"""Connects the controller to the Route53 manager when the config has a ``dns`` section."""

from __future__ import annotations

import asyncio
from typing import Any

from skymesh_controller.config import ControllerConfig
from skymesh_controller.dns_sync import DnsHook
from skymesh_controller.store import Obj


def dns_hook(cfg: ControllerConfig) -> DnsHook | None:
    if cfg.dns is None:
        return None
    dns_cfg = cfg.dns

    async def sync(balancers: list[Obj], regions: list[Obj], dry_run: bool) -> dict[str, Any]:
        from skymesh_controller import dns

        def run() -> dict[str, Any]:
            manager = dns.Route53Manager.from_config(dns_cfg)
            desired = dns.desired_records(balancers, regions, manager.cfg)
            return manager.sync(desired, dry_run=dry_run).to_dict()

        # boto3 blocks: keep it off the event loop that serves the API.
        return await asyncio.to_thread(run)

    return sync
