"""Runs the clock-free :class:`~.engine.core.Engine` in real (optionally scaled) time.

One asyncio task loops ``schedule -> sleep(batch.duration) -> complete`` and hands each
step's new tokens to the request's :class:`RequestHandle`, which HTTP handlers iterate.
Steps are chained on deadlines (the next step starts when the previous one was due to end,
not when Python got round to it), so per-step overhead does not stretch the emulated GPU's
timeline; after a stall longer than ``max_lag`` the chain restarts from now instead of
bursting through the missed steps.

Generated text is synthetic but deterministic: every output token is one word of a fixed
list, drawn from an RNG seeded by ``(seed, request counter)`` or by the request's own
``seed``. The whole output is drawn at submission, so the request's block hashes cover
prompt + output and the engine caches the answer's blocks too: a follow-up turn that
sends the answer back re-tokenises to the same ids (every word or mark is one token, see
:data:`WORDS`) and hits them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
from collections import deque
from collections.abc import Callable, Sequence

from skymesh.prefix.prompt import Tokenizer, get_tokenizer
from skymesh_replica.engine.core import Engine, StepEvent
from skymesh_replica.engine.core import Sequence as EngineSeq
from skymesh_replica.engine.hashing import hash_token_blocks

log = logging.getLogger(__name__)

# Common English words; each is kept only if " word" is a single token, so decoding and
# re-encoding an answer gives back exactly its ids.
_WORDS_TEXT = (
    "the of and to in is was for that on with as by at from his it an were are which "
    "this be or has had not but first one their its new after who they have her she two "
    "been other when there all during into school time may years more most only over city "
    "some world would where later up such used many can state about national out known "
    "university united then made also because between under each high same while well "
    "people these team through part being since world government three both season called "
    "against film year work series could what including several music number early second "
    "until four area life south north before game great under group history however took "
    "long following public well american west east side place system name water small "
    "found country general family house because church local main power best just left "
    "line make set end center book point held good form five white village around does "
    "order club much based days back top station without took within program development "
    "again major light market river language short model open free field data question "
    "answer simple clear result value change source server cache token request latency"
)
WORDS = tuple(dict.fromkeys(_WORDS_TEXT.split()))
PUNCTUATION = (",", ".")


class ContextLengthError(ValueError):
    """The prompt plus the requested output do not fit the model's context."""


def _vocabulary(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    words: list[int] = []
    seen: set[int] = set()
    for w in WORDS:
        ids = tokenizer.encode(" " + w)
        if len(ids) == 1 and ids[0] not in seen:
            seen.add(ids[0])
            words.append(ids[0])
    punct = [ids[0] for p in PUNCTUATION if len(ids := tokenizer.encode(p)) == 1]
    if not words:
        raise RuntimeError("tokenizer maps no output word to a single token")
    return words, punct


def synth_output(
    rng: random.Random, n: int, words: Sequence[int], punct: Sequence[int]
) -> list[int]:
    """``n`` token ids of word salad with a comma or full stop every ten words or so.

    Punctuation never follows punctuation (",." would re-tokenise as one piece) and never
    comes first (it would glue onto the assistant header's newline).
    """
    out = rng.choices(words, k=n)
    if punct:
        for i in range(1, n):
            if rng.random() < 0.08 and out[i - 1] not in punct:
                out[i] = rng.choice(punct)
    return out


def resolve_output_len(
    rng: random.Random,
    draw: Callable[[random.Random], int],
    prompt_len: int,
    max_model_len: int,
    *,
    max_tokens: int | None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> tuple[int, str]:
    """How many tokens a request generates and its finish reason ("length" or "stop").

    With ``ignore_eos`` (vLLM's benchmark flag) a request runs to its limit; otherwise it
    "stops" at a length drawn from the profile, clamped to ``[min_tokens, limit]``. The
    limit is ``max_tokens`` or, like vLLM, whatever context is left.
    """
    room = max_model_len - prompt_len
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        asked = max_tokens if max_tokens is not None else 1
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} in "
            "the completion). Please reduce the length of the prompt or completion."
        )
    limit = max_tokens if max_tokens is not None else room
    n = limit if ignore_eos else min(limit, max(draw(rng), min_tokens))
    return n, ("length" if n >= limit else "stop")


class RequestHandle:
    """One request as its HTTP handler sees it: async-iterate token-id chunks to the end.

    Each item is the ids one engine step produced for this request. Iteration stops when
    the request finishes or is aborted; ``finish_reason`` is then "stop", "length" or
    "abort".
    """

    def __init__(
        self,
        seq: EngineSeq,
        output_ids: list[int],
        finish_reason: str,
        arrival: float,
    ) -> None:
        self.seq = seq
        self.output_ids = output_ids
        self._final_reason = finish_reason
        self.finish_reason: str | None = None
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_delivered = 0
        self._chunks: deque[list[int]] = deque()
        self._waiter: asyncio.Future[None] | None = None

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def prompt_tokens(self) -> int:
        return self.seq.prompt_len

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache at first admission (0 before it)."""
        return max(0, self.seq.first_hit_tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def exhausted(self) -> bool:
        """Ended and every chunk taken: the chunk just returned was the last one."""
        return self.finish_reason is not None and not self._chunks

    # -- driver side -------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _push(self, ids: list[int], now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        self.num_delivered += len(ids)
        self._chunks.append(ids)
        self._wake()

    def _end(self, reason: str, now: float) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_time = now
            self._wake()

    # -- consumer side -----------------------------------------------------------------
    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> list[int]:
        while not self._chunks:
            if self.finish_reason is not None:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._chunks.popleft()


FinishListener = Callable[[RequestHandle], None]


class RealtimeDriver:
    """Drives one engine on the running asyncio loop's clock (``loop.time()``)."""

    def __init__(
        self,
        engine: Engine,
        *,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
        time_scale: float = 1.0,
        max_lag: float = 0.25,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.engine = engine
        self.tokenizer = tokenizer or get_tokenizer()
        self.seed = seed
        self.time_scale = time_scale
        self.max_lag = max_lag
        self._words, self._punct = _vocabulary(self.tokenizer)
        self._counter = itertools.count()
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.finish_listeners: list[FinishListener] = []
        # Called whenever the engine's waiting/running/KV figures may have changed (a
        # request added or aborted, a step scheduled or completed): lagged gauges sample.
        self.state_listeners: list[Callable[[], None]] = []

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._closed:
            raise RuntimeError("driver is closed")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine")

    async def close(self) -> None:
        """Stop the engine task and end every open stream as aborted."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for rid in list(self._handles):
            self.abort(rid)

    @property
    def num_open(self) -> int:
        return len(self._handles)

    # -- requests ----------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        request_id: str | None = None,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        seed: int | None = None,
    ) -> RequestHandle:
        """Queue a request; raises :class:`ContextLengthError` if it cannot fit."""
        self.start()
        n = next(self._counter)
        rid = request_id or f"req-{n}"
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if rid in self._handles:
            raise ValueError(f"duplicate request id {rid!r}")
        # String seeds hash with SHA-512, so streams are stable across processes and runs.
        rng = random.Random(f"{self.seed}/{n}" if seed is None else f"{self.seed}/s{seed}")
        profile = self.engine.profile
        out_len, reason = resolve_output_len(
            rng,
            profile.draw_output_len,
            len(prompt_ids),
            profile.max_model_len,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
        )
        output_ids = synth_output(rng, out_len, self._words, self._punct)
        token_ids = list(prompt_ids) + output_ids
        seq = EngineSeq(
            request_id=rid,
            prompt_len=len(prompt_ids),
            output_len=out_len,
            # The limit the client set; without one the engine puts what the context leaves.
            max_new_tokens=max_tokens or 0,
            block_hashes=hash_token_blocks(token_ids, self.engine.block_size),
            token_ids=token_ids,
        )
        try:
            self.engine.add(seq)
        except ValueError as exc:
            # Past the checks above, add() only refuses what cannot fit (context or KV).
            raise ContextLengthError(str(exc)) from None
        handle = RequestHandle(seq, output_ids, reason, asyncio.get_running_loop().time())
        seq.payload = handle
        self._handles[rid] = handle
        self._wake.set()
        self._state_changed()
        return handle

    def _state_changed(self) -> None:
        for listener in self.state_listeners:
            listener()

    def abort(self, request_id: str) -> bool:
        """Drop a request from the engine and end its stream; False if already over."""
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return False
        self.engine.abort(request_id)
        handle._end("abort", asyncio.get_running_loop().time())
        self._state_changed()
        log.info("request %s aborted after %d tokens", request_id, handle.num_delivered)
        return True

    # -- the step loop -----------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        next_start: float | None = None
        while True:
            batch = engine.schedule()
            if batch is None:
                next_start = None
                self._wake.clear()
                await self._wake.wait()
                continue
            self._state_changed()  # admitted: waiting -> running
            now = loop.time()
            start = now if next_start is None or now - next_start > self.max_lag else next_start
            deadline = start + batch.duration * self.time_scale
            # sleep(0) when behind still yields, so handlers get to write between steps.
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            next_start = deadline
            self._deliver(engine.complete(batch), loop.time())
            self._state_changed()

    def _deliver(self, events: list[StepEvent], now: float) -> None:
        for ev in events:
            handle = ev.seq.payload
            if not isinstance(handle, RequestHandle):
                continue
            end = ev.seq.num_output
            handle._push(handle.output_ids[end - ev.new_tokens : end], now)
            if ev.finished:
                self._handles.pop(handle.request_id, None)
                handle._end(handle._final_reason, now)
                self._log_finished(handle)
                for listener in self.finish_listeners:
                    listener(handle)

    @staticmethod
    def _log_finished(h: RequestHandle) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        ttft = (h.first_token_time or h.arrival) - h.arrival
        e2e = (h.finish_time or h.arrival) - h.arrival
        log.info(
            "request %s %s prompt=%d cached=%d output=%d ttft=%.3fs e2e=%.3fs preempted=%d",
            h.request_id, h.finish_reason, h.prompt_tokens, h.cached_tokens,
            h.num_delivered, ttft, e2e, h.seq.num_preemptions,
        )
