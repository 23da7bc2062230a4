"""The text a replica generated, read back from the response the balancer relayed.

Prefix policies record a finished request's prompt *and* output in their trie
(``Policy.on_cached``), because the replica's KV cache holds both and the next turn of a
conversation resends both: the next prompt starts with this prompt's text (its ChatML
ends with the assistant header, see :func:`skymesh.prompt.render_chat`) followed by the
reply. So the balancer keeps the raw response bytes it relayed, up to a budget, and after
the client has its last byte turns them into the reply's text.

Only a *prefix* of the reply is ever needed, and only up to the characters the prefix
keys cover (:data:`skymesh.prefix.keys.KEYED_CHARS`): a reply cut short by the budget, or
an event that does not parse, ends the text there, which is still a true prefix.
"""

from __future__ import annotations

import json
from typing import Any

from skymesh.prefix.keys import KEYED_CHARS

# Raw bytes kept per response at most. An SSE event carries a few characters of text in
# 150-300 bytes of JSON, so this covers replies of several thousand tokens; past it the
# text recorded is the part that fitted, still a true prefix of the reply.
MAX_CAPTURE_BYTES = 1 << 20
# Bytes budgeted per character still to key: generous for SSE's per-token framing.
BYTES_PER_CHAR = 96


class OutputCapture:
    """The raw bytes of one response, kept up to a byte budget."""

    __slots__ = ("left", "parts")

    def __init__(self, budget: int) -> None:
        self.parts: list[bytes] = []
        self.left = budget

    @classmethod
    def for_prompt(cls, prompt_text: str) -> OutputCapture | None:
        """A capture sized for what the keys can still cover after ``prompt_text``, or
        None when the prompt alone fills them (the reply would add no key)."""
        room = KEYED_CHARS - len(prompt_text)
        if room <= 0:
            return None
        return cls(min(MAX_CAPTURE_BYTES, room * BYTES_PER_CHAR))

    def add(self, chunk: bytes) -> None:
        if self.left > 0:
            self.parts.append(chunk)
            self.left -= len(chunk)

    def raw(self) -> bytes:
        return b"".join(self.parts)


def _choice_text(obj: Any, kind: str, *, delta: bool) -> str | None:
    """Choice 0's text in one response object (a stream event when ``delta``); None
    when the object has none (a role chunk, a usage chunk, another choice's event)."""
    if not isinstance(obj, dict):
        return None
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return None
    for ch in choices:
        if not isinstance(ch, dict) or ch.get("index", 0) != 0:
            continue
        if kind == "chat":
            msg = ch.get("delta" if delta else "message")
            text = msg.get("content") if isinstance(msg, dict) else None
        else:
            text = ch.get("text")
        return text if isinstance(text, str) else None
    return None


def sse_output_text(raw: bytes, kind: str) -> str:
    """Choice 0's generated text in a relayed SSE stream (``kind``: "chat" or
    "completion"), up to the first event that does not parse."""
    payloads = [line[6:] for line in raw.split(b"\n")
                if line.startswith(b"data: {")]
    if not payloads:
        return ""
    try:
        # One parse of all events as an array: a C call, not one per token.
        events = json.loads(b"[" + b",".join(payloads) + b"]")
    except ValueError:
        events = []
        for p in payloads:  # something is cut or malformed: keep what precedes it
            try:
                events.append(json.loads(p))
            except ValueError:
                break
    parts: list[str] = []
    for ev in events:
        text = _choice_text(ev, kind, delta=kind == "chat")
        if text:
            parts.append(text)
    return "".join(parts)


def json_output_text(body: bytes, kind: str) -> str:
    """Choice 0's generated text in a non-streamed response ("" when it has none)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return ""
    return _choice_text(obj, kind, delta=False) or ""


def cached_text(prompt_text: str, body: dict[str, Any], output: str) -> str | None:
    """The text the replica caches after this request, as the next request would resend
    it: prompt then reply. None when the request's reply is not a continuation of its
    prompt text (``echo`` repeats the prompt in the output) or there is no reply."""
    if not output or body.get("echo"):
        return None
    return prompt_text + output
