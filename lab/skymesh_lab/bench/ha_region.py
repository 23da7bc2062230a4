"""Two balancers for one region (availability), on real processes over loopback.

Lab code, not product: it measures what operators get when they run two ``skymesh-lb``
for one region behind one regional address (DNS round robin), sharing that region's
emulated replicas (``skymesh-replica --max-num-seqs 4``, metrics lag at its default), its
peer (a second region with one balancer) and its ``skymesh-controller`` (memory store).

Two experiments (``python -m skymesh_lab.bench.ha_region --json PATH``):

- ``kill``: closed-loop clients alternate between the region's two balancers; one is
  SIGKILLed mid-load. Every request is classified as the client saw it (see
  :class:`KillTally`); a client whose request was refused or cut retries it once on the
  other address, as a client library behind round-robin DNS would.
- ``burst``: N streams at once, split over one or two balancers, in ``sp-p`` and ``bp``,
  and sp-p on two balancers with ``pushing.balancers_per_region: 2`` (the n x margin);
  the replicas' own waiting counts (``/get_load``, read live) and the balancers' queues
  are sampled throughout. Without the margin, two sp-p balancers that see the same free
  slots within one metrics-lag window may both fill them: the figures say how much that
  costs, and what the margin changes. The arms alternate within each repeat, in an order
  rotated by one per repeat, so a slow spell of the shared machine falls on all of them.

``--markdown PATH`` prints the tables of the results page ``docs/results/ha-region.md``
(the renderer is ``skymesh_lab.bench.ha_region_page``).
Peers are static (``follow_peers: false``) and balancers keep their configured replicas
unless ``link_replicas`` (the controller then hands out membership, and
``balancers_per_region="auto"`` takes the count from it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_lab.bench import ha_region_page
from skymesh_lab.bench.ha_region_page import CUT, EU_LB, US_LBS
from skymesh_lab.faults.client import (
    COMPLETED,
    FAILED,
    LOST,
    REFUSED,
    Tally,
    chat_body,
    send,
    session,
)
from skymesh_lab.faults.cluster import MODEL, status

REGIONS = {"us": (38.9, -77.0), "eu": (53.3, -6.3)}
START_S = 120.0  # a daemon's start deadline: minutes of imports on a loaded 2-core box
SAMPLE_S = 0.02  # sampling cadence of the burst's gauges (not a wait for anything)


class HaRegion:
    """Region ``us`` with ``us_lbs`` balancers sharing ``replicas`` replicas, region ``eu``
    with one balancer and one replica, peered over mTLS, under one controller."""

    def __init__(self, workdir: Path, *, us_lbs: int = 2, replicas: int = 3,
                 max_num_seqs: int = 4, time_scale: float = 0.1, push_mode: str = "sp-p",
                 eu: bool = True, controller: bool = True, link_replicas: bool = False,
                 balancers_per_region: int | str = 1) -> None:
        self.dir = workdir
        self.balancers_per_region = balancers_per_region
        self.us_ids = list(US_LBS[:us_lbs])
        self.n_replicas, self.max_num_seqs = replicas, max_num_seqs
        self.time_scale, self.push_mode = time_scale, push_mode
        self.want_eu, self.want_controller, self.link = eu, controller, link_replicas
        self.token = secrets.token_hex(16)
        self.controller: Daemon | None = None
        self.lbs: dict[str, Daemon] = {}
        self.us_replicas: list[Daemon] = []
        self.eu_replicas: list[Daemon] = []
        self.daemons: list[Daemon] = []

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    async def start(self) -> None:
        """Replicas and controller at once, then the balancers one by one (each start is
        mostly Python's imports: on a busy machine, three at once can outlast the start
        deadline). Whatever started is stopped again if anything fails."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        from skymesh.mesh import certs

        ids = [*self.us_ids, *([EU_LB] if self.want_eu else [])]
        pki = self.dir / "pki"
        certs.create_ca(pki)
        for bid in ids:
            certs.issue_cert(pki, bid)
        names = [f"us-replica{i}" for i in range(self.n_replicas)]
        names += ["eu-replica0"] if self.want_eu else []
        flags = ["--port", "0", "--log-level", "warning", "--max-num-seqs",
                 str(self.max_num_seqs), "--time-scale", str(self.time_scale)]
        started = await asyncio.gather(
            *(self._daemon("skymesh-replica", [*flags, "--seed", str(i)], name)
              for i, name in enumerate(names)),
            self._start_controller(), return_exceptions=True)
        for err in started:
            if isinstance(err, BaseException):
                raise err
        reps = [d for d in started if isinstance(d, Daemon)]
        self.us_replicas, self.eu_replicas = reps[:self.n_replicas], reps[self.n_replicas:]
        grpc = {bid: free_port() for bid in ids}
        for bid in ids:
            self.lbs[bid] = await self._start_lb(bid, ids, grpc, pki)
        if self.controller is not None and not self.link:
            await self._register(grpc)

    async def _daemon(self, exe: str, args: list[str], name: str,
                      env: dict[str, str] | None = None) -> Daemon:
        """``start_daemon`` with a start deadline for a busy machine; kept for ``stop``."""
        d = await asyncio.to_thread(start_daemon, exe, args, log_path=self.dir / f"{name}.log",
                                    timeout=START_S, env=env)
        self.daemons.append(d)
        return d

    async def _start_controller(self) -> None:
        if not self.want_controller:
            return
        self.controller = await self._daemon(
            "skymesh-controller", ["--port", "0", "--store", "memory", "--probe-interval",
                                   "0.2", "--log-level", "warning"], "controller",
            env={**os.environ, "SKYMESH_ADMIN_TOKEN": self.token})
        async with aiohttp.ClientSession(headers=self.auth) as s:
            for name, (lat, lon) in REGIONS.items():
                async with s.post(self.controller.url + "/v1/regions", json={
                        "name": name, "latitude": lat, "longitude": lon}) as r:
                    r.raise_for_status()

    async def _start_lb(self, bid: str, ids: list[str], grpc: dict[str, int], pki: Path
                        ) -> Daemon:
        region = "eu" if bid == EU_LB else "us"
        reps = self.eu_replicas if region == "eu" else self.us_replicas
        # Siblings do not peer: forwarding within a region gains nothing.
        peers = [o for o in ids if o != bid and (o == EU_LB) != (bid == EU_LB)]
        cfg: dict[str, Any] = {
            "region": region, "listen": {"host": "127.0.0.1", "port": 0},
            "policy": {"name": "least-load"}, "probe": {"interval_s": 0.05},
            "pushing": {"mode": self.push_mode,
                        "balancers_per_region": self.balancers_per_region},
            "replicas": [{"url": r.url, "models": [MODEL], "gpu": "L4"} for r in reps],
            "mesh": {"id": bid, "certs_dir": str(pki), "listen_port": grpc[bid],
                     "peers": [{"id": p, "address": f"127.0.0.1:{grpc[p]}"} for p in peers]}}
        if self.controller is not None and self.link:
            cfg["controller"] = {
                "url": self.controller.url, "balancer_id": bid, "follow_peers": False,
                "retry_s": 0.2, "telemetry_interval_s": 1.0,
                "url_policy": {"allow_loopback": True}}
        path = self.dir / f"{bid}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return await self._daemon("skymesh-lb", ["--config", str(path), "--log-level",
                                                 "warning"], bid,
                                  env={**os.environ, "SKYMESH_AGENT_TOKEN": self.token})

    async def _register(self, grpc: dict[str, int]) -> None:
        """What the balancers' own registration would write, by the operator: each
        balancer, and each replica homed at its region's first balancer."""
        assert self.controller is not None
        async with aiohttp.ClientSession(headers=self.auth) as s:
            for bid, lb in self.lbs.items():
                region = "eu" if bid == EU_LB else "us"
                async with s.post(self.controller.url + "/v1/balancers", json={
                        "id": bid, "region": region, "url": lb.url,
                        "peer_address": f"127.0.0.1:{grpc[bid]}"}) as r:
                    r.raise_for_status()
            homes = [(self.us_ids[0], "us", self.us_replicas)]
            if self.want_eu:
                homes.append((EU_LB, "eu", self.eu_replicas))
            for home, region, reps in homes:
                for rep in reps:
                    async with s.post(self.controller.url + "/v1/replicas", json={
                            "url": rep.url, "model": MODEL, "region": region, "gpu": "L4",
                            "balancer": home}) as r:
                        r.raise_for_status()

    async def ctl(self, s: aiohttp.ClientSession, path: str) -> Any:
        assert self.controller is not None
        async with s.get(self.controller.url + path, headers=self.auth) as r:
            r.raise_for_status()
            return await r.json()

    async def ready(self, s: aiohttp.ClientSession) -> bool:
        """Every balancer serves its region's replicas (healthy, limit learned) and sees
        all its peers alive; the controller, if any, has every balancer up."""
        for bid, lb in self.lbs.items():
            st = await status(s, lb.url)
            want = {r.url for r in (self.eu_replicas if bid == EU_LB else self.us_replicas)}
            got = {u for u, r in st["replicas"].items()
                   if r["healthy"] and r.get("max_num_seqs") == self.max_num_seqs}
            if got != want:
                return False
            if st["mesh"] and not all(p["forwardable"] for p in st["mesh"]["peers"]):
                return False
        if self.controller is not None:
            bs = await self.ctl(s, "/v1/balancers")
            if len(bs) != len(self.lbs) or {b["state"] for b in bs} != {"up"}:
                return False
        return True

    async def stop(self) -> None:
        for d in reversed(self.daemons):
            await asyncio.to_thread(d.stop)


# -- the kill experiment -------------------------------------------------------------------

@dataclass
class KillTally:
    """First attempts by (balancer, outcome), and the retries of refused/cut/failed ones.

    ``cut``: the killed balancer's connection dropped mid-request (reset or an incomplete
    chunked body): a clean error the client sees, allowed only for requests it had in
    flight at the kill. ``lost``: anything else that is neither a correct answer nor an
    explicit error (a hang, a silent truncation, a wrong token count)."""

    first: Counter[str] = field(default_factory=Counter)
    retries: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    cut_started_after_kill: int = 0
    in_flight: Counter[str] = field(default_factory=Counter)  # per balancer, live
    in_flight_at_kill: int = 0
    completed_after_kill: Counter[str] = field(default_factory=Counter)

    def row(self) -> dict[str, Any]:
        return {"first_attempts": dict(self.first), "retries": dict(self.retries),
                "reasons": dict(self.reasons), "in_flight_at_kill": self.in_flight_at_kill,
                "cut_started_after_kill": self.cut_started_after_kill,
                "completed_after_kill": dict(self.completed_after_kill)}


async def _attempt(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                   deadline_s: float) -> tuple[str, str]:
    t = Tally()
    out = await send(s, url, body, t, deadline_s)
    reason = next(iter(t.reasons), "")
    if out == LOST and ("mid-response" in reason or "before a response" in reason):
        return CUT, reason  # classified by the caller: clean only on the killed balancer
    return out, reason


async def kill_under_load(workdir: Path, *, clients: int = 8, eu_clients: int = 6,
                          max_tokens: int = 24, per_phase: int = 40,
                          timeout: float = 120.0) -> dict[str, Any]:
    """Load over both ``us`` balancers (and ``eu``, which overflows to them), SIGKILL
    ``lb-us-a`` once each has completed ``per_phase`` requests, run until ``lb-us-b`` has
    completed ``per_phase`` more; report the tally and what controller and peers did."""
    ha = HaRegion(workdir)
    tally, eu_tally = KillTally(), KillTally()
    killed, stop = asyncio.Event(), asyncio.Event()
    victim, survivor = US_LBS
    tasks: list[asyncio.Task[None]] = []
    await ha.start()
    try:
        async with session() as s:
            deadline = time.monotonic() + timeout
            await _until(lambda: ha.ready(s), "the HA region to come up", deadline)
            urls = {bid: lb.url for bid, lb in ha.lbs.items()}

            async def client(i: int, targets: list[str], t: KillTally) -> None:
                k = 0
                while not stop.is_set():
                    k += 1
                    bid = targets[(i + k) % len(targets)]
                    body = chat_body(f"ha client {i} request {k}", max_tokens, True)
                    before_kill = not killed.is_set()
                    t.in_flight[bid] += 1
                    out, why = await _attempt(s, urls[bid], body, 30)
                    t.in_flight[bid] -= 1
                    if out == CUT and bid != victim:
                        out = LOST  # a survivor's dropped connection is a real loss
                    t.first[f"{bid} {out}"] += 1
                    if why:
                        t.reasons[f"{bid} {out}: {why}"] += 1
                    if out == CUT and not before_kill:
                        t.cut_started_after_kill += 1
                    if out == COMPLETED and killed.is_set():
                        t.completed_after_kill[bid] += 1
                    if out in (CUT, REFUSED, FAILED):
                        other = [b for b in targets if b != bid] or [bid]
                        out2, why2 = await _attempt(s, urls[other[0]], body, 30)
                        t.retries[out2] += 1
                        if why2:
                            t.reasons[f"retry {out2}: {why2}"] += 1

            def served(bid: str, n: int) -> bool:
                return tally.first[f"{bid} {COMPLETED}"] >= n

            async def both_served() -> bool:
                return all(served(b, per_phase) for b in US_LBS)

            async def survivor_served() -> bool:
                return served(survivor, base + per_phase)

            tasks += [asyncio.create_task(client(i, list(US_LBS), tally)) for i in range(clients)]
            tasks += [asyncio.create_task(client(i, [EU_LB], eu_tally))
                      for i in range(eu_clients)]
            base = 0
            await _until(both_served, "both us balancers serving", deadline)
            eu_st = await status(s, urls[EU_LB])
            forwarded_before = eu_st["mesh"]["forwarded_out"]
            tally.in_flight_at_kill = tally.in_flight[victim]
            eu_tally.in_flight_at_kill = eu_tally.in_flight[EU_LB]
            ha.lbs[victim].kill()  # SIGKILL
            killed.set()
            base = tally.first[f"{survivor} {COMPLETED}"]
            await _until(survivor_served, "the survivor serving on", deadline)
            info = await _after_kill(ha, s, victim, survivor, deadline)
            survivor_in = (await status(s, urls[survivor]))["mesh"]["forwarded_in"]
            stop.set()
            await asyncio.gather(*tasks)
            eu_after = await status(s, urls[EU_LB])
            info.update(eu_forwarded_out_before_kill=forwarded_before,
                        eu_forwarded_out_total=eu_after["mesh"]["forwarded_out"],
                        survivor_forwarded_in_total=survivor_in)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await ha.stop()
    return {"us": tally.row(), "eu": eu_tally.row(), **info}


async def _after_kill(ha: HaRegion, s: aiohttp.ClientSession, victim: str, survivor: str,
                      deadline: float) -> dict[str, Any]:
    """Wait for the controller and the peer to act on the kill; what they decided."""
    rep_urls = {r.url for r in ha.us_replicas}

    async def marked_down() -> bool:
        bs = {b["id"]: b["state"] for b in await ha.ctl(s, "/v1/balancers")}
        return bs[victim] == "down" and bs[survivor] == "up"

    async def moved() -> bool:
        reps = [r for r in await ha.ctl(s, "/v1/replicas") if r["url"] in rep_urls]
        return {r["assigned"] for r in reps} == {survivor}

    async def peer_dropped() -> bool:
        st = await status(s, ha.lbs[EU_LB].url)
        view = {p["id"]: p for p in st["mesh"]["peers"]}
        m = await ha.ctl(s, f"/v1/balancers/{EU_LB}/membership")
        return (view[victim]["liveness"] == "down" and not view[victim]["forwardable"]
                and view[survivor]["forwardable"]
                and victim not in {p["id"] for p in m["peers"]})

    await _until(marked_down, "the controller to mark the victim down", deadline)
    await _until(moved, "the controller to assign its replicas to the survivor", deadline)
    await _until(peer_dropped, "the eu peer to drop the victim", deadline)
    st = await status(s, ha.lbs[survivor].url)
    eu_view = {p["id"]: p for p in (await status(s, ha.lbs[EU_LB].url))["mesh"]["peers"]}
    m = await ha.ctl(s, f"/v1/balancers/{EU_LB}/membership")
    return {"eu_view": {bid: {k: eu_view[bid][k] for k in ("liveness", "forwardable")}
                        for bid in (victim, survivor)},
            "eu_membership_peers": sorted(p["id"] for p in m["peers"]),
            "controller_balancers": {b["id"]: b["state"]
                                     for b in await ha.ctl(s, "/v1/balancers")},
            "replicas_assigned_to": sorted({r["assigned"] for r in await ha.ctl(
                s, "/v1/replicas") if r["url"] in rep_urls}),
            "survivor_healthy_replicas": sum(1 for r in st["replicas"].values()
                                             if r["healthy"])}


# -- the burst experiment ------------------------------------------------------------------
async def burst(workdir: Path, *, mode: str, balancers: int, streams: int = 48,
                max_tokens: int = 150, timeout: float = 120.0, margin: int = 1
                ) -> dict[str, Any]:
    """``streams`` streams at once, alternating over ``balancers`` us balancers, each
    configured with ``pushing.balancers_per_region: margin``."""
    ha = HaRegion(workdir, us_lbs=balancers, push_mode=mode, eu=False, controller=False,
                  balancers_per_region=margin)
    await ha.start()
    waiting: list[int] = []
    queued: list[int] = []
    missed = 0
    try:
        async with session() as s:
            await _until(lambda: ha.ready(s), "the region to come up",
                         time.monotonic() + timeout)
            stop = asyncio.Event()

            async def sample() -> None:
                nonlocal missed
                while not stop.is_set():  # one snapshot: every gauge read at once
                    try:
                        loads, sts = await asyncio.gather(
                            asyncio.gather(*(_json(s, r.url + "/get_load")
                                             for r in ha.us_replicas)),
                            asyncio.gather(*(status(s, lb.url) for lb in ha.lbs.values())))
                    except (aiohttp.ClientError, TimeoutError):
                        missed += 1  # a starved machine: skip the snapshot, not the run
                    else:
                        waiting.extend(x[0]["num_waiting_reqs"] for x in loads)
                        queued.append(sum(st["queued"] for st in sts))
                    await asyncio.sleep(SAMPLE_S)

            lbs = list(ha.lbs.values())
            tally = Tally()
            sampler = asyncio.create_task(sample())
            t0 = time.monotonic()
            await asyncio.gather(*(send(s, lbs[i % len(lbs)].url,
                                        chat_body(f"story {i}", max_tokens, True), tally,
                                        timeout) for i in range(streams)))
            wall = time.monotonic() - t0
            stop.set()
            await sampler
    finally:
        await ha.stop()
    return {"mode": mode, "balancers": balancers, "balancers_per_region": margin,
            "streams": streams,
            "completed": tally.completed, "lost": tally.lost,
            "failed_explicit": tally.failed_explicit,
            "replica_waiting_mean": statistics.fmean(waiting) if waiting else 0.0,
            "replica_waiting_max": max(waiting, default=0),
            "balancer_queue_max": max(queued, default=0), "samples": len(waiting),
            "samples_missed": missed,
            "wall_s": wall}


# -- helpers, CLI --------------------------------------------------------------------------
async def _json(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as r:
        r.raise_for_status()
        return await r.json()


async def _until(cond: Any, what: str, deadline: float) -> None:
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError, KeyError):
            if await cond():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(SAMPLE_S)


# (push mode, balancers, pushing.balancers_per_region): the burst's arms.
ARMS = (("sp-p", 1, 1), ("sp-p", 2, 1), ("sp-p", 2, 2), ("bp", 1, 1), ("bp", 2, 1))


def arm_order(repeat: int) -> list[tuple[str, int, int]]:
    k = repeat % len(ARMS)
    return [*ARMS[k:], *ARMS[:k]]


async def run_all(workdir: Path, repeats: int, streams: int) -> dict[str, Any]:
    runs = []
    load = os.getloadavg()[0]
    for rep in range(repeats):
        for mode, n, margin in arm_order(rep):
            d = workdir / f"burst-{mode}-{n}-{margin}-{rep}"
            d.mkdir(parents=True)
            runs.append({"repeat": rep, **await burst(d, mode=mode, balancers=n,
                                                      streams=streams, margin=margin)})
    kd = workdir / "kill"
    kd.mkdir()
    return {"setup": {"us_replicas": 3, "max_num_seqs": 4, "time_scale": 0.1,
                      "metrics_lag": "replica default (0.9 s)", "streams": streams,
                      "repeats": repeats, "load_average_1m_at_start": round(load, 2),
                      "cpus": os.cpu_count()},
            "burst": runs, "kill": await kill_under_load(kd)}


def markdown(doc: dict[str, Any]) -> str:
    """The results page's tables from the JSON ``main`` writes."""
    return ha_region_page.ha_region(doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.ha_region", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the measurements here")
    ap.add_argument("--markdown", type=Path, metavar="JSON",
                    help="print the tables for this JSON (no run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=48)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.markdown is not None:
        sys.stdout.write(markdown(json.loads(args.markdown.read_text())))
        return 0
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ha-region-") as tmp:
        doc = asyncio.run(run_all(args.workdir or Path(tmp), args.repeats, args.streams))
    text = json.dumps(doc, indent=2, sort_keys=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    sys.stdout.write(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
