"""The controller's ``planner:`` section (absent: no planner; the default).

Example (every key optional except ``capacity``)::

    planner:
      mode: approve                 # dry-run (plan only) | approve (admin approves) | auto
      schedule: {interval_s: 3600, window_s: 600, horizon: 6, history_windows: 2016,
                 min_history_windows: 3, stale_windows: 2, tick_s: 15,
                 first_round_s: 60}
      forecaster: {name: arima, params: {}, retrain_every: 6, headroom: 0.2}
      capacity:                     # tokens/s one instance serves, per model and GPU type
        llama-8b: {L4: 1500, H100-80GB: 9000}   # (the GPU type picks the engine profile)
      gpus_per_instance: {llama-8b: {H100-80GB: 1}}
      gpus_available: {us: {L4: 16}}            # per region; absent: unbounded
      vm_cost: {L4: 0.8, H100-80GB: 12.0}       # per instance-hour, the ILP's alpha (1)
      bounds:                       # per model and region; "*" is every other region
        llama-8b: {"*": {min: 1, max: 8}, asia: {min: 0, max: 2}}
      epsilon: 0.5                  # SageServe's regional share of the peak
      strategy: lt-ua               # between rounds (planning.strategies); none: off
      actuator: {kind: local, local: {replica_args: ["--time-scale", "0.05"]}}
      cooldowns: {retry_s: 300, retry_max_s: 3600, max_attempts: 5, hold_s: 900}
      approvers: [capacity-ops]     # token names that may approve besides admin tokens
      moves: true                   # pair surplus and deficit into replica moves
      drain_timeout_s: 300          # a move's drain gives up (and rolls back) after this
      drain_poll_s: 1.0             # between idle checks while a move drains

Units: seconds, tokens per second, instances. ``bounds`` are enforced inside the ILP (per
endpoint) and again on every strategy step.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from skymesh.common.config import StrictModel

Mode = Literal["dry-run", "approve", "auto"]
ForecasterName = Literal["seasonal-naive", "ets", "arima", "mlstm"]


class ScheduleConfig(StrictModel):
    interval_s: float = Field(3600.0, gt=0, description="between planning rounds")
    window_s: int = Field(600, ge=1, le=86_400, description="series and forecast window")
    horizon: int = Field(6, ge=1, le=288, description="windows forecast and planned for")
    history_windows: int = Field(2016, ge=2, description="most recent windows a fit sees")
    min_history_windows: int = Field(3, ge=1, description="fewer: the round is skipped")
    stale_windows: int = Field(2, ge=1, description="a region silent this long is left "
                                                    "as it is (balancers report every 5 s)")
    tick_s: float = Field(15.0, gt=0, description="between strategy steps and retries")
    first_round_s: float = Field(60.0, ge=0, description="after start-up: balancers report "
                                                         "first")
    # The seasonal period the forecasters look for. Only a time-compressed demo (skymesh
    # demo --autopilot: a day in minutes) sets it shorter than a day.
    day_s: int = Field(86_400, ge=2, description="seasonal period (a day)")


class ForecasterConfig(StrictModel):
    name: ForecasterName = "seasonal-naive"
    params: dict[str, Any] = Field(default_factory=dict)
    retrain_every: int = Field(6, ge=0, description="windows between refits (0: every round)")
    headroom: float = Field(0.2, ge=0, le=10, description="forecast x (1 + headroom)")

    @model_validator(mode="after")
    def _known_params(self) -> ForecasterConfig:
        from skymesh_controller.planning.forecast.registry import forecaster_params

        unknown = sorted(set(self.params) - set(forecaster_params(self.name)))
        if unknown:
            raise ValueError(f"forecaster {self.name!r} has no parameter "
                             f"{', '.join(unknown)}")
        return self


class BoundConfig(StrictModel):
    min: int = Field(0, ge=0)
    max: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _order(self) -> BoundConfig:
        if self.max is not None and self.max < self.min:
            raise ValueError("max must be at least min")
        return self


class LocalActuatorConfig(StrictModel):
    replica_args: list[str] = Field(default_factory=list)
    profiles: dict[str, str] = Field(default_factory=dict, description="GPU type -> profile")
    balancer: str | None = None
    log_dir: str | None = None
    # A replica that has not said it listens by then is a failed start (retried on the
    # cooldowns). A real engine loading a model, or a loaded machine, needs more than 30 s.
    start_timeout_s: float = Field(30.0, gt=0, description="one replica's start-up")


class AwsActuatorConfig(StrictModel):
    endpoint_url: str | None = None  # moto, or a VPC endpoint
    regions: dict[str, str] | None = None  # mesh region -> AWS region
    instance_types: dict[str, str] | None = None  # GPU type -> EC2 instance type
    subnets: dict[str, str] = Field(default_factory=dict)
    reserve: bool = False


class ActuatorConfig(StrictModel):
    kind: Literal["none", "local", "aws"] = "none"
    local: LocalActuatorConfig = LocalActuatorConfig()
    aws: AwsActuatorConfig = AwsActuatorConfig()


class CooldownConfig(StrictModel):
    retry_s: float = Field(300.0, gt=0, description="first retry of a failed key")
    retry_max_s: float = Field(3600.0, gt=0, description="backoff cap")
    max_attempts: int = Field(5, ge=1, description="then the key waits for the next round")
    hold_s: float = Field(900.0, ge=0, description="no reversal of a key's change before")


class PlannerConfig(StrictModel):
    mode: Mode = "dry-run"
    schedule: ScheduleConfig = ScheduleConfig()
    forecaster: ForecasterConfig = ForecasterConfig()
    capacity: dict[str, dict[str, float]] = Field(min_length=1)
    gpus_per_instance: dict[str, dict[str, int]] = Field(default_factory=dict)
    gpus_available: dict[str, dict[str, int]] = Field(default_factory=dict)
    vm_cost: dict[str, float] = Field(default_factory=dict)
    bounds: dict[str, dict[str, BoundConfig]] = Field(default_factory=dict)
    epsilon: float = Field(0.5, gt=0, le=1)
    strategy: str | None = None
    strategy_cooldown_s: float | None = Field(
        None, ge=0, description="between one endpoint's strategy steps (default: the "
                                "strategy's own, 15 s); a time-compressed demo shortens it")
    actuator: ActuatorConfig = ActuatorConfig()
    cooldowns: CooldownConfig = CooldownConfig()
    approvers: list[str] = Field(default_factory=list)
    keep_rounds: int = Field(500, ge=10)
    solve_time_limit_s: float = Field(30.0, gt=0)
    # Moves (moves.py): a replica the plan takes from one endpoint and gives to another
    # is drained, waited on until idle, and re-registered instead of stopped and started.
    moves: bool = True
    drain_timeout_s: float = Field(300.0, gt=0, description="a move's drain gives up after")
    drain_poll_s: float = Field(1.0, gt=0, description="between idle checks of a drain")

    @field_validator("capacity")
    @classmethod
    def _positive(cls, v: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for model, per_gpu in v.items():
            if not per_gpu:
                raise ValueError(f"{model}: name at least one GPU type")
            for gpu, tps in per_gpu.items():
                if not tps > 0:
                    raise ValueError(f"{model}.{gpu}: tokens/s must be positive")
        return v

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, v: str | None) -> str | None:
        from skymesh_controller.planning.strategies import STRATEGIES

        # The one registry the simulated week uses: no second list of names here.
        if v is not None and v not in STRATEGIES:
            raise ValueError(f"unknown strategy {v!r}; one of {', '.join(STRATEGIES)}")
        return v

    @model_validator(mode="after")
    def _bounds_name_models(self) -> PlannerConfig:
        unknown = sorted(set(self.bounds) - set(self.capacity))
        if unknown:
            raise ValueError(f"bounds: {unknown[0]!r} is not a model under capacity")
        return self

    @model_validator(mode="after")
    def _installed(self) -> PlannerConfig:
        from skymesh.util.extras import install_hint, missing

        # At config load, not at the first round: the solver and forecasters are extras.
        needs = ["planning"] + (["forecast"] if self.forecaster.name == "mlstm" else [])
        for extra in needs:
            absent = missing(extra)
            if absent:
                raise ValueError(f"the planner {install_hint(extra, absent)}")
        return self

    def bound(self, model: str, region: str) -> BoundConfig:
        per_region = self.bounds.get(model, {})
        return per_region.get(region) or per_region.get("*") or BoundConfig()
