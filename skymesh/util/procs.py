"""Starting and stopping SkyMesh daemons as real processes (demo, benchmarks, tests).

Each daemon prints ``NAME listening on http://HOST:PORT`` to stderr once bound; we start
it with ``--port 0``, send its output to a log file (a pipe nobody reads would block it
once full) and read the URL from the log, with a deadline.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

_LISTENING = re.compile(r"listening on (https?://\S+)")
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, for a listener that must be named before it starts (a
    gRPC peer in another balancer's config, redis-server).

    Bind-to-0 then close is racy: the kernel hands that same port out again, to a daemon
    started with ``--port 0`` or as the local end of any outgoing connection, before our
    listener binds it. Ports are therefore drawn below the kernel's ephemeral range,
    which neither of those ever uses, and never twice from one process.
    """
    try:
        low = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 16384), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port below the ephemeral range ({low}) after 200 tries")


def executable(name: str) -> list[str]:
    """The console script ``name`` next to this interpreter, or, where the script is not
    there (an interpreter outside the venv), its entry point run by this interpreter:
    whichever installed distribution declares it, none named here."""
    script = Path(sys.executable).with_name(name)
    if script.exists():
        return [str(script)]
    found = entry_points(group="console_scripts", name=name)
    if not found:
        raise FileNotFoundError(f"{name}: no installed distribution provides this command")
    ep = next(iter(found))
    return [sys.executable, "-c", f"import sys; from {ep.module} import {ep.attr}; "
                                  f"sys.exit({ep.attr}())"]


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    _owned_log: bool = field(default=False, repr=False)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._owned_log:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_daemon(name: str, args: list[str], *, log_path: Path | None = None,
                 timeout: float = 30.0, env: dict[str, str] | None = None) -> Daemon:
    """Start ``name`` (a console script) with ``args`` (which should include ``--port 0``)."""
    owned = log_path is None
    if log_path is None:
        fd, tmp = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        os.close(fd)
        log_path = Path(tmp)
    with log_path.open("wb") as log:
        proc = subprocess.Popen([*executable(name), *args], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
    return wait_listening(name, proc, log_path, timeout, owned)


def wait_listening(name: str, proc: subprocess.Popen[bytes], log_path: Path,
                   timeout: float = 30.0, owned: bool = True) -> Daemon:
    """The started daemon ``proc`` once its "listening on" line is in ``log_path``
    (where its output goes, or a copy of it); killed, and RuntimeError, if it exits or
    ``timeout`` passes first. ``owned``: the Daemon deletes the log when stopped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _LISTENING.search(log_path.read_text(errors="replace"))
        if m:
            return Daemon(name, proc, m.group(1), log_path, owned)
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    text = log_path.read_text(errors="replace")
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    raise RuntimeError(f"{name} did not start (exit {proc.returncode}):\n{text[-4000:]}")
