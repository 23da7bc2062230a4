"""Between planning rounds: the configured strategy steps each endpoint on live load.

The strategy objects are skymesh_controller.planning.strategies', the ones the simulated capacity
week runs (the lab's capacity-week experiment): this module only builds their
:class:`~skymesh_controller.planning.strategies.Observation` from the controller's view and carries
out the :class:`~skymesh_controller.planning.strategies.Action` through the planner's actuator.

Per endpoint (model, region), every tick: ``load_tps`` is the prompt + output tokens/s of
the newest report of each balancer in the region (reports older than three of their own
windows are ignored); ``utilisation`` is that load over what the running instances serve
(``capacity`` x instances, capped at 1: the balancers' telemetry carries no KV-cache
figure, so this is the simulated week's fluid signal); ``target`` is the last applied
plan's count and ``forecast_tps`` its forecast for the current window. A scale-out adds
an instance of the endpoint's most-used GPU type (the first listed when none runs); the
bounds of the ``planner:`` section clamp every step, and the planner's cooldowns
(guard.py) hold a step that would reverse a recent change.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

from skymesh_controller.autopilot.config import PlannerConfig
from skymesh_controller.autopilot.guard import Cooldowns
from skymesh_controller.autopilot.metrics import Stats
from skymesh_controller.planning.actuate import ApplyReport
from skymesh_controller.planning.ilp import Key
from skymesh_controller.planning.strategies import Observation, make_strategy
from skymesh_controller.store import Obj, Store

log = logging.getLogger("skymesh.controller.planner")


class Host(Protocol):
    """What a step needs of the planner that runs it (planner.Planner): its clock,
    cooldowns and counters, its view of the world and its records, and its actuator."""

    clock: Callable[[], float]
    guard: Cooldowns
    stats: Stats

    async def world(self) -> tuple[list[str], dict[Key, int], dict[Key, int]]: ...

    async def records(self) -> list[Obj]: ...

    async def registered(self) -> dict[Key, int]: ...

    async def apply_counts(self, counts: dict[Key, int], registered: dict[Key, int]
                           ) -> ApplyReport: ...


class StrategyStepper:
    """Steps every endpoint once per ``step``; the caller holds the planner's lock."""

    def __init__(self, cfg: PlannerConfig, host: Host, store: Store) -> None:
        assert cfg.strategy is not None
        self.cfg, self.host, self.store = cfg, host, store
        cooldown = cfg.strategy_cooldown_s
        self.strategy = make_strategy(cfg.strategy) if cooldown is None \
            else make_strategy(cfg.strategy, cooldown_s=cooldown)

    async def live_load(self, now: float) -> dict[tuple[str, str], float]:
        store = self.store
        load: dict[tuple[str, str], float] = {}
        for name in await store.series():
            if not name.startswith("balancer:"):
                continue
            for s in await store.tail(name, 1):
                if now - float(s["ts"]) > 3 * float(s["window_s"]):
                    continue
                for model, st in s.get("models", {}).items():
                    tokens = int(st.get("prompt_tokens", 0)) + int(st.get("output_tokens", 0))
                    key = (model, s["region"])
                    load[key] = load.get(key, 0.0) + tokens / float(s["window_s"])
        return load

    async def last_plan(self) -> dict[str, Any] | None:
        for rec in await self.host.records():
            if rec["status"] in ("applied", "partial") and rec.get("plan"):
                return rec
        return None

    async def step(self) -> None:
        now = self.host.clock()
        regions, _, current = await self.host.world()
        load = await self.live_load(now)
        plan = await self.last_plan()
        targets: dict[tuple[str, str], int] = {}
        forecasts: dict[tuple[str, str], float] = {}
        if plan is not None:
            for c in plan["plan"]["counts"]:
                k = (c["model"], c["region"])
                targets[k] = targets.get(k, 0) + c["count"]
            w = self.cfg.schedule.window_s
            for f in plan["forecast"]:
                i = math.floor((now - f["start"]) / w)
                if 0 <= i < len(f["tokens_per_s"]):
                    forecasts[f["model"], f["region"]] = f["tokens_per_s"][i]
        for model, per_gpu in sorted(self.cfg.capacity.items()):
            for region in regions:
                await self._one(model, region, per_gpu, current, load, targets,
                                forecasts, now)

    async def _one(self, model: str, region: str, per_gpu: dict[str, float],
                   current: dict[Any, int], load: dict[tuple[str, str], float],
                   targets: dict[tuple[str, str], int],
                   forecasts: dict[tuple[str, str], float], now: float) -> None:
        p = self.host
        counts = {g: current.get((model, region, g), 0) for g in per_gpu}
        ready = sum(counts.values())
        serves = sum(per_gpu[g] * n for g, n in counts.items())
        tps = load.get((model, region), 0.0)
        util = min(1.0, tps / serves) if serves > 0 else (1.0 if tps > 0 else 0.0)
        bound = self.cfg.bound(model, region)
        obs = Observation(
            now=now, utilisation=util, load_tps=tps, ready=ready,
            target=targets.get((model, region)), forecast_tps=forecasts.get((model, region)),
            min_instances=bound.min,
            max_instances=bound.max if bound.max is not None else 1_000_000)
        act = self.strategy.decide((model, region), obs)
        if not act.delta:
            return
        # Grow the most-used GPU type, shrink the most-used one that has an instance.
        gpu = max(per_gpu, key=lambda g: (counts[g], -list(per_gpu).index(g)))
        key = (model, region, gpu)
        before = counts[gpu]
        after = max(0, before + act.delta)
        why = p.guard.admit(key, before, after, now)
        if why is not None:
            log.info("strategy step %s %+d held: %s", key, act.delta, why)
            return
        registered = await p.registered()
        try:
            report = await p.apply_counts({key: after}, registered)
        except Exception as exc:
            log.warning("strategy step %s failed: %s", key, exc)
            report = None
        if report is None or report.errors:
            p.stats.actuation_errors[model, region] = \
                p.stats.actuation_errors.get((model, region), 0) + 1
            p.guard.failed(key, now)
            return
        p.guard.changed(key, before, after, now)
        d = "out" if act.delta > 0 else "in"
        p.stats.strategy_actions[model, region, d] = \
            p.stats.strategy_actions.get((model, region, d), 0) + 1
        log.info("strategy %s: %s %s -> %d (%s)", self.strategy.name, key, d, after, act.reason)
