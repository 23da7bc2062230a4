"""Real vLLM servers and skymesh-lb on loopback, for the e2e suite and the burst benchmark.

Each vLLM server is ``python -m vllm.entrypoints.openai.api_server`` from the lane's venv
(``build_env.py``), serving the tiny model as ``tiny`` with ``--max-num-seqs 4`` and
``--max-model-len 2048``, 1 GiB of KV cache, its OpenMP threads bound to one core (server
i to core i mod nproc) so two servers do not fight over the same core. Readiness is
``/health`` answering 200, waited on with a deadline: start-up is 30-50 s on an idle
machine (torch.compile) and minutes on a loaded one. The balancer is the project venv's
``skymesh-lb`` (the interpreter running this code), started with the contract's
quick-start flags, or with a config file for settings the flags do not reach.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skymesh.util.procs import Daemon, free_port, start_daemon

E2E_ENV_VAR = "SKYMESH_E2E_ENV"
MODEL_NAME = "tiny"
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 2048
# Logs and results of the lane's runs (gitignored ``out/``).
OUT_DIR = Path(__file__).resolve().parents[2] / "out" / "e2e"


@dataclass(frozen=True)
class E2EEnv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.root / "model"


def e2e_env() -> E2EEnv | None:
    """The built env named by ``$SKYMESH_E2E_ENV``, or None when unset or not built."""
    raw = os.environ.get(E2E_ENV_VAR)
    if not raw:
        return None
    env = E2EEnv(Path(raw))
    if not (env.python.exists() and (env.model / "config.json").exists()):
        return None
    return env


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, TimeoutError):
        return 0, b""


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class VllmServer:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to the server and its engine process: a crash, not a shutdown."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 20.0) -> None:
        # vLLM runs its engine core in a child process of its own session; signal the
        # whole group so no engine outlives its API server.
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_vllm(env: E2EEnv, port: int, core: int, log_path: Path) -> VllmServer:
    cmd = [str(env.python), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(env.model), "--served-model-name", MODEL_NAME,
           "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
           "--dtype", "bfloat16"]
    penv = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1)),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=penv,
                                start_new_session=True)
    return VllmServer(proc, f"http://127.0.0.1:{port}", log_path)


def wait_healthy(servers: list[VllmServer], deadline_s: float) -> float:
    """Wait until every server's ``/health`` is 200; returns the seconds it took. Raises
    with the log tail of a server that exited or was still not ready at the deadline."""
    t0 = time.monotonic()
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive():
                raise RuntimeError(f"vLLM at {s.url} exited ({s.proc.returncode}) while "
                                   f"starting:\n{tail(s.log_path)}")
            if http_get(s.url + "/health", timeout=2.0)[0] == 200:
                pending.remove(s)
        if pending and time.monotonic() - t0 > deadline_s:
            raise RuntimeError(f"vLLM at {pending[0].url} not healthy after {deadline_s} s:\n"
                               f"{tail(pending[0].log_path)}")
        if pending:
            time.sleep(0.5)  # polling cadence of the readiness check
    return time.monotonic() - t0


def start_lb(replicas: list[str], log_path: Path, push_mode: str = "sp-p",
             config: dict[str, Any] | None = None, port: int = 0,
             policy: str = "least-load") -> Daemon:
    """skymesh-lb in front of ``replicas``: the quick-start flags, plus ``config`` (written
    next to the log) for what the flags do not reach (``pushing.max_outstanding``).
    ``port`` 0: any free one."""
    args = ["--port", str(port), "--replicas", ",".join(replicas), "--policy", policy,
            "--region", "us", "--push-mode", push_mode]
    if config:
        cfg_path = log_path.with_suffix(".json")  # JSON is YAML: the config loader reads it
        cfg_path.write_text(json.dumps({**config, "replicas": [{"url": u} for u in replicas]}))
        args = ["--config", str(cfg_path), *args]
    return start_daemon("skymesh-lb", args, log_path=log_path)


def wait_lb_ready(lb: Daemon, replicas: int, deadline_s: float = 60.0) -> None:
    """Until the balancer sees every replica healthy and lists the served model."""
    t0 = time.monotonic()
    while True:
        status, body = http_get(lb.url + "/ready")
        ready = status == 200 and json.loads(body).get("healthy_replicas") == replicas
        if ready:
            status, body = http_get(lb.url + "/v1/models")
            ids = [m.get("id") for m in json.loads(body).get("data", [])] if status == 200 else []
            if MODEL_NAME in ids:
                return
        if not lb.alive():
            raise RuntimeError(f"skymesh-lb exited:\n{lb.log()[-4000:]}")
        if time.monotonic() - t0 > deadline_s:
            raise RuntimeError(f"skymesh-lb not ready after {deadline_s} s (last /ready "
                               f"{status}):\n{lb.log()[-4000:]}")
        time.sleep(0.1)  # polling cadence


@dataclass
class Cluster:
    servers: list[VllmServer]
    lb: Daemon
    out_dir: Path
    start_s: float = 0.0  # seconds the servers took to become healthy

    @property
    def replica_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def log_tails(self, lines: int = 30) -> dict[str, str]:
        tails = {s.log_path.name: tail(s.log_path, lines) for s in self.servers}
        tails[self.lb.log_path.name] = tail(self.lb.log_path, lines)
        return tails

    def stop(self) -> None:
        self.lb.stop()
        for s in self.servers:
            s.stop()


def start_servers(env: E2EEnv, out_dir: Path, n: int = 2,
                  deadline_s: float = 600.0) -> tuple[list[VllmServer], float]:
    servers = [start_vllm(env, free_port(), i, out_dir / f"vllm-{i}.log") for i in range(n)]
    try:
        took = wait_healthy(servers, deadline_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers, took


def start_cluster(env: E2EEnv, out_dir: Path, deadline_s: float = 600.0,
                  push_mode: str = "sp-p") -> Cluster:
    servers, took = start_servers(env, out_dir, deadline_s=deadline_s)
    try:
        lb = start_lb([s.url for s in servers], out_dir / "skymesh-lb.log", push_mode)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    try:
        wait_lb_ready(lb, len(servers))
    except BaseException:
        lb.stop()
        for s in servers:
            s.stop()
        raise
    return Cluster(servers, lb, out_dir, start_s=took)
