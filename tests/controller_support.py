"""Helpers for the controller tests: a real redis-server process, tokens and auth headers."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

POLL_S = 0.01  # polling cadence while a server starts (not a wait for it)
ADMIN = "admin-token-for-tests"
READER = "read-token-for-tests"
AGENT = "agent-token-for-tests"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """``redis-server`` with AOF on, in a temporary directory; restartable on its port."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run `make system-deps`")
        self.exe, self.dir, self.port = exe, workdir, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
            time.sleep(POLL_S)

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


def token_config() -> list[dict[str, str]]:
    from controller.auth import digest

    return [{"name": "ops", "sha256": digest(ADMIN), "role": "admin"},
            {"name": "dash", "sha256": digest(READER), "role": "read"},
            {"name": "lbs", "sha256": digest(AGENT), "role": "agent"}]


def auth(token: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
