"""The burst benchmark's prompts: GSM8K questions, one per request, or groups of requests
sharing a long prefix (pure but for reading the corpus).

``--prefix-groups G`` models a tree of thought's children: the burst's requests fall into
``G`` groups (sizes differ by at most one, membership shuffled with the seed); a group's
requests share one prefix of exactly ``prefix_chars`` characters (GSM8K questions
concatenated, a parent's context) and differ in a suffix of at most ``suffix_chars`` (a
branch number and the start of another question). The prefix is most of the prompt on
purpose: the prefix-tree policy follows a match only when it covers ``match_threshold``
(0.7) of the prompt's keys.

A ``nonce`` opens every prompt of a run: the servers outlive the runs and their KV cache
(1 GiB, about a million tokens of the tiny model) never evicts, so without it a run would
meet the prefixes an earlier mode's run left in both servers. Same seed, same prompts but
for the nonce, whose width is fixed so every run's prompts are equally long.

Lengths: the tokenizer is byte-level BPE, so a prompt never has more tokens than UTF-8
bytes; ``token_bound`` (bytes plus the chat template's and ``<s>``) is a safe bound to keep
``token_bound + max_tokens`` within the servers' ``--max-model-len`` without loading the
tokenizer (measured: about 3.8 bytes per token on GSM8K text).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

from make_tiny_model import data_dir

# tools/e2e/make_tiny_model.py's CHAT_TEMPLATE around one user message, and <s>.
TEMPLATE_TOKENS = len(b"user: \nassistant:") + 1
NONCE_HEX = 8  # "[0123abcd] ": 11 characters
DEFAULT_PREFIX_CHARS = 1350
DEFAULT_SUFFIX_CHARS = 120
# Questions read from the corpus for the groups' prefixes and suffixes.
POOL_SIZE = 2000


def corpus_questions(limit: int) -> list[str]:
    """The first ``limit`` GSM8K training questions, or stand-ins when the corpus is absent
    (the unit tests run without the shared data folder too)."""
    path = data_dir(None) / "gsm8k" / "train.jsonl"
    if path.is_file():
        out = []
        with path.open() as f:
            for line, _ in zip(f, range(limit), strict=False):
                out.append(json.loads(line)["question"])
        return out
    return [f"Question {i}: Natalia sold clips to {i + 3} of her friends in April, and then "
            f"she sold half as many clips in May. How many clips did she sell?"
            for i in range(limit)]


def prompts(n: int) -> list[str]:
    """The burst's prompts without groups: the first ``n`` questions."""
    return corpus_questions(n)


def nonce(*parts: object) -> str:
    """A fixed-width tag for one run's prompts, from whatever names the run."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).hexdigest()
    return f"[{digest[:NONCE_HEX]}] "


@dataclass(frozen=True)
class GroupedBurst:
    texts: list[str]     # each request's user message, in send order
    groups: list[int]    # each request's group
    prefixes: list[str]  # each group's shared prefix (nonce included): its parent's prompt


def grouped_prompts(n: int, groups: int, seed: int, pool: list[str], *, tag: str = "",
                    prefix_chars: int = DEFAULT_PREFIX_CHARS,
                    suffix_chars: int = DEFAULT_SUFFIX_CHARS) -> GroupedBurst:
    """``n`` requests in ``groups`` groups (see the module header); ``tag`` is the run's
    nonce (``nonce()``), "" for none."""
    if not 1 <= groups <= n:
        raise ValueError(f"prefix groups must be in 1..{n} (the requests), not {groups}")
    if suffix_chars < 16 or prefix_chars < 64:
        raise ValueError("prefix_chars must be >= 64 and suffix_chars >= 16")
    rng = random.Random(seed)
    order = list(range(len(pool)))
    rng.shuffle(order)
    drawn = iter(order)

    def take() -> str:
        try:
            return pool[next(drawn)]
        except StopIteration:
            raise ValueError(f"{len(pool)} questions are too few for these groups") from None

    prefixes = []
    for _ in range(groups):
        body = tag
        while len(body) < prefix_chars:
            body += take() + " "
        prefixes.append(body[:prefix_chars])
    members = [i % groups for i in range(n)]
    rng.shuffle(members)
    seen = [0] * groups
    texts = []
    for g in members:
        seen[g] += 1
        suffix = f"\nBranch {seen[g]}: {take()}"
        texts.append(prefixes[g] + suffix[:suffix_chars])
    return GroupedBurst(texts, members, prefixes)


def token_bound(text: str) -> int:
    """At least the prompt tokens ``text`` as the one user message becomes (the header)."""
    return len(text.encode("utf-8")) + TEMPLATE_TOKENS


def check_fits(texts: list[str], max_tokens: int, max_model_len: int) -> None:
    """Raises ValueError when a prompt and ``max_tokens`` may not fit the context."""
    worst = max((token_bound(t) for t in texts), default=0)
    if worst + max_tokens > max_model_len:
        raise ValueError(f"a prompt of up to {worst} tokens and {max_tokens} output tokens "
                         f"may exceed the servers' max-model-len {max_model_len}")


def workload_prompts(n: int, groups: int, seed: int, *, tag: str = "",
                     prefix_chars: int = DEFAULT_PREFIX_CHARS,
                     suffix_chars: int = DEFAULT_SUFFIX_CHARS) -> GroupedBurst | None:
    """The grouped burst of a run, or None when ``groups`` is 0 (plain ``prompts``)."""
    if groups == 0:
        return None
    return grouped_prompts(n, groups, seed, corpus_questions(POOL_SIZE), tag=tag,
                           prefix_chars=prefix_chars, suffix_chars=suffix_chars)
