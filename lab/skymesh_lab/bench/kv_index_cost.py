"""What the exact prefix index costs: memory per replica, CPU per event and per query.

    python -m skymesh_lab.bench.kv_index_cost --json docs/results/data/kv-index-cost.json
    python -m skymesh_lab.bench.results docs/results/data docs/results   # the page

A synthetic engine stores chains of ``CHAIN`` blocks (16 tokens each, random token ids)
as vLLM publishes them: msgpack ``EventBatch`` payloads of ``BATCH_CHAINS`` chains. The
balancer's side is measured on them:

- memory: ``tracemalloc``'s growth while one :class:`ReplicaBlockIndex` takes 100,000
  blocks, with the engine hashes vLLM 0.32 publishes (32-byte digests) and the emulated
  replica's (63-bit ints);
- event CPU: process CPU time to decode the payloads (msgspec) and apply them, per 1,000
  blocks stored, and per 1,000 blocks removed;
- query CPU: tokenizing a chat prompt as the emulated engine does (ChatML rendering, the
  Qwen vocabulary of ``skymesh.prefix.prompt.get_tokenizer``), keying its full blocks and
  matching them against 4 replicas' indexes, per request, at 1k, 8k and 32k tokens.

Each figure is the median of ``--repeats`` runs with the min and max beside it: the machine
is shared, so the spread is the noise.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skymesh.prefix.kv_events import (
    BlockRemoved,
    BlockStored,
    apply_events,
    decode_batch,
    encode_batch,
)
from skymesh.prefix.kv_index import ReplicaBlockIndex, block_keys, longest_prefix
from skymesh.prefix.prompt import get_tokenizer, render_chat

BLOCK = 16
CHAIN = 32  # blocks per stored chain (a 512-token prompt)
BATCH_CHAINS = 4  # chains per engine step's batch
MEMORY_BLOCKS = 100_000
QUERY_TOKENS = (1_000, 8_000, 32_000)


def make_payloads(n_blocks: int, digest: bool, seed: int = 0
                  ) -> tuple[list[bytes], list[bytes], list[list[int]]]:
    """(store payloads, remove payloads, the chains' token ids)."""
    rng = random.Random(seed)
    stores: list[bytes] = []
    removes: list[bytes] = []
    prompts: list[list[int]] = []
    batch: list[Any] = []
    gone: list[Any] = []
    for c in range(n_blocks // CHAIN):
        toks = [rng.randrange(150_000) for _ in range(CHAIN * BLOCK)]
        prompts.append(toks)
        hashes: list[bytes | int] = [
            rng.randbytes(32) if digest else rng.getrandbits(63) for _ in range(CHAIN)]
        batch.append(BlockStored(hashes, None, toks, BLOCK, None, "GPU", None))
        gone.append(BlockRemoved(list(reversed(hashes)), "GPU"))
        if len(batch) == BATCH_CHAINS or c == n_blocks // CHAIN - 1:
            stores.append(encode_batch(0.0, batch))
            removes.append(encode_batch(0.0, gone))
            batch, gone = [], []
    return stores, removes, prompts


def cpu(fn: Callable[[], object]) -> float:
    gc.collect()
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def memory(digest: bool) -> dict[str, float]:
    stores, _removes, _p = make_payloads(MEMORY_BLOCKS, digest)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = ReplicaBlockIndex(max_blocks=MEMORY_BLOCKS)
    for payload in stores:
        # Decoded here, so the engine hashes the index keeps are counted; the rest of
        # each decoded batch (token ids) is freed once applied.
        apply_events(idx, decode_batch(payload)[0])
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(idx) == MEMORY_BLOCKS
    return {"blocks": len(idx), "bytes": used, "bytes_per_block": used / len(idx)}


def events_cpu(digest: bool, n_blocks: int, repeats: int) -> dict[str, Any]:
    stores, removes, _p = make_payloads(n_blocks, digest)
    decode_s, store_s, remove_s = [], [], []
    for _ in range(repeats):
        decoded: list[list[Any]] = []
        idx = ReplicaBlockIndex(max_blocks=n_blocks)

        def decode(d: list[list[Any]] = decoded) -> None:
            d.extend(decode_batch(p)[0] for p in stores)

        def store(i: ReplicaBlockIndex = idx, d: list[list[Any]] = decoded) -> None:
            for ev in d:
                apply_events(i, ev)

        def remove(i: ReplicaBlockIndex = idx) -> None:
            for p in removes:
                apply_events(i, decode_batch(p)[0])

        decode_s.append(cpu(decode))
        store_s.append(cpu(store))
        remove_s.append(cpu(remove))
        assert len(idx) == 0
    per_k = 1000 / n_blocks * 1e3  # seconds per run -> ms per 1,000 blocks
    return {"blocks": n_blocks,
            "decode_ms_per_1k_blocks": spread([s * per_k for s in decode_s]),
            "apply_store_ms_per_1k_blocks": spread([s * per_k for s in store_s]),
            "remove_ms_per_1k_blocks": spread([s * per_k for s in remove_s]),
            "store_total_ms_per_1k_blocks": spread(
                [(a + b) * per_k for a, b in zip(decode_s, store_s, strict=True)])}


def query_cpu(repeats: int, per_run: int = 50) -> dict[str, Any]:
    """Keying + matching a prompt against 4 replicas, one holding its whole prefix."""
    rng = random.Random(1)
    out: dict[str, Any] = {}
    tok = get_tokenizer()
    words = [f" w{i}" for i in range(2000)]
    for n in QUERY_TOKENS:
        toks = [rng.randrange(150_000) for _ in range(n)]
        # A chat prompt about n tokens long, tokenized as the balancer does it.
        text = render_chat([{"role": "user", "content": "".join(
            rng.choice(words) for _ in range(n // 2))}])
        n_tok = len(tok.encode(text))
        indexes = {f"r{i}": ReplicaBlockIndex() for i in range(4)}
        nb = n // BLOCK
        indexes["r0"].stored(list(range(nb)), None, toks[: nb * BLOCK], BLOCK)
        indexes["r1"].stored(list(range(nb // 2)), None, toks[: nb // 2 * BLOCK], BLOCK)
        keys_s, match_s = [], []

        def keys(t: list[int] = toks) -> None:
            for _ in range(per_run):
                block_keys(t, BLOCK)

        def match(t: list[int] = toks, ix: dict[str, ReplicaBlockIndex] = indexes) -> None:
            for _ in range(per_run):
                longest_prefix(ix, t)

        def tokenize(t: str = text) -> None:
            for _ in range(per_run):
                tok.encode(t)

        tok_s = []
        for _ in range(repeats):
            keys_s.append(cpu(keys))
            match_s.append(cpu(match))
            tok_s.append(cpu(tokenize))
        assert longest_prefix(indexes, toks)["r0"] == nb
        out[str(n)] = {"tokenizer": tok.name, "chat_prompt_tokens": n_tok,
                       "tokenize_us": spread([s / per_run * 1e6 for s in tok_s]),
                       "keys_us": spread([s / per_run * 1e6 for s in keys_s]),
                       "keys_and_match_4_replicas_us": spread(
                           [s / per_run * 1e6 for s in match_s])}
    return out


def run(repeats: int, cpu_blocks: int) -> dict[str, Any]:
    return {
        "setup": {"block_size": BLOCK, "chain_blocks": CHAIN, "chains_per_batch": BATCH_CHAINS,
                  "repeats": repeats, "cpu_blocks": cpu_blocks,
                  "python": sys.version.split()[0]},
        "memory": {"vllm_digest_hashes": memory(True), "int_hashes": memory(False)},
        "events": {"vllm_digest_hashes": events_cpu(True, cpu_blocks, repeats),
                   "int_hashes": events_cpu(False, cpu_blocks, repeats)},
        "query": query_cpu(repeats),
    }


# -- the results page ------------------------------------------------------------------
def _f(s: dict[str, float], digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def page(doc: dict[str, Any]) -> str:
    mem, ev, q = doc["memory"], doc["events"], doc["query"]
    names = {"vllm_digest_hashes": "vLLM 0.32 (32-byte hashes)",
             "int_hashes": "skymesh-replica (int hashes)"}
    out = ["Memory of one replica's index:", "",
           "| engine hashes | blocks | MB | bytes per block |", "| --- | ---: | ---: | ---: |"]
    for k, m in mem.items():
        out.append(f"| {names[k]} | {m['blocks']:,} | {m['bytes'] / 1e6:.1f} "
                   f"| {m['bytes_per_block']:.0f} |")
    out += ["", "Event-processing CPU, ms per 1,000 blocks (median, min-max over "
            f"{doc['setup']['repeats']} runs of {doc['setup']['cpu_blocks']:,} blocks):", "",
            "| engine hashes | decode | apply stores | stores in all | removals |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for k, e in ev.items():
        out.append(f"| {names[k]} | {_f(e['decode_ms_per_1k_blocks'], 2)} "
                   f"| {_f(e['apply_store_ms_per_1k_blocks'], 2)} "
                   f"| {_f(e['store_total_ms_per_1k_blocks'], 2)} "
                   f"| {_f(e['remove_ms_per_1k_blocks'], 2)} |")
    first = next(iter(q.values()))
    out += ["", "Query CPU per request, microseconds: tokenizing a chat prompt of about that "
            f"many tokens (`{first.get('tokenizer', '?')}`), keying its blocks, keying and "
            "matching against 4 replicas:", "",
            "| prompt tokens | tokenize | keys | keys + match |", "| ---: | ---: | ---: | ---: |"]
    for n, r in q.items():
        tk = _f(r["tokenize_us"], 0) if "tokenize_us" in r else "-"
        out.append(f"| {int(n):,} | {tk} | {_f(r['keys_us'], 0)} "
                   f"| {_f(r['keys_and_match_4_replicas_us'], 0)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.kv_index_cost",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-blocks", type=int, default=50_000)
    args = ap.parse_args(argv)
    doc = run(args.repeats, args.cpu_blocks)
    print(page(doc))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
