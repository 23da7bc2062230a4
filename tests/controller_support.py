"""Helpers for the controller tests: a real redis-server process, tokens and auth headers."""

from __future__ import annotations

from pathlib import Path

import yaml

from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_lab.faults.cluster import RedisProcess

ADMIN = "admin-token-for-tests"
READER = "read-token-for-tests"
AGENT = "agent-token-for-tests"


# One restartable redis-server (AOF on) for the tests and the fault scenarios.
RedisServer = RedisProcess
__all__ = ["ADMIN", "AGENT", "READER", "RedisServer", "auth", "free_port", "start_controller",
           "token_config"]


def token_config() -> list[dict[str, str]]:
    from skymesh.controller.auth import digest

    return [{"name": "ops", "sha256": digest(ADMIN), "role": "admin"},
            {"name": "dash", "sha256": digest(READER), "role": "read"},
            {"name": "lbs", "sha256": digest(AGENT), "role": "agent"}]


def auth(token: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def start_controller(tmp: Path, *, probe_s: float, timeout_s: float) -> Daemon:
    """A ``skymesh-controller`` with the test tokens, probing every ``probe_s``; two
    failed probes in a row mark a balancer down."""
    path = tmp / "controller.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0}, "tokens": token_config(),
        "url_policy": {"allow_loopback": True},
        "probe": {"interval_s": probe_s, "timeout_s": timeout_s, "failure_threshold": 2}}))
    return start_daemon("skymesh-controller", ["--config", str(path)],
                        log_path=tmp / "controller.log")
