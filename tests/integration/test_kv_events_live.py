"""KV-cache events end to end: a real emulated replica publishing, a real subscriber.

The replica runs as its own process with ``--kv-events-config`` on loopback ports; the
subscriber (:class:`skymesh.prefix.kv_events.KVEventSubscriber`) runs in the test's
loop. Prompts are token ids (the completions API takes them), so the test knows exactly
which blocks the engine caches.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from support import eventually, start_lb_with, until

from skymesh.prefix.kv_events import KVEventSubscriber, SubscriberSettings, stop
from skymesh.prefix.kv_index import ReplicaBlockIndex
from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile

pytestmark = pytest.mark.timeout(120)

MODEL = get_profile(DEFAULT_PROFILE).model
FAST = SubscriberSettings(heartbeat_s=0.2, stale_after_s=1.0, replay_timeout_s=1.0)


def _start(tmp: Path, pub: int, replay: int, name: str = "replica") -> Daemon:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
           "endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    return start_daemon("skymesh-replica",
                        ["--port", "0", "--time-scale", "0.01", "--metrics-lag-s", "0",
                         "--kv-events-config", json.dumps(cfg)],
                        log_path=tmp / f"{name}.log")


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture
def replica(tmp_path: Path, ports: tuple[int, int]) -> Iterator[Daemon]:
    d = _start(tmp_path, *ports)
    try:
        yield d
    finally:
        d.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30_000) for _ in range(n)]


async def complete(http: aiohttp.ClientSession, url: str, ids: list[int]) -> None:
    async with http.post(f"{url}/v1/completions",
                         json={"model": MODEL, "prompt": ids, "max_tokens": 1}) as r:
        assert r.status == 200, await r.text()
        await r.read()


class Following:
    """A subscriber task and its index."""

    def __init__(self, ports: tuple[int, int], cls: type[KVEventSubscriber] = KVEventSubscriber
                 ) -> None:
        self.index = ReplicaBlockIndex()
        self.sub = cls(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}",
                       self.index, FAST)
        self.task = asyncio.get_running_loop().create_task(self.sub.run())

    def blocks(self, ids: list[int]) -> int:
        return self.index.match_tokens(ids)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


class DropsOne(KVEventSubscriber):
    """Loses the first live batch after ``arm()`` (a frame dropped on the way)."""

    armed = False
    dropped: int | None = None

    async def _on_live(self, frames: list[bytes]) -> None:
        if self.armed and self.dropped is None:
            self.dropped = int.from_bytes(frames[1], "big")
            return
        await super()._on_live(frames)


async def test_index_follows_stores_resets_and_evictions(
        replica: Daemon, ports: tuple[int, int], http: aiohttp.ClientSession) -> None:
    f = Following(ports)
    try:
        await eventually(f.sub.is_live, "the subscriber hears the publisher")
        a = prompt(1, 64 + 5)  # 4 full blocks and a tail
        await complete(http, replica.url, a)
        await eventually(lambda: f.blocks(a) == 4, "A's four blocks in the index")

        # A subscriber that joins late learns what the replay buffer holds.
        late = Following(ports)
        await eventually(lambda: late.blocks(a) == 4, "a late subscriber catches up")
        await stop(late.task)

        # One lost live batch: the gap is filled from the replay endpoint.
        lossy = Following(ports, DropsOne)
        await eventually(lambda: lossy.blocks(a) == 4, "the lossy subscriber catches up")
        assert isinstance(lossy.sub, DropsOne)
        replayed = lossy.sub.counters.replayed
        lossy.sub.armed = True
        b = prompt(2, 48)
        await complete(http, replica.url, b)
        await eventually(lambda: lossy.sub.dropped is not None, "a batch dropped")
        await eventually(lambda: lossy.blocks(b) == 3, "B recovered from replay", timeout=10)
        assert lossy.sub.counters.replayed > replayed
        await stop(lossy.task)

        async with http.post(f"{replica.url}/reset_prefix_cache") as r:
            assert r.status == 200
        await eventually(lambda: len(f.index) == 0, "AllBlocksCleared empties the index")

        # Eviction: the L4 profile holds 2400 blocks; 4 prompts of 750 blocks push A out.
        await complete(http, replica.url, a)
        await eventually(lambda: f.blocks(a) == 4, "A cached again")
        for seed in range(10, 14):
            await complete(http, replica.url, prompt(seed, 12_000))
        await eventually(lambda: f.blocks(a) == 0, "A evicted", timeout=20)
        assert len(f.index) > 2000
        assert f.sub.counters.restarts == 0 and f.sub.counters.resyncs == 0
    finally:
        await stop(f.task)


async def test_restarted_replica_is_resynced_and_stale_meanwhile(
        tmp_path: Path, ports: tuple[int, int], http: aiohttp.ClientSession) -> None:
    d = _start(tmp_path, *ports)
    f = Following(ports)
    try:
        a = prompt(1, 64)
        await complete(http, d.url, a)
        await eventually(lambda: f.blocks(a) == 4, "A in the index")
        d.kill()
        await eventually(lambda: not f.sub.is_live(), "events stale while the replica is down")
        d = _start(tmp_path, *ports, name="replica2")
        await eventually(lambda: f.sub.counters.restarts >= 1, "the restart is seen",
                         timeout=10)
        assert f.blocks(a) == 0  # the new engine holds nothing
        await eventually(f.sub.is_live, "events live again")
        b = prompt(2, 32)
        await complete(http, d.url, b)
        await eventually(lambda: f.blocks(b) == 2, "the new engine's blocks in the index")
    finally:
        await stop(f.task)
        d.stop()


async def test_balancer_status_shows_live_stale_and_off(
        tmp_path: Path, ports: tuple[int, int], http: aiohttp.ClientSession) -> None:
    d = _start(tmp_path, *ports)
    plain = start_daemon("skymesh-replica", ["--port", "0"], log_path=tmp_path / "plain.log")
    cfg = {"listen": {"host": "127.0.0.1", "port": 0},
           "kv_events": {"heartbeat_s": 0.2, "stale_after_s": 1.0, "replay_timeout_s": 0.5},
           "replicas": [{"url": d.url, "kv_events": {
                             "endpoint": f"tcp://127.0.0.1:{ports[0]}",
                             "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}"}},
                        {"url": plain.url}]}
    lb = start_lb_with(tmp_path, cfg, {})

    async def states() -> dict[str, str]:
        async with http.get(f"{lb.url}/status") as r:
            body = await r.json()
        return {u: rep["kv_events"] for u, rep in body["replicas"].items()}

    async def state_is(url: str, want: str) -> bool:
        return (await states())[url] == want

    try:
        await until(lambda: state_is(d.url, "live"), "events live in /status")
        assert (await states())[plain.url] == "off"
        d.kill()
        await until(lambda: state_is(d.url, "stale"), "events stale once the replica died")
    finally:
        lb.stop()
        plain.stop()
        d.stop()


async def test_prefix_tree_routes_to_the_replica_the_events_say_holds_the_prompt(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """Prompts cached on a replica by traffic the balancer never saw (sent to the replica
    directly): with events, prefix-tree sends each one to its holder and the engine hits
    the cache; the trie alone would pick between two idle replicas at random."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    reps = [_start(tmp_path, *p, name=f"r{i}") for i, p in enumerate(ports)]
    cfg = {"listen": {"host": "127.0.0.1", "port": 0}, "policy": {"name": "prefix-tree"},
           "kv_events": {"heartbeat_s": 0.2, "stale_after_s": 2.0},
           "replicas": [{"url": r.url, "kind": "skymesh", "kv_events": {
               "endpoint": f"tcp://127.0.0.1:{p[0]}",
               "replay_endpoint": f"tcp://127.0.0.1:{p[1]}"}} for r, p in zip(reps, ports,
                                                                                 strict=True)]}
    lb = start_lb_with(tmp_path, cfg, {})

    async def status() -> dict[str, dict[str, object]]:
        async with http.get(f"{lb.url}/status") as r:
            replicas: dict[str, dict[str, object]] = (await r.json())["replicas"]
            return replicas

    async def chat(url: str, text: str) -> int:
        body = {"model": MODEL, "max_tokens": 1,
                "messages": [{"role": "user", "content": text}]}
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
            cached: int = usage["prompt_tokens_details"]["cached_tokens"]
            return cached

    try:
        async def exact_everywhere() -> bool:
            return all(v.get("kv_exact") for v in (await status()).values())

        await until(exact_everywhere, "events live and the tokenizer loaded")
        rng = random.Random(5)
        words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
        for i in range(6):
            holder = reps[rng.randrange(2)]
            text = f"document {i}: " + " ".join(rng.choice(words) for _ in range(300))
            before = (await status())[holder.url]["kv_blocks"]
            assert isinstance(before, int)
            await chat(holder.url, text)  # straight to the engine: the balancer sees nothing

            async def stored(url: str = holder.url, n: int = before) -> bool:
                got = (await status())[url]["kv_blocks"]
                return isinstance(got, int) and got >= n + 16

            await until(stored, "the holder's blocks in the balancer's index")
            cached = await chat(lb.url, text)
            assert cached >= 256, f"prompt {i} missed the holder's cache ({cached} cached)"
    finally:
        lb.stop()
        for r in reps:
            r.stop()
