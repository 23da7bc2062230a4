"""Make the real-engine lane's model offline: a tiny random-weight Llama with a byte-level
BPE tokenizer trained on GSM8K questions and answers.

    VENV/bin/python tools/e2e/make_tiny_model.py --out DIR [--data DIR]

Runs inside the vLLM venv (it needs torch, transformers, tokenizers, safetensors). No
model hub is reachable here and none is needed: the text it writes is gibberish, but
vLLM's scheduling, prefix caching, metrics and API are real. Everything is seeded, so two
runs give the same tokenizer and the same weights.

Parameters (the ones ``../shared/REAL_ENGINES.md`` measured): vocabulary 4,096 with
``<s>`` ``</s>`` ``<pad>``; hidden 128, intermediate 256, 2 layers, 4 heads, 4,096
positions, bf16, ``torch.manual_seed(0)``. The data folder is ``--data``, else
``$SKYMESH_DATA_DIR``, else ``<repo>/../shared/data``; the corpus is
``gsm8k/train.jsonl`` in it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

VOCAB = 4096
SPECIAL = ["<s>", "</s>", "<pad>"]
SEED = 0
# Roles in plain text, then the assistant's turn opened when asked for one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def data_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    if env := os.environ.get("SKYMESH_DATA_DIR"):
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "data"


def corpus(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            yield row["question"]
            yield row["answer"]


def make_tokenizer(train: Path, out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(train), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return int(tok.get_vocab_size())


def make_model(out: Path, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                      pad_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="model folder to write")
    ap.add_argument("--data", help="data folder holding gsm8k/train.jsonl")
    args = ap.parse_args(argv)
    train = data_dir(args.data) / "gsm8k" / "train.jsonl"
    if not train.is_file():
        print(f"make_tiny_model: no corpus at {train} (set SKYMESH_DATA_DIR)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(train, args.out)
    make_model(args.out, vocab)
    print(f"tiny model (vocab {vocab}) written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
