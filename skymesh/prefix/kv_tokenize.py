"""A model's own tokenizer and chat template, applied as vLLM applies them.

Exact prefix scoring (docs/kv-events.md) compares the token ids of a prompt with the
blocks an engine reports: the balancer must produce the engine's ids, byte for byte. For a
vLLM or SGLang replica that means the model's ``tokenizer.json`` (the ``tokenizers``
library, which transformers' fast tokenizers wrap) and its chat template rendered the way
transformers' ``apply_chat_template`` does (a sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a ``tojson`` that
keeps non-ASCII, the special tokens as variables, ``add_generation_prompt=True``).

vLLM's rules, followed here:

- Chat: the template's text is tokenized *without* special tokens added (the template
  writes its own BOS); ``add_special_tokens`` in the body overrides. Text content parts
  are joined with a newline unless the template iterates over the parts itself
  (vLLM's "openai" content format), then they are passed as they came.
  ``chat_template_kwargs`` from the body reach the template.
- Completions: a text prompt is tokenized *with* special tokens (the tokenizer's post
  processor decides which); a prompt of token ids is taken as it is.

A model folder without a chat template still scores completions exactly; its chat requests
are left to the trie (:class:`NoChatTemplate`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from skymesh.prefix.prompt import PromptError, completion_prompt

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                "mask_token")
# A template that loops over a message's content wants OpenAI's list of parts (vLLM's
# "openai" content format); others get the parts' texts joined (its "string" format).
_ITERATES_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content\b)")


class NoChatTemplate(PromptError):
    """The model folder has no chat template: chat prompts cannot be tokenized exactly."""


class EngineTokenizer:
    """``tokenizer.json`` + chat template of one model folder (loaded once, read-only)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        folder = p if p.is_dir() else p.parent
        tok_file = folder / "tokenizer.json" if p.is_dir() else p
        self.name = str(folder)
        self._tok = Tokenizer.from_file(str(tok_file))
        cfg_file = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.special: dict[str, str] = {}
        for key in SPECIAL_KEYS:
            v = cfg.get(key)
            if isinstance(v, dict):  # older configs: {"content": "<s>", ...}
                v = v.get("content")
            if isinstance(v, str):
                self.special[key] = v
        self.chat_template = _find_template(folder, cfg)
        self._template: Any = None
        self._openai_parts = False
        if self.chat_template is not None:
            self._template = _compile(self.chat_template)
            self._openai_parts = bool(_ITERATES_CONTENT.search(self.chat_template))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def render_chat(self, body: dict[str, Any]) -> str:
        """The template's text for a chat request body (``messages`` and the template
        options vLLM takes from it)."""
        if self._template is None:
            raise NoChatTemplate(f"{self.name} has no chat template", "messages")
        import jinja2

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list", "messages")
        conv = [self._message(m, i) for i, m in enumerate(messages)]
        kwargs = body.get("chat_template_kwargs")
        extra: dict[str, Any] = dict(kwargs) if isinstance(kwargs, dict) else {}
        gen = body.get("add_generation_prompt", True)
        cont = bool(body.get("continue_final_message", False))
        try:
            return str(self._template.render(
                **{**self.special, **extra, "messages": conv, "tools": body.get("tools"),
                   "documents": None, "add_generation_prompt": bool(gen) and not cont}))
        except jinja2.TemplateError as exc:
            raise PromptError(f"chat template: {exc}", "messages") from None

    def _message(self, m: Any, i: int) -> dict[str, Any]:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        out = dict(m)
        content = m.get("content")
        if isinstance(content, list) and not self._openai_parts:
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise PromptError("only text content parts are scored",
                                      f"messages[{i}].content")
                texts.append(str(part.get("text", "")))
            out["content"] = "\n".join(texts)
        elif content is None and not self._openai_parts:
            out["content"] = ""
        return out

    def request_ids(self, kind: str, body: dict[str, Any]) -> list[int]:
        """The prompt token ids vLLM computes for a request of ``kind`` ("chat" or
        "completion")."""
        add = body.get("add_special_tokens")
        if kind == "chat":
            return self.encode(self.render_chat(body), bool(add) if add is not None else False)
        prompt = completion_prompt(body.get("prompt"))
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        return self.encode(prompt.text or "", bool(add) if add is not None else True)


def _find_template(folder: Path, cfg: dict[str, Any]) -> str | None:
    """The default chat template: ``chat_template.jinja`` (transformers >= 4.43 saves it
    beside the config), ``chat_template.json``, or ``tokenizer_config.json``'s key (a
    string, or a list of named templates)."""
    jinja_file = folder / TEMPLATE_FILES[0]
    if jinja_file.exists():
        return jinja_file.read_text()
    json_file = folder / TEMPLATE_FILES[1]
    tpl: Any = cfg.get("chat_template")
    if json_file.exists():
        tpl = json.loads(json_file.read_text()).get("chat_template", tpl)
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) and tpl else None


def _compile(source: str) -> Any:
    """transformers' template environment (``utils/chat_template_utils.py``)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training masks;
        # rendering keeps the text.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_keep"), [], [], body).set_lineno(lineno)

        def _keep(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
