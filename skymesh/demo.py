"""``make demo``: what the lab can do today, in about a minute.

1. A short simulated comparison: SkyLB's selective-pushing microbenchmark in miniature
   (one region, 4 L4 replicas, tree-of-thoughts clients), blind pushing vs selective
   pushing, with the load-only policies.
2. A real ``skymesh-replica`` process on loopback answering a few streamed chat requests,
   with what its ``/metrics`` reports afterwards (prefix-cache hits included).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp

from skymesh.sim.runner import SimConfig, run


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
                  f"{r['ttft_p50_s']:>8.2f}s {r['ttft_p90_s']:>8.2f}s {r['e2e_p50_s']:>7.2f}s "
                  f"{r['prefix_hit_rate'] * 100:>8.1f}% {r['speedup']:>8.0f}x")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"skymesh-replica exited with {proc.returncode}")
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError("skymesh-replica did not become healthy")


async def _stream_one(s: aiohttp.ClientSession, url: str, question: str) -> dict[str, Any]:
    body = {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [
            {"role": "system", "content": "You are a careful math tutor. " * 40},
            {"role": "user", "content": question},
        ],
        "max_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
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
            if obj.get("choices") and obj["choices"][0].get("delta", {}).get("content"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return {"ttft": ttft or 0.0, "e2e": time.perf_counter() - t0, "chunks": chunks,
            "usage": usage}


async def _replica_demo() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    exe = os.path.join(os.path.dirname(sys.executable), "skymesh-replica")
    proc = subprocess.Popen([exe, "--port", str(port), "--profile", "llama3.1-8b-l4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await _wait_healthy(url, proc, 30.0)
        print(f"\n== Real replica process on {url} (emulated L4, real time) ==")
        questions = ["What is 17 * 23?", "What is 12 squared?", "Is 91 prime?"]
        async with aiohttp.ClientSession() as s:
            first = await _stream_one(s, url, questions[0])
            rest = await asyncio.gather(*(_stream_one(s, url, q) for q in questions[1:]))
            for q, res in zip(questions, [first, *rest], strict=True):
                cached = res["usage"].get("prompt_tokens_details", {}) or {}
                print(f"  {q:<22} TTFT {res['ttft'] * 1000:6.0f} ms  E2E {res['e2e']:5.2f} s  "
                      f"{res['chunks']:>2} streamed chunks  prompt "
                      f"{res['usage'].get('prompt_tokens', '?')} tokens, "
                      f"{cached.get('cached_tokens', 0)} from the prefix cache")
            async with s.get(url + "/metrics") as r:
                text = await r.text()
        keep = ("vllm:num_requests_waiting{", "vllm:num_requests_running{",
                "vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{")
        print("  /metrics after the run:")
        for line in text.splitlines():
            if line.startswith(keep):
                print("    " + line)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    t0 = time.perf_counter()
    _sim_table()
    asyncio.run(_replica_demo())
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s. Next: `skymesh sim --help`, "
          "`skymesh-replica --list-profiles`, README.md.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
