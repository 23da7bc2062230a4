"""Forecast-aware overflow (skymesh.mesh.outlook): the peer ranking, its reduction to the
plain overflow rule without a forecast (property tests through the real dispatcher), the
controller's outlook from a round record, and the simulator's wiring."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from skymesh.balancer.config import ConfigError, MeshConfig, parse_config
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.mesh.outlook import OutlookParams, PeerOutlook, RegionOutlook
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import ModelLoad
from skymesh_controller.autopilot.outlook import outlook

W = 60.0
PEERS = ("eu", "asia", "sa")


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def region(name: str, *load: float, start: float = 0.0, model: str = "m") -> RegionOutlook:
    return RegionOutlook(name, model, start, W, tuple(load))


def ranked(o: PeerOutlook, loads: Mapping[str, ModelLoad | None]) -> list[str]:
    return o.rank(list(loads), "m", loads)


def idle(total: int = 4) -> ModelLoad:
    return ModelLoad(available=total, total=total, queue=0)


def test_equal_peers_now_the_one_whose_load_falls_wins() -> None:
    o = PeerOutlook(clock=Clock(10.0))
    o.set_regions({"lb-eu": "eu", "lb-asia": "asia"})
    o.update([region("eu", 0.5, 0.9, 1.3), region("asia", 0.9, 0.5, 0.2)])
    both = {"lb-eu": ModelLoad(2, 4, 0), "lb-asia": ModelLoad(2, 4, 0)}
    assert ranked(o, both) == ["lb-asia"]
    # Within slack of the best, both stay and the peer policy chooses as before.
    o.update([region("eu", 0.5, 0.9, 1.0), region("asia", 0.6, 0.8, 0.95)])
    assert ranked(o, both) == ["lb-eu", "lb-asia"]


def test_windows_are_read_from_the_one_containing_now_and_expire() -> None:
    clock = Clock(0.0)
    o = PeerOutlook(OutlookParams(horizon=1, current_weight=0.0), clock=clock)
    o.set_regions({"a": "eu", "b": "asia"})
    o.update([region("eu", 0.1, 0.9, 0.9), region("asia", 0.5, 0.5, 0.5)])
    loads = {"a": idle(), "b": idle()}
    assert ranked(o, loads) == ["a"]
    clock.now = W + 1  # eu's second window: 0.9 against 0.5
    assert ranked(o, loads) == ["b"]
    clock.now = 3 * W + 1  # past every window: no forecast left, the plain rule
    assert ranked(o, loads) == ["a", "b"]
    assert o.score("a", "m", idle(), clock.now) == (0.0, False)


def test_a_peer_without_forecast_scores_its_heartbeat_alone() -> None:
    o = PeerOutlook(clock=Clock())
    o.set_regions({"a": "eu", "b": "asia"})
    o.update([region("eu", 0.8, 0.8, 0.8)])
    # b: no outlook, 3 of 4 replicas busy -> 0.75; a: (0 + 3 x 0.8) / 4 = 0.6.
    assert o.score("a", "m", idle(), 0.0) == (pytest.approx(0.6), True)
    assert o.score("b", "m", ModelLoad(1, 4, 0), 0.0) == (0.75, False)
    assert ranked(o, {"a": idle(), "b": ModelLoad(1, 4, 0)}) == ["a"]
    # Another model's forecast is no forecast for this one.
    o.update([region("eu", 0.0, 0.0, 0.0, model="other")])
    assert ranked(o, {"a": ModelLoad(0, 4, 0), "b": idle()}) == ["a", "b"]


def test_bad_outlooks_and_parameters_are_refused() -> None:
    for bad in ((-0.1,), (math.nan,), (math.inf,)):
        with pytest.raises(ValueError, match="load"):
            region("eu", *bad)
    with pytest.raises(ValueError, match="window_s"):
        RegionOutlook("eu", "m", 0.0, 0.0, (0.5,))
    with pytest.raises(ValueError, match="horizon"):
        OutlookParams(horizon=0)
    with pytest.raises(ValidationError, match=r"outlook\.horizon"):
        MeshConfig.model_validate({"id": "x", "certs_dir": "c", "outlook": {"horizon": 0}})
    with pytest.raises(ValidationError, match=r"outlook\.speed"):
        MeshConfig.model_validate({"id": "x", "certs_dir": "c", "outlook": {"speed": 1}})
    o = region("eu", 0.25, 0.5, start=120.0)
    assert RegionOutlook.from_json(o.to_json()) == o


def test_the_outlook_needs_a_controller_to_read_it_from() -> None:
    lb = {"region": "us", "replicas": [{"url": "http://127.0.0.1:8001"}],
          "mesh": {"id": "lb-us", "certs_dir": "pki", "outlook": {"enabled": True}}}
    with pytest.raises(ConfigError, match=r"mesh\.outlook\.enabled.*controller section"):
        parse_config(lb)
    cfg = parse_config({**lb, "controller": {"url": "http://127.0.0.1:9000"}})
    assert cfg.mesh is not None and cfg.mesh.outlook.enabled


# -- the dispatcher: overflow goes where the forecast says, and nowhere else changes --------
def overflowing(seed: int, outlook_: PeerOutlook | None) -> Dispatcher:
    """A balancer whose one replica is full, so every request overflows to a peer."""
    d = Dispatcher(build_policy("least-load"), PushMode.SP_O, max_outstanding=1, hold_s=0.0,
                   peer_policy=build_policy("random", rng=random.Random(seed)), tau=8)
    d.set_targets({"r1": ["m"]})
    d.set_peers(PEERS)
    d.outlook = outlook_
    busy = Ticket(RouteRequest("busy", model="m"), 0.0)
    d.offer(busy, 0.0)
    assert d.pump(0.0) == [busy]
    return d


def picks(d: Dispatcher, available: list[int], n: int) -> list[str | None]:
    for seq, (pid, a) in enumerate(zip(PEERS, available, strict=True), 1):
        d.on_peer_heartbeat(pid, 0.0, 1, seq, {"m": ModelLoad(a, 64, 0)})
    out = []
    for i in range(n):
        t = Ticket(RouteRequest(f"q{i}", model="m"), 0.0)
        d.offer(t, 0.0)
        got = d.pump(0.0)
        out.append(got[0].target if got else None)
        if not got:
            d.cancel(t)
    return out


def test_the_dispatcher_overflows_to_the_falling_region_only() -> None:
    o = PeerOutlook(clock=Clock())
    o.set_regions({"eu": "eu", "asia": "asia", "sa": "sa"})
    o.update([region("eu", 0.6, 0.9, 1.2), region("asia", 0.9, 0.6, 0.3),
              region("sa", 0.7, 0.9, 1.0)])
    assert set(picks(overflowing(0, o), [32, 32, 32], 20)) == {"asia"}
    assert len(set(picks(overflowing(0, None), [32, 32, 32], 20))) == 3


no_forecast = st.sampled_from(["none", "empty", "other-model", "expired", "unmapped"])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), available=st.lists(st.integers(0, 64), min_size=3,
                                                       max_size=3),
       case=no_forecast, n=st.integers(1, 30))
def test_without_a_usable_forecast_overflow_is_exactly_the_plain_rule(
        seed: int, available: list[int], case: str, n: int) -> None:
    o: PeerOutlook | None = PeerOutlook(clock=Clock(10 * W))
    assert o is not None
    o.set_regions({p: p for p in PEERS} if case != "unmapped" else {})
    if case == "empty":
        o.update([])
    elif case == "other-model":
        o.update([region(p, 0.1 * i, model="other") for i, p in enumerate(PEERS)])
    elif case in ("expired", "unmapped"):
        o.update([region(p, 0.1 * i, 0.2) for i, p in enumerate(PEERS)])  # 2 windows ago
        if case == "unmapped":
            o.clock = Clock(0.0)
    elif case == "none":
        o = None
    plain = picks(overflowing(seed, None), available, n)
    assert picks(overflowing(seed, o), available, n) == plain


@settings(max_examples=60, deadline=None)
@given(loads=st.lists(st.lists(st.floats(0, 3), min_size=1, max_size=4), min_size=3,
                      max_size=3),
       busy=st.lists(st.integers(0, 4), min_size=3, max_size=3))
def test_the_ranking_keeps_the_best_and_only_peers_within_slack(
        loads: list[list[float]], busy: list[int]) -> None:
    o = PeerOutlook(clock=Clock())
    o.set_regions({p: p for p in PEERS})
    o.update([region(p, *ld) for p, ld in zip(PEERS, loads, strict=True)])
    hb = {p: ModelLoad(4 - b, 4, 0) for p, b in zip(PEERS, busy, strict=True)}
    kept = ranked(o, dict(hb))
    scores = {p: o.score(p, "m", hb[p], 0.0)[0] for p in PEERS}
    best = min(scores.values())
    assert kept and kept == [p for p in PEERS if scores[p] <= best + o.params.slack]


# -- the controller's side ------------------------------------------------------------------
def round_record(pid: str, ts: float, forecast: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": pid, "ts": ts, "forecast": forecast, "inputs": {
        "window_s": 600, "current": [
            {"model": "llama", "region": "us", "gpu": "L4", "count": 2},
            {"model": "llama", "region": "us", "gpu": "H100", "count": 1},
            {"model": "llama", "region": "eu", "gpu": "L4", "count": 0},
            {"model": "llama", "region": "asia", "gpu": "A10", "count": 3}]}}


def test_the_controller_outlook_is_forecast_over_current_capacity() -> None:
    per_instance = {"llama": {"L4": 100.0, "H100": 800.0}}
    f = [{"model": "llama", "region": r, "start": 6000, "tokens_per_s": [500.0, 1500.0, -1.0]}
         for r in ("us", "eu", "asia")]
    skipped = {"id": "newest", "ts": 3.0, "forecast": [], "inputs": {}}
    got = outlook([skipped, round_record("p2", 2.0, f), round_record("p1", 1.0, [])],
                  per_instance)
    assert got["plan"] == "p2" and got["window_s"] == 600
    # us: 2 x 100 + 800 = 1000 tokens/s; eu runs nothing and asia an unknown GPU: left out.
    assert got["regions"] == [{"region": "us", "model": "llama", "start": 6000,
                               "window_s": 600, "capacity_tokens_per_s": 1000.0,
                               "forecast_tokens_per_s": [500.0, 1500.0, 0.0],
                               "load": [0.5, 1.5, 0.0]}]
    assert RegionOutlook.from_json(got["regions"][0]).load == (0.5, 1.5, 0.0)
    assert outlook([], per_instance)["regions"] == []


# -- the simulator: the same object on every balancer, fed in virtual time -------------------
def test_the_simulator_gives_every_balancer_the_feed() -> None:
    from skymesh_lab.sim.outlook import attach
    from skymesh_lab.sim.runner import SimConfig, Simulation
    from skymesh_lab.sim.workloads import build_workload

    class Feed:
        interval_s = 5.0
        calls: list[float] = []

        def outlooks(self, now: float) -> list[RegionOutlook]:
            self.calls.append(now)
            return [RegionOutlook("eu", "default", now, 5.0, (0.2,))]

    cfg = SimConfig(workload="poisson", regions=["us", "eu", "asia"],
                    replicas={"us": 1, "eu": 1, "asia": 1}, seed=1, duration_s=12.0,
                    workload_params={"rate_rps": 2.0})
    sim = Simulation(cfg, build_workload("poisson", regions=cfg.regions, seed=1,
                                         duration_s=12.0, rate_rps=2.0))
    feed = Feed()
    got = attach(sim, feed)
    res = sim.run()
    assert res["completed"] > 0
    assert feed.calls[:3] == [0.0, 5.0, 10.0]
    assert got["us"] is sim.balancers["us"].dispatcher.outlook
    assert got["us"].regions == {"lb-eu": "eu", "lb-asia": "asia"}
    assert [o.region for o in got["asia"].outlooks()] == ["eu"]
