"""``skymesh demo``: the local three-region mesh, run for real.

Three regions (us, eu, asia) on this machine, each a ``skymesh-lb`` with its own emulated
replicas (real processes, real time). Balancers peer over mTLS gRPC (certificates made
for the run by ``skymesh.mesh.certs``); every inter-region link goes through a
:class:`~skymesh_lab.netproxy.DelayProxy` adding half the link's round-trip time each way
(us-eu 75 ms, us-asia 160 ms, eu-asia 225 ms, as in the simulator). Clients are skewed
toward us, whose replicas are too few for its load: the moment SkyMesh exists for. The
same load runs twice, with forwarding (the mesh) and without (region-local), and the demo
prints per-region finished requests and generated tokens (on the region's replicas),
forwarded counts, TTFT percentiles and throughput.

The mesh run also has a ``skymesh-controller`` (embedded in-memory store): balancers
register with it and take their membership from it. At the end the demo kills lb-us and
shows the controller handing its replica to the nearest live balancer (lb-eu).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.util.jsonio import write_json
from skymesh.util.stats import fmt, percentiles
from skymesh_lab.faults.cluster import DEFAULT_REPLICAS, MODEL, REGIONS, Mesh

REPLICAS = DEFAULT_REPLICAS
CLIENTS = {"us": 16, "eu": 2, "asia": 2}


async def _client(s: aiohttp.ClientSession, url: str, rng: random.Random, stop_at: float,
                  ttfts: list[float], done: list[float]) -> None:
    doc = " ".join(f"clause-{rng.randrange(50)}" for _ in range(400))
    while time.monotonic() < stop_at:
        body = {"model": MODEL, "stream": True, "max_tokens": 48, "ignore_eos": True,
                "messages": [{"role": "system", "content": doc},
                             {"role": "user", "content": f"Summarise part {rng.random()}"}]}
        t0 = time.monotonic()
        first: float | None = None
        try:
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    await r.read()
                    continue
                async for _line in r.content:
                    if first is None:
                        # Counted at the first byte, so a request cut off by the end of
                        # the window still counts: no survivorship bias toward the
                        # regions that finished.
                        first = time.monotonic() - t0
                        ttfts.append(first)
                done.append(time.monotonic())
        except aiohttp.ClientError:
            continue


async def _run_load(mesh: Mesh, duration: float, seed: int) -> dict[str, Any]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await mesh.wait_ready(s)
        rng = random.Random(seed)
        ttfts: list[float] = []
        done: list[float] = []
        t0 = time.monotonic()
        stop_at = t0 + duration
        tasks = [asyncio.create_task(
            _client(s, mesh.lbs[r].url, random.Random(rng.random()), stop_at, ttfts, done))
            for r in REGIONS for _ in range(CLIENTS[r])]
        # At the end of the window the clients hang up: requests still in flight are
        # cancelled (and cancelled upstream), not waited for.
        _, pending = await asyncio.wait(tasks, timeout=duration)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # Throughput over the load window only: the requests still queued at its end
        # drain afterwards, and counting that tail would reward the slower system.
        in_window = sum(1 for t in done if t <= stop_at)
        regions: dict[str, dict[str, int]] = {}
        for r, lb in mesh.lbs.items():
            served = tokens = 0.0
            for rep in mesh.replicas[r]:
                async with s.get(rep.url + "/metrics") as resp:
                    text = await resp.text()
                for line in text.splitlines():
                    if line.startswith("vllm:request_success_total{"):
                        served += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:generation_tokens_total"):
                        tokens += float(line.rsplit(" ", 1)[1])
            async with s.get(lb.url + "/status") as resp:
                st = await resp.json()
            # Tokens too: a region whose few replicas carry long requests may finish none
            # inside a short window while generating all along.
            regions[r] = {"served": int(served), "tokens": int(tokens),
                          "forwarded_out": st["mesh"]["forwarded_out"],
                          "forwarded_in": st["mesh"]["forwarded_in"]}
    p50, p90 = percentiles(ttfts, (50, 90))
    return {"throughput_rps": in_window / duration, "ttft_p50_s": p50, "ttft_p90_s": p90,
            "completed": len(done), "regions": regions}


async def _demo(duration: float, seed: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="skymesh-demo-") as tmp:
        for name, forwarding in (("mesh", True), ("region_local", False)):
            mesh = Mesh(Path(tmp), forwarding, controller=forwarding)
            try:
                await mesh.start()
                results[name] = await _run_load(mesh, duration, seed)
                if mesh.controller is not None:
                    async with aiohttp.ClientSession() as s:
                        st = await mesh.controller_status(s)
                        results[name]["controller"] = {
                            "balancers": st["balancers"], "replicas": st["replicas"],
                            "failover": await mesh.failover(s)}
            finally:
                await mesh.stop()
    return results


def run_demo(duration: float = 20.0, seed: int = 0, json_path: str | None = None) -> int:
    print(f"== Live three-region mesh: {REPLICAS} replicas (emulated L4), clients {CLIENTS}, "
          f"inter-region delay proxies, {duration:.0f} s per mode ==")
    res = asyncio.run(_demo(duration, seed))
    for name in ("mesh", "region_local"):
        r = res[name]
        print(f"  {name:<13} {r['throughput_rps']:6.2f} req/s  TTFT p50 "
              f"{fmt(r['ttft_p50_s'], '6.0f', 1000)} ms  p90 "
              f"{fmt(r['ttft_p90_s'], '6.0f', 1000)} ms")
        for region, st in r["regions"].items():
            print(f"    {region:<5} its replicas finished {st['served']:>3} requests, "
                  f"generated {st['tokens']:>6,} tokens; forwarded out "
                  f"{st['forwarded_out']:>3}, in {st['forwarded_in']:>3}")
        if "controller" in r:
            c = r["controller"]
            f = c["failover"]
            print(f"    controller (embedded store): balancers {c['balancers']}, replicas "
                  f"{c['replicas']}; killed {f['killed']}: its replica served by "
                  f"{f['moved_to']} after {f['seconds']:.2f} s")
    out = {"mesh": res["mesh"],
           "region_local": {k: res["region_local"][k]
                            for k in ("throughput_rps", "ttft_p50_s", "ttft_p90_s",
                                      "completed", "regions")}}
    write_json(json_path, out)
    return 0
