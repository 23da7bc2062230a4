"""Request intake: from an OpenAI request body to what the router needs.

The prompt is rendered to one canonical string with :func:`skymesh.prefix.prompt.render_chat`
(the same rendering the replica uses) and cut into chained chunk keys for the prefix-aware
policies. The balancer never tokenises on the hot path: the prompt length in tokens is
estimated from characters (about 4 per token for English BPE vocabularies), which is all
the policies need for relative costs. The original body bytes are forwarded unchanged.

Affinity key: the ``X-Session-ID`` header, else the body's ``user``. Deadline: the
``X-SkyMesh-Deadline-Ms`` header (milliseconds from now) or an SLO class named in the
configured header (``slo.classes``), the tighter of the two: it caps how long the request
may wait in the balancer's queue and reaches the policy as ``RouteRequest.deadline_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skymesh.balancer.errors import BadRequest
from skymesh.net.jsonbody import JsonBodyError, loads_body
from skymesh.policies.base import RouteRequest
from skymesh.prefix.prompt import PromptError, completion_prompt, render_chat

CHARS_PER_TOKEN = 4
SESSION_HEADER = "X-Session-ID"
DEADLINE_HEADER = "X-SkyMesh-Deadline-Ms"


# Not frozen: built once per request and never changed, and a frozen dataclass's
# __init__ sets each field through object.__setattr__ (0.4 us more per request here).
@dataclass(slots=True)
class Intake:
    model: str
    stream: bool
    prompt_text: str
    affinity_key: str | None
    deadline_ms: float | None
    body: dict[str, Any]
    kind: str = "chat"  # "chat" or "completion": the endpoint it came in on


def parse_request(kind: str, raw: bytes, headers: Mapping[str, str]) -> Intake:
    """``kind`` is "chat" or "completion". Raises BadRequest naming the bad field."""
    try:
        body = loads_body(raw)
    except JsonBodyError as exc:
        raise BadRequest(str(exc)) from None
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
        # Engines (vLLM, SGLang, ours) need at least one token; failing here saves a hop.
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise BadRequest(f"'{field}' must be a positive integer", param=field)
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
    return Intake(model, stream, text, affinity, deadline_ms, body, kind)


def request_deadline(intake: Intake, headers: Mapping[str, str], header: str,
                     classes: Mapping[str, float], default: str | None = None
                     ) -> float | None:
    """Seconds the request has end to end: its ``X-SkyMesh-Deadline-Ms``, its SLO class's
    deadline (``header`` names the class; ``default`` when it names none), the tighter of
    the two, or None. An SLO class that is not configured is a 400 naming it."""
    deadline = intake.deadline_ms / 1000.0 if intake.deadline_ms is not None else None
    if not classes:
        return deadline
    name = headers.get(header) or default
    if name is None:
        return deadline
    seconds = classes.get(name)
    if seconds is None:
        raise BadRequest(f"{header}: unknown SLO class {name!r}; configured classes: "
                         f"{', '.join(sorted(classes))}")
    return seconds if deadline is None else min(deadline, seconds)


def prediction_input(intake: Intake, prompt_len: int) -> tuple[str, int, int]:
    """(text, prompt tokens, history tokens) as the length predictor was trained on them:
    the last user turn's text, its length and the length of the conversation before it
    (ShareGPT turns, the lab's training data). Lengths are the balancer's estimates."""
    text = intake.prompt_text
    if intake.kind == "chat":
        messages: list[Any] = intake.body.get("messages") or []
        for msg in reversed(messages if isinstance(messages, list) else []):
            if isinstance(msg, dict) and msg.get("role") == "user":
                content: Any = msg.get("content")
                if isinstance(content, list):  # validated text parts (render_chat)
                    content = "\n".join(str(p.get("text", "")) for p in content
                                        if isinstance(p, dict))
                if isinstance(content, str):
                    text = content
                break
    turn = max(1, len(text) // CHARS_PER_TOKEN)
    return text, min(turn, prompt_len), max(0, prompt_len - turn)


_prompt_keys: Callable[[str], Sequence[int]] | None = None


def _keys_of() -> Callable[[str], Sequence[int]]:
    """``skymesh.prefix.keys.prompt_keys``, imported at its first use: the keys need numpy,
    which a balancer whose policy reads no keys (and the workers' supervisor) never
    loads. Kept here after that: an import statement per request cost 0.7 us."""
    global _prompt_keys
    if _prompt_keys is None:
        from skymesh.prefix.keys import prompt_keys

        _prompt_keys = prompt_keys
    return _prompt_keys


def route_request(request_id: str, intake: Intake, *, prefix_keys: bool = True,
                  deadline_s: float | None = None) -> RouteRequest:
    """``prefix_keys``: hash the prompt into chunk keys (only policies that read them)."""
    keys: Sequence[int] = ()
    if prefix_keys:
        keys = _keys_of()(intake.prompt_text)
    body = intake.body
    out = body.get("max_completion_tokens") or body.get("max_tokens")
    return RouteRequest(
        request_id=request_id,
        model=intake.model,
        prompt_len=max(1, len(intake.prompt_text) // CHARS_PER_TOKEN),
        prefix_keys=keys,
        affinity_key=intake.affinity_key,
        output_len_hint=out if isinstance(out, int) else None,
        deadline_s=deadline_s,
    )
