"""Helpers for the controller tests: a real redis-server process, tokens and auth headers."""

from __future__ import annotations

from skymesh.faults.cluster import RedisProcess
from skymesh.procs import free_port

ADMIN = "admin-token-for-tests"
READER = "read-token-for-tests"
AGENT = "agent-token-for-tests"


# One restartable redis-server (AOF on) for the tests and the fault scenarios.
RedisServer = RedisProcess
__all__ = ["ADMIN", "AGENT", "READER", "RedisServer", "auth", "free_port", "token_config"]


def token_config() -> list[dict[str, str]]:
    from controller.auth import digest

    return [{"name": "ops", "sha256": digest(ADMIN), "role": "admin"},
            {"name": "dash", "sha256": digest(READER), "role": "read"},
            {"name": "lbs", "sha256": digest(AGENT), "role": "agent"}]


def auth(token: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
