"""skymesh-lb with several workers on one port (skymesh.balancer.workers), real processes on
loopback: the kernel spreads connections over them, one /metrics and /status shows them
all, a killed worker is replaced, SIGTERM drains every worker, and one worker is the single
process of before."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import read_sse, until

from skymesh.util.procs import Daemon, start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BODY = {"model": MODEL, "max_tokens": 2, "prompt": "hello"}


def per_worker(text: str, sample: str) -> dict[str, float]:
    """``sample``'s value summed over its other labels, by worker."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == sample:
                w = s.labels.get("worker", "")
                out[w] = out.get(w, 0.0) + s.value
    return out


async def fresh_request(url: str, path: str = "/v1/completions",
                        body: dict[str, Any] | None = None) -> int:
    """One request on a connection of its own (a new source port: the kernel's hash)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, \
            s.post(url + path, json=body or BODY) as r:
        await r.read()
        return r.status


async def status(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
            s.get(url + "/status") as r:
        out: dict[str, Any] = await r.json()
        return out


async def metrics(url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
            s.get(url + "/metrics") as r:
        return await r.text()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def replica(tmp_path: Path) -> Any:
    rep = start_daemon("skymesh-replica", ["--port", "0"], log_path=tmp_path / "r.log")
    yield rep
    rep.stop()


def start_lb(tmp_path: Path, rep: Daemon, *extra: str) -> Daemon:
    return start_daemon("skymesh-lb", ["--port", "0", "--replicas", rep.url, *extra],
                        log_path=tmp_path / "lb.log")


async def test_two_workers_share_the_port_restart_and_drain(tmp_path: Path,
                                                            replica: Daemon) -> None:
    lb = start_lb(tmp_path, replica, "--workers", "2")
    try:
        assert "2 workers" in lb.log_path.read_text()
        workers = (await status(lb.url))["workers"]
        assert [w["index"] for w in workers] == [0, 1] and all(w["up"] for w in workers)
        pids = [w["pid"] for w in workers]
        assert lb.proc.pid not in pids and len(set(pids)) == 2
        assert all(set(w["share"]) == {"inserts_sent", "datagrams_sent", "inserts_applied"}
                   for w in workers)

        # Both workers take connections: one /metrics counts each one's requests.
        async def both_served() -> bool:
            assert await fresh_request(lb.url) == 200
            served = per_worker(await metrics(lb.url), "skymesh_requests_total")
            return served.get("0", 0) > 0 and served.get("1", 0) > 0
        await until(both_served, "requests served by both workers", timeout=60)
        up = per_worker(await metrics(lb.url), "skymesh_worker_up")
        assert up == {"0": 1.0, "1": 1.0}

        # A killed worker is replaced; the other serves meanwhile.
        os.kill(pids[1], signal.SIGKILL)

        async def replaced() -> bool:
            ws = (await status(lb.url))["workers"]
            return ws[1]["up"] and ws[1].get("pid") not in (None, pids[1])
        await until(replaced, "worker 1 restarted", timeout=60)
        assert alive(pids[0])
        new_pids = [w["pid"] for w in (await status(lb.url))["workers"]]

        # SIGTERM drains both: streams open on each end with the shutting-down event.
        body = {"model": MODEL, "stream": True, "max_tokens": 4000, "ignore_eos": True,
                "prompt": "tell a long story"}
        sessions: list[aiohttp.ClientSession] = []
        tasks: list[asyncio.Task[list[Any]]] = []

        async def stream(s: aiohttp.ClientSession) -> list[Any]:
            async with s.post(lb.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                return await read_sse(r)

        async def streaming_on_both() -> bool:
            s = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
            sessions.append(s)
            tasks.append(asyncio.create_task(stream(s)))
            ws = (await status(lb.url))["workers"]
            return all(w["in_flight"] > 0 for w in ws)
        try:
            await until(streaming_on_both, "a stream open on each worker", timeout=60,
                        interval=0.1)
            lb.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            code = await asyncio.to_thread(lb.proc.wait, 60)
        finally:
            for s in sessions:
                await s.close()
        assert code == 0
        for events in results:
            assert events[-1] == "[DONE]", events[-3:]
            assert events[-2]["error"]["code"] == "shutting_down", events[-3:]
        assert not any(alive(p) for p in new_pids)
    finally:
        lb.stop()


async def test_workers_drain_when_the_supervisor_is_killed(tmp_path: Path,
                                                           replica: Daemon) -> None:
    lb = start_lb(tmp_path, replica, "--workers", "2")
    try:
        pids = [w["pid"] for w in (await status(lb.url))["workers"]]
        cmdline = Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
        workdir = cmdline[cmdline.index(b"--worker-dir") + 1].decode()
        lb.proc.kill()
        lb.proc.wait()

        async def gone() -> bool:
            return not any(alive(p) for p in pids)
        await until(gone, "the workers stop without their supervisor", timeout=30)
        assert not Path(workdir).exists()  # the last one out removed the shared directory
    finally:
        lb.stop()
        for p in pids:  # a failed test leaves nothing behind
            if alive(p):
                os.kill(p, signal.SIGKILL)


async def test_workers_run_the_supervisors_code_whatever_the_directory(
        tmp_path: Path, replica: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``skymesh`` package in the working directory (another version's checkout) is not
    what the workers import: they run the code the supervisor runs."""
    shadow = tmp_path / "elsewhere" / "skymesh"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the shadow package')\n")
    monkeypatch.chdir(shadow.parent)
    lb = start_lb(tmp_path, replica, "--workers", "2")
    try:
        assert await fresh_request(lb.url) == 200
        assert [w["up"] for w in (await status(lb.url))["workers"]] == [True, True]
        assert "shadow package" not in lb.log_path.read_text()
    finally:
        assert lb.stop() == 0


async def test_one_worker_is_the_single_process_of_before(tmp_path: Path,
                                                          replica: Daemon) -> None:
    lb = start_lb(tmp_path, replica, "--workers", "1")
    try:
        assert await fresh_request(lb.url) == 200
        st = await status(lb.url)
        assert st["workers"] is None and st["balancers_per_region"] == 1
        text = await metrics(lb.url)
        assert per_worker(text, "skymesh_requests_total") == {"": 1.0}  # no worker label
        assert "skymesh_worker_up" not in text
        children = Path(f"/proc/{lb.proc.pid}/task/{lb.proc.pid}/children")
        if children.exists():
            assert children.read_text().split() == []
        assert "workers)" not in lb.log_path.read_text()
    finally:
        assert lb.stop() == 0
