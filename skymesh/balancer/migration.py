"""Live migration of streaming requests (GoodServe sec. 3.4): the pure parts.

A policy with ``wants_migration`` (goodserve) is asked every ``migration_interval_s``
about each streaming request that has produced a token (``Policy.migrate``). When it names
another replica, the balancer (``skymesh.balancer.moves``) cancels the upstream request,
re-submits it there as ``/v1/completions`` with ``prompt`` = the original prompt's token
ids + the ids of the tokens the client has already received (both from the new
replica's ``/tokenize``, so the model's own tokenizer and chat template decide), and
``max_tokens`` (``min_tokens``) reduced by what was sent; and splices the new response's
events into the client's stream: the role chunk dropped, ``id`` / ``object`` / ``created``
/ ``model`` rewritten to the original's, a completions chunk turned into a chat chunk for
a chat client, usage rewritten to count the original prompt and every generated token.
The client sees one response.

What is not migrated, and why:

- non-streaming requests: the client has received nothing, but the balancer does not see
  their progress (no tokens to carry over), so a move would restart from scratch;
- requests asking for ``logprobs``, tools or structured output (``response_format``,
  ``guided_*``), ``n`` > 1, ``echo``, ``best_of`` or ``suffix``: the continuation could not
  reproduce their per-token extras or grammar state;
- requests forwarded to a peer region (the peer owns them).

Text-level splicing has one known limit with real BPE tokenizers: re-tokenising the
generated text may merge tokens differently at the edges than the model produced them
(the ids come from ``/tokenize``, not from the stream). The replica emulator's outputs
re-tokenise exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from skymesh.balancer.dispatch import Ticket
from skymesh.balancer.upstream import Reply
from skymesh.policies.base import RequestTiming, RouteRequest

# vLLM's and OpenAI's legacy default for /v1/completions without max_tokens.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Body fields carried over to the continuation: sampling and stopping controls that mean
# the same on /v1/completions. Everything else (messages, tools, ...) is either rebuilt
# or makes the request non-migratable (see ``migratable``).
_CARRIED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
            "logit_bias", "user", "skip_special_tokens", "spaces_between_special_tokens",
            "include_stop_str_in_output", "stream_options", "priority")
_BLOCKING = ("logprobs", "top_logprobs", "tools", "functions", "response_format",
             "guided_json", "guided_regex", "guided_choice", "guided_grammar",
             "structured_outputs", "echo", "best_of", "suffix", "prompt_logprobs")


def migratable(body: dict[str, Any]) -> bool:
    """Whether a streaming request's continuation can be produced faithfully."""
    if any(body.get(k) not in (None, False) for k in _BLOCKING):
        return False
    n = body.get("n")
    return n is None or n == 1


def max_output(body: dict[str, Any], kind: str) -> int | None:
    """The request's output cap as the engine applies it (None: up to the context)."""
    if kind == "chat":
        v = body.get("max_completion_tokens") or body.get("max_tokens")
        return v if isinstance(v, int) else None
    if "max_tokens" not in body:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    v = body["max_tokens"]
    return v if isinstance(v, int) else None


def continuation_body(body: dict[str, Any], kind: str, prompt_ids: list[int],
                      generated_ids: list[int]) -> dict[str, Any] | None:
    """The ``/v1/completions`` body that continues the request after ``generated_ids``,
    or None when nothing is left to generate."""
    cap = max_output(body, kind)
    left = None if cap is None else cap - len(generated_ids)
    if left is not None and left < 1:
        return None
    out: dict[str, Any] = {k: body[k] for k in _CARRIED if k in body}
    out["model"] = body["model"]
    out["prompt"] = [*prompt_ids, *generated_ids]
    # Explicit null: "up to the context", where an absent field would mean 16.
    out["max_tokens"] = left
    mn = body.get("min_tokens")
    if isinstance(mn, int) and mn > 0:
        out["min_tokens"] = max(0, mn - len(generated_ids))
    out["stream"] = True
    return out


def tokenize_requests(body: dict[str, Any], kind: str, generated_text: str
                      ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Bodies for ``/tokenize`` (vLLM's): the original prompt (None when the client sent
    token ids already) and the generated text (no special tokens: it continues a
    sequence)."""
    model = body["model"]
    prompt: dict[str, Any] | None
    if kind == "chat":
        prompt = {"model": model, "messages": body["messages"], "add_generation_prompt": True}
    else:
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
            p = p[0]
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            prompt = None
        else:
            prompt = {"model": model, "prompt": p}
    gen = {"model": model, "prompt": generated_text, "add_special_tokens": False}
    return prompt, gen


def given_prompt_ids(body: dict[str, Any]) -> list[int]:
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
        p = p[0]
    return [int(t) for t in p]


def migrated_route(route: RouteRequest, generated: int, elapsed: float) -> RouteRequest:
    """The request as it is re-offered: prompt + generated tokens to prefill, what is
    left of its predicted output, output cap and deadline, kept in this region (as the
    simulator's ``SimBalancer._migrate``)."""
    predicted = route.predicted_output_tokens
    hint = route.output_len_hint
    return replace(
        route,
        prompt_len=route.prompt_len + generated,
        predicted_output_tokens=None if predicted is None else (
            predicted - generated if predicted > generated
            else max(1, math.ceil(0.2 * predicted))),
        output_len_hint=None if hint is None else max(1, hint - generated),
        deadline_s=None if route.deadline_s is None else route.deadline_s - elapsed,
        # The continuation needs a replica's /tokenize and splices into a stream relayed
        # here: it is served by this region's replicas, never forwarded to a peer.
        forwarded=True,
    )


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SSEFramer:
    """Cuts a byte stream into whole SSE events (each ending in a blank line), so a stream
    can be cut over between two events and never inside one."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        if b"\n\n" not in buf:
            self._buf = buf
            return []
        parts = buf.split(b"\n\n")
        self._buf = parts.pop()
        return [p + b"\n\n" for p in parts if p]


def _payload(event: bytes) -> bytes | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


# ``LiveStream.moving_to`` of a stream resumed after its replica broke: the policy picks
# the replica when the continuation's ticket is dispatched.
RESUME_ANYWHERE = "*"


@dataclass(eq=False, slots=True)
class LiveStream:
    """One migratable streaming request as the balancer relays it."""

    ticket: Ticket
    kind: str  # the client's endpoint: "chat" or "completion"
    body: dict[str, Any]
    dispatched_at: float
    first_at: float | None = None  # first token of the current attempt
    tokens: int = 0  # token events the client has received, all attempts together
    attempt_tokens: int = 0  # of them, in the current attempt
    texts: list[str] = field(default_factory=list)
    head: dict[str, Any] | None = None  # id, object, created, model the client sees
    finished: bool = False  # a finish_reason or [DONE] went to the client
    done: bool = False  # [DONE] went to the client
    moving_to: str | None = None  # set by the re-check: cut over to this replica
    moved_from: str | None = None
    spliced: bool = False  # the current upstream is a continuation (rewrite its events)
    upstream: Reply | None = None
    prompt_ids: list[int] | None = None
    generated_ids: int = 0  # tokens carried into the current continuation
    usage: dict[str, Any] | None = None
    migrations: int = 0
    resumes: int = 0  # continuations after the replica broke mid-stream

    def timing(self, now: float, finished: bool = False) -> RequestTiming:
        return RequestTiming(now=now, dispatched_at=self.dispatched_at,
                             first_token_at=self.first_at, output_tokens=self.attempt_tokens,
                             finished=finished, prompt_tokens=self.ticket.route.prompt_len)

    @property
    def generated_text(self) -> str:
        return "".join(self.texts)

    def accept(self, event: bytes) -> bytes | None:
        """One upstream event: update what the client has received and return the bytes
        to write (the event itself, or rewritten for a continuation; None: drop it)."""
        data = _payload(event)
        if data is None:
            return event if not self.spliced else None  # comments, keep-alives
        if data == b"[DONE]":
            self.finished = self.done = True
            return event
        try:
            obj = json.loads(data)
        except ValueError:
            return event
        if not isinstance(obj, dict) or "error" in obj:
            return event
        choices = obj.get("choices")
        if self.head is None and not self.spliced and "id" in obj:
            self.head = {k: obj.get(k) for k in ("id", "object", "created", "model")}
        if not choices:
            usage = obj.get("usage")
            if not self.spliced:
                return event
            if not isinstance(usage, dict):
                return None
            return sse({**self._head(), "choices": [], "usage": self._usage(usage)})
        ch = choices[0] if isinstance(choices[0], dict) else {}
        finish = ch.get("finish_reason")
        if "delta" in ch:
            delta = ch["delta"] if isinstance(ch["delta"], dict) else {}
            text = delta.get("content")
            role = "role" in delta
        else:
            text = ch.get("text")
            role = False
        if self.spliced and role and not text:
            return None  # the continuation's own role chunk: the client has one
        if text:
            self.texts.append(text)
        # A token event: text in a non-role chunk (a token may decode to ""), or a role
        # chunk that carries text; not a bare end marker ("" with a finish_reason).
        if text or (text is not None and not role and finish is None):
            self.tokens += 1
            self.attempt_tokens += 1
        if finish is not None:
            self.finished = True
        if not self.spliced:
            return event
        return sse(self.client_chunk(text or "", finish))

    def _head(self) -> dict[str, Any]:
        h = self.head or {}
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": h.get("id") or f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-"
                f"{self.ticket.route.request_id}",
                "object": h.get("object") or obj, "created": h.get("created"),
                "model": h.get("model") or self.body.get("model")}

    def client_chunk(self, text: str, finish: str | None) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text},
                                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(), "choices": [choice]}

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation's usage as the client's one response: the original prompt, and
        every token generated (before the cut-over and after)."""
        prompt = len(self.prompt_ids or ())
        try:
            completion = self.generated_ids + int(usage.get("completion_tokens") or 0)
        except (TypeError, ValueError):
            completion = self.generated_ids
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}
