"""Moving a replica from one endpoint to another: drain, wait until idle, re-register.

A plan that takes a replica from (model, region, GPU) A and gives one to B on the same GPU
type moves it (decide.pair_moves) when the actuator can (actuators.Mover): the local one
re-registers the same process under another region, or restarts it with the other model.
One move, run by :class:`MoveRunner`:

1. **Drain**: the replica's record turns ``draining`` (the ``POST .../drain`` path). It
   leaves every balancer's membership at the next long poll; the balancers dispatch
   nothing new to it and let the requests they have on it finish.
2. **Wait until idle**, polling every ``drain_poll_s`` (:class:`DrainWatch`, pure): idle
   is (a) every balancer that served the replica has long-polled again with the drain's
   revision or a later one, so it applied the membership without the replica, and then
   (b) the replica's own ``/metrics`` shows running + waiting = 0 on two polls in a row.
   The replica's count is the real one: it covers every balancer and any direct client,
   while balancer telemetry carries one in-flight total per balancer, not per replica,
   and lags by its report interval. The second quiet poll covers a request a balancer
   picked just before it applied the drain and that was still on its way.
3. **Re-register**: the actuator readies the replica for B (a new process for a model
   change), then one commit gives the record B's model and region, a home balancer there
   and ``unknown`` state (the probe decides; ``unknown`` serves), so B's balancers take it
   at their next long poll. Then the actuator lets the old process go.

Never half-applied: a drain that does not go idle by ``drain_timeout_s``, or a step that
fails, undrains the replica where it was (and stops a process started for B), so the store
holds the replica at A or at B, never between. The planner reports the failed move on
both keys and retries it on the cooldowns (guard.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from skymesh_controller.autopilot.actuators import Mover
from skymesh_controller.planning.ilp import Key
from skymesh_controller.relocation import Relocations

log = logging.getLogger("skymesh.controller.planner")

WAITING, IDLE, TIMEOUT = "waiting", "idle", "timeout"
QUIET_POLLS = 2  # idle observations in a row that make a drain idle

Actuate = Callable[..., Awaitable[Any]]


@dataclass
class DrainWatch:
    """One drain's state machine, on the caller's clock: feed it one observation per poll.

    ``acked``: every balancer serving the replica applied the drain; ``busy``: running +
    waiting on the replica (None: unreadable, which never counts as idle)."""

    deadline: float
    quiet_needed: int = QUIET_POLLS
    quiet: int = 0
    polls: int = 0

    def observe(self, now: float, acked: bool, busy: int | None) -> str:
        self.polls += 1
        if acked and busy == 0:
            self.quiet += 1
            if self.quiet >= self.quiet_needed:
                return IDLE
        else:
            self.quiet = 0  # a request seen again: the next quiet run starts over
        return TIMEOUT if now >= self.deadline else WAITING


@dataclass
class MoveResult:
    src: Key
    dst: Key
    replica: str | None
    outcome: str  # moved | timeout | failed | no-replica
    seconds: float = 0.0
    error: str | None = None
    last_busy: int | None = field(default=None, repr=False)

    def row(self) -> dict[str, Any]:
        return {"replica": self.replica, "from": _obj(self.src), "to": _obj(self.dst),
                "outcome": self.outcome, "seconds": round(self.seconds, 3),
                "error": self.error}


def _obj(key: Key) -> dict[str, str]:
    return {"model": key[0], "region": key[1], "gpu": key[2]}


class MoveRunner:
    """Runs moves against the controller's relocation part (``moves``) and the
    actuator's mover."""

    def __init__(self, moves: Relocations, mover: Mover, actuate: Actuate, *,
                 clock: Callable[[], float], timeout_s: float, poll_s: float,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.moves, self.mover, self.actuate = moves, mover, actuate
        self.clock, self.sleep = clock, sleep
        self.timeout_s, self.poll_s = timeout_s, poll_s

    async def pick(self, src: Key, taken: set[str]) -> str | None:
        """A replica of ``src`` to move: the actuator's order, serving, not yet taken."""
        replicas = await self.moves.store.all("replicas")
        for rid in await self.actuate(self.mover.movable, src):
            rec = replicas.get(rid)
            if rid not in taken and rec is not None and rec.get("state") != "draining":
                taken.add(rid)
                return rid
        return None

    async def run(self, rid: str, src: Key, dst: Key) -> MoveResult:
        t0 = time.perf_counter()
        res = MoveResult(src, dst, rid, "failed")
        try:
            if await self.moves.move_home(rid, dst[1]) is None:
                # Checked before the drain too: no point emptying a replica for nowhere.
                res.error = f"region {dst[1]!r} has no balancer that may serve it"
                return res
            rev = await self.moves.begin_drain(rid)
            log.info("move %s %s -> %s: draining (revision %d)", rid, src, dst, rev)
            if await self._wait_idle(rid, rev, res):
                await self._reregister(rid, src, dst, res)
        except Exception as exc:  # the store or the actuator failed: roll back below
            log.exception("move of %s failed", rid)
            res.outcome, res.error = "failed", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if res.outcome != "moved":
                await self._undrain(rid)
            res.seconds = time.perf_counter() - t0
        return res

    async def _wait_idle(self, rid: str, rev: int, res: MoveResult) -> bool:
        watch = DrainWatch(self.clock() + self.timeout_s)
        while True:
            rec = await self.moves.store.get("replicas", rid)
            if rec is None:
                res.error = "the replica was deregistered while it drained"
                return False
            acked = await self.moves.drain_applied(rid, rev)
            # The replica is asked only once no balancer can send it anything new.
            busy = await self.moves.replica_busy(rec["url"]) if acked else None
            res.last_busy = busy
            state = watch.observe(self.clock(), acked, busy)
            if state == IDLE:
                return True
            if state == TIMEOUT:
                res.outcome = "timeout"
                res.error = (f"not idle after {self.timeout_s:.0f}s (drain_timeout_s): "
                             + ("running + waiting " + str(busy) if acked else
                                "a balancer has not applied the drain"))
                return False
            await self.sleep(self.poll_s)

    async def _reregister(self, rid: str, src: Key, dst: Key, res: MoveResult) -> None:
        url = await self.actuate(self.mover.prepare_move, rid, src, dst)
        try:
            await self.moves.move_replica(rid, model=dst[0], region=dst[1], url=url)
        except BaseException:
            await self.actuate(self.mover.abort_move, rid)
            raise
        res.outcome = "moved"  # the store says B now, whatever happens next
        log.info("move %s %s -> %s: re-registered at %s", rid, src, dst, url)
        try:
            # The actuator's books follow the store, and a replaced process goes.
            await self.actuate(self.mover.finish_move, rid, src, dst)
        except Exception as exc:
            log.exception("move of %s: the old process did not stop cleanly", rid)
            res.error = f"after the move: {type(exc).__name__}: {exc}"[:300]

    async def _undrain(self, rid: str) -> None:
        try:
            rec = await self.moves.store.get("replicas", rid)
            if rec is not None and rec.get("state") == "draining":
                await self.moves.undrain(rid)
        except Exception:
            log.exception("undrain of %s after a failed move failed", rid)
