"""``make demo``: what the lab can do today, in about a minute.

1. A short simulated comparison: SkyLB's selective-pushing microbenchmark in miniature
   (one region, 4 L4 replicas, tree-of-thoughts clients), blind pushing vs selective
   pushing, with the load-only policies.
2. Real processes on loopback: four ``skymesh-replica`` processes behind ``skymesh-lb``
   with the prefix-tree policy, a burst of streamed requests with shared prefixes, and
   what happened: requests per replica, prefix-cache hit rate, TTFT percentiles.
3. The three-region mesh (``skymesh demo``): a balancer and replicas per region, peered
   over mTLS gRPC through delay proxies, clients skewed toward us; the mesh against
   region-local serving.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import aiohttp

from skymesh.util.procs import start_daemon
from skymesh.util.stats import fmt, percentiles
from skymesh_lab.sim.runner import SimConfig, run


def _sim_table() -> None:
    print("== Simulated: 1 region, 4 x Llama-3.1-8B on L4, tree-of-thoughts (GSM8K) ==")
    print(f"  {'push':<5} {'policy':<12} {'req/s':>7} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'E2E p50':>8} {'hit rate':>9} {'sim/wall':>9}")
    for mode in ("bp", "sp-p"):
        for policy in ("round-robin", "least-load"):
            cfg = SimConfig(
                workload="tot-gsm8k", regions=["us"], replicas={"us": 4}, policy=policy,
                push_mode=mode, seed=1, duration_s=120.0,
                workload_params={"clients_per_region": 30, "branching": 2},
            )
            r = run(cfg)
            print(f"  {mode:<5} {policy:<12} {r['throughput_rps']:>7.2f} "
                  f"{fmt(r['ttft_p50_s'], '>8.2f')}s {fmt(r['ttft_p90_s'], '>8.2f')}s "
                  f"{fmt(r['e2e_p50_s'], '>7.2f')}s "
                  f"{r['prefix_hit_rate'] * 100:>8.1f}% {r['speedup']:>8.0f}x")


async def _stream_one(s: aiohttp.ClientSession, url: str, body: dict[str, Any]
                      ) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            if ttft is None and obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
    # No content streamed: no TTFT (None), which is not a zero TTFT.
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "usage": usage}


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def _live_demo() -> None:
    print("\n== Live: 4 replica processes (emulated L4, real time) behind skymesh-lb ==")
    replicas = [start_daemon("skymesh-replica", ["--port", "0", "--seed", str(i)])
                for i in range(4)]
    lb = None
    try:
        lb = start_daemon("skymesh-lb", ["--port", "0", "--policy", "prefix-tree",
                                         "--region", "demo",
                                         "--replicas", ",".join(r.url for r in replicas)])
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            deadline = time.monotonic() + 30
            while True:
                async with s.get(lb.url + "/ready") as r:
                    if r.status == 200 and (await r.json())["healthy_replicas"] == 4:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("the balancer did not see its replicas in time")
                await asyncio.sleep(0.05)
            # Four "documents", each shared by six questions: prefix-aware routing keeps
            # each document's KV cache on one replica.
            docs = [f"Document {d}: " + " ".join(f"fact-{d}-{k} is true." for k in range(60))
                    for d in range(4)]
            bodies = [{"model": "meta-llama/Llama-3.1-8B-Instruct", "stream": True,
                       "max_tokens": 16, "stream_options": {"include_usage": True},
                       "messages": [{"role": "system", "content": docs[i % 4]},
                                    {"role": "user", "content": f"Question {i}?"}]}
                      for i in range(24)]
            first = await asyncio.gather(*(_stream_one(s, lb.url, b) for b in bodies[:4]))
            rest = await asyncio.gather(*(_stream_one(s, lb.url, b) for b in bodies[4:]))
            results = [*first, *rest]
            ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
            counts = []
            hits = queries = 0.0
            for rep in replicas:
                async with s.get(rep.url + "/metrics") as r:
                    text = await r.text()
                counts.append(int(_metric(text, "vllm:request_success_total")))
                hits += _metric(text, "vllm:prefix_cache_hits_total")
                queries += _metric(text, "vllm:prefix_cache_queries_total")
        print(f"  balancer {lb.url} (policy prefix-tree, selective pushing on pending)")
        print(f"  {len(results)} streamed requests, 4 documents x 6 questions")
        print(f"  requests per replica: {counts}")
        print(f"  prefix-cache hit rate on the replicas: {hits / max(queries, 1) * 100:.1f}%")
        p50, p90 = percentiles(ttfts, (50, 90))
        print(f"  TTFT through the balancer: p50 {fmt(p50, '.0f', 1000)} ms, "
              f"p90 {fmt(p90, '.0f', 1000)} ms")
    finally:
        for d in [lb, *replicas]:
            if d is not None:
                d.stop()


def main() -> int:
    t0 = time.perf_counter()
    _sim_table()
    asyncio.run(_live_demo())
    print()
    from skymesh_lab.demos.meshdemo import run_demo

    run_demo(duration=15.0)
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s. Next: `skymesh sim --help`, "
          "`skymesh-replica --list-profiles`, README.md.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
