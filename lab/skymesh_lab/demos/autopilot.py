"""``skymesh demo --autopilot``: the controller's planner on a time-compressed day, live.

Three regions (us, eu, asia), each a ``skymesh-lb`` taking its membership from a
``skymesh-controller`` and reporting telemetry to it every second; emulated replicas
(``skymesh-replica --max-num-seqs 4 --time-scale 6``: about 1 req/s each at the planned
utilisation); open-loop clients following the Azure 2024 conversation trace's hourly
curve, shifted by each region's time zone (autopilot_load.py). One day of the trace is
played in ``day_s`` seconds (default 192: an hour is 8 s) by three arms at once, each
with its own controller, balancers and replicas, all sent the same requests (same seed)
at the same moments, so the machine's load weighs on them alike:

- ``fixed``: every region holds, all day, the instances its peak needs (peak x (1 +
  headroom) / capacity): today's practice. Static replicas, no planner.
- ``reactive``: the planner's strategy only (``strategy: reactive``, no rounds, no
  forecast): SageServe's 70% / 30% utilisation rule, its 15 s cooldown scaled to the
  compressed day (``planner.strategy_cooldown_s``), through the local actuator.
- ``autopilot``: the planner in ``auto`` mode with the local actuator: a round every
  compressed hour forecasts the next ``horizon`` hours per region (seasonal naive over a
  24-window day, ``planner.schedule.day_s``), solves the ILP, starts and stops replicas.
  Its history: the two previous days of the trace, posted to the controller's telemetry
  API as the balancers would have reported them (HistoryFeed) before the day starts.

The reactive and autopilot arms keep ``floor`` static replicas per region (the bounds'
minimum, default 2: what the day's quietest hour needs) and scale above it; the clients
start ``preroll_h`` hours before 00:00 UTC so every arm is in its steady state when the
measured day begins. Per arm: GPU-hours (registered replicas x time, scaled from the
compressed day to 24 h) and SLO attainment (share of the day's requests that streamed
their first token within ``slo_ttft_s`` and completed).
The timeline (instances, load, the forecast made before each hour) is printed, written
as JSON and plotted (autopilot_report.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from skymesh.util.procs import Daemon, start_daemon
from skymesh_controller.auth import digest
from skymesh_lab.demos.autopilot_load import (
    MODEL,
    UTC_OFFSETS,
    Clients,
    Day,
    HistoryFeed,
    Record,
    arrivals,
    read_trace,
    tokens_per_request,
)
from skymesh_lab.faults.cluster import LOCATIONS

ARMS = ("fixed", "reactive", "autopilot")
# Six times slower than the L4 profile: a request takes ~3 s, so a replica is busy at about
# 1 req/s and the whole demo sends few requests (CPU for the clients and balancers).
REPLICA_ARGS = ["--max-num-seqs", "4", "--time-scale", "6", "--log-level", "warning"]
SAMPLE_S = 0.5  # how often the registered replicas are counted
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Options:
    day_s: float = 192.0
    peak_rps: float = 3.0  # per region, at its busiest hour of the day
    capacity_rps: float = 1.0  # one replica at the utilisation planned for (saturates ~1.35)
    headroom: float = 0.2
    horizon: int = 3  # windows (compressed hours) each round plans for
    max_per_region: int = 6
    floor: int = 2  # static replicas per region under the scaling arms (the bounds' min)
    start_allowance_s: float = 420.0  # the other arms' start-up on a loaded machine
    slo_ttft_s: float = 1.5
    preroll_h: float = 3.0
    seed: int = 0
    live_day: int = 3  # the trace's day played (2024-05-15, a Wednesday)
    history_days: int = 2
    window_s: int | None = None  # the planner's window (default: one compressed hour)
    hold_windows: int = 2  # no reversal of a change for this many windows
    min_history_windows: int = 3  # fewer complete windows of telemetry: no round

    @property
    def hour_s(self) -> float:
        return self.day_s / 24

    @property
    def tokens(self) -> int:
        return sum(tokens_per_request())

    @property
    def capacity_tps(self) -> float:
        return self.capacity_rps * self.tokens

    def fixed_count(self) -> int:
        return math.ceil(self.peak_rps * (1 + self.headroom) / self.capacity_rps)


def planner_section(arm: str, o: Options, log_dir: Path) -> dict[str, Any] | None:
    if arm == "fixed":
        return None
    h = o.window_s or int(o.hour_s)
    sec: dict[str, Any] = {
        "mode": "auto", "epsilon": 1.0,  # balancers here do not forward: each holds its own
        "capacity": {MODEL: {"L4": o.capacity_tps}},
        "bounds": {MODEL: {"*": {"min": o.floor, "max": o.max_per_region}}},
        "schedule": {"window_s": h, "interval_s": h, "horizon": o.horizon, "tick_s": 0.5,
                     "history_windows": int(o.day_s) * (o.history_days + 2) // h,
                     "min_history_windows": o.min_history_windows, "stale_windows": 3,
                     "first_round_s": h, "day_s": int(o.day_s)},
        "forecaster": {"name": "seasonal-naive", "headroom": o.headroom, "retrain_every": 0},
        "cooldowns": {"hold_s": o.hold_windows * h, "retry_s": h, "retry_max_s": 4 * h},
        "actuator": {"kind": "local", "local": {"replica_args": REPLICA_ARGS,
                                                "log_dir": str(log_dir),
                                                "start_timeout_s": START_TIMEOUT_S}}}
    if arm == "reactive":
        # No rounds: the strategy alone, its cooldown shrunk with the day.
        sec["schedule"].update(interval_s=1e9, first_round_s=1e9)
        sec.update(strategy="reactive", strategy_cooldown_s=15.0 * o.day_s / 86_400)
    return sec


@dataclass
class Arm:
    name: str
    dir: Path
    token: str
    controller: Daemon | None = None
    lbs: dict[str, Daemon] = field(default_factory=dict)
    daemons: list[Daemon] = field(default_factory=list)
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    late: int = 0  # scheduled requests not sent: the harness was behind

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    async def start(self, o: Options, regions: Sequence[str]) -> None:
        planner = planner_section(self.name, o, self.dir)
        cfg: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "tokens": [{"name": "ops", "sha256": digest(self.token), "role": "admin"}],
            "url_policy": {"allow_loopback": True}, "probe": {"interval_s": 0.5}}
        if planner is not None:
            cfg["planner"] = planner
        path = self.dir / "controller.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.controller = await asyncio.to_thread(
            start_daemon, "skymesh-controller", ["--config", str(path), "--log-level",
                                                 "warning"],
            log_path=self.dir / "controller.log", timeout=START_TIMEOUT_S)
        self.daemons.append(self.controller)
        async with aiohttp.ClientSession(headers=self.auth) as s:
            for r in regions:
                lat, lon = LOCATIONS[r]
                async with s.post(self.controller.url + "/v1/regions",
                                  json={"name": r, "latitude": lat, "longitude": lon}) as resp:
                    resp.raise_for_status()
        static = o.fixed_count() if self.name == "fixed" else o.floor
        # A loaded machine may take longer than start_daemon's default 30 s to start one.
        reps = list(await asyncio.gather(*(asyncio.to_thread(
            start_daemon, "skymesh-replica", ["--port", "0", "--seed", str(i), *REPLICA_ARGS],
            log_path=self.dir / f"static{i}.log", timeout=START_TIMEOUT_S)
            for i in range(static * len(regions)))))
        self.daemons += reps
        lbs = await asyncio.gather(*(asyncio.to_thread(
            self._start_lb, r, reps[i * static:(i + 1) * static])
            for i, r in enumerate(regions)))
        self.daemons += lbs
        self.lbs = dict(zip(regions, lbs, strict=True))
        await self.wait_serving(static)

    def _start_lb(self, region: str, replicas: Sequence[Daemon]) -> Daemon:
        assert self.controller is not None
        cfg = {"region": region, "listen": {"host": "127.0.0.1", "port": 0},
               "policy": {"name": "least-load"}, "probe": {"interval_s": 0.1},
               "replicas": [{"url": d.url, "models": [MODEL], "gpu": "L4"} for d in replicas],
               "controller": {"url": self.controller.url, "balancer_id": f"lb-{region}",
                              "retry_s": 0.2, "telemetry_interval_s": 1.0,
                              "url_policy": {"allow_loopback": True}}}
        path = self.dir / f"lb-{region}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return start_daemon("skymesh-lb", ["--config", str(path), "--log-level", "warning"],
                            log_path=self.dir / f"lb-{region}.log", timeout=START_TIMEOUT_S,
                            env={**os.environ, "SKYMESH_AGENT_TOKEN": self.token})

    async def wait_serving(self, per_region: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                ok = 0
                for lb in self.lbs.values():
                    async with s.get(lb.url + "/status") as r:
                        st = await r.json()
                    ok += sum(1 for x in st["replicas"].values() if x["healthy"]) >= per_region
                if ok == len(self.lbs):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: balancers did not see their replicas")
                await asyncio.sleep(0.1)

    async def count(self, s: aiohttp.ClientSession) -> dict[str, int]:
        assert self.controller is not None
        async with s.get(self.controller.url + "/v1/replicas", headers=self.auth) as r:
            r.raise_for_status()
            reps = await r.json()
        out = dict.fromkeys(self.lbs, 0)
        for rep in reps:
            if rep.get("model") == MODEL and rep["region"] in out:
                out[rep["region"]] += 1
        return out

    async def sample(self, t0: float, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    self.samples.append((time.monotonic() - t0, await self.count(s)))
                await asyncio.sleep(SAMPLE_S)

    async def plans(self) -> list[dict[str, Any]]:
        assert self.controller is not None
        async with aiohttp.ClientSession(headers=self.auth) as s, \
                s.get(self.controller.url + "/v1/plans?limit=500") as r:
            if r.status != 200:
                return []
            out: list[dict[str, Any]] = await r.json()
            return out

    async def stop(self) -> None:
        # The controller stops the replicas its actuator started when it exits; on a loaded
        # machine that can outlast a SIGTERM's grace, so end any it leaves behind.
        spawned = _children(self.controller.proc.pid) if self.controller else []
        for d in reversed(self.daemons):  # balancers and the controller first
            await asyncio.to_thread(d.stop, 60.0 if d is self.controller else 10.0)
        for pid in spawned:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return out


async def run_day(arm: Arm, schedule: Sequence[tuple[float, str]], t0: float
                  ) -> list[Record]:
    """Clients from the schedule's first request to its last, the arm's replicas counted
    meanwhile (times from 00:00); ``t0``: monotonic time of 00:00 of the live day."""
    stop = asyncio.Event()
    sampler = asyncio.create_task(arm.sample(t0, stop))
    clients = Clients({r: lb.url for r, lb in arm.lbs.items()}, schedule, t0)
    try:
        return await clients.run()
    finally:
        arm.late = clients.late
        stop.set()
        await sampler


def aligned_t0(delay_s: float, hour_s: float) -> float:
    """Monotonic time of the first wall-clock multiple of ``hour_s`` after ``delay_s``: the
    controller's windows are multiples of ``window_s`` in unix time, so compressed hours
    and windows coincide."""
    wall = math.ceil((time.time() + delay_s) / hour_s) * hour_s
    return time.monotonic() + (wall - time.time())


async def run(o: Options, arms: Sequence[str], data_dir: Path, workdir: Path
              ) -> dict[str, Any]:
    """Start every arm, feed the autopilot its history, then play the day on all arms at
    once: the same requests at the same moments, under the same load of the machine."""
    day = Day(read_trace(data_dir), o.live_day, o.hour_s, o.peak_rps, UTC_OFFSETS)
    pre = o.preroll_h * o.hour_s
    schedule = arrivals(day, -pre, o.day_s, o.seed)
    token = secrets.token_hex(16)
    # The autopilot first: its history is fed while the other arms start.
    started = sorted((Arm(name, workdir / name, token) for name in arms),
                     key=lambda a: a.name != "autopilot")
    out: dict[str, Any] = {"arms": {}, "day": day}
    feed_task: asyncio.Task[None] | None = None
    try:
        t0 = 0.0
        if started[0].name == "autopilot":
            first = started[0]
            first.dir.mkdir()
            await first.start(o, day.regions)
            assert first.controller is not None
            # At least two days; more when the other arms take longer to start.
            t0 = aligned_t0(max(o.history_days * o.day_s, o.start_allowance_s) + pre,
                            o.hour_s)
            feed = HistoryFeed(first.controller.url, token, day, t0, until=-pre)
            feed_task = asyncio.create_task(feed.run())
            print(f"  autopilot: up; feeding {(t0 - pre - time.monotonic()) / o.day_s:.1f} "
                  "days of history while the other arms start")
        rest = [a for a in started if a.name != "autopilot"]
        for arm in rest:
            arm.dir.mkdir()
        await asyncio.gather(*(arm.start(o, day.regions) for arm in rest))
        print(f"  {', '.join(a.name for a in rest)}: up")
        if feed_task is not None:
            await feed_task
        else:
            t0 = aligned_t0(pre, o.hour_s)
        auto = next((a for a in started if a.name == "autopilot"), None)
        if time.monotonic() > t0 - pre + 2.0:
            print(f"  (the arms started {time.monotonic() - t0 + pre:.0f} s after the "
                  "history ended: the preroll is that much shorter)")
        print("  the day starts (all arms at once)")
        days = await asyncio.gather(*(run_day(arm, schedule, t0) for arm in started))
        for arm, records in zip(started, days, strict=True):
            out["arms"][arm.name] = {"records": records, "samples": arm.samples,
                                     "late": arm.late}
        if auto is not None:
            out["plans"] = await auto.plans()
            out["t0_unix"] = time.time() - (time.monotonic() - t0)
    finally:
        if feed_task is not None:
            feed_task.cancel()
        for arm in started:
            await arm.stop()
    return out


def main(o: Options, arms: Sequence[str], json_path: str | None, plot_path: str | None,
         keep_dir: str | None = None) -> int:
    from skymesh.util.jsonio import write_json
    from skymesh_lab.demos.autopilot_report import plot, print_timeline, summarise
    from skymesh_lab.sim.workloads.data import data_dir

    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm {unknown[0]!r}; one of {', '.join(ARMS)}")
    if o.day_s % 24:
        raise SystemExit("--day-seconds must be a multiple of 24 (whole-second hours)")
    load0 = os.getloadavg()
    t_start = time.monotonic()
    print(f"== Autopilot on a compressed day: {o.day_s:.0f} s per day ({o.hour_s:.0f} s per "
          f"hour), regions {', '.join(UTC_OFFSETS)}, arms {', '.join(arms)} ==")
    with tempfile.TemporaryDirectory(prefix="skymesh-autopilot-", dir=keep_dir) as tmp:
        raw = asyncio.run(run(o, arms, data_dir(), Path(tmp)))
    doc = summarise(raw, o)
    doc["machine"] = {"cpus": os.cpu_count(), "load_average_1m_at_start": round(load0[0], 2),
                      "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                      "wall_seconds": round(time.monotonic() - t_start, 1)}
    print_timeline(doc)
    if plot_path:
        plot(doc, Path(plot_path))
        print(f"  plot: {plot_path}")
    write_json(json_path, doc)
    return 0
