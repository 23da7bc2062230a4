"""The text a replica generated, read back from the response the balancer relayed.

Prefix policies record a finished request's prompt *and* output in their trie
(``Policy.on_cached``), because the replica's KV cache holds both and the next turn of a
conversation resends both: the next prompt starts with this prompt's text (its ChatML
ends with the assistant header, see :func:`skymesh.prefix.prompt.render_chat`) followed by the
reply. So the balancer keeps the raw response bytes it relayed, up to a budget, and after
the client has its last byte turns them into the reply's text.

Only a *prefix* of the reply is ever needed, and only up to the characters the prefix
keys cover (:data:`skymesh.prefix.keys.KEYED_CHARS`): a reply cut short by the budget, or
an event that does not parse, ends the text there, which is still a true prefix.

A non-streamed reply is read by :func:`reply_record`: with msgspec, a typed decode builds
only ``usage`` and each choice's ``index``, ``message.content`` and ``text`` and skips
the rest unbuilt, about a fifth less CPU per reply than the whole decode and the reading
of it (measured in process on the stub's reply and vLLM-like ones, ASCII or not; the
decode alone about a third less). Whatever the typed decode refuses (a field of another
type, not an object, not JSON for msgspec) is decoded whole as before, so the result is
:func:`parse_json` then :func:`reply_text`'s, but for one thing: a field the balancer
does not read is skipped unchecked, as :func:`skymesh.net.jsonbody.fast_usage` already
skips it, so invalid UTF-8 or a number too long for ``int`` (over 4,300 digits) there no
longer voids the reply's usage and text. Checking the UTF-8 first would cost more than
the typed decode saves on a non-ASCII reply.
"""

from __future__ import annotations

import json
import re
from typing import Any

from skymesh.net.jsonbody import NOT_DECODED, fast_decode
from skymesh.prefix.keys import KEYED_CHARS

_REPLY: Any = None
_REFUSED: tuple[type[BaseException], ...] = ()
try:
    import msgspec

    class _Message(msgspec.Struct):
        content: Any = None

    class _Choice(msgspec.Struct):
        index: Any = 0  # Any, as reply_text compares whatever is there with 0
        message: _Message | None = None
        text: Any = None

    class _Reply(msgspec.Struct):
        """What the records path reads of a reply; every other field is skipped unbuilt."""

        choices: list[_Choice] | None = None
        usage: Any = None

    _REPLY = msgspec.json.Decoder(_Reply)
    _REFUSED = (msgspec.MsgspecError, ValueError, RecursionError)
except ImportError:  # the lean core (no ``fast`` extra): the whole decode
    pass

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
    def for_request(cls, prompt_text: str, body: dict[str, Any]) -> OutputCapture | None:
        """A capture sized for what the keys can still cover after ``prompt_text``, or
        None when the prompt alone fills them (the reply would add no key) or the request
        is not :func:`single_choice`."""
        room = KEYED_CHARS - len(prompt_text)
        if room <= 0 or not single_choice(body):
            return None
        return cls(min(MAX_CAPTURE_BYTES, room * BYTES_PER_CHAR))

    def add(self, chunk: bytes) -> None:
        if self.left > 0:
            self.parts.append(chunk)
            self.left -= len(chunk)

    def raw(self) -> bytes:
        return b"".join(self.parts)


def parse_json(body: bytes) -> Any:
    """A non-streamed response body parsed, or None when it is not JSON. msgspec first
    when installed (a vLLM reply parses several times faster); what it refuses gets
    json's verdict."""
    value = fast_decode(body)
    if value is not NOT_DECODED:
        return value
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # deeper than json's scanner recurses: not ours
        return None


def reply_text(obj: Any, kind: str) -> str:
    """Choice 0's generated text in a parsed non-streamed response ("" when none)."""
    if not isinstance(obj, dict):
        return ""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return ""
    for ch in choices:
        if not isinstance(ch, dict) or ch.get("index", 0) != 0:
            continue
        if kind == "chat":
            msg = ch.get("message")
            text = msg.get("content") if isinstance(msg, dict) else None
        else:
            text = ch.get("text")
        return text if isinstance(text, str) else ""
    return ""


def reply_record(body: bytes, kind: str) -> tuple[Any, str]:
    """A non-streamed reply's ``usage`` member (None without one, :data:`NOT_DECODED`
    when the body is not a JSON object) and choice 0's text (``kind``: "chat" or
    "completion"; "" when none), as :func:`parse_json` then :func:`reply_text` give them,
    without building the fields neither reads (module docstring)."""
    if _REPLY is not None:
        try:
            reply = _REPLY.decode(body)
        except _REFUSED:
            pass
        else:
            for ch in reply.choices or ():
                if ch.index != 0:
                    continue
                if kind == "chat":
                    text = ch.message.content if ch.message is not None else None
                else:
                    text = ch.text
                return reply.usage, text if isinstance(text, str) else ""
            return reply.usage, ""
    whole = parse_json(body)
    return (whole.get("usage") if isinstance(whole, dict) else NOT_DECODED,
            reply_text(whole, kind))


# The text field of a stream event, as a JSON string literal. Inside a JSON string every
# quote is escaped, so ``"content":"`` can only be a key and its value, never text.
_FIELD = {"chat": re.compile(rb'"content"\s*:\s*"((?:[^"\\]|\\.)*)"'),
          "completion": re.compile(rb'"text"\s*:\s*"((?:[^"\\]|\\.)*)"')}


def sse_output_text(raw: bytes, kind: str) -> str:
    """The generated text in a relayed SSE stream of one choice (``kind``: "chat" or
    "completion"), up to the first piece that does not decode.

    The events are not parsed: a regular expression picks each event's text literal and
    one ``json.loads`` decodes them all, about 8x less CPU than parsing every event
    (1,000 tokens: ~0.3 ms). Only valid for streams of one choice (``n`` = 1): the caller
    does not capture others."""
    pieces = _FIELD[kind].findall(raw)
    if not pieces:
        return ""
    try:
        parts: list[str] = json.loads(b'["' + b'","'.join(pieces) + b'"]')
    except ValueError:
        parts = []
        for p in pieces:  # a bad escape somewhere: keep what precedes it
            try:
                parts.append(json.loads(b'"' + p + b'"'))
            except ValueError:
                break
    return "".join(parts)


def single_choice(body: dict[str, Any]) -> bool:
    """Whether a request asks for one reply that continues its prompt: not ``n`` > 1 or
    ``best_of`` (several replies, and streams interleave them), not ``echo`` (the output
    repeats the prompt)."""
    n, best = body.get("n"), body.get("best_of")
    return (n in (None, 1) and best in (None, 1) and not body.get("echo"))


def cached_text(prompt_text: str, body: dict[str, Any], output: str) -> str | None:
    """The text the replica caches after this request, as the next request would resend
    it: prompt then reply. None when there is no reply or the request is not
    :func:`single_choice`."""
    if not output or not single_choice(body):
        return None
    return prompt_text + output
