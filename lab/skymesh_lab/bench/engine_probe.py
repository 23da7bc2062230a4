"""Where the load sits during a simulated run: per-replica KV usage, waiting and running
requests, and requests queued at the balancers, sampled on the simulator's clock.

The macrobenchmark reports these beside its throughput and latencies so that a missing
paper figure can be explained by measurement (docs/notes/sglang-mode.md): selective pushing
only helps when replicas' pools fill and requests wait somewhere, so the first question
about any ratio near 1.0x is whether anything waited at all, and where.

The probe only reads state; it schedules its own events on the simulation's loop from
``t0`` to ``t1`` (the benchmark's window), so it neither keeps the loop alive past the
window nor changes what the simulation does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from skymesh_lab.sim.runner import Simulation

# A replica counts as "full" at this KV usage: the pool has no room for a new prompt's
# blocks plus SGLang's reserve, so admission stalls or decode retracts.
FULL_KV_USAGE = 0.95


class EngineProbe:
    """Samples every ``interval_s`` of simulated time in ``[t0, t1)``."""

    def __init__(self, sim: Simulation, t0: float, t1: float, interval_s: float = 1.0
                 ) -> None:
        self.sim = sim
        self.t1 = t1
        self.interval_s = interval_s
        self.kv: list[list[float]] = []
        self.waiting: list[list[int]] = []
        self.running: list[list[int]] = []
        self.balancer_queue: list[int] = []
        sim.loop.at(t0, self._sample)

    def _sample(self) -> None:
        reps = self.sim.replicas
        self.kv.append([r.engine.kv_usage for r in reps])
        self.waiting.append([r.engine.num_waiting for r in reps])
        self.running.append([r.engine.num_running for r in reps])
        self.balancer_queue.append(sum(b.dispatcher.queued
                                       for b in self.sim.balancers.values()))
        if self.sim.loop.now + self.interval_s < self.t1:
            self.sim.loop.after(self.interval_s, self._sample)

    def summary(self) -> dict[str, Any]:
        """Means over the samples; per replica unless the key says total."""
        if not self.kv:
            return {}
        kv = np.asarray(self.kv)
        waiting = np.asarray(self.waiting, dtype=float)
        running = np.asarray(self.running, dtype=float)
        return {
            "kv_usage_mean": float(kv.mean()),
            "kv_usage_max_replica_mean": float(kv.max(axis=1).mean()),
            "kv_full_fraction": float((kv >= FULL_KV_USAGE).mean()),
            "replica_running_mean": float(running.mean()),
            "replica_waiting_mean": float(waiting.mean()),
            "replica_waiting_total_mean": float(waiting.sum(axis=1).mean()),
            "balancer_queue_total_mean": float(np.mean(self.balancer_queue)),
        }
