"""Scaling strategies over one interface: an endpoint's observation in, an instance delta out.

An *endpoint* is one model in one region (SageServe's model deployment). Every strategy
sees the same :class:`Observation` and returns an :class:`Action`; the caller starts or
stops instances (actuation is elsewhere). All are pure apart from the small per-endpoint
memory each keeps (last scaling time, last window acted on), so tests drive them with
hand-made observations.

- ``reactive`` (SageServe sec. 4, the status quo): scale out by one when effective memory
  utilisation is over 70%, in by one under 30%, at most one event per 15 s cooldown.
- ``lt-i``: jump to the hour's ILP target as soon as it is known (sec. 6.5.1).
- ``lt-u``: the ILP sets the target, but move towards it only when utilisation says so:
  out over 70% while below target, in under 30% while above it. An observation may carry
  the endpoint's own thresholds (``scale_out_utilisation``, ``scale_in_utilisation``:
  per-model target utilisation, see ``capacity_week.target_utilisation``); LT-U and LT-UA
  then use those instead of 70% / 30%. Reactive ignores them: it is SageServe's rule.
- ``lt-ua``: LT-U, and once the target is reached, in the last 20 minutes of the hour keep
  scaling out while traffic is at least 5x the forecast, and in while at most 0.5x.
- ``preserve`` (PreServe sec. 4.3.2): at each window pre-start PreServe's N (from the
  forecast); within it, one more instance whenever the load anticipator projects an
  overloaded instance, and scale down (once per window) when the projected utilisation
  stays under 30%.

Scale-outs never exceed ``max_instances`` and scale-ins never go under ``min_instances``;
instances still starting count towards the total so a strategy does not order twice.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass

SCALE_OUT_UTILISATION = 0.70
SCALE_IN_UTILISATION = 0.30
COOLDOWN_S = 15.0
HOUR_S = 3600.0
LAST_MINUTES_S = 20 * 60.0  # LT-UA's traffic rules apply in the hour's last 20 minutes
TRAFFIC_OUT_FACTOR = 5.0
TRAFFIC_IN_FACTOR = 0.5
PRESERVE_OVERLOAD = 0.95  # projected KV usage that marks an instance potentially overloaded
PRESERVE_SCALE_DOWN = 0.30  # T_f


@dataclass(frozen=True, slots=True)
class Observation:
    """What an endpoint reports when a request arrives (or at each control tick)."""

    now: float  # seconds since the start of the run; hours start at multiples of 3600
    utilisation: float  # effective memory utilisation of the serving instances, 0..1
    load_tps: float  # observed tokens/s arriving at the endpoint
    ready: int  # instances serving
    starting: int = 0  # instances ordered and not yet serving
    target: int | None = None  # the ILP's count for this endpoint this hour
    forecast_tps: float | None = None  # forecast tokens/s for the current window
    needed: int | None = None  # PreServe's N for the coming window
    window_start: float | None = None  # start of the current forecast window (PreServe)
    projected_utilisation: float | None = None  # load anticipator's peak over look-ahead
    min_instances: int = 1
    max_instances: int = 1_000_000
    # Per-endpoint thresholds for the plan-driven strategies (None: 70% / 30%).
    scale_out_utilisation: float | None = None
    scale_in_utilisation: float | None = None

    @property
    def total(self) -> int:
        return self.ready + self.starting


@dataclass(frozen=True, slots=True)
class Action:
    delta: int  # instances to start (> 0) or stop (< 0)
    reason: str = ""


HOLD = Action(0)


class Strategy(ABC):
    """Per-endpoint memory lives in dicts keyed by the endpoint's id."""

    name: str = "base"

    def __init__(self, cooldown_s: float = COOLDOWN_S) -> None:
        self.cooldown_s = cooldown_s
        self._last_event: dict[Hashable, float] = {}

    def decide(self, endpoint: Hashable, obs: Observation) -> Action:
        act = self._decide(endpoint, obs)
        clamped = _clamp(act, obs)
        if clamped.delta:
            self._last_event[endpoint] = obs.now
        return clamped

    @abstractmethod
    def _decide(self, endpoint: Hashable, obs: Observation) -> Action: ...

    def _cooling(self, endpoint: Hashable, now: float) -> bool:
        last = self._last_event.get(endpoint)
        return last is not None and now - last < self.cooldown_s


def _clamp(act: Action, obs: Observation) -> Action:
    if act.delta > 0:
        room = obs.max_instances - obs.total
        return Action(min(act.delta, room), act.reason) if room > 0 else HOLD
    if act.delta < 0:
        # Only serving instances can be stopped; starting ones are left to finish.
        spare = min(obs.total - obs.min_instances, obs.ready)
        return Action(max(act.delta, -spare), act.reason) if spare > 0 else HOLD
    return act


class Reactive(Strategy):
    name = "reactive"

    def _decide(self, endpoint: Hashable, obs: Observation) -> Action:
        if self._cooling(endpoint, obs.now):
            return HOLD
        if obs.utilisation > SCALE_OUT_UTILISATION:
            return Action(1, "utilisation over 70%")
        if obs.utilisation < SCALE_IN_UTILISATION:
            return Action(-1, "utilisation under 30%")
        return HOLD


class LongTermImmediate(Strategy):
    name = "lt-i"

    def _decide(self, endpoint: Hashable, obs: Observation) -> Action:
        if obs.target is None or obs.target == obs.total:
            return HOLD
        return Action(obs.target - obs.total, "ILP target")


class LongTermUtilisation(Strategy):
    name = "lt-u"

    def _decide(self, endpoint: Hashable, obs: Observation) -> Action:
        if self._cooling(endpoint, obs.now) or obs.target is None:
            return HOLD
        if obs.utilisation > _out(obs) and obs.total < obs.target:
            return Action(1, "utilisation over the scale-out threshold, below ILP target")
        if obs.utilisation < _in(obs) and obs.total > obs.target:
            return Action(-1, "utilisation under the scale-in threshold, above ILP target")
        return HOLD


def _out(obs: Observation) -> float:
    return SCALE_OUT_UTILISATION if obs.scale_out_utilisation is None \
        else obs.scale_out_utilisation


def _in(obs: Observation) -> float:
    return SCALE_IN_UTILISATION if obs.scale_in_utilisation is None \
        else obs.scale_in_utilisation


class LongTermUtilisationAdjusted(LongTermUtilisation):
    name = "lt-ua"

    def _decide(self, endpoint: Hashable, obs: Observation) -> Action:
        act = super()._decide(endpoint, obs)
        if act.delta or self._cooling(endpoint, obs.now) or obs.target is None:
            return act
        if obs.now % HOUR_S < HOUR_S - LAST_MINUTES_S or not obs.forecast_tps:
            return act
        ratio = obs.load_tps / obs.forecast_tps
        if ratio >= TRAFFIC_OUT_FACTOR and obs.total >= obs.target:
            return Action(1, "last 20 min: traffic at least 5x forecast")
        if ratio <= TRAFFIC_IN_FACTOR and obs.total <= obs.target and obs.ready > 1:
            # Stop short of pushing the remaining instances over the scale-out threshold,
            # which would only trigger a scale-out right after.
            after = obs.utilisation * obs.ready / (obs.ready - 1)
            if after <= _out(obs):
                return Action(-1, "last 20 min: traffic at most 0.5x forecast")
        return act


class PreServeScaler(Strategy):
    """PreServe's proactive scaler, fed by a per-window N and the load anticipator."""

    name = "preserve"

    def __init__(self, cooldown_s: float = COOLDOWN_S) -> None:
        super().__init__(cooldown_s)
        self._window_done: dict[Hashable, float] = {}  # window start when N was applied
        self._scaled_down: dict[Hashable, float] = {}  # window start of the last scale-in

    def _decide(self, endpoint: Hashable, obs: Observation) -> Action:
        window = obs.window_start
        if obs.needed is not None and window is not None \
                and self._window_done.get(endpoint) != window:
            self._window_done[endpoint] = window
            if obs.needed != obs.total:
                return Action(obs.needed - obs.total, "window forecast N")
        proj = obs.projected_utilisation
        if proj is None:
            return HOLD
        if proj > PRESERVE_OVERLOAD and not self._cooling(endpoint, obs.now):
            return Action(1, "anticipator: potentially overloaded instance")
        if proj < PRESERVE_SCALE_DOWN and window is not None \
                and self._scaled_down.get(endpoint) != window and obs.ready > 0:
            keep = math.ceil(obs.ready * proj / PRESERVE_SCALE_DOWN)
            if keep < obs.ready:
                self._scaled_down[endpoint] = window
                return Action(keep - obs.ready, "anticipator: under 30% all look-ahead")
        return HOLD


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Reactive, LongTermImmediate, LongTermUtilisation,
                              LongTermUtilisationAdjusted, PreServeScaler)
}


def make_strategy(name: str, cooldown_s: float = COOLDOWN_S) -> Strategy:
    """``cooldown_s``: between one endpoint's scaling events (a time-compressed live demo
    shortens it with its day)."""
    try:
        return STRATEGIES[name](cooldown_s)
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
