"""Electing the one controller that acts: the lease of lease.py, held in the store.

Every controller runs this loop. A standby tries to take the lease every
``renew_interval_s``; the leader renews it as often. On winning, the leader's loops
(probing and failover, the planner) start inside this task's context, with ``FENCE``
set to the lease's value: each of their writes carries it, and the store refuses it once
the lease is gone (store.py). On losing (renewal refused, or not answered before the
lease ran out locally) the loops stop. A clean shutdown gives the lease up at once, so a
standby need not wait for it to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

from skymesh_controller.config import HaConfig
from skymesh_controller.lease import Event, LeaseState
from skymesh_controller.store import FENCE, Store, StoreError

log = logging.getLogger("skymesh.controller")

Hook = Callable[[], Awaitable[None]]


def default_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def parse_value(value: str | None) -> dict[str, Any] | None:
    """The lease's value ``id|since|url|epoch`` as a dict (None when free)."""
    if not value:
        return None
    parts = value.split("|")
    if len(parts) != 4:
        return {"id": value, "since": None, "url": None, "epoch": None}
    ident, since, url, epoch = parts
    return {"id": ident, "since": float(since) if since else None, "url": url or None,
            "epoch": int(epoch) if epoch.isdigit() else None}


class Leadership:
    def __init__(self, store: Store, cfg: HaConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.cfg, self.clock = store, cfg, clock
        self.id = cfg.id or default_id()
        self.state = LeaseState(cfg.lease_ttl_s, cfg.renew_interval_s)
        self.value: str | None = None
        self.on_elected: list[Hook] = []
        self.on_lost: list[Hook] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def leader(self) -> bool:
        return self.state.acts(self.clock())

    def acts(self) -> bool:
        """Checked by the leader's loops before each round: the lease still holds here."""
        return self.state.acts(self.clock())

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A task of the leader's, its writes fenced by the lease held now."""
        ctx = contextvars.copy_context()
        ctx.run(FENCE.set, self.value)
        return asyncio.create_task(coro, name=name, context=ctx)

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """Writes in the block carry the lease held now (an API call the leader acts on)."""
        token = FENCE.set(self.value)
        try:
            yield
        finally:
            FENCE.reset(token)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="controller-lease")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        value = self.value
        if self.state.resign() == "lost":
            await self._run(self.on_lost)
            if value is not None:
                with contextlib.suppress(StoreError):
                    await self.store.lease_release(value)
                log.info("leader lease released (shutdown)")

    async def _loop(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.state.wait_s(self.clock()))

    async def step(self) -> None:
        """One acquire or renewal, and what follows from its answer."""
        st = self.state
        await self._on(st.expire(self.clock()), "its lease ran out before a renewal came back")
        sent = self.clock()
        ttl_ms = int(self.cfg.lease_ttl_s * 1000)
        try:
            if st.next_action() == "acquire":
                prefix = f"{self.id}|{time.time():.3f}|{self.cfg.advertise_url or ''}|"
                got = await self.store.lease_acquire(prefix, ttl_ms)
                if got is not None:
                    self.value = got[1]
                await self._on(st.acquired(sent, None if got is None else got[0]), "")
            else:
                assert self.value is not None
                ok = await self.store.lease_renew(self.value, ttl_ms)
                await self._on(st.renewed(sent, ok), "another controller holds the lease")
        except StoreError as exc:
            await self._on(st.unreachable(self.clock()), f"the store did not answer: {exc}")

    async def _on(self, event: Event, why: str) -> None:
        if event == "elected":
            FENCE.set(self.value)  # inherited by every task the hooks start from here
            log.warning("leader: %s won the lease (epoch %d)", self.id, self.state.epoch)
            await self._run(self.on_elected)
        elif event == "lost":
            FENCE.set(None)
            log.warning("standing down: %s (%s)", self.id, why)
            self.value = None
            await self._run(self.on_lost)

    async def _run(self, hooks: list[Hook]) -> None:
        for hook in hooks:
            try:
                await hook()
            except Exception:  # one part failing to start or stop must not stop the rest
                log.exception("leadership hook %s failed", getattr(hook, "__name__", hook))

    async def info(self) -> dict[str, Any]:
        """The lease as the store holds it, for ``/v1/status`` and ``/metrics``."""
        value, ttl_ms = await self.store.lease()
        holder = parse_value(value)
        since = holder.get("since") if holder else None
        return {"id": self.id, "role": "leader" if self.leader else "standby",
                "leader": holder and holder["id"], "leader_url": holder and holder["url"],
                "epoch": holder and holder["epoch"],
                "lease_age_s": None if since is None else max(0.0, time.time() - since),
                "lease_ttl_left_s": ttl_ms / 1000 if holder else None,
                "elections": self.state.elections, "stood_down": self.state.losses}
