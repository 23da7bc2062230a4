"""A tenant over its request rate, through the real OpenAI SDK (issue #37).

A ``skymesh-lb`` with one tenant limited to 1 request/s (its burst: one request) in front
of an emulated replica. The tenant's first request is served; its second, sent at once,
gets 429 ``rate_limit_exceeded`` with ``Retry-After`` and ``retry-after-ms``; a third,
from a client with ``max_retries=1``, is refused too and then served on the SDK's one
retry. That success needs the retry to wait what the balancer said: without the header
the SDK's first back-off is 0.5 s at most, when the bucket is still short of a request.
The balancer's own access log shows the gap: the retry reached it no sooner than the
``retry-after-ms`` it had sent after the refusal (timestamps of its lines, not the
test's clock).
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from support import get_metrics, http_call, wait_for

from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.timeout(60)

KEY = "sk-capped-sdk"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LOG_MS = 0.002  # the access log's timestamps are whole milliseconds (truncated): two


def start(tmp: Path, replica: Daemon) -> Daemon:
    cfg: dict[str, Any] = {
        "region": "us", "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
        "probe": {"interval_s": 0.05}, "logging": {"format": "json"},
        "replicas": [{"url": replica.url}],
        "tenants": {"members": [{"name": "capped", "keys_sha256": [
            hashlib.sha256(KEY.encode()).hexdigest()], "requests_per_s": 1.0}]}}
    (tmp / "lb.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "SKYMESH_API_KEYS": KEY}
    return start_daemon("skymesh-lb", ["--config", str(tmp / "lb.yaml")],
                        log_path=tmp / "lb.log", env=env)


def access_lines(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("logger") == "skymesh.access" and rec.get("tenant") == "capped":
                out.append(rec)
    return out


def wall(rec: dict[str, Any]) -> float:
    return datetime.fromisoformat(rec["ts"]).timestamp()


async def test_the_sdk_waits_retry_after_and_is_then_served(tmp_path: Path) -> None:
    replica = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.05"],
                           log_path=tmp_path / "replica.log")
    lb = start(tmp_path, replica)
    seen: list[Any] = []  # every attempt the SDK made, retries included
    try:
        wait_for(lambda: http_call(lb.url + "/ready")[0] == 200, "the balancer sees its replica")

        async def record(r: Any) -> None:  # an httpx2.Response, the SDK's own
            seen.append(r)

        http = openai.DefaultAsyncHttpx2Client(event_hooks={"response": [record]})

        def client(retries: int) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=lb.url + "/v1", api_key=KEY,
                                      max_retries=retries, http_client=http)

        body: dict[str, Any] = {"model": MODEL, "max_tokens": 2,
                                "messages": [{"role": "user", "content": "hi"}]}
        await client(0).chat.completions.create(**body)  # the burst: one request
        with pytest.raises(openai.RateLimitError) as refused:
            await client(0).chat.completions.create(**body)
        served = await client(1).chat.completions.create(**body)
        await http.aclose()
        async with aiohttp.ClientSession() as probe:
            m = await get_metrics(probe, lb.url)
    finally:
        lb.stop()
        replica.stop()

    assert served.choices[0].message.content is not None
    err = refused.value
    assert err.status_code == 429 and err.code == "rate_limit_exceeded"
    assert err.response.headers["Retry-After"] == "1"
    assert 0 < int(err.response.headers["retry-after-ms"]) <= 1000
    assert [r.status_code for r in seen] == [200, 429, 429, 200]
    limited = 'skymesh_tenant_limited_total{priority="standard",reason="requests",tenant="capped"}'
    assert m[limited] == 2
    assert m['skymesh_tenant_admitted_total{priority="standard",tenant="capped"}'] == 2

    lines = access_lines(tmp_path / "lb.log")
    assert [r["status"] for r in lines] == [200, 429, 429, 200], lines
    refusal, retry = lines[2], lines[3]
    waited = (wall(retry) - retry["duration_ms"] / 1000) - wall(refusal)
    asked = int(seen[2].headers["retry-after-ms"]) / 1000
    assert waited >= asked - LOG_MS, (waited, asked)
