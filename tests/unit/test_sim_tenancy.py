"""The simulator's balancer orders its queue with tenancy's fair queue (the same
``FairQueue`` and release rule as the live balancer): an interactive tenant beside a batch
tenant that floods waits far less than first come, first served, and the batch tenant
still gets all its work done."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator

from skymesh.balancer.tenancy import FairQueue
from skymesh_lab.sim.cluster import RequestRecord, SimTenancy
from skymesh_lab.sim.runner import SimConfig, Simulation
from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_replica.engine.hashing import BLOCK_SIZE, hash_token_blocks

CLASSES = ("interactive", "standard", "batch")


class FloodBeside(Workload):
    """A batch flood at t=0 (``b*`` ids), and interactive requests at a steady rate."""

    def __init__(self, flood: int, steady: int, rate: float) -> None:
        self.flood, self.steady, self.rate = flood, steady, rate

    def initial(self) -> Iterator[Arrival]:
        rng = random.Random(1)
        out: list[Arrival] = []
        for i in range(self.flood):
            toks = [rng.randrange(150_000) for _ in range(400)]
            out.append((0.001 * i, WorkItem(f"b{i}", "us", len(toks), 200,
                                            hash_token_blocks(toks, BLOCK_SIZE))))
        for i in range(self.steady):
            toks = [rng.randrange(150_000) for _ in range(200)]
            out.append((0.5 + i / self.rate, WorkItem(f"i{i}", "us", len(toks), 50,
                                                      hash_token_blocks(toks, BLOCK_SIZE))))
        yield from sorted(out, key=lambda a: a[0])


def classify(rec: RequestRecord) -> tuple[str, str]:
    return ("web", "interactive") if rec.item.request_id[0] == "i" else ("bulk", "batch")


def run(fair: bool) -> tuple[float, int]:
    cfg = SimConfig(regions=["us"], replicas={"us": 2}, policy="least-load",
                    push_mode="sp-p", forwarding=False)
    sim = Simulation(cfg, FloodBeside(flood=600, steady=40, rate=2.0))
    if fair:
        sim.balancers["us"].tenancy = SimTenancy(
            FairQueue(CLASSES, max_wait_s={"batch": 600.0}, capacity=10_000), classify)
    sim.run()
    ttft = [r.t_first - r.t_arrival for r in sim.records if r.item.request_id[0] == "i"]
    done = sum(1 for r in sim.records if r.ok and r.item.request_id[0] == "b")
    return statistics.median(ttft), done


def test_fair_queue_in_the_simulator_keeps_interactive_ahead_of_a_flood() -> None:
    fcfs_ttft, fcfs_done = run(fair=False)
    fair_ttft, fair_done = run(fair=True)
    print(f"interactive TTFT p50: fcfs {fcfs_ttft:.3f} s, fair {fair_ttft:.3f} s")
    assert fair_done == fcfs_done == 600  # the flood is still served, all of it
    assert fair_ttft * 5 < fcfs_ttft, (fair_ttft, fcfs_ttft)
