"""``kv_eviction``'s eviction case on real vLLM: a KV cache small enough to evict.

Lab code, not product. Two vLLM CPU servers (the e2e lane's tiny model, ``make e2e``
builds it; :func:`skymesh_lab.bench.kv_events_live.start_vllm`) with KV events on and
``--kv-cache-memory-bytes`` small, one ``skymesh-lb`` (``prefix-tree``) in front, fresh for
each run, the servers shared by the runs (their prefix caches reset between runs). As in
``kv_eviction``: a document (token ids) cached on server A and routed there once through
the balancer; other clients' prompts sent straight to A until its events remove the
document's first block; then, with A busy with another client's long generation,
``--followups`` requests for the document through the balancer, one at a time. The hit
is vLLM's own (``vllm:prefix_cache_hits_total`` added on the server that took the
request). A restart is not measured here: a vLLM CPU server takes minutes to start on
this shared machine.

    python -m skymesh_lab.bench.kv_eviction_vllm --json docs/results/data/kv-eviction.json
        --vllm-env $SKYMESH_E2E_ENV [--repeats 2]

It adds the runs under ``vllm`` to an existing ``--json`` file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from skymesh_lab.bench.kv_events_live import MODEL, Engine, vllm_servers
from skymesh_lab.bench.kv_events_live import lb_config as live_lb_config
from skymesh_lab.bench.kv_eviction import (
    busy,
    complete,
    follow_replica,
    follow_ups,
    routed,
    start_lb,
    summary,
    token_ids,
)
from skymesh_lab.bench.run_record import LoadWindow, need_vllm_env, parser, vllm_flags, vllm_setup
from skymesh_lab.faults.cluster import parse_metrics, status, wait_for

VOCAB = 4000  # the tiny model's vocabulary is 4,096
DOC_TOKENS, FILL_TOKENS, QUESTION_TOKENS = 1024, 1800, 24
MAX_FILL = 16


def lb_config(engines: Sequence[Engine], arm: str, tokenizer: str) -> dict[str, Any]:
    cfg = live_lb_config(engines, "exact" if arm == "events" else "trie", tokenizer)
    # A CPU server generating answers its probes late on a loaded machine: a patient probe.
    return {**cfg, "probe": {"interval_s": 0.2, "timeout_s": 5.0}}


async def hits(s: aiohttp.ClientSession, url: str) -> float:
    # A CPU server busy generating answers its /metrics late on a loaded machine.
    async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=60)) as r:
        r.raise_for_status()
        return parse_metrics(await r.text()).get("vllm:prefix_cache_hits_total", 0.0)


async def run_one(workdir: Path, engines: Sequence[Engine], arm: str, seed: int,
                  tokenizer: str, followups: int) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    a, b = engines
    # A document of its own per run: the servers' replay buffers still hold the batches of
    # earlier runs, which the bench's subscriber replays when it joins.
    doc = token_ids(1000 + 10 * seed + ("trie", "events").index(arm), DOC_TOKENS, VOCAB)
    out: dict[str, Any] = {"scenario": "evict", "arm": arm, "seed": seed}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        for e in engines:
            async with s.post(e.url + "/reset_prefix_cache") as r:
                r.raise_for_status()
        follow = follow_replica(a.pub, a.replay, doc)
        task = asyncio.create_task(follow.run())
        lb = start_lb(workdir, lb_config(engines, arm, tokenizer))
        try:
            async def ready() -> bool:
                reps = (await status(s, lb.url))["replicas"]
                return all(v["healthy"] and (arm == "trie" or v.get("kv_exact"))
                           for v in reps.values())

            await wait_for(ready, "servers healthy (and events live)", 60)
            await complete(s, a.url, doc, MODEL)

            async def on_a() -> bool:
                return follow.index.match_tokens(doc) > 0

            await wait_for(on_a, "DOC on A", 30)
            if arm == "events":
                async def indexed() -> bool:
                    st = (await status(s, lb.url))["replicas"][a.url]
                    return bool(st["kv_blocks"]) and st["kv_blocks"] >= DOC_TOKENS // 128
                await wait_for(indexed, "A's blocks in the balancer's index", 30)
            async with busy(s, lb.url, b.url, MODEL, 1900, 90):
                target, _ = await routed(s, lb.url, doc, MODEL)
            if target != a.url:
                raise RuntimeError("the warm-up request was not routed to A")
            for i in range(MAX_FILL):
                if follow.lost_at is not None:
                    break
                await complete(s, a.url, token_ids(2000 + 100 * seed + i, FILL_TOKENS, VOCAB),
                               MODEL)

            async def lost() -> bool:
                return follow.lost_at is not None

            await wait_for(lost, "DOC evicted", 30)
            out["batches_to_loss"] = follow.lost_batch
            async def send(ids: list[int]) -> tuple[str, int]:
                before = {e.url: await hits(s, e.url) for e in engines}
                target, _ = await routed(s, lb.url, ids, MODEL)
                return target, int(await hits(s, target) - before[target])

            async with busy(s, lb.url, a.url, MODEL, 1900, 90):
                out["requests"] = await follow_ups(
                    follow, a.url,
                    [doc + token_ids(3000 + 100 * seed + k, QUESTION_TOKENS, VOCAB)
                     for k in range(followups)], send)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            lb.stop()
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = str(Path(os.path.expandvars(args.vllm_env)) / "model")
    load = LoadWindow()
    runs = []
    async with vllm_servers(args) as (engines, cache):
        for rep in range(args.repeats):
            for arm in ("trie", "events") if rep % 2 == 0 else ("events", "trie"):
                r = await run_one(Path(args.workdir) / f"{arm}-{rep}", engines, arm, rep,
                                  tokenizer, args.followups)
                r.update(summary(r, DOC_TOKENS))
                print(json.dumps({k: v for k, v in r.items() if k != "requests"}), flush=True)
                runs.append(r)
    return {"setup": {**vllm_setup(args, cache),
                      "doc_tokens": DOC_TOKENS, "fill_tokens": FILL_TOKENS,
                      "question_tokens": QUESTION_TOKENS, "followups": args.followups,
                      "repeats": args.repeats, **load.fields()},
            "runs": runs}


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    vllm_flags(ap, repeats=2)
    ap.add_argument("--workdir", default="out/kv-eviction-vllm")
    ap.add_argument("--followups", type=int, default=6)
    args = ap.parse_args(argv)
    need_vllm_env(ap, args)
    path = Path(args.json)
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc["vllm"] = asyncio.run(main_async(args))
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
