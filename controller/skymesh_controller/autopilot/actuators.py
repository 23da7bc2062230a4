"""The configured actuator behind one seam: what runs now, and make it match counts.

``none`` plans only. ``local`` runs ``skymesh-replica`` processes
(skymesh_controller.planning.actuate_local) and registers them with *this* controller in-process (no
HTTP call back to ourselves, no token to hand out): a plan's count for a key is the total
the key should have, so replicas registered by other means count towards it and the
actuator starts or stops only its own. ``aws`` sets Auto Scaling groups
(skymesh_controller.planning.actuate_aws); what runs now is each group's desired capacity.

The actuators are synchronous (boto3, process start-up): the planner calls them in a
worker thread, and the local one's controller calls hop back onto the event loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from skymesh_controller.autopilot.config import ActuatorConfig
from skymesh_controller.planning.actuate import ApplyReport
from skymesh_controller.planning.ilp import Key

CALL_TIMEOUT_S = 30.0


class Backend(Protocol):
    kind: str

    def current(self, keys: Iterable[Key], registered: Mapping[Key, int]) -> dict[Key, int]:
        """Instances per key the plan starts from (``registered``: replicas in the store)."""

    def apply_counts(self, counts: Mapping[Key, int], registered: Mapping[Key, int]
                     ) -> ApplyReport: ...

    def close(self) -> None: ...


@runtime_checkable
class Mover(Protocol):
    """What an actuator that can move replicas offers (moves.py runs the move).

    ``move_kinds``: what one of its replicas may change, ``"region"`` and/or ``"model"``
    (the GPU type never changes). ``movable(key)``: its own replicas of ``key``, in the
    order it would give them up. ``prepare_move`` returns the URL the replica will serve
    ``dst`` at (a new process for a model change); then either ``finish_move`` (the store
    has the replica at ``dst``: update the books, stop a replaced process) or
    ``abort_move`` (stop what ``prepare_move`` started)."""

    @property
    def move_kinds(self) -> frozenset[str]: ...

    def movable(self, key: Key) -> list[str]: ...

    def prepare_move(self, rid: str, src: Key, dst: Key) -> str: ...

    def finish_move(self, rid: str, src: Key, dst: Key) -> None: ...

    def abort_move(self, rid: str) -> None: ...


def mover_of(backend: Backend | None) -> Mover | None:
    """The backend's mover, if it has one (``aws`` and ``none`` do not: see below)."""
    return getattr(backend, "mover", None)


class NoActuator:
    kind = "none"

    def current(self, keys: Iterable[Key], registered: Mapping[Key, int]) -> dict[Key, int]:
        return dict(registered)

    def apply_counts(self, counts: Mapping[Key, int], registered: Mapping[Key, int]
                     ) -> ApplyReport:
        raise RuntimeError("no actuator configured (planner.actuator.kind: none)")

    def close(self) -> None:
        pass


class InProcessClient:
    """The two calls LocalActuator makes, as controller calls on the event loop."""

    def __init__(self, ctl: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.ctl, self.loop = ctl, loop

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        from skymesh_controller.errors import ApiError
        from skymesh_controller.planning.actuate_local import ControllerError

        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(CALL_TIMEOUT_S)
        except ApiError as exc:
            raise ControllerError(f"HTTP {exc.status}: {exc.message}") from None
        except TimeoutError:
            # A call left running would register a replica whose process the actuator
            # is about to stop: cancel it, and let the caller clean up as for a refusal.
            fut.cancel()
            raise ControllerError(f"no answer in {CALL_TIMEOUT_S:.0f}s") from None

    def register(self, body: dict[str, Any]) -> None:
        from skymesh_controller.models import ReplicaIn

        self._run(self.ctl.add_replica(ReplicaIn.model_validate(body)))

    def deregister(self, rid: str) -> None:
        from skymesh_controller.planning.actuate_local import ControllerError

        try:
            self._run(self.ctl.remove_replica(rid))
        except ControllerError as exc:
            if "HTTP 404" not in str(exc):  # already gone is what we wanted
                raise


class LocalBackend:
    kind = "local"

    def __init__(self, cfg: ActuatorConfig, ctl: Any, loop: asyncio.AbstractEventLoop,
                 starter: Any = None) -> None:
        from skymesh_controller.planning.actuate_local import DEFAULT_PROFILES, LocalActuator

        local = cfg.local
        if starter is None:
            from skymesh.util.procs import start_daemon

            starter = functools.partial(start_daemon, timeout=local.start_timeout_s)
        extra: dict[str, Any] = {"starter": starter}
        profiles: dict[str | tuple[str, str], str] = {}
        profiles.update(DEFAULT_PROFILES)
        profiles.update(local.profiles)
        # The token is never used: the client below replaces the HTTP one.
        self.actuator = LocalActuator(
            "http://in-process", token="in-process",
            profiles=profiles, balancer=local.balancer,
            replica_args=tuple(local.replica_args),
            log_dir=Path(local.log_dir) if local.log_dir else None, **extra)
        self.actuator.client = InProcessClient(ctl, loop)  # type: ignore[assignment]
        self.mover: Mover = self.actuator

    def current(self, keys: Iterable[Key], registered: Mapping[Key, int]) -> dict[Key, int]:
        return dict(registered)

    def apply_counts(self, counts: Mapping[Key, int], registered: Mapping[Key, int]
                     ) -> ApplyReport:
        mine = self.actuator.running()
        own: dict[Key, int] = {}
        for key, total in counts.items():
            others = max(0, registered.get(key, 0) - len(mine.get(key, [])))
            own[key] = max(0, total - others)
        return self.actuator.apply_counts(own)

    def close(self) -> None:
        self.actuator.close()


class AwsBackend:
    """No moves: an instance lives in its AWS region's Auto Scaling group, and one that
    served another model would need its launch template's user data run again, so a plan
    that shifts capacity is a scale-in of one group and a scale-out of another."""

    kind = "aws"

    def __init__(self, cfg: ActuatorConfig, client_factory: Any = None) -> None:
        import boto3

        from skymesh_controller.planning.actuate_aws import AwsActuator

        aws = cfg.aws

        def factory(service: str, region: str) -> Any:
            return boto3.client(service, region_name=region, endpoint_url=aws.endpoint_url)

        kw: dict[str, Any] = {"client_factory": client_factory or factory,
                              "subnets": aws.subnets, "reserve": aws.reserve}
        if aws.regions is not None:
            kw["regions"] = aws.regions
        if aws.instance_types is not None:
            kw["instance_types"] = aws.instance_types
        self.actuator = AwsActuator(**kw)

    def current(self, keys: Iterable[Key], registered: Mapping[Key, int]) -> dict[Key, int]:
        out = {}
        for m, r, g in keys:
            if r in self.actuator.regions:
                out[m, r, g] = self.actuator.desired(m, r, g) or 0
        return out

    def apply_counts(self, counts: Mapping[Key, int], registered: Mapping[Key, int]
                     ) -> ApplyReport:
        return self.actuator.apply_counts(counts)

    def close(self) -> None:
        pass


def build_backend(cfg: ActuatorConfig, ctl: Any, loop: asyncio.AbstractEventLoop) -> Backend:
    if cfg.kind == "local":
        return LocalBackend(cfg, ctl, loop)
    if cfg.kind == "aws":
        return AwsBackend(cfg)
    return NoActuator()
