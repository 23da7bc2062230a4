"""A replica frozen mid-stream (SIGSTOP): its connections stay open and silent. Once the
balancer's probes mark it down, the streams on it must end with an SSE error event (or,
with ``retry.resume_streams``, continue on the other replica), not wait out
``upstream.read_timeout_s`` (600 s). Real replica and balancer processes; when the
replica is marked down is read from the balancer's own /status.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import get_metrics, until

from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.timeout(120)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
N = 300  # tokens, about 3.3 s on this profile: a frozen stream would hold them for 600 s
# After the replica is marked down, the stream must end within this (the balancer's own
# bound is upstream.stalled_stream_s plus a probe round; the read timeout is 600 s).
DEADLINE_S = 20.0


def replica(tmp: Path, name: str) -> Daemon:
    return start_daemon("skymesh-replica", ["--port", "0", "--profile", "llama3.1-8b-l4",
                                            "--time-scale", "0.2", "--seed", "7"],
                        log_path=tmp / f"{name}.log")


def balancer(tmp: Path, replicas: list[Daemon], resume: bool) -> Daemon:
    cfg: dict[str, Any] = {
        # One process: the test reads one balancer's replica state and exact counters.
        "region": "test", "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
        "policy": {"name": "round-robin"},
        "probe": {"interval_s": 0.05, "timeout_s": 0.5},
        "retry": {"resume_streams": resume},
        "replicas": [{"url": r.url} for r in replicas],
    }
    path = tmp / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(path)], log_path=tmp / "lb.log")


async def status(s: aiohttp.ClientSession, lb: Daemon) -> dict[str, Any]:
    async with s.get(lb.url + "/status") as r:
        out: dict[str, Any] = await r.json()
        return out


@pytest.mark.parametrize("resume", [False, True])
async def test_streams_on_a_frozen_replica_end_once_it_is_marked_down(
        tmp_path: Path, resume: bool) -> None:
    reps = [replica(tmp_path, "a"), replica(tmp_path, "b")]
    lb = balancer(tmp_path, reps, resume)
    frozen: Daemon | None = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
            async def ready() -> bool:
                try:
                    async with s.get(lb.url + "/ready") as r:
                        return r.status == 200 and (await r.json())["healthy_replicas"] == 2
                except aiohttp.ClientError:
                    return False
            await until(ready, "both replicas healthy")

            events: list[Any] = []
            started = asyncio.Event()
            body = {"model": MODEL, "prompt": "The river in spring is", "max_tokens": N,
                    "ignore_eos": True, "seed": 11, "stream": True}

            async def consume() -> None:
                async with s.post(lb.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:].strip()
                        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
                        if len(events) == 10:
                            started.set()

            stream = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), 30)
            st = await status(s, lb)
            [url] = [u for u, v in st["replicas"].items() if v["in_flight"] == 1]
            frozen = next(d for d in reps if d.url == url)
            os.kill(frozen.proc.pid, signal.SIGSTOP)

            async def marked_down() -> bool:
                return not (await status(s, lb))["replicas"][url]["healthy"]
            await until(marked_down, "the frozen replica marked down", timeout=30)
            down_at = time.monotonic()
            # Bounded by the deadline, not by the 600 s read timeout.
            await asyncio.wait_for(stream, DEADLINE_S)
            print(f"resume={resume}: the stream ended {time.monotonic() - down_at:.1f} s "
                  "after the replica was seen marked down")

            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            tokens = [e for e in events if isinstance(e, dict) and e.get("choices")]
            if resume:
                assert not errors and len(tokens) == N
                st = await status(s, lb)
                assert st["migrations"]["resumed"] == 1
                assert st["migrations"]["recent_resumes"][0]["source"] == url
            else:
                [err] = errors
                assert "marked down" in err["error"]["message"]
                assert len(tokens) < N
            m = await get_metrics(s, lb.url)
            assert m[f'skymesh_replica_limit_hits_total{{limit="stalled_stream",'
                     f'replica="{url}"}}'] == 1
    finally:
        if frozen is not None:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        lb.stop()
        for d in reps:
            d.stop()
