"""The access-log-cost benchmark's interval of a median (order statistics)."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from skymesh_lab.bench.access_log_cost import median_interval


@pytest.mark.parametrize(("n", "ranks"), [
    (12, (2, 9)),  # P(Binomial(12, 1/2) <= 2) = 0.019, <= 3: 0.073
    (24, (6, 17)),  # <= 6: 0.011, <= 7: 0.032
    (30, (9, 20)),  # <= 9: 0.021, <= 10: 0.049
])
def test_the_interval_is_the_binomial_order_statistics(n: int, ranks: tuple[int, int]) -> None:
    values = [float(i * i) for i in range(n)][::-1]  # any order
    low, high = median_interval(values)
    assert (low, high) == (float(ranks[0] ** 2), float(ranks[1] ** 2))
    assert low <= statistics.median(values) <= high


def test_too_few_values_for_95_percent_give_min_and_max() -> None:
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)


def test_an_outlier_does_not_widen_it() -> None:
    values = [10.0 + i % 3 for i in range(24)]
    assert median_interval([*values[:-1], 1e6]) == median_interval(values)


def test_request_path_cost_counts_the_loops_kernel_time_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: request_path_cost summed every value of ``thread_ticks``, whose
    ``loop_sys`` is part of ``loop`` already: the loop's kernel time counted twice."""
    from types import SimpleNamespace

    from skymesh_lab.bench import access_log_cost as alc
    from skymesh_lab.bench import request_path_cost as rpc

    readings = iter([{alc.LOOP: 0, alc.WRITER: 0, alc.THREADS: 0, alc.LOOP_SYS: 0},
                     {alc.LOOP: 100, alc.WRITER: 5, alc.THREADS: 3, alc.LOOP_SYS: 40}])
    monkeypatch.setattr(alc, "thread_ticks", lambda root: next(readings))
    monkeypatch.setattr(rpc.ro, "run_wrk", lambda url, case, duration_s: "")
    monkeypatch.setattr(rpc.st, "parse_wrk", lambda out: {
        "requests": 1000, "rps": 100.0, "errors": 0, "non_2xx": 0})
    daemon: Any = SimpleNamespace(proc=SimpleNamespace(pid=1), url="http://lb")
    seg = rpc.segment(daemon, "rr", 1.0)
    assert seg["ticks"] == 108  # loop (its kernel time within) + writer + other threads


def test_a_toggle_signals_the_daemon_and_waits_for_its_word(tmp_path: Any) -> None:
    """--toggle: the benchmark switches the daemon's access log with a signal and reads
    the CPU counters only once the daemon says it has switched."""
    import os
    import signal

    from skymesh_lab.bench import access_log_toggle as toggle

    ack = tmp_path / "ack"
    ack.write_text("on")
    got: list[str] = []

    def daemon_side(signum: int, frame: Any) -> None:
        got.append("on" if signum == toggle.ON else "off")
        ack.write_text(got[-1])

    old_on = signal.signal(toggle.ON, daemon_side)
    old_off = signal.signal(toggle.OFF, daemon_side)
    try:
        toggle.switch(os.getpid(), ack, False)
        toggle.switch(os.getpid(), ack, False)  # off already: no signal
        toggle.switch(os.getpid(), ack, True)
        signal.signal(toggle.OFF, lambda signum, frame: None)  # a daemon that never says
        with pytest.raises(TimeoutError):
            toggle.switch(os.getpid(), ack, False, timeout_s=0.05)
    finally:
        signal.signal(toggle.ON, old_on)
        signal.signal(toggle.OFF, old_off)
    assert got == ["off", "on"]


def test_paired_turns_on_one_toggled_daemon_switch_it_before_each_turn(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """With one daemon for on and off, each turn runs in the state it is counted as
    (on, off, off, on, ...), and the turns' counts go to their own side."""
    from types import SimpleNamespace

    from skymesh_lab.bench import access_log_cost as alc

    daemon: Any = SimpleNamespace(proc=SimpleNamespace(pid=4242), url="http://lb")
    state: list[bool] = []
    monkeypatch.setitem(alc._ACKS, 4242, tmp_path / "ack")
    monkeypatch.setattr(alc.toggle, "switch",
                        lambda pid, ack, on: state.append(on))

    def segment(d: Any, duration_s: float, case: Any = None) -> dict[str, Any]:
        on = state[-1]
        return {"requests": 1000.0, "wall_s": 0.1, "errors": 0.0,
                "ticks": {alc.LOOP: 0.012 if on else 0.010, alc.LOOP_SYS: 0.0}}

    monkeypatch.setattr(alc, "segment", segment)
    on, off = alc.pair(daemon, daemon, 4.0)
    assert state == [True, False, False, True] * (alc.SLICES // 2)
    assert on["cpu_us"] == pytest.approx(12.0) and off["cpu_us"] == pytest.approx(10.0)


def test_a_toggled_ablation_applies_its_variant_then_the_toggle(tmp_path: Any) -> None:
    from skymesh_lab.bench import access_log_cost as alc

    site = (alc._toggle_dir(tmp_path / "t", "record") / "sitecustomize.py").read_text()
    assert site.index("access_log_ablate") < site.index("access_log_toggle")


def test_the_page_says_when_on_and_off_ran_in_one_process() -> None:
    from skymesh_lab.bench.access_log_cost_page import _fresh

    assert "`--toggle`" in _fresh({"fresh_every": 1, "toggle": True})
    assert "`--toggle`" in _fresh({"fresh_every": 0, "toggle": True})
    assert "toggle" not in _fresh({"fresh_every": 1})


def test_the_step_split_times_every_step_and_ends_every_record_in_a_line() -> None:
    """access_log_steps: each step timed, and the records its finish step batched are
    the requests it began, each made into its line (the split measures the real path)."""
    import re

    from skymesh_lab.bench.access_log_steps import LINES, STEPS, measure

    got = measure(requests=150, repeats=1)
    assert set(got["best_us"]) == {*STEPS, LINES}
    # The prepare hook watches streams only: the lean server skips it for this reply.
    assert got["best_us"]["prepare hook"] == 0
    assert all(us > 0 for step, us in got["best_us"].items() if step != "prepare hook")
    assert got["request_part_us"] == pytest.approx(sum(got["best_us"][s] for s in STEPS),
                                                   abs=0.01)
    assert got["lines"] == 150
    assert re.fullmatch(
        r"\S+ \S+ INFO skymesh\.access: POST /v1/chat/completions 200 request_id=req-149 "
        r"model=stub served_by=http://127\.0\.0\.1:8001 via=replica ttft_ms=(\d+\.\d+) "
        r"duration_ms=\1 prompt_tokens=8 completion_tokens=1 client=127\.0\.0\.1",
        got["last_line"])


def test_a_pipes_drain_keeps_its_first_bytes_and_reads_the_rest_to_its_end(
        tmp_path: Any) -> None:
    """``--sink pipe``: the drain child keeps the start of what the daemon writes (its
    "listening on" line, read from the file) and reads everything after it, so the
    daemon's writes never fill the pipe; it ends when the writing end closes."""
    import subprocess
    import sys

    from skymesh_lab.bench.access_log_cost import _DRAIN

    log = tmp_path / "lb.log"
    drain = subprocess.Popen([sys.executable, "-c", _DRAIN, str(log)],
                             stdin=subprocess.PIPE)
    assert drain.stdin is not None
    head = b"skymesh-lb listening on http://127.0.0.1:42001 (1 worker)\n"
    drain.stdin.write(head + b"x" * 300_000)  # past the kept part and a pipe's buffer
    drain.stdin.close()
    assert drain.wait(30) == 0
    kept = log.read_bytes()
    assert kept.startswith(head) and 65_536 <= len(kept) < 300_000


def test_the_page_shows_the_pipe_run_apart_and_says_where_the_log_went() -> None:
    from skymesh_lab.bench.access_log_cost_page import LEAN, LEAN_PIPE, _lean

    spread = {"median": 5.0, "min": 4.0, "max": 6.0, "ci_low": 4.5, "ci_high": 5.5}
    share = {"median": 0.045, "min": 0.04, "max": 0.05, "ci_low": 0.042, "ci_high": 0.048}
    row = {key: spread for key in ("off_us", "on_us", "cost_us", "loop_cost_us",
                                   "writer_us")} | {"share": share}

    def run(sink: str | None) -> dict[str, Any]:
        setup = {"rounds": 30, "duration_s": 4, "fresh_every": 1, "toggle": True,
                 "loadavg_before": [1.0], "loadavg_after": [1.0], "command": "python -m x"}
        if sink is not None:
            setup["sink"] = sink
        return {"setup": setup, "summary": {"current": row}}

    file_page = _lean({LEAN: run(None)}, LEAN)
    pipe_page = _lean({LEAN_PIPE: run("pipe")}, LEAN_PIPE)
    assert "a file" in file_page and "pipe" not in file_page
    assert "(`--sink pipe`)" in pipe_page and "a pipe" in pipe_page
    assert f"--json docs/results/data/{LEAN_PIPE}.json" in pipe_page
    assert "**holds**" in pipe_page
    assert _lean({LEAN: run(None)}, LEAN_PIPE) == ""


def test_the_default_lane_runs_the_daemons_own_policy_on_shared_prefix_bodies() -> None:
    """--config default: no --policy or --push-mode for the daemon, router-overhead's
    shared-prefix bodies for wrk; rr keeps round-robin with bp on fixed bodies."""
    from skymesh_lab.bench import access_log_cost as alc

    default, rr = alc.LANES["default"], alc.LANES["rr"]
    assert "--policy" not in default.flags and "--push-mode" not in default.flags
    assert default.flags[-2:] == ("--workers", "1")
    assert (default.case.config, default.case.body, default.case.stream) == (
        "default", "prefix", False)
    assert rr.flags == tuple(alc.LB_FLAGS) and rr.case == alc.CASE
    policy = rr.flags[rr.flags.index("--policy") + 1]
    assert (policy, rr.flags[rr.flags.index("--push-mode") + 1]) == ("round-robin", "bp")


def test_the_page_shows_the_default_lane_as_a_section_of_its_own() -> None:
    from skymesh_lab.bench.access_log_cost_page import LEAN, LEAN_DEFAULT, _lean

    spread = {"median": 5.0, "min": 4.0, "max": 6.0, "ci_low": 4.5, "ci_high": 5.5}
    share = {"median": 0.05, "min": 0.04, "max": 0.07, "ci_low": 0.045, "ci_high": 0.06}
    row = {key: spread for key in ("off_us", "on_us", "cost_us", "loop_cost_us",
                                   "writer_us")} | {"share": share}
    setup = {"rounds": 24, "duration_s": 4, "fresh_every": 1, "toggle": True,
             "loadavg_before": [1.0], "loadavg_after": [1.0], "config": "default",
             "lb_flags": ["--workers", "1"], "connections": 32, "ablate": ["floor"],
             "command": "python -m x --config default"}
    page = _lean({LEAN_DEFAULT: {"setup": setup, "summary": {
        "current": row, "floor": row,
        "ablation_steps_us": {"current-floor": spread}}}}, LEAN_DEFAULT)
    assert page.startswith("### The default configuration")
    assert "`skymesh-lb --workers 1`" in page and "shared-prefix" in page
    assert f"--json docs/results/data/{LEAN_DEFAULT}.json" in page
    assert "| `floor`: " in page and "the full log above the floor" in page
    assert "**not shown** either way" in page  # the interval straddles 5%
    assert "The floor (`floor`, the least a log made in Python does) costs **5.0%**" in page
    rr = _lean({LEAN: {"setup": {**setup, "config": "rr"}, "summary": {"current": row}}})
    assert "default configuration" not in rr


def test_the_floors_parts_are_each_set_against_the_whole_floor() -> None:
    """``--ablate floor,floor-nonotes,floor-nolines``: each part's step is the floor's
    cost minus that variant's in the same round, not a difference of two parts."""
    from skymesh_lab.bench.access_log_cost import summarize

    costs = {"current": 9.0, "floor": 5.0, "floor-nonotes": 4.0, "floor-nolines": 2.0}
    segments = [{"setup": f"{build}/{state}", "round": rnd,
                 "cpu_us": 100.0 + (cost + rnd if state == "on" else 0.0),
                 "threads_us": {"loop": 90.0, "writer": 0.5, "threads": 0.4, "loop_sys": 20.0}}
                for rnd in range(6) for build, cost in costs.items()
                for state in ("on", "off")]
    steps = summarize(segments)["ablation_steps_us"]
    assert steps["floor-floor-nonotes"]["median"] == 1.0
    assert steps["floor-floor-nolines"]["median"] == 3.0
    assert steps["current-floor"]["median"] == 4.0
    assert "floor-nonotes-floor-nolines" not in steps


def test_the_floors_run_is_a_section_of_its_own_with_its_parts() -> None:
    from skymesh_lab.bench.access_log_cost_page import ABLATION, FLOOR, _ablation

    spread = {"median": 1.0, "min": 0.5, "max": 2.0, "ci_low": 0.8, "ci_high": 1.2}
    share = {"median": 0.05, "min": 0.04, "max": 0.07, "ci_low": 0.045, "ci_high": 0.06}
    row = {key: spread for key in ("off_us", "on_us", "cost_us", "loop_cost_us",
                                   "writer_us")} | {"share": share}
    setup = {"rounds": 16, "duration_s": 4, "loadavg_before": [1.0],
             "loadavg_after": [1.0], "current": "abc1234",
             "command": "python -m skymesh_lab.bench.access_log_cost --ablate floor"}
    doc = {FLOOR: {"setup": setup, "summary": {
        "current": row, "floor": row, "floor-nonotes": row, "floor-nolines": row,
        "ablation_steps_us": {"floor-floor-nonotes": spread,
                              "floor-floor-nolines": spread}}}}
    page = _ablation(doc, FLOOR, "The floor and its parts")
    assert page.startswith("### The floor and its parts")
    assert "| `floor-nonotes`: the floor with the balancer's notes" in page
    assert "the floor's three notes 1.0 [0.8, 1.2] us" in page
    assert f"--json docs/results/data/{FLOOR}.json" in page
    assert _ablation(doc) == ""  # the older ablation's section stays its own
    assert ABLATION != FLOOR
