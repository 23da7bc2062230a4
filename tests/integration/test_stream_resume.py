"""``retry.resume_streams``: a replica killed mid-stream, the client's stream continues on
the other one. Real replica and balancer processes; the replica dies by SIGKILL.

Both replicas run the same profile with the same ``--seed``, so a request with a given
``seed`` produces the same tokens on either: the test can say exactly what the client must
receive (the dead replica's first k tokens, then the survivor's continuation of prompt +
those k tokens).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import get_metrics, read_sse, until

from skymesh.util.procs import Daemon, start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
N = 200  # about 2.2 s on the L4 profile at time scale 0.2: time to kill it mid-stream


def replica(tmp: Path, name: str) -> Daemon:
    return start_daemon("skymesh-replica", ["--port", "0", "--profile", "llama3.1-8b-l4",
                                            "--time-scale", "0.2", "--seed", "7"],
                        log_path=tmp / f"{name}.log")


def balancer(tmp: Path, replicas: list[Daemon], resume: bool) -> Daemon:
    cfg: dict[str, Any] = {
        # One process: the tests read exact per-replica counters from /metrics.
        "region": "test", "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
        "policy": {"name": "round-robin"}, "probe": {"interval_s": 0.05},
        "retry": {"resume_streams": resume},
        "replicas": [{"url": r.url} for r in replicas],
    }
    path = tmp / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(path)], log_path=tmp / "lb.log")


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def status(s: aiohttp.ClientSession, lb: Daemon) -> dict[str, Any]:
    async with s.get(lb.url + "/status") as r:
        out: dict[str, Any] = await r.json()
        return out


async def texts_of(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[str]:
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        events = await read_sse(r)
    return [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")]


async def stream_and_kill(s: aiohttp.ClientSession, lb: Daemon, replicas: list[Daemon],
                          body: dict[str, Any], after: int) -> tuple[list[Any], Daemon]:
    """Stream ``body`` through ``lb``; after ``after`` token events, SIGKILL the replica
    serving it. Returns every event the client got and the killed replica."""
    events: list[Any] = []
    victim: Daemon | None = None
    async with s.post(lb.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            if victim is None and len(events) == after:
                st = await status(s, lb)
                [url] = [u for u, v in st["replicas"].items() if v["in_flight"] == 1]
                victim = next(d for d in replicas if d.url == url)
                victim.proc.kill()
    assert victim is not None
    return events, victim


@pytest.mark.parametrize("resume", [True, False])
async def test_a_replica_killed_mid_stream(tmp_path: Path, session: aiohttp.ClientSession,
                                           resume: bool) -> None:
    reps = [replica(tmp_path, "a"), replica(tmp_path, "b")]
    lb = balancer(tmp_path, reps, resume)
    try:
        async def ready() -> bool:
            try:
                async with session.get(lb.url + "/ready") as r:
                    return r.status == 200 and (await r.json())["healthy_replicas"] == 2
            except aiohttp.ClientError:
                return False
        await until(ready, "both replicas healthy")
        prompt = "The river in spring is"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": N, "ignore_eos": True,
                "seed": 11, "stream": True, "stream_options": {"include_usage": True}}
        events, dead = await stream_and_kill(session, lb, reps, body, after=20)
        survivor = next(d for d in reps if d is not dead)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        got = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")]
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        m = await get_metrics(session, lb.url)
        st = await status(session, lb)
        direct = await texts_of(session, survivor.url, {**body, "stream": True})
        if not resume:  # the documented default: an error event and a clean end
            assert len(errors) == 1 and len(got) < N and got == direct[:len(got)]
            assert st["migrations"]["resumed"] == 0
            return

        assert not errors and len(got) == N
        assert st["migrations"]["resumed"] == 1
        [resumed] = st["migrations"]["recent_resumes"]
        assert resumed["source"] == dead.url
        k = resumed["tokens_streamed"]
        assert 20 <= k < N
        # Exactly the dead replica's first k tokens, then the survivor's continuation of
        # prompt + those k tokens: nothing lost, repeated or reordered.
        assert got[:k] == direct[:k]
        async with session.post(survivor.url + "/tokenize",
                                json={"model": MODEL, "prompt": prompt}) as r:
            prompt_ids = (await r.json())["tokens"]
        async with session.post(survivor.url + "/tokenize",
                                json={"model": MODEL, "prompt": "".join(got[:k])}) as r:
            gen_ids = (await r.json())["tokens"]
        rest = await texts_of(session, survivor.url, {
            "model": MODEL, "prompt": prompt_ids + gen_ids, "max_tokens": N - k,
            "ignore_eos": True, "seed": 11, "stream": True})
        assert got[k:] == rest
        usage = [e for e in events if isinstance(e, dict) and e.get("usage")][-1]["usage"]
        assert usage["completion_tokens"] == N and usage["prompt_tokens"] == len(prompt_ids)
        assert m[f'skymesh_retries_total{{target="{dead.url}"}}'] == 1
        assert m[f'skymesh_requests_total{{model="{MODEL}",outcome="ok"}}'] == 1

        async def drained() -> bool:
            s2 = await status(session, lb)
            return s2["queued"] == 0 and all(v["in_flight"] == 0
                                             for v in s2["replicas"].values())
        await until(drained, "in-flight counts back to zero")
    finally:
        lb.stop()
        for d in reps:
            d.stop()
