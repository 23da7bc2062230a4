"""The simulator's replica and balancer: step-exact fast-forward, pushing modes, metrics."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from skymesh.policies import RouteRequest
from skymesh_lab.sim.cluster import RequestRecord, SimReplica
from skymesh_lab.sim.events import EventLoop
from skymesh_lab.sim.runner import SimConfig, Simulation, parse_replicas
from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_replica.engine.hashing import BLOCK_SIZE, hash_token_blocks
from skymesh_replica.engine.profiles import get_profile


class PoissonShared(Workload):
    """Open-loop arrivals whose prompts share a system prefix (test-local workload)."""

    def __init__(self, n: int, rate: float, regions: list[str], seed: int = 0) -> None:
        self.n, self.rate, self.regions, self.seed = n, rate, regions, seed

    def initial(self) -> Iterator[Arrival]:
        rng = random.Random(self.seed)
        shared = [7] * 320
        t = 0.0
        for i in range(self.n):
            t += rng.expovariate(self.rate)
            toks = shared + [rng.randrange(150_000) for _ in range(rng.randrange(50, 900))]
            yield t, WorkItem(f"r{i}", self.regions[i % len(self.regions)], len(toks),
                              rng.randrange(5, 300), hash_token_blocks(toks, BLOCK_SIZE))


def _replay(max_ff: int) -> dict[str, tuple[float, float]]:
    loop = EventLoop()
    seen: dict[str, list[float]] = {}

    def on_event(rep: SimReplica, rec: RequestRecord, ev) -> None:  # type: ignore[no-untyped-def]
        r = seen.setdefault(rec.item.request_id, [-1.0, -1.0])
        if ev.first_token:
            r[0] = loop.now
        if ev.finished:
            r[1] = loop.now

    rep = SimReplica("r0", "us", get_profile("llama3.1-8b-a100"), loop, on_event,
                     max_fast_forward=max_ff)
    for t, item in PoissonShared(80, 6.0, ["us"], seed=5).initial():
        rec = RequestRecord(item, RouteRequest(item.request_id), t)
        loop.at(t, rep.submit, rec)
    loop.run()
    return {k: (v[0], v[1]) for k, v in seen.items()}


def test_fast_forward_with_mid_batch_arrivals_is_step_exact() -> None:
    slow, fast = _replay(1), _replay(4096)
    assert len(slow) == 80 and slow.keys() == fast.keys()
    for rid, (ttft, done) in slow.items():
        assert fast[rid][0] == pytest.approx(ttft, abs=1e-9)
        assert fast[rid][1] == pytest.approx(done, abs=1e-9)


def _sim(mode: str, policy: str = "round-robin", n: int = 300, rate: float = 8.0,
         **kw: object) -> dict[str, object]:
    cfg = SimConfig(regions=["us"], replicas={"us": 4}, policy=policy, push_mode=mode,
                    **kw)  # type: ignore[arg-type]
    return Simulation(cfg, PoissonShared(n, rate, ["us"])).run()


def test_summary_has_the_contract_keys_and_sane_values() -> None:
    res = _sim("sp-p")
    for key in ("requests", "completed", "throughput_rps", "ttft_mean_s", "ttft_p50_s",
                "ttft_p90_s", "e2e_p50_s", "tpot_mean_s", "prefix_hit_rate", "sim_seconds",
                "wall_seconds"):
        assert key in res
    assert res["requests"] == res["completed"] == 300
    assert 0 < res["ttft_p50_s"] <= res["ttft_p90_s"] <= res["e2e_p50_s"] * 10
    assert 0.2 < res["prefix_hit_rate"] < 1.0  # the 320-token shared prefix is hit
    assert res["gpu_hours"] == pytest.approx(4 * res["sim_seconds"] / 3600)


def test_selective_pushing_keeps_the_queue_at_the_balancer() -> None:
    bp, spp = _sim("bp", rate=20.0), _sim("sp-p", rate=20.0)
    assert bp["max_balancer_queue"] == 0  # blind pushing never queues at the balancer
    assert spp["max_balancer_queue"] > 0


def test_runs_are_reproducible() -> None:
    a, b = _sim("sp-p", "random"), _sim("sp-p", "random")
    for key in ("throughput_rps", "ttft_p90_s", "prefix_hit_rate"):
        assert a[key] == b[key]


def test_parse_replicas() -> None:
    assert parse_replicas("12", ["us", "eu", "asia"]) == {"us": 4, "eu": 4, "asia": 4}
    assert parse_replicas("4", ["us", "eu", "asia"]) == {"us": 2, "eu": 1, "asia": 1}
    assert parse_replicas("us=3,eu=2", ["us", "eu", "asia"]) == {"us": 3, "eu": 2, "asia": 0}
    with pytest.raises(ValueError, match="mars"):
        parse_replicas("mars=1", ["us"])


class TooLong(Workload):
    def initial(self) -> Iterator[Arrival]:
        yield 0.0, WorkItem("ok", "us", 100, 10, [])
        yield 0.1, WorkItem("huge", "us", 10_000_000, 10, [])


def test_a_request_the_replica_refuses_ends_the_run_as_failed() -> None:
    cfg = SimConfig(regions=["us"], replicas={"us": 1})
    res = Simulation(cfg, TooLong()).run()
    assert res["requests"] == 2
    assert res["completed"] == 1
    assert res["failed"] == 1
