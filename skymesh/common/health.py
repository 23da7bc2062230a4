"""The health rule both planes apply to probe results: consecutive-result thresholds, so
one lost probe does not move a replica. ``skymesh-lb`` applies it to its replicas'
probes (skymesh.balancer.health) and the controller to its own probes of replicas and
balancers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Streak:
    """Consecutive probe results of one kind (a success resets the failures, and back)."""

    failures: int = 0
    successes: int = 0

    def record(self, ok: bool) -> None:
        if ok:
            self.failures = 0
            self.successes += 1
        else:
            self.successes = 0
            self.failures += 1


@dataclass(frozen=True, slots=True)
class HealthRule:
    """Consecutive-result thresholds, so one lost probe does not move a replica."""

    failure_threshold: int = 3
    success_threshold: int = 2

    def step(self, streak: Streak, ok: bool, current: bool | None, *,
             first_contact: bool = False) -> bool | None:
        """Record ``ok`` in ``streak``; the state after it: True up, False down, None
        (unknown) only when it was unknown and no threshold is reached yet."""
        streak.record(ok)
        if ok:
            if current is not True and (first_contact
                                        or streak.successes >= self.success_threshold):
                return True
        elif current is not False and streak.failures >= self.failure_threshold:
            return False
        return current
