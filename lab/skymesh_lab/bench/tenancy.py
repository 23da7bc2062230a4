"""What the balancer's tenancy (skymesh.balancer.tenancy, docs/tenancy.md) does, in the
simulator with the live balancer's ``FairQueue`` and release rule (``SimBalancer.tenancy``)
and, for the limits, with the pure buckets on a fake clock:

- ``flood``: an interactive tenant at a steady rate beside a batch tenant that floods the
  region at once; the interactive TTFT with first come first served, with the fair queue,
  with the fair queue and its slot reserve (``tenants.reserve``'s default, adaptive, and
  the fixed quarter it replaced), and with no flood at all; the batch tenant's
  completions and tokens/s (to its last, and while the interactive tenant sends); the
  batch class's longest wait. Replicas admit ``SEQS`` requests each (``max_num_seqs``,
  known to the balancer as a live engine publishes it), so the reserve has slots to count.
- ``light``: the same with the interactive tenant at ``LIGHT_RATE``: a fixed reserve
  keeps slots idle that an adaptive one gives the batch tenant.
- ``tail``: where the interactive TTFT goes under the flood, per request: waiting in the
  fair queue, in the dispatcher's queue (and the hop to the replica), for admission inside
  the engine (the step in progress, or a full replica), and its prefill step(s), with the
  batch prefills that shared them; the mean of all requests and of the slowest 5%.
- ``engine``: one emulated replica's batch throughput (the same ``Engine`` and profile in
  the simulator and ``skymesh-replica``) with ``n`` batch requests running at once, kept
  full: how far below linear in ``n`` it is (prefill is a fixed cost per request).
- ``lull``: the flood, with the interactive tenant silent for ``LULL_S`` between two
  bursts: the fair queue alone and the reserve lapsing after several ``reserve_idle_s``
  (the first interactive requests after the lull against the batch tenant's throughput).
- ``share``: two tenants of equal weight in one class, one sending 10x the other, both
  backlogged from the start; the service (prompt + output tokens finished) each received
  per window while both were backlogged, FCFS against the fair queue.
- ``limits``: a tenant at 3x its ``requests_per_s`` through two balancers (each holds half
  the limit), spread evenly and all to one; the admitted rate against the limit.

``--live`` runs the flood again on a real ``skymesh-lb`` in front of two emulated replicas
(``skymesh-replica --max-num-seqs SEQS --time-scale LIVE_TIME_SCALE``) over loopback, one
balancer per arm: the same shapes, the interactive rate scaled with the replicas' speed
and the flood cut to ``LIVE_FLOOD`` so an arm takes about a minute. Wall-clock figures on
a shared machine: the interactive TTFT carries the loopback and the balancer's own time.

Each live arm also records, per phase (while pacing may hold: to ``reserve_window_s``
after the interactive tenant's last request; and after), the batch requests started per
second per replica (from the replicas' prompt-token counters) and the requests running
per replica, how much of the batch run the reserve could hold (``reserve_idle_s``), and
the balancer's ``skymesh_tenant_reserve_held_total``.

    python -m skymesh_lab.bench.tenancy --json out.json [--seeds 0,1,2,3,4] [--live]
        [--live-seeds 0,1]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import os
import random
import statistics
import time
from collections.abc import Container, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.balancer.config import (
    AUTO_RESERVE,
    DEFAULT_RESERVE,
    DEFAULT_RESERVE_FALL_GAPS,
    DEFAULT_RESERVE_HEADROOM,
)
from skymesh.balancer.tenancy import FairQueue, Reserve, Tenant, Waiter
from skymesh.balancer.tenant_limits import Limiter, TenantLimited
from skymesh_lab.faults.cluster import (
    MODEL,
    metrics,
    start_lb,
    start_replicas,
    wait_for,
)
from skymesh_lab.sim.cluster import RequestRecord, SimTenancy
from skymesh_lab.sim.runner import SimConfig, Simulation
from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_replica.engine.batch import Sequence
from skymesh_replica.engine.core import Engine
from skymesh_replica.engine.hashing import BLOCK_SIZE, hash_token_blocks
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile

CLASSES = ("interactive", "standard", "batch")
MAX_WAIT_S = {"standard": 10.0, "batch": 60.0}  # the configuration's defaults
FLOOD, STEADY, RATE = 600, 60, 2.0
SEQS = 16  # each replica's max_num_seqs
RESERVE_IDLE_S = 120.0  # tenants.reserve_idle_s's default
RESERVE_WINDOW_S = 10.0  # tenants.reserve_window_s's default
FIXED_IDLE_S = 30.0  # reserve_idle_s's default with the fixed reserve, before
RESERVE_PACE = 1  # tenants.reserve_pace's default
# The default reserve (adaptive), and the fixed quarter it replaced.
RESERVE = Reserve(CLASSES, {}, RESERVE_IDLE_S, RESERVE_PACE, adaptive=frozenset({"batch"}),
                  headroom=DEFAULT_RESERVE_HEADROOM, pace_s=RESERVE_WINDOW_S)
# As before: paced for as long as the reserve held.
FIXED = replace(RESERVE, fractions={"batch": DEFAULT_RESERVE}, adaptive=frozenset(),
                idle_s=FIXED_IDLE_S, pace_s=FIXED_IDLE_S)
# The reserve arms by reserve_pace: the default, and two looser ones (the trade-off of
# pacing, batch throughput against the interactive tail). None: no pacing.
PACES: dict[str, int | None] = {"fair_reserve": RESERVE_PACE, "fair_reserve_pace2": 2,
                                "fair_reserve_nopace": None}
# The default reserve with another reserve_headroom (the frontier of batch throughput
# against the interactive TTFT).
HEADROOMS: dict[str, float] = {"fair_reserve_h1": 1.0, "fair_reserve_h125": 1.25}
# The reserve by arrivals (tenants.reserve_miss): the share of interactive requests that
# may find no slot free, sized from their arrival rate against the rate slots free up.
MISSES: dict[str, float] = {"fair_reserve_miss005": 0.005, "fair_reserve_miss01": 0.01}
# The reserve by load counting the slots the interactive requests hold
# (tenants.reserve_held): their part, in service and free together, is reserve_headroom x
# their mean in service, so the slots kept free shrink as they take them.
HELD = "fair_reserve_held"
# The default reserve whose mean of the interactive requests in service falls within
# this long (tenants.reserve_fall_s) instead of reserve_window_s: it gives the slots of a
# falling interactive load back sooner (the mean sat near the load's recent peak, and for
# about twice reserve_window_s after the interactive tenant's last request).
FALLS: dict[str, float] = {"fair_reserve_fall15": 1.5}
# The default reserve's mean falls over DEFAULT_RESERVE_FALL_GAPS of the interactive
# tenant's mean inter-arrival gaps (tenants.reserve_fall_gaps), at most over
# reserve_window_s; the arm here sets it otherwise: None, over reserve_window_s whatever
# the rate (the default before).
FALL_GAPS: dict[str, float | None] = {"fair_reserve_fallwindow": None}
FLOOD_ARMS: tuple[str, ...] = ("no_flood", "fcfs", "fair", "fair_reserve",
                               "fair_reserve_fixed", "fair_reserve_pace2",
                               "fair_reserve_nopace", *HEADROOMS, *MISSES, HELD, *FALLS,
                               *FALL_GAPS)
LIGHT_RATE = 0.5  # the interactive rate of the light arms
LIGHT_ARMS = ("no_flood", "fcfs", "fair_reserve", "fair_reserve_fixed", *FALLS, *FALL_GAPS)
TAIL_ARMS = ("fair_reserve", "fair_reserve_fixed")
TAIL_SHARE = 0.05  # the slowest 5% of the interactive requests
ENGINE_SEQS = (9, 12, 16)
LIVE_TIME_SCALE, LIVE_FLOOD = 0.5, 200
WEB_KEY, BULK_KEY = "sk-bench-web", "sk-bench-bulk"
# The lull: two bursts of interactive requests LULL_S apart; the first LULL_FIRST after it.
LULL_BURST, LULL_S, LULL_FIRST = 20, 60.0, 3
LULL_IDLE_S: tuple[float | None, ...] = (None, 10.0, 30.0, 120.0)
HEAVY, LIGHT, WINDOW_S = 1000, 100, 5.0
LIMIT_RPS, OFFERED_X, LIMIT_RUN_S = 10.0, 3.0, 60.0


def _item(rng: random.Random, rid: str, prompt: int, output: int) -> WorkItem:
    toks = [rng.randrange(150_000) for _ in range(prompt)]
    return WorkItem(rid, "us", len(toks), output, hash_token_blocks(toks, BLOCK_SIZE))


class _Arrivals(Workload):
    def __init__(self, arrivals: list[Arrival]) -> None:
        self.arrivals = sorted(arrivals, key=lambda a: a[0])

    def initial(self) -> Iterator[Arrival]:
        yield from self.arrivals


class _WatchedQueue(FairQueue):
    """The fair queue, noting per class the longest wait from arrival to release and the
    longest time the class went unserved while it had a waiter (what the aging guard
    bounds: its head's wait, not the wait behind its own backlog)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.longest: dict[str, float] = {}
        self.head: dict[str, float] = {}
        self._served: dict[str, float] = {}

    def pop(self, model: str, now: float, held: Container[str] = ()) -> Waiter | None:
        w = super().pop(model, now, held)
        if w is not None:
            self.longest[w.cls] = max(self.longest.get(w.cls, 0.0), now - w.since)
            became_head = max(w.since, self._served.get(w.cls, 0.0))
            self.head[w.cls] = max(self.head.get(w.cls, 0.0), now - became_head)
            self._served[w.cls] = now
        return w


def _reserve(arm: str) -> Reserve | None:
    if arm == "fair_reserve_fixed":
        return FIXED
    if arm in HEADROOMS:
        return replace(RESERVE, headroom=HEADROOMS[arm])
    if arm in MISSES:
        return replace(RESERVE, miss=MISSES[arm])
    if arm == HELD:
        return replace(RESERVE, held=True)
    if arm in FALLS or arm in FALL_GAPS:
        return RESERVE
    if arm not in PACES:
        return None
    pace = PACES[arm]
    return replace(RESERVE, pace=pace) if pace is not None else replace(RESERVE, pace=1 << 20)


def _is_prefill(seq: Sequence, n: int) -> bool:
    return not (n == 1 and seq.num_output > 0)  # as Engine.timed tells decodes


class _Trace:
    """Per interactive request: when the fair queue let it go, when it reached its
    replica's engine, when the engine first scheduled it and for how long its prefill
    step(s) ran, with the batch prefills (and their tokens) that shared them; and whether
    a step with batch prefill was running as it arrived. Wraps the replicas' ``submit``
    and their engines' ``timed`` (what they compute is unchanged)."""

    def __init__(self) -> None:
        self.at: dict[str, dict[str, Any]] = {}

    def follow(self, sim: Simulation, queue: _WatchedQueue | None) -> None:
        loop = sim.loop
        for rep in sim.balancers["us"].replicas.values():
            running: list[Any] = [None]  # the step in progress: (its batch prefills)
            submit, timed = rep.submit, rep.engine.timed

            def on_submit(rec: RequestRecord, submit: Any = submit,
                          running: list[Any] = running) -> str | None:
                if _tenant_of_id(rec) == "web":
                    d = self.at.setdefault(rec.item.request_id, {})
                    d["delivered"] = loop.now
                    d["batch_prefill_running"] = bool(running[0])
                return submit(rec)

            def on_timed(entries: list[tuple[Sequence, int]], timed: Any = timed,
                         running: list[Any] = running) -> Any:
                batch = timed(entries)
                bulk = [n for seq, n in entries
                        if seq.request_id.startswith("bulk") and _is_prefill(seq, n)]
                running[0] = bulk
                for seq, n in entries:
                    if seq.request_id.startswith("web") and _is_prefill(seq, n):
                        d = self.at.setdefault(seq.request_id, {})
                        d.setdefault("admitted", loop.now)
                        d["prefill_s"] = d.get("prefill_s", 0.0) + batch.duration
                        d["batch_prefills"] = d.get("batch_prefills", 0) + len(bulk)
                return batch

            rep.submit = on_submit  # type: ignore[method-assign]
            rep.engine.timed = on_timed  # type: ignore[method-assign]
        if queue is not None:
            pop = queue.pop

            def on_pop(model: str, now: float, held: Container[str] = ()) -> Waiter | None:
                w = pop(model, now, held)
                if w is not None and w.tenant == "web":
                    rec: RequestRecord = w.payload.payload
                    self.at.setdefault(rec.item.request_id, {})["released"] = now
                return w

            queue.pop = on_pop  # type: ignore[method-assign]

    def parts(self, rec: RequestRecord) -> dict[str, float]:
        """Its TTFT in parts (seconds; they add up to it, the reply's hop in the last)."""
        d = self.at[rec.item.request_id]
        released = d.get("released", rec.t_arrival)
        return {"ttft_s": rec.t_first - rec.t_arrival,
                "fair_queue_s": released - rec.t_arrival,
                "dispatch_s": d["delivered"] - released,
                "engine_wait_s": d["admitted"] - d["delivered"],
                "prefill_s": rec.t_first - d["admitted"],
                "batch_prefills": float(d.get("batch_prefills", 0)),
                "batch_prefill_running": float(d["batch_prefill_running"])}


def _sim(arrivals: list[Arrival], classify: Any, arm: str, seed: int,
         seqs: int | None = None, reserve: Reserve | None = None,
         trace: _Trace | None = None, window_s: float = RESERVE_WINDOW_S
         ) -> tuple[Simulation, _WatchedQueue | None]:
    """``reserve``: this one instead of the arm's (the fair queue with it); ``trace``:
    follows the interactive requests through the balancer and the engines; ``window_s``:
    tenants.reserve_window_s (the queue's rates and its mean's slowest fall, as
    ``queue_of`` sets them; the reserve's pacing window is the reserve's own)."""
    cfg = SimConfig(regions=["us"], replicas={"us": 2}, policy="least-load",
                    push_mode="sp-p", forwarding=False, seed=seed)
    sim = Simulation(cfg, _Arrivals(arrivals))
    lb = sim.balancers["us"]
    for rid, rep in lb.replicas.items() if seqs else ():
        assert seqs is not None
        rep.profile = rep.engine.profile = replace(rep.profile, max_num_seqs=seqs)
        lb.dispatcher.targets[rid].load.max_num_seqs = seqs  # as a live engine publishes
    queue = None
    if arm not in ("fcfs", "no_flood") or reserve is not None:
        queue = _WatchedQueue(CLASSES, max_wait_s=MAX_WAIT_S, capacity=100_000,
                              started=0.0)
        queue.flow.tau_s = window_s  # as queue_of sets
        queue.occupancy.fall_s = FALLS.get(arm, window_s)
        queue.occupancy.fall_gaps = FALL_GAPS.get(arm, DEFAULT_RESERVE_FALL_GAPS)
        lb.tenancy = SimTenancy(queue, classify,
                                reserve=reserve or _reserve(arm))
    if trace is not None:
        trace.follow(sim, queue)
    sim.run()
    return sim, queue


def _fall_keys(arm: str) -> dict[str, float | None]:
    """The arm's tenants.reserve_fall_s and reserve_fall_gaps, when it sets them."""
    if arm in FALLS:
        return {"reserve_fall_s": FALLS[arm]}
    if arm in FALL_GAPS:
        return {"reserve_fall_gaps": FALL_GAPS[arm]}
    return {}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _tenant_of_id(rec: RequestRecord) -> str:
    return rec.item.request_id.split("-")[0]


def _flood_sim(seed: int, arm: str, rate: float = RATE, trace: _Trace | None = None,
               reserve: Reserve | None = None, window_s: float = RESERVE_WINDOW_S,
               alone: bool = False) -> tuple[Simulation, _WatchedQueue | None, float]:
    """The flood run, and the interactive tenant's last arrival (``reserve``,
    ``window_s``: as :func:`_sim` takes them; ``alone``: the flood's interactive
    arrivals, the same draw, without its batch requests)."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    if arm != "no_flood":
        bulk = [(0.001 * i, _item(rng, f"bulk-{i}", 400, 200)) for i in range(FLOOD)]
        arrivals += [] if alone else bulk
    t = last = 0.5
    for i in range(STEADY):
        arrivals.append((t, _item(rng, f"web-{i}", 200, 50)))
        last = t
        t += rng.expovariate(rate)

    def classify(rec: RequestRecord) -> tuple[str, str]:
        return ("web", "interactive") if _tenant_of_id(rec) == "web" else ("bulk", "batch")

    sim, queue = _sim(arrivals, classify, arm, seed, SEQS, reserve, trace, window_s)
    return sim, queue, last


def flood_run(seed: int, arm: str, rate: float = RATE) -> dict[str, Any]:
    sim, queue, last = _flood_sim(seed, arm, rate)
    return flood_figures(sim, queue, last, seed, arm, rate)


def flood_figures(sim: Simulation, queue: _WatchedQueue | None, last: float, seed: int,
                  arm: str, rate: float = RATE) -> dict[str, Any]:
    """A flood run's figures (:func:`flood_run`'s row)."""
    web = [r for r in sim.records if _tenant_of_id(r) == "web"]
    bulk = [r for r in sim.records if _tenant_of_id(r) == "bulk"]
    ttft = [r.t_first - r.t_arrival for r in web if r.ok]
    done = [r for r in bulk if r.ok]
    end = max((r.t_done for r in done), default=0.0)
    out: dict[str, Any] = {
        "seed": seed, "arm": arm, "interactive_rate_per_s": rate,
        "interactive_sent": len(web), "interactive_last_arrival_s": last,
        "interactive_ok": len(ttft), "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": _pct(ttft, 0.99), "batch_sent": FLOOD if arm != "no_flood" else 0,
        "batch_completed": len(done), "batch_last_done_s": end,
        "batch_tokens_per_s": (sum(r.item.prompt_len + r.item.output_len for r in done) / end
                               if end else None),
        # While the interactive tenant sends (to its last arrival): the capacity it
        # leaves, which first come first served gives the flood whole.
        "batch_tokens_per_s_while_interactive": (
            sum(r.item.prompt_len + r.item.output_len for r in done if r.t_done <= last)
            / last if done else None)}
    if arm in HEADROOMS:
        out["reserve_headroom"] = HEADROOMS[arm]
    if arm in MISSES:
        out["reserve_miss"] = MISSES[arm]
    out.update(_fall_keys(arm))
    if queue is not None:
        out["batch_longest_wait_s"] = queue.longest.get("batch", 0.0)
        out["batch_longest_unserved_s"] = queue.head.get("batch", 0.0)
    return out


def tail_run(seed: int, arm: str) -> dict[str, Any]:
    """The flood's interactive TTFT in parts (:class:`_Trace`): the mean over all the
    interactive requests and over the slowest ``TAIL_SHARE`` of them."""
    trace = _Trace()
    sim, _, _ = _flood_sim(seed, arm, trace=trace)
    parts = sorted((trace.parts(r) for r in sim.records
                    if _tenant_of_id(r) == "web" and r.ok), key=lambda p: -p["ttft_s"])
    slow = parts[:max(1, round(TAIL_SHARE * len(parts)))]

    def mean(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}

    return {"seed": seed, "arm": arm, "all": mean(parts), "slowest": mean(slow),
            "slowest_n": len(slow)}


def engine_run(seqs: int, requests: int = 400) -> dict[str, Any]:
    """One engine (the simulator's and ``skymesh-replica``'s) kept full with ``seqs``
    batch requests (400 prompt, 200 output tokens, no shared prefix): tokens/s of the
    requests finished, over emulated time from the first start to the last finish."""
    rng = random.Random(seqs)
    eng = Engine(replace(get_profile(DEFAULT_PROFILE), max_num_seqs=seqs))
    started = done = 0
    now = 0.0

    def add() -> None:
        nonlocal started
        toks = [rng.randrange(150_000) for _ in range(400)]
        eng.add(Sequence(f"b{started}", 400, 200, hash_token_blocks(toks, BLOCK_SIZE)))
        started += 1

    for _ in range(seqs):
        add()
    while done < requests:
        batch = eng.schedule()
        assert batch is not None
        now += batch.duration
        for ev in eng.complete(batch):
            if ev.finished:
                done += 1
                add()  # refilled at once: the replica stays full
    return {"seqs": seqs, "profile": DEFAULT_PROFILE, "requests": done,
            "tokens_per_s": done * 600 / now}


def lull_run(seed: int, idle_s: float | None, fixed: bool = False) -> dict[str, Any]:
    """The flood, with the interactive tenant sending LULL_BURST requests, falling silent
    for LULL_S, then sending LULL_BURST more; the fair queue with the reserve lapsing
    after ``idle_s`` (None: the fair queue alone; ``fixed``: the fixed reserve, else the
    default adaptive one). The first requests after the lull pay for a lapsed reserve;
    the batch tenant gains while it is lapsed."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = [(0.001 * i, _item(rng, f"bulk-{i}", 400, 200))
                               for i in range(FLOOD)]
    t, after = 0.5, []
    for i in range(2 * LULL_BURST):
        if i == LULL_BURST:
            t += LULL_S
        arrivals.append((t, _item(rng, f"web-{i}", 200, 50)))
        if i >= LULL_BURST:
            after.append(f"web-{i}")
        t += rng.expovariate(RATE)

    def classify(rec: RequestRecord) -> tuple[str, str]:
        return ("web", "interactive") if _tenant_of_id(rec) == "web" else ("bulk", "batch")

    reserve = replace(FIXED if fixed else RESERVE, idle_s=idle_s) \
        if idle_s is not None else None
    sim, _ = _sim(arrivals, classify, "fair", seed, SEQS, reserve)
    web = {r.item.request_id: r for r in sim.records if _tenant_of_id(r) == "web"}
    first = [web[k].t_first - web[k].t_arrival for k in after[:LULL_FIRST]]
    done = [r for r in sim.records if _tenant_of_id(r) == "bulk" and r.ok]
    end = max(r.t_done for r in done)
    return {"seed": seed, "idle_s": idle_s, "reserve": "fixed" if fixed else AUTO_RESERVE,
            "ttft_after_lull_max_s": max(first),
            "ttft_p50_s": statistics.median(r.t_first - r.t_arrival for r in web.values()),
            "batch_tokens_per_s": sum(r.item.prompt_len + r.item.output_len
                                      for r in done) / end}


def _tenants(arm: str) -> dict[str, Any]:
    def sha(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    out: dict[str, Any] = {
        "classes": list(CLASSES), "max_wait_s": MAX_WAIT_S,
        "members": [{"name": "web", "keys_sha256": [sha(WEB_KEY)],
                     "default_class": "interactive"},
                    {"name": "bulk", "keys_sha256": [sha(BULK_KEY)],
                     "default_class": "batch"}]}
    if arm == "fair":
        out["reserve"] = {}  # the fair queue alone; the reserve arms keep the default
    elif arm == "fair_reserve_fixed":
        out["reserve"] = {"batch": DEFAULT_RESERVE}
        out["reserve_idle_s"] = FIXED_IDLE_S
        out["reserve_window_s"] = FIXED_IDLE_S  # paced while it holds, as before
    elif arm in PACES:
        out["reserve_pace"] = PACES[arm] or 1 << 20
    elif arm in HEADROOMS:
        out["reserve_headroom"] = HEADROOMS[arm]
    elif arm in MISSES:
        out["reserve_miss"] = MISSES[arm]
    elif arm == HELD:
        out["reserve_held"] = True
    else:
        out.update(_fall_keys(arm))
    return out


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _live_arm(workdir: Path, arm: str, seed: int,
                    tenants: dict[str, Any] | None = None) -> dict[str, Any]:
    """One arm on a live balancer: TTFTs of the interactive tenant (streamed), first-byte
    and end times of the batch tenant's requests. ``tenants``: this ``tenants:`` section
    instead of the arm's (:func:`_tenants`)."""
    rng = random.Random(seed)
    load_at_start = os.getloadavg()[0]  # the machine is shared: how busy it was
    reps = await start_replicas(workdir, 2, time_scale=LIVE_TIME_SCALE, name=f"{arm}-rep",
                                extra=["--max-num-seqs", str(SEQS)])
    overrides: dict[str, Any] = {"pushing": {"mode": "sp-p"},
                                 "queue": {"timeout_s": 600, "max_length": 4096}}
    if arm not in ("fcfs", "no_flood"):
        overrides["tenants"] = tenants or _tenants(arm)
    lb = await start_lb(workdir, reps, name=f"{arm}-lb", overrides=overrides,
                        env={"SKYMESH_API_KEYS": f"{WEB_KEY},{BULK_KEY}"})
    ttft: list[float] = []
    ends: list[float] = []
    started_at: list[float] = []  # the interactive requests' first tokens (s after t0)
    tokens = 0
    last = 0.0  # the interactive tenant's last request sent (s after the start)
    samples: list[tuple[float, list[tuple[float, float]]]] = []  # see _sample
    held = 0.0
    try:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            async def both_up() -> bool:
                async with s.get(lb.url + "/status", headers=auth(WEB_KEY)) as r:
                    st = await r.json()
                return sum(bool(x["healthy"]) for x in st["replicas"].values()) == 2

            await wait_for(both_up, "both replicas healthy behind the balancer", 30)
            t0 = time.perf_counter()
            sampler = asyncio.create_task(_sample(s, reps, t0, samples))

            async def one(key: str, prompt: int, output: int,
                          stream: bool) -> tuple[float, float, float]:
                """(sent, first token or the end, end), perf_counter seconds."""
                body = {"model": MODEL, "prompt": [rng.randrange(1000, 30_000)
                                                   for _ in range(prompt)],
                        "max_tokens": output, "ignore_eos": True, "stream": stream}
                sent = time.perf_counter()
                first = None
                async with s.post(lb.url + "/v1/completions", json=body,
                                  headers=auth(key)) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{r.status}: {(await r.text())[:200]}")
                    async for line in r.content:
                        if first is None and line.startswith(b"data: {"):
                            first = time.perf_counter()
                end = time.perf_counter()
                return sent, first or end, end

            async def bulk(i: int) -> None:
                nonlocal tokens
                await asyncio.sleep(0.001 * i * LIVE_TIME_SCALE)
                # Not streamed: on two shared cores the balancer's and the client's time
                # per streamed chunk of the flood would slow the interactive tenant too.
                _, _, done = await one(BULK_KEY, 400, 200, False)
                ends.append(done - t0)
                tokens += 600

            async def web() -> None:
                await asyncio.sleep(0.5 * LIVE_TIME_SCALE)
                nonlocal last
                waits = []
                for _ in range(STEADY):
                    last = time.perf_counter() - t0
                    waits.append(asyncio.create_task(one(WEB_KEY, 200, 50, True)))
                    await asyncio.sleep(rng.expovariate(RATE / LIVE_TIME_SCALE))
                for f in waits:
                    sent, first, _ = await f
                    ttft.append(first - sent)
                    started_at.append(first - t0)

            jobs = [web()]
            if arm != "no_flood":
                jobs += [bulk(i) for i in range(LIVE_FLOOD)]
            await asyncio.gather(*jobs)
            sampler.cancel()
            held = (await metrics(s, lb.url)).get("skymesh_tenant_reserve_held_total", 0.0)
    finally:
        lb.stop()
        for r in reps:
            r.stop()
    out: dict[str, Any] = {
        "seed": seed, "arm": arm, "interactive_sent": STEADY,
        "interactive_ok": len(ttft), "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": _pct(ttft, 0.99), "batch_sent": LIVE_FLOOD if arm != "no_flood" else 0,
        "batch_completed": len(ends), "batch_last_done_s": max(ends, default=0.0),
        "batch_tokens_per_s": tokens / max(ends) if ends else None,
        "interactive_last_arrival_s": last,
        "batch_tokens_per_s_while_interactive": (
            600 * sum(e <= last for e in ends) / last if ends and last else None),
        "load_average_1m": (load_at_start + os.getloadavg()[0]) / 2}
    if arm in HEADROOMS:
        out["reserve_headroom"] = HEADROOMS[arm]
    if arm in MISSES:
        out["reserve_miss"] = MISSES[arm]
    out.update(_fall_keys(arm))
    if ends:
        # The longest the batch class went without a request finishing, after its first
        # (what the client can see of it going unserved; its requests are not streamed).
        done = sorted(ends)
        out["batch_longest_unserved_s"] = max(
            (b - a for a, b in itertools.pairwise(done)), default=0.0)
        out.update(_live_phases(arm, samples, started_at, last, max(ends), held,
                                tenants))
    return out


SAMPLE_S = 0.5  # the replicas' counters, read this often during a live arm


async def _sample(s: aiohttp.ClientSession, reps: list[Any], t0: float,
                  out: list[tuple[float, list[tuple[float, float]]]]) -> None:
    """Every ``SAMPLE_S``: each replica's prompt tokens so far (a current counter) and
    requests running (a gauge as of its metrics lag ago)."""
    while True:
        got = await asyncio.gather(*(metrics(s, r.url) for r in reps))
        out.append((time.perf_counter() - t0,
                    [(m.get("vllm:prompt_tokens_total", 0.0),
                      m.get("vllm:num_requests_running", 0.0)) for m in got]))
        await asyncio.sleep(SAMPLE_S)


def _live_phases(arm: str, samples: list[tuple[float, list[tuple[float, float]]]],
                 started_at: list[float], last: float, end: float,
                 held: float, tenants: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per phase of a live arm: while pacing may hold (to ``reserve_window_s`` after the
    interactive tenant's last request) and after: batch requests started per second per
    replica (prompt tokens less the interactive ones started then, over the batch prompt),
    and requests running per replica; how long the reserve could hold (to
    ``reserve_idle_s`` after that last request) as a share of the batch run; and the
    releases the reserve held back (``skymesh_tenant_reserve_held_total``). ``tenants``:
    the arm's ``tenants:`` section when it is not :func:`_tenants`'s."""
    if arm in ("fcfs", "no_flood"):
        tenants = {}
    elif tenants is None:
        tenants = _tenants(arm)
    window = tenants.get("reserve_window_s", RESERVE_WINDOW_S)
    idle = tenants.get("reserve_idle_s", RESERVE_IDLE_S)
    reps = len(samples[0][1]) if samples else 1
    split = min(end, last + window)

    def phase(a: float, b: float) -> dict[str, float] | None:
        xs = [(t, r) for t, r in samples if a <= t <= b]
        if len(xs) < 2 or xs[-1][0] <= xs[0][0]:
            return None
        (ta, ra), (tb, rb) = xs[0], xs[-1]
        prompt = sum(y[0] - x[0] for x, y in zip(ra, rb, strict=True))
        web = 200 * sum(ta <= t < tb for t in started_at)
        return {"from_s": ta, "to_s": tb,
                "batch_starts_per_s_per_replica": max(0.0, prompt - web) / 400
                / (tb - ta) / reps,
                "running_per_replica": statistics.fmean(sum(x[1] for x in r) / reps
                                                        for _, r in xs)}

    return {"paced_phase": phase(0.0, split), "after_phase": phase(split, end),
            "reserve_could_hold_share": (min(end, last + idle) / end) if tenants
            and tenants.get("reserve") != {} else 0.0,
            "reserve_held_total": held}


async def live_flood(seeds: list[int], arms: tuple[str, ...] = FLOOD_ARMS
                     ) -> list[dict[str, Any]]:
    """Every arm once per seed, the arms of a seed one after another (a repetition)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tenancy-live-") as d:
        return [await _live_arm(Path(d), arm, seed) for seed in seeds for arm in arms]


def share_run(seed: int, fair: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals: list[Arrival] = [(0.001 * i, _item(rng, f"heavy-{i}", 300, 100))
                               for i in range(HEAVY)]
    arrivals += [(0.01 * i + 0.0005, _item(rng, f"light-{i}", 300, 100)) for i in range(LIGHT)]
    sim, _ = _sim(arrivals, lambda rec: (_tenant_of_id(rec), "standard"),
                  "fair" if fair else "fcfs", seed)
    ok = [r for r in sim.records if r.ok]
    # Both backlogged until the light tenant's last request finished (it has the fewer).
    until = max(r.t_done for r in ok if _tenant_of_id(r) == "light")
    windows: dict[int, dict[str, float]] = {}
    for r in ok:
        if r.t_done <= until:
            w = windows.setdefault(int(r.t_done // WINDOW_S), {"heavy": 0.0, "light": 0.0})
            w[_tenant_of_id(r)] += r.item.prompt_len + r.item.output_len
    full = [w for k, w in sorted(windows.items()) if (k + 1) * WINDOW_S <= until]
    shares = [w["light"] / (w["heavy"] + w["light"]) for w in full if w["heavy"] + w["light"]]
    light = sum(w["light"] for w in full)
    total = sum(w["heavy"] + w["light"] for w in full)
    return {"seed": seed, "arm": "fair" if fair else "fcfs", "both_backlogged_s": until,
            "windows": len(full), "light_share": light / total if total else None,
            "light_share_window_min": min(shares, default=None),
            "light_share_window_max": max(shares, default=None)}


def limit_run(seed: int, spread: str) -> dict[str, Any]:
    rng = random.Random(seed)
    tenant = Tenant("a", "standard", CLASSES, requests_per_s=LIMIT_RPS)
    lbs = [Limiter([tenant], share=2, now=0.0) for _ in range(2)]
    offered = admitted = 0
    now = rng.expovariate(LIMIT_RPS * OFFERED_X)
    while now < LIMIT_RUN_S:
        lb = lbs[offered % 2] if spread == "even" else lbs[0]
        offered += 1
        try:
            lb.admit("a", 1, now, 0.0)
            admitted += 1
        except TenantLimited:
            pass
        now += rng.expovariate(LIMIT_RPS * OFFERED_X)
    return {"seed": seed, "spread": spread, "offered_per_s": offered / LIMIT_RUN_S,
            "admitted_per_s": admitted / LIMIT_RUN_S, "limit_per_s": LIMIT_RPS}


def merge_live(prior: list[dict[str, Any]], new: list[dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """The live rows after a partial live run (``new``: the arms that changed, with first
    come first served and no flood, on some seeds): ``new`` tagged with its own ``run``
    (the page pairs each arm with the baselines of its own run, never of another run on
    a busier or quieter machine), and the prior rows of the same seed and arm kept
    ``superseded`` (the baselines of the arms not rerun; the page shows them no more)."""
    run = 1 + max((r.get("run", 0) for r in prior), default=0)
    ran = {(r["seed"], r["arm"]) for r in new}
    return [{**r, "superseded": True} if (r.get("seed"), r["arm"]) in ran else r
            for r in prior] + [{**r, "run": run} for r in new]


def _live_setup(seeds: list[int]) -> dict[str, Any]:
    return {"live_time_scale": LIVE_TIME_SCALE, "live_flood": LIVE_FLOOD, "live_seeds": seeds,
            "live_rate_per_s": RATE / LIVE_TIME_SCALE, "live_cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--live", action="store_true",
                    help="also run the flood on a live balancer (once per --live-seeds); "
                         "without it the --json file's live rows are kept")
    ap.add_argument("--live-seeds", default="0,1",
                    help="the live repetitions' seeds (their interactive arrivals)")
    ap.add_argument("--live-only", action="store_true",
                    help="run only the live flood, into the existing --json file")
    ap.add_argument("--live-arms", default=",".join(FLOOD_ARMS),
                    help="the live arms to run (a trial; the results page wants them all)")
    args = ap.parse_args(argv)
    live_seeds = [int(x) for x in args.live_seeds.split(",")]
    live_arms = tuple(args.live_arms.split(","))
    if unknown := set(live_arms) - set(FLOOD_ARMS):
        ap.error(f"--live-arms: no arm {', '.join(sorted(unknown))}")
    if args.live_only:
        prior: dict[str, Any] = json.loads(args.json.read_text())
        prior["live"] = merge_live(prior.get("live", []),
                                   asyncio.run(live_flood(live_seeds, live_arms)))
        prior["setup"].update(_live_setup(sorted({r["seed"] for r in prior["live"]})))
        args.json.write_text(json.dumps(prior, indent=2) + "\n")
        print(json.dumps(prior["live"], indent=1))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.monotonic()
    doc: dict[str, Any] = {
        "setup": {"replicas": 2, "policy": "least-load", "push_mode": "sp-p",
                  "max_num_seqs": SEQS, "reserve": {"batch": AUTO_RESERVE},
                  "reserve_headroom": RESERVE.headroom,
                  "reserve_fall_gaps": DEFAULT_RESERVE_FALL_GAPS,
                  "reserve_fixed": FIXED.fractions, "light_rate_per_s": LIGHT_RATE,
                  "tail_share": TAIL_SHARE, "reserve_idle_s": RESERVE_IDLE_S,
                  "reserve_window_s": RESERVE_WINDOW_S, "reserve_fixed_idle_s": FIXED_IDLE_S,
                  "reserve_pace": RESERVE_PACE, "interactive_request_tokens": 250,
                  "batch_request_tokens": 600,
                  "lull_burst": LULL_BURST, "lull_s": LULL_S, "lull_first": LULL_FIRST,
                  "flood": FLOOD, "steady": STEADY, "steady_rate_per_s": RATE,
                  "max_wait_s": MAX_WAIT_S, "heavy": HEAVY, "light": LIGHT,
                  "window_s": WINDOW_S, "limit_per_s": LIMIT_RPS, "offered_x": OFFERED_X,
                  "limit_run_s": LIMIT_RUN_S, "seeds": seeds},
        "flood": [flood_run(s, arm) for s in seeds for arm in FLOOD_ARMS],
        "light": [flood_run(s, arm, LIGHT_RATE) for s in seeds for arm in LIGHT_ARMS],
        "tail": [tail_run(s, arm) for s in seeds for arm in TAIL_ARMS],
        "engine": [engine_run(n) for n in ENGINE_SEQS],
        "lull": [*(lull_run(s, idle) for s in seeds for idle in LULL_IDLE_S),
                 *(lull_run(s, FIXED_IDLE_S, fixed=True) for s in seeds)],
        "share": [share_run(s, fair) for s in seeds for fair in (False, True)],
        "limits": [limit_run(s, spread) for s in seeds for spread in ("even", "one")],
    }
    if args.live:
        doc["live"] = asyncio.run(live_flood(live_seeds, live_arms))
        doc["setup"].update(_live_setup(live_seeds))
    elif args.json.exists():
        # The simulator alone: the file's live rows stay (with their setup), as a live
        # run takes far longer than the simulator's.
        prior = json.loads(args.json.read_text())
        if prior.get("live"):
            doc["live"] = prior["live"]
            doc["setup"].update({k: v for k, v in prior.get("setup", {}).items()
                                 if k.startswith("live_")})
    doc["wall_seconds"] = round(time.monotonic() - t0, 1)
    doc["date"] = datetime.now(UTC).strftime("%Y-%m-%d")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("flood", "share", "limits")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
