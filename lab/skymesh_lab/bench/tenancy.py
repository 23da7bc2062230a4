"""What the balancer's tenancy (skymesh.balancer.tenancy, docs/tenancy.md) does, in the
simulator with the live balancer's ``FairQueue`` and release rule (``SimBalancer.tenancy``)
and, for the limits, with the pure buckets on a fake clock:

- ``flood``: an interactive tenant at a steady rate beside a batch tenant that floods the
  region at once; the interactive TTFT with first come first served, with the fair queue,
  with the fair queue and its slot reserve (``tenants.reserve``'s default), and with no
  flood at all; the batch tenant's completions and tokens/s; the batch class's longest
  wait. Replicas admit ``SEQS`` requests each (``max_num_seqs``, known to the balancer
  as a live engine publishes it), so the reserve has slots to count.
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

    python -m skymesh_lab.bench.tenancy --json out.json [--seeds 0,1,2,3,4] [--live]
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

from skymesh.balancer.config import DEFAULT_RESERVE
from skymesh.balancer.tenancy import (
    FairQueue,
    Limiter,
    Reserve,
    Tenant,
    TenantLimited,
    Waiter,
)
from skymesh_lab.faults.cluster import (
    MODEL,
    start_lb,
    start_replicas,
    wait_for,
)
from skymesh_lab.sim.cluster import RequestRecord, SimTenancy
from skymesh_lab.sim.runner import SimConfig, Simulation
from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_replica.engine.hashing import BLOCK_SIZE, hash_token_blocks

CLASSES = ("interactive", "standard", "batch")
MAX_WAIT_S = {"standard": 10.0, "batch": 60.0}  # the configuration's defaults
FLOOD, STEADY, RATE = 600, 60, 2.0
SEQS = 16  # each replica's max_num_seqs
RESERVE_IDLE_S = 30.0  # tenants.reserve_idle_s's default
RESERVE_PACE = 1  # tenants.reserve_pace's default
RESERVE = Reserve(CLASSES, {"batch": DEFAULT_RESERVE}, RESERVE_IDLE_S, RESERVE_PACE)
# The reserve arms by reserve_pace: the default, and two looser ones (the trade-off of
# pacing, batch throughput against the interactive tail). None: no pacing.
PACES: dict[str, int | None] = {"fair_reserve": RESERVE_PACE, "fair_reserve_pace2": 2,
                                "fair_reserve_nopace": None}
FLOOD_ARMS = ("no_flood", "fcfs", "fair", *PACES)
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
    if arm not in PACES:
        return None
    pace = PACES[arm]
    return replace(RESERVE, pace=pace) if pace is not None else replace(RESERVE, pace=1 << 20)


def _sim(arrivals: list[Arrival], classify: Any, arm: str, seed: int,
         seqs: int | None = None, reserve: Reserve | None = None
         ) -> tuple[Simulation, _WatchedQueue | None]:
    """``reserve``: this one instead of the arm's (the fair queue with it)."""
    cfg = SimConfig(regions=["us"], replicas={"us": 2}, policy="least-load",
                    push_mode="sp-p", forwarding=False, seed=seed)
    sim = Simulation(cfg, _Arrivals(arrivals))
    lb = sim.balancers["us"]
    for rid, rep in lb.replicas.items() if seqs else ():
        rep.profile = rep.engine.profile = replace(rep.profile, max_num_seqs=seqs)
        lb.dispatcher.targets[rid].load.max_num_seqs = seqs  # as a live engine publishes
    queue = None
    if arm == "fair" or arm in PACES or reserve is not None:
        queue = _WatchedQueue(CLASSES, max_wait_s=MAX_WAIT_S, capacity=100_000,
                              started=0.0)
        lb.tenancy = SimTenancy(queue, classify,
                                reserve=reserve or _reserve(arm))
    sim.run()
    return sim, queue


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _tenant_of_id(rec: RequestRecord) -> str:
    return rec.item.request_id.split("-")[0]


def flood_run(seed: int, arm: str) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    if arm != "no_flood":
        arrivals += [(0.001 * i, _item(rng, f"bulk-{i}", 400, 200)) for i in range(FLOOD)]
    t = 0.5
    for i in range(STEADY):
        arrivals.append((t, _item(rng, f"web-{i}", 200, 50)))
        t += rng.expovariate(RATE)

    def classify(rec: RequestRecord) -> tuple[str, str]:
        return ("web", "interactive") if _tenant_of_id(rec) == "web" else ("bulk", "batch")

    sim, queue = _sim(arrivals, classify, arm, seed, SEQS)
    web = [r for r in sim.records if _tenant_of_id(r) == "web"]
    bulk = [r for r in sim.records if _tenant_of_id(r) == "bulk"]
    ttft = [r.t_first - r.t_arrival for r in web if r.ok]
    done = [r for r in bulk if r.ok]
    end = max((r.t_done for r in done), default=0.0)
    out: dict[str, Any] = {
        "seed": seed, "arm": arm, "interactive_sent": len(web),
        "interactive_ok": len(ttft), "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": _pct(ttft, 0.99), "batch_sent": FLOOD if arm != "no_flood" else 0,
        "batch_completed": len(done), "batch_last_done_s": end,
        "batch_tokens_per_s": (sum(r.item.prompt_len + r.item.output_len for r in done) / end
                               if end else None)}
    if queue is not None:
        out["batch_longest_wait_s"] = queue.longest.get("batch", 0.0)
        out["batch_longest_unserved_s"] = queue.head.get("batch", 0.0)
    return out


def lull_run(seed: int, idle_s: float | None) -> dict[str, Any]:
    """The flood, with the interactive tenant sending LULL_BURST requests, falling silent
    for LULL_S, then sending LULL_BURST more; the fair queue with the reserve lapsing
    after ``idle_s`` (None: the fair queue alone). The first requests after the lull pay
    for a lapsed reserve; the batch tenant gains while it is lapsed."""
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

    reserve = replace(RESERVE, idle_s=idle_s) if idle_s is not None else None
    sim, _ = _sim(arrivals, classify, "fair", seed, SEQS, reserve)
    web = {r.item.request_id: r for r in sim.records if _tenant_of_id(r) == "web"}
    first = [web[k].t_first - web[k].t_arrival for k in after[:LULL_FIRST]]
    done = [r for r in sim.records if _tenant_of_id(r) == "bulk" and r.ok]
    end = max(r.t_done for r in done)
    return {"seed": seed, "idle_s": idle_s, "ttft_after_lull_max_s": max(first),
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
    elif arm in PACES:
        out["reserve_pace"] = PACES[arm] or 1 << 20
    return out


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _live_arm(workdir: Path, arm: str, seed: int) -> dict[str, Any]:
    """One arm on a live balancer: TTFTs of the interactive tenant (streamed), first-byte
    and end times of the batch tenant's requests."""
    rng = random.Random(seed)
    reps = await start_replicas(workdir, 2, time_scale=LIVE_TIME_SCALE, name=f"{arm}-rep",
                                extra=["--max-num-seqs", str(SEQS)])
    overrides: dict[str, Any] = {"pushing": {"mode": "sp-p"},
                                 "queue": {"timeout_s": 600, "max_length": 4096}}
    if arm == "fair" or arm in PACES:
        overrides["tenants"] = _tenants(arm)
    lb = await start_lb(workdir, reps, name=f"{arm}-lb", overrides=overrides,
                        env={"SKYMESH_API_KEYS": f"{WEB_KEY},{BULK_KEY}"})
    ttft: list[float] = []
    ends: list[float] = []
    tokens = 0
    try:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            async def both_up() -> bool:
                async with s.get(lb.url + "/status", headers=auth(WEB_KEY)) as r:
                    st = await r.json()
                return sum(bool(x["healthy"]) for x in st["replicas"].values()) == 2

            await wait_for(both_up, "both replicas healthy behind the balancer", 30)
            t0 = time.perf_counter()

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
                waits = []
                for _ in range(STEADY):
                    waits.append(asyncio.create_task(one(WEB_KEY, 200, 50, True)))
                    await asyncio.sleep(rng.expovariate(RATE / LIVE_TIME_SCALE))
                for f in waits:
                    sent, first, _ = await f
                    ttft.append(first - sent)

            jobs = [web()]
            if arm != "no_flood":
                jobs += [bulk(i) for i in range(LIVE_FLOOD)]
            await asyncio.gather(*jobs)
    finally:
        lb.stop()
        for r in reps:
            r.stop()
    out: dict[str, Any] = {
        "seed": seed, "arm": arm, "interactive_sent": STEADY,
        "interactive_ok": len(ttft), "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": _pct(ttft, 0.99), "batch_sent": LIVE_FLOOD if arm != "no_flood" else 0,
        "batch_completed": len(ends), "batch_last_done_s": max(ends, default=0.0),
        "batch_tokens_per_s": tokens / max(ends) if ends else None}
    if ends:
        # The longest the batch class went without a request finishing, after its first
        # (what the client can see of it going unserved; its requests are not streamed).
        done = sorted(ends)
        out["batch_longest_unserved_s"] = max(
            (b - a for a, b in itertools.pairwise(done)), default=0.0)
    return out


async def live_flood(seed: int) -> list[dict[str, Any]]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tenancy-live-") as d:
        return [await _live_arm(Path(d), arm, seed) for arm in FLOOD_ARMS]


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


def _live_setup() -> dict[str, Any]:
    return {"live_time_scale": LIVE_TIME_SCALE, "live_flood": LIVE_FLOOD,
            "live_rate_per_s": RATE / LIVE_TIME_SCALE, "live_cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--live", action="store_true",
                    help="also run the flood on a live balancer (seed 0; keeps the "
                         "JSON's other sections when only --live-only is given)")
    ap.add_argument("--live-only", action="store_true",
                    help="run only the live flood, into the existing --json file")
    args = ap.parse_args(argv)
    if args.live_only:
        doc = json.loads(args.json.read_text())
        doc["live"] = asyncio.run(live_flood(0))
        doc["setup"].update(_live_setup())
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(doc["live"], indent=1))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.monotonic()
    doc: dict[str, Any] = {
        "setup": {"replicas": 2, "policy": "least-load", "push_mode": "sp-p",
                  "max_num_seqs": SEQS, "reserve": RESERVE.fractions,
                  "reserve_idle_s": RESERVE_IDLE_S, "reserve_pace": RESERVE_PACE,
                  "lull_burst": LULL_BURST, "lull_s": LULL_S, "lull_first": LULL_FIRST,
                  "flood": FLOOD, "steady": STEADY, "steady_rate_per_s": RATE,
                  "max_wait_s": MAX_WAIT_S, "heavy": HEAVY, "light": LIGHT,
                  "window_s": WINDOW_S, "limit_per_s": LIMIT_RPS, "offered_x": OFFERED_X,
                  "limit_run_s": LIMIT_RUN_S, "seeds": seeds},
        "flood": [flood_run(s, arm) for s in seeds for arm in FLOOD_ARMS],
        "lull": [lull_run(s, idle) for s in seeds for idle in LULL_IDLE_S],
        "share": [share_run(s, fair) for s in seeds for fair in (False, True)],
        "limits": [limit_run(s, spread) for s in seeds for spread in ("even", "one")],
    }
    if args.live:
        doc["live"] = asyncio.run(live_flood(0))
        doc["setup"].update(_live_setup())
    doc["wall_seconds"] = round(time.monotonic() - t0, 1)
    doc["date"] = datetime.now(UTC).strftime("%Y-%m-%d")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("flood", "share", "limits")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
