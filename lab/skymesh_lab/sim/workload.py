"""The workload interface the simulator drives.

A workload yields :class:`WorkItem` arrivals. Open-loop workloads (trace replay, Poisson)
know every arrival up front and return them, sorted by time, from :meth:`Workload.initial`
(lazily: an iterator, so a million-request trace never sits in the event heap at once).
Closed-loop workloads (conversations, trees of thoughts) return each client's first
request from ``initial`` and the follow-ups from :meth:`Workload.on_complete`, which the
simulator calls when a request finishes (or fails) at virtual time ``now``.

Everything a workload needs that is random comes from the seed it was built with, so a
run is reproducible.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from skymesh_replica.engine.hashing import BLOCK_SIZE


@dataclass(slots=True)
class WorkItem:
    """One request as a client issues it."""

    request_id: str
    region: str
    prompt_len: int
    output_len: int
    # Chained engine-block hashes (see skymesh_replica.engine.hashing) of every full block of
    # prompt + output whose content is known. The engine looks up the prompt's blocks
    # for prefix hits and registers the output's blocks as they fill, so the next turn
    # of a conversation can hit them.
    block_hashes: list[int]
    model: str = "default"
    affinity_key: str | None = None
    # The client's max_tokens; None: the engine takes what the context leaves.
    max_new_tokens: int | None = None
    deadline_s: float | None = None
    # Free-form bookkeeping the workload uses in on_complete (client id, tree node...).
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def prompt_block_hashes(self) -> list[int]:
        """Hashes of the prompt's full blocks: what a prefix-aware router keys on."""
        return self.block_hashes[: self.num_prompt_blocks]

    @property
    def num_prompt_blocks(self) -> int:
        return min(len(self.block_hashes), self.prompt_len // BLOCK_SIZE)


Arrival = tuple[float, WorkItem]


class Workload(ABC):
    """Source of requests for one simulation run."""

    name: str = ""

    @abstractmethod
    def initial(self) -> Iterator[Arrival]:
        """Arrivals known at start, in non-decreasing time order."""

    def on_complete(self, item: WorkItem, now: float, ok: bool = True) -> Iterable[Arrival]:
        """Follow-up arrivals after ``item`` ended at ``now`` (closed-loop workloads)."""
        return ()
