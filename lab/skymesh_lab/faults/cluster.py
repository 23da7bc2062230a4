"""Real SkyMesh processes on loopback, started the way an operator would start them.

Shared by the fault scenarios, the soak, the demo (:class:`Mesh`, factored out of
``skymesh_lab.demos.meshdemo``) and the hardening tests: replicas, a balancer from a YAML config, a
controller (embedded or Redis store), a restartable ``redis-server``, and the
three-region mesh with mTLS certificates and one :class:`~skymesh_lab.netproxy.DelayProxy`
per inter-region link. Daemons are started off the event loop (``start_daemon`` polls
its log synchronously) so that clients already running keep being served while a daemon
(re)starts.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import select
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import aiohttp
import yaml

from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_lab.netproxy import DelayProxy

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REGIONS = ("us", "eu", "asia")
DEFAULT_REPLICAS = {"us": 1, "eu": 2, "asia": 2}
LOCATIONS = {"us": (38.9, -77.0), "eu": (53.3, -6.3), "asia": (35.7, 139.7)}
POLL_S = 0.02  # polling cadence while waiting for a condition (not a wait for it)


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{"name{labels}": value}`` plus ``{"name": sum over labels}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        out[series] = float(value)
        if "{" in series:
            name = series.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def metrics(s: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with s.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
        r.raise_for_status()
        return parse_metrics(await r.text())


async def status(s: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with s.get(base + "/status", timeout=aiohttp.ClientTimeout(total=5)) as r:
        r.raise_for_status()
        out: dict[str, Any] = await r.json()
        return out


async def wait_for(cond: Any, what: str, timeout: float) -> None:
    """Await ``cond()`` (an async predicate; errors count as False) until it holds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await cond():
                return
        except (aiohttp.ClientError, OSError, TimeoutError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(POLL_S)


async def drained(s: aiohttp.ClientSession, base: str) -> bool:
    """Nothing queued and nothing in flight at the balancer ``base``."""
    st = await status(s, base)
    return st["queued"] == 0 and all(r["in_flight"] == 0 for r in st["replicas"].values())


async def healthy_replicas(s: aiohttp.ClientSession, base: str) -> int:
    st = await status(s, base)
    return sum(1 for r in st["replicas"].values() if r["healthy"])


async def start_replicas(workdir: Path, n: int, *, time_scale: float | None = None,
                         name: str = "replica", extra: list[str] | None = None
                         ) -> list[Daemon]:
    args = ["--port", "0", *(extra or [])]
    if time_scale is not None:
        args += ["--time-scale", str(time_scale)]
    return list(await asyncio.gather(*(
        asyncio.to_thread(start_daemon, "skymesh-replica", [*args, "--seed", str(i)],
                          log_path=workdir / f"{name}{i}.log") for i in range(n))))


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


async def start_lb(workdir: Path, replicas: list[Daemon], *, name: str = "lb", port: int = 0,
                   overrides: Mapping[str, Any] | None = None, log_level: str = "warning",
                   env: Mapping[str, str] | None = None) -> Daemon:
    """``skymesh-lb --config`` with least-load, fast probes and ``overrides`` merged in."""
    cfg: dict[str, Any] = {
        # One process: the scenarios measure it (RSS, exact counters) and kill it by pid.
        "region": "local", "listen": {"host": "127.0.0.1", "port": port, "workers": 1},
        "policy": {"name": "least-load"}, "probe": {"interval_s": 0.05},
        "replicas": [{"url": r.url, "models": [MODEL], "gpu": "L4"} for r in replicas],
    }
    _merge(cfg, overrides or {})
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return await asyncio.to_thread(
        start_daemon, "skymesh-lb", ["--config", str(path), "--log-level", log_level],
        log_path=workdir / f"{name}.log", env={**os.environ, **(env or {})})


async def start_controller(workdir: Path, token: str, *, store: str = "memory",
                           port: int = 0, log_level: str = "warning", name: str = "controller",
                           probe_interval: float = 0.3) -> Daemon:
    return await asyncio.to_thread(
        start_daemon, "skymesh-controller",
        ["--port", str(port), "--store", store, "--probe-interval", str(probe_interval),
         "--log-level", log_level],
        log_path=workdir / f"{name}.log", env={**os.environ, "SKYMESH_ADMIN_TOKEN": token})


class RedisProcess:
    """``redis-server`` with AOF on (state survives a restart), restartable on its port."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run `make system-deps`")
        self.exe, self.dir, self.port = exe, workdir, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        # The server says when it is ready on its log: wait for that line (with a deadline)
        # rather than polling the port, then keep draining the log so it never blocks.
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--protected-mode", "no", "--logfile", ""],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            bufsize=0)  # unbuffered: select() must see every line the server writes
        assert self.proc.stdout is not None
        out = self.proc.stdout
        deadline = time.monotonic() + timeout
        seen: list[bytes] = []
        while True:
            ready, _, _ = select.select([out], [], [], max(deadline - time.monotonic(), 0))
            line = out.readline() if ready else b""
            if not line:
                raise RuntimeError("redis-server did not start: "
                                   + b"".join(seen[-5:]).decode(errors="replace"))
            seen.append(line)
            if b"Ready to accept connections" in line:
                break
        threading.Thread(target=_drain, args=(out,), daemon=True).start()

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(10)

    def restart(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()


def _drain(stream: IO[bytes]) -> None:
    for _ in stream:
        pass


class Mesh:
    """The three-region mesh: per region a ``skymesh-lb`` with its own replicas, peering
    over mTLS gRPC through one delay proxy per direction of every inter-region link
    (half the simulator's RTT each way), optionally under a ``skymesh-controller``."""

    def __init__(self, workdir: Path, forwarding: bool, controller: bool = False, *,
                 replicas: Mapping[str, int] | None = None, time_scale: float | None = None,
                 log_level: str = "warning", lb_overrides: Mapping[str, Any] | None = None,
                 token: str | None = None, replica_args: tuple[str, ...] = ()) -> None:
        self.dir = workdir
        self.forwarding = forwarding
        self.token = token or secrets.token_hex(16)
        self.controller: Daemon | None = None
        self.want_controller = controller
        self.replica_counts = dict(replicas or DEFAULT_REPLICAS)
        self.time_scale = time_scale
        self.log_level = log_level
        self.lb_overrides = dict(lb_overrides or {})
        self.replica_args = replica_args  # extra skymesh-replica flags, e.g. --scheduler
        self.daemons: list[Daemon] = []
        self.proxies: list[DelayProxy] = []
        self.links: dict[tuple[str, str], DelayProxy] = {}  # (from, to) -> its proxy
        self.lbs: dict[str, Daemon] = {}
        self.replicas: dict[str, list[Daemon]] = {}

    async def start(self) -> None:
        from skymesh.mesh import certs
        from skymesh_lab.sim.network import Network

        pki = self.dir / "pki"
        if not (pki / "ca.crt").exists():
            certs.create_ca(pki)
            for r in REGIONS:
                certs.issue_cert(pki, f"lb-{r}")
        if self.want_controller:
            await self._start_controller()
        grpc_ports = {r: free_port() for r in REGIONS}
        net = Network()
        for a in REGIONS:
            for b in REGIONS:
                if a != b:  # a's channel to b goes through its own delayed link
                    proxy = DelayProxy("127.0.0.1", grpc_ports[b], net.one_way(a, b))
                    await proxy.start()
                    self.proxies.append(proxy)
                    self.links[(a, b)] = proxy
        extra = ["--log-level", self.log_level, *self.replica_args]
        for r in REGIONS:
            reps = await start_replicas(self.dir, self.replica_counts[r],
                                        time_scale=self.time_scale, name=f"{r}-replica",
                                        extra=extra)
            self.daemons.extend(reps)
            self.replicas[r] = reps
            overrides: dict[str, Any] = {
                "region": r, "policy": {"name": "prefix-tree"},
                "probe": {"interval_s": 0.1},
                "mesh": {"id": f"lb-{r}", "certs_dir": str(pki),
                         "listen_port": grpc_ports[r], "forwarding": self.forwarding,
                         "peers": [{"id": f"lb-{o}", "address": self.links[(r, o)].address}
                                   for o in REGIONS if o != r]},
            }
            if self.controller is not None:
                # Peers stay as configured: each link runs through its own delay proxy.
                overrides["controller"] = {
                    "url": self.controller.url, "balancer_id": f"lb-{r}",
                    "follow_peers": False, "retry_s": 0.2, "telemetry_interval_s": 1.0,
                    "url_policy": {"allow_loopback": True}}  # a local mesh
            _merge(overrides, self.lb_overrides)
            lb = await start_lb(self.dir, reps, name=f"lb-{r}", overrides=overrides,
                                log_level=self.log_level,
                                env={"SKYMESH_AGENT_TOKEN": self.token})
            self.daemons.append(lb)
            self.lbs[r] = lb

    async def _start_controller(self) -> None:
        ctl = await start_controller(self.dir, self.token, log_level=self.log_level)
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

    def partition(self, a: str, b: str, on: bool = True) -> None:
        """Black-hole (or heal) both directions of the a-b link."""
        self.links[(a, b)].blackhole = on
        self.links[(b, a)].blackhole = on

    async def failover(self, s: aiohttp.ClientSession, timeout: float = 30) -> dict[str, Any]:
        """Kill lb-us; time until the controller has its replicas served elsewhere."""
        assert self.controller is not None
        urls = {d.url for d in self.replicas["us"]}
        self.lbs["us"].kill()
        t0 = time.monotonic()
        deadline = t0 + timeout
        reps: list[dict[str, Any]] = []
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
        raise RuntimeError(f"the controller did not move lb-us's replicas within {timeout} s; "
                           f"its view of them: {reps}")

    async def controller_status(self, s: aiohttp.ClientSession) -> dict[str, Any]:
        assert self.controller is not None
        async with s.get(self.controller.url + "/v1/status", headers=self.auth) as r:
            st: dict[str, Any] = await r.json()
        return st

    async def peers_alive(self, s: aiohttp.ClientSession) -> bool:
        for lb in self.lbs.values():
            st = await status(s, lb.url)
            if not all(p["liveness"] == "alive" for p in st["mesh"]["peers"]) or \
                    not all(rep["healthy"] for rep in st["replicas"].values()):
                return False
        return True

    async def wait_ready(self, s: aiohttp.ClientSession, timeout: float = 30) -> None:
        try:
            await wait_for(lambda: self.peers_alive(s), "the mesh to come up", timeout)
        except TimeoutError as exc:
            raise RuntimeError("the mesh did not come up in time") from exc

    async def stop(self) -> None:
        for d in self.daemons:
            await asyncio.to_thread(d.stop)
        for p in self.proxies:
            await p.stop()
