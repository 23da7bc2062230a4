"""Request intake: from an OpenAI request body to what the router needs.

The prompt is rendered to one canonical string with :func:`skymesh.prompt.render_chat`
(the same rendering the replica uses) and cut into chained chunk keys for the prefix-aware
policies. The balancer never tokenises on the hot path: the prompt length in tokens is
estimated from characters (about 4 per token for English BPE vocabularies), which is all
the policies need for relative costs. The original body bytes are forwarded unchanged.

Affinity key: the ``X-Session-ID`` header, else the body's ``user``. Deadline: the
``X-SkyMesh-Deadline-Ms`` header (milliseconds from now) caps how long the request may
wait in the balancer's queue.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from skymesh.balancer.errors import BadRequest
from skymesh.policies.base import RouteRequest
from skymesh.prompt import PromptError, completion_prompt, render_chat

CHARS_PER_TOKEN = 4
SESSION_HEADER = "X-Session-ID"
DEADLINE_HEADER = "X-SkyMesh-Deadline-Ms"


@dataclass(frozen=True, slots=True)
class Intake:
    model: str
    stream: bool
    prompt_text: str
    affinity_key: str | None
    deadline_ms: float | None
    body: dict[str, Any]


def parse_request(kind: str, raw: bytes, headers: Mapping[str, str]) -> Intake:
    """``kind`` is "chat" or "completion". Raises BadRequest naming the bad field."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    try:
        if kind == "chat":
            if "messages" not in body:
                raise BadRequest("'messages' is required", param="messages")
            text = render_chat(body["messages"])
        else:
            if "prompt" not in body:
                raise BadRequest("'prompt' is required", param="prompt")
            p = completion_prompt(body["prompt"])
            text = p.text if p.text is not None else " ".join(map(str, p.token_ids or ()))
    except PromptError as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    for field in ("max_tokens", "max_completion_tokens"):
        v = body.get(field)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise BadRequest(f"'{field}' must be a non-negative integer", param=field)
    affinity = headers.get(SESSION_HEADER)
    if not affinity:
        user = body.get("user")
        affinity = user if isinstance(user, str) and user else None
    deadline_ms: float | None = None
    raw_deadline = headers.get(DEADLINE_HEADER)
    if raw_deadline is not None:
        try:
            deadline_ms = float(raw_deadline)
        except ValueError:
            raise BadRequest(f"{DEADLINE_HEADER} must be a number of milliseconds") from None
        if not deadline_ms > 0:
            raise BadRequest(f"{DEADLINE_HEADER} must be positive")
    return Intake(model, stream, text, affinity, deadline_ms, body)


def route_request(request_id: str, intake: Intake, *, prefix_keys: bool = True
                  ) -> RouteRequest:
    """``prefix_keys``: hash the prompt into chunk keys (only policies that read them)."""
    from skymesh.prefix.keys import text_prefix_keys

    body = intake.body
    out = body.get("max_completion_tokens") or body.get("max_tokens")
    return RouteRequest(
        request_id=request_id,
        model=intake.model,
        prompt_len=max(1, len(intake.prompt_text) // CHARS_PER_TOKEN),
        prefix_keys=text_prefix_keys(intake.prompt_text) if prefix_keys else (),
        affinity_key=intake.affinity_key,
        output_len_hint=out if isinstance(out, int) else None,
    )
