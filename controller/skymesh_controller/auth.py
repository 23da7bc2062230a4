"""Bearer tokens, kept hashed: the config and the process hold only sha256 digests.

Roles: ``admin`` may do anything; ``read`` may only read; ``agent`` (balancers) may read,
register a balancer and its replicas, and report telemetry; ``tenants`` may read and
change tenants and their limits (``/v1/tenants``), nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from skymesh_controller.config import Role, TokenConfig


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role


class TokenBook:
    def __init__(self, tokens: list[TokenConfig], admin_token: str | None = None) -> None:
        self._by_digest: list[tuple[str, Principal]] = [
            (t.sha256, Principal(t.name, t.role)) for t in tokens]
        if admin_token:
            self._by_digest.append((digest(admin_token), Principal("env-admin", "admin")))

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, token: str) -> Principal | None:
        d = digest(token)
        found = None
        # Compare against every entry in constant time: no early exit that times the match.
        for known, principal in self._by_digest:
            if hmac.compare_digest(known, d):
                found = principal
        return found


def allowed(role: Role, need: Role) -> bool:
    """``need`` is what the endpoint requires: read < agent < admin, and ``tenants`` beside
    them (admin or tenants may change tenants; tenants may otherwise only read)."""
    if need == "tenants":
        return role in ("tenants", "admin")
    rank = {"read": 0, "tenants": 0, "agent": 1, "admin": 2}
    return rank[role] >= rank[need]
