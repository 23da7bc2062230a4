"""The macrobenchmark and the diurnal curve on the faithful setup (issue #24 item 3): the
scheduler and client choices reach the simulator, the engine probe only observes, and the
pages render SkyLB's figures beside ours."""

from __future__ import annotations

from argparse import Namespace
from dataclasses import replace
from typing import Any

import pytest

from skymesh_lab.bench import diurnal, results_faithful, skylb_faithful, skylb_macro
from skymesh_lab.bench.results import command_for
from skymesh_lab.bench.skylb_setup import CLIENT_SETS, SKYLB_CLIENT_WORKLOADS, Options

SMALL = {"us": 1, "eu": 1, "asia": 1}


def small(name: str, clients: str = "skylb") -> Any:
    """A workload of ``clients``' set on 3 replicas with a few clients per region."""
    spec = CLIENT_SETS[clients][name]
    return replace(skylb_macro.scale_clients(spec, 0.1), replicas=SMALL)


def test_skylb_clients_run_skylbs_tree_workloads_and_keep_the_chat_ones() -> None:
    assert SKYLB_CLIENT_WORKLOADS["tot"].sim_workload == "tot-skylb"
    assert SKYLB_CLIENT_WORKLOADS["mixed-tree"].sim_workload == "mixed-tree-skylb"
    assert SKYLB_CLIENT_WORKLOADS["mixed-tree"].params["branching_per_region"] == {"us": 4}
    for w in ("chat-arena", "chat-wildchat"):
        assert replace(SKYLB_CLIENT_WORKLOADS[w], max_tokens=None) == skylb_macro.WORKLOADS[w]
    assert set(SKYLB_CLIENT_WORKLOADS) == set(skylb_macro.WORKLOADS)


def test_options_carry_scheduler_and_clients_and_reject_unknown_names() -> None:
    opts = skylb_macro.options_from_args(Namespace(scheduler="sglang", clients="skylb"))
    assert (opts.scheduler, opts.clients) == ("sglang", "skylb")
    default = skylb_macro.options_from_args(Namespace())
    assert (default.scheduler, default.clients) == ("vllm", "ours")
    with pytest.raises(SystemExit, match="scheduler"):
        skylb_macro.options_from_args(Namespace(scheduler="trt"))
    with pytest.raises(SystemExit, match="clients"):
        skylb_macro.options_from_args(Namespace(clients="theirs"))
    with pytest.raises(SystemExit, match="sim only"):
        skylb_macro.options_from_args(Namespace(mode="live", clients="skylb"))


def test_the_scheduler_reaches_every_replica_engine() -> None:
    cfg = skylb_macro.sim_config(small("tot"), "skymesh-prefix", 10.0, 0, "sglang")
    assert cfg.scheduler == "sglang" and cfg.workload == "tot-skylb"
    row_sgl = skylb_macro.run_sim(small("tot"), "skymesh-prefix", 20.0, 0, "sglang")
    row_vllm = skylb_macro.run_sim(small("tot"), "skymesh-prefix", 20.0, 0, "vllm")
    # Same clients and seed: only the engine differs, and it changes the timings.
    assert row_sgl["requests"] > 0 and row_vllm["requests"] > 0
    assert row_sgl["ttft_mean_s"] != row_vllm["ttft_mean_s"]


def test_the_engine_probe_observes_without_changing_the_run() -> None:
    spec = small("mixed-tree")
    row = skylb_macro.run_sim(spec, "single-ch", 20.0, 1, "sglang")
    assert 0.0 < row["kv_usage_mean"] <= row["kv_usage_max_replica_mean"] <= 1.0
    assert 0.0 <= row["kv_full_fraction"] <= 1.0
    assert row["replica_running_mean"] > 0
    assert row["balancer_queue_total_mean"] == 0  # blind pushing never queues
    # The same run without the probe gives the same metrics.
    cfg = skylb_macro.sim_config(spec, "single-ch", 20.0, 1, "sglang")
    from skymesh_lab.sim.runner import Simulation
    from skymesh_lab.sim.workloads import build_workload

    wl = build_workload(cfg.workload, regions=list(cfg.regions), seed=1, duration_s=20.0,
                        **cfg.workload_params)
    sim = Simulation(cfg, wl)
    sim.run()
    plain = skylb_macro.window_metrics(sim, 2.0, 20.0)
    for k in ("throughput_rps", "ttft_p90_s", "e2e_p50_s", "prefix_hit_rate", "requests"):
        assert row[k] == plain[k], k


def test_the_sweep_records_its_setup_and_the_command_carries_it() -> None:
    opts = Options(duration_s=10.0, workloads=("tot",), systems=("single-ll", "skymesh-prefix"),
                   progress=False, scheduler="sglang", clients="skylb")
    specs = {"tot": small("tot")}
    res = skylb_macro.run_sim_sweep(opts, specs)
    assert res["setup"]["scheduler"] == "sglang" and res["setup"]["clients"] == "skylb"
    assert res["setup"]["workloads"]["tot"]["sim_workload"] == "tot-skylb"
    cmd = command_for(res, skylb_macro.Path("x.json"))
    assert "--scheduler sglang" in cmd and "--clients skylb" in cmd


def test_setups_parse_and_bad_ones_name_the_part() -> None:
    assert skylb_faithful.parse_setups("sglang/skylb, vllm/ours") == [
        ("sglang", "skylb"), ("vllm", "ours")]
    for bad in ("sglang", "trt/skylb", "vllm/theirs", ""):
        with pytest.raises(ValueError):
            skylb_faithful.parse_setups(bad)
    assert skylb_faithful.main(["macro", "--setups", "x/y"]) == 2


def test_diurnal_takes_the_scheduler_and_keeps_its_signatures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The simulator itself is exercised above; here only what diurnal hands it (a real
    # run loads all of ShareGPT, seconds on a loaded machine).
    from skymesh_lab.bench.max_tokens import MaxTokens
    from skymesh_lab.sim.workloads.poisson import PoissonWorkload

    seen: list[Any] = []

    def fake_run(cfg: Any, workload: Any = None) -> dict[str, Any]:
        seen.append((cfg, workload))
        return {k: 0.0 for k in ("throughput_rps", "ttft_p50_s", "ttft_p90_s", "e2e_p50_s",
                                 "prefix_hit_rate", "preemptions", "max_balancer_queue")
                } | {"region_stats": {}}

    def fake_build(name: str, **kw: Any) -> Any:
        assert name == "sharegpt-chat" and kw["clients_per_region"] == diurnal.CLIENTS
        return PoissonWorkload(regions=kw["regions"], seed=0, duration_s=1.0)

    monkeypatch.setattr(diurnal, "run", fake_run)
    monkeypatch.setattr(diurnal, "build_workload", fake_build)
    r = diurnal.run_one("mesh-overflow", 3, 5.0, 0, scheduler="sglang", max_tokens=512)
    cfg, wl = seen[-1]
    assert r["replicas"] == 3 and cfg.scheduler == "sglang" and cfg.forwarding
    assert isinstance(wl, MaxTokens) and wl.max_tokens == 512
    diurnal.run_one("region-local", 3, 5.0, 0)  # the old call still works: vLLM, no cap
    cfg, wl = seen[-1]
    assert cfg.scheduler == "vllm" and not cfg.forwarding and not isinstance(wl, MaxTokens)
    res = diurnal.main(5.0, 0, range(12, 13), scheduler="sglang")
    assert res["setup"]["scheduler"] == "sglang"
    assert {c.scheduler for c, _ in seen[2:]} == {"sglang"}
    assert diurnal.replicas_to_match([{"system": "m", "replicas": 9, "throughput_rps": 9.9}],
                                     "m", 10.0) == 9
    with pytest.raises(SystemExit, match="scheduler"):
        diurnal.run_experiment(Namespace(duration=5.0, seed=0, scheduler="trt"))


def _macro_data() -> dict[str, Any]:
    def run(system: str, rps: float, p90: float, hit: float) -> dict[str, Any]:
        return {"workload": "tot", "system": system, "throughput_rps": rps,
                "ttft_mean_s": p90 / 2, "ttft_p50_s": p90 / 2, "ttft_p90_s": p90,
                "e2e_mean_s": 10.0, "e2e_p50_s": 10.0, "e2e_p90_s": 20.0,
                "prefix_hit_rate": hit, "kv_usage_mean": 0.3, "preemptions": 4}

    runs = [run("single-ch", 10.0, 2.0, 0.9), run("region-local", 10.5, 1.0, 0.9),
            run("skymesh-prefix", 12.0, 0.5, 0.95)]
    from skymesh_lab.bench.skylb_setup import PAPER, comparisons

    block = {"scheduler": "sglang", "clients": "skylb", "runs": runs,
             "comparisons": comparisons(runs)}
    return {"setups": [block], "paper": PAPER, "setup": {"duration_s": 120, "seed": 0}}


def test_the_macro_page_puts_the_paper_beside_each_setup() -> None:
    text = results_faithful.skylb_macro_faithful(_macro_data())
    assert "| tot | sglang / skylb | single-ch | 1.20x |" in text
    assert "89.56-90.01%" in text  # the paper's ToT hit rate
    assert "10.08-23.38%" in text  # the paper's P90 TTFT range
    assert "| tot | sglang / skylb | skymesh-prefix | 30.0% |" in text  # probe figures
    assert "Every system, SGLang mode with SkyLB's clients" in text


def test_the_diurnal_page_gives_the_mesh_ratio_and_the_paper() -> None:
    runs = [{"system": s, "replicas": n, "throughput_rps": x, "ttft_p90_s": 1.0,
             "region_stats": {}}
            for s, n, x in (("region-local", 9, 8.0), ("region-local", 12, 10.0),
                            ("mesh-overflow", 9, 9.9), ("mesh-overflow", 12, 11.0))]
    data = {"setups": [{"scheduler": "sglang", "runs": runs,
                        "replicas_to_match_12_by_rule": {"overflow": 9}}],
            "paper": skylb_faithful.PAPER_DIURNAL, "setup": {"duration_s": 200, "seed": 0}}
    text = results_faithful.diurnal_cost_faithful(data)
    assert "| sglang | mesh-overflow | 1.10-1.24x | 9 |" in text
    assert "| **paper** (SGLang) | SkyLB | 1.07-1.18x | 9 |" in text


def test_per_workload_parts_merge_into_the_whole_sweep() -> None:
    specs = {w: small(w) for w in ("tot", "mixed-tree")}

    def sweep(workloads: tuple[str, ...]) -> dict[str, Any]:
        opts = Options(duration_s=10.0, workloads=workloads, progress=False,
                       systems=("single-ll", "skymesh-prefix", "oracle"),
                       scheduler="sglang", clients="skylb")
        return skylb_macro.run_sim_sweep(opts, specs)

    whole = sweep(("tot", "mixed-tree"))
    merged = skylb_faithful.merge_parts("sglang", "skylb", [sweep(("tot",)),
                                                             sweep(("mixed-tree",))])

    def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]

    assert strip(merged["runs"]) == strip(whole["runs"])
    assert merged["comparisons"] == whole["comparisons"]
    assert merged["ceiling"] == whole["ceiling"]
    assert merged["setup"] == whole["setup"]


def test_max_tokens_caps_every_request_of_a_closed_loop_workload() -> None:
    from skymesh_lab.bench.max_tokens import MaxTokens
    from skymesh_lab.sim.runner import SimConfig, Simulation
    from skymesh_lab.sim.workloads import build_workload

    inner = build_workload("tot-gsm8k", regions=["us"], seed=0, duration_s=20.0,
                           clients_per_region=3, output_scale=3.0)
    capped = MaxTokens(inner, 64)
    cfg = SimConfig(workload="tot-gsm8k", regions=["us"], replicas={"us": 1},
                    scheduler="sglang", duration_s=20.0)
    sim = Simulation(cfg, capped)
    sim.run()
    items = [r.item for r in sim.records]
    assert len(items) > 3  # follow-ups (on_complete) were capped too, not just the first
    assert all(i.max_new_tokens == 64 and 1 <= i.output_len <= 64 for i in items)
    assert any(i.output_len == 64 for i in items)  # some answers were longer: cut
    with pytest.raises(ValueError):
        MaxTokens(inner, 0)


def test_skylb_chat_clients_send_512_max_tokens_and_ours_none() -> None:
    from skymesh_lab.bench.skylb_setup import SKYLB_CHAT_MAX_TOKENS

    assert SKYLB_CHAT_MAX_TOKENS == 512
    for w in ("chat-arena", "chat-wildchat"):
        assert SKYLB_CLIENT_WORKLOADS[w].max_tokens == 512
        assert skylb_macro.WORKLOADS[w].max_tokens is None


def _vllm_block() -> dict[str, Any]:
    from skymesh_lab.bench.skylb_setup import comparisons

    runs = [dict(r, throughput_rps=r["throughput_rps"] + 1.0, ttft_p90_s=r["ttft_p90_s"] * 2)
            for r in _macro_data()["setups"][0]["runs"]]
    return {"scheduler": "vllm", "clients": "skylb", "runs": runs,
            "comparisons": comparisons(runs)}


def test_the_macro_page_shows_both_engine_modes_side_by_side() -> None:
    data = _macro_data()
    data["setups"].append(_vllm_block())
    text = results_faithful.skylb_macro_faithful(data)
    # The headline: one row per mode, then the paper's.
    assert "| tot | sglang / skylb | single-ch | 1.20x |" in text
    assert "| tot | vllm / skylb | single-ch | 1.18x |" in text
    # Per system, the modes read across a row: req/s, TTFT p90, E2E p50 per mode.
    assert ("| tot | skymesh-prefix | 12.00 | 13.00 | 0.50 s | 1.00 s | 10.0 s | 10.0 s |"
            in text)
    assert "Every system, SGLang mode with SkyLB's clients" in text
    assert "Every system, vLLM mode with SkyLB's clients" in text
    assert "over seeds" not in text  # one seed: no spread table
    one = _macro_data()
    assert "side by side" not in results_faithful.skylb_macro_faithful(one)


def test_the_seed_table_gives_mean_and_range_of_the_headline_ratios() -> None:
    def at(tput_x: float, p90_frac: float, best: str) -> dict[str, Any]:
        return {"scheduler": "sglang", "clients": "skylb", "runs": [],
                "comparisons": {"chat-arena": {"best_single": best,
                                               "throughput_x_vs_best_single": tput_x,
                                               "ttft_p90_frac_of_best_single": p90_frac}}}

    from skymesh_lab.bench.skylb_setup import PAPER

    data = {"setups": [at(1.2, 0.5, "single-ch")], "paper": PAPER,
            "setup": {"duration_s": 60, "seed": 0, "seeds": [0, 1, 2]},
            "by_seed": [{"seed": 1, "setups": [at(1.0, 0.3, "single-ll")]},
                        {"seed": 2, "setups": [at(1.1, 0.7, "single-ch")]}]}
    text = results_faithful.seed_spread(data)
    assert "Seeds 0, 1, 2" in text
    assert ("| chat-arena | sglang / skylb | 3 | single-ch, single-ll | 1.10x (1.00-1.20x) "
            "| 50.0% (30.0-70.0%) |") in text
    assert "| chat-arena | **paper** (SGLang, SkyLB's clients) | - | LL | 1.12-1.20x | - |" in text
    assert results_faithful.seed_spread({k: v for k, v in data.items() if k != "by_seed"}) == ""


def test_seeds_parse_and_bad_ones_are_refused() -> None:
    assert skylb_faithful.parse_seeds("0, 1,2") == [0, 1, 2]
    for bad in ("", "0,0", "-1", "a"):
        with pytest.raises(ValueError):
            skylb_faithful.parse_seeds(bad)
    assert skylb_faithful.main(["macro", "--seeds", "1,1"]) == 2


def test_extra_seeds_are_the_same_sweep_at_that_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real sweep at a small size: each part runs its workload on 3 replicas.
    def part(sched: str, clients: str, workload: str, duration_s: float, seed: int,
             progress: bool, ceiling: bool) -> dict[str, Any]:
        opts = Options(duration_s=duration_s, seed=seed, workloads=(workload,),
                       systems=("single-ll", "skymesh-prefix"), progress=False,
                       scheduler=sched, clients=clients, ceiling=ceiling)
        return skylb_macro.run_sim_sweep(opts, {workload: small(workload, clients)})

    monkeypatch.setattr(skylb_faithful, "_macro_part", part)
    setups = [("sglang", "skylb"), ("vllm", "skylb")]
    both = skylb_faithful.run_macro(setups, 10.0, 0, ("tot",), extra_seeds=(1,))
    alone = skylb_faithful.run_macro(setups, 10.0, 1, ("tot",))
    assert both["setup"]["seeds"] == [0, 1] and "seeds" not in alone["setup"]
    assert [e["seed"] for e in both["by_seed"]] == [1]
    for slim, full in zip(both["by_seed"][0]["setups"], alone["setups"], strict=True):
        assert (slim["scheduler"], slim["clients"]) == (full["scheduler"], full["clients"])
        assert slim["comparisons"] == full["comparisons"]
        assert [{k: r[k] for k in skylb_faithful.SEED_ROW_KEYS} for r in full["runs"]] == \
            slim["runs"]
    # The seed reaches the simulator: seed 0's runs differ from seed 1's.
    keys = skylb_faithful.SEED_ROW_KEYS
    assert [{k: r[k] for k in keys} for r in both["setups"][0]["runs"]] != \
        both["by_seed"][0]["setups"][0]["runs"]
