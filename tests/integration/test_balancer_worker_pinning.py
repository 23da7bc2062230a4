"""``listen.pin_workers``: each worker of a multi-worker skymesh-lb on a core of its own
(skymesh.balancer.workers.worker_cpus), real processes on loopback: every thread of a
worker keeps its core, a restarted worker gets the same one, and unpinned workers keep the
cores the supervisor may use."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support import until

from skymesh.util.procs import Daemon, start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CORES = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="pinning 2 workers needs 2 cores")


@pytest.fixture
def replica(tmp_path: Path) -> Any:
    rep = start_daemon("skymesh-replica", ["--port", "0"], log_path=tmp_path / "r.log")
    yield rep
    rep.stop()


def start_lb(tmp_path: Path, rep: Daemon, pin: str) -> Daemon:
    cfg = tmp_path / "lb.yaml"
    cfg.write_text(f"listen:\n  pin_workers: {pin}\n")
    return start_daemon("skymesh-lb", ["--port", "0", "--replicas", rep.url, "--workers", "2",
                                       "--config", str(cfg)], log_path=tmp_path / "lb.log")


async def worker_pids(url: str) -> list[int | None]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for _ in range(4):  # a request on each of a few connections: the threads start
            async with s.post(url + "/v1/completions",
                              json={"model": MODEL, "max_tokens": 2, "prompt": "hi"}) as r:
                assert r.status == 200
        async with s.get(url + "/status") as r:
            return [w.get("pid") for w in (await r.json())["workers"]]


def allowed(path: Path) -> set[int]:
    """``Cpus_allowed_list`` of a /proc status file (``0-3,6``) as a set."""
    text = path.read_text().split("Cpus_allowed_list:", 1)[1].split("\n", 1)[0]
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def thread_cores(pid: int) -> list[set[int]]:
    """The cores each thread of ``pid`` may run on."""
    return [allowed(t / "status") for t in Path(f"/proc/{pid}/task").iterdir()]


async def test_pinned_workers_each_keep_a_core_of_their_own(tmp_path: Path,
                                                            replica: Daemon) -> None:
    lb = start_lb(tmp_path, replica, "true")
    try:
        pids = await worker_pids(lb.url)
        assert None not in pids and len(set(pids)) == 2
        for i, pid in enumerate(pids):
            assert pid is not None
            threads = thread_cores(pid)
            assert len(threads) > 1  # the loop's helpers too, not the main thread alone
            assert all(cores == {CORES[i]} for cores in threads), (i, threads)
        assert allowed(Path(f"/proc/{lb.proc.pid}/status")) == set(CORES)  # not itself
        assert f"workers pinned to cores {CORES[0]}, {CORES[1]}" in lb.log_path.read_text()

        # A killed worker's replacement takes the same core.
        assert pids[1] is not None
        os.kill(pids[1], signal.SIGKILL)

        async def replaced() -> bool:
            now = await worker_pids(lb.url)
            return now[1] not in (None, pids[1])
        await until(replaced, "worker 1 restarted", timeout=60)
        new = (await worker_pids(lb.url))[1]
        assert new is not None and all(c == {CORES[1]} for c in thread_cores(new))
    finally:
        assert lb.stop() == 0


async def test_unpinned_workers_keep_the_supervisors_cores(tmp_path: Path,
                                                           replica: Daemon) -> None:
    lb = start_lb(tmp_path, replica, "false")
    try:
        for pid in await worker_pids(lb.url):
            assert pid is not None
            assert all(cores == set(CORES) for cores in thread_cores(pid))
        assert "workers pinned to cores" not in lb.log_path.read_text()
    finally:
        assert lb.stop() == 0
