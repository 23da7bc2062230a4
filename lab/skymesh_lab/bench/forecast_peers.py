"""Forecast-aware overflow against SkyLB's plain overflow rule, in the simulator.

The diurnal experiment's regions and clients (``skymesh_lab.bench.diurnal``: ShareGPT
chat, closed loop, prefix-tree policy, L4 replicas), with the load moving round the
world: each region's active clients follow a daily cosine, the three peaks a third of a
day apart (us, then eu, then asia), so while one region peaks, one peer is climbing
towards its own peak and the other is coming off it. A simulated day lasts ``day_s``
seconds; the run lasts two days and every figure covers the second one (the first is the
seasonal forecaster's history).

Arms, same seeds and same clients:

- ``overflow``: SkyLB Algorithm 1 as the mesh runs it by default.
- ``outlook-oracle``: the same, with ``skymesh.mesh.outlook`` fed the true client curve of
  the next windows.
- ``outlook-seasonal-naive``: fed the seasonal-naive forecaster of
  ``skymesh_controller.planning.forecast`` (the planner's default) over each region's own past
  tokens per window, as the controller's planner forecasts balancer telemetry.

Loads are relative to the mesh's mean load (1.0 = a region carrying a third of the
total; at 210 clients on 6 replicas that is about what a region can serve), the same
scale for both feeds. Figures: SLO attainment (share of requests with TTFT <=
``TTFT_SLO_S``), TTFT p50/p90, the share of requests forwarded to a peer, and of those the
share sent to a region past its peak.

    python -m skymesh_lab.bench.forecast_peers [--seeds 0,1,2] [--day-s 300] --json PATH
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from skymesh.mesh.outlook import OutlookParams, RegionOutlook
from skymesh.util.stats import percentile
from skymesh_controller.planning.forecast.registry import make_forecaster
from skymesh_lab.bench.diurnal import REGIONS
from skymesh_lab.sim.outlook import attach
from skymesh_lab.sim.runner import SimConfig, Simulation
from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_lab.sim.workloads.common import meta_int
from skymesh_lab.sim.workloads.sharegpt import ShareGPTChatWorkload

ARMS = ("overflow", "outlook-oracle", "outlook-seasonal-naive")
DAY_S = 300.0
WINDOWS_PER_DAY = 24
REPLICAS_PER_REGION = 2
# Clients per region: BASE at its trough, BASE + SWING at its peak. The three cosines sum
# to a constant (3 x BASE + 1.5 x SWING = 210 clients): diurnal-cost's 200 clients on 6
# replicas, where the mesh keeps up only by forwarding (region-local's TTFT p90 is 20 s),
# so where the overflow goes matters.
BASE = 20
SWING = 100
TTFT_SLO_S = 1.0
SEEDS = (0, 1, 2)


def _phase(region_index: int, t: float, day_s: float) -> float:
    return 2 * math.pi * (t / day_s - region_index / len(REGIONS))


def active_clients(region_index: int, t: float, day_s: float) -> float:
    """Clients of the region active at ``t``: peak at a third of a day per region."""
    return BASE + SWING * (1 + math.cos(_phase(region_index, t, day_s))) / 2


def falling(region_index: int, t: float, day_s: float) -> bool:
    """Whether the region's client count is going down at ``t`` (past its peak)."""
    return math.sin(_phase(region_index, t, day_s)) > 0


class DiurnalChat(Workload):
    """ShareGPT chat clients switched on and off by :func:`active_clients`: client ``k``
    of a region is active while more than ``k`` clients are; an inactive client's next
    turn waits until it is active again. Records every region's tokens per window (what
    the balancers' telemetry reports)."""

    name = "diurnal-chat"

    def __init__(self, seed: int, day_s: float, duration_s: float) -> None:
        self.day_s, self.duration_s = day_s, duration_s
        per = BASE + SWING
        self.inner = ShareGPTChatWorkload(regions=REGIONS, seed=seed, duration_s=duration_s,
                                          clients_per_region=per)
        self.window_s = day_s / WINDOWS_PER_DAY
        n = math.ceil(duration_s / self.window_s) + 1
        self.tokens = {r: np.zeros(n) for r in REGIONS}
        self._per = per

    def _defer(self, arrival: Arrival) -> Arrival | None:
        t, item = arrival
        j, rank = divmod(meta_int(item, "client"), self._per)
        while active_clients(j, t, self.day_s) <= rank:
            t = (math.floor(t) + 1.0)
            if t >= self.duration_s:
                return None
        self.tokens[item.region][int(t // self.window_s)] += item.prompt_len + item.output_len
        return t, item

    def initial(self) -> Any:
        out = [a for a in map(self._defer, self.inner.initial()) if a is not None]
        return iter(sorted(out, key=lambda a: a[0]))

    def on_complete(self, item: WorkItem, now: float, ok: bool = True) -> Any:
        return [a for a in map(self._defer, self.inner.on_complete(item, now, ok))
                if a is not None]


@dataclass
class OracleFeed:
    """The true client curve of the next windows, relative to the mean."""

    day_s: float
    horizon: int

    @property
    def interval_s(self) -> float:
        return self.day_s / WINDOWS_PER_DAY

    def outlooks(self, now: float) -> list[RegionOutlook]:
        w = self.interval_s
        first = math.floor(now / w)
        mean = BASE + SWING / 2
        return [RegionOutlook(r, "default", first * w, w, tuple(
            float(np.mean([active_clients(j, (first + i + f) * w, self.day_s)
                           for f in (0.0, 0.25, 0.5, 0.75)])) / mean
            for i in range(self.horizon)))
            for j, r in enumerate(REGIONS)]


@dataclass
class ForecastFeed:
    """A planner forecaster over each region's complete past windows of tokens; nothing
    until one season of history exists (the run's first day: plain overflow)."""

    workload: DiurnalChat
    horizon: int
    forecaster: str = "seasonal-naive"

    @property
    def interval_s(self) -> float:
        return self.workload.window_s

    def outlooks(self, now: float) -> list[RegionOutlook]:
        w = self.workload.window_s
        done = math.floor(now / w + 1e-9)  # windows before this one are complete
        if done < WINDOWS_PER_DAY:
            return []
        past = {r: self.workload.tokens[r][:done] for r in REGIONS}
        mean = float(np.mean([v.mean() for v in past.values()])) or 1.0
        out = []
        for r in REGIONS:
            f = make_forecaster(self.forecaster, WINDOWS_PER_DAY).fit(past[r])
            ahead = np.maximum(f.predict(self.horizon), 0.0) / mean
            out.append(RegionOutlook(r, "default", done * w, w,
                                     tuple(float(x) for x in ahead)))
        return out


def run_arm(arm: str, seed: int, day_s: float = DAY_S,
            params: OutlookParams | None = None) -> dict[str, Any]:
    params = params or OutlookParams()
    duration = 2 * day_s
    wl = DiurnalChat(seed, day_s, duration)
    cfg = SimConfig(workload="sharegpt-chat", regions=list(REGIONS),
                    replicas={r: REPLICAS_PER_REGION for r in REGIONS}, policy="prefix-tree",
                    forwarding=True, forwarding_rule="overflow", seed=seed,
                    duration_s=duration)
    sim = Simulation(cfg, wl)
    if arm == "outlook-oracle":
        attach(sim, OracleFeed(day_s, params.horizon), params)
    elif arm == "outlook-seasonal-naive":
        attach(sim, ForecastFeed(wl, params.horizon), params)
    elif arm != "overflow":
        raise ValueError(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")
    res = sim.run()
    return {"arm": arm, "seed": seed, **measure(sim, day_s),
            "wall_seconds": res["wall_seconds"]}


def measure(sim: Simulation, day_s: float) -> dict[str, Any]:
    """Figures over the requests that arrived on the second day."""
    recs = [r for r in sim.records if r.t_arrival >= day_s]
    done = [r for r in recs if r.ok]
    ttft = [r.t_first - r.t_arrival for r in done]
    index = {r: j for j, r in enumerate(REGIONS)}
    fwd = [r for r in recs if len(r.path) > 1]
    down = sum(1 for r in fwd if falling(index[r.path[1][0].region], r.t_arrival, day_s))
    return {
        "requests": len(recs), "completed": len(done),
        "slo_attainment": sum(1 for x in ttft if x <= TTFT_SLO_S) / max(1, len(recs)),
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p90_s": percentile(ttft, 90) if ttft else None,
        "forwarded_share": len(fwd) / max(1, len(recs)),
        # Of the forwarded requests, the share sent to a region past its peak.
        "forwarded_to_falling_share": down / len(fwd) if fwd else None,
        "throughput_rps": len(done) / day_s,
    }


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if mine:
            out[arm] = {k: float(np.mean([r[k] for r in mine if r[k] is not None]))
                        for k in ("slo_attainment", "ttft_p50_s", "ttft_p90_s",
                                  "forwarded_share", "forwarded_to_falling_share",
                                  "throughput_rps")}
    return out


def main(seeds: Sequence[int] = SEEDS, day_s: float = DAY_S,
         on_run: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every arm on every seed; ``on_run`` sees the result so far after each run."""
    params = OutlookParams()
    runs: list[dict[str, Any]] = []
    print(f"  {'arm':<24}{'seed':>5}{'SLO met':>9}{'TTFT p50':>10}{'TTFT p90':>10}"
          f"{'forwarded':>11}{'to falling':>12}")
    for seed in seeds:
        for arm in ARMS:
            r = run_arm(arm, seed, day_s, params)
            runs.append(r)
            print(f"  {arm:<24}{seed:>5}{r['slo_attainment']:>9.1%}{r['ttft_p50_s']:>9.2f}s"
                  f"{r['ttft_p90_s']:>9.2f}s{r['forwarded_share']:>11.1%}"
                  f"{r['forwarded_to_falling_share'] or 0.0:>12.1%}", flush=True)
            if on_run is not None:
                on_run(result(runs, seeds, day_s, params))
    return result(runs, seeds, day_s, params)


def result(runs: list[dict[str, Any]], seeds: Sequence[int], day_s: float,
           params: OutlookParams) -> dict[str, Any]:
    return {"runs": runs, "mean": summarize(runs),
            "setup": {"regions": list(REGIONS), "replicas_per_region": REPLICAS_PER_REGION,
                      "clients_trough": BASE, "clients_peak": BASE + SWING,
                      "day_s": day_s, "windows_per_day": WINDOWS_PER_DAY,
                      "measured": "second day", "ttft_slo_s": TTFT_SLO_S,
                      "seeds": list(seeds), "workload": "sharegpt-chat",
                      "policy": "prefix-tree", "peer_policy": "prefix-tree",
                      "outlook": {"horizon": params.horizon, "slack": params.slack,
                                  "current_weight": params.current_weight}}}


def cli(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.forecast_peers",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated")
    ap.add_argument("--day-s", type=float, default=DAY_S, help="simulated seconds a day")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)

    def save(out: dict[str, Any]) -> None:
        if args.json:  # after every run, so a long sweep leaves what it measured
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
                f.write("\n")

    save(main(seeds=tuple(int(s) for s in args.seeds.split(",")), day_s=args.day_s,
              on_run=save))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
