"""Prefix block hashes shared by the engine, the simulator and the routing policies.

A KV-cache block holds ``block_size`` tokens. Its hash chains the parent block's hash with
the block's own tokens, so two requests share block ``j`` exactly when their first
``(j + 1) * block_size`` tokens are equal (vLLM's automatic prefix caching does the same).
Only full blocks have hashes; the tail of a sequence shorter than a block is never shared.

Traces that carry their own prefix ids (Mooncake: one id per 512-token block) are expanded
into engine-sized blocks with :func:`expand_block_ids`, which keeps the same property
without materialising any tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

_MASK = (1 << 63) - 1
# vLLM's default KV block size; every profile uses it so hashes are comparable across
# replicas, the simulator and the routers.
BLOCK_SIZE = 16
ROOT_HASH = 0x5EED


def _mix(parent: int, payload: int) -> int:
    # A cheap, well-spread 63-bit mix. CPython's tuple hash of ints is not salted by
    # PYTHONHASHSEED, so hashes are reproducible across processes (not across Python
    # implementations, which nothing here needs: hashes never leave one deployment).
    return hash((parent, payload)) & _MASK


def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH
) -> list[int]:
    """Chained hashes of every full block of ``token_ids``."""
    out: list[int] = []
    h = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start : start + block_size]))) & _MASK
        out.append(h)
    return out


def extend_token_blocks(
    hashes: list[int], token_ids: Sequence[int], block_size: int
) -> list[int]:
    """Hashes of all full blocks of ``token_ids``, reusing ``hashes`` of a known prefix.

    ``hashes`` must be the chained hashes of a prefix of ``token_ids``; only the blocks
    after it are computed. Used when a conversation or a tree grows by appending text.
    """
    done = len(hashes)
    parent = hashes[-1] if hashes else ROOT_HASH
    return hashes + hash_token_blocks(token_ids[done * block_size :], block_size, parent)


def expand_block_ids(
    block_ids: Sequence[int], trace_block_size: int, num_tokens: int, block_size: int
) -> list[int]:
    """Engine-block hashes for a prompt described by coarse prefix ids (Mooncake).

    ``block_ids[i]`` names the content of tokens ``[i * trace_block_size, (i + 1) *
    trace_block_size)``; equal ids mean equal content *and* equal prefix. Each engine
    block inside it gets ``mix(parent, id, index)``, chained, so sharing is exact at
    engine-block granularity. Only the ``num_tokens // block_size`` full engine blocks are
    returned. Whole trace blocks are memoised: requests of a trace share long prefixes, and
    expanding the Mooncake conversation trace naively hashes about 9 M engine blocks.
    """
    if trace_block_size % block_size:
        raise ValueError(f"trace block size {trace_block_size} is not a multiple of {block_size}")
    per = trace_block_size // block_size
    n_full = num_tokens // block_size
    out: list[int] = []
    h = ROOT_HASH
    for block_id in block_ids:
        left = n_full - len(out)
        if left <= 0:
            break
        seg = _segment(h, block_id, per) if left >= per else _segment_part(h, block_id, left)
        out.extend(seg)
        h = seg[-1]
    return out


def _segment_part(parent: int, block_id: int, n: int) -> tuple[int, ...]:
    base = block_id << 16
    seg = []
    h = parent
    for j in range(n):
        h = _mix(h, base | j)
        seg.append(h)
    return tuple(seg)


@functools.lru_cache(maxsize=1 << 15)
def _segment(parent: int, block_id: int, per: int) -> tuple[int, ...]:
    return _segment_part(parent, block_id, per)
