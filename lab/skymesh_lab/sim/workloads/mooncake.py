"""Mooncake trace replay (open loop): ``mooncake-conversation`` and ``mooncake-synthetic``.

Follows the Mooncake FAST'25 trace release (Qin et al., "Mooncake: A KVCache-centric
Architecture for LLM Serving", FAST'25): ``mooncake_fast25/{conversation,synthetic}_trace
.jsonl``, one request per line with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (one prefix-chained id per 512-token block). Each prompt
becomes engine-block hashes through :func:`skymesh_replica.engine.hashing.expand_block_ids`, so two
requests share exactly the 16-token blocks under their common leading ids. The outputs'
content is unknown to the trace, so they carry no block hashes.

Regions: every conversation request opens with the shared system block 0, so a request
goes to ``regions[key % len(regions)]`` with ``key = hash_ids[1]`` (``hash_ids[0]`` for a
one-block prompt): requests that continue the same prefix chain land in the same region.
The key is also the request's ``affinity_key``.

Parameters (defaults):

- ``regions`` (required), ``seed`` (unused: the replay is fully determined by the trace)
- ``duration_s`` = None: no arrival at or after this simulated time (after ``time_scale``)
- ``time_scale`` = 1.0: multiplies inter-arrival times (< 1 compresses the trace)
- ``max_requests`` = None: replay at most this many rows
- ``model`` = "default"
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Literal

from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_lab.sim.workloads.common import check_open_loop, check_regions
from skymesh_lab.sim.workloads.data import data_file
from skymesh_replica.engine.hashing import BLOCK_SIZE, expand_block_ids

MOONCAKE_BLOCK_TOKENS = 512

TraceName = Literal["conversation", "synthetic"]


def region_key(hash_ids: Sequence[int]) -> int:
    """The id that picks a request's region: the first one after the shared block 0."""
    return hash_ids[1] if len(hash_ids) > 1 else hash_ids[0]


class MooncakeWorkload(Workload):
    """Replays a Mooncake FAST'25 trace; see the module docstring."""

    def __init__(
        self,
        trace: TraceName,
        *,
        regions: Sequence[str],
        seed: int = 0,
        duration_s: float | None = None,
        time_scale: float = 1.0,
        max_requests: int | None = None,
        model: str = "default",
    ) -> None:
        if trace not in ("conversation", "synthetic"):
            raise ValueError(f"unknown Mooncake trace {trace!r}")
        check_open_loop(time_scale, max_requests, duration_s)
        self.name = f"mooncake-{trace}"
        self.path = data_file("mooncake_fast25", f"{trace}_trace.jsonl")
        self.regions = check_regions(regions)
        self.seed = seed
        self.duration_s = duration_s
        self.time_scale = time_scale
        self.max_requests = max_requests
        self.model = model

    def initial(self) -> Iterator[Arrival]:
        regions = self.regions
        t0: float | None = None
        with self.path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if self.max_requests is not None and i >= self.max_requests:
                    return
                row = json.loads(line)
                ts = float(row["timestamp"]) / 1000.0
                if t0 is None:
                    t0 = ts
                t = (ts - t0) * self.time_scale
                if self.duration_s is not None and t >= self.duration_s:
                    return
                hash_ids: list[int] = row["hash_ids"]
                prompt_len = max(1, int(row["input_length"]))
                key = region_key(hash_ids) if hash_ids else i
                item = WorkItem(
                    request_id=f"{self.name}-{i}",
                    region=regions[key % len(regions)],
                    prompt_len=prompt_len,
                    output_len=max(1, int(row["output_length"])),
                    block_hashes=expand_block_ids(
                        hash_ids, MOONCAKE_BLOCK_TOKENS, prompt_len, BLOCK_SIZE
                    ),
                    model=self.model,
                    affinity_key=f"mooncake-{key}",
                    meta={"row": i},
                )
                yield t, item
