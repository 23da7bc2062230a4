"""Poisson arrivals of independent requests (open loop): ``poisson``.

The textbook open-loop load generator (as in the vLLM and SGLang serving benchmarks):
exponential inter-arrival times at ``rate_rps``, regions dealt round robin, every prompt
unique (its prompt and output blocks get a hash chain of their own, so nothing is shared).
Lengths are fixed when ``prompt_len`` / ``output_len`` are given, else drawn independently
from ShareGPT (``sharegpt_partial``): the prompt from one random row's history + prompt
tokens, the output from another random row's response tokens (each at least 1).

Parameters (defaults):

- ``regions`` (required), ``seed`` = 0 (arrival times, drawn lengths)
- ``duration_s`` = 60.0 when None: arrivals stop before this simulated time
- ``rate_rps`` = 5.0: mean arrival rate over all regions
- ``prompt_len`` = None (ShareGPT draw), ``output_len`` = None (ShareGPT draw)
- ``max_requests`` = None: at most this many requests
- ``model`` = "default"
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_lab.sim.workloads.common import check_open_loop, check_regions, unique_block_hashes
from skymesh_lab.sim.workloads.sharegpt import load_sharegpt, sharegpt_path

DEFAULT_DURATION_S = 60.0

# Keeps these unique chains apart from the trace replays' (see azure.py).
_UID_BASE = 0x9015 << 40


class PoissonWorkload(Workload):
    """Poisson arrivals of unique prompts; see the module docstring."""

    name = "poisson"

    def __init__(
        self,
        *,
        regions: Sequence[str],
        seed: int = 0,
        duration_s: float | None = None,
        rate_rps: float = 5.0,
        prompt_len: int | None = None,
        output_len: int | None = None,
        max_requests: int | None = None,
        model: str = "default",
    ) -> None:
        check_open_loop(1.0, max_requests, duration_s)
        if not rate_rps > 0:
            raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
        for label, value in (("prompt_len", prompt_len), ("output_len", output_len)):
            if value is not None and value < 1:
                raise ValueError(f"{label} must be >= 1, got {value}")
        self.regions = check_regions(regions)
        self.seed = seed
        self.duration_s = DEFAULT_DURATION_S if duration_s is None else duration_s
        self.rate_rps = rate_rps
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.max_requests = max_requests
        self.model = model
        self._prompts: tuple[int, ...] = ()
        self._outputs: tuple[int, ...] = ()
        if prompt_len is None or output_len is None:
            data = load_sharegpt(sharegpt_path())
            self._prompts, self._outputs = data.row_prompt_tokens, data.row_response_tokens

    def initial(self) -> Iterator[Arrival]:
        # Separate streams, so fixing one length does not shift the other draws or times.
        times = random.Random(f"poisson/{self.seed}/arrivals")
        lengths = random.Random(f"poisson/{self.seed}/lengths")
        regions = self.regions
        t = 0.0
        i = 0
        while self.max_requests is None or i < self.max_requests:
            t += times.expovariate(self.rate_rps)
            if t >= self.duration_s:
                return
            prompt_len = self.prompt_len or max(1, lengths.choice(self._prompts))
            output_len = self.output_len or max(1, lengths.choice(self._outputs))
            item = WorkItem(
                request_id=f"poisson-{i}",
                region=regions[i % len(regions)],
                prompt_len=prompt_len,
                output_len=output_len,
                block_hashes=unique_block_hashes(_UID_BASE | i, prompt_len + output_len),
                model=self.model,
                affinity_key=f"poisson-{i}",
                meta={"index": i},
            )
            yield t, item
            i += 1
