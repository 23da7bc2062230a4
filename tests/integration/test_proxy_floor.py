"""The router-overhead benchmark's floor proxies (``skymesh_lab.bench.proxy_floor``): each
kind serves one port from its worker processes, passes requests and replies through to
the stubs in turn, and leaves no worker behind when stopped (no benchmark run here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import wait_for

from skymesh.util.procs import Daemon
from skymesh_lab.bench import router_overhead as ro
from skymesh_lab.bench import router_overhead_stats as st

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="gcc is needed to build the stub backend")
EVENTS = 3


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Daemon]]:
    tmp = tmp_path_factory.mktemp("floor")
    binary = ro.build_stub(tmp)
    ds = [ro.start_stub(binary, EVENTS, tmp, i) for i in range(2)]
    try:
        yield ds
    finally:
        for d in ds:
            d.stop()


def _lookups(stubs: list[Daemon]) -> list[float]:
    out = []
    for d in stubs:
        status, text = ro.http_request(d.url, "GET", "/metrics")
        assert status == 200
        out.append(st.prefix_samples(text.decode())["stub_prefix_lookups_total"])
    return out


@pytest.mark.parametrize("name", list(ro.FLOORS))
def test_floor_proxies_to_the_stubs_in_turn_and_stops_its_workers(
        name: str, stubs: list[Daemon], tmp_path: Path) -> None:
    d, flags = ro.start_floor(name, 2, "rr", [s.url for s in stubs], tmp_path)
    try:
        assert flags == ["--kind", ro.FLOORS[name], "--workers", "2"]
        workers = [p.pid for p in st.tree(ro.proc_snapshot(), d.proc.pid)][1:]
        assert len(workers) == 2
        ro.wait_ready(d)
        before = _lookups(stubs)
        body = b'{"model":"stub","messages":[{"role":"system","content":"x"}]}'
        for _ in range(4):  # one connection each: whichever worker, it alternates stubs
            status, reply = ro.http_request(d.url, "POST", "/v1/chat/completions", body)
            assert status == 200 and b'"chat.completion"' in reply
        status, reply = ro.http_request(d.url, "POST", "/v1/chat/completions",
                                        b'{"model":"stub","stream":true}')
        assert status == 200 and reply.count(b"data: ") == EVENTS + 1
        added = [b - a for a, b in zip(before, _lookups(stubs), strict=True)]
        # The stream asked with no message text: 4 lookups. Each worker alternates stubs
        # and one of the 2 workers took at least 2 of the 4: both stubs served.
        assert sum(added) == 4 and min(added) >= 1
    finally:
        d.stop()
    wait_for(lambda: not set(workers) & {p.pid for p in ro.proc_snapshot()},
             "the floor's workers to exit with it", timeout=10.0)


def _start_on_two_cores(stubs: list[Daemon], tmp_path: Path, *flags: str) -> Daemon:
    """The asyncio floor with 2 workers, started on exactly 2 cores: where skymesh-lb's
    ``listen.pin_workers: auto`` pins (one usable core per worker)."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    log_path = tmp_path / "floor.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "skymesh_lab.bench.proxy_floor", "--kind", "asyncio",
             "--workers", "2", "--upstreams", ",".join(s.url for s in stubs), *flags],
            stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.sched_setaffinity(0, cores))
    d = Daemon("floor", proc, "", log_path)
    try:
        d.url = wait_for(lambda: "listening on " in d.log() and
                         d.log().split("listening on ", 1)[1].split()[0],
                         "the floor to listen", timeout=30.0)
        ro.wait_ready(d)
    except BaseException:
        d.stop()
        raise
    return d


def _thread_cores(pid: int) -> list[set[int]]:
    """The cores each thread of ``pid`` may run on."""
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning 2 workers needs 2 cores")
def test_floor_workers_take_distinct_cores_where_skymesh_lb_would_pin(
        stubs: list[Daemon], tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    d = _start_on_two_cores(stubs, tmp_path)
    try:
        workers = [p.pid for p in st.tree(ro.proc_snapshot(), d.proc.pid)][1:]
        assert len(workers) == 2
        # Every thread of a worker on that worker's one core, and the two cores differ.
        per_worker = [set().union(*_thread_cores(pid)) for pid in workers]
        assert sorted(per_worker, key=min) == [{cores[0]}, {cores[1]}], per_worker
        assert os.sched_getaffinity(d.proc.pid) == set(cores)  # not the parent itself
        assert f"pinned to cores {cores[0]}, {cores[1]}: listening on" in d.log()
    finally:
        d.stop()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning 2 workers needs 2 cores")
def test_floor_workers_left_to_the_kernel_with_pinning_off(
        stubs: list[Daemon], tmp_path: Path) -> None:
    cores = set(sorted(os.sched_getaffinity(0))[:2])
    d = _start_on_two_cores(stubs, tmp_path, "--pin-workers", "false")
    try:
        assert "2 workers unpinned: listening on" in d.log()
        workers = [p.pid for p in st.tree(ro.proc_snapshot(), d.proc.pid)][1:]
        assert len(workers) == 2
        assert all(c == cores for pid in workers for c in _thread_cores(pid))
    finally:
        d.stop()
