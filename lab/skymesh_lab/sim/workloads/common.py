"""Helpers shared by the workload families: synthetic tokens, unique prompts, clients."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from functools import lru_cache

import numpy as np

from skymesh_lab.sim.workload import WorkItem
from skymesh_replica.engine.hashing import BLOCK_SIZE, expand_block_ids

# Token ids stay below this bound (Qwen2.5's vocabulary is ~151.6k).
VOCAB_SIZE = 151_000

# With one "trace block" this large, expand_block_ids gives every engine block of the
# request its own index under one per-request id: a cheap, never-shared chain.
_UNIQUE_SPAN = 1 << 40


def synth_tokens(key: str, n: int) -> list[int]:
    """``n`` deterministic token ids for the content named ``key``.

    Equal keys give equal tokens, in any process: ``random.Random`` seeds a str through
    SHA-512 (all of its bits; unlike ``hash(str)`` it is not salted per process, and
    unlike a 32-bit CRC it does not collide among tens of thousands of conversations).
    """
    if n <= 0:
        return []
    raw = random.Random(key).randbytes(4 * n)
    # Explicit little-endian so the ids do not depend on the host's byte order.
    return (np.frombuffer(raw, dtype="<u4") % VOCAB_SIZE).tolist()


@lru_cache(maxsize=64)
def shared_tokens(key: str, n: int) -> tuple[int, ...]:
    """Like :func:`synth_tokens`, cached: for prefixes every request repeats."""
    return tuple(synth_tokens(key, n))


def unique_block_hashes(uid: int, num_tokens: int) -> list[int]:
    """Hashes of the full blocks of a prompt no other request of the workload shares."""
    return expand_block_ids([uid], _UNIQUE_SPAN, num_tokens, BLOCK_SIZE)


def check_regions(regions: Sequence[str]) -> list[str]:
    """A validated copy of the region names (non-empty, no duplicates)."""
    out = list(regions)
    if not out:
        raise ValueError("a workload needs at least one region")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate region names in {out}")
    return out


def check_open_loop(time_scale: float, max_requests: int | None, duration_s: float | None) -> None:
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    check_duration(duration_s)


def check_duration(duration_s: float | None) -> None:
    if duration_s is not None and duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")


def client_regions(
    regions: Sequence[str], clients_per_region: int | Mapping[str, int]
) -> list[str]:
    """One entry per client, its region; clients are numbered region by region.

    A mapping may leave regions out (they get no clients) but not name unknown ones.
    """
    if isinstance(clients_per_region, Mapping):
        unknown = sorted(set(clients_per_region) - set(regions))
        if unknown:
            raise ValueError(f"clients_per_region names unknown regions {unknown}")
        counts = [int(clients_per_region.get(r, 0)) for r in regions]
    else:
        counts = [int(clients_per_region)] * len(regions)
    if any(c < 0 for c in counts):
        raise ValueError(f"clients_per_region must be >= 0, got {clients_per_region}")
    return [r for r, c in zip(regions, counts, strict=True) for _ in range(c)]


def meta_int(item: WorkItem, key: str) -> int:
    """An int the workload stored in ``item.meta`` (typed ``object`` there)."""
    value = item.meta.get(key)
    if not isinstance(value, int):
        raise ValueError(f"work item {item.request_id} has no int meta[{key!r}]: not ours?")
    return value
