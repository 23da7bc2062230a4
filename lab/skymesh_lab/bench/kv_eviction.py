"""After a replica restarts or evicts a prefix: does the balancer keep sending it there?

Lab code, not product. Real processes over loopback: one ``skymesh-lb`` (``prefix-tree``,
the default push mode) in front of two emulated replicas (``skymesh-replica``, L4 profile,
2,400 KV blocks of 16 tokens, ``--time-scale`` 0.01) publishing KV-cache events. A
document (2,048 token ids, 128 blocks) is cached on replica A behind the balancer's back,
then sent once through the balancer, which routes it to A (so its trie says A holds it).
Then A loses it:

- ``restart``: A is killed and started again on the same ports: an empty cache, its event
  sequence from 0;
- ``evict``: other clients send A four prompts of 12,000 tokens: A's LRU evicts the
  document (``BlockRemoved``).

Then another client's long generation keeps A busy (the balancer's probe sees it running),
so that load points away from A, and ``--followups`` requests for the document (each with
its own question appended) go through the balancer one after another. Per request: which
replica got it (the balancer's ``skymesh_routing_decisions_total``), the prompt tokens it
served from cache (``usage.prompt_tokens_details.cached_tokens``), its send time after the
loss and how many event batches A had published since. The bench follows A's events
itself (a SUB socket, ``skymesh.prefix.kv_index``) to time the loss: the batch that
removed the document's first block (``evict``), the new process's start (``restart``).

Two arms: ``trie`` (the balancer without ``kv_events``: its trie of its own decisions) and
``events`` (the replicas' ``kv_events`` in its config). Fresh processes for each run; arms
interleaved, ``--repeats`` of each. The eviction case on real vLLM:
:mod:`skymesh_lab.bench.kv_eviction_vllm`.

    python -m skymesh_lab.bench.kv_eviction --json out.json [--repeats 3] [--followups 8]
        [--arms trie,events] [--into runs]

``--into KEY`` keeps the rest of an existing ``--json`` file and puts these runs under
``KEY`` (with the commit measured): how ``before_fix`` was recorded, the events arm at the
commit before the balancer stopped believing its trie for a prompt the replica's events
said it lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from skymesh.prefix.kv_events import KVEventSubscriber, SubscriberSettings
from skymesh.prefix.kv_index import ReplicaBlockIndex
from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_lab.bench.run_record import LoadWindow, commit, parser
from skymesh_lab.faults.cluster import parse_metrics, status, wait_for
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile

MODEL = get_profile(DEFAULT_PROFILE).model
ARMS = ("trie", "events")
SCENARIOS = ("restart", "evict")
TIME_SCALE = 0.01
DOC_TOKENS = 2048
FILL_PROMPTS, FILL_TOKENS = 4, 12_000  # 3,000 blocks through a 2,400-block cache
QUESTION_TOKENS = 24


def token_ids(seed: int, n: int, vocab: int = 30_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab) for _ in range(n)]


class Replica:
    """An emulated replica with KV events on fixed ports, restartable as itself."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.workdir, self.name = workdir, name
        self.port, self.pub, self.replay = free_port(), free_port(), free_port()
        self.starts = 0
        self.daemon = self.start()

    def start(self) -> Daemon:
        self.starts += 1
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
               "endpoint": f"tcp://127.0.0.1:{self.pub}",
               "replay_endpoint": f"tcp://127.0.0.1:{self.replay}"}
        self.daemon = start_daemon(
            "skymesh-replica",
            ["--port", str(self.port), "--time-scale", str(TIME_SCALE), "--metrics-lag-s",
             "0", "--kv-events-config", json.dumps(cfg)],
            log_path=self.workdir / f"{self.name}-{self.starts}.log")
        return self.daemon

    @property
    def url(self) -> str:
        return self.daemon.url

    def lb_entry(self, events: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"url": self.url, "kind": "skymesh"}
        if events:
            entry["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{self.pub}",
                                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay}"}
        return entry


def lb_config(replicas: Sequence[Replica], events: bool) -> dict[str, Any]:
    return {"listen": {"host": "127.0.0.1", "port": 0}, "policy": {"name": "prefix-tree"},
            "kv_events": {"heartbeat_s": 0.2, "stale_after_s": 2.0, "replay_timeout_s": 0.5},
            "replicas": [r.lb_entry(events) for r in replicas]}


def start_lb(workdir: Path, cfg: dict[str, Any]) -> Daemon:
    path = workdir / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(path)], log_path=workdir / "lb.log")


async def decisions(s: aiohttp.ClientSession, lb: str) -> dict[str, float]:
    """Requests placed per target so far (``skymesh_routing_decisions_total``)."""
    out: dict[str, float] = {}
    # Patient: next to a busy vLLM CPU server on a shared machine, an answer can take
    # seconds.
    async with s.get(lb + "/metrics", timeout=aiohttp.ClientTimeout(total=60)) as r:
        r.raise_for_status()
        text = await r.text()
    for series, v in parse_metrics(text).items():
        if series.startswith("skymesh_routing_decisions_total{"):
            target = series.split('target="', 1)[1].split('"', 1)[0]
            out[target] = out.get(target, 0.0) + v
    return out


async def complete(s: aiohttp.ClientSession, url: str, ids: list[int], model: str = MODEL
                   ) -> int:
    """Cached prompt tokens of one completion of ``ids`` (``max_tokens`` 1; 0 from an
    engine that does not report them)."""
    async with s.post(f"{url}/v1/completions",
                      json={"model": model, "prompt": ids, "max_tokens": 1}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        details = (await r.json())["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


async def routed(s: aiohttp.ClientSession, lb: str, ids: list[int], model: str = MODEL
                 ) -> tuple[str, int]:
    """(the replica the balancer sent ``ids`` to, the prompt tokens it had cached);
    one request at a time."""
    before = await decisions(s, lb)
    cached = await complete(s, lb, ids, model)
    after = await decisions(s, lb)
    (target,) = [t for t, v in after.items() if v > before.get(t, 0.0)]
    return target, cached


async def replica_status(s: aiohttp.ClientSession, lb: str, url: str) -> dict[str, Any]:
    out: dict[str, Any] = (await status(s, lb))["replicas"][url]
    return out


@contextlib.asynccontextmanager
async def busy(s: aiohttp.ClientSession, lb: str, url: str, model: str = MODEL,
               max_tokens: int = 16_000, deadline_s: float = 15) -> AsyncIterator[None]:
    """Another client's long generation on ``url``, once the balancer's probe sees it."""
    body = {"model": model, "prompt": [11, 12, 13], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}

    async def run() -> None:
        # A session of its own: a pooled connection to a replica since restarted is dead.
        # Again and again: a short context (real vLLM's) ends a generation in seconds.
        async with aiohttp.ClientSession() as own:
            while True:
                async with own.post(f"{url}/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for _chunk in r.content.iter_any():
                        pass

    task = asyncio.create_task(run())

    async def seen() -> bool:
        if task.done():  # refused or cut: say why rather than time out
            raise RuntimeError(f"the busy requests on {url} failed: {task.exception()!r}")
        return bool((await replica_status(s, lb, url)).get("running"))

    try:
        await wait_for(seen, "the balancer's probe sees the replica busy", deadline_s)
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await task


@dataclass
class Follow(KVEventSubscriber):
    """A's event stream as the bench sees it (the balancer's own subscriber, so a batch
    published before the SUB socket joined is replayed): batches, and when DOC went."""

    doc: list[int] = field(default_factory=list)
    batches: int = 0
    lost_at: float | None = None  # monotonic time of the batch that dropped DOC's head
    lost_batch: int | None = None

    def _apply(self, seq: int, payload: bytes) -> None:
        held = self.index.match_tokens(self.doc) > 0
        super()._apply(seq, payload)
        self.batches += 1
        if held and self.lost_at is None and self.index.match_tokens(self.doc) == 0:
            self.lost_at, self.lost_batch = time.monotonic(), self.batches

    def mark_loss(self) -> None:
        self.lost_at, self.lost_batch = time.monotonic(), self.batches


def follow_replica(replica_pub: int, replay: int, doc: list[int]) -> Follow:
    return Follow(f"tcp://127.0.0.1:{replica_pub}", f"tcp://127.0.0.1:{replay}",
                  ReplicaBlockIndex(), SubscriberSettings(heartbeat_s=0.2), doc=doc)


async def run_one(workdir: Path, scenario: str, arm: str, seed: int, followups: int
                  ) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    a, b = Replica(workdir, "a"), Replica(workdir, "b")
    lb = start_lb(workdir, lb_config([a, b], events=arm == "events"))
    doc = token_ids(1000 + seed, DOC_TOKENS)
    follow = follow_replica(a.pub, a.replay, doc)
    task = asyncio.create_task(follow.run())
    out: dict[str, Any] = {"scenario": scenario, "arm": arm, "seed": seed}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def ready() -> bool:
                reps = (await status(s, lb.url))["replicas"]
                return all(v["healthy"] and (arm == "trie" or v.get("kv_exact"))
                           for v in reps.values())

            await wait_for(ready, "replicas healthy (and events live)", 30)
            await complete(s, a.url, doc)  # cached on A behind the balancer's back
            await wait_for(lambda: _true(follow.index.match_tokens(doc) > 0), "DOC on A", 10)
            if arm == "events":
                async def indexed() -> bool:
                    return (await replica_status(s, lb.url, a.url))["kv_blocks"] >= 128
                await wait_for(indexed, "A's blocks in the balancer's index", 10)
            # Once through the balancer, to A (the trie, knowing nothing yet, by load: B
            # is kept busy), so that its trie records A for the document.
            async with busy(s, lb.url, b.url):
                target, _ = await routed(s, lb.url, doc)
            if target != a.url:
                raise RuntimeError("the warm-up request was not routed to A")

            t_restart = None
            if scenario == "restart":
                a.daemon.kill()
                a.start()
                follow.mark_loss()
                t_restart = time.monotonic()

                async def back() -> bool:
                    st = await replica_status(s, lb.url, a.url)
                    return bool(st["healthy"]) and (arm == "trie" or (
                        st["kv_events"] == "live" and st["kv_blocks"] == 0))

                await wait_for(back, "A healthy again (events: live, index empty)", 30)
                out["a_back_in_balancer_s"] = round(time.monotonic() - t_restart, 3)
            else:
                for i in range(FILL_PROMPTS):
                    await complete(s, a.url, token_ids(2000 + 10 * seed + i, FILL_TOKENS))
                await wait_for(lambda: _true(follow.lost_at is not None), "DOC evicted", 20)
            out["batches_to_loss"] = follow.lost_batch

            async with busy(s, lb.url, a.url):
                out["requests"] = await follow_ups(
                    follow, a.url, [doc + token_ids(3000 + 100 * seed + k, QUESTION_TOKENS)
                                    for k in range(followups)],
                    lambda ids: routed(s, lb.url, ids))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        lb.stop()
        a.daemon.stop()
        b.daemon.stop()
    return out


async def follow_ups(follow: Follow, lost_url: str, prompts: list[list[int]],
                     send: Callable[[list[int]], Awaitable[tuple[str, int]]]
                     ) -> list[dict[str, Any]]:
    """Send ``prompts`` one at a time (``send``: the target and its cached tokens) and
    record each against the loss ``follow`` saw."""
    out = []
    for ids in prompts:
        assert follow.lost_at is not None and follow.lost_batch is not None
        since_s = time.monotonic() - follow.lost_at
        since_batches = follow.batches - follow.lost_batch
        target, cached = await send(ids)
        out.append({"to_lost": target == lost_url, "cached": cached,
                    "prompt_tokens": len(ids), "after_loss_s": round(since_s, 3),
                    "batches_after_loss": since_batches})
    return out


async def _true(v: bool) -> bool:
    return v


def summary(run: dict[str, Any], doc_tokens: int = DOC_TOKENS) -> dict[str, Any]:
    reqs = run["requests"]
    to_lost = [r for r in reqs if r["to_lost"]]
    return {"to_lost": len(to_lost), "followups": len(reqs),
            "hit_rate": sum(r["cached"] for r in reqs) / sum(r["prompt_tokens"] for r in reqs),
            "hits": sum(r["cached"] >= doc_tokens for r in reqs),
            "last_to_lost_after_s": max((r["after_loss_s"] for r in to_lost), default=None),
            "last_to_lost_batches": max((r["batches_after_loss"] for r in to_lost),
                                        default=None)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir)
    load = LoadWindow()
    runs = []
    for rep in range(args.repeats):
        for scenario in SCENARIOS:
            arms = args.arms if rep % 2 == 0 else args.arms[::-1]
            for arm in arms:
                r = await run_one(workdir / f"{scenario}-{arm}-{rep}", scenario, arm, rep,
                                  args.followups)
                r.update(summary(r))
                print(json.dumps({k: v for k, v in r.items() if k != "requests"}), flush=True)
                runs.append(r)
    return {"setup": {"replicas": 2, "profile": DEFAULT_PROFILE,
                      "kv_blocks": get_profile(DEFAULT_PROFILE).num_kv_blocks,
                      "block_size": get_profile(DEFAULT_PROFILE).block_size,
                      "time_scale": TIME_SCALE, "doc_tokens": DOC_TOKENS,
                      "question_tokens": QUESTION_TOKENS, "fill_prompts": FILL_PROMPTS,
                      "fill_tokens": FILL_TOKENS, "followups": args.followups,
                      "repeats": args.repeats, "policy": "prefix-tree",
                      "heartbeat_s": 0.2, "stale_after_s": 2.0, **load.fields()},
            "runs": runs}


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--workdir", default="out/kv-eviction")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--followups", type=int, default=8)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--into", default="runs")
    ap.add_argument("--code", help="what code ran, for --into (default: the commit)")
    args = ap.parse_args(argv)
    args.arms = tuple(args.arms.split(","))
    if not set(args.arms) <= set(ARMS):
        ap.error(f"--arms: of {', '.join(ARMS)}")
    out = asyncio.run(main_async(args))
    path = Path(args.json)
    if args.into != "runs":
        code = commit(args.code)
        runs = [{**r, "commit": code} for r in out["runs"]]
        out = {**json.loads(path.read_text()), args.into: runs}
    path.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
