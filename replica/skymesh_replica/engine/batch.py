"""What the engine schedules and reports: a request inside it (:class:`Sequence`), one
step's work (:class:`Batch`), what a step did to a request (:class:`StepEvent`) and the
running totals (:class:`EngineStats`). Shared by the engine (:mod:`.core`) and its
SGLang-mode scheduler (:mod:`.sglang`), so neither imports the other for them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from skymesh_replica.engine.status import Status


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine."""

    request_id: str
    prompt_len: int
    output_len: int
    # Chained hashes of the full blocks of prompt + output that are known (see hashing).
    block_hashes: Seq[int] = ()
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    num_output: int = 0  # tokens generated (and streamed) so far
    blocks: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    first_hit_tokens: int = -1  # prefix hit at first admission (-1: not admitted yet)
    payload: object = None  # the driver's handle (stream, client record...)
    # The client's output limit (max_tokens); 0: unset, add() puts what the context leaves.
    max_new_tokens: int = 0
    # Prompt + output token ids, when the driver knows them (the KV events carry them).
    token_ids: Seq[int] = ()

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output

    @property
    def remaining_output(self) -> int:
        return self.output_len - self.num_output


@dataclass(slots=True)
class Batch:
    """What runs in one step (or ``num_steps`` identical decode steps)."""

    entries: list[tuple[Sequence, int]]  # (sequence, tokens it computes this step)
    duration: float
    num_steps: int = 1
    prefill_tokens: int = 0
    decode_seqs: int = 0
    decode_context: int = 0


@dataclass(slots=True)
class StepEvent:
    seq: Sequence
    new_tokens: int
    first_token: bool
    finished: bool


@dataclass(slots=True)
class EngineStats:
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_steps: int = 0
    busy_time: float = 0.0
