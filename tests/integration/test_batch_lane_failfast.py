"""Batch across the mesh, the batch lane's waits. One real ``skymesh-lb`` with one emulated
replica admitting one request at a time, held by a long interactive request while a batch
request arrives. Order of events, never seconds.

- When the last replica serving its model goes down (it hangs, SIGSTOP, until its probes
  mark it down), the waiting batch request gets its 503 (with Retry-After) at once, not at
  the queue timeout nor at its deadline hours later (the lane was not in the stranded
  check).
- While the replica is busy with interactive work, the batch request waits for it past
  ``queue.timeout_s``, up to its deadline (the queue timeout used to end the wait)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from pathlib import Path

import aiohttp
import pytest
import yaml
from support import get_metrics, until

from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.timeout(120)

WEB_KEY, BULK_KEY = "sk-web-1", "sk-bulk-1"
_Reply = asyncio.Task[tuple[int, dict[str, str], str]]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _start(tmp_path: Path, queue_timeout_s: float) -> tuple[Daemon, Daemon]:
    rep = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.2",
                                           "--max-num-seqs", "1"],
                       log_path=tmp_path / "rep.log")
    cfg = {"region": "us", "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
           "probe": {"interval_s": 0.05, "timeout_s": 0.2},
           "queue": {"timeout_s": queue_timeout_s},
           "pushing": {"mode": "sp-p", "max_num_seqs": 1, "max_outstanding": 1},
           "replicas": [{"url": rep.url, "kind": "skymesh", "max_num_seqs": 1}],
           "tenants": {"members": [
               {"name": "web", "keys_sha256": [sha(WEB_KEY)], "default_class": "interactive"},
               {"name": "bulk", "keys_sha256": [sha(BULK_KEY)], "classes": ["batch"],
                "default_class": "batch"}],
               "batch_mesh": {"deadline_h": 4, "urgent_h": 0}}}
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**{k: v for k, v in os.environ.items() if k != "SKYMESH_API_KEYS"},
           "SKYMESH_API_KEYS": f"{WEB_KEY},{BULK_KEY}"}
    lb = start_daemon("skymesh-lb", ["--config", str(path)], log_path=tmp_path / "lb.log",
                      env=env)
    return rep, lb


class _Client:
    def __init__(self, s: aiohttp.ClientSession, url: str) -> None:
        self.s, self.url, self.model = s, url, ""

    async def models(self) -> list[dict[str, str]] | None:
        async with self.s.get(self.url + "/v1/models",
                              headers={"Authorization": f"Bearer {WEB_KEY}"}) as r:
            return (await r.json()).get("data") if r.status == 200 else None

    async def ready(self) -> None:
        await until(self.models, "the replica's model listed")
        self.model = (await self.models() or [{}])[0]["id"]

    async def post(self, key: str, max_tokens: int) -> tuple[int, dict[str, str], str]:
        body = {"model": self.model, "max_tokens": max_tokens, "ignore_eos": True,
                "prompt": "tell me"}
        async with self.s.post(self.url + "/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status, dict(r.headers), await r.text()

    async def held(self) -> bool:
        m = await get_metrics(self.s, self.url)
        return sum(v for k, v in m.items()
                   if k.startswith("skymesh_replica_in_flight_requests")) >= 1

    async def queued(self) -> bool:  # /status's count includes the batch lanes
        async with self.s.get(self.url + "/status",
                              headers={"Authorization": f"Bearer {WEB_KEY}"}) as r:
            return (await r.json())["queued"] >= 1

    async def batch_behind(self, long_tokens: int) -> tuple[_Reply, _Reply]:
        """An interactive request of ``long_tokens`` holding the only replica, and a
        batch request waiting in its lane behind it."""
        await self.ready()
        long = asyncio.create_task(self.post(WEB_KEY, long_tokens))
        await until(self.held, "the long request on the only replica")
        batch = asyncio.create_task(self.post(BULK_KEY, 8))
        await until(self.queued, "the batch request waiting in its lane")
        return long, batch


async def test_batch_waiting_in_its_lane_fails_fast_when_the_last_replica_goes(
        tmp_path: Path) -> None:
    rep, lb = _start(tmp_path, 3600)
    try:
        async with aiohttp.ClientSession() as s:
            long, batch = await _Client(s, lb.url).batch_behind(1500)
            lane = await get_metrics(s, lb.url)
            assert lane["skymesh_batch_lane_length"] == 1  # seen there, not in the queue
            assert lane.get("skymesh_queue_length", 0) == 0
            assert not long.done()  # the replica is still held: batch waits for it
            # The replica hangs (its probes time out until it is marked down) rather than
            # exits: an exit would free its slot first and the batch would go to it.
            rep.proc.send_signal(signal.SIGSTOP)
            status, headers, text = await asyncio.wait_for(batch, 90)
            assert status == 503, text
            assert "no healthy replica serves model" in text
            assert float(headers["Retry-After"]) > 0
            long.cancel()
            await asyncio.gather(long, return_exceptions=True)
    finally:
        lb.stop()
        if rep.alive():
            rep.proc.send_signal(signal.SIGCONT)
        rep.stop()


async def test_batch_waits_for_a_busy_replica_past_the_queue_timeout(tmp_path: Path) -> None:
    # The queue timeout is far shorter than the interactive request holding the only
    # replica: the batch request must outlast it (its deadline is hours), then be served.
    rep, lb = _start(tmp_path, 0.2)
    try:
        async with aiohttp.ClientSession() as s:
            long, batch = await _Client(s, lb.url).batch_behind(400)
            status, _, text = await asyncio.wait_for(long, 90)
            assert status == 200, text
            assert not batch.done(), await batch  # it waited out the long request
            status, _, text = await asyncio.wait_for(batch, 90)
            assert status == 200, text
    finally:
        lb.stop()
        rep.stop()
