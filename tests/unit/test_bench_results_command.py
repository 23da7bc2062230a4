"""``skymesh_lab.bench.results`` rebuilds the command that reproduces a run, load scale included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skymesh_lab.bench.results import command_for
from skymesh_lab.bench.results import main as results_main
from skymesh_lab.bench.results_pages import BY_NAME, SOURCES, render_pages
from skymesh_lab.bench.results_tables import num, pct, sp_microbench
from skymesh_lab.bench.skylb_macro import CALIBRATED_LOAD_SCALE, WORKLOADS, parse_load_scale


def _setup(scale: dict[str, float], workloads: list[str]) -> dict[str, object]:
    return {"setup": {"mode": "sim", "duration_s": 300, "workloads": dict.fromkeys(workloads),
                      "load_scale": scale}}


def test_the_reproducing_command_carries_the_load_scale() -> None:
    every = list(WORKLOADS)
    cal = {w: CALIBRATED_LOAD_SCALE.get(w, 1.0) for w in every}
    cmd = command_for(_setup(cal, every), Path("out/a.json"))
    assert "--load-scale calibrated" in cmd
    pair = {"chat-arena": 2.0, "tot": 1.0}
    cmd = command_for(_setup(pair, ["chat-arena", "tot"]), Path("b.json"))
    flag = cmd.split("--load-scale ")[1].split()[0]
    assert flag == "chat-arena=2"
    assert parse_load_scale(flag)["chat-arena"] == 2.0  # the flag parses back
    assert "--load-scale" not in command_for(_setup(dict.fromkeys(every, 1.0), every),
                                             Path("c.json"))


# The results pages: generated from the committed JSON, never edited by hand.

REPO = Path(__file__).resolve().parents[2]
DATA, PAGES = REPO / "docs" / "results" / "data", REPO / "docs" / "results"


def test_the_committed_results_pages_are_what_the_committed_json_gives() -> None:
    pages = render_pages(DATA, PAGES)
    assert len(pages) > 1, "no result JSON in docs/results/data"
    stale = [str(p.relative_to(REPO)) for p, text in pages.items()
             if not p.exists() or p.read_text() != text]
    assert not stale, (f"{stale} differ from what docs/results/data gives: run "
                       "python -m skymesh_lab.bench.results docs/results/data docs/results")
    committed = {p.name for p in PAGES.glob("*.md")}
    assert committed == {p.name for p in pages}, "a results page has no JSON behind it"


def test_every_page_shows_the_command_that_reproduces_it() -> None:
    for source in SOURCES:
        if (DATA / f"{source.name}.json").exists():
            text = (PAGES / f"{source.name}.md").read_text()
            assert source.command(f"docs/results/data/{source.name}.json") in text


def test_a_changed_figure_changes_the_page_and_check_reports_it(tmp_path: Path) -> None:
    data, out = tmp_path / "data", tmp_path / "pages"
    data.mkdir()
    plan = {"regions": 10, "models": 8, "gpu_types": 4, "solve_seconds": 0.25,
            "status": "optimal", "objective": 3311.5, "seed": 0}
    (data / "plan-ilp.json").write_text(json.dumps(plan))
    assert results_main([str(data), str(out)]) == 0
    page = (out / "plan-ilp.md").read_text()
    assert "250 ms" in page and "3,311.50" in page
    assert "skymesh plan bench --json docs/results/data/plan-ilp.json" in page
    assert results_main([str(data), str(out), "--check"]) == 0
    (data / "plan-ilp.json").write_text(json.dumps(plan | {"solve_seconds": 0.5}))
    assert results_main([str(data), str(out), "--check"]) == 1
    assert "(plan-ilp.md)" in (out / "README.md").read_text()


def test_missing_figures_print_as_a_dash_not_zero() -> None:
    assert num(None, ".2f") == "-" and pct(None) == "-"
    text = sp_microbench({"by_clients": {"30": {"systems": {"bp": {"throughput_rps": 1.5}},
                                                "ratios": {}}}})
    assert "| bp | 1.50 | - |" in text


def test_run_refuses_an_unknown_benchmark_by_name(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert results_main([str(tmp_path), str(tmp_path / "p"), "--run", "nope"]) == 2
    assert "unknown result nope" in capsys.readouterr().err


def test_the_vllm_burst_page_has_a_row_per_mode_and_server() -> None:
    # Figures over rounds as tools/e2e/burst_stats.py aggregates them (its own tests, with
    # the page's other tables, are in tests/e2e/test_burst_stats.py).
    def over(mean: float | None, lo: float | None = None, hi: float | None = None
             ) -> dict[str, float | int | None]:
        return {"mean": mean, "min": lo if lo is not None else mean,
                "max": hi if hi is not None else mean, "n": 3}
    server = {"waiting_mean": over(1.25, 1.0, 1.5), "waiting_max": over(5.0, 4.0, 6.0),
              "running_when_backlogged_mean": over(3.5)}
    mode = {"servers": {"a": server, "b": server}, "lb_queue_mean": over(20.0),
            "ttft_p50_s": over(1.5, 1.0, 2.0), "ttft_p90_s": over(None),
            "completion_s": over(30.0)}
    text = BY_NAME["vllm_burst"].render({"setup": {"servers": 2}, "modes": {"sp-p": mode}})
    assert ("| sp-p | a | 1.25 (1.00-1.50) | 6 | 3.50 | 20.0 | 1.5 s (1.0-2.0) | - | 30.0 s "
            "| - |") in text
    assert "| sp-p | b |" in text


def test_the_predictor_page_lists_overall_per_source_and_the_papers_row() -> None:
    moe = {"mae_tokens": 117.8, "acc25": 0.2, "acc50": 0.34, "acc100": 0.55,
           "ms_per_request": 0.3}
    text = BY_NAME["predict-eval"].render({
        "predictors": {"moe-mlp": moe}, "by_source": {"gsm8k": {"moe-mlp": moe}},
        "paper_preserve_table2": {"mae_tokens": 90.0, "acc25": 0.3, "acc50": 0.4,
                                  "acc100": 0.6},
        "samples": {"train": 700, "test": 300}})
    assert "| moe-mlp (all) | 117.80 | 20.00% | 34.00% | 55.00% | 0.30 ms |" in text
    assert "| moe-mlp (gsm8k) |" in text
    assert "| PreServe, Table 2 | 90.00 | 30.00% | 40.00% | 60.00% | - |" in text
