"""Applying a re-read ``skymesh-lb`` config to the running balancer (SIGHUP).

What can change live: the replica set (:meth:`Balancer.set_replicas`: probe state of the
replicas that stay survives, requests in flight on a removed one finish there), the
routing policy (:meth:`Balancer.set_policy`) and the pushing limits (mode, caps, hold and
window, read by the dispatcher on every decision). Every other section that differs
(listen address and TLS, mesh identity and peers, auth, queue, probe, retry, ...) is only
reported as needing a restart: it is wired into sockets, tasks or clients at start-up.

The caller parses and validates the new file first (a bad file never gets here); this
module only compares and applies, so it has no I/O of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from skymesh.balancer.config import BalancerConfig, PushingConfig
from skymesh.balancer.server import Balancer

LIVE_SECTIONS = ("replicas", "policy", "pushing")


@dataclass(frozen=True)
class ReloadResult:
    applied: tuple[str, ...]  # sections changed live
    needs_restart: tuple[str, ...]  # sections that differ but keep their running values

    def summary(self) -> str:
        done = ", ".join(self.applied) or "nothing changed"
        if self.needs_restart:
            return f"applied: {done}; needs restart: {', '.join(self.needs_restart)}"
        return f"applied: {done}"


def apply_config(lb: Balancer, new: BalancerConfig) -> ReloadResult:
    """Apply ``new``'s live sections to ``lb``; ``lb.cfg`` then holds what is in effect
    (the new live sections, the old values of everything else)."""
    old = lb.cfg
    applied: list[str] = []
    if new.replicas != old.replicas:
        lb.set_replicas(list(new.replicas))
        applied.append("replicas")
    if new.policy != old.policy:
        # set_policy skips a switch when name and params match what it last installed;
        # the start-up policy was installed by the constructor, not by set_policy, so
        # tell it which params are running (else a change back to {} would be skipped).
        if getattr(lb, "_policy_params", None) is None:
            lb._policy_params = dict(old.policy.params)
        lb.set_policy(new.policy.name, dict(new.policy.params))
        applied.append("policy")
    if new.pushing != old.pushing:
        _set_pushing(lb, new.pushing)
        applied.append("pushing")
    restart = tuple(name for name in type(new).model_fields
                    if name not in LIVE_SECTIONS and getattr(new, name) != getattr(old, name))
    lb.cfg = old.model_copy(update={name: getattr(new, name) for name in applied})
    return ReloadResult(tuple(applied), restart)


def _set_pushing(lb: Balancer, p: PushingConfig) -> None:
    d = lb.dispatcher
    d.mode = p.mode
    d.max_outstanding = p.max_outstanding
    d.kv_headroom = p.kv_headroom
    d.window = p.window
    d.hold_s = p.hold_s
    # A replica's own prefer_queue (its kind's default, or this) is set at its next probe.
    d.prefer_queue, d.hold_queue_max = p.prefer_queue or 0, p.hold_queue_max
    if p.balancers_per_region != "auto":  # auto: the controller link keeps it current
        d.balancers_per_region = p.balancers_per_region * lb.workers  # each worker pushes
    d.step_tokens = p.step_tokens  # for targets added from now on
    for target in d.targets.values():
        target.load.step_tokens = p.step_tokens
