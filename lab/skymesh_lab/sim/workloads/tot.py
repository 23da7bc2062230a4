"""Tree of thoughts over GSM8K (closed loop): ``tot-gsm8k``.

Follows SkyLB's tree-of-thoughts workload (Xia et al., "SkyLB: A Locality-Aware
Cross-Region Load Balancer for LLM Inference", 2025; after Yao et al., "Tree of Thoughts",
NeurIPS'23): each client solves one GSM8K test question at a time by expanding a full tree
of ``depth`` levels. The root prompt is a ToT instruction prefix shared by every tree plus
the question; when a node's response arrives, its ``branching`` children are issued at
once, each prompted with its parent's prompt + response + a short instruction that differs
per child index. Leaves (level ``depth - 1``) have no children, so a tree issues
``1 + b + ... + b**(depth-1)`` requests (15 at b = 2, 85 at b = 4 with depth 4). When every
node of the tree has ended the client starts its next question.

Lengths: the question is ~1.3 tokens per word; each node's output length is drawn (per
tree, from the seed) from the GSM8K train answers' lengths (1.3 tokens per word, clamped to
[16, 512]). Token ids are synthetic and deterministic. The question id is the request's
``affinity_key`` (SkyLB's consistent-hashing key). Questions are shuffled with the seed and
dealt round robin to clients; a client whose share is used up stops. A failed node abandons
its subtree; the tree still ends when its last outstanding node ends.

Parameters (defaults):

- ``regions`` (required), ``seed`` = 0 (question order, output lengths)
- ``duration_s`` = None: no request at all is issued at or after this simulated time
- ``clients_per_region`` = 10: an int, or a dict region -> int (missing regions: 0)
- ``branching`` = 2 (SkyLB uses 2 and 4), ``depth`` = 4 (levels, root included)
- ``branching_per_region`` = None: a dict region -> branching overriding ``branching`` for
  the clients of the regions it names (SkyLB's mixed tree: 4-branch trees in the US,
  2-branch elsewhere); a tree's node count and output draws follow its client's branching
- ``system_prompt_tokens`` = 150: the shared ToT instruction prefix
- ``instruction_tokens`` = 12: the per-child instruction appended to the parent's context
- ``think_time_s`` = 0.0: delay between the end of a tree and the client's next tree
- ``output_scale`` = 1.0: multiplies each drawn output length (clamped to [16, 512]);
  GSM8K reference answers are terser than an 8B model's reasoning steps (SGLang's
  tree-of-thought benchmark asks for up to 80-200 words per step), so experiments that
  want the paper's load use about 3
- ``model`` = "default"
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_lab.sim.workloads.common import (
    check_duration,
    check_regions,
    client_regions,
    meta_int,
    shared_tokens,
    synth_tokens,
)
from skymesh_lab.sim.workloads.data import data_file
from skymesh_replica.engine.hashing import BLOCK_SIZE, extend_token_blocks, hash_token_blocks

TOKENS_PER_WORD = 1.3
MIN_OUTPUT_TOKENS = 16
MAX_OUTPUT_TOKENS = 512


def words_to_tokens(text: str) -> int:
    return max(1, round(TOKENS_PER_WORD * len(text.split())))


@lru_cache(maxsize=2)
def load_question_tokens(path: Path) -> tuple[int, ...]:
    """Approximate token length of each test question, in file order."""
    with path.open(encoding="utf-8") as f:
        return tuple(words_to_tokens(json.loads(line)["question"]) for line in f if line.strip())


@lru_cache(maxsize=2)
def load_answer_tokens(path: Path) -> tuple[int, ...]:
    """Approximate token length of each train answer, clamped to the output range."""
    with path.open(encoding="utf-8") as f:
        lengths = [words_to_tokens(json.loads(line)["answer"]) for line in f if line.strip()]
    return tuple(min(MAX_OUTPUT_TOKENS, max(MIN_OUTPUT_TOKENS, n)) for n in lengths)


def tree_size(branching: int, depth: int) -> int:
    return sum(branching**level for level in range(depth))


@dataclass(slots=True)
class _Tree:
    seq: int  # the client's tree counter, to recognise stale completions
    question: int  # index into test.jsonl
    output_lens: list[int]  # per node, heap-numbered: node n's children are b*n+1 .. b*n+b
    # prompt + output tokens and their block hashes of issued inner nodes, until they end.
    streams: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    # Issued nodes that have not ended yet; the tree is done when this empties.
    pending: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Client:
    index: int
    region: str
    started: int = 0
    tree: _Tree | None = None
    branching: int = 2


class TreeOfThoughtsWorkload(Workload):
    """Closed-loop tree-of-thoughts over GSM8K; see the module docstring."""

    def _scaled(self, n: int) -> int:
        if self.output_scale == 1.0:
            return n
        return min(MAX_OUTPUT_TOKENS, max(MIN_OUTPUT_TOKENS, round(n * self.output_scale)))

    name = "tot-gsm8k"

    def __init__(
        self,
        *,
        regions: Sequence[str],
        seed: int = 0,
        duration_s: float | None = None,
        clients_per_region: int | Mapping[str, int] = 10,
        branching: int = 2,
        depth: int = 4,
        branching_per_region: Mapping[str, int] | None = None,
        system_prompt_tokens: int = 150,
        instruction_tokens: int = 12,
        think_time_s: float = 0.0,
        output_scale: float = 1.0,
        model: str = "default",
    ) -> None:
        check_duration(duration_s)
        if output_scale <= 0:
            raise ValueError(f"output_scale must be positive, got {output_scale}")
        if branching < 1 or depth < 1:
            raise ValueError(f"branching and depth must be >= 1, got {branching}, {depth}")
        if system_prompt_tokens < 0:
            raise ValueError(f"system_prompt_tokens must be >= 0, got {system_prompt_tokens}")
        if instruction_tokens < 1:
            # Siblings would send identical prompts.
            raise ValueError(f"instruction_tokens must be >= 1, got {instruction_tokens}")
        if think_time_s < 0:
            raise ValueError(f"think_time_s must be >= 0, got {think_time_s}")
        self.regions = check_regions(regions)
        per_region = dict(branching_per_region or {})
        unknown = sorted(set(per_region) - set(self.regions))
        if unknown:
            raise ValueError(f"branching_per_region names unknown regions {unknown}")
        if any(int(b) < 1 for b in per_region.values()):
            raise ValueError(f"branching_per_region values must be >= 1, got {per_region}")
        self.branching_per_region = {r: int(b) for r, b in per_region.items()}
        self.seed = seed
        self.duration_s = duration_s
        self.client_regions = client_regions(self.regions, clients_per_region)
        self.branching = branching
        self.depth = depth
        self.think_time_s = think_time_s
        self.output_scale = output_scale
        self.model = model
        self.question_tokens = load_question_tokens(data_file("gsm8k", "test.jsonl"))
        self.answer_tokens = load_answer_tokens(data_file("gsm8k", "train.jsonl"))
        order = list(range(len(self.question_tokens)))
        random.Random(f"tot-gsm8k/{seed}").shuffle(order)
        self.order = order
        self.nodes_per_tree = tree_size(branching, depth)
        self.system_tokens = list(shared_tokens("tot/system", system_prompt_tokens))
        self.system_hashes = hash_token_blocks(self.system_tokens, BLOCK_SIZE)
        # One instruction per child index, for the widest tree any client grows.
        widest = max([branching, *self.branching_per_region.values()])
        self.instructions = [
            list(shared_tokens(f"tot/instruction/{i}", instruction_tokens))
            for i in range(widest)
        ]
        self._clients: list[_Client] = []

    def initial(self) -> Iterator[Arrival]:
        # Fresh client state, so a workload object can drive more than one run.
        self._clients = [_Client(i, r, branching=self.branching_per_region.get(r, self.branching))
                         for i, r in enumerate(self.client_regions)]
        arrivals: list[Arrival] = []
        for client in self._clients:
            arrivals.extend(self._next_tree(client, 0.0))
        return iter(arrivals)

    def on_complete(self, item: WorkItem, now: float, ok: bool = True) -> Iterable[Arrival]:
        client = self._clients[meta_int(item, "client")]
        tree = client.tree
        if tree is None or meta_int(item, "tree_seq") != tree.seq:
            return ()  # stale: not from the client's current tree
        node = meta_int(item, "node")
        if node not in tree.pending:
            return ()  # a duplicate completion
        level = meta_int(item, "level")
        tree.pending.discard(node)
        stream = tree.streams.pop(node, None)
        if self._over(now):
            return ()
        arrivals: list[Arrival] = []
        if ok and stream is not None and level + 1 < self.depth:
            b = client.branching
            for i in range(b):
                child = b * node + 1 + i
                arrivals.append(self._issue_child(client, tree, stream, child, i, level + 1, now))
        if not tree.pending:
            arrivals.extend(self._next_tree(client, now + self.think_time_s))
        return arrivals

    def _over(self, t: float) -> bool:
        return self.duration_s is not None and t >= self.duration_s

    def _next_tree(self, client: _Client, t: float) -> list[Arrival]:
        pos = client.index + client.started * len(self._clients)
        if pos >= len(self.order) or self._over(t):
            client.tree = None
            return []
        question = self.order[pos]
        # Output lengths come from a per-tree rng, so they do not depend on the order in
        # which the simulator completes nodes.
        rng = random.Random(f"tot-gsm8k/{self.seed}/{client.started}/{question}")
        tree = _Tree(
            seq=client.started,
            question=question,
            output_lens=[self._scaled(rng.choice(self.answer_tokens))
                         for _ in range(tree_size(client.branching, self.depth))],
        )
        client.started += 1
        client.tree = tree
        qid = f"gsm8k-test-{question}"
        prompt = self.system_tokens + synth_tokens(
            f"tot/{qid}/question", self.question_tokens[question]
        )
        output = synth_tokens(f"tot/{qid}/n0/output", tree.output_lens[0])
        tokens = prompt + output
        hashes = extend_token_blocks(self.system_hashes, tokens, BLOCK_SIZE)
        return [(t, self._item(client, tree, 0, 0, len(prompt), tokens, hashes))]

    def _issue_child(
        self,
        client: _Client,
        tree: _Tree,
        parent: tuple[list[int], list[int]],
        node: int,
        child_index: int,
        level: int,
        t: float,
    ) -> Arrival:
        parent_tokens, parent_hashes = parent
        prompt_len = len(parent_tokens) + len(self.instructions[child_index])
        output = synth_tokens(
            f"tot/gsm8k-test-{tree.question}/n{node}/output", tree.output_lens[node]
        )
        tokens = parent_tokens + self.instructions[child_index] + output
        hashes = extend_token_blocks(parent_hashes, tokens, BLOCK_SIZE)
        return t, self._item(client, tree, node, level, prompt_len, tokens, hashes)

    def _item(
        self,
        client: _Client,
        tree: _Tree,
        node: int,
        level: int,
        prompt_len: int,
        tokens: list[int],
        hashes: list[int],
    ) -> WorkItem:
        tree.pending.add(node)
        if level + 1 < self.depth:
            tree.streams[node] = (tokens, hashes)
        qid = f"gsm8k-test-{tree.question}"
        return WorkItem(
            request_id=f"tot-c{client.index}-{qid}-n{node}",
            region=client.region,
            prompt_len=prompt_len,
            output_len=len(tokens) - prompt_len,
            block_hashes=list(hashes),
            model=self.model,
            affinity_key=qid,
            meta={"client": client.index, "tree_seq": tree.seq, "node": node, "level": level},
        )
