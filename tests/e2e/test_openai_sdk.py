"""The official OpenAI SDK against skymesh-lb in front of two real vLLM servers.

``ignore_eos`` (a vLLM sampling parameter, sent through ``extra_body``) makes every answer
exactly ``max_tokens`` long, so the usage figures can be checked to the token.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_cluster import MODEL_NAME, Cluster

MAX_TOKENS = 12
EXACT = {"ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Natalia sold clips to 48 of her friends."}]


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Any:
    import openai  # in the test extra; imported here so collection works without it

    return openai.OpenAI(base_url=cluster.lb.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120.0)


def test_chat_completion(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                       max_tokens=MAX_TOKENS, extra_body=EXACT)
    assert r.object == "chat.completion"
    assert r.model == MODEL_NAME
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS


def test_chat_completion_stream_with_usage(client: Any) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body=EXACT))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1  # one stream, not pieces of two
    assert with_choices[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text
    usage = chunks[-1].usage  # include_usage: a last chunk with usage and no choices
    assert chunks[-1].choices == []
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + MAX_TOKENS


def test_completion(client: Any) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="Weng earns $12 an hour",
                                  max_tokens=MAX_TOKENS, extra_body=EXACT)
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS


def test_completion_stream(client: Any) -> None:
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt="Weng earns $12 an hour", max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True}, extra_body=EXACT))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in with_choices)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_same_prompt_gets_same_prompt_tokens_on_either_path(cluster: Cluster,
                                                            client: Any) -> None:
    """The balancer passes the prompt through untouched: vLLM counts the same prompt
    tokens whether asked directly or through skymesh-lb."""
    import openai

    direct = openai.OpenAI(base_url=cluster.replica_urls[0] + "/v1", api_key="unused",
                           max_retries=0, timeout=120.0)
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
    assert (client.chat.completions.create(**kwargs).usage.prompt_tokens
            == direct.chat.completions.create(**kwargs).usage.prompt_tokens)


def test_unknown_model_is_a_not_found_error(client: Any) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert err.value.status_code == 404


def test_sdk_sees_an_error_code_on_the_balancers_own_errors(client: Any) -> None:
    """The SDK reads ``code`` from an OpenAI-shaped JSON body; a text/plain one gives None.
    GET on the balancer's own generation path is its own 405."""
    import openai

    with pytest.raises(openai.APIStatusError) as err:
        client.get("/chat/completions", cast_to=object)
    assert err.value.status_code == 405
    assert err.value.code is not None
