"""SGLang's scheduler for the emulated engine (``Engine(profile, scheduler="sglang")``).

Follows SGLang v0.4.x (v0.4.3-v0.4.6, February-May 2025: the releases SkyLB ran; its
client notes v0.4.3.post2 and v0.4.5), read in sgl-project/sglang:

- ``python/sglang/srt/managers/scheduler.py``: ``get_next_batch_to_run`` (a waiting
  request's prefill runs in a batch of its own, before decoding; no mixed chunks by
  default), ``get_new_batch_prefill`` (the ``batch_is_full`` latch, ``max_running_requests``),
  ``update_running_batch`` (``check_decode_mem``, retraction, ratio decay), the idle reset
  of ``new_token_ratio``, ``log_prefill_stats`` / ``log_decode_stats`` (where
  ``num_queue_reqs`` is published);
- ``python/sglang/srt/managers/schedule_policy.py``: ``SchedulePolicy.calc_priority``
  (lpm, fcfs above 128 waiting, in-batch prefix de-prioritisation) and ``PrefillAdder``
  (``add_one_req``, ``add_chunked_req``, ``budget_state``, ``CLIP_MAX_NEW_TOKENS_ESTIMATION``);
- ``python/sglang/srt/managers/schedule_batch.py``: ``retract_decode``,
  ``check_decode_mem``; ``python/sglang/global_config.py`` for the constants.

The rules, as modelled here:

- Admission (``PrefillAdder``): running requests reserve ``new_token_ratio x min(max_new
  - generated, 4096)`` tokens; a waiting request is admitted only if ``extend +
  min(max_new, 4096)`` is below what is free (free + evictable cache) minus every reserve
  so far, checked again with its cached prefix locked. A prefill batch holds at most
  ``chunked_prefill_size`` new tokens (the profile's ``max_num_batched_tokens``: 2,048 on
  GPUs under 25 GB, 8,192 above, SGLang's defaults too) and ``max_prefill_tokens``
  (16,384); the request that crosses the chunk budget is split and continues first in the
  next prefill batch.
- Latch: running out of tokens (``NO_TOKEN``) or of request slots sets ``batch_is_full``;
  no prefill is tried until the running batch shrinks (a request finishes, is aborted
  or retracted) or empties. New arrivals do not clear it.
- ``new_token_ratio``: starts at 0.7, falls by ``(0.7 - 0.7 x 0.14) / 600`` per decode
  step to the floor 0.098, is reset to 0.7 whenever the engine is idle, and after a
  retraction is set to ``min(1, (generated + 20 x n) / sum(max_new))`` over the ``n``
  requests left.
- Retraction: when a decode step cannot get a slot per request, requests are retracted
  fewest-generated-tokens first (ties: longest prompt first) until ``20 x n`` slots are
  free or one request is left; they go to the back of the waiting queue and recompute
  prompt + generated tokens on readmission.
- Queue order: longest cached prefix first (``lpm``, SGLang's default then) while at most
  128 wait; above that the queue keeps its previous order (SGLang's fcfs branch does not
  re-sort). A request whose cached prefix is at most 32 tokens but whose prompt shares 32
  or more tokens with one already ahead of it in the queue goes to the back (in-batch
  prefix caching).
- Gauges: ``num_queue_reqs`` and ``num_running_reqs`` are published at log points only:
  every prefill batch (queue after admission, running before it) and every 40th decode
  step (``decode_log_interval``). A probe between log points reads the last snapshot.

Differences that remain: when nothing else runs, the head of the queue is admitted if it
fits at all (a retracted request's reserve can exceed the pool, where SGLang would stall);
KV is paged in 16-token blocks (SGLang: one token per page), so
prefix hits and free space are counted in whole blocks; a retracted request's generated
blocks stay cached (SGLang frees them); ``max_running_requests`` follows SGLang's formula
(at least 2,048) and is never the binding limit on these profiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from skymesh_replica.engine.kv_cache import KVCacheError
from skymesh_replica.engine.status import Status

if TYPE_CHECKING:
    from collections import deque

    from skymesh_replica.engine.batch import Batch, EngineStats, Sequence, StepEvent
    from skymesh_replica.engine.kv_cache import BlockManager
    from skymesh_replica.engine.profiles import Profile


class Engine(Protocol):
    """What this scheduler uses of the engine it schedules for (:mod:`.core`'s
    ``Engine``), so that this module needs nothing of that one."""

    waiting: deque[Sequence]
    running: list[Sequence]
    kv: BlockManager
    profile: Profile
    block_size: int
    stats: EngineStats

    def timed(self, entries: list[tuple[Sequence, int]]) -> Batch: ...
    def blocks_for(self, tokens: int) -> int: ...
    def fast_forward(self, batch: Batch, max_steps: int) -> None: ...

# global_config.py (v0.4.x): default_init_new_token_ratio, *_min_new_token_ratio_factor,
# *_new_token_ratio_decay_steps, retract_decode_steps; schedule_policy.py's clip.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
CLIP_MAX_NEW_TOKENS = 4096
MAX_PREFILL_TOKENS = 16384  # server_args.max_prefill_tokens
LPM_MAX_QUEUE = 128  # above this many waiting, lpm falls back to fcfs
IN_BATCH_PREFIX_THRESHOLD = 32  # both IN_BATCH_PREFIX_CACHING_* thresholds, tokens
DECODE_LOG_INTERVAL = 40  # server_args.decode_log_interval


@dataclass(frozen=True, slots=True)
class SGLangParams:
    """SGLang's tunables (server arguments and environment defaults of v0.4.x)."""

    schedule_policy: str = "lpm"  # "lpm" or "fcfs"
    schedule_conservativeness: float = 1.0
    max_prefill_tokens: int = MAX_PREFILL_TOKENS
    decode_log_interval: int = DECODE_LOG_INTERVAL
    max_running_requests: int | None = None  # None: SGLang's formula from the KV size


def default_max_running(kv_tokens: int, context_len: int) -> int:
    """SGLang's ``max_running_requests`` when not given: the request pool's size
    (``min(max(kv / context x 512, 2048), 4096)``) capped at half the KV tokens."""
    pool = min(max(int(kv_tokens / context_len * 512), 2048), 4096)
    return min(kv_tokens // 2, pool)


class SGLangScheduler:
    """The scheduling half of an SGLang-mode :class:`Engine`; it owns the ratio, latch,
    chunked request and gauges, and works on the engine's queue, sequences and cache."""

    def __init__(self, engine: Engine, params: SGLangParams | None = None) -> None:
        p = params or SGLangParams()
        if p.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(f"unknown schedule_policy {p.schedule_policy!r}: lpm or fcfs")
        self.e = engine
        self.params = p
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * p.schedule_conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio
        self.batch_is_full = False
        self.chunked: Sequence | None = None
        prof = engine.profile
        self.chunk_size = prof.max_num_batched_tokens
        self.max_running = p.max_running_requests or default_max_running(
            prof.kv_capacity_tokens, prof.max_model_len)
        self.forward_ct_decode = 0
        self.queue_gauge = 0
        self.running_gauge = 0
        self.num_retractions = 0
        # Set when a decode batch lost requests: SGLang notices (and unlatches) in the
        # next update_running_batch, i.e. after that round's prefill attempt.
        self._shrunk = False
        self._log_values = (0, 0)  # what this decode batch's log points would publish
        self._last_decode = False  # the batch being run is a decode batch

    # -- hooks from the engine -------------------------------------------------------------
    def on_add(self, seq: Sequence) -> None:
        # SGLang caps max_new_tokens so prompt + output fit the pool (max_req_len - 1).
        room = self.e.profile.kv_capacity_tokens - 1 - seq.prompt_len
        seq.max_new_tokens = max(seq.output_len, min(seq.max_new_tokens, room))

    def on_abort(self, seq: Sequence) -> None:
        if seq is self.chunked:
            self.chunked = None
        elif seq in self.e.running:
            self._shrunk = True

    def on_complete(self, batch: Batch, events: list[StepEvent]) -> None:
        finished = any(ev.finished for ev in events)
        if self._last_decode:
            # The first step's decay was applied when the batch was scheduled.
            self._decay(batch.num_steps - 1)
            before = self.forward_ct_decode
            self.forward_ct_decode += batch.num_steps
            interval = self.params.decode_log_interval
            if self.forward_ct_decode // interval > before // interval:
                self.queue_gauge, self.running_gauge = self._log_values
            if finished:
                self._shrunk = True
        elif finished:
            # A request that ended with its prefill leaves before the next prefill try.
            self.batch_is_full = False

    # -- scheduling --------------------------------------------------------------------------
    def schedule(self, max_steps: int) -> Batch | None:
        e = self.e
        if not self._decoding() and self.chunked is None:
            self.batch_is_full = False
        entries = self._prefill()
        self._last_decode = False
        if entries:
            return e.timed(entries)
        running = self._decoding()
        if not running:
            # Idle: SGLang re-initialises the ratio when it has nothing to run.
            self.new_token_ratio = self.init_ratio
            self.batch_is_full = False
            return None
        initial = len(running)
        retracted = self._check_decode_mem(running)
        if retracted:
            running = self._decoding()
        else:
            self._decay(1)
        if len(running) < initial or self._shrunk:
            self.batch_is_full = False
        self._shrunk = False
        kv = e.kv
        entries = []
        for seq in running:
            if e.blocks_for(seq.num_computed + 1) > len(seq.blocks):
                seq.blocks.extend(kv.allocate(1))
            entries.append((seq, 1))
        batch = e.timed(entries)
        self._log_values = (len(e.waiting), len(running))
        if max_steps > 1 and not retracted and self._steady():
            steps = max_steps
            interval = self.params.decode_log_interval
            if self._log_values != (self.queue_gauge, self.running_gauge):
                # Stop at the next log point so the new snapshot appears on time.
                steps = min(steps, interval - self.forward_ct_decode % interval)
            e.fast_forward(batch, steps)
        self._last_decode = True
        return batch

    def _decoding(self) -> list[Sequence]:
        return [s for s in self.e.running if s is not self.chunked]

    def _steady(self) -> bool:
        """Nothing but a finish can change the next decode steps: no chunk to continue,
        and no prefill will be tried (latched, or nothing waits)."""
        return self.chunked is None and (self.batch_is_full or not self.e.waiting)

    def _decay(self, steps: int) -> None:
        if steps > 0:
            self.new_token_ratio = max(self.new_token_ratio - steps * self.decay,
                                       self.min_ratio)

    # -- prefill (get_new_batch_prefill + PrefillAdder) -----------------------------------------
    def _prefill(self) -> list[tuple[Sequence, int]]:
        e = self.e
        if (self.batch_is_full or not e.waiting) and self.chunked is None:
            return []
        running = self._decoding()
        running_bs = len(running)
        if running_bs >= self.max_running:
            self.batch_is_full = True
            return []
        kv, bs = e.kv, e.block_size
        self._order_queue()
        reserve = sum(self.new_token_ratio * min(s.max_new_tokens - s.num_output,
                                                 CLIP_MAX_NEW_TOKENS) for s in running)
        rem_input = self.params.max_prefill_tokens
        rem_chunk = self.chunk_size
        entries: list[tuple[Sequence, int]] = []
        chunked = self.chunked
        if chunked is not None:
            left = chunked.num_tokens - chunked.num_computed
            n = min(left, rem_chunk)
            room = (kv.num_free + len(chunked.blocks)) * bs - chunked.num_computed
            n = min(n, room)
            if n > 0:
                need = e.blocks_for(chunked.num_computed + n) - len(chunked.blocks)
                if need > 0:
                    chunked.blocks.extend(kv.allocate(need))
                entries.append((chunked, n))
                if n >= left:
                    # Its last chunk: from the next round on it decodes with the others.
                    reserve += min(chunked.max_new_tokens, CLIP_MAX_NEW_TOKENS)
                    self.chunked = None
                rem_input -= n
                rem_chunk -= n
        admitted: list[Sequence] = []
        for seq in list(e.waiting):
            if rem_input <= 0 or rem_chunk <= 0:
                break
            if running_bs + len(admitted) >= self.max_running:
                self.batch_is_full = True
                break
            # Matched again: blocks allocated for requests admitted before it may have
            # evicted part of the prefix the ordering saw.
            hit_blocks = kv.match_prefix(self._lookup(seq))
            hit = len(hit_blocks) * bs
            extend = seq.num_tokens - hit
            future = min(seq.max_new_tokens, CLIP_MAX_NEW_TOKENS)
            total = extend + future
            # Liveness: with nothing else in the engine the request goes in if it fits at
            # all (a retracted one can reserve more than the pool; SGLang would stall).
            alone = not running and not entries
            if total >= kv.num_free * bs - reserve and not alone:
                self.batch_is_full = True
                break
            if extend > rem_input and (entries or admitted):
                break
            locked = kv.num_evictable_in(hit_blocks)
            if total > (kv.num_free - locked) * bs - reserve and not alone:
                self.batch_is_full = True
                break
            if extend <= rem_chunk:
                n = extend
            else:
                n = rem_chunk  # > 0: checked at the top of the loop
                future = 0
            need = e.blocks_for(hit + n) - len(hit_blocks)
            if need + locked > kv.num_free:  # whole blocks: SGLang counts single tokens
                self.batch_is_full = True
                break
            kv.acquire(hit_blocks)
            seq.blocks = list(hit_blocks)
            if need > 0:
                seq.blocks.extend(kv.allocate(need))
            seq.num_computed = hit
            self._start(seq, hit)
            admitted.append(seq)
            entries.append((seq, n))
            if n < extend:
                self.chunked = seq
            reserve += future
            rem_input -= n
            rem_chunk -= n
            if kv.num_free * bs - reserve <= 0:
                self.batch_is_full = True
                break
        if admitted:
            gone = {id(s) for s in admitted}
            e.waiting = type(e.waiting)(s for s in e.waiting if id(s) not in gone)
        if entries:
            # log_prefill_stats: the queue after admission, the running batch before it.
            self.queue_gauge = len(e.waiting)
            self.running_gauge = running_bs
        return entries

    def _lookup(self, seq: Sequence) -> list[int] | tuple[int, ...]:
        # At least one token is recomputed, so the step yields logits (SGLang as vLLM).
        hashes = seq.block_hashes
        return list(hashes[: (seq.num_tokens - 1) // self.e.block_size])

    def _start(self, seq: Sequence, hit: int) -> None:
        seq.status = Status.RUNNING
        self.e.running.append(seq)
        st = self.e.stats
        st.prefix_query_tokens += seq.num_tokens
        st.prefix_hit_tokens += hit
        if seq.first_hit_tokens < 0:
            seq.first_hit_tokens = hit
            st.prompt_tokens += seq.prompt_len

    def _order_queue(self) -> None:
        """Sort the waiting queue as ``calc_priority`` does (stable, in place)."""
        e = self.e
        if self.params.schedule_policy != "lpm" or len(e.waiting) > LPM_MAX_QUEUE:
            return
        kv = e.kv
        bs = e.block_size
        threshold_blocks = -(-IN_BATCH_PREFIX_THRESHOLD // bs)
        hits: dict[int, int] = {}
        seen: set[int] = set()  # block hashes of prompts already ahead in this pass
        back: set[int] = set()
        for seq in e.waiting:
            lookup = self._lookup(seq)
            hit = len(kv.match_prefix(lookup)) * bs
            hits[id(seq)] = hit
            if hit <= IN_BATCH_PREFIX_THRESHOLD:
                shared = 0
                for h in lookup:  # chained hashes: a hit at j means the whole prefix matched
                    if h not in seen:
                        break
                    shared += 1
                if shared >= threshold_blocks:
                    back.add(id(seq))
                else:
                    seen.update(lookup)
        # De-prioritised requests sort last (SGLang's key: infinity), the rest by hit.
        order = sorted(e.waiting, key=lambda s: float("inf") if id(s) in back
                       else -hits[id(s)])
        e.waiting = type(e.waiting)(order)

    # -- decode memory (check_decode_mem + retract_decode) --------------------------------------
    def _check_decode_mem(self, running: list[Sequence]) -> bool:
        """Retract requests if the next decode step lacks room; True if any was."""
        e = self.e
        kv = e.kv
        if self._blocks_short(running) <= 0:
            return False
        order = sorted(running, key=lambda s: (s.num_output, -s.prompt_len), reverse=True)
        first = True
        while first or kv.num_free * e.block_size < len(order) * RETRACT_DECODE_STEPS \
                or self._blocks_short(order) > 0:
            if len(order) == 1:
                break
            first = False
            self._retract(order.pop())
        if self._blocks_short(order) > 0 and self.chunked is not None:
            self._retract(self.chunked)  # the half-prefilled request holds the rest
            self.chunked = None
        if self._blocks_short(order) > 0:
            raise KVCacheError("a lone decoding request does not fit the KV cache")
        decoded = sum(s.num_output for s in order)
        limit = sum(s.max_new_tokens for s in order)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(order))
                                   / max(1, limit))
        self.batch_is_full = False
        return True

    def _blocks_short(self, seqs: list[Sequence]) -> int:
        e = self.e
        need = sum(1 for s in seqs if e.blocks_for(s.num_computed + 1) > len(s.blocks))
        return need - e.kv.num_free

    def _retract(self, seq: Sequence) -> None:
        e = self.e
        e.running.remove(seq)
        e.kv.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        e.stats.num_preemptions += 1
        self.num_retractions += 1
        e.waiting.append(seq)
