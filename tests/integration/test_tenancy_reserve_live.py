"""The slot reserve (``tenants.reserve``) on a live ``skymesh-lb`` in front of two emulated
replicas admitting 4 requests each: a batch tenant floods, and while its requests wait in
the fair queue with the replicas otherwise full, an interactive request starts before any
batch request has finished. Without the reserve the flood takes every slot and the
interactive request waits for a batch one to end. Counted in requests, not in seconds."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import get_metrics, until

from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.timeout(240)

WEB_KEY, BULK_KEY = "sk-web-r", "sk-bulk-r"
SEQS, FLOOD = 4, 12
_ENV = {**{k: v for k, v in os.environ.items() if k != "SKYMESH_API_KEYS"},
        "SKYMESH_API_KEYS": f"{WEB_KEY},{BULK_KEY}"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("reps")
    reps = [start_daemon("skymesh-replica", ["--port", "0", "--seed", str(i),
                                             "--max-num-seqs", str(SEQS)],
                         log_path=tmp / f"rep{i}.log") for i in range(2)]
    yield reps
    for r in reps:
        r.stop()


def start(tmp: Path, replicas: list[Daemon], reserve: dict[str, float] | None) -> Daemon:
    tenants: dict[str, Any] = {
        "members": [
            {"name": "web", "keys_sha256": [sha(WEB_KEY)], "default_class": "interactive"},
            {"name": "bulk", "keys_sha256": [sha(BULK_KEY)], "default_class": "batch"}]}
    if reserve is not None:
        tenants["reserve"] = reserve
    cfg: dict[str, Any] = {
        "region": "us", "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
        "probe": {"interval_s": 0.05}, "pushing": {"mode": "sp-p"},
        "queue": {"timeout_s": 200},
        # max_num_seqs comes from the replicas' published gauge, as from vLLM.
        "replicas": [{"url": r.url, "kind": "skymesh"} for r in replicas],
        "tenants": tenants}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "lb.yaml").write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(tmp / "lb.yaml")],
                        log_path=tmp / "lb.log", env=_ENV)


async def batch_done_before_interactive_starts(lb: Daemon, running: int
                                               ) -> tuple[int, dict[str, Any]]:
    """Flood with batch work; once it waits in the fair queue and the replicas run
    ``running`` of it, send one interactive request: how many batch requests had finished
    by its first byte (and the balancer's status at that point)."""
    async with aiohttp.ClientSession() as s:
        async def up() -> bool:
            async with s.get(lb.url + "/status", headers=bearer(WEB_KEY)) as r:
                st = await r.json()
            return sum(x["healthy"] for x in st["replicas"].values()) == 2

        await until(up, "both replicas healthy behind the balancer")
        async with s.get(lb.url + "/v1/models", headers=bearer(WEB_KEY)) as r:
            model = (await r.json())["data"][0]["id"]
        batch = {"model": model, "prompt": "summarise the archive", "max_tokens": 300,
                 "ignore_eos": True}

        async def bulk() -> None:
            async with s.post(lb.url + "/v1/completions", json=batch,
                              headers=bearer(BULK_KEY)) as r:
                assert r.status == 200, await r.text()
                await r.read()

        flood = [asyncio.create_task(bulk()) for _ in range(FLOOD)]

        def done() -> int:
            return sum(f.done() for f in flood)

        status: dict[str, Any] = {}

        async def settled() -> bool:
            """Batch waits in the fair queue and the replicas run as much of it as they
            will take (``running``)."""
            nonlocal status
            m = await get_metrics(s, lb.url)
            async with s.get(lb.url + "/status", headers=bearer(WEB_KEY)) as r:
                st = await r.json()
            status = {"running": sum(x["in_flight"] for x in st["replicas"].values()),
                      "queued": m.get("skymesh_tenant_queue_length", 0)}
            return status["queued"] > 0 and status["running"] == running

        await until(settled, "the flood waiting in the fair queue", timeout=60)
        assert done() == 0, "a batch request finished before the test could start"
        body = {"model": model, "prompt": "hello", "max_tokens": 4, "stream": True}
        seen = -1
        async with s.post(lb.url + "/v1/completions", json=body,
                          headers=bearer(WEB_KEY)) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if seen < 0 and line.startswith(b"data: {"):
                    seen = done()  # its first token
        await asyncio.gather(*flood)
        status["held"] = (await get_metrics(s, lb.url)).get(
            'skymesh_tenant_reserve_held_total{priority="batch"}', 0.0)
        return seen, status


async def test_interactive_starts_beside_a_batch_flood_with_the_reserve(
        tmp_path: Path, replicas: list[Daemon]) -> None:
    lb = start(tmp_path, replicas, None)  # the default reserve: 0.25 of 4 slots, 1 each
    try:
        # One slot per replica kept for better classes.
        seen, status = await batch_done_before_interactive_starts(lb, 2 * (SEQS - 1))
    finally:
        lb.stop()
    assert seen == 0, (seen, status)  # it started while every batch request still ran
    assert status["held"] > 0
    assert "slot reserve: holding class batch" in (tmp_path / "lb.log").read_text()


async def test_without_the_reserve_interactive_waits_for_a_batch_request(
        tmp_path: Path, replicas: list[Daemon]) -> None:
    lb = start(tmp_path, replicas, {})
    try:
        seen, status = await batch_done_before_interactive_starts(lb, 2 * SEQS)
    finally:
        lb.stop()
    assert seen >= 1, (seen, status)
