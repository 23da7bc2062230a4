"""The pure parts of the second-worker split bench (skymesh_lab.bench.dispatch_cost_live_split):
perf stat's per-thread counts, system calls and CPU per request per process, and which
processes of a balancer are its supervisor and workers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
from support import wait_for

from skymesh_lab.bench import dispatch_cost_live_split as sp

PERF_STAT = """\
python3-101,5000,,raw_syscalls:sys_enter,4000123,100.00,,
python3-101,2000,,syscalls:sys_enter_write,4000123,100.00,,
skymesh-access-102,30,,raw_syscalls:sys_enter,4000123,100.00,,
skymesh-access-102,20,,syscalls:sys_enter_futex,4000123,100.00,,
python3-201,<not counted>,,syscalls:sys_enter_futex,0,100.00,,
python3-202,7,,syscalls:sys_enter_epoll_pwait,4000123,100.00,,

 Performance counter stats for process id '101,201':
"""


def test_parse_perf_stat_counts_by_thread_and_kind() -> None:
    got = sp.parse_perf_stat(PERF_STAT)
    assert got == {101: {"all": 5000, "write": 2000}, 102: {"all": 30, "futex": 20},
                   202: {"epoll_pwait": 7}}  # "<not counted>" and prose lines skipped


def test_per_process_sums_threads_per_request_most_first() -> None:
    by_tid = sp.parse_perf_stat(PERF_STAT)
    got = sp.per_process(by_tid, {"w0": {101, 102}, "w1": {201, 202}, "gone": {999}}, 1000)
    assert got["w0"] == {"all": 5.03, "write": 2.0, "futex": 0.02}
    assert list(got["w0"]) == ["all", "write", "futex"]
    assert got["w1"] == {"epoll_pwait": 0.007}
    assert got["gone"] == {}


def test_per_request_splits_user_system_and_switches() -> None:
    before = {"w0": sp.ProcCounters(1.0, 0.5, 10, 20), "dead": None,
              "late": sp.ProcCounters(0, 0, 0, 0)}
    after = {"w0": sp.ProcCounters(1.2, 0.55, 30, 220), "dead": sp.ProcCounters(9, 9, 9, 9),
             "late": None}
    got = sp.per_request(before, after, 1000)
    assert set(got) == {"w0"}  # a process missing at either end is left out
    assert got["w0"] == pytest.approx({"user_us": 200.0, "sys_us": 50.0, "vcsw": 0.02,
                                       "ivcsw": 0.2})


def test_machine_busy_share() -> None:
    # user nice system idle iowait irq softirq
    a = [100, 0, 50, 1000, 10, 0, 0]
    b = [160, 0, 70, 1015, 15, 0, 10]
    assert sp._machine_busy(a, b) == pytest.approx(90 / 110)
    assert sp._machine_busy(a, a) == 0.0


def test_read_counters_of_this_process() -> None:
    c = sp.read_counters(os.getpid())
    assert c is not None and c.utime > 0 and c.vcsw >= 0 and c.ivcsw >= 0
    assert sp.read_counters(2**22 + 12345) is None  # above pid_max: no such process


def test_balancer_pids_single_process_and_supervisor() -> None:
    sleeper = "import time; time.sleep(60)"
    alone = subprocess.Popen([sys.executable, "-c", sleeper])
    code = ("import subprocess, sys, time\n"
            f"kids = [subprocess.Popen([sys.executable, '-c', {sleeper!r}]) for _ in range(2)]\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code])
    got: dict[str, int] = {}
    try:
        assert sp.balancer_pids(alone.pid) == {"w0": alone.pid}
        def both_children() -> dict[str, int] | None:
            pids = sp.balancer_pids(parent.pid)
            return pids if len(pids) == 3 else None

        got = wait_for(both_children, "the parent's two children")
        assert got["supervisor"] == parent.pid
        assert got["w0"] < got["w1"] and parent.pid not in (got["w0"], got["w1"])
    finally:
        for pid in (got.get("w0"), got.get("w1")):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for p in (alone, parent):
            p.kill()
            p.wait()


def _seg(us: float) -> dict[str, float]:
    return {"balancer_us": us}


def test_paired_ratios_round_by_round_against_the_one_worker_arm() -> None:
    rows = {"now default w1": [_seg(100), _seg(200)], "now default w2": [_seg(110), _seg(180)],
            "now default pair": [_seg(150)], "floor w1": [_seg(40)], "floor w2": [_seg(44)],
            "now rr w2": [_seg(1)]}  # no rr w1 arm: nothing to pair with
    got = sp.paired_ratios(rows)
    assert got == {"now default w2 / w1": [1.1, 0.9], "now default pair / w1": [1.5],
                   "floor w2 / w1": [pytest.approx(1.1)]}


def test_median_calls_over_segments() -> None:
    traced = [{"w0": {"read": 2.0, "getpid": 1.0}}, {"w0": {"read": 4.0}},
              {"w0": {"read": 3.0, "getpid": 3.0}}]
    got = sp.median_calls(traced, "w0")
    assert got == {"read": 3.0, "getpid": 1.0}  # a kind a segment lacks counts as 0 there
    assert list(got) == ["read", "getpid"]


def test_watch_placement_ends_with_the_load_and_leaves_it_unreaped() -> None:
    spin = "while True: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    load = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        workers = {"w0": busy[0].pid, "w1": busy[1].pid}
        shared, both = sp.watch_placement(workers, [load], every_s=0.01)
        assert both > 0 and 0 <= shared <= both  # two spinning processes: runnable
        # Not reaped: its exit status and CPU are still wait4's to read.
        assert load.returncode is None
        _, status, _ = os.wait4(load.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        load.returncode = 0
        assert sp.watch_placement({"w0": busy[0].pid}, [load]) == (0, 0)  # one worker
    finally:
        for p in busy:
            p.kill()
            p.wait()
