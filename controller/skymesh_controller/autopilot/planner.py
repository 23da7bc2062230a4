"""The planner's loop and records: a round every ``interval_s``, retries and the strategy
in between, every round kept in the state store.

A round (decide.py does the thinking) reads the telemetry, registered replicas, regions
and declared models from the store, asks the actuator what runs now, and records
``{id, ts, mode, status, reason, inputs, forecast, plan, changes, held, actions}`` in
the store's ``planner:rounds`` series (a record that changes, e.g. when approved, is
appended again; the newest copy wins), so ``GET /v1/plans`` survives a restart.

Statuses: ``skipped`` (not enough telemetry, infeasible), ``no-change``, ``planned``
(dry-run, or no actuator), ``pending`` (approve mode: waits for ``POST .../approve``),
``superseded`` (a newer round came before approval), ``applied``, ``partial`` (some keys
failed: retried on the cooldowns of guard.py), ``failed``.

Applying a plan: first its moves (moves.py: replicas the diff takes from one key and
gives to another are drained, waited on and re-registered; decide.pair_moves picks them),
then the counts. A failed move fails both its keys, retried together on the cooldowns.

Between rounds, every ``tick_s``: due retries; then, in auto mode with an actuator and a
``strategy``, the strategy of skymesh_controller.planning.strategies (the code the simulated week
runs) steps each endpoint from its live load (strategy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client.core import Metric

from skymesh_controller.autopilot.actuators import Backend, build_backend, mover_of
from skymesh_controller.autopilot.config import PlannerConfig
from skymesh_controller.autopilot.decide import (
    RECORDED_WINDOWS,
    Decision,
    ForecastBook,
    decide,
    pair_moves,
)
from skymesh_controller.autopilot.guard import Cooldowns
from skymesh_controller.autopilot.metrics import Stats, families
from skymesh_controller.autopilot.moves import MoveResult, MoveRunner
from skymesh_controller.autopilot.strategy import StrategyStepper
from skymesh_controller.errors import ApiError
from skymesh_controller.planning.actuate import ApplyReport
from skymesh_controller.planning.ilp import Key
from skymesh_controller.service import Controller
from skymesh_controller.store import Fenced, Obj, StoreError

log = logging.getLogger("skymesh.controller.planner")
SERIES = "planner:rounds"
VERSIONS_PER_ROUND = 5  # copies a round may leave (made, applying, moves, approved, retries)
ACTING_CALLS = frozenset({"apply_counts", "prepare_move", "finish_move"})


def key_obj(key: Key) -> Obj:
    return {"model": key[0], "region": key[1], "gpu": key[2]}


def obj_key(o: Obj) -> Key:
    return (o["model"], o["region"], o["gpu"])


class Planner:
    def __init__(self, cfg: PlannerConfig, ctl: Controller, *,
                 clock: Callable[[], float] = time.time, backend: Backend | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        # The parts of the controller it uses: the store (telemetry, records, its own
        # rounds), the moves (relocation.py), and the whole as the local actuator's client
        # (it registers replicas as an operator would: actuators.InProcessClient).
        self.cfg, self.ctl = cfg, ctl
        self.store, self.moves = ctl.store, ctl.moves
        self.telemetry_keep = ctl.cfg.telemetry_keep
        self.clock, self.sleep = clock, sleep  # sleep: between a drain's idle checks
        self.backend = backend
        self.book = ForecastBook(cfg)
        self.guard = Cooldowns(cfg.cooldowns)
        self.stats = Stats()
        self.next_round_at: float | None = None
        self._retrying: dict[Key, tuple[str, int, int]] = {}  # key -> (plan id, before, after)
        self._lock = asyncio.Lock()
        # Held by the worker thread around every actuator call: a cancelled await leaves
        # its thread running, and close() at shutdown must not race it.
        self._backend_lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        self.stepper = StrategyStepper(cfg, self, self.store) if cfg.strategy else None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, loop_task: bool = True) -> None:
        if self.backend is None:
            self.backend = build_backend(self.cfg.actuator, self.ctl, asyncio.get_running_loop())
        lead = getattr(self.ctl, "leadership", None)
        if not loop_task or lead is None:
            await self._recall()
            self.next_round_at = self.clock() + self.cfg.schedule.first_round_s
            if loop_task:
                self._task = asyncio.create_task(self._loop(), name="controller-planner")
            return
        # Only the leader plans (leadership.py): from each election, in the lease's
        # context, it first settles what a previous leader left half done.
        lead.on_elected.append(self._lead)
        lead.on_lost.append(self._stand_down)
        if lead.leader:
            await self._lead()

    async def _lead(self) -> None:
        if self._task is not None and not self._task.done():
            return
        self._task = self.ctl.leadership.spawn(self._led(), "controller-planner")

    async def _led(self) -> None:
        await self._recall()
        self.next_round_at = self.clock() + self.cfg.schedule.first_round_s
        await self._loop()

    async def _stand_down(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def acts(self) -> bool:
        """Whether this controller may act (leads, or stands alone)."""
        lead = getattr(self.ctl, "leadership", None)
        return lead is None or lead.leader

    async def _recall(self) -> None:
        """Rebuild the cooldowns from the recorded rounds: a restarted controller must not
        reverse a change it made minutes before it went down."""
        try:
            recs = await self.records()
        except StoreError:
            log.warning("planner: rounds not readable at start-up; cooldowns start empty")
            return
        for rec in reversed(recs):  # oldest first
            before = {obj_key(c): c["before"] for c in rec["changes"]}
            for act in rec["actions"]:
                for c in act["changed"]:
                    k = obj_key(c)
                    if k in before:
                        self.guard.changed(k, before[k], c["count"], act["ts"])
        try:
            for rec in recs:
                await self._interrupted(rec)
        except StoreError:
            log.warning("planner: could not undrain the replicas of interrupted moves")

    async def _interrupted(self, rec: Obj) -> None:
        """Moves a stop (or a lost leader) cut short: a replica whose re-registration
        landed stays moved; one still draining is undrained where it is (the store never
        holds a replica between two endpoints, and no move is run twice). The round is
        not resumed as such: the next round plans from what runs then, with absolute
        counts, so nothing it did is applied twice."""
        cut = [m for m in rec.get("moves", []) if m["state"] == "draining"]
        if not cut:
            if rec["status"] == "applying":  # stopped while the actuator applied it
                rec["status"] = "failed"
                rec["reason"] = ("the controller stopped while applying this round; the "
                                 "next round plans from what runs then")
                log.warning("planner round %s: %s", rec["id"], rec["reason"])
                await self.save(rec)
            return
        undrained = landed = 0
        for m in cut:
            rep = await self.store.get("replicas", m["replica"])
            if (rep is not None and rep.get("state") != "draining"
                    and (rep.get("model"), rep.get("region")) == (m["to"]["model"],
                                                                  m["to"]["region"])):
                m["state"] = "moved"  # its one commit landed before the stop
                landed += 1
                continue
            m["state"] = "planned"
            if rep is not None and rep.get("state") == "draining":
                await self.moves.undrain(m["replica"])
                undrained += 1
        if rec["status"] == "applying":
            rec["status"] = "failed"
        rec["reason"] = (f"the controller stopped while its moves ran: {undrained} undrained "
                         f"where they were, {landed} had moved")
        log.warning("planner round %s: %s", rec["id"], rec["reason"])
        await self.save(rec)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.backend is not None:
            # Local replicas are this process's children: deregister and stop them.
            await self.actuate(self.backend.close)

    async def actuate(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call the (blocking) actuator in a worker thread, one call at a time. A call
        that changes the world waits for no lease: it is made only while this controller
        leads (an old leader's writes to the store are fenced, these cannot be)."""
        if getattr(fn, "__name__", "") in ACTING_CALLS and not self.acts():
            raise Fenced(f"{fn.__name__}: this controller no longer leads")

        def locked() -> Any:
            with self._backend_lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    async def apply_counts(self, counts: dict[Key, int], registered: dict[Key, int]
                           ) -> ApplyReport:
        """The actuator's ``apply_counts``, in its worker thread."""
        assert self.backend is not None
        return await self.actuate(self.backend.apply_counts, counts, registered)

    async def _loop(self) -> None:
        while True:
            if not self.acts():  # a woken leader whose lease ran out plans nothing
                return
            try:
                await self.tick()
            except Exception:  # a store outage or a solver error must not end planning
                log.exception("planner tick failed")
            await asyncio.sleep(self.cfg.schedule.tick_s)

    async def tick(self) -> None:
        now = self.clock()
        if self.next_round_at is None or now >= self.next_round_at:
            self.next_round_at = now + self.cfg.schedule.interval_s
            await self.run_round()
            return
        await self.retry_due()
        if self.stepper is not None and self.cfg.mode == "auto" and self._acts():
            async with self._lock:
                await self.stepper.step()

    def _acts(self) -> bool:
        return self.backend is not None and self.backend.kind != "none"

    # -- reading the store -----------------------------------------------------------------
    async def samples(self) -> list[Obj]:
        store = self.store
        out: list[Obj] = []
        for name in await store.series():
            if name.startswith("balancer:"):
                out += await store.tail(name, self.telemetry_keep)
        out.sort(key=lambda s: s["ts"])
        return out

    async def registered(self) -> dict[Key, int]:
        counts: dict[Key, int] = {}
        for r in (await self.store.all("replicas")).values():
            if r.get("state") != "draining" and r["model"] in self.cfg.capacity:
                k = (r["model"], r["region"], r["gpu"])
                counts[k] = counts.get(k, 0) + 1
        return counts

    async def world(self) -> tuple[list[str], dict[Key, int], dict[Key, int]]:
        """Regions, registered replicas per key, and what the actuator runs per key."""
        assert self.backend is not None
        regions = sorted(await self.store.all("regions"))
        registered = await self.registered()
        keys = [(m, r, g) for m in self.cfg.capacity for r in regions
                for g in self.cfg.capacity[m]]
        current = await self.actuate(self.backend.current, keys, registered)
        self._note_actual(current)
        return regions, registered, current

    def _note_actual(self, current: dict[Key, int]) -> None:
        actual: dict[tuple[str, str], int] = {}
        for (m, r, _), n in current.items():
            actual[m, r] = actual.get((m, r), 0) + n
        self.stats.actual = actual

    # -- records ---------------------------------------------------------------------------
    async def save(self, rec: Obj) -> None:
        await self.store.append(SERIES, rec, self.cfg.keep_rounds * VERSIONS_PER_ROUND)

    async def records(self) -> list[Obj]:
        """Newest round first, each at its latest copy."""
        raw = await self.store.tail(SERIES, self.cfg.keep_rounds * VERSIONS_PER_ROUND)
        latest: dict[str, Obj] = {}
        for rec in raw:
            latest[rec["id"]] = rec
        return sorted(latest.values(), key=lambda r: (r["ts"], r["id"]), reverse=True)

    async def record(self, pid: str) -> Obj | None:
        return next((r for r in await self.records() if r["id"] == pid), None)

    # -- a round ---------------------------------------------------------------------------
    async def run_round(self, dry_run: bool = False, trigger: str = "schedule") -> Obj:
        async with self._lock:
            t0 = time.perf_counter()
            now = self.clock()
            regions, _, current = await self.world()
            declared = await self.store.all("models")
            limits = {m: (int(d.get("min_replicas", 0)), d.get("max_replicas"))
                      for m, d in declared.items()}
            samples = await self.samples()
            decision = await asyncio.to_thread(
                decide, self.cfg, self.book, now=now, samples=samples, regions=regions,
                current=current, model_limits=limits)
            rec = self._record(now, decision, current, dry_run, trigger,
                               await self._movable(decision))
            await self._supersede()
            if rec["status"] == "applying":
                # Recorded before it acts: a leader lost mid-apply leaves its successor
                # the record to settle (_interrupted).
                await self.save(rec)
                await self._apply(rec, now, attempt=1)
            await self.save(rec)
            self._count(rec, decision)
            self.stats.last_round_ts = now
            self.stats.last_round_seconds = time.perf_counter() - t0
            log.info("planner round %s: %s", rec["id"], rec["status"])
            return rec

    async def _movable(self, d: Decision) -> dict[Key, int]:
        """Per key that shrinks, how many of its replicas the actuator could move."""
        mover = mover_of(self.backend)
        if mover is None or not self.cfg.moves:
            return {}
        return {k: len(await self.actuate(mover.movable, k))
                for k, before, after in d.changes if before > after}

    def _record(self, now: float, d: Decision, current: dict[Key, int], dry_run: bool,
                trigger: str, movable: dict[Key, int] | None = None) -> Obj:
        pid = f"plan-{int(now)}-{secrets.token_hex(3)}"
        changes, held = [], []
        for key, before, after in d.changes:
            why = self.guard.admit(key, before, after, now)
            row = {**key_obj(key), "before": before, "after": after}
            if why is None:
                changes.append(row)
            else:
                held.append({**row, "reason": why})
        held += [{"model": m, "region": r, "reason": why} for (m, r), why in d.kept]
        mover = mover_of(self.backend)
        moves = [] if mover is None or not movable else [
            {"from": key_obj(src), "to": key_obj(dst), "replica": None, "state": "planned"}
            for src, dst in pair_moves([(obj_key(c), c["before"], c["after"])
                                        for c in changes], mover.move_kinds, movable)]
        if d.skipped is not None:
            status = "skipped"
        elif not changes:
            status = "no-change"
        elif dry_run or self.cfg.mode == "dry-run" or not self._acts():
            status = "planned"
        elif self.cfg.mode == "approve":
            status = "pending"
        else:
            status = "applying"
        plan = None if d.plan is None else {
            "counts": [{**key_obj(k), "count": n} for k, n in sorted(d.plan.counts.items())],
            "objective": d.plan.objective, "status": d.plan.status,
            "solve_seconds": d.plan.solve_seconds}
        return {
            "id": pid, "ts": now, "trigger": trigger, "mode": "dry-run" if dry_run
            else self.cfg.mode, "actuator": self.backend.kind if self.backend else "none",
            "status": status, "reason": d.skipped or d.note,
            "inputs": {"window_s": self.cfg.schedule.window_s,
                       "current": [{**key_obj(k), "count": n}
                                   for k, n in sorted(current.items())],
                       "series": [{"model": m, "region": r,
                                   "start": (s.start_slot + max(0, len(s.values)
                                                                - RECORDED_WINDOWS))
                                   * self.cfg.schedule.window_s,
                                   "tokens_per_s": [round(float(v), 3)
                                                    for v in s.values[-RECORDED_WINDOWS:]]}
                                  for (m, r), s in sorted(d.series.items())]},
            "forecast": [{"model": m, "region": r, "forecaster": f.used,
                          "start": f.start_slot * self.cfg.schedule.window_s,
                          "tokens_per_s": [round(v, 3) for v in f.values],
                          "previous_error": f.error}
                         for (m, r), f in sorted(d.forecasts.items())],
            "plan": plan, "changes": changes, "moves": moves, "held": held, "actions": [],
        }

    async def _supersede(self) -> None:
        for old in await self.records():
            if old["status"] == "pending":
                old["status"] = "superseded"
                await self.save(old)

    def _count(self, rec: Obj, d: Decision) -> None:
        s = self.stats
        s.rounds[rec["status"]] = s.rounds.get(rec["status"], 0) + 1
        for (m, r), f in d.forecasts.items():
            if f.error is not None:
                s.forecast_error[m, r] = f.error
        if d.plan is not None:
            planned: dict[tuple[str, str], int] = {}
            for (m, r, _), n in d.plan.counts.items():
                planned[m, r] = planned.get((m, r), 0) + n
            s.planned = planned

    # -- applying --------------------------------------------------------------------------
    async def approve(self, pid: str, who: str) -> Obj:
        async with self._lock:
            rec = await self.record(pid)
            if rec is None:
                raise ApiError(404, "not_found", f"no plan named {pid!r}")
            if rec["status"] != "pending":
                raise ApiError(409, "plan_not_pending",
                               f"plan {pid!r} is {rec['status']}: only a pending plan "
                               "(approve mode, newest round, with changes) can be approved")
            rec["approved_by"], rec["approved_at"] = who, self.clock()
            rec["status"] = "applying"
            await self.save(rec)
            await self._apply(rec, self.clock(), attempt=1)
            await self.save(rec)
            return rec

    async def _apply(self, rec: Obj, now: float, attempt: int, only: set[Key] | None = None
                     ) -> None:
        assert self.backend is not None
        pending = [m for m in rec.get("moves", []) if m["state"] != "moved" and (
            only is None or obj_key(m["from"]) in only or obj_key(m["to"]) in only)]
        if only is not None:  # a move's two keys go together, even if one alone was due
            only = only | {obj_key(m[e]) for m in pending for e in ("from", "to")}
        rows = [c for c in rec["changes"] if only is None or obj_key(c) in only]
        moved, move_errors = await self._moves(rec, pending)
        if moved:
            now = self.clock()  # a drain takes time: cooldowns count from its end
        counts = {obj_key(c): c["after"] for c in rows if obj_key(c) not in move_errors}
        registered = await self.registered()
        try:
            # After the moves: absolute counts, so what the moves did is not done twice.
            report = await self.actuate(self.backend.apply_counts, counts, registered)
        except Exception as exc:  # the actuator's own failure: every key of this call failed
            log.exception("actuation failed")
            report = ApplyReport(errors={k: f"{type(exc).__name__}: {exc}" for k in counts})
        report.errors.update(move_errors)
        counts.update({obj_key(c): c["after"] for c in rows if obj_key(c) in move_errors})
        retry_at = None
        for c in rows:
            key = obj_key(c)
            if key in report.errors:
                self.stats.actuation_errors[key[:2]] = \
                    self.stats.actuation_errors.get(key[:2], 0) + 1
                if self.guard.failed(key, now):
                    self._retrying[key] = (rec["id"], c["before"], c["after"])
                    nxt = self.guard.retry_at(key)
                    if nxt is not None:
                        retry_at = nxt if retry_at is None else min(retry_at, nxt)
                else:
                    self._retrying.pop(key, None)
            else:
                self.guard.changed(key, c["before"], c["after"], now)
                self._retrying.pop(key, None)
        rec["actions"].append({
            "ts": now, "attempt": attempt,
            "changed": [{**key_obj(k), "count": counts[k]} for k in sorted(counts)
                        if k not in report.errors],
            "errors": [{**key_obj(k), "error": e} for k, e in sorted(report.errors.items())],
            "moves": [m.row() for m in moved],
            "retry_at": retry_at})
        failed = {obj_key(e) for a in rec["actions"][-1:] for e in a["errors"]}
        done = {obj_key(c) for a in rec["actions"] for c in a["changed"]}
        all_keys = {obj_key(c) for c in rec["changes"]}
        if not failed and done >= all_keys:
            rec["status"] = "applied"
        else:
            rec["status"] = "partial" if done else "failed"
        await self.world()  # refresh "actual" for /metrics

    async def _moves(self, rec: Obj, pending: list[Obj]) -> tuple[list[MoveResult],
                                                                   dict[Key, str]]:
        """Run the record's pending moves (at once: each waits on its own drain); the
        keys of those that failed, with why. A move with no replica to take is left to
        the counts (a stop and a start)."""
        mover = mover_of(self.backend)
        if not pending or mover is None:
            return [], {}
        runner = MoveRunner(self.moves, mover, self.actuate, clock=self.clock,
                            timeout_s=self.cfg.drain_timeout_s, poll_s=self.cfg.drain_poll_s,
                            sleep=self.sleep)
        taken: set[str] = set()
        picked = [(m, await runner.pick(obj_key(m["from"]), taken)) for m in pending]
        for m, rid in picked:
            m["replica"] = rid
            m["state"] = "draining" if rid is not None else m["state"]
        # Seen while they drain, and found by _interrupted if the controller stops now.
        await self.save(rec)
        results = await asyncio.gather(*(
            runner.run(rid, obj_key(m["from"]), obj_key(m["to"])) if rid is not None
            else _no_replica(m) for m, rid in picked))
        errors: dict[Key, str] = {}
        for (m, _), res in zip(picked, results, strict=True):
            m["state"] = "moved" if res.outcome == "moved" else "planned"
            if res.outcome not in ("moved", "no-replica"):
                why = f"move of {res.replica} to {res.dst[1]}/{res.dst[0]}: {res.error}"
                errors[res.src] = errors[res.dst] = why
        self.stats.moves.update(r.outcome for r in results)
        return list(results), errors

    async def retry_due(self) -> None:
        now = self.clock()
        due = [k for k in self.guard.due(now) if k in self._retrying]
        by_plan: dict[str, set[Key]] = {}
        for k in due:
            by_plan.setdefault(self._retrying[k][0], set()).add(k)
        for pid, keys in sorted(by_plan.items()):
            async with self._lock:
                rec = await self.record(pid)
                if rec is None or rec["status"] not in ("partial", "failed"):
                    for k in keys:
                        self._retrying.pop(k, None)
                    continue
                await self._apply(rec, now, attempt=len(rec["actions"]) + 1, only=keys)
                await self.save(rec)

    # -- metrics ---------------------------------------------------------------------------
    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        """A prometheus_client collector: /metrics registers the planner itself."""
        return families(self.stats)


async def _no_replica(m: Obj) -> MoveResult:
    return MoveResult(obj_key(m["from"]), obj_key(m["to"]), None, "no-replica",
                      error="no replica of the actuator's own to move: stop and start")
