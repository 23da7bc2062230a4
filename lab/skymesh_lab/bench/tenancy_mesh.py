"""Batch across the mesh (skymesh.balancer.batch_routing, docs/tenancy.md) in the simulator,
on the diurnal three-region workload (lab/skymesh_lab/bench/diurnal.py: ShareGPT chat
clients skewed toward us, 120 / 40 / 40, at its peak; replicas spread evenly; SkyLB's
overflow forwarding on) plus a batch tenant: Poisson batch jobs in every region, each with
a deadline. The batch lane runs with ``tenants.batch_mesh``'s defaults (``reserve``,
``max_per_replica``, ``room_per_replica``, ``urgent_h`` scaled as the deadline is). The
arms, on the same seeds:

- ``no_batch``: the chat clients alone: the interactive figures to keep;
- ``fcfs``: batch jobs mixed in, first come first served, as without tenancy;
- ``local_last``: batch in the dispatcher's batch lane, never forwarded;
- ``mesh_rule``: the rule: batch runs only where there is room (replicas running fewer
  than ``room_per_replica`` interactive requests), at home or at a peer, and waits
  otherwise until its deadline is near, when it goes to a far lighter peer or runs at
  home;
- ``mesh_rule_room<N>``: the same with ``room_per_replica`` N (``ROOM_SWEEP``).

Interactive SLO attainment is the share of chat requests whose TTFT is within
``TTFT_SLO_S``; batch is judged by the share finished within its deadline, and where it ran.
The simulated day is compressed: deadlines are simulated seconds standing for the hours
of ``tenants.batch_mesh.deadline_h``. A second scenario, ``night``, runs the same arms
with eu and asia at night (8 chat clients each): the room across regions that batch is
forwarded to. The chat clients stop sending at the end of the run
(``duration``) and what they sent drains: that is the simulated day's trough, where batch
that waited for its deadline runs (the page counts how much did).

    python -m skymesh_lab.bench.tenancy_mesh --json docs/results/data/tenancy-mesh.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skymesh.balancer.config import BatchMeshConfig
from skymesh_lab.sim.cluster import RequestRecord, SimBatch
from skymesh_lab.sim.runner import SimConfig, Simulation, spread_replicas
from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_lab.sim.workloads import build_workload
from skymesh_replica.engine.hashing import BLOCK_SIZE, hash_token_blocks

REGIONS = ["us", "eu", "asia"]
CLIENTS = {"us": 120, "eu": 40, "asia": 40}
# The same hour with eu and asia at night: their replicas run next to nothing, the room
# the rule forwards us's batch to.
SCENARIOS = {"peak": CLIENTS, "night": {"us": 120, "eu": 8, "asia": 8}}
REPLICAS = 9
# The rule at other values of ``room_per_replica`` than the default (arms
# ``mesh_rule_room<N>``): how much the default's verdict depends on it.
ROOM_SWEEP = (4, 12)
ARMS = ("no_batch", "fcfs", "local_last", "mesh_rule",
        *(f"mesh_rule_room{n}" for n in ROOM_SWEEP))
DURATION_S = 300.0
BATCH_PER_S = 0.3  # batch jobs per second per region
BATCH_PROMPT, BATCH_OUTPUT = 1500, 400
DEADLINE_S = 240.0
# tenants.batch_mesh's defaults; the compressed day: DEADLINE_S stands for deadline_h.
BATCH_CFG = BatchMeshConfig()
assert BATCH_CFG.deadline_h is not None
SECONDS_PER_H = DEADLINE_S / BATCH_CFG.deadline_h
TTFT_SLO_S = 2.0


class WithBatch(Workload):
    """``inner`` plus a Poisson stream of batch jobs per region (request ids ``batch-``)."""

    def __init__(self, inner: Workload, seed: int, duration_s: float) -> None:
        self.inner = inner
        self.name = inner.name
        rng = random.Random(seed ^ 0xBA7C)
        self.jobs: list[Arrival] = []
        for region in REGIONS:
            t = rng.expovariate(BATCH_PER_S)
            while t < duration_s:
                toks = [rng.randrange(150_000) for _ in range(BATCH_PROMPT)]
                item = WorkItem(f"batch-{region}-{len(self.jobs)}", region, len(toks),
                                BATCH_OUTPUT, hash_token_blocks(toks, BLOCK_SIZE))
                self.jobs.append((t, item))
                t += rng.expovariate(BATCH_PER_S)
        self.jobs.sort(key=lambda a: a[0])

    def initial(self) -> Iterator[Arrival]:
        return heapq.merge(self.inner.initial(), self.jobs, key=lambda a: a[0])

    def on_complete(self, item: WorkItem, now: float, ok: bool = True) -> Iterable[Arrival]:
        if is_batch_item(item):
            return ()
        return self.inner.on_complete(item, now, ok)


def is_batch_item(item: WorkItem) -> bool:
    return item.request_id.startswith("batch-")


def _is_batch(rec: RequestRecord) -> bool:
    return is_batch_item(rec.item)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_arm(arm: str, seed: int, duration_s: float,
            clients: dict[str, int] | None = None) -> dict[str, Any]:
    cfg = SimConfig(workload="sharegpt-chat", regions=REGIONS,
                    replicas=spread_replicas(REGIONS, REPLICAS), policy="prefix-tree",
                    forwarding=True, seed=seed, duration_s=duration_s,
                    workload_params={"clients_per_region": clients or CLIENTS})
    workload: Workload = build_workload(cfg.workload, regions=REGIONS, seed=seed,
                                        duration_s=duration_s, **cfg.workload_params)
    if arm != "no_batch":
        workload = WithBatch(workload, seed, duration_s)
    sim = Simulation(cfg, workload)
    if arm == "local_last" or arm.startswith("mesh_rule"):
        room = arm.removeprefix("mesh_rule_room") if arm.startswith("mesh_rule_room") else ""
        for bal in sim.balancers.values():
            bal.set_batch(SimBatch(_is_batch, DEADLINE_S, forward=arm != "local_last",
                                   reserve=BATCH_CFG.reserve,
                                   urgent_s=BATCH_CFG.urgent_h * SECONDS_PER_H,
                                   max_per_replica=BATCH_CFG.max_per_replica,
                                   room_per_replica=int(room or BATCH_CFG.room_per_replica)))
    sim.run()
    chat = [r for r in sim.records if not _is_batch(r)]
    batch = [r for r in sim.records if _is_batch(r)]
    ttft = [r.t_first - r.t_arrival for r in chat if r.ok]
    in_time = [r for r in batch if r.ok and r.t_done - r.t_arrival <= DEADLINE_S]
    ran: dict[str, dict[str, int]] = {}
    for r in batch:
        if r.ok:
            row = ran.setdefault(r.item.region, {})
            row[r.served_region] = row.get(r.served_region, 0) + 1
    us_ttft = [r.t_first - r.t_arrival for r in chat if r.ok and r.item.region == "us"]
    by_region, ok_by_region = {}, {}
    for region in REGIONS:
        ts = [r.t_first - r.t_arrival for r in chat if r.ok and r.item.region == region]
        by_region[region] = sum(1 for t in ts if t <= TTFT_SLO_S) / len(ts) if ts else None
        ok_by_region[region] = len(ts)
    beside, alone = _tpot_beside_batch(chat, batch)
    return {**where_lost(chat, batch, duration_s),
        "arm": arm, "seed": seed,
        "interactive_ok": len(ttft),
        "interactive_slo_attainment": (sum(1 for t in ttft if t <= TTFT_SLO_S) / len(ttft)
                                       if ttft else None),
        "interactive_ttft_p50_s": statistics.median(ttft) if ttft else None,
        "interactive_ttft_p90_s": _pct(ttft, 0.9),
        "interactive_us_ttft_p90_s": _pct(us_ttft, 0.9),
        "interactive_slo_by_region": by_region,
        "interactive_ok_by_region": ok_by_region,
        # Time per output token of chat requests that shared their replica with a batch
        # job decoding, and of the others: where batch slows interactive work.
        "interactive_tpot_p50_beside_batch_s": _pct(beside, 0.5),
        "interactive_tpot_p50_alone_s": _pct(alone, 0.5),
        "interactive_beside_batch": len(beside),
        # Batch whose first token came after the chat clients stopped: run in the trough.
        "batch_after_peak": (sum(1 for r in batch if r.ok and r.t_first > duration_s)
                             / len(batch)) if batch else None,
        # Of those that started during the peak, the share that waited until due first
        # (within urgent_h of the deadline): none found a quiet replica before.
        "batch_in_peak_due": _due_share(batch, duration_s),
        "batch_sent": len(batch), "batch_ok": sum(1 for r in batch if r.ok),
        "batch_by_deadline": (len(in_time) / len(batch)) if batch else None,
        "batch_e2e_p90_s": _pct([r.t_done - r.t_arrival for r in batch if r.ok], 0.9),
        "batch_ran": ran,
    }


def where_lost(chat: list[RequestRecord], batch: list[RequestRecord], duration_s: float
               ) -> dict[str, Any]:
    """Where the interactive loss is, from the per-request records: chat requests served
    and those past the TTFT SLO by the region that served them; chat requests that ran
    beside a decoding batch job, by that region and the batch job's home; and batch
    started during the peak, by its home and where it ran."""
    served: dict[str, int] = {}
    missed: dict[str, int] = {}
    for r in chat:
        if r.ok:
            served[r.served_region] = served.get(r.served_region, 0) + 1
            if r.t_first - r.t_arrival > TTFT_SLO_S:
                missed[r.served_region] = missed.get(r.served_region, 0) + 1
    decoding: dict[str, list[tuple[float, float, str]]] = {}
    in_peak: dict[str, dict[str, int]] = {}
    for b in batch:
        if b.ok:
            decoding.setdefault(b.replica, []).append((b.t_first, b.t_done, b.item.region))
            if b.t_first <= duration_s:
                row = in_peak.setdefault(b.item.region, {})
                row[b.served_region] = row.get(b.served_region, 0) + 1
    beside: dict[str, dict[str, int]] = {}
    for r in chat:
        if not r.ok:
            continue
        homes = {h for s, e, h in decoding.get(r.replica, ()) if s < r.t_done and e > r.t_arrival}
        row = beside.setdefault(r.served_region, {})
        for h in homes:
            row[h] = row.get(h, 0) + 1
    return {"chat_served_in": served, "chat_slo_missed_in": missed,
            "chat_beside_batch_from": beside, "batch_started_in_peak": in_peak}


def _due_share(batch: list[RequestRecord], duration_s: float) -> float | None:
    urgent_s = BATCH_CFG.urgent_h * SECONDS_PER_H
    started = [r for r in batch if r.ok and r.t_first <= duration_s]
    if not started:
        return None
    return sum(1 for r in started
               if r.t_first - r.t_arrival >= DEADLINE_S - urgent_s) / len(started)


def _tpot_beside_batch(chat: list[RequestRecord], batch: list[RequestRecord]
                       ) -> tuple[list[float], list[float]]:
    """Chat requests' time per output token, split by whether a batch job was decoding on
    the same replica while they ran."""
    decoding: dict[str, list[tuple[float, float]]] = {}
    for b in batch:
        if b.ok:
            decoding.setdefault(b.replica, []).append((b.t_first, b.t_done))
    beside: list[float] = []
    alone: list[float] = []
    for r in chat:
        if not r.ok or r.item.output_len < 2:
            continue
        tpot = (r.t_done - r.t_first) / (r.item.output_len - 1)
        hit = any(s < r.t_done and e > r.t_arrival for s, e in decoding.get(r.replica, ()))
        (beside if hit else alone).append(tpot)
    return beside, alone


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--duration", type=float, default=DURATION_S)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.monotonic()
    runs = []
    for scenario, clients in SCENARIOS.items():
        for seed in seeds:
            for arm in ARMS:
                r = {"scenario": scenario, **run_arm(arm, seed, args.duration, clients)}
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if not isinstance(v, dict)}),
                      flush=True)
    doc: dict[str, Any] = {
        "setup": {"regions": REGIONS, "clients": CLIENTS, "scenarios": SCENARIOS,
                  "replicas": REPLICAS,
                  "workload": "sharegpt-chat", "policy": "prefix-tree",
                  "forwarding_rule": "overflow", "duration_s": args.duration,
                  "batch_per_s_per_region": BATCH_PER_S, "batch_prompt": BATCH_PROMPT,
                  "batch_output": BATCH_OUTPUT, "deadline_s": DEADLINE_S,
                  "reserve": BATCH_CFG.reserve, "max_per_replica": BATCH_CFG.max_per_replica,
                  "room_per_replica": BATCH_CFG.room_per_replica,
                  "urgent_s": BATCH_CFG.urgent_h * SECONDS_PER_H,
                  "ttft_slo_s": TTFT_SLO_S, "seeds": seeds},
        "runs": runs,
        "wall_seconds": round(time.monotonic() - t0, 1),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
