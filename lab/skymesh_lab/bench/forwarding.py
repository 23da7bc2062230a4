"""Round trips a forwarded request costs, measured on real processes.

Two regions on this machine: ``a`` has a balancer and no replicas, ``b`` a balancer and one
emulated replica; the link between them is a delay proxy adding ``delay`` each way. The
same short request is sent straight to ``b``'s balancer (served locally) and to ``a``'s
(forwarded to ``b``): the difference in time to first byte, divided by the link's round
trip, is the number of round trips forwarding adds. One is the forwarding call itself
(request out, first chunk back); the target is nothing beyond it, which needs the peer
channel to be persistent: the proxy also counts the TCP connections opened while the
requests run (target: none).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from skymesh.util.jsonio import write_json
from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh.util.stats import percentile
from skymesh_lab.netproxy import DelayProxy

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


async def _ttft(s: aiohttp.ClientSession, url: str, i: int) -> float:
    body = {"model": MODEL, "stream": True, "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"ping {i}"}]}
    t0 = time.monotonic()
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for _ in r.content:
            t = time.monotonic() - t0
            await r.read()
            return t
    raise RuntimeError("empty response")


async def _run(delay: float, n: int) -> dict[str, Any]:
    from skymesh.mesh import certs

    daemons: list[Daemon] = []
    proxies: list[DelayProxy] = []
    with tempfile.TemporaryDirectory(prefix="skymesh-fwd-") as tmp:
        d = Path(tmp)
        certs.create_ca(d)
        for name in ("lb-a", "lb-b"):
            certs.issue_cert(d, name)
        ports = {"a": free_port(), "b": free_port()}
        links = {}
        for src, dst in (("a", "b"), ("b", "a")):
            p = DelayProxy("127.0.0.1", ports[dst], delay)
            await p.start()
            proxies.append(p)
            links[src] = p.address
        try:
            rep = start_daemon("skymesh-replica", ["--port", "0", "--profile",
                                                   "llama3.1-8b-h100", "--time-scale", "0.1"])
            daemons.append(rep)
            lbs = {}
            for r, other in (("a", "b"), ("b", "a")):
                cfg = {"region": r, "listen": {"port": 0},
                       "replicas": [{"url": rep.url}] if r == "b" else [],
                       "mesh": {"id": f"lb-{r}", "certs_dir": str(d),
                                "listen_port": ports[r], "heartbeat_interval_s": 0.1,
                                "peers": [{"id": f"lb-{other}", "address": links[r]}]}}
                (d / f"{r}.yaml").write_text(yaml.safe_dump(cfg))
                lbs[r] = start_daemon("skymesh-lb", ["--config", str(d / f"{r}.yaml")])
                daemons.append(lbs[r])
            async with aiohttp.ClientSession() as s:
                deadline = time.monotonic() + 30
                while True:
                    async with s.get(lbs["a"].url + "/status") as resp:
                        st = await resp.json()
                    if st["mesh"]["peers"][0]["liveness"] == "alive":
                        try:
                            await _ttft(s, lbs["a"].url, -1)  # warm both paths
                            await _ttft(s, lbs["b"].url, -1)
                            break
                        except aiohttp.ClientResponseError:
                            pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("the two balancers did not peer in time")
                    await asyncio.sleep(0.1)
                conns_before = sum(p.connections for p in proxies)
                local, forwarded = [], []
                for i in range(n):  # alternate so drift hits both paths alike
                    local.append(await _ttft(s, lbs["b"].url, i))
                    forwarded.append(await _ttft(s, lbs["a"].url, i))
                new_conns = sum(p.connections for p in proxies) - conns_before
        finally:
            for dm in daemons:
                dm.stop()
            for p in proxies:
                await p.stop()
    rtt = 2 * delay
    local_p50, fwd_p50 = percentile(local, 50), percentile(forwarded, 50)
    if local_p50 is None or fwd_p50 is None:
        raise ValueError("no requests measured (--requests must be at least 1)")
    return {"link_rtt_s": rtt, "requests": n,
            "ttft_local_p50_s": local_p50, "ttft_forwarded_p50_s": fwd_p50,
            "extra_round_trips": (fwd_p50 - local_p50) / rtt, "new_connections": new_conns}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.forwarding",
                                 description=__doc__)
    ap.add_argument("--delay", type=float, default=0.04, help="one-way link delay, s")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res = asyncio.run(_run(args.delay, args.requests))
    print(f"link RTT {res['link_rtt_s'] * 1000:.0f} ms; TTFT p50 local "
          f"{res['ttft_local_p50_s'] * 1000:.1f} ms, forwarded "
          f"{res['ttft_forwarded_p50_s'] * 1000:.1f} ms: forwarding adds "
          f"{res['extra_round_trips']:.2f} round trips (1 is the forwarding call itself; "
          f"target: no more); new TCP connections during the run: {res['new_connections']} "
          "(target 0)")
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
