"""The model's own tokenizer and chat template, applied as vLLM applies them
(skymesh.prefix.kv_tokenize), and the scorer using them for vLLM replicas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from skymesh.balancer.config import KVEventsConfig, ReplicaConfig
from skymesh.balancer.intake import parse_request
from skymesh.balancer.kv_feed import ExactScorer, KVFeeds
from skymesh.policies import RouteRequest
from skymesh.prefix.kv_tokenize import EngineTokenizer, NoChatTemplate
from skymesh.prefix.prompt import PromptError
from skymesh.util.procs import free_port

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog " * 3,
          "user: assistant: system: what is two plus two? four. naïve café"] * 20


def make_model(folder: Path, *, template: str | None = TEMPLATE, where: str = "jinja",
               bos: object = "<s>") -> Path:
    """A small byte-level BPE tokenizer saved as transformers saves one: tokenizer.json
    (adding <s> to single sequences), tokenizer_config.json, the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg: dict[str, object] = {"bos_token": bos, "eos_token": "</s>", "pad_token": "<pad>"}
    if template is not None and where == "config":
        cfg["chat_template"] = template
    if template is not None and where == "named":
        cfg["chat_template"] = [{"name": "tool_use", "template": "x"},
                                {"name": "default", "template": template}]
    if template is not None and where == "jinja":
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("where", ["jinja", "config", "named"])
def test_chat_renders_the_template_and_tokenizes_without_added_specials(
        tmp_path: Path, where: str) -> None:
    bos = {"content": "<s>", "special": True} if where == "named" else "<s>"
    tok = EngineTokenizer(make_model(tmp_path / "m", where=where, bos=bos))
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "what is two plus two?"}]}
    text = tok.render_chat(body)
    assert text == "<s>system: be brief\nuser: what is two plus two?\nassistant:"
    ids = tok.request_ids("chat", body)
    assert ids[0] == 0 and ids.count(0) == 1  # the template's <s>, none added
    assert tok.decode(ids) == text
    # vLLM's request options: no generation prompt, specials added on demand.
    assert not tok.render_chat({**body, "add_generation_prompt": False}).endswith("assistant:")
    assert tok.request_ids("chat", {**body, "add_special_tokens": True})[:2] == [0, 0]


def test_completions_add_specials_unless_given_ids(tmp_path: Path) -> None:
    tok = EngineTokenizer(make_model(tmp_path / "m") / "tokenizer.json")  # a file works
    ids = tok.request_ids("completion", {"prompt": "the lazy dog"})
    assert ids[0] == 0 and tok.decode(ids[1:]) == "the lazy dog"
    assert tok.request_ids("completion", {"prompt": "the lazy dog",
                                          "add_special_tokens": False}) == ids[1:]
    assert tok.request_ids("completion", {"prompt": [5, 6, 7]}) == [5, 6, 7]


def test_content_parts_joined_unless_the_template_iterates_them(tmp_path: Path) -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}]}
    plain = EngineTokenizer(make_model(tmp_path / "s"))
    assert plain.render_chat(parts) == "<s>user: a\nb\nassistant:"
    iterating = ("{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]"
                 "{% endfor %}{% endfor %}")
    tok = EngineTokenizer(make_model(tmp_path / "o", template=iterating))
    assert tok.render_chat(parts) == "[a][b]"


def test_transformers_template_helpers(tmp_path: Path) -> None:
    tpl = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
           "{{ raise_exception('no tools') }}{% endif %}"
           "{% generation %}{{ m['content'] | tojson }}{% endgeneration %}{% endfor %}")
    tok = EngineTokenizer(make_model(tmp_path / "m", template=tpl))
    assert tok.render_chat({"messages": [{"role": "user", "content": "café"}]}) == '"café"'
    with pytest.raises(PromptError, match="no tools"):
        tok.render_chat({"messages": [{"role": "tool", "content": "x"}]})


def test_no_template_scores_completions_only(tmp_path: Path) -> None:
    tok = EngineTokenizer(make_model(tmp_path / "m", template=None))
    assert tok.chat_template is None
    with pytest.raises(NoChatTemplate):
        tok.request_ids("chat", {"messages": [{"role": "user", "content": "x"}]})
    assert tok.request_ids("completion", {"prompt": "the dog"})[0] == 0


def test_tokenizer_key_refused_on_the_emulated_replica() -> None:
    with pytest.raises(ValidationError, match="kind: skymesh"):
        ReplicaConfig.model_validate({"url": "http://127.0.0.1:1", "kind": "skymesh",
                                      "tokenizer": "/m"})


def vllm_replica(url: str, tokenizer: str | None) -> ReplicaConfig:
    return ReplicaConfig.model_validate(
        {"url": url, "kind": "vllm", "tokenizer": tokenizer,
         "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}})


async def test_vllm_replicas_scored_on_their_model_tokenizer(tmp_path: Path) -> None:
    """A vLLM replica with a tokenizer folder is scored on its events; one whose folder
    has no chat template keeps chat on the trie; one without a folder, or with a folder
    that does not load, stays on the trie, and /status says why."""
    model = str(make_model(tmp_path / "m"))
    bare = str(make_model(tmp_path / "bare", template=None))
    clock = [10.0]
    feeds = KVFeeds(KVEventsConfig(heartbeat_s=60.0), clock=lambda: clock[0])
    a, b, c, d, e = (f"http://127.0.0.1:{i}" for i in range(1, 6))
    feeds.set_replicas([vllm_replica(a, model), vllm_replica(b, model), vllm_replica(c, None),
                        vllm_replica(d, str(tmp_path / "missing")), vllm_replica(e, bare)])
    for url in (a, b, c, d, e):
        feeds._subs[url][1].last_heard = clock[0]
    scorer = ExactScorer(feeds)
    try:
        scorer.preload()
        await scorer.loaded()
        tok = EngineTokenizer(model)
        words = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
        chat = parse_request("chat", json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": words}]}).encode(), {})
        ids = tok.request_ids("chat", chat.body)
        assert len(ids) >= 32
        ia = feeds.index(a)
        assert ia is not None
        ia.stored([11, 12], None, ids[:32], 16)
        out = await scorer.annotate(RouteRequest("r"), chat)
        assert out.exact_prefix == {a: 2, b: 0}  # c, d: trie; e: no chat template
        assert out.exact_blocks == len(ids) // 16

        comp = parse_request("completion", json.dumps({"model": "m", "prompt": words}).encode(),
                             {})
        cids = tok.request_ids("completion", comp.body)
        ie = feeds.index(e)
        assert ie is not None
        ie.stored([21], None, cids[:16], 16)
        out = await scorer.annotate(RouteRequest("r"), comp)
        assert out.exact_prefix == {a: 0, b: 0, e: 1}

        assert scorer.figures(a) == {"kv_events": "live", "kv_blocks": 2, "kv_exact": True}
        assert scorer.figures(c)["kv_exact"] is False
        assert "no tokenizer configured" in scorer.figures(c)["kv_exact_note"]
        assert "failed to load" in scorer.figures(d)["kv_exact_note"]
        assert "no chat template" in scorer.figures(e)["kv_exact_note"]
    finally:
        await feeds.stop()
