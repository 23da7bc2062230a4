"""Processes for the control plane's availability runs: a Redis primary with replicas and
three sentinels (``redis-server --sentinel``), and ``skymesh-controller`` processes
sharing a store with short leases. Used by ``skymesh_lab.bench.control_ha`` and the
integration tests.

Redis runs with the durability the operations page states (docs/operations-control-ha.md):
AOF fsynced on every write (``appendonly yes``, ``appendfsync always``) and
``min-replicas-to-write 1``, so the primary refuses writes no replica follows.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

import yaml

from skymesh.util.procs import Daemon, free_port, start_daemon

SERVICE = "skymesh"
DURABLE = ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]


def _redis_exe() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed: run `make system-deps`")
    return exe


def _spawn(argv: list[str], ready: bytes, timeout: float = 10.0) -> subprocess.Popen[bytes]:
    """Start a redis-server and wait for ``ready`` on its log (with a deadline); then
    keep draining the log so the server never blocks on it."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0)
    assert proc.stdout is not None
    out, seen = proc.stdout, list[bytes]()
    deadline = time.monotonic() + timeout
    while True:
        ready_fds, _, _ = select.select([out], [], [], max(deadline - time.monotonic(), 0))
        line = out.readline() if ready_fds else b""
        if not line:
            proc.kill()
            raise RuntimeError(f"{argv[1:3]} did not start: "
                               + b"".join(seen[-5:]).decode(errors="replace"))
        seen.append(line)
        if ready in line:
            break
    threading.Thread(target=_drain, args=(out,), daemon=True).start()
    return proc


def _drain(stream: IO[bytes]) -> None:
    for _ in stream:
        pass


class SentinelCluster:
    """A primary, ``replicas`` replicas and three sentinels (quorum 2) on loopback."""

    def __init__(self, workdir: Path, replicas: int = 2, down_after_ms: int = 500,
                 min_replicas_to_write: int = 1) -> None:
        self.dir, self.n_replicas = workdir, replicas
        self.down_after_ms, self.min_replicas = down_after_ms, min_replicas_to_write
        self.ports = [free_port() for _ in range(1 + replicas)]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.servers: dict[int, subprocess.Popen[bytes]] = {}
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def start(self) -> None:
        exe = _redis_exe()
        primary = self.ports[0]
        for i, port in enumerate(self.ports):
            d = self.dir / f"redis-{port}"
            d.mkdir(parents=True, exist_ok=True)
            argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                    *DURABLE, "--protected-mode", "no", "--logfile", "",
                    "--min-replicas-to-write", str(self.min_replicas),
                    "--min-replicas-max-lag", "10"]
            if i:
                argv += ["--replicaof", "127.0.0.1", str(primary)]
            self.servers[port] = _spawn(argv, b"Ready to accept connections")
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"  # a sentinel rewrites its config
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.dir}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n")
            self.sentinels.append(_spawn([exe, str(conf), "--sentinel"], b"+monitor master"))
        self.wait_replicas_online(self.n_replicas)

    def primary(self) -> int:
        """The port the sentinels name as primary."""
        import redis

        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError):
                r = redis.Redis(port=port, socket_timeout=1)
                addr = r.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
                r.close()
                if addr:
                    return int(addr[1])
        raise RuntimeError("no sentinel answered")

    def wait_replicas_online(self, n: int, timeout: float = 15.0) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                r = redis.Redis(port=self.primary(), socket_timeout=1, decode_responses=True)
                info = r.info("replication")
                r.close()
                if int(info.get("connected_slaves", 0)) >= n:
                    return
            time.sleep(0.05)  # polling cadence; the deadline bounds the wait
        raise RuntimeError(f"fewer than {n} replicas online after {timeout} s")

    def kill_primary(self) -> int:
        port = self.primary()
        proc = self.servers.pop(port)
        proc.kill()
        proc.wait()
        return port

    def wait_failover(self, old: int, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                port = self.primary()
                if port != old:
                    return port
            time.sleep(0.02)  # polling cadence; the deadline bounds the wait
        raise RuntimeError(f"no failover after {timeout} s")

    def stop(self) -> None:
        for proc in [*self.sentinels, *self.servers.values()]:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.sentinels, self.servers = [], {}


def start_controller(workdir: Path, name: str, store: str, tokens: list[dict[str, str]], *,
                     ttl_s: float = 0.6, renew_s: float = 0.2, probe_s: float = 0.1,
                     extra: dict[str, Any] | None = None,
                     env: dict[str, str] | None = None) -> Daemon:
    """A ``skymesh-controller`` named ``name`` in its lease, on ``store``."""
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0}, "tokens": tokens, "store": store,
        "url_policy": {"allow_loopback": True}, "probe": {"interval_s": probe_s},
        "ha": {"id": name, "lease_ttl_s": ttl_s, "renew_interval_s": renew_s,
               "revision_poll_s": 0.1}, **(extra or {})}))
    return start_daemon("skymesh-controller", ["--config", str(path)],
                        log_path=workdir / f"{name}.log", env=env)


def stop_all(daemons: list[Daemon]) -> None:
    """Stop every controller, waking any that a run left stopped (SIGSTOP)."""
    for d in daemons:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.proc.pid, signal.SIGCONT)
        d.stop()
