"""Build a simulated deployment from a config and run a workload through it.

One balancer per region (cross-region forwarding arrives with the mesh); clients of a
region talk to their own balancer, which places requests on its region's replicas with a
policy built by :func:`skymesh.policies.build_policy` from the same name and parameters
the live balancer takes.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skymesh.balancer.dispatch import DEFAULT_HOLD_S
from skymesh.balancer.siblings import FLUSH_S
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import DEFAULT_HOLD_QUEUE_MAX, DEFAULT_PREFER_QUEUE, PushMode
from skymesh.policies.peers import (
    DEFAULT_BALANCE_MARGIN,
    DEFAULT_FORWARDING_RULE,
    DEFAULT_LOCALITY_MARGIN,
    DEFAULT_RTT_WEIGHT,
    DEFAULT_TAU,
    Balancing,
    ForwardingRule,
)
from skymesh.prefix.trie import PrefixTrie
from skymesh.util.stats import summary
from skymesh_lab.sim.cluster import RequestRecord, SimBalancer, SimReplica
from skymesh_lab.sim.deadlines import DEFAULT_DEADLINE_PROFILE, alone_latency
from skymesh_lab.sim.events import EventLoop
from skymesh_lab.sim.lengths import LengthSource
from skymesh_lab.sim.metrics import spread
from skymesh_lab.sim.network import DEFAULT_RTT_MS, Network
from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_replica.engine.core import StepEvent
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile


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
    # sp-p's queue for the replica holding the prefix (None: the scheduler's default, as
    # the balancer YAML's ``pushing.prefer_queue`` by replica kind; 0: strict sp-p) and the
    # queue length that stops the hold (``hold_queue_max``; None: no limit).
    prefer_queue: int | None = None
    hold_queue_max: int | None = DEFAULT_HOLD_QUEUE_MAX
    # Cross-region forwarding (SkyLB's mesh). Off: region-local, each region on its own.
    forwarding: bool = True
    peer_policy: str = "prefix-tree"
    tau: int = DEFAULT_TAU
    # The mesh's forwarding rule and the balanced rule's parameters, as in the balancer
    # YAML's ``mesh`` section (skymesh.policies.peers).
    forwarding_rule: str = DEFAULT_FORWARDING_RULE.value
    balance_margin: float = DEFAULT_BALANCE_MARGIN
    locality_margin: float = DEFAULT_LOCALITY_MARGIN
    rtt_weight: float = DEFAULT_RTT_WEIGHT
    heartbeat_interval_s: float = 0.2
    profile: str = DEFAULT_PROFILE
    # The replicas' scheduler: "vllm" (v1) or "sglang" (v0.4.x; skymesh_replica.engine.sglang).
    scheduler: str = "vllm"
    seed: int = 0
    duration_s: float | None = None
    probe_interval_s: float = 0.1
    sample_interval_s: float = 1.0
    workload_params: dict[str, Any] = field(default_factory=dict)
    progress: bool = False
    # Heterogeneous fleets: per region, one profile name per replica (overrides
    # ``replicas`` and ``profile`` for the regions it names); see parse_profiles.
    replica_profiles: dict[str, list[str]] | None = None
    # Deadlines: every request gets deadline_scale x base seconds end to end, base being
    # deadline_base_s, or when None the request's own alone latency on deadline_profile.
    deadline_scale: float | None = None
    deadline_base_s: float | None = None
    deadline_profile: str = DEFAULT_DEADLINE_PROFILE
    # Predicted output lengths handed to the policy (skymesh_lab.sim.lengths).
    length_predictor: str = "none"
    length_noise: float = 0.5
    # SkyLB's single-balancer baselines: one balancer, in this region, in front of every
    # replica of every region; clients of all regions reach it across the RTTs. Implies
    # no forwarding. None: one balancer per region.
    single_balancer: str | None = None
    # Multiplies every inter-region RTT (0: no network cost between regions, for the
    # benchmarks' oracle); the client-to-balancer hop within a region is unchanged.
    rtt_scale: float = 1.0
    # skymesh-lb's listen.workers (skymesh.balancer.workers): each region's balancer as
    # this many workers behind one address. Each request goes to one at random (the kernel
    # spreads connections), each pushes with a 1/workers share of the free slots, and each
    # one's trie inserts reach its siblings' tries ``worker_share_s`` later (the live
    # share's batching, skymesh.balancer.siblings.FLUSH_S). Region-local only, as live.
    workers: int = 1
    worker_share_s: float = FLUSH_S
    # KV-cache events (docs/kv-events.md): every balancer reads the prefix state of its
    # replicas' caches (RouteRequest.exact_prefix) at a request's arrival as following the
    # engines' events gives it: each replica publishes its stores and evictions once per
    # step, applied ``kv_event_delay_s`` later (None: one engine step plus the one-way
    # delay to the balancer; skymesh_lab.sim.kv_view). False: each its own trie only.
    exact_prefix_state: bool = False
    kv_event_delay_s: float | None = None
    # Independent balancers per region (separate skymesh-lb processes): each its own
    # trie, each pushing with a 1/N share of the free slots, each client request to one
    # at random; with forwarding each is a mesh peer of every balancer in the other
    # regions. Not with ``workers`` > 1 nor a single balancer.
    balancers_per_region: int = 1


def with_exact_prefix(route: RouteRequest, replicas: Iterable[SimReplica]) -> RouteRequest:
    """``route`` with the blocks of its prompt each replica holds as far as its KV events
    have told (``SimReplica.kv_view``; a replica without one: its cache as it is now), and
    the replicas whose events say they dropped its leading block (``exact_lost``, as the
    daemon's ``kv_feed``)."""
    keys = route.prefix_keys
    replicas = list(replicas)
    lost = frozenset(r.id for r in replicas
                     if keys and r.kv_view is not None and r.kv_view.lost(keys[0]))
    return dataclasses.replace(
        route, exact_prefix={r.id: (len(r.engine.kv.match_prefix(keys)) if r.kv_view is None
                                    else r.kv_view.held(keys)) for r in replicas},
        exact_blocks=len(keys), exact_lost=lost)


def share_tries(loop: EventLoop, workers: list[SimBalancer], delay_s: float) -> None:
    """Workers of one balancer as live: each pushes as one of ``len(workers)`` balancers,
    and each insert into one's trie reaches the others' ``delay_s`` later."""
    for w in workers:
        w.dispatcher.balancers_per_region = len(workers)
    tries = [getattr(w.policy, "trie", None) for w in workers]
    if not all(isinstance(t, PrefixTrie) for t in tries):
        return  # a policy without a trie: nothing to share
    applying = [False]

    def apply(others: list[PrefixTrie], keys: list[int], target: str) -> None:
        applying[0] = True
        try:
            for t in others:
                t.insert(keys, target)
        finally:
            applying[0] = False

    for trie in tries:
        assert isinstance(trie, PrefixTrie)
        others = [t for t in tries if t is not trie and isinstance(t, PrefixTrie)]

        def record(keys: Sequence[int], target: str, others: list[PrefixTrie] = others
                   ) -> None:
            if not applying[0] and len(keys):
                loop.after(delay_s, apply, others, list(keys), target)
        trie.on_insert = record


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


def parse_profiles(spec: str, regions: list[str]) -> dict[str, list[str]]:
    """``"l4=2,a100=1,h100=1"`` -> that mix in every region; ``"us:l4=2,a100=1;eu:h100=2"``
    -> per region. A name is a profile (``llama3.1-8b-a100``) or its GPU suffix (``a100``)."""
    from skymesh_replica.engine.profiles import PROFILES

    def resolve(name: str) -> str:
        name = name.strip()
        if name in PROFILES:
            return name
        hits = [p for p in PROFILES if p.endswith("-" + name)]
        if len(hits) != 1:
            raise ValueError(f"--profiles: unknown or ambiguous profile {name!r}; "
                             f"known: {', '.join(sorted(PROFILES))}")
        return hits[0]

    def mix(part: str) -> list[str]:
        out: list[str] = []
        for item in part.split(","):
            name, sep, num = item.partition("=")
            try:
                n = int(num) if sep else 1
            except ValueError:
                raise ValueError(f"--profiles: bad count {num!r} for {name!r}") from None
            if n < 0:
                raise ValueError(f"--profiles: negative count for {name!r}")
            out += [resolve(name)] * n
        return out

    spec = spec.strip()
    if not spec:
        raise ValueError("--profiles: empty")
    if ":" not in spec:
        fleet = mix(spec)
        return {r: list(fleet) for r in regions}
    per: dict[str, list[str]] = {}
    for part in spec.split(";"):
        region, _, rest = part.partition(":")
        region = region.strip()
        if region not in regions:
            raise ValueError(f"--profiles: region {region!r} is not in {regions}")
        per[region] = mix(rest)
    return {r: per.get(r, []) for r in regions}


class Simulation:
    def __init__(self, cfg: SimConfig, workload: Workload) -> None:
        self.cfg = cfg
        self.workload = workload
        self.loop = EventLoop()
        if cfg.rtt_scale < 0:
            raise ValueError(f"rtt_scale must be >= 0, got {cfg.rtt_scale}")
        if cfg.single_balancer is not None and cfg.single_balancer not in cfg.regions:
            raise ValueError(f"single_balancer {cfg.single_balancer!r} is not in {cfg.regions}")
        if cfg.workers < 1 or (cfg.workers > 1 and (cfg.forwarding
                                                    or cfg.single_balancer is not None)):
            raise ValueError("workers: an integer >= 1; more than 1 only region-local "
                             "(no forwarding, no single balancer), as in skymesh-lb")
        if cfg.balancers_per_region < 1 or (cfg.balancers_per_region > 1 and (
                cfg.workers > 1 or cfg.single_balancer is not None)):
            raise ValueError("balancers_per_region: an integer >= 1; more than 1 not with "
                             "workers > 1 nor a single balancer")
        if cfg.rtt_scale == 1.0:
            self.net = Network()
        else:
            self.net = Network({k: v * cfg.rtt_scale for k, v in DEFAULT_RTT_MS.items()},
                               default_ms=150.0 * cfg.rtt_scale)
        self.profile = get_profile(cfg.profile)
        if cfg.deadline_scale is not None and not cfg.deadline_scale > 0:
            raise ValueError(f"deadline_scale must be > 0, got {cfg.deadline_scale}")
        self.deadline_profile = get_profile(cfg.deadline_profile)
        self.lengths = LengthSource(cfg.length_predictor, cfg.length_noise, cfg.seed)
        self.records: list[RequestRecord] = []
        self.outstanding = 0
        self.spread_samples: list[list[int]] = []
        self._arrivals: Iterator[Arrival] = iter(())
        self._arrivals_left = True
        rng = random.Random(cfg.seed)
        mode = PushMode(cfg.push_mode)
        prefer_queue = (DEFAULT_PREFER_QUEUE[cfg.scheduler] if cfg.prefer_queue is None
                        else cfg.prefer_queue)
        self.prefer_queue = prefer_queue  # in force: the result says which rule ran
        rule = ForwardingRule(cfg.forwarding_rule)
        balancing = Balancing(cfg.balance_margin, cfg.locality_margin, cfg.rtt_weight)
        self.replicas: list[SimReplica] = []
        self.balancers: dict[str, SimBalancer] = {}
        # Every worker of a region's balancer (the first is self.balancers[region]).
        self.workers: dict[str, list[SimBalancer]] = {}
        # Its own stream: one worker changes no other draw of the run.
        self._worker_rng = random.Random(cfg.seed ^ 0x5EED)
        for region in cfg.regions:
            if cfg.replica_profiles is not None and region in cfg.replica_profiles:
                names = cfg.replica_profiles[region]
            else:
                names = [cfg.profile] * cfg.replicas.get(region, 0)
            reps = [
                SimReplica(f"{region}-r{i}", region, get_profile(name), self.loop,
                           self._on_event, scheduler=cfg.scheduler)
                for i, name in enumerate(names)
            ]
            self.replicas.extend(reps)
            if cfg.exact_prefix_state:
                reader = cfg.single_balancer or region
                for r in reps:
                    r.follow_events(self.net.one_way(region, reader), cfg.kv_event_delay_s)
            if cfg.single_balancer is not None:
                continue  # one balancer for all, built below
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
                cfg.hold_s, peer_policy, cfg.tau, cfg.heartbeat_interval_s, rule, balancing,
                prefer_queue=prefer_queue, hold_queue_max=cfg.hold_queue_max,
            )
            count = max(cfg.workers, cfg.balancers_per_region)  # at most one is > 1
            if count > 1:
                tag = "w" if cfg.workers > 1 else ""
                self.workers[region] = [self.balancers[region], *(
                    SimBalancer(
                        f"lb-{region}-{tag}{i}", region, reps,
                        build_policy(cfg.policy, cfg.policy_params,
                                     rng=random.Random(rng.getrandbits(32))),
                        self.loop, self.net, mode, cfg.max_outstanding,
                        cfg.probe_interval_s, self._active, self._on_rejected, cfg.hold_s,
                        build_policy(cfg.peer_policy, rng=random.Random(rng.getrandbits(32)))
                        if cfg.forwarding else None,  # workers: never (region-local)
                        cfg.tau, cfg.heartbeat_interval_s, rule, balancing,
                        prefer_queue=prefer_queue, hold_queue_max=cfg.hold_queue_max)
                    for i in range(1, count))]
                if cfg.workers > 1:
                    share_tries(self.loop, self.workers[region], cfg.worker_share_s)
                else:
                    for b in self.workers[region]:
                        b.dispatcher.balancers_per_region = count
        if not self.replicas:
            raise ValueError("the simulation needs at least one replica")
        if cfg.single_balancer is not None:
            region = cfg.single_balancer
            self.balancers[region] = SimBalancer(
                f"lb-{region}", region, list(self.replicas),
                build_policy(cfg.policy, cfg.policy_params,
                             rng=random.Random(rng.getrandbits(32))),
                self.loop, self.net, mode, cfg.max_outstanding, cfg.probe_interval_s,
                self._active, self._on_rejected, cfg.hold_s, None, cfg.tau,
                cfg.heartbeat_interval_s,
                prefer_queue=prefer_queue, hold_queue_max=cfg.hold_queue_max,
            )
        elif cfg.forwarding:
            every = self._all_balancers()
            for bal in every:
                bal.connect([p for p in every if p.region != bal.region])
        self._models = {r.engine_model for r in self.replicas}

    def _all_balancers(self) -> list[SimBalancer]:
        out = list(self.balancers.values())
        for workers in self.workers.values():
            out += workers[1:]
        return out

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
        bal = self.balancers.get(self.cfg.single_balancer or item.region)
        if item.region in self.workers:
            bal = self._worker_rng.choice(self.workers[item.region])
        if bal is None:
            raise ValueError(
                f"workload sent a request to region {item.region!r}, which has no replicas; "
                "in region-local mode every region with clients needs replicas"
            )
        if item.model not in self._models:
            raise ValueError(f"workload asked for model {item.model!r}, which no replica serves")
        deadline = item.deadline_s
        cfg = self.cfg
        if deadline is None and cfg.deadline_scale is not None:
            base = cfg.deadline_base_s
            if base is None:
                base = alone_latency(self.deadline_profile, item.prompt_len, item.output_len)
            deadline = cfg.deadline_scale * base
        predicted = self.lengths.predict(item)
        route = RouteRequest(
            request_id=item.request_id,
            model=item.model,
            prompt_len=item.prompt_len,
            prefix_keys=item.prompt_block_hashes,
            affinity_key=item.affinity_key,
            deadline_s=deadline,
            predicted_output_tokens=predicted,
        )
        if self.cfg.exact_prefix_state:
            route = with_exact_prefix(route, bal.replicas.values())
        rec = RequestRecord(item, route, self.loop.now, deadline_s=deadline,
                            predicted_output=predicted)
        self.records.append(rec)
        self.outstanding += 1
        # Local hop, or the way across to the single balancer of that baseline.
        self.loop.after(self.net.one_way(item.region, bal.region), bal.arrive, rec)

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
        # ``here`` is now the origin balancer: the client's own region unless a single
        # balancer elsewhere serves it (then the response crosses back to the client).
        return delay + self.net.one_way(here, rec.item.region)

    def _on_event(self, rep: SimReplica, rec: RequestRecord, ev: StepEvent) -> None:
        now = self.loop.now
        if ev.first_token:
            rec.segment_hit_tokens = max(ev.seq.first_hit_tokens, 0)
            delay = self._back_along(rec, rep.region, "on_first_byte")
            if rec.t_first < 0:  # a migrated request's stream goes on: no second first token
                rec.hit_tokens = rec.segment_hit_tokens
                rec.t_first = now + delay
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
        self.lengths.observe(rec.item, rec.ok)
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
            "prefer_queue": self.prefer_queue,
            "hold_queue_max": self.cfg.hold_queue_max,
            "profile": self.cfg.profile,
            "scheduler": self.cfg.scheduler,
            "regions": {reg: self.cfg.replicas.get(reg, 0) for reg in self.cfg.regions},
            "seed": self.cfg.seed,
            "requests": len(recs),
            "completed": len(done),
            "failed": sum(1 for r in recs if r.error),
            "throughput_rps": len(done) / sim_seconds,
            "output_tokens_per_s": out_tokens / sim_seconds,
            "input_tokens_per_s": in_tokens / sim_seconds,
        }
        res.update(summary(ttft, prefix="ttft_", suffix="_s"))
        res.update(summary(e2e, prefix="e2e_", suffix="_s"))
        res.update(summary(tpot, (90,), prefix="tpot_", suffix="_s"))
        res["prefix_hit_rate"] = h / q if q else 0.0
        res.update(spread(self.spread_samples))
        res["preemptions"] = sum(r.engine.stats.num_preemptions for r in self.replicas)
        res["max_balancer_queue"] = max((b.max_queue for b in self._all_balancers()),
                                        default=0)
        res["forwarding"] = self.cfg.forwarding
        res["region_stats"] = {
            region: {
                "clients_requests": sum(1 for r in recs if r.item.region == region),
                "served": sum(1 for r in done if r.served_region == region),
                "forwarded_out": sum(b.forwarded_out for b in self.workers.get(region, [bal])),
                "forwarded_in": sum(b.forwarded_in for b in self.workers.get(region, [bal])),
            }
            for region, bal in self.balancers.items()
        }
        res["gpu_hours"] = sum(r.profile.num_gpus for r in self.replicas) * sim_seconds / 3600.0
        res["sim_seconds"] = sim_seconds
        res["wall_seconds"] = wall
        res["speedup"] = sim_seconds / wall if wall > 0 else 0.0
        res["events"] = self.loop.processed
        res["per_replica"] = per_replica
        if len({r.profile.name for r in self.replicas}) > 1 or self.cfg.replica_profiles:
            res["replica_profiles"] = {r.id: r.profile.name for r in self.replicas}
        res.update(goodput_stats(recs, sim_seconds))
        predicted = [(r.predicted_output, r.item.output_len) for r in recs
                     if r.predicted_output is not None]
        if predicted:
            res["predicted_length_mae"] = sum(abs(p - t) for p, t in predicted) / len(predicted)
        res["migrations"] = sum(b.migrations for b in self._all_balancers())
        return res


def goodput_stats(recs: list[RequestRecord], sim_seconds: float) -> dict[str, Any]:
    """GoodServe's metrics over the requests that carry a deadline: goodput (requests done
    within their deadline per second of the window in which requests arrived, so routers
    that leave a longer backlog to drain are not also charged for the drain) and the share
    that missed or failed."""
    with_deadline = [r for r in recs if r.deadline_s is not None]
    if not with_deadline:
        return {}
    met = sum(1 for r in with_deadline
              if r.ok and r.t_done - r.t_arrival <= (r.deadline_s or 0.0))
    window = max((r.t_arrival for r in recs), default=0.0)
    out: dict[str, Any] = {
        "deadline_requests": len(with_deadline),
        "slo_met": met,
        "goodput_rps": met / (window if window > 0 else sim_seconds),
        "slo_violation_rate": 1.0 - met / len(with_deadline),
    }
    return out


def run(cfg: SimConfig, workload: Workload | None = None,
        extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if workload is None:
        from skymesh_lab.sim.workloads import build_workload

        workload = build_workload(
            cfg.workload, regions=[r for r in cfg.regions if cfg.replicas.get(r, 0) > 0]
            or cfg.regions, seed=cfg.seed, duration_s=cfg.duration_s, **cfg.workload_params,
        )
    return Simulation(cfg, workload).run()
