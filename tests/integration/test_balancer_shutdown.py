"""A balancer stopped with SIGTERM tells every open stream it is ending, never cuts it."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
from support import read_sse, until

from skymesh.util.procs import start_daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


async def test_sigterm_ends_long_streams_with_an_error_event(tmp_path: Path) -> None:
    rep = start_daemon("skymesh-replica", ["--port", "0"], log_path=tmp_path / "r.log")
    lb = start_daemon("skymesh-lb", ["--port", "0", "--replicas", rep.url],
                      log_path=tmp_path / "lb.log")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def ready() -> bool:
                async with s.get(lb.url + "/ready") as r:
                    return r.status == 200
            await until(ready, "the balancer is ready")
            body = {"model": MODEL, "stream": True, "max_tokens": 2000, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "tell a long story"}]}
            started = asyncio.Event()

            async def stream() -> list[Any]:
                async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    started.set()
                    return await read_sse(r)

            tasks = [asyncio.create_task(stream()) for _ in range(3)]
            await asyncio.wait_for(started.wait(), 30)
            lb.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            code = await asyncio.to_thread(lb.proc.wait, 30)
    finally:
        lb.stop()
        rep.stop()
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        err = events[-2]
        assert isinstance(err, dict) and err["error"]["code"] == "shutting_down", events[-3:]
        assert any("choices" in e for e in events if isinstance(e, dict))
    assert code == 0
