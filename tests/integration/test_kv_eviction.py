"""A replica that restarts or evicts a prompt: the balancer stops sending it there.

Real processes over loopback: ``skymesh-lb`` (prefix-tree, events on) in front of two
emulated replicas publishing KV-cache events. A document is cached on replica A and routed
there once through the balancer (so its trie, too, says A holds it). Then A loses it, by a
restart (a new publisher, its sequence numbers from 0) or by evicting it (``BlockRemoved``
while other clients fill its cache). The balancer's view of A must follow within the
events' deadline, and the next request for the document, with A the busier replica, must
be scored by load (to B), not sent back to A on its stale trie entry.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support import eventually, start_lb_with, until

from skymesh.prefix.kv_events import KVEventSubscriber, SubscriberSettings, stop
from skymesh.prefix.kv_index import ReplicaBlockIndex
from skymesh.util.procs import Daemon
from skymesh_lab.bench.kv_eviction import Replica, busy, complete, lb_config, routed, token_ids

pytestmark = pytest.mark.timeout(120)

DOC = token_ids(7, 320)  # 20 full blocks


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Replica, Replica, Daemon]]:
    a, b = Replica(tmp_path, "a"), Replica(tmp_path, "b")
    lb = start_lb_with(tmp_path, lb_config([a, b], events=True), {})
    try:
        yield a, b, lb
    finally:
        lb.stop()
        a.daemon.stop()
        b.daemon.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def status(http: aiohttp.ClientSession, lb: Daemon) -> dict[str, dict[str, Any]]:
    async with http.get(f"{lb.url}/status") as r:
        replicas: dict[str, dict[str, Any]] = (await r.json())["replicas"]
        return replicas


async def warm(http: aiohttp.ClientSession, lb: Daemon, a: Replica) -> None:
    async def exact_everywhere() -> bool:
        return all(v.get("kv_exact") for v in (await status(http, lb)).values())

    await until(exact_everywhere, "events live and the tokenizer loaded")
    await complete(http, a.url, DOC)  # cached on A behind the balancer's back

    async def indexed() -> bool:
        return (await status(http, lb))[a.url]["kv_blocks"] >= 20

    await until(indexed, "A's blocks in the balancer's index")
    # Through the balancer: the events send it to A, and the trie records A too.
    target, cached = await routed(http, lb.url, DOC)
    assert target == a.url
    assert cached >= 304  # all but the last block, which an engine always computes


async def test_a_restarted_replica_loses_its_prompts_in_the_balancer(
        pair: tuple[Replica, Replica, Daemon], http: aiohttp.ClientSession) -> None:
    a, b, lb = pair
    await warm(http, lb, a)
    a.daemon.kill()
    a.start()  # same ports, empty cache, sequence numbers from 0

    async def forgotten() -> bool:
        st = (await status(http, lb))[a.url]
        return st["healthy"] and st["kv_events"] == "live" and st["kv_blocks"] == 0

    await until(forgotten, "A's index empty and A live again", timeout=15)
    async with busy(http, lb.url, a.url):
        target, cached = await routed(http, lb.url, DOC)
    assert target == b.url, "sent back to the restarted replica on its stale trie entry"
    assert cached == 0


async def test_an_evicted_prompt_is_not_sent_back_to_its_old_holder(
        pair: tuple[Replica, Replica, Daemon], http: aiohttp.ClientSession) -> None:
    a, b, lb = pair
    index = ReplicaBlockIndex()
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{a.pub}", f"tcp://127.0.0.1:{a.replay}", index,
                            SubscriberSettings(heartbeat_s=0.2))
    follow = asyncio.create_task(sub.run())
    try:
        await warm(http, lb, a)
        await eventually(lambda: index.match_tokens(DOC) == 20, "the test's own view of A")
        # Other clients fill A's cache (2,400 blocks on the L4 profile): LRU evicts DOC.
        for i in range(4):
            await complete(http, a.url, token_ids(100 + i, 12_000))
        await eventually(lambda: index.match_tokens(DOC) == 0, "DOC evicted (BlockRemoved)",
                         timeout=20)
        assert sub.counters.restarts == 0 and sub.counters.resyncs == 0

        async def caught_up() -> bool:
            return (await status(http, lb))[a.url]["kv_blocks"] == len(index)

        await until(caught_up, "the balancer applied the same batches")
        async with busy(http, lb.url, a.url):
            target, cached = await routed(http, lb.url, DOC)
        assert target == b.url, "sent back to the replica that evicted it"
        assert cached == 0
    finally:
        await stop(follow)
