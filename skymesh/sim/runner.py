"""Build a simulated deployment from a config and run a workload through it.

One balancer per region (cross-region forwarding arrives with the mesh); clients of a
region talk to their own balancer, which places requests on its region's replicas with a
policy built by :func:`skymesh.policies.build_policy` from the same name and parameters
the live balancer takes.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from skymesh.balancer.dispatch import DEFAULT_HOLD_S
from skymesh.engine.core import StepEvent
from skymesh.engine.profiles import DEFAULT_PROFILE, get_profile
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import DEFAULT_TAU
from skymesh.sim.cluster import RequestRecord, SimBalancer, SimReplica
from skymesh.sim.events import EventLoop
from skymesh.sim.metrics import percentiles, spread
from skymesh.sim.network import Network
from skymesh.sim.workload import Arrival, WorkItem, Workload


@dataclass
class SimConfig:
    workload: str = "poisson"
    regions: list[str] = field(default_factory=lambda: ["us", "eu", "asia"])
    replicas: dict[str, int] = field(default_factory=lambda: {"us": 1, "eu": 1, "asia": 1})
    policy: str = "least-load"
    policy_params: dict[str, Any] = field(default_factory=dict)
    push_mode: str = "sp-p"
    max_outstanding: int = 16
    hold_s: float = DEFAULT_HOLD_S
    # Cross-region forwarding (SkyLB's mesh). Off: region-local, each region on its own.
    forwarding: bool = True
    peer_policy: str = "prefix-tree"
    tau: int = DEFAULT_TAU
    heartbeat_interval_s: float = 0.2
    profile: str = DEFAULT_PROFILE
    seed: int = 0
    duration_s: float | None = None
    probe_interval_s: float = 0.1
    sample_interval_s: float = 1.0
    workload_params: dict[str, Any] = field(default_factory=dict)
    progress: bool = False


def spread_replicas(regions: list[str], total: int) -> dict[str, int]:
    """``total`` replicas spread evenly over ``regions`` (earlier regions get the rest)."""
    base, extra = divmod(total, len(regions))
    return {r: base + (1 if i < extra else 0) for i, r in enumerate(regions)}


def parse_replicas(spec: str, regions: list[str]) -> dict[str, int]:
    """``"12"`` or ``"us=4,eu=4,asia=4"``."""
    spec = spec.strip()
    if "=" not in spec:
        try:
            n = int(spec)
        except ValueError:
            raise ValueError(f"--replicas: expected N or region=N,..., got {spec!r}") from None
        if n < 1:
            raise ValueError("--replicas: need at least one replica")
        return spread_replicas(regions, n)
    out: dict[str, int] = {}
    for part in spec.split(","):
        name, _, num = part.partition("=")
        name = name.strip()
        if name not in regions:
            raise ValueError(f"--replicas: region {name!r} is not in --regions {regions}")
        try:
            out[name] = int(num)
        except ValueError:
            raise ValueError(f"--replicas: bad count {num!r} for region {name!r}") from None
    return {r: out.get(r, 0) for r in regions}


class Simulation:
    def __init__(self, cfg: SimConfig, workload: Workload) -> None:
        self.cfg = cfg
        self.workload = workload
        self.loop = EventLoop()
        self.net = Network()
        self.profile = get_profile(cfg.profile)
        self.records: list[RequestRecord] = []
        self.outstanding = 0
        self.spread_samples: list[list[int]] = []
        self._arrivals: Iterator[Arrival] = iter(())
        self._arrivals_left = True
        rng = random.Random(cfg.seed)
        mode = PushMode(cfg.push_mode)
        self.replicas: list[SimReplica] = []
        self.balancers: dict[str, SimBalancer] = {}
        for region in cfg.regions:
            reps = [
                SimReplica(f"{region}-r{i}", region, self.profile, self.loop, self._on_event)
                for i in range(cfg.replicas.get(region, 0))
            ]
            self.replicas.extend(reps)
            if not reps and not cfg.forwarding:
                continue
            policy = build_policy(
                cfg.policy, cfg.policy_params, rng=random.Random(rng.getrandbits(32))
            )
            peer_policy = (build_policy(cfg.peer_policy, rng=random.Random(rng.getrandbits(32)))
                           if cfg.forwarding else None)
            self.balancers[region] = SimBalancer(
                f"lb-{region}", region, reps, policy, self.loop, self.net, mode,
                cfg.max_outstanding, cfg.probe_interval_s, self._active, self._on_rejected,
                cfg.hold_s, peer_policy, cfg.tau, cfg.heartbeat_interval_s,
            )
        if not self.replicas:
            raise ValueError("the simulation needs at least one replica")
        if cfg.forwarding:
            for bal in self.balancers.values():
                bal.connect(list(self.balancers.values()))
        self._models = {r.engine_model for r in self.replicas}

    def _active(self) -> bool:
        return self.outstanding > 0 or self._arrivals_left

    # -- arrivals ----------------------------------------------------------------------
    def _next_arrival(self) -> None:
        for t, item in self._arrivals:
            self.loop.at(t, self._arrive, item, True)
            return
        self._arrivals_left = False

    def _arrive(self, item: WorkItem, from_stream: bool = False) -> None:
        if from_stream:
            self._next_arrival()
        bal = self.balancers.get(item.region)
        if bal is None:
            raise ValueError(
                f"workload sent a request to region {item.region!r}, which has no replicas; "
                "in region-local mode every region with clients needs replicas"
            )
        if item.model not in self._models:
            raise ValueError(f"workload asked for model {item.model!r}, which no replica serves")
        route = RouteRequest(
            request_id=item.request_id,
            model=item.model,
            prompt_len=item.prompt_len,
            prefix_keys=item.prompt_block_hashes,
            affinity_key=item.affinity_key,
            deadline_s=item.deadline_s,
        )
        rec = RequestRecord(item, route, self.loop.now)
        self.records.append(rec)
        self.outstanding += 1
        self.loop.after(self.net.local_one_way_s, bal.arrive, rec)

    # -- replica events ----------------------------------------------------------------
    def _back_along(self, rec: RequestRecord, from_region: str, fn_name: str,
                    *args: object) -> float:
        """Deliver an event back along the request's path (serving balancer first, then
        the origin); returns the delay until the client sees it."""
        delay = 0.0
        here = from_region
        for bal, ticket in reversed(rec.path):
            delay += self.net.one_way(here, bal.region)
            self.loop.after(delay, getattr(bal, fn_name), ticket, *args)
            here = bal.region
        return delay + self.net.local_one_way_s

    def _on_event(self, rep: SimReplica, rec: RequestRecord, ev: StepEvent) -> None:
        now = self.loop.now
        if ev.first_token:
            rec.hit_tokens = max(ev.seq.first_hit_tokens, 0)
            rec.t_first = now + self._back_along(rec, rep.region, "on_first_byte")
        if ev.finished:
            rec.ok = True
            rec.served_region = rep.region
            rec.t_done = now + self._back_along(rec, rep.region, "on_done", True)
            self.loop.at(rec.t_done, self._client_done, rec)

    def _on_rejected(self, rec: RequestRecord) -> None:
        region = rec.path[-1][0].region
        rec.t_done = self.loop.now + self._back_along(rec, region, "on_done", False)
        self.loop.at(rec.t_done, self._client_done, rec)

    def _client_done(self, rec: RequestRecord) -> None:
        self.outstanding -= 1
        for t, item in self.workload.on_complete(rec.item, self.loop.now, rec.ok):
            self.loop.at(t, self._arrive, item)

    def _sample(self) -> None:
        self.spread_samples.append(
            [r.engine.num_running + r.engine.num_waiting for r in self.replicas]
        )
        if self._active():
            self.loop.after(self.cfg.sample_interval_s, self._sample)

    # -- run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        wall0 = time.perf_counter()
        self._arrivals = iter(self.workload.initial())
        self._next_arrival()
        self.loop.at(0.0, self._sample)
        bar = None
        if self.cfg.progress:
            from tqdm import tqdm

            total = self.cfg.duration_s
            bar = tqdm(total=total, unit="sim-s", file=sys.stderr, leave=False,
                       bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt} sim-s [{elapsed}]")

        def tick(t: float) -> None:
            if bar is not None:
                bar.n = min(t, bar.total) if bar.total else t
                bar.refresh()

        self.loop.run(on_tick=tick)
        if bar is not None:
            bar.close()
        return self.summary(time.perf_counter() - wall0)

    def summary(self, wall: float) -> dict[str, Any]:
        recs = self.records
        done = [r for r in recs if r.ok]
        sim_seconds = max((r.t_done for r in done), default=self.loop.now)
        sim_seconds = max(sim_seconds, 1e-9)
        ttft = [r.t_first - r.t_arrival for r in done]
        e2e = [r.t_done - r.t_arrival for r in done]
        tpot = [
            (r.t_done - r.t_first) / (r.item.output_len - 1) for r in done if r.item.output_len > 1
        ]
        q = sum(r.engine.stats.prefix_query_tokens for r in self.replicas)
        h = sum(r.engine.stats.prefix_hit_tokens for r in self.replicas)
        out_tokens = sum(r.item.output_len for r in done)
        in_tokens = sum(r.item.prompt_len for r in done)
        per_replica = {
            r.id: {
                "completed": r.engine.stats.num_finished,
                "preemptions": r.engine.stats.num_preemptions,
                "prefix_hit_rate": (r.engine.stats.prefix_hit_tokens
                                    / max(1, r.engine.stats.prefix_query_tokens)),
                "busy_fraction": r.engine.stats.busy_time / sim_seconds,
            }
            for r in self.replicas
        }
        res: dict[str, Any] = {
            "workload": self.cfg.workload,
            "policy": self.cfg.policy,
            "push_mode": self.cfg.push_mode,
            "profile": self.cfg.profile,
            "regions": {reg: self.cfg.replicas.get(reg, 0) for reg in self.cfg.regions},
            "seed": self.cfg.seed,
            "requests": len(recs),
            "completed": len(done),
            "failed": sum(1 for r in recs if r.error),
            "throughput_rps": len(done) / sim_seconds,
            "output_tokens_per_s": out_tokens / sim_seconds,
            "input_tokens_per_s": in_tokens / sim_seconds,
        }
        res.update(percentiles(ttft, "ttft"))
        res.update(percentiles(e2e, "e2e"))
        tp = percentiles(tpot, "tpot")
        res["tpot_mean_s"] = tp["tpot_mean_s"]
        res["tpot_p90_s"] = tp["tpot_p90_s"]
        res["prefix_hit_rate"] = h / q if q else 0.0
        res.update(spread(self.spread_samples))
        res["preemptions"] = sum(r.engine.stats.num_preemptions for r in self.replicas)
        res["max_balancer_queue"] = max((b.max_queue for b in self.balancers.values()), default=0)
        res["forwarding"] = self.cfg.forwarding
        res["region_stats"] = {
            region: {
                "clients_requests": sum(1 for r in recs if r.item.region == region),
                "served": sum(1 for r in done if r.served_region == region),
                "forwarded_out": bal.forwarded_out,
                "forwarded_in": bal.forwarded_in,
            }
            for region, bal in self.balancers.items()
        }
        res["gpu_hours"] = len(self.replicas) * self.profile.num_gpus * sim_seconds / 3600.0
        res["sim_seconds"] = sim_seconds
        res["wall_seconds"] = wall
        res["speedup"] = sim_seconds / wall if wall > 0 else 0.0
        res["events"] = self.loop.processed
        res["per_replica"] = per_replica
        return res


def run(cfg: SimConfig, workload: Workload | None = None,
        extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if workload is None:
        from skymesh.sim.workloads import build_workload

        workload = build_workload(
            cfg.workload, regions=[r for r in cfg.regions if cfg.replicas.get(r, 0) > 0]
            or cfg.regions, seed=cfg.seed, duration_s=cfg.duration_s, **cfg.workload_params,
        )
    return Simulation(cfg, workload).run()
