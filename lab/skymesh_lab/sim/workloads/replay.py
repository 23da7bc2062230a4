"""Replay of a prepared list of requests (open loop), for experiments that build their
requests themselves: e.g. ShareGPT / GSM8K prompts with predicted lengths in ``meta``
(``skymesh bench goodput``). Not in the named-workload table: it takes a list, not data
files. :func:`poisson_items` deals such requests Poisson arrival times."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_lab.sim.workloads.common import unique_block_hashes

# Keeps these unique chains apart from the other workloads' (see poisson.py, azure.py).
_UID_BASE = 0x2E91 << 40


class ReplayWorkload(Workload):
    name = "replay"

    def __init__(self, arrivals: Sequence[Arrival]) -> None:
        times = [t for t, _ in arrivals]
        if times != sorted(times):
            raise ValueError("replay arrivals must be in time order")
        self.arrivals = list(arrivals)

    def initial(self) -> Iterator[Arrival]:
        return iter(self.arrivals)


def poisson_items(lengths: Sequence[tuple[int, int, dict[str, object]]], *, rate_rps: float,
                  duration_s: float, region: str, seed: int, prefix: str = "replay"
                  ) -> list[Arrival]:
    """Poisson arrivals at ``rate_rps`` until ``duration_s``, cycling through ``lengths``
    ((prompt tokens, output tokens, meta) per request, in the given order); every prompt
    is unique."""
    if not rate_rps > 0 or not duration_s > 0:
        raise ValueError("need rate_rps > 0 and duration_s > 0")
    if not lengths:
        raise ValueError("no requests to replay")
    rng = random.Random(f"{prefix}/{seed}/arrivals")
    out: list[Arrival] = []
    t = rng.expovariate(rate_rps)
    i = 0
    while t < duration_s:
        prompt, output, meta = lengths[i % len(lengths)]
        prompt, output = max(1, prompt), max(1, output)
        out.append((t, WorkItem(
            request_id=f"{prefix}-{i}", region=region, prompt_len=prompt, output_len=output,
            block_hashes=unique_block_hashes(_UID_BASE | i, prompt + output),
            affinity_key=f"{prefix}-{i}", meta=dict(meta))))
        i += 1
        t += rng.expovariate(rate_rps)
    return out
