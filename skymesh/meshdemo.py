"""``skymesh demo``: the local three-region mesh, run for real.

Three regions (us, eu, asia) on this machine, each a ``skymesh-lb`` with its own emulated
replicas (real processes, real time). Balancers peer over mTLS gRPC (certificates made
for the run by ``skymesh.mesh.certs``); every inter-region link goes through a
:class:`~skymesh.netproxy.DelayProxy` adding half the link's round-trip time each way
(us-eu 75 ms, us-asia 160 ms, eu-asia 225 ms, as in the simulator). Clients are skewed
toward us, whose replicas are too few for its load: the moment SkyMesh exists for. The
same load runs twice, with forwarding (the mesh) and without (region-local), and the demo
prints per-region served and forwarded counts, TTFT percentiles and throughput.

The mesh run also has a ``skymesh-controller`` (embedded in-memory store): balancers
register with it and take their membership from it. At the end the demo kills lb-us and
shows the controller handing its replica to the nearest live balancer (lb-eu).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from skymesh.netproxy import DelayProxy
from skymesh.procs import Daemon, start_daemon
from skymesh.sim.network import Network

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REGIONS = ("us", "eu", "asia")
REPLICAS = {"us": 1, "eu": 2, "asia": 2}
CLIENTS = {"us": 16, "eu": 2, "asia": 2}
LOCATIONS = {"us": (38.9, -77.0), "eu": (53.3, -6.3), "asia": (35.7, 139.7)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Mesh:
    def __init__(self, workdir: Path, forwarding: bool, controller: bool = False) -> None:
        self.dir = workdir
        self.forwarding = forwarding
        self.token = secrets.token_hex(16)
        self.controller: Daemon | None = None
        self.want_controller = controller
        self.daemons: list[Daemon] = []
        self.proxies: list[DelayProxy] = []
        self.lbs: dict[str, Daemon] = {}
        self.replicas: dict[str, list[Daemon]] = {}

    async def start(self) -> None:
        from skymesh.mesh import certs

        pki = self.dir / "pki"
        if not (pki / "ca.crt").exists():
            certs.create_ca(pki)
            for r in REGIONS:
                certs.issue_cert(pki, f"lb-{r}")
        if self.want_controller:
            await self._start_controller()
        grpc_ports = {r: _free_port() for r in REGIONS}
        net = Network()
        links: dict[tuple[str, str], str] = {}
        for a in REGIONS:
            for b in REGIONS:
                if a != b:  # a's channel to b goes through its own delayed link
                    proxy = DelayProxy("127.0.0.1", grpc_ports[b], net.one_way(a, b))
                    await proxy.start()
                    self.proxies.append(proxy)
                    links[(a, b)] = proxy.address
        for r in REGIONS:
            reps = [start_daemon("skymesh-replica", ["--port", "0", "--seed", str(i)],
                                 log_path=self.dir / f"{r}-replica{i}.log")
                    for i in range(REPLICAS[r])]
            self.daemons.extend(reps)
            self.replicas[r] = reps
            cfg: dict[str, Any] = {
                "region": r, "listen": {"port": 0},
                "replicas": [{"url": d.url, "models": [MODEL], "gpu": "L4"} for d in reps],
                "mesh": {"id": f"lb-{r}", "certs_dir": str(pki),
                         "listen_port": grpc_ports[r], "forwarding": self.forwarding,
                         "peers": [{"id": f"lb-{o}", "address": links[(r, o)]}
                                   for o in REGIONS if o != r]},
            }
            if self.controller is not None:
                # Peers stay as configured: each link runs through its own delay proxy.
                cfg["controller"] = {"url": self.controller.url, "balancer_id": f"lb-{r}",
                                     "follow_peers": False, "retry_s": 0.2,
                                     "telemetry_interval_s": 1.0}
            path = self.dir / f"lb-{r}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            lb = start_daemon("skymesh-lb", ["--config", str(path)],
                              log_path=self.dir / f"lb-{r}.log",
                              env={**os.environ, "SKYMESH_AGENT_TOKEN": self.token})
            self.daemons.append(lb)
            self.lbs[r] = lb

    async def _start_controller(self) -> None:
        ctl = start_daemon("skymesh-controller",
                           ["--port", "0", "--store", "memory", "--probe-interval", "0.3"],
                           log_path=self.dir / "controller.log",
                           env={**os.environ, "SKYMESH_ADMIN_TOKEN": self.token})
        self.daemons.append(ctl)
        self.controller = ctl
        async with aiohttp.ClientSession(headers=self.auth) as s:
            for r, (lat, lon) in LOCATIONS.items():
                async with s.post(ctl.url + "/v1/regions",
                                  json={"name": r, "latitude": lat, "longitude": lon}) as resp:
                    resp.raise_for_status()

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    async def failover(self, s: aiohttp.ClientSession, timeout: float = 30) -> dict[str, Any]:
        """Kill lb-us; time until the controller has its replicas served elsewhere."""
        assert self.controller is not None
        urls = {d.url for d in self.replicas["us"]}
        self.lbs["us"].kill()
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            async with s.get(self.controller.url + "/v1/replicas", headers=self.auth) as r:
                reps = [x for x in await r.json() if x["url"] in urls]
            takers = {x["assigned"] for x in reps}
            if len(takers) == 1 and (taker := takers.pop()) not in (None, "lb-us"):
                lb = self.lbs[taker.removeprefix("lb-")]
                async with s.get(lb.url + "/status") as r:
                    serving = set((await r.json())["replicas"])
                if urls <= serving:
                    return {"killed": "lb-us", "moved_to": taker,
                            "seconds": time.monotonic() - t0}
            await asyncio.sleep(0.05)
        raise RuntimeError("the controller did not move lb-us's replicas in time")

    async def controller_status(self, s: aiohttp.ClientSession) -> dict[str, Any]:
        assert self.controller is not None
        async with s.get(self.controller.url + "/v1/status", headers=self.auth) as r:
            st: dict[str, Any] = await r.json()
        return st

    async def wait_ready(self, s: aiohttp.ClientSession, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok = True
            for lb in self.lbs.values():
                async with s.get(lb.url + "/status") as r:
                    st = await r.json()
                if not all(p["liveness"] == "alive" for p in st["mesh"]["peers"]) or \
                        not all(rep["healthy"] for rep in st["replicas"].values()):
                    ok = False
            if ok:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("the mesh did not come up in time")

    async def stop(self) -> None:
        for d in self.daemons:
            d.stop()
        for p in self.proxies:
            await p.stop()


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
            served = 0.0
            for rep in mesh.replicas[r]:
                async with s.get(rep.url + "/metrics") as resp:
                    text = await resp.text()
                served += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                              if line.startswith("vllm:request_success_total{"))
            async with s.get(lb.url + "/status") as resp:
                st = await resp.json()
            regions[r] = {"served": int(served), "forwarded_out": st["mesh"]["forwarded_out"],
                          "forwarded_in": st["mesh"]["forwarded_in"]}
    arr = np.asarray(ttfts) if ttfts else np.zeros(1)
    return {"throughput_rps": in_window / duration, "ttft_p50_s": float(np.percentile(arr, 50)),
            "ttft_p90_s": float(np.percentile(arr, 90)), "completed": len(done),
            "regions": regions}


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
              f"{r['ttft_p50_s'] * 1000:6.0f} ms  p90 {r['ttft_p90_s'] * 1000:6.0f} ms")
        for region, st in r["regions"].items():
            print(f"    {region:<5} served {st['served']:>4}  forwarded out "
                  f"{st['forwarded_out']:>4}  in {st['forwarded_in']:>4}")
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
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
    return 0
