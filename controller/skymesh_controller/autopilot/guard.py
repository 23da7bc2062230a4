"""Cooldowns that keep the planner from flapping, as a pure object on an injected clock.

Two rules, per key (model, region, GPU type):

- *hold*: after a key changes, a change in the opposite direction waits ``hold_s``
  (a plan that scales out at 10:00 does not scale in at 10:05 on a noisy forecast);
  a change in the same direction is allowed (a rising peak keeps rising).
- *retry*: a key whose actuation failed is retried after ``retry_s``, doubling up to
  ``retry_max_s``, at most ``max_attempts`` times; then it waits for the next round.
  While it waits, other plans do not touch it either (no two actuations racing on it).

The planner asks :meth:`Cooldowns.admit` before it hands changes to the actuator and
tells :meth:`Cooldowns.changed` / :meth:`Cooldowns.failed` what happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from skymesh_controller.autopilot.config import CooldownConfig
from skymesh_controller.planning.ilp import Key


@dataclass
class _Retry:
    attempts: int
    next_at: float


@dataclass
class Cooldowns:
    cfg: CooldownConfig
    _last: dict[Key, tuple[float, int]] = field(default_factory=dict)  # (when, sign)
    _retry: dict[Key, _Retry] = field(default_factory=dict)

    def admit(self, key: Key, before: int, after: int, now: float) -> str | None:
        """None when the change may go ahead, else why it is held."""
        retry = self._retry.get(key)
        if retry is not None and now < retry.next_at:
            return f"retry cooldown until t={retry.next_at:.0f} (attempt {retry.attempts})"
        sign = (after > before) - (after < before)
        last = self._last.get(key)
        if sign and last is not None and last[1] == -sign and now - last[0] < self.cfg.hold_s:
            return (f"hold: changed the other way {now - last[0]:.0f}s ago "
                    f"(hold_s {self.cfg.hold_s:.0f})")
        return None

    def changed(self, key: Key, before: int, after: int, now: float) -> None:
        self._retry.pop(key, None)
        sign = (after > before) - (after < before)
        if sign:
            self._last[key] = (now, sign)

    def failed(self, key: Key, now: float) -> bool:
        """Note a failure; True while the key has attempts left (a retry is due later)."""
        prev = self._retry.get(key)
        attempts = (prev.attempts if prev else 0) + 1
        if attempts >= self.cfg.max_attempts:
            # Out of attempts: wait out the longest cooldown, then the next round decides.
            self._retry[key] = _Retry(attempts, now + self.cfg.retry_max_s)
            return False
        delay = min(self.cfg.retry_s * 2 ** (attempts - 1), self.cfg.retry_max_s)
        self._retry[key] = _Retry(attempts, now + delay)
        return True

    def due(self, now: float) -> list[Key]:
        """Failed keys whose retry time has come and that have attempts left."""
        return sorted(k for k, r in self._retry.items()
                      if now >= r.next_at and r.attempts < self.cfg.max_attempts)

    def retry_at(self, key: Key) -> float | None:
        retry = self._retry.get(key)
        return None if retry is None else retry.next_at
