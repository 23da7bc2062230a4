"""``skymesh bench skylb-macro``: the contract JSON, the oracle's bound, the mixed tree's
per-region branching, a live smoke run, and the README generator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import run_bounded

from skymesh_lab.bench import results, skylb_macro
from skymesh_lab.sim.runner import Simulation
from skymesh_lab.sim.workloads import build_workload

CONTRACT_SYSTEMS = {"single-rr", "single-ll", "single-ch", "single-sgl", "region-local",
                    "skymesh-ch", "skymesh-prefix", "skymesh-lmetric", "oracle"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("macro") / "q.json"
    plots = out.parent / "plots"
    r = subprocess.run([sys.executable, "-m", "skymesh_lab.bench.skylb_macro", "--mode", "sim",
                        "--quick", "--no-progress", "--json", str(out), "--plots", str(plots)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| skymesh-prefix |" in r.stdout  # the markdown table was printed
    return json.loads(out.read_text()), plots


def test_quick_writes_contract_json(quick: tuple[dict[str, Any], Path]) -> None:
    res, plots = quick
    runs = res["runs"]
    for workload in skylb_macro.QUICK_WORKLOADS:
        systems = {r["system"] for r in runs if r["workload"] == workload}
        assert systems == CONTRACT_SYSTEMS
    for r in runs:
        for key in skylb_macro.CONTRACT_KEYS[2:]:
            assert isinstance(r[key], float), (r["system"], key)
        assert r["throughput_rps"] > 0
        assert 0.0 <= r["prefix_hit_rate"] <= 1.0
        assert r["ttft_p90_s"] >= r["ttft_p50_s"] > 0
    pngs = sorted(p.name for p in plots.glob("*.png"))
    assert pngs == [f"skylb-macro-sim-{w}.png" for w in sorted(skylb_macro.QUICK_WORKLOADS)]


def test_oracle_hit_rate_bounds_every_system(quick: tuple[dict[str, Any], Path]) -> None:
    """Up to closed-loop noise: each system's clients issue a different request set (a
    faster system reaches later, longer turns), so a system with the same perfect program
    affinity (consistent hashing) can land a fraction of a point above. A real shortfall
    of the oracle (a prefix-trie oracle collapses onto one replica: 63% vs 97% on trees)
    is far outside that."""
    res, _ = quick
    for workload in skylb_macro.QUICK_WORKLOADS:
        by = {r["system"]: r["prefix_hit_rate"] for r in res["runs"]
              if r["workload"] == workload}
        oracle = by.pop("oracle")
        worst = max(by, key=lambda s: by[s])
        assert oracle >= by[worst] - 0.01, (workload, worst, by[worst], oracle)


def test_throughput_ceiling_is_above_every_system(quick: tuple[dict[str, Any], Path]) -> None:
    """The ceiling (oracle, 16x replicas, no WAN) serves the same clients faster than any
    system on the real fleet; its ratio to the best single balancer is reported."""
    res, _ = quick
    for workload in skylb_macro.QUICK_WORKLOADS:
        ceiling = res["ceiling"][workload]["throughput_rps"]
        runs = [r for r in res["runs"] if r["workload"] == workload]
        assert all(ceiling > r["throughput_rps"] for r in runs), workload
        c = res["comparisons"][workload]
        assert c["ceiling_throughput_x_vs_best_single"] > max(
            1.0, c["throughput_x_vs_best_single"])
        # No queue and no WAN: the lowest P90 TTFT any router could give these clients.
        assert c["ceiling_ttft_p90_frac_of_best_single"] < min(
            1.0, c["ttft_p90_frac_of_best_single"])


def test_single_balancer_pays_the_rtt() -> None:
    """A single US balancer: eu and asia clients' TTFT includes their RTT to it; the same
    balancer with the RTTs scaled to zero does not."""
    spec = skylb_macro.WORKLOADS["chat-wildchat"]

    def ttft_by_region(rtt_scale: float) -> dict[str, float]:
        cfg = skylb_macro.sim_config(spec, "single-ll", 30.0, 0)
        cfg.rtt_scale = rtt_scale
        wl = build_workload(cfg.workload, regions=list(skylb_macro.REGIONS), seed=0,
                            duration_s=30.0, **cfg.workload_params)
        sim = Simulation(cfg, wl)
        sim.run()
        out = {}
        for region in skylb_macro.REGIONS:
            t = [r.t_first - r.t_arrival for r in sim.records if r.ok and r.item.region == region]
            out[region] = min(t)
        return out

    far, near = ttft_by_region(1.0), ttft_by_region(0.0)
    # asia <-> us is 160 ms round trip: the fastest asia request cannot beat it.
    assert far["asia"] >= 0.160
    assert near["asia"] < 0.160
    assert far["us"] < 0.160


def test_mixed_tree_branches_per_region() -> None:
    """Completing every node of each client's first tree: the US client's tree has 85
    nodes (4-branch, depth 4), the EU client's 15 (2-branch)."""
    wl = build_workload("tot-gsm8k", regions=["us", "eu"], seed=0, duration_s=None,
                        clients_per_region={"us": 1, "eu": 1}, branching=2,
                        branching_per_region={"us": 4})
    nodes: dict[str, int] = {"us": 0, "eu": 0}
    todo = [item for _, item in wl.initial()]
    while todo:
        item = todo.pop()
        if item.meta["tree_seq"] != 0:
            continue  # the client's second tree: not counted
        nodes[item.region] += 1
        todo.extend(i for _, i in wl.on_complete(item, 1.0, True))
    assert nodes == {"us": 85, "eu": 15}


def test_results_generator_prints_commands(quick: tuple[dict[str, Any], Path],
                                           tmp_path: Path) -> None:
    res, _ = quick
    path = tmp_path / "macro.json"
    path.write_text(json.dumps(res))
    text = results.render([path])
    assert f"--json {path}" in text
    assert "--workloads chat-wildchat,mixed-tree" in text
    assert "| oracle |" in text and "Targets" in text and "Throughput ceiling" in text


@pytest.mark.parametrize("scheduler", ["vllm", "sglang"])
def test_live_smoke(tmp_path: Path, scheduler: str) -> None:
    """Real processes: one workload, a single balancer and the mesh, a few seconds each;
    in SGLang mode the replicas publish SGLang's metrics only, and the balancers and the
    hit-rate counters read those."""
    out = tmp_path / "live.json"
    r = run_bounded([sys.executable, "-m", "skymesh_lab.bench.skylb_macro", "--mode", "live",
                     "--quick", "--duration", "4", "--scheduler", scheduler, "--no-progress",
                     "--json", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["setup"]["scheduler"] == scheduler
    runs = res["runs"]
    assert {x["system"] for x in runs} == set(skylb_live_quick_systems())
    for x in runs:
        assert x["requests"] > 0 and x["throughput_rps"] > 0, x
        assert x["ttft_p50_s"] > 0
    # Second chat turns resend the conversation: the hit-rate counters (vLLM's, or SGLang's
    # rate x prompt tokens) see cached tokens.
    assert any(x["prefix_hit_rate"] > 0 for x in runs), runs


def skylb_live_quick_systems() -> tuple[str, ...]:
    from skymesh_lab.bench.skylb_live import QUICK_LIVE_SYSTEMS

    return QUICK_LIVE_SYSTEMS


# ---------------------------------------------------------------------------- load scale
def test_parse_load_scale_forms() -> None:
    ones = dict.fromkeys(skylb_macro.WORKLOADS, 1.0)
    assert skylb_macro.parse_load_scale(None) == ones
    assert skylb_macro.parse_load_scale("2.5") == dict.fromkeys(skylb_macro.WORKLOADS, 2.5)
    assert skylb_macro.parse_load_scale("chat-arena=2, tot=3") == {
        **ones, "chat-arena": 2.0, "tot": 3.0}
    assert skylb_macro.parse_load_scale("calibrated") == {
        **ones, **skylb_macro.CALIBRATED_LOAD_SCALE}
    for bad in ("0", "-1", "nope=2", "chat-arena", "tot=0", "x"):
        with pytest.raises(ValueError):
            skylb_macro.parse_load_scale(bad)


def test_scale_clients_multiplies_counts_only() -> None:
    arena = skylb_macro.scale_clients(skylb_macro.WORKLOADS["chat-arena"], 1.75)
    assert arena.params == {"clients_per_region": 140}
    mixed = skylb_macro.WORKLOADS["mixed-tree"]
    scaled = skylb_macro.scale_clients(mixed, 0.1)  # us 2 * 0.1 rounds to 0: kept at 1
    assert scaled.params["clients_per_region"] == {"us": 1, "eu": 2, "asia": 2}
    assert {k: v for k, v in scaled.params.items() if k != "clients_per_region"} == {
        k: v for k, v in mixed.params.items() if k != "clients_per_region"}
    assert mixed.params["clients_per_region"] == {"us": 2, "eu": 20, "asia": 20}  # untouched
    assert skylb_macro.scale_clients(mixed, 1.0) is mixed


def test_load_scale_reaches_the_simulation_and_the_setup() -> None:
    """The scaled sweep issues more requests than the unscaled one and records the scale
    and the client counts it ran in ``setup``; the contract keys stay."""
    def sweep(scale: str) -> dict[str, Any]:
        opts = skylb_macro.Options(duration_s=40.0, workloads=("chat-wildchat",),
                                   systems=("single-ll",), progress=False,
                                   load_scale=skylb_macro.parse_load_scale(scale))
        return skylb_macro.run_sim_sweep(opts)

    base, big = sweep(""), sweep("chat-wildchat=3")
    assert set(big) >= {"runs", "comparisons", "paper", "targets", "setup"}
    assert big["setup"]["load_scale"] == {"chat-wildchat": 3.0}
    assert big["setup"]["workloads"]["chat-wildchat"]["params"]["clients_per_region"] == {
        "us": 120, "eu": 90, "asia": 90}
    assert base["setup"]["workloads"]["chat-wildchat"]["params"]["clients_per_region"] == {
        "us": 40, "eu": 30, "asia": 30}
    (b,), (g,) = base["runs"], big["runs"]
    assert set(skylb_macro.CONTRACT_KEYS) <= set(g)
    assert g["requests"] > 2 * b["requests"]


def test_load_scale_saturates_the_single_balancer() -> None:
    """The point of the calibration: at the paper's 80 clients per region the single US
    balancer (consistent hashing, blind pushing) keeps P90 TTFT under a second; at twice
    that its hot replicas run out of KV cache (preemptions) and P90 TTFT reaches seconds."""
    spec = skylb_macro.WORKLOADS["chat-arena"]
    low = skylb_macro.run_sim(spec, "single-ch", 200.0, 0)
    high = skylb_macro.run_sim(skylb_macro.scale_clients(spec, 2.0), "single-ch", 200.0, 0)
    assert low["ttft_p90_s"] < 1.0 and low["preemptions"] == 0
    assert high["ttft_p90_s"] > 3.0 and high["preemptions"] > 0


def test_load_scale_cli_rejects_live_and_bad_values() -> None:
    ap = skylb_macro.build_parser()
    with pytest.raises(SystemExit):
        skylb_macro.options_from_args(ap.parse_args(["--mode", "live", "--load-scale", "2"]))
    with pytest.raises(SystemExit):
        skylb_macro.options_from_args(ap.parse_args(["--load-scale", "tot=-1"]))
    opts = skylb_macro.options_from_args(ap.parse_args(["--load-scale", "calibrated"]))
    assert opts.load_scale["chat-arena"] == skylb_macro.CALIBRATED_LOAD_SCALE["chat-arena"]
