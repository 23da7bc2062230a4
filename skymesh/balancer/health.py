"""Replica health: the one owner of what the balancer knows about each replica's state.

:class:`HealthTracker` keeps, per replica, the consecutive probe results, whether it is
up, the models it serves and what its last probe read. Nothing else writes that state:
the dispatcher's per-target ``healthy`` and ``models`` (``skymesh.balancer.dispatch``, which
routes on them) are published by the tracker through :class:`HealthSink` on every change
and are never set anywhere else. The probing I/O (``skymesh.balancer.probing``) only
reports outcomes here.

The decision itself is pure and shared with the controller's probing, so it lives in the
planes' shared kernel (``skymesh.common.health``): ``HealthRule`` turns a ``Streak`` of
consecutive results into up / down / unchanged. Parameters (``probe`` in the config):

- ``failure_threshold`` (3): failed probes in a row that take a replica down;
- ``success_threshold`` (2): good probes in a row that bring it (back) up. The first
  contact with a replica whose models the probe has just listed counts as up at once,
  so start-up does not wait several probe rounds;
- ``models_interval_s`` (10): how often a replica's models are listed again when the
  config does not name them.

There is no probe back-off: a down replica is probed every ``interval_s`` like the others,
so it comes back within ``success_threshold`` intervals of recovering; coming back is
what the thresholds slow down (hysteresis), and requests that fail on a replica back off
through its breaker (``skymesh.balancer.breaker``).

Time comes from an injected clock (``time.monotonic`` in the daemon, a fake in tests):
a probe's age in ``/status`` is ``clock() - `` when the last good probe was sent. A
replica whose last probe failed shows no figures (``None``), never its last good ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from skymesh.balancer.config import ReplicaConfig
from skymesh.balancer.seqcap import CapLearner, Source
from skymesh.common.health import HealthRule, Streak
from skymesh.common.probe import ProbeResult

log = logging.getLogger("skymesh.lb")

Clock = Callable[[], float]
NEVER = -1e18  # models never listed


class HealthSink(Protocol):
    """Where the tracker publishes membership and health (the dispatcher)."""

    def set_targets(self, models_by_target: dict[str, Iterable[str]]) -> None: ...
    def set_models(self, target: str, models: Iterable[str]) -> None: ...
    def set_healthy(self, target: str, healthy: bool) -> None: ...


class ReplicaHealth:
    """One replica's state: its probe streak, whether it is up, the models it serves and
    what its last probe read (None once a probe failed: /status shows no stale figures)."""

    __slots__ = ("cap", "cfg", "error", "healthy", "last", "last_ok_at", "models", "models_at",
                 "seqs_source", "streak")

    def __init__(self, cfg: ReplicaConfig) -> None:
        self.cfg = cfg
        self.streak = Streak()
        self.healthy = False
        self.models: set[str] = set(cfg.models or ())
        self.models_at = NEVER
        self.last: ProbeResult | None = None
        self.last_ok_at: float | None = None  # when the last good probe was sent
        self.error: str | None = None  # why the last probe failed
        # Its admission limit when nobody tells it (skymesh.balancer.seqcap), and where
        # the limit in force came from.
        self.cap = CapLearner()
        self.seqs_source: Source = "unknown"

    @property
    def url(self) -> str:
        return self.cfg.url


class HealthTracker:
    def __init__(self, replicas: Iterable[ReplicaConfig], rule: HealthRule, *,
                 models_interval_s: float = 10.0, clock: Clock = time.monotonic,
                 sink: HealthSink | None = None) -> None:
        self.rule = rule
        self.models_interval_s = models_interval_s
        self.clock = clock
        self.sink = sink
        self.replicas: dict[str, ReplicaHealth] = {r.url: ReplicaHealth(r) for r in replicas}
        self._publish()

    # -- membership ----------------------------------------------------------------------
    def set_replicas(self, replicas: Iterable[ReplicaConfig]) -> tuple[set[str], set[str]]:
        """Replace the replica set; state survives for replicas that stay. Returns the
        URLs added and removed."""
        old = self.replicas
        self.replicas = {}
        for rc in replicas:
            h = old.get(rc.url)
            if h is None:
                h = ReplicaHealth(rc)
            elif h.cfg != rc:
                h.cfg = rc
                if rc.models is not None:
                    h.models = set(rc.models)
            self.replicas[rc.url] = h
        added, removed = set(self.replicas) - set(old), set(old) - set(self.replicas)
        if added or removed:
            log.info("membership: +%s -%s", sorted(added), sorted(removed))
        self._publish()
        return added, removed

    def _publish(self) -> None:
        if self.sink is None:
            return
        self.sink.set_targets({url: h.models for url, h in self.replicas.items()})
        for url, h in self.replicas.items():
            self.sink.set_healthy(url, h.healthy)

    # -- probe outcomes ------------------------------------------------------------------
    # They take the ReplicaHealth the probe started with, not its URL: a probe that ends
    # after its replica left the set updates only that orphan.
    def wants_models(self, h: ReplicaHealth, sent: float) -> bool:
        """Should the probe sent at ``sent`` list ``h``'s models too?"""
        return h.cfg.models is None and sent - h.models_at >= self.models_interval_s

    def models_listed(self, h: ReplicaHealth, models: set[str], sent: float) -> None:
        h.models = models
        h.models_at = sent
        if self.sink is not None:
            self.sink.set_models(h.url, models)

    def probe_ok(self, h: ReplicaHealth, result: ProbeResult, sent: float) -> bool:
        """A good probe sent at ``sent``; True when it brought ``h`` up."""
        h.last, h.last_ok_at, h.error = result, sent, None
        up = self.rule.step(h.streak, True, h.healthy, first_contact=h.models_at == sent)
        if up and not h.healthy:
            h.healthy = True
            log.info("replica %s healthy", h.url)
            if self.sink is not None:
                self.sink.set_healthy(h.url, True)
            return True
        return False

    def probe_failed(self, h: ReplicaHealth, error: str) -> bool:
        """A failed probe; True when it took ``h`` down."""
        h.last = None
        h.error = error
        up = self.rule.step(h.streak, False, h.healthy)
        if h.healthy and up is False:
            h.healthy = False
            log.warning("replica %s unhealthy: %s", h.url, error)
            if self.sink is not None:
                self.sink.set_healthy(h.url, False)
            return True
        return False

    # -- reading -------------------------------------------------------------------------
    def is_healthy(self, url: str) -> bool:
        h = self.replicas.get(url)
        return h is not None and h.healthy

    def healthy_count(self) -> int:
        return sum(1 for h in self.replicas.values() if h.healthy)

    def figures(self, url: str) -> dict[str, Any]:
        """/status's probe figures for one replica: null figures after a failed probe (or
        before any), with the age of the last good one and the error."""
        h = self.replicas.get(url)
        res = h.last if h is not None else None
        ok_at = h.last_ok_at if h is not None else None
        return {
            "waiting": res.waiting if res is not None else None,
            "running": res.running if res is not None else None,
            "kv_usage": res.kv_usage if res is not None else None,
            "probe_age_s": None if ok_at is None else round(self.clock() - ok_at, 3),
            "probe_error": h.error if h is not None else None,
            "max_num_seqs_source": h.seqs_source if h is not None else "unknown",
        }


__all__ = ["Clock", "HealthRule", "HealthSink", "HealthTracker", "ReplicaHealth", "Streak"]
