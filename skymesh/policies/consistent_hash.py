"""Consistent hashing on the request's affinity key: ``consistent-hash`` (SkyLB-CH).

A ring hash (Karger et al., STOC'97) with ``virtual_nodes`` points per target, each at
blake2b("<target>#<i>"). A request's key is ``request.affinity_key`` (a session, user or
question id), else its first prefix key (the leading block of the prompt), else its
request id. The request goes to the first point clockwise from the key's position whose
target is among the candidates: points of unavailable targets are skipped, as SkyLB-CH
does (SkyLB sec. 3.2, Algorithm 1 line 26), so a busy replica's keys spill to their next
owner on the ring and come back once it frees up. Adding or removing a target moves only
the keys next to its points, about 1/N of them.

Beyond SkyLB-CH: ``preferred`` names the key's owner among all serving targets, so with
delay scheduling (``pushing.hold_s`` > 0, the default) a request waits up to ``hold_s`` for
a busy owner before spilling. Spilling at once broke cache affinity under saturation
(tree of thoughts at the paper's load: 25 req/s and 48% hits, against 38 req/s and 86%
with the hold; ``docs/notes/bench.md``).

The ring is rebuilt only in ``on_membership`` and swapped in whole (Envoy's ring hash
does the same). If membership was never given, it is built from the first candidates seen
and grown when unseen candidates show up.

Parameters: ``virtual_nodes`` = 160 (with 160 points each, a target's share of the ring
is within about 10% of 1/N).
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Iterable, Sequence

from skymesh.policies.base import LoadView, Policy, RouteRequest

_M64 = (1 << 64) - 1


def _hash_str(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def _mix64(x: int) -> int:
    # splitmix64: prefix keys are already hashes, but may not span all 64 bits of the ring.
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def request_key_hash(request: RouteRequest) -> int:
    """The request's position on the ring."""
    if request.affinity_key is not None:
        return _hash_str("a:" + request.affinity_key)
    if request.prefix_keys:
        return _mix64(request.prefix_keys[0] & _M64)
    return _hash_str("r:" + request.request_id)


class ConsistentHash(Policy, name="consistent-hash"):
    uses_prefix_keys = True

    def __init__(self, *, virtual_nodes: int = 160, rng: random.Random | None = None) -> None:
        super().__init__(rng=rng)
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes
        # (sorted point positions, owner of each point); replaced whole, never edited.
        self._ring: tuple[list[int], list[str]] = ([], [])
        self._members: frozenset[str] = frozenset()
        self._given = False

    def on_membership(self, targets: Sequence[str]) -> None:
        self._given = True
        self._build(targets)

    def _build(self, targets: Iterable[str]) -> None:
        members = frozenset(targets)
        vn = self.virtual_nodes
        ring = sorted((_hash_str(f"{t}#{i}"), t) for t in members for i in range(vn))
        self._ring = ([p for p, _ in ring], [t for _, t in ring])
        self._members = members

    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        if not candidates:
            return None
        if not self._given and not self._members.issuperset(candidates):
            self._build(self._members.union(candidates))
        points, owners = self._ring
        h = request_key_hash(request)
        allowed = set(candidates) if len(candidates) > 8 else candidates
        n = len(points)
        if n and not self._members.isdisjoint(allowed):
            start = bisect.bisect_left(points, h)
            for k in range(n):
                t = owners[(start + k) % n]
                if t in allowed:
                    return t
        # Candidates the ring does not know (membership out of step): still deterministic.
        return sorted(candidates)[h % len(candidates)]

    def preferred(self, request: RouteRequest, targets: Sequence[str], view: LoadView
                  ) -> str | None:
        """The key's owner on the ring of every serving target, busy or not: with delay
        scheduling the dispatcher may hold a request briefly for it instead of spilling
        the key at once (measured: affinity, and so throughput, survive saturation)."""
        return self.select(request, targets, view) if targets else None
