"""Tenancy on a live ``skymesh-lb`` in front of an emulated replica (``skymesh-replica``
admitting one request at a time): a batch tenant floods the queue, then an interactive
tenant sends one request. First come, first served (no ``tenants`` section) serves it
after the flood; with tenants, the fair queue serves it after at most the few requests
already let into the dispatcher. Counted in requests finished, not in seconds. And a
tenant over its request rate gets a 429 in the OpenAI shape with a Retry-After."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import get_metrics, until

from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.timeout(180)

WEB_KEY, BULK_KEY, CAPPED_KEY = "sk-web-1", "sk-bulk-1", "sk-capped-1"
FLOOD = 24
_ENV = {**{k: v for k, v in os.environ.items() if k != "SKYMESH_API_KEYS"},
        "SKYMESH_API_KEYS": f"{WEB_KEY},{BULK_KEY},{CAPPED_KEY}"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS: dict[str, Any] = {
    "classes": ["interactive", "standard", "batch"],
    "dispatch_queue": 1,
    "members": [
        {"name": "web", "keys_sha256": [sha(WEB_KEY)], "default_class": "interactive"},
        {"name": "bulk", "keys_sha256": [sha(BULK_KEY)], "classes": ["batch"],
         "default_class": "batch"},
        {"name": "capped", "keys_sha256": [sha(CAPPED_KEY)], "requests_per_s": 1.0},
    ],
}


def start(tmp: Path, replica: str, tenants: dict[str, Any] | None) -> Daemon:
    cfg: dict[str, Any] = {
        "region": "us", "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
        "probe": {"interval_s": 0.05},
        "pushing": {"mode": "sp-p", "max_num_seqs": 1, "max_outstanding": 1},
        "queue": {"timeout_s": 120},
        "replicas": [{"url": replica, "kind": "skymesh", "max_num_seqs": 1}]}
    if tenants is not None:
        cfg["tenants"] = tenants
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "lb.yaml").write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(tmp / "lb.yaml")],
                        log_path=tmp / "lb.log", env=_ENV)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("rep")
    rep = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.2",
                                           "--max-num-seqs", "1"], log_path=tmp / "rep.log")
    yield rep
    rep.stop()


async def model_of(s: aiohttp.ClientSession, lb: Daemon) -> str:
    async def listed() -> bool:
        async with s.get(lb.url + "/v1/models", headers=bearer(WEB_KEY)) as r:
            return r.status == 200 and bool((await r.json())["data"])
    await until(listed, "the replica's model behind the balancer")
    async with s.get(lb.url + "/v1/models", headers=bearer(WEB_KEY)) as r:
        return str((await r.json())["data"][0]["id"])


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def batch_done_before_interactive(lb: Daemon, queued_series: str
                                        ) -> tuple[int, float]:
    """Flood with the batch tenant, then send one interactive request: how many batch
    requests had finished when it did (and its latency, printed only)."""
    async with aiohttp.ClientSession() as s:
        model = await model_of(s, lb)
        body = {"model": model, "max_tokens": 8, "prompt": "tell me"}
        done = 0

        async def bulk() -> None:
            nonlocal done
            async with s.post(lb.url + "/v1/completions", json=body,
                              headers=bearer(BULK_KEY)) as r:
                assert r.status == 200, await r.text()
                await r.read()
            done += 1

        flood = [asyncio.create_task(bulk()) for _ in range(FLOOD)]

        async def backlogged() -> bool:
            m = await get_metrics(s, lb.url)
            return m.get(queued_series, 0.0) >= FLOOD - 6

        await until(backlogged, f"the flood waiting ({queued_series})", timeout=60)
        t0 = time.perf_counter()
        async with s.post(lb.url + "/v1/completions", json=body,
                          headers=bearer(WEB_KEY)) as r:
            assert r.status == 200, await r.text()
            await r.read()
        seen, took = done, time.perf_counter() - t0
        await asyncio.gather(*flood)
        return seen, took


async def test_fair_queue_serves_interactive_ahead_of_a_batch_flood(
        tmp_path: Path, replica: Daemon) -> None:
    lb = start(tmp_path / "fcfs", replica.url, None)
    try:
        fcfs, fcfs_s = await batch_done_before_interactive(lb, "skymesh_queue_length")
    finally:
        lb.stop()
    lb = start(tmp_path / "fair", replica.url, TENANTS)
    try:
        fair, fair_s = await batch_done_before_interactive(lb, "skymesh_tenant_queue_length")
        async with aiohttp.ClientSession() as s:
            m = await get_metrics(s, lb.url)
    finally:
        lb.stop()
    # FCFS: behind everything queued before it. Fair: behind what was running or
    # already in the dispatcher's queue (dispatch_queue: 1) and not much more.
    print(f"batch requests done before the interactive one: fcfs {fcfs}, fair {fair}; "
          f"its latency: fcfs {fcfs_s:.2f} s, fair {fair_s:.2f} s")
    assert fcfs >= FLOOD - 6, (fcfs, fair)
    assert fair <= 4, (fcfs, fair)
    assert m['skymesh_tenant_admitted_total{priority="batch",tenant="bulk"}'] == FLOOD
    assert m['skymesh_tenant_admitted_total{priority="interactive",tenant="web"}'] == 1
    assert m['skymesh_tenant_queue_length'] == 0  # nothing left behind
    assert m['skymesh_tenant_tokens_total{priority="batch",tenant="bulk"}'] > 0
    log = (tmp_path / "fair" / "lb.log").read_text()
    assert "tenant=web" in log and "priority=interactive" in log  # the access log's


async def test_a_tenant_over_its_rate_gets_429_with_retry_after(
        tmp_path: Path, replica: Daemon) -> None:
    lb = start(tmp_path, replica.url, TENANTS)
    try:
        async with aiohttp.ClientSession() as s:
            model = await model_of(s, lb)
            body = {"model": model, "max_tokens": 2, "prompt": "hi"}
            statuses = []
            refusal: dict[str, Any] = {}
            headers: dict[str, str] = {}
            told_ms = []  # each refusal's retry-after-ms
            for _ in range(3):  # 1 request/s
                async with s.post(lb.url + "/v1/completions", json=body,
                                  headers=bearer(CAPPED_KEY)) as r:
                    statuses.append(r.status)
                    if r.status == 429:
                        told_ms.append(int(r.headers["retry-after-ms"]))
                        if not refusal:  # the first refusal's
                            refusal, headers = await r.json(), dict(r.headers)
            m = await get_metrics(s, lb.url)
    finally:
        lb.stop()
    assert statuses[0] == 200 and 429 in statuses, statuses
    assert refusal["error"]["code"] == "rate_limit_exceeded"
    assert "capped" in refusal["error"]["message"]
    assert headers["Retry-After"] == "1"
    assert 0 < int(headers["retry-after-ms"]) <= 1000
    # Refused one after the other, told to come back in turn (one refill, 1 s, apart).
    assert told_ms == sorted(told_ms) and len(set(told_ms)) == len(told_ms), told_ms
    limited = 'skymesh_tenant_limited_total{priority="standard",reason="requests",tenant="capped"}'
    assert m[limited] >= 1
