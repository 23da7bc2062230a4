"""The lb-workers page and its benches say which HTTP server the balancer ran."""

from __future__ import annotations

from pathlib import Path

from skymesh_lab.bench.dispatch_cost_live import default_http_server
from skymesh_lab.bench.lb_workers_page import cost_section, lb_workers, server_name


def test_a_versions_default_server_is_read_from_its_tree(tmp_path: Path) -> None:
    net = tmp_path / "new" / "skymesh" / "net"
    net.mkdir(parents=True)
    (net / "serving.py").write_text('HTTP_SERVERS = ("aiohttp", "lean")\n'
                                    'DEFAULT_HTTP_SERVER = "lean"\n')
    old = tmp_path / "old" / "skymesh" / "net"
    old.mkdir(parents=True)
    (old / "serving.py").write_text("def serve_app(): ...\n")  # before the choice existed
    assert default_http_server(str(tmp_path / "new")) == "lean"
    assert default_http_server(str(tmp_path / "old")) == "aiohttp"
    assert default_http_server(None) == "lean"  # this checkout's


def _live(servers: dict[str, str] | None) -> dict[str, object]:
    cell = {"median": 150.0, "min": 140.0, "max": 160.0, "rounds": [150.0]}
    version = {"configs": {"default": cell, "rr": cell}, "ratio_rounds": [1.0],
               "ratio_median": 1.0, "ratios": {}}
    setup = {"workers": 2, "connections": 64, "rounds": 1, "duration_s": 4.0, "seed": 0,
             "configs": {"default": "(no flags)", "rr": "--policy round-robin"},
             "base": "6b2f2cd", "commit": "abc", "load_average_1m_at_start": 0.5,
             "cpus": 2, "date": "2026-11-29",
             **({"http_server": servers} if servers is not None else {})}
    return {"setup": setup, "versions": {"current": version, "base": version},
            "command": "python -m skymesh_lab.bench.dispatch_cost_live"}


def test_the_cost_section_names_each_versions_server() -> None:
    text = cost_section(_live({"current": "lean", "base": "aiohttp"}))
    assert "each version's default): now `lean`, `6b2f2cd` `aiohttp`." in text
    assert server_name(None) in cost_section(_live(None))  # a run that recorded none


def test_the_page_names_the_server_of_its_live_runs() -> None:
    doc = {"setup": {"workers": [1, 2], "repeats": 1, "usable_cores": 2, "replicas": 4,
                     "clients": 2, "requests": 4, "groups": 2, "connections": 64,
                     "duration_s": 6.0, "http_server": "lean"},
           "locality": {"runs": [], "median_hit_rate": {}},
           "throughput": {"runs": [], "median": {}}}
    assert "HTTP server (`listen.http_server`) `lean` in every live run" in lb_workers(doc)
    del doc["setup"]["http_server"]
    assert "not recorded in the run (aiohttp's" in lb_workers(doc)
