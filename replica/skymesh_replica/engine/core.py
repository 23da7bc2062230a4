"""The emulated inference engine: vLLM v1's scheduler over a paged, prefix-cached KV cache.

One implementation, no clock of its own: a driver asks :meth:`Engine.schedule` for the next
batch, lets ``batch.duration`` pass on its clock (virtual in the simulator, real in
``skymesh-replica``), then calls :meth:`Engine.complete` to apply it. What it models:

- continuous batching: running sequences are scheduled first, each step, then waiting ones
  are admitted FCFS while the token budget (``max_num_batched_tokens``), the sequence cap
  (``max_num_seqs``) and free KV blocks allow; the head of the queue blocks the rest, as
  in vLLM;
- chunked prefill: a prompt longer than the remaining budget is computed over several steps;
- prefix reuse: at admission the longest run of cached leading blocks is taken from the
  cache (at least one token is always recomputed, as in vLLM) and counted as a hit;
- preemption by recompute: when a running sequence needs a block and none is free, the
  most recently admitted running sequence is preempted, its blocks released (they stay
  cached, so its recompute often hits) and it goes back to the head of the waiting queue;
- ``num_waiting`` is exactly vLLM's ``num_requests_waiting``: admitted-but-not-scheduled
  requests, preempted ones included.

The scheduler above is the default (``scheduler="vllm"``); ``scheduler="sglang"`` swaps
in SGLang's (:mod:`skymesh_replica.engine.sglang`) over the same sequences, cache and step
timing. Every sequence carries ``max_new_tokens`` (the client's ``max_tokens``, else what
the context leaves); only SGLang's admission rule reads it.

Fast-forward: when a step is pure decode and nothing can change the batch before some
sequence finishes (no admission is possible, blocks suffice), ``schedule(max_steps=k)``
returns one batch standing for up to ``k`` identical-shape steps, timed in closed form.
:meth:`Engine.truncate` shortens such a batch when a new request arrives mid-way, so the
simulator stays step-exact while skipping the steady stretches.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from skymesh_replica.engine.batch import Batch, EngineStats, Sequence, StepEvent
from skymesh_replica.engine.kv_cache import BlockManager
from skymesh_replica.engine.profiles import Profile
from skymesh_replica.engine.status import Status

if TYPE_CHECKING:
    from skymesh_replica.engine.sglang import SGLangScheduler

__all__ = ["SCHEDULERS", "Batch", "Engine", "EngineStats", "Sequence", "Status", "StepEvent"]


SCHEDULERS: tuple[str, ...] = ("vllm", "sglang")


class Engine:
    def __init__(self, profile: Profile, *, enable_prefix_caching: bool = True,
                 scheduler: str = "vllm") -> None:
        if profile.max_num_batched_tokens <= profile.max_num_seqs:
            # Fast-forward relies on every running decode fitting in one step's budget.
            raise ValueError("max_num_batched_tokens must exceed max_num_seqs")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; known: {', '.join(SCHEDULERS)}")
        self.profile = profile
        self.block_size = profile.block_size
        self.kv = BlockManager(profile.num_kv_blocks, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = EngineStats()
        self._by_id: dict[str, Sequence] = {}
        self.scheduler = scheduler
        self._sgl: SGLangScheduler | None = None
        if scheduler == "sglang":
            from skymesh_replica.engine.sglang import SGLangScheduler

            self._sgl = SGLangScheduler(self)

    # -- intake ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if seq.prompt_len <= 0 or seq.output_len <= 0:
            raise ValueError("prompt_len and output_len must be positive")
        if seq.prompt_len + seq.output_len > self.profile.max_model_len:
            raise ValueError(
                f"prompt ({seq.prompt_len}) + output ({seq.output_len}) tokens exceed the "
                f"model's context length {self.profile.max_model_len}"
            )
        if self.blocks_for(seq.prompt_len + seq.output_len) > self.kv.num_blocks:
            raise ValueError("request does not fit in the KV cache even alone")
        if seq.max_new_tokens <= 0:
            seq.max_new_tokens = self.profile.max_model_len - seq.prompt_len
        elif seq.max_new_tokens < seq.output_len:
            raise ValueError(f"output_len ({seq.output_len}) exceeds max_new_tokens "
                             f"({seq.max_new_tokens})")
        if self._sgl is not None:
            self._sgl.on_add(seq)
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks are released at once."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if self._sgl is not None:
            self._sgl.on_abort(seq)
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.kv.release(seq.blocks)
            seq.blocks = []
        seq.status = Status.ABORTED
        self.stats.num_aborted += 1
        return True

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    # -- state -----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def published_waiting(self) -> int:
        """The waiting count a load probe reads: vLLM's live gauge, or SGLang's
        ``num_queue_reqs`` as of its last log point (a snapshot)."""
        return self.num_waiting if self._sgl is None else self._sgl.queue_gauge

    @property
    def published_running(self) -> int:
        return self.num_running if self._sgl is None else self._sgl.running_gauge

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    @property
    def num_used_tokens(self) -> int:
        """Token slots held by live sequences (SGLang's ``num_used_tokens``)."""
        return (self.kv.num_blocks - self.kv.num_free) * self.block_size

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- scheduling ------------------------------------------------------------------
    def schedule(self, max_steps: int = 1) -> Batch | None:
        """The next batch, or None when there is nothing to run."""
        if self._sgl is not None:
            return self._sgl.schedule(max_steps)
        if not self.has_work:
            return None
        budget = self.profile.max_num_batched_tokens
        entries: list[tuple[Sequence, int]] = []
        preempted = False
        kv = self.kv
        bs = self.block_size

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self.blocks_for(seq.num_computed + n) - len(seq.blocks)
            while need > kv.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            if need > 0:
                seq.blocks.extend(kv.allocate(need))
            entries.append((seq, n))
            budget -= n
            i += 1

        if not preempted:
            budget = self._admit(entries, budget, bs)

        if not entries:
            # Everything waiting is blocked (cannot happen with an empty running set,
            # since add() refuses requests that cannot fit alone).
            return None
        batch = self.timed(entries)
        if max_steps > 1 and not preempted and batch.prefill_tokens == 0:
            self.fast_forward(batch, max_steps)
        return batch

    def _admit(self, entries: list[tuple[Sequence, int]], budget: int, bs: int) -> int:
        kv = self.kv
        cap = self.profile.max_num_seqs
        while self.waiting and budget > 0 and len(self.running) < cap:
            seq = self.waiting[0]
            # Keep at least one token to compute, so the step produces logits (as vLLM).
            lookup = seq.block_hashes[: (seq.num_tokens - 1) // bs]
            hit_blocks = kv.match_prefix(lookup)
            hit_tokens = len(hit_blocks) * bs
            n = min(seq.num_tokens - hit_tokens, budget)
            need = self.blocks_for(hit_tokens + n) - len(hit_blocks)
            if need + kv.num_evictable_in(hit_blocks) > kv.num_free:
                break
            kv.acquire(hit_blocks)
            seq.blocks = list(hit_blocks)
            if need > 0:
                seq.blocks.extend(kv.allocate(need))
            seq.num_computed = hit_tokens
            seq.status = Status.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            st = self.stats
            st.prefix_query_tokens += seq.num_tokens
            st.prefix_hit_tokens += hit_tokens
            if seq.first_hit_tokens < 0:
                seq.first_hit_tokens = hit_tokens
                st.prompt_tokens += seq.prompt_len
            entries.append((seq, n))
            budget -= n
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def timed(self, entries: list[tuple[Sequence, int]]) -> Batch:
        prefill = 0
        attn = 0.0
        dseqs = 0
        dctx = 0
        for seq, n in entries:
            if n == 1 and seq.num_output > 0 and seq.num_computed == seq.num_tokens - 1:
                dseqs += 1
                dctx += seq.num_tokens
            else:
                prefill += n
                attn += n * (seq.num_computed + n / 2)
        dur = self.profile.step_time(prefill, attn, dseqs, dctx)
        return Batch(entries, dur, 1, prefill, dseqs, dctx)

    def fast_forward(self, batch: Batch, max_steps: int) -> None:
        """Stretch a pure-decode batch over as many identical steps as is safe."""
        k = min(max_steps, min(seq.remaining_output for seq, _ in batch.entries))
        if k <= 1:
            return
        bs = self.block_size
        free = self.kv.num_free

        def blocks_needed(steps: int) -> int:
            # Blocks beyond those already held to compute `steps` more tokens per sequence.
            return sum(
                max(0, -(-(seq.num_computed + steps) // bs) - len(seq.blocks))
                for seq, _ in batch.entries
            )

        if blocks_needed(k) > free:
            lo, hi = 1, k  # blocks_needed(lo) <= free (already allocated for one step)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if blocks_needed(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        if k <= 1:
            return
        for seq, _ in batch.entries:
            extra = -(-(seq.num_computed + k) // bs) - len(seq.blocks)
            if extra > 0:
                seq.blocks.extend(self.kv.allocate(extra))
        batch.num_steps = k
        batch.duration = self.profile.decode_run_time(k, batch.decode_seqs, batch.decode_context)

    def step_offsets(self, batch: Batch, steps: int) -> float:
        """Time from the batch's start to the end of its ``steps``-th step."""
        if batch.prefill_tokens:
            return batch.duration  # mixed batches are never stretched: one step
        return self.profile.decode_run_time(steps, batch.decode_seqs, batch.decode_context)

    def truncate(self, batch: Batch, elapsed: float) -> float:
        """Cut a fast-forwarded batch at the first step boundary at or after ``elapsed``.

        Returns the batch's new duration. Blocks allocated for the dropped steps stay with
        their sequences; the next steps use them.
        """
        if batch.num_steps <= 1:
            return batch.duration
        lo, hi = 1, batch.num_steps
        while lo < hi:
            mid = (lo + hi) // 2
            if self.step_offsets(batch, mid) >= elapsed:
                hi = mid
            else:
                lo = mid + 1
        batch.num_steps = lo
        batch.duration = self.step_offsets(batch, lo)
        return batch.duration

    # -- completion ------------------------------------------------------------------
    def complete(self, batch: Batch) -> list[StepEvent]:
        """Apply a batch the driver has let run for ``batch.duration``."""
        events: list[StepEvent] = []
        k = batch.num_steps
        st = self.stats
        st.num_steps += k
        st.busy_time += batch.duration
        bs = self.block_size
        kv = self.kv
        for seq, n in batch.entries:
            if seq.status is not Status.RUNNING:
                continue  # aborted while the step ran
            before = seq.num_computed
            if k == 1:
                seq.num_computed += n
                new = 1 if seq.num_computed == seq.num_tokens else 0
            else:
                seq.num_computed += k
                new = k
            # Register blocks that became full, so later requests can hit them.
            hashes = seq.block_hashes
            rec = kv.recorder
            for j in range(before // bs, min(seq.num_computed // bs, len(hashes))):
                if kv.register(seq.blocks[j], hashes[j]) and rec is not None:
                    rec.stored(hashes[j], hashes[j - 1] if j else None,
                               seq.token_ids[j * bs : (j + 1) * bs], bs)
            if not new:
                continue
            first = seq.num_output == 0
            seq.num_output += new
            st.generation_tokens += new
            done = seq.num_output >= seq.output_len
            if done:
                self.running.remove(seq)
                kv.release(seq.blocks)
                seq.blocks = []
                seq.status = Status.FINISHED
                self._by_id.pop(seq.request_id, None)
                st.num_finished += 1
            events.append(StepEvent(seq, new, first, done))
        if self._sgl is not None:
            self._sgl.on_complete(batch, events)
        return events
