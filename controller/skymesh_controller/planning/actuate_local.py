"""Apply a plan on this machine: ``skymesh-replica`` processes registered with the controller.

For every (model, region, GPU type) the actuator keeps as many emulated replicas running
as the plan counts. A new replica is started with the engine profile of its GPU type
(``--profile``; the served model name is the plan's model), then registered with the
controller's admin API (``POST /v1/replicas {id, url, model, region, gpu, kind,
balancer?}``); a surplus one is deregistered first (``DELETE /v1/replicas/{id}``, so no
balancer picks it again) and then stopped. The admin token comes from
``SKYMESH_ADMIN_TOKEN`` unless given.

Moves (``movable``, ``prepare_move``, ``finish_move``, ``abort_move``; the controller's
planner runs them, skymesh_controller.autopilot.moves): a replica keeps its id; a region
move keeps its process, a model change starts one with the other model and stops the old
one once the controller has re-registered the replica.

Idempotent: the actuator compares the plan with the replicas it runs (alive processes
only: one that died is deregistered and replaced), so applying the same plan twice
changes nothing the second time. Which replicas to stop is decided by the pure
:func:`reconcile` (the newest first: the oldest have warm caches and proven health).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skymesh.util.procs import Daemon, start_daemon
from skymesh_controller.planning.actuate import ApplyReport, Change
from skymesh_controller.planning.ilp import Key, Plan

# Replica processes started at once by one apply (each is a Python process importing the
# engine: more at once only slows them all on a small machine).
MAX_PARALLEL_STARTS = 4

# Engine profile per GPU type (the profiles in replica/skymesh_replica/engine/profiles.py); a
# (model, gpu) entry in ``LocalActuator.profiles`` overrides it.
DEFAULT_PROFILES: dict[str, str] = {
    "L4": "llama3.1-8b-l4", "A100": "llama3.1-8b-a100", "A100-80GB": "llama3.1-8b-a100",
    "H100": "llama3.1-8b-h100", "H100-80GB": "llama3.1-8b-h100",
}


def _default_profiles() -> dict[str | tuple[str, str], str]:
    return {gpu: prof for gpu, prof in DEFAULT_PROFILES.items()}


@dataclass(frozen=True, slots=True)
class Actions:
    """What :func:`reconcile` decides: replicas to start per key, replica ids to stop."""

    start: dict[Key, int]
    stop: list[tuple[Key, str]]

    def __bool__(self) -> bool:
        return bool(self.start or self.stop)


def reconcile(running: Mapping[Key, Sequence[str]], desired: Mapping[Key, int]) -> Actions:
    """Starts and stops that turn ``running`` (ids per key, oldest first) into ``desired``.

    Keys absent from ``desired`` keep what they run: a plan covers the keys it names (so a
    partial plan for one model leaves the others alone); set a key to 0 to empty it.
    """
    start: dict[Key, int] = {}
    stop: list[tuple[Key, str]] = []
    for key, want in desired.items():
        if want < 0:
            raise ValueError(f"desired count of {key} is negative: {want}")
        have = list(running.get(key, ()))
        if want > len(have):
            start[key] = want - len(have)
        elif want < len(have):
            stop += [(key, rid) for rid in reversed(have[want:])]
    return Actions(start, stop)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


class ControllerError(RuntimeError):
    pass


@dataclass
class ControllerClient:
    """The two admin calls the actuator needs, over plain HTTP (synchronous, like the
    Actuator protocol)."""

    url: str
    token: str
    timeout_s: float = 10.0

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url.rstrip("/") + path, data=data, method=method,
            headers={"Authorization": f"Bearer {self.token}",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise ControllerError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ControllerError(f"{method} {path}: {exc}") from None
        return json.loads(raw) if raw else None

    def register(self, body: dict[str, Any]) -> None:
        self._call("POST", "/v1/replicas", body)

    def deregister(self, rid: str) -> None:
        try:
            self._call("DELETE", f"/v1/replicas/{rid}")
        except ControllerError as exc:
            if "HTTP 404" not in str(exc):  # already gone is what we wanted
                raise


@dataclass
class _Replica:
    id: str
    daemon: Daemon


@dataclass
class LocalActuator:
    """Runs replicas as child processes; ``close()`` deregisters and stops them all."""

    controller_url: str
    token: str | None = None  # default: $SKYMESH_ADMIN_TOKEN
    profiles: Mapping[str | tuple[str, str], str] = field(
        default_factory=_default_profiles)
    balancer: str | None = None  # home balancer for every replica (default: the region's)
    replica_args: Sequence[str] = ()  # extra flags, e.g. ("--time-scale", "0.05")
    log_dir: Path | None = None
    starter: Callable[..., Daemon] = start_daemon
    _running: dict[Key, list[_Replica]] = field(default_factory=dict, repr=False)
    _serial: int = field(default=0, repr=False)
    _staged: dict[str, Daemon] = field(default_factory=dict, repr=False)  # moves under way

    def __post_init__(self) -> None:
        token = self.token or os.environ.get("SKYMESH_ADMIN_TOKEN")
        if not token:
            raise ValueError("an admin token is needed: pass token= or set "
                             "SKYMESH_ADMIN_TOKEN")
        self.client = ControllerClient(self.controller_url, token)

    # -- state ------------------------------------------------------------------------------
    def running(self) -> dict[Key, list[str]]:
        """Replica ids per key, oldest first (live processes only)."""
        return {k: [r.id for r in reps] for k, reps in self._running.items() if reps}

    def urls(self, key: Key) -> list[str]:
        return [r.daemon.url for r in self._running.get(key, [])]

    def profile_for(self, model: str, gpu: str) -> str:
        prof = self.profiles.get((model, gpu)) or self.profiles.get(gpu)
        if prof is None:
            raise ValueError(f"no engine profile for GPU type {gpu!r} (model {model!r})")
        return prof

    # -- Actuator protocol ------------------------------------------------------------------
    def apply(self, plan: Plan) -> ApplyReport:
        return self.apply_counts(plan.counts)

    def apply_counts(self, counts: Mapping[Key, int]) -> ApplyReport:
        report = ApplyReport()
        for key in counts:
            self._reap(key)
        before = {k: len(self._running.get(k, [])) for k in counts}
        actions = reconcile(self.running(), counts)
        for key, rid in actions.stop:
            try:
                self._stop(key, rid)
            except ControllerError as exc:
                report.errors[key] = str(exc)
        report.errors.update(self._start_all([key for key, n in actions.start.items()
                                              for _ in range(n)]))
        for key in counts:
            after = len(self._running.get(key, []))
            if after != before[key]:
                report.changed.append(Change(*key, before=before[key], after=after))
            elif key not in report.errors:
                report.unchanged.append(key)
        return report

    def close(self) -> None:
        """Deregister and stop every replica this actuator started: deregistered one by
        one, stopped together (SIGTERM to all, then the waits), so a controller that
        shuts down within its grace period does not leave processes behind."""
        daemons = list(self._staged.values())
        self._staged.clear()
        for reps in self._running.values():
            for rep in reversed(reps):
                # The controller may be gone already: still end our process.
                with contextlib.suppress(ControllerError):
                    self.client.deregister(rep.id)
                daemons.append(rep.daemon)
        self._running.clear()
        if daemons:
            with ThreadPoolExecutor(len(daemons)) as pool:
                list(pool.map(lambda d: d.stop(), daemons))

    # -- actions ----------------------------------------------------------------------------
    def _reap(self, key: Key) -> None:
        """Forget (and deregister) replicas whose process has exited, so they are replaced."""
        for rep in [r for r in self._running.get(key, []) if not r.daemon.alive()]:
            # Best effort: the controller's probe marks a dead replica unhealthy anyway.
            with contextlib.suppress(ControllerError):
                self.client.deregister(rep.id)
            self._running[key].remove(rep)

    def _spawn(self, key: Key, name: str, seed: int | None = None) -> Daemon:
        model, _, gpu = key
        log_path = self.log_dir / f"{name}.log" if self.log_dir else None
        return self.starter(
            "skymesh-replica",
            ["--port", "0", "--profile", self.profile_for(model, gpu), "--model", model,
             "--seed", str(self._serial if seed is None else seed), *self.replica_args],
            log_path=log_path)

    def _start_all(self, keys: list[Key]) -> dict[Key, str]:
        """Start a replica per entry of ``keys``: the processes at once (a start waits for
        the process to listen, seconds each on a busy machine, and a round holds the
        planner while it runs), then register them in ``keys``' order. Errors by key."""
        named = []
        for key in keys:
            self._serial += 1
            model, region, gpu = key
            rid = (f"{_slug(region)}-{_slug(model)}-{_slug(gpu)}-{os.getpid()}-"
                   f"{self._serial}")[-63:]
            named.append((key, rid.lstrip("-._") or f"replica-{self._serial}", self._serial))
        errors: dict[Key, str] = {}
        if not named:
            return errors
        with ThreadPoolExecutor(min(len(named), MAX_PARALLEL_STARTS)) as pool:
            spawned = [pool.submit(self._spawn, key, rid, seed) for key, rid, seed in named]
        for (key, rid, _), fut in zip(named, spawned, strict=True):
            try:
                self._register(key, rid, fut.result())
            except (ControllerError, RuntimeError, ValueError) as exc:
                errors[key] = str(exc)
        return errors

    def _register(self, key: Key, rid: str, daemon: Daemon) -> None:
        model, region, gpu = key
        body: dict[str, Any] = {"id": rid, "url": daemon.url, "model": model,
                                "region": region, "gpu": gpu, "kind": "skymesh"}
        if self.balancer:
            body["balancer"] = self.balancer
        try:
            self.client.register(body)
        except ControllerError:
            daemon.stop()  # an unregistered replica would only burn a GPU
            # A registration that timed out may have landed: no record of a dead process.
            with contextlib.suppress(ControllerError):
                self.client.deregister(rid)
            raise
        self._running.setdefault(key, []).append(_Replica(rid, daemon))

    # -- moves (skymesh_controller.autopilot.moves runs them) -------------------------------
    @property
    def move_kinds(self) -> frozenset[str]:
        # A fixed home balancer sits in one region: a replica moved elsewhere would stay
        # homed there, so with one only model changes move.
        return frozenset({"model"}) if self.balancer else frozenset({"model", "region"})

    def movable(self, key: Key) -> list[str]:
        """Live replicas of ``key``, newest first (as :func:`reconcile` stops them)."""
        self._reap(key)
        return [r.id for r in reversed(self._running.get(key, []))]

    def prepare_move(self, rid: str, src: Key, dst: Key) -> str:
        """The URL ``rid`` will serve ``dst`` at: its own for a region move; for a model
        change a new process with ``dst``'s model (started before the old one stops, so a
        failed start leaves the old one serving)."""
        rep = self._find(src, rid)
        if src[0] == dst[0] and src[2] == dst[2]:
            return rep.daemon.url
        self._serial += 1
        daemon = self._spawn(dst, f"{rid}-{self._serial}")
        self._staged[rid] = daemon
        return daemon.url

    def finish_move(self, rid: str, src: Key, dst: Key) -> None:
        rep = self._find(src, rid)
        self._running[src].remove(rep)
        self._running.setdefault(dst, []).append(rep)
        new = self._staged.pop(rid, None)
        if new is not None:
            old, rep.daemon = rep.daemon, new
            old.stop()

    def abort_move(self, rid: str) -> None:
        new = self._staged.pop(rid, None)
        if new is not None:
            new.stop()

    def _find(self, key: Key, rid: str) -> _Replica:
        rep = next((r for r in self._running.get(key, []) if r.id == rid), None)
        if rep is None:
            raise ValueError(f"replica {rid!r} is not one of mine at {key}")
        return rep

    def _stop(self, key: Key, rid: str) -> None:
        reps = self._running.get(key, [])
        rep = next(r for r in reps if r.id == rid)
        # Deregister first so balancers stop routing to it before it goes away.
        self.client.deregister(rid)
        rep.daemon.stop()
        reps.remove(rep)
