"""``make bench`` (foundation part): simulator speed and sim-vs-live fidelity.

Speed: simulated seconds per wall second for 12 replicas (4 per region, A100 profile)
replaying the whole Mooncake conversation trace (target: at least 100x real time).
Fidelity: ``skymesh_lab.bench.fidelity`` at its default size (target: throughput and TTFT
within 10%).
"""

from __future__ import annotations

import sys

from skymesh_lab.bench import fidelity
from skymesh_lab.sim.runner import SimConfig, run


def speed() -> dict[str, float]:
    cfg = SimConfig(workload="mooncake-conversation", regions=["us", "eu", "asia"],
                    replicas={"us": 4, "eu": 4, "asia": 4}, policy="least-load",
                    profile="llama3.1-8b-a100", seed=0)
    r = run(cfg)
    print("== Simulator speed: Mooncake conversation trace, 12 x A100 replicas, 3 regions ==")
    print(f"  {r['requests']} requests, {r['sim_seconds']:.0f} simulated s in "
          f"{r['wall_seconds']:.1f} wall s: {r['speedup']:.0f}x real time (target >= 100x); "
          f"{r['events']} events")
    return {"speedup": r["speedup"], "sim_seconds": r["sim_seconds"],
            "wall_seconds": r["wall_seconds"]}


def main() -> int:
    speed()
    print("\n== Fidelity: the same workload through the simulator and real replicas ==")
    return fidelity.main([])


if __name__ == "__main__":
    sys.exit(main())
