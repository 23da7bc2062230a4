"""Azure LLM inference trace 2023 replay (open loop): ``azure2023-code``, ``azure2023-conv``.

Follows the Splitwise setting (Patel et al., "Splitwise: Efficient Generative LLM Inference
Using Phase Splitting", ISCA'24), whose public trace is ``azure_llm_2023/
AzureLLMInferenceTrace_{code,conv}.csv``: ``TIMESTAMP,ContextTokens,GeneratedTokens``.
Arrival times are relative to the first row. The trace has no content, so every request is
a unique prompt: its prompt and output blocks get a hash chain of their own (no prefix is
ever shared), and regions are dealt round robin in trace order.

Parameters (defaults):

- ``regions`` (required), ``seed`` (unused: the replay is fully determined by the trace)
- ``duration_s`` = None: no arrival at or after this simulated time (after ``time_scale``)
- ``time_scale`` = 1.0: multiplies inter-arrival times (< 1 compresses the trace)
- ``max_requests`` = None: replay at most this many rows
- ``model`` = "default"
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Literal

from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_lab.sim.workloads.common import check_open_loop, check_regions, unique_block_hashes
from skymesh_lab.sim.workloads.data import data_file

TraceName = Literal["code", "conv"]

# Per-trace id namespaces, so the two traces' unique chains never coincide either.
_UID_BASE = {"code": 0xA2023C << 32, "conv": 0xA2023D << 32}


def parse_timestamp(text: str) -> float:
    """Seconds since the epoch of a trace timestamp like ``2023-11-16 18:17:03.9799600``.

    The trace has 7 fractional digits; ``datetime`` takes at most 6, and the 100 ns
    digit is below any timing the simulator cares about. Read as UTC so a local DST
    change can never bend the arrival times.
    """
    head, _, frac = text.strip().partition(".")
    seconds = datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp()
    return seconds + (int(frac[:6].ljust(6, "0")) / 1e6 if frac else 0.0)


class AzureWorkload(Workload):
    """Replays an Azure LLM 2023 trace; see the module docstring."""

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
        if trace not in _UID_BASE:
            raise ValueError(f"unknown Azure 2023 trace {trace!r}")
        check_open_loop(time_scale, max_requests, duration_s)
        self.name = f"azure2023-{trace}"
        self.trace = trace
        self.path = data_file("azure_llm_2023", f"AzureLLMInferenceTrace_{trace}.csv")
        self.regions = check_regions(regions)
        self.seed = seed
        self.duration_s = duration_s
        self.time_scale = time_scale
        self.max_requests = max_requests
        self.model = model

    def initial(self) -> Iterator[Arrival]:
        regions = self.regions
        uid_base = _UID_BASE[self.trace]
        t0: float | None = None
        with self.path.open(encoding="utf-8", newline="") as f:
            for i, row in enumerate(csv.DictReader(f)):
                if self.max_requests is not None and i >= self.max_requests:
                    return
                ts = parse_timestamp(row["TIMESTAMP"])
                if t0 is None:
                    t0 = ts
                t = (ts - t0) * self.time_scale
                if self.duration_s is not None and t >= self.duration_s:
                    return
                prompt_len = max(1, int(row["ContextTokens"]))
                output_len = max(1, int(row["GeneratedTokens"]))
                item = WorkItem(
                    request_id=f"{self.name}-{i}",
                    region=regions[i % len(regions)],
                    prompt_len=prompt_len,
                    output_len=output_len,
                    block_hashes=unique_block_hashes(uid_base | i, prompt_len + output_len),
                    model=self.model,
                    affinity_key=f"{self.name}-{i}",
                    meta={"row": i},
                )
                yield t, item
