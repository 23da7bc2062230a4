"""The pure parts of ``skymesh bench router-overhead``: wrk output, /proc accounting,
medians and spreads over rounds, and the results page from a small JSON fixture."""

from __future__ import annotations

import argparse
import math

import pytest

from skymesh_lab.bench import router_overhead as ro
from skymesh_lab.bench import router_overhead_page as page
from skymesh_lab.bench import router_overhead_stats as st

WRKJSON_OUT = """Running 2s test @ http://127.0.0.1:1/v1/chat/completions
  2 threads and 64 connections
Requests/sec:  28670.55
WRKJSON {"requests":59987,"duration_us":2000000,"bytes":19015879,"connect_errors":1,\
"read_errors":2,"write_errors":0,"status_errors":5,"timeouts":3,"lat_mean_us":7045.5,\
"lat_p50_us":932,"lat_p90_us":23793,"lat_p99_us":53425,"lat_p999_us":75427,"lat_max_us":79885}
"""

WRK_TEXT = """Running 10s test @ http://127.0.0.1:8080/
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.10ms    1.02ms  30.00ms   90.00%
  Latency Distribution
     50%  850.00us
     75%    1.20ms
     90%    2.50ms
     99%    1.05s
  120000 requests in 10.00s, 10.00MB read
  Socket errors: connect 0, read 4, write 0, timeout 6
  Non-2xx or 3xx responses: 7
Requests/sec:  12000.00
"""


def test_parse_wrk_prefers_the_scripts_json_line() -> None:
    r = st.parse_wrk(WRKJSON_OUT)
    assert r["requests"] == 59987
    assert r["rps"] == pytest.approx(29993.5)
    assert r["p50_ms"] == pytest.approx(0.932)
    assert r["p99_ms"] == pytest.approx(53.425)
    assert r["errors"] == 6  # connect + read + write + timeouts
    assert r["non_2xx"] == 5


def test_parse_wrk_reads_the_human_summary_with_units() -> None:
    r = st.parse_wrk(WRK_TEXT)
    assert r["requests"] == 120000
    assert r["rps"] == pytest.approx(12000.0)
    assert r["p50_ms"] == pytest.approx(0.85)
    assert r["p90_ms"] == pytest.approx(2.5)
    assert r["p99_ms"] == pytest.approx(1050.0)
    assert r["errors"] == 10
    assert r["non_2xx"] == 7


def test_parse_wrk_refuses_what_is_not_wrk() -> None:
    with pytest.raises(ValueError, match="not wrk output"):
        st.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused")


def _stat(pid: int, ppid: int, ut: int, stime: int, cut: int = 0, cst: int = 0,
          rss: int = 100, comm: str = "python") -> str:
    rest = ["S", ppid, 1, 1, 0, -1, 0, 0, 0, 0, 0, ut, stime, cut, cst, 20, 0, 1, 0, 5,
            1000, rss, 0]
    return f"{pid} ({comm}) " + " ".join(str(x) for x in rest)


def test_parse_stat_counts_fields_after_the_last_parenthesis() -> None:
    s = st.parse_stat(_stat(42, 7, 300, 40, 5, 6, rss=2500, comm="tokio (rt) worker"))
    assert (s.pid, s.ppid, s.utime, s.stime, s.cutime, s.cstime, s.rss_pages) == \
        (42, 7, 300, 40, 5, 6, 2500)


def test_tree_cpu_sums_living_descendants_and_reaped_children() -> None:
    snap = [st.parse_stat(x) for x in (
        _stat(10, 1, 100, 20, cut=30, cst=4),  # the router; a reaped child's 34 ticks
        _stat(11, 10, 50, 5),                  # a worker
        _stat(12, 11, 7, 1),                   # the worker's child
        _stat(20, 1, 999, 999),                # someone else
    )]
    members = st.tree(snap, 10)
    assert sorted(p.pid for p in members) == [10, 11, 12]
    assert st.tree_cpu_ticks(members) == 100 + 20 + 30 + 4 + 50 + 5 + 7 + 1
    assert st.tree_rss_bytes(members, 4096) == 3 * 100 * 4096
    assert st.tree(snap, 99) == []


def test_cpu_per_thousand_requests() -> None:
    # 250 ticks at 100 Hz = 2.5 s of CPU for 10,000 requests: 250 ms per 1,000
    assert st.cpu_ms_per_1k(1000, 1250, 10_000, 100) == pytest.approx(250.0)
    assert math.isnan(st.cpu_ms_per_1k(0, 10, 0, 100))


def test_machine_busy_from_two_proc_stat_lines() -> None:
    before = [100, 0, 100, 700, 100, 0, 0, 0]
    after = [200, 0, 200, 900, 100, 0, 0, 0]  # +200 busy, +200 idle
    assert st.machine_busy(before, after) == pytest.approx(0.5)


def test_spread_is_median_min_max_and_drops_nan() -> None:
    s = st.spread([3.0, 1.0, float("nan"), 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    assert s["rel_spread"] == pytest.approx(9.0 / 2.5)
    assert st.spread([float("nan")]) == {}


def _seg(router: str, case: str, rnd: int, rps: float, p50: float, p99: float,
         **extra: float) -> dict[str, object]:
    return {"router": router, "case": case, "round": rnd, "rps": rps, "p50_ms": p50,
            "p99_ms": p99, "errors": 0.0, "non_2xx": 0.0, "machine_busy": 0.9,
            "foreign_cores": 0.4, **extra}


SEGMENTS = [
    _seg("direct", "stream-c1", 0, 5000, 0.10, 0.50),
    _seg("direct", "stream-c1", 1, 5000, 0.20, 0.40),
    _seg("skymesh-lb", "stream-c1", 0, 2000, 0.40, 2.50, cpu_ms_per_1k=100.0),
    _seg("skymesh-lb", "stream-c1", 1, 2000, 0.60, 4.40, cpu_ms_per_1k=140.0),
    _seg("direct", "rr-c64", 0, 40000, 1.0, 5.0),
    _seg("direct", "rr-c64", 1, 30000, 1.0, 5.0),
    _seg("skymesh-lb", "rr-c64", 0, 8000, 4.0, 40.0, cpu_ms_per_1k=120.0),
    _seg("skymesh-lb", "rr-c64", 1, 9000, 4.0, 20.0, cpu_ms_per_1k=110.0),
    _seg("vllm-router", "rr-c64", 0, 20000, 2.0, 8.0, cpu_ms_per_1k=50.0),
    _seg("vllm-router", "rr-c64", 1, 10000, 2.0, 8.0, cpu_ms_per_1k=52.0),
]


def test_summarize_pairs_added_latency_with_the_same_rounds_direct_run() -> None:
    s = st.summarize(SEGMENTS)
    row = s["skymesh-lb"]["stream-c1"]
    # round 0: 0.40 - 0.10 = 0.30; round 1: 0.60 - 0.20 = 0.40
    assert row["added_p50_ms"]["median"] == pytest.approx(0.35)
    assert row["added_p99_ms"]["min"] == pytest.approx(2.0)
    assert row["added_p99_ms"]["max"] == pytest.approx(4.0)
    assert row["cpu_ms_per_1k"]["median"] == pytest.approx(120.0)
    assert s["skymesh-lb"]["rr-c64"]["p99_over_p50"]["median"] == pytest.approx(7.5)
    assert "added_p50_ms" not in s["direct"]["rr-c64"]


def test_generator_headroom_against_the_fastest_router() -> None:
    s = st.summarize(SEGMENTS)
    assert st.generator_headroom(s, "rr-c64") == pytest.approx(35000 / 15000)
    assert st.generator_headroom(s, "tail-c256") is None


def test_prefix_hit_rate_from_counters_or_a_gauge() -> None:
    text = ('# TYPE skymesh_prefix_hits_total counter\n'
            'skymesh_prefix_hits_total{model="m"} 30\n'
            'skymesh_prefix_lookups_total{model="m"} 40\n'
            'skymesh_requests_total{model="m",outcome="ok"} 99\n')
    after = st.prefix_samples(text)
    assert after == {"skymesh_prefix_hits_total": 30.0, "skymesh_prefix_lookups_total": 40.0}
    before = {"skymesh_prefix_hits_total": 10.0, "skymesh_prefix_lookups_total": 20.0}
    assert st.prefix_hit_rate(before, after) == pytest.approx(1.0)  # 20 of 20
    assert st.prefix_hit_rate({}, st.prefix_samples("skymesh_prefix_hit_rate 0.8\n")) == 0.8
    assert st.prefix_hit_rate({}, st.prefix_samples("skymesh_queue_length 3\n")) is None


FIXTURE = {
    "setup": {"command": "skymesh bench router-overhead --rounds 2 --duration 1",
              "rounds": 2, "duration_s": 1.0, "cores": 2, "wrk": "wrk 4.1.0",
              "loadavg_before": [3.5, 2.0, 1.0], "loadavg_after": [4.0, 2.0, 1.0],
              "started": "2026-11-28T17:00:00+00:00", "finished": "2026-11-28T17:01:00+00:00",
              "versions": {"vllm-router": "0.1.17"},
              "routers": {"skymesh-lb": {"rr": ["--policy", "round-robin"], "default": []}}},
    "segments": SEGMENTS,
    "rss": {"skymesh-lb/rr": {"before_mb": 60.0, "after_mb": 70.5, "requests": 1000.0}},
    "long_run": {"skymesh-lb": [{"requests": 0.0, "rss_mb": 60.0},
                                {"requests": 5e5, "rss_mb": 90.0},
                                {"requests": 1e6, "rss_mb": 80.0}]},
}


def test_page_renders_the_fixture() -> None:
    text = page.router_overhead(FIXTURE)
    assert "| | skymesh-lb | vllm-router |" in text
    assert "| non-stream, c=64, round-robin: req/s | 8,500 [8,000, 9,000] " \
           "| 15,000 [10,000, 20,000] |" in text
    assert "| added latency p50, stream c=1: ms | +0.35 [+0.30, +0.40] | - |" in text
    assert "| rr-c64 | 35,000 [30,000, 40,000] | 1.00 [1.00, 1.00] | 5.00 [5.00, 5.00] " \
           "| 2.3x |" in text
    assert "| skymesh-lb/rr | 60.0 | 70.5 | 1,000 |" in text
    assert "| skymesh-lb | 1,000,000 | 60.0 | 80.0 | 90.0 |" in text
    assert "load average 3.50 at the start, 4.00 at the end" in text
    assert "90% busy" in text and "used 0.40 cores" in text
    assert "No prefix hit rate in this run" in text
    assert "## The floor" not in text  # no floor ran
    assert "No socket error" in text
    assert "skymesh-lb rr: `--policy round-robin`; skymesh-lb default: `(none)`" in text
    assert "c=256" not in text.split("## The generator")[0]  # no tail case in the fixture


def test_page_counts_errors_per_router() -> None:
    data = {**FIXTURE, "segments": [*SEGMENTS, _seg("vllm-router", "rr-c64", 2, 1, 1, 1,
                                                    errors=3.0, non_2xx=4.0)]}
    assert "vllm-router 7" in page.router_overhead(data)


def test_skymesh_workers_flag_only_when_skymesh_lb_has_it() -> None:
    opts = ro.Options(skymesh_args=["--log-level", "warning"], skymesh_workers=2)
    assert ro.skymesh_flags("rr", opts, "usage: skymesh-lb [--workers N]") == [
        "--policy", "round-robin", "--push-mode", "bp", "--log-level", "warning",
        "--workers", "2"]
    assert ro.skymesh_flags("default", ro.Options(), "") == []
    with pytest.raises(RuntimeError, match="no --workers flag"):
        ro.skymesh_flags("default", opts, "usage: skymesh-lb [--port PORT]")


def test_options_and_the_command_that_reproduces_them() -> None:
    args = argparse.Namespace(rounds=5, duration=2.0, seed=0, quick=False,
                              routers="skymesh-lb,vllm-router", cases=None,
                              skymesh_workers=None, skymesh_args="--foo 'a b'", requests=0)
    opts = ro.options_from_args(args)
    assert (opts.rounds, opts.duration_s, opts.routers) == (5, 2.0,
                                                            ("skymesh-lb", "vllm-router"))
    assert opts.skymesh_args == ["--foo", "a b"]
    assert ro.command_line(opts) == ("skymesh bench router-overhead --rounds 5 --duration 2 "
                                     "--routers skymesh-lb,vllm-router "
                                     "--skymesh-args '--foo '\"'\"'a b'\"'\"''")
    with pytest.raises(SystemExit, match="unknown router or case: nginx"):
        ro.options_from_args(argparse.Namespace(routers="nginx"))


def test_skymesh_bench_knows_router_overhead_as_live_only(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from skymesh.cli import main
    from skymesh_lab.cli import BENCH_EXPERIMENTS

    # Live-only: not among the experiments that `make bench` runs with --mode sim.
    assert "router-overhead" not in BENCH_EXPERIMENTS
    assert main(["bench", "router-overhead", "--mode", "sim", "--rounds", "1"]) == 2
    assert "runs with --mode live" in capsys.readouterr().err


def test_tail_instruments_time_collections_per_generation_and_reset() -> None:
    from skymesh_lab.bench import router_overhead_tail as tail

    inst = tail.Instruments()
    inst.on_gc("start", {"generation": 2})
    inst.on_gc("stop", {"generation": 2})
    inst.add(inst.handler, 0.001)
    inst.add(inst.handler, 0.003)
    snap = inst.snapshot()
    assert snap["gc"]["2"]["n"] == 1 and snap["gc"]["0"] == {}
    assert snap["handler"]["p50_ms"] == pytest.approx(3.0)  # upper median of two
    assert snap["handler"]["max_ms"] == pytest.approx(3.0)
    inst.reset()
    assert inst.snapshot()["handler"] == {}


def test_tail_table_takes_medians_per_variant() -> None:
    from skymesh_lab.bench import router_overhead_tail as tail

    def row(rnd: int, p99: float, closed: int) -> dict[str, object]:
        return {"round": rnd, "lb": "tuned-2", "connections": 256,
                "wrk": {"rps": 4000.0, "p50_ms": 50.0, "p99_ms": p99},
                "handler": {"p50_ms": 0.2, "p99_ms": 1.0}, "loop_lag": {"p99_ms": 3.0,
                                                                       "max_ms": 9.0},
                "gc": {"0": {"n": 5.0, "max_ms": 3.0}, "1": {},
                       "2": {"n": 2.0, "max_ms": 30.0}},
                "accept_to_first_handler": {"p50_ms": 100.0, "max_ms": 900.0},
                "client_conns_closed": 0.0, "upstream_connects": closed,
                "unread_request_s": {"p99_ms": 20.0, "max_ms": 40.0},
                "unread_answer_s": {"p99_ms": 700.0, "max_ms": 1500.0}}

    res = {"setup": {"variants": [["tuned-2", 256], ["nogc-2", 256]]},
           "rows": [row(0, 500.0, 900), row(1, 700.0, 1100), row(2, 600.0, 1000)]}
    text = tail.table(res)
    assert "| tuned, 2 | 256 | 4,000 | 50.0 | 600.0 | 12.0 | 0.20 | 1.00 | 3.0 | 9.0 " \
           "| 7 / 30.0 | 100.0 / 900.0 | 0 | 1,000 | 20 / 40 | 700 / 1500 | - |" in text
    assert "nogc" not in text  # no rows, no line


def test_tail_reads_the_age_of_unread_bytes_from_ss() -> None:
    from skymesh_lab.bench import router_overhead_tail as tail

    text = ("0      66     127.0.0.1:1000 127.0.0.1:5000\n"
            "\t bbr rto:204 lastsnd:3 lastack:3 busy:6ms\n"
            "160    0      127.0.0.1:1000 127.0.0.1:5001\n"
            "\t bbr rto:204 lastsnd:900 lastrcv:850 lastack:850\n"
            "160    0      127.0.0.1:1000 127.0.0.1:5002\n"
            "\t bbr rto:204 busy:1ms\n")
    assert tail.parse_ss(text) == {("127.0.0.1:1000", "127.0.0.1:5001"): 0.85,
                                   ("127.0.0.1:1000", "127.0.0.1:5002"): 0.0}


def test_page_says_what_was_left_out() -> None:
    setup = {**FIXTURE["setup"], "notes": {"vllm-router/rr": "left out: never answered",
                                           "sglang-router": "sglang-router 0.3.2 in /tmp/x"}}
    text = page.router_overhead({**FIXTURE, "setup": setup})
    assert "Not measured as planned: vllm-router/rr: left out: never answered." in text
    assert "/tmp/x" not in text
    assert "Not measured as planned" not in page.router_overhead(FIXTURE)


def _floor_segments(floor_rps: float, lean_rps: float | None = None
                    ) -> list[dict[str, object]]:
    """Two rounds: skymesh-lb, sglang-router and the floors in the c=64 cases (the lean
    stack's floor only given its req/s)."""
    out: list[dict[str, object]] = []
    lean = [("lean-stack-floor", lean_rps, 30.0)] if lean_rps else []
    for rnd in (0, 1):
        for router, rps, cpu in (("skymesh-lb", 7500, 214.0), ("sglang-router", 19500, 64.0),
                                 ("aiohttp-floor", floor_rps * 0.8, 70.0),
                                 ("lb-stack-floor", floor_rps, 40.0), *lean,
                                 ("asyncio-floor", 60000, 12.0)):
            out.append(_seg(router, "default-c64", rnd, rps, 3.0, 9.0, cpu_ms_per_1k=cpu,
                            prefix_hit_rate=0.5 if router.endswith("floor") else 0.9))
            out.append(_seg(router, "rr-c64", rnd, rps * 2, 2.0, 6.0,
                            cpu_ms_per_1k=cpu / 2))
    return out


def test_floor_lines_say_the_target_is_out_of_reach_below_sglang() -> None:
    lines = page.floor_lines(st.summarize(_floor_segments(15000)))
    assert lines[0] == ("Non-streaming c=64 with the default case's bodies, medians: "
                        "sglang-router's cache-aware path 19,500 req/s; the floors on "
                        "aiohttp's server aiohttp-floor 12,000, lb-stack-floor 15,000 req/s; "
                        "skymesh-lb's default 7,500 (its round-robin 15,000 with the fixed "
                        "bodies).")
    # rr: skymesh-lb 107 ms, lb-stack-floor 20 ms; default: 214 ms against 40 ms
    assert lines[1] == ("Of skymesh-lb's round-robin CPU (107 ms per 1,000 requests), the "
                        "HTTP stack alone (lb-stack-floor: 20 ms) is 19%; the other 87 ms "
                        "(81%) is SkyMesh's own logic.")
    assert "lb-stack-floor: 40 ms) is 19%" in lines[2]
    assert lines[3].startswith("By this measurement the target (skymesh-lb's default at "
                               "or above sglang-router's cache-aware req/s) is out of reach "
                               "on this stack: a proxy with no logic at all on aiohttp's "
                               "server and uvloop (lb-stack-floor) serves 15,000 req/s, 77% "
                               "of")
    assert "Without aiohttp (asyncio-floor) the floor is 60,000 req/s (308%" in lines[3]
    assert lines[4].endswith("lb-stack-floor costs 40 ms per 1,000 requests with the default "
                             "case's bodies, sglang-router's whole cache-aware path 64; to "
                             "match it, SkyMesh's own logic may cost 24 ms per 1,000 requests "
                             "(its default path's logic costs 174 today).")
    # rr CPU: aiohttp-floor 35, lb-stack-floor 20, asyncio-floor 6
    assert lines[5] == ("Where aiohttp's cost lies, in ms of CPU per 1,000 round-robin "
                        "requests: aiohttp's server 14 (lb-stack-floor over asyncio-floor); "
                        "aiohttp's `ClientSession` against skymesh-lb's client 15 "
                        "(aiohttp-floor over lb-stack-floor).")


def test_floor_lines_judge_by_the_lean_stack_when_it_ran() -> None:
    lines = page.floor_lines(st.summarize(_floor_segments(15000, lean_rps=21000)))
    assert "the floors on skymesh-lb's HTTP stacks aiohttp-floor 12,000, lb-stack-floor " \
           "15,000, lean-stack-floor 21,000 req/s" in lines[0]
    # The stack skymesh-lb runs by default is the one its logic is measured over.
    assert "HTTP stack alone (lean-stack-floor: 15 ms) is 14%" in lines[1]
    assert lines[3].startswith("By this measurement the target (skymesh-lb's default at "
                               "or above sglang-router's cache-aware req/s) is within this "
                               "stack's reach: lean-stack-floor serves 21,000 req/s, 108% of")
    assert lines[4].endswith("to match it, SkyMesh's own logic may cost 34 ms per 1,000 "
                             "requests (its default path's logic costs 184 today).")
    assert lines[5].endswith("skymesh-lb's lean server and connection guard against "
                             "aiohttp's server 5 (lb-stack-floor over lean-stack-floor).")


def test_floor_lines_say_within_reach_when_the_floor_passes_sglang() -> None:
    lines = page.floor_lines(st.summarize(_floor_segments(25000)))
    assert lines[3].startswith("By this measurement the target (skymesh-lb's default at "
                                "or above sglang-router's cache-aware req/s) is within this "
                                "stack's reach: lb-stack-floor serves 25,000 req/s, 128% of")
    assert page.floor_lines(st.summarize(SEGMENTS)) == []  # no floor in the run
    dear = [{**seg, "cpu_ms_per_1k": 90.0} if seg["router"] == "lb-stack-floor" else seg
            for seg in _floor_segments(25000)]
    assert page.floor_lines(st.summarize(dear))[4].endswith(
        "the HTTP stack alone costs as much as sglang-router's whole path, so no SkyMesh "
        "logic fits.")


def test_page_shows_the_floor_table_and_every_prefix_hit_rate() -> None:
    setup = {**FIXTURE["setup"], "floor_workers": 2, "stub_prefix_cache": 8,
             "prefix_groups": 16}
    text = page.router_overhead({**FIXTURE, "setup": setup,
                                 "segments": _floor_segments(15000)})
    floor = text.split("## The floor")[1].split("## Memory")[0]
    assert "2 worker processes on one port with `SO_REUSEPORT`" in floor
    assert ("| lb-stack-floor | aiohttp's server and skymesh-lb's own httptools client "
            "(`skymesh.balancer.upstream`): skymesh-lb's HTTP stack with `listen.http_server: "
            "aiohttp` | 30,000 [30,000, 30,000] "
            "| 20 [20, 20] | 15,000 [15,000, 15,000] | 40 [40, 40] |") in floor
    assert "out of reach on this stack" in floor
    main = text.split("## The generator")[0]
    assert "floor" not in main  # the floors stay out of the routers' table
    assert ("each stub keeps the 8 most recently used of the 16 shared prefixes" in text)
    assert ("skymesh-lb 90.0% [90.0%, 90.0%], sglang-router 90.0% [90.0%, 90.0%], "
            "aiohttp-floor 50.0% [50.0%, 50.0%], lb-stack-floor 50.0% [50.0%, 50.0%], "
            "asyncio-floor 50.0% [50.0%, 50.0%].") in text


def test_floor_text_says_where_the_floors_workers_ran() -> None:
    def floor(**extra: object) -> str:
        setup = {**FIXTURE["setup"], "floor_workers": 2, **extra}
        text = page.router_overhead({**FIXTURE, "setup": setup,
                                     "segments": _floor_segments(15000)})
        return text.split("## The floor")[1].split("## Memory")[0]

    assert ("`SO_REUSEPORT` as skymesh-lb's default, each pinned to a core of its own "
            "(cores 0, 1) by skymesh-lb's own rule for `listen.pin_workers: auto`, in the "
            "same rounds") in floor(floor_cpus=[0, 1])
    assert "unpinned: skymesh-lb's rule for `listen.pin_workers: auto` leaves them" in floor(
        floor_cpus=None)
    assert "unpinned (this run is from before the floors followed" in floor()


def test_floors_run_only_the_non_streaming_c64_cases() -> None:
    assert set(ro.FLOORS) <= set(ro.ROUTERS)
    assert {c.name for c in ro.CASES if c.name in ro.FLOOR_CASES} == {"rr-c64", "default-c64"}
    assert ro.floor_workers(ro.Options(skymesh_workers=3)) == 3
    from skymesh.balancer.workers import resolve_workers, usable_cores
    assert ro.floor_workers(ro.Options()) == resolve_workers(
        "auto", usable_cores(), mesh_or_controller=False)


def _pair_segments() -> list[dict[str, object]]:
    """Three rounds of the default case; sglang-router's round 2 is missing."""
    return [
        _seg("skymesh-lb", "default-c64", 0, 9000, 4.0, 9.0, cpu_ms_per_1k=160.0),
        _seg("sglang-router", "default-c64", 0, 10000, 4.0, 9.0, cpu_ms_per_1k=130.0),
        _seg("skymesh-lb", "default-c64", 1, 12000, 4.0, 9.0, cpu_ms_per_1k=150.0),
        _seg("sglang-router", "default-c64", 1, 8000, 4.0, 9.0, cpu_ms_per_1k=150.0),
        _seg("skymesh-lb", "default-c64", 2, 1000, 4.0, 9.0, cpu_ms_per_1k=900.0),
        _seg("direct", "default-c64", 0, 80000, 0.5, 3.0),
    ]


def test_paired_ratios_divide_within_a_round_and_skip_unpaired_rounds() -> None:
    segs = _pair_segments()
    assert page.paired_ratios(segs, "default-c64", "rps") == pytest.approx([0.9, 1.5])
    assert page.paired_ratios(segs, "default-c64", "cpu_ms_per_1k") == pytest.approx(
        [160 / 130, 1.0])
    assert page.paired_ratios(segs, "rr-c64", "rps") == []


def test_paired_lines_count_the_rounds_at_or_above_sglang() -> None:
    (line,) = page.paired_lines(_pair_segments())
    assert line.startswith("default (cache-aware), c=64: skymesh-lb's req/s over "
                           "sglang-router's in the same round 1.20 [0.90, 1.50], at or "
                           "above 1 in 1 of 2 rounds")
    assert page.paired_lines(SEGMENTS) == []  # no sglang-router in the fixture


def test_page_shows_the_attached_focused_run() -> None:
    focused = {"setup": {**FIXTURE["setup"], "rounds": 3,  # type: ignore[dict-item]
                         "command": "skymesh bench router-overhead --cases default-c64"},
               "segments": _pair_segments()}
    text = page.router_overhead({**FIXTURE, page.FOCUSED: focused})
    section = text.split("## The default case alone, more rounds")[1]
    assert "| skymesh-lb | 9,000 [1,000, 12,000] | 160 [150, 900] |" in section
    assert "| sglang-router | 9,000 [8,000, 10,000] | 140 [130, 150] |" in section
    assert "`skymesh bench router-overhead --cases default-c64`" in section
    assert "1.20 [0.90, 1.50]" in section
    assert "## The default case alone" not in page.router_overhead(FIXTURE)
