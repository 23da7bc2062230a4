"""The live side of ``skymesh.balancer.tenancy``: a generation request's tenant and class,
its limits, and its wait in the fair queue, on the event loop.

The handler calls :meth:`TenantGate.classify` (tenant and class), :meth:`TenantGate.admit`
(429 over a limit), then :meth:`TenantGate.wait_turn` (the fair queue; False at the queue
timeout), offers the request to the dispatcher and calls :meth:`TenantGate.settle`; its
``finally`` calls
:meth:`TenantGate.leave` whatever happened. The balancer's pump calls
:meth:`TenantGate.release`, which wakes the next waiters while the dispatcher's queue
for their model is short (``tenants.dispatch_queue``). A waiter whose client left or whose
time ran out is taken out of the queue, and a waiter woken but never offered gives its
place back in ``leave``: nothing stays behind.

With a controller, :meth:`TenantGate.set_pushed` takes the tenants it pushes with
membership (``skymesh.balancer.tenant_push`` merges them with ``lb.yaml``'s) and swaps
the book and the limiter between two requests; the fair queue and its waiters stay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.errors import NoHealthyReplica
from skymesh.balancer.metrics import TenantMetrics
from skymesh.balancer.overload import stranded_line
from skymesh.balancer.tenancy import (
    Slots,
    Waiter,
    book_of,
    queue_of,
    release_into,
    reserve_of,
    tenants_of,
)
from skymesh.balancer.tenant_limits import Limiter, TenantLimited
from skymesh.balancer.tenant_push import limiter_of, merge, show_shares

log = logging.getLogger(__name__)
LOG_EVERY_S = 60.0


@dataclass(eq=False)
class Admission:
    tenant: str
    cls: str
    model: str
    prompt_tokens: int
    request_id: str = ""
    waiter: Waiter | None = None
    given_back: bool = False  # its place among the woken (TenantGate.reserved)
    left: bool = False


class TenantGate:
    def __init__(self, cfg: TenantsConfig, *, share: int, capacity: int,
                 queued: Callable[[str], int], metrics: TenantMetrics,
                 clock: Callable[[], float], wall: Callable[[], float] = time.time,
                 slots: Slots | None = None, workers: int = 1) -> None:
        self.cfg = cfg  # lb.yaml's section (the controller's tenants are merged into it)
        self.share = share
        self.workers = workers  # a pushed share is this balancer's: split among them
        self.pushed: list[Any] | None = None  # as the controller last sent them
        self.book = book_of(cfg)
        self.limiter = Limiter(tenants_of(cfg), share=share, now=clock())
        self.queue = queue_of(cfg, capacity, clock())
        self.bound = cfg.dispatch_queue
        self.queued = queued  # the dispatcher's queue length for a model
        self.metrics = metrics
        self.clock = clock
        self.wall = wall
        self.reserved: dict[str, int] = {}  # woken per model, not yet offered
        self.reserve = reserve_of(cfg)
        self.slots = slots  # the replicas' free slots per model (Dispatcher.slots)
        self.logged_at = -LOG_EVERY_S  # the reserve's last log line

    def set_pushed(self, tenants: Sequence[Mapping[str, Any]]) -> bool:
        """The controller's tenants, each with its ``share`` (False: the same as last)."""
        pushed = [dict(t) for t in tenants]
        if pushed == self.pushed:
            return False
        self.pushed = pushed
        merged = merge(self.cfg, pushed)
        # Built whole, then swapped: a request sees the old book and limiter or the new.
        book = book_of(merged.cfg)
        self.limiter = limiter_of(merged, self.share, self.clock(), self.limiter,
                                  workers=self.workers)
        show_shares(self.metrics.share, merged, self.workers)
        self.book = book
        self.queue.weights = {t.name: t.weight for t in merged.cfg.members}
        return True

    def classify(self, digest: bytes | None, headers: Mapping[str, str],
                 peer_ip: str | None) -> tuple[str, str]:
        """The request's (tenant, class); 400 for a class or trusted tenant that is none."""
        tenant = self.book.tenant_of(digest, headers, peer_ip)
        return tenant.name, self.book.class_of(tenant, headers)

    def admit(self, tenant: str, cls: str, model: str, prompt_tokens: int,
              request_id: str = "") -> Admission:
        """Past the tenant's limits (:class:`TenantLimited`, a 429, otherwise)."""
        try:
            self.limiter.admit(tenant, prompt_tokens, self.clock(), self.wall())
        except TenantLimited as exc:
            self.metrics.limited.labels(tenant, cls, exc.reason).inc()
            raise
        self.metrics.admitted.labels(tenant, cls).inc()
        return Admission(tenant, cls, model, prompt_tokens, request_id)

    async def wait_turn(self, adm: Admission, timeout: float) -> bool:
        """Wait in the fair queue until released (True) or ``timeout`` (False)."""
        now = self.clock()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        w = adm.waiter = Waiter(adm.model, adm.tenant, adm.cls, adm.prompt_tokens, now, fut,
                                request_id=adm.request_id)
        self.queue.push(w)  # Overloaded when full
        self.release(now)
        if not fut.done():
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError:
                pass
            finally:
                # Timed out or cancelled (client gone) while waiting: out of the queue.
                self.queue.remove(w)
                self.metrics.waiting.set(self.queue.waiting)
        if not fut.done():
            return False
        fut.result()  # raises fail_stranded's error
        self.metrics.queue_wait.labels(adm.tenant, adm.cls).observe(self.clock() - now)
        return True

    def release(self, now: float) -> None:
        held: set[str] = set()
        for w in release_into(self.queue, self.queued, self.reserved, self.bound, now,
                              reserve=self.reserve, slots=self.slots, held_out=held):
            fut: asyncio.Future[None] = w.payload
            if fut.done():  # cannot happen: a done waiter is out of the queue
                continue
            fut.set_result(None)
            self.reserved[w.model] = self.reserved.get(w.model, 0) + 1
        for cls in held:
            self.metrics.reserve_held.labels(cls).inc()
        if held and now - self.logged_at >= LOG_EVERY_S:
            # At most once a minute: under a flood it bites on nearly every pump.
            self.logged_at = now
            log.warning("slot reserve: holding class %s back while the replicas' free "
                        "slots are kept for better classes (tenants.reserve; counted in "
                        "skymesh_tenant_reserve_held_total)", ", ".join(sorted(held)))
        self.metrics.waiting.set(self.queue.waiting)

    def fail_stranded(self, servable: Callable[[str], bool],
                      error: Callable[[str], NoHealthyReplica]) -> None:
        """Waiters for a model nothing up serves get ``error(model)`` (a 503) now, not
        at the queue timeout, as the dispatcher's queue does, and the same log line."""
        for model in self.queue.models():
            if servable(model):
                continue
            ids: list[str] = []
            first: NoHealthyReplica | None = None
            for w in self.queue.drain(model):
                fut: asyncio.Future[None] = w.payload
                if not fut.done():
                    fut.set_exception(exc := error(model))
                    first = first or exc
                    ids.append(w.request_id)
            if first is not None:  # the access log has the 503s: why
                log.warning("%s", stranded_line(model, ids, first))
        self.metrics.waiting.set(self.queue.waiting)

    def _release_reservation(self, adm: Admission) -> None:
        w = adm.waiter
        if w is None or not w.payload.done() or w.payload.exception() is not None \
                or adm.given_back:
            return
        adm.given_back = True  # never twice
        left = self.reserved.get(adm.model, 0) - 1
        if left > 0:
            self.reserved[adm.model] = left
        else:
            self.reserved.pop(adm.model, None)

    def settle(self, adm: Admission) -> None:
        """The woken request is in the dispatcher's queue (or was refused there)."""
        self._release_reservation(adm)

    def leave(self, adm: Admission, tokens: int) -> None:
        """The request ended, with ``tokens`` served (prompt + output)."""
        if adm.left:
            return
        adm.left = True
        self._release_reservation(adm)
        output = max(0, tokens - adm.prompt_tokens)
        if adm.waiter is not None:
            self.queue.remove(adm.waiter)
            self.queue.finished(adm.waiter, self.clock(), output)
        self.limiter.release(adm.tenant, tokens, adm.prompt_tokens, self.clock(), self.wall())
        if output:
            self.queue.charge(adm.tenant, output)
        if tokens:
            self.metrics.tokens.labels(adm.tenant, adm.cls).inc(tokens)


__all__ = ["Admission", "TenantGate"]
