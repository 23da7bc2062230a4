"""Prompt / output-length samples for training and evaluating length predictors.

Sources (read from the shared data directory, never copied, see
:func:`skymesh_lab.sim.workloads.data.data_dir`):

- ``sharegpt_partial/sharegpt_v3_partial_turns.jsonl.gz``: a human turn's text, its prompt
  and history lengths and the ChatGPT response length in Qwen2.5 tokens (61,223 rows);
- ``gsm8k/{train,test}.jsonl``: grade-school maths questions and reference answers
  (8,792 rows), tokenised here with the project's Qwen2.5 tokenizer
  (:func:`skymesh.prefix.prompt.get_tokenizer`).

Lengths are clamped to ``MAX_TOKENS`` (PreServe's Table 2 counts "up to 4096"). The split
is deterministic: a sample's group (its ShareGPT conversation, or its GSM8K question)
goes to the test side when a seeded hash of the group falls in the test fraction, so the
turns of one conversation never straddle train and test.
"""

from __future__ import annotations

import gzip
import json
import zlib
from functools import lru_cache

from skymesh.predict.sample import MAX_TOKENS, Sample
from skymesh_lab.sim.workloads.data import data_file

__all__ = ["MAX_TOKENS", "SOURCES", "Sample", "limit", "load_samples", "split"]
SOURCES = ("sharegpt", "gsm8k")


@lru_cache(maxsize=1)
def load_sharegpt() -> tuple[Sample, ...]:
    path = data_file("sharegpt_partial", "sharegpt_v3_partial_turns.jsonl.gz")
    out: list[Sample] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            out.append(Sample(
                text=str(r["prompt"]), prompt_tokens=int(r["prompt_tokens_qwen25"]),
                history_tokens=int(r["history_tokens_qwen25"]),
                output_tokens=max(1, min(MAX_TOKENS, int(r["response_tokens_qwen25"]))),
                source="sharegpt", group=f"sharegpt/{r['conv_id']}",
            ))
    return tuple(out)


@lru_cache(maxsize=1)
def load_gsm8k() -> tuple[Sample, ...]:
    from skymesh.prefix.prompt import get_tokenizer

    tok = get_tokenizer()
    out: list[Sample] = []
    for split in ("train", "test"):
        with data_file("gsm8k", f"{split}.jsonl").open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                r = json.loads(line)
                q, a = str(r["question"]), str(r["answer"])
                out.append(Sample(
                    text=q, prompt_tokens=len(tok.encode(q)), history_tokens=0,
                    output_tokens=max(1, min(MAX_TOKENS, len(tok.encode(a)))),
                    source="gsm8k", group=f"gsm8k/{split}/{i}",
                ))
    return tuple(out)


def load_samples(sources: tuple[str, ...] = SOURCES) -> list[Sample]:
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown:
        raise ValueError(f"unknown sample sources {unknown}; valid: {', '.join(SOURCES)}")
    out: list[Sample] = []
    if "sharegpt" in sources:
        out += load_sharegpt()
    if "gsm8k" in sources:
        out += load_gsm8k()
    return out


def is_test(group: str, seed: int, test_fraction: float) -> bool:
    h = zlib.crc32(f"{seed}/{group}".encode())
    return h / 2**32 < test_fraction


def split(samples: list[Sample], seed: int = 0, test_fraction: float = 0.3
          ) -> tuple[list[Sample], list[Sample]]:
    """(train, test), by group (PreServe splits ShareGPT 7:3)."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    train: list[Sample] = []
    test: list[Sample] = []
    for s in samples:
        (test if is_test(s.group, seed, test_fraction) else train).append(s)
    return train, test


def limit(samples: list[Sample], n: int | None, seed: int = 0) -> list[Sample]:
    """A deterministic subset of at most ``n`` samples, mixing sources in proportion."""
    if n is None or n >= len(samples):
        return samples
    if n < 1:
        raise ValueError(f"--limit must be >= 1, got {n}")
    ranked = sorted(samples, key=lambda s: zlib.crc32(f"{seed}/pick/{s.group}/{s.text[:64]}"
                                                      .encode()))
    return ranked[:n]
