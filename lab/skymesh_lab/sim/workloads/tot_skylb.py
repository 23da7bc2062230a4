"""SkyLB's own tree-of-thoughts client (closed loop): ``tot-skylb`` and ``mixed-tree-skylb``.

A port of the client logic in skypilot-org/skypilot, branch ``serve-multi-region-lb``,
``sky/lbbench/workloads/tot.py`` with ``sky/lbbench/oai.py`` (our own code, no text of
theirs). What it does, and how it differs from ``tot-gsm8k``:

- Virtual root: a tree starts from an empty chat, so level 1 is ``b`` *identical*
  requests (the plan prompt with the question); each answer spawns ``b`` identical
  requests for the next of four fixed user turns (plan, execute, reflect, final answer).
  A tree issues ``b + b**2 + b**3 + b**4`` requests (30 at b = 2), up to ``b**4`` (16) at
  once. Every request asks for ``max_tokens`` = 256 at temperature 0.001.
- Identical siblings: at temperature ~0 identical prompts get identical answers, so all
  ``b**L`` requests of level L carry the same prompt and output (``sibling_outputs`` =
  "identical"). "distinct" gives every request its own answer (sampling noise).
- Questions: the client downloads GSM8K's *train* split (7,473 questions; it saves it
  under the name test.jsonl). A region at index ``r`` among the regions takes the lines
  ``i`` with ``i % clients == r`` (at most 100 per client), dealt round robin to its
  clients; so only ``min(clients, 7473 / clients)`` clients get any (all of 30, 62 of
  120). A client solves its questions in order and starts over when through them, until
  the duration ends (SkyLB's loop); a question asked again is the same tree again.
- Consistent-hashing key: SkyLB's client sends ``x-hash-key`` = its ``--seed``, which is
  the region name, so every request of a region has the same key (``hash_key`` =
  "region"); "question" keys by question as ``tot-gsm8k`` does.
- A failed request abandons its subtree; after ``duration_s`` no request is issued.

Lengths: prompts are the four turn texts' token counts (Qwen2.5 tokenizer: 63, 40, 31, 22)
plus the question (1.3 tokens per word) and Llama 3.1's chat template (27-token system
header, 10 tokens around each user turn and the assistant header). Answers: the client's
prompts ask for short answers (the plan within 80 words) and cap them at 256 tokens; no
trace of SkyLB's outputs exists, so each (question, level) draws a GSM8K train answer's
length x ``output_scale`` (3: median 183 tokens, a quarter at the cap), clamped to
[16, max_tokens].

Parameters (defaults): ``regions`` (required), ``seed`` = 0 (output lengths),
``duration_s`` = None, ``clients_per_region`` = 30 (int or region -> int), ``branching`` =
2, ``branching_per_region`` = None (region -> b), ``max_tokens`` = 256, ``output_scale`` =
3.0, ``sibling_outputs`` = "identical", ``hash_key`` = "region", ``model`` = "default".
``mixed-tree-skylb`` is the same client with SkyLB's mixed-tree setup as defaults: the
first region's 2 clients grow 4-branch trees, the other regions' 20 clients 2-branch.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

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
from skymesh_lab.sim.workloads.tot import load_answer_tokens, load_question_tokens
from skymesh_replica.engine.hashing import BLOCK_SIZE, extend_token_blocks, hash_token_blocks

# Token counts of SkyLB's four user turns (plan, execute, reflect, final answer).
TURN_TOKENS = (63, 40, 31, 22)
SYSTEM_HEADER_TOKENS = 27  # Llama 3.1's default system block (knowledge/today dates)
TURN_OVERHEAD_TOKENS = 10  # end of the last answer, user header, end of turn, assistant header
MIN_OUTPUT_TOKENS = 16
QUESTIONS_PER_CLIENT = 100


@dataclass(slots=True)
class _Tree:
    seq: int
    question: int
    question_tokens: list[int]
    pending: set[int] = field(default_factory=set)
    # Issued nodes that are not leaves: (tokens, hashes) of prompt + answer, until they end.
    streams: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    # Identical siblings: level -> (prompt length, tokens, hashes), built once per level.
    levels: dict[int, tuple[int, list[int], list[int]]] = field(default_factory=dict)


@dataclass(slots=True)
class _Client:
    index: int
    region: str
    branching: int
    questions: list[int]
    started: int = 0
    tree: _Tree | None = None


class SkyLBTreeWorkload(Workload):
    """SkyLB's tree-of-thoughts client; see the module docstring."""

    name = "tot-skylb"
    depth = len(TURN_TOKENS)

    def __init__(
        self,
        *,
        regions: Sequence[str],
        seed: int = 0,
        duration_s: float | None = None,
        clients_per_region: int | Mapping[str, int] = 30,
        branching: int = 2,
        branching_per_region: Mapping[str, int] | None = None,
        max_tokens: int = 256,
        output_scale: float = 3.0,
        sibling_outputs: str = "identical",
        hash_key: str = "region",
        model: str = "default",
    ) -> None:
        check_duration(duration_s)
        self.regions = check_regions(regions)
        if branching < 1:
            raise ValueError(f"branching must be >= 1, got {branching}")
        per_region = {r: int(b) for r, b in (branching_per_region or {}).items()}
        unknown = sorted(set(per_region) - set(self.regions))
        if unknown:
            raise ValueError(f"branching_per_region names unknown regions {unknown}")
        if any(b < 1 for b in per_region.values()):
            raise ValueError(f"branching_per_region values must be >= 1, got {per_region}")
        if max_tokens < MIN_OUTPUT_TOKENS:
            raise ValueError(f"max_tokens must be >= {MIN_OUTPUT_TOKENS}, got {max_tokens}")
        if not output_scale > 0:
            raise ValueError(f"output_scale must be positive, got {output_scale}")
        if sibling_outputs not in ("identical", "distinct"):
            raise ValueError(f"sibling_outputs must be identical or distinct, "
                             f"got {sibling_outputs!r}")
        if hash_key not in ("region", "question"):
            raise ValueError(f"hash_key must be region or question, got {hash_key!r}")
        self.seed = seed
        self.duration_s = duration_s
        self.branching = branching
        self.branching_per_region = per_region
        self.max_tokens = max_tokens
        self.output_scale = output_scale
        self.identical = sibling_outputs == "identical"
        self.hash_key = hash_key
        self.model = model
        self.client_regions = client_regions(self.regions, clients_per_region)
        # SkyLB's client fetches train.jsonl (its --data-path default names it test.jsonl).
        self.question_tokens = load_question_tokens(data_file("gsm8k", "train.jsonl"))
        self.answer_tokens = load_answer_tokens(data_file("gsm8k", "train.jsonl"))
        self.header = list(shared_tokens("tot-skylb/system", SYSTEM_HEADER_TOKENS))
        self.header_hashes = hash_token_blocks(self.header, BLOCK_SIZE)
        self.turns = [list(shared_tokens(f"tot-skylb/turn/{i}", n + TURN_OVERHEAD_TOKENS))
                      for i, n in enumerate(TURN_TOKENS)]
        self._clients: list[_Client] = []

    # -- clients and questions -------------------------------------------------------------
    def _make_clients(self) -> list[_Client]:
        clients: list[_Client] = []
        for r_index, region in enumerate(self.regions):
            n = sum(1 for r in self.client_regions if r == region)
            if n == 0:
                continue
            # SkyLB: lines i with i % clients == the region's index, 100 per client at most,
            # dealt round robin; a client without a question never starts.
            lines = [i for i in range(len(self.question_tokens)) if i % n == r_index % n]
            lines = lines[: QUESTIONS_PER_CLIENT * n]
            b = self.branching_per_region.get(region, self.branching)
            for u in range(n):
                clients.append(_Client(len(clients), region, b, lines[u::n]))
        return clients

    def initial(self) -> Iterator[Arrival]:
        self._clients = self._make_clients()
        arrivals: list[Arrival] = []
        for c in self._clients:
            arrivals.extend(self._next_tree(c, 0.0))
        return iter(arrivals)

    def on_complete(self, item: WorkItem, now: float, ok: bool = True) -> Iterable[Arrival]:
        client = self._clients[meta_int(item, "client")]
        tree = client.tree
        if tree is None or meta_int(item, "tree_seq") != tree.seq:
            return ()
        node = meta_int(item, "node")
        if node not in tree.pending:
            return ()
        tree.pending.discard(node)
        stream = tree.streams.pop(node, None)
        if self._over(now):
            return ()
        out: list[Arrival] = []
        level = meta_int(item, "level")
        if ok and stream is not None:
            b = client.branching
            for i in range(b):
                out.append((now, self._issue(client, tree, b * node + 1 + i, level + 1,
                                             stream)))
        if not tree.pending:
            out.extend(self._next_tree(client, now))
        return out

    def _over(self, t: float) -> bool:
        return self.duration_s is not None and t >= self.duration_s

    def _next_tree(self, client: _Client, t: float) -> list[Arrival]:
        if not client.questions or self._over(t):
            client.tree = None
            return []
        question = client.questions[client.started % len(client.questions)]
        qtokens = synth_tokens(f"tot-skylb/q{question}", self.question_tokens[question])
        tree = _Tree(client.started, question, qtokens)
        client.started += 1
        client.tree = tree
        root = (self.header, self.header_hashes)
        # Node 0 is the virtual root (the empty chat): its b children are level 1.
        return [(t, self._issue(client, tree, 1 + i, 1, root)) for i in range(client.branching)]

    # -- requests ----------------------------------------------------------------------------
    def _output_len(self, question: int, level: int, node_key: str) -> int:
        rng = random.Random(f"tot-skylb/{self.seed}/{question}/{level}/{node_key}")
        n = round(rng.choice(self.answer_tokens) * self.output_scale)
        return min(self.max_tokens, max(MIN_OUTPUT_TOKENS, n))

    def _content(self, client: _Client, tree: _Tree, node: int, level: int,
                 parent: tuple[list[int], list[int]]) -> tuple[int, list[int], list[int]]:
        """Prompt length, prompt + answer tokens and their block hashes of one node."""
        parent_tokens, parent_hashes = parent
        prompt = parent_tokens + self.turns[level - 1]
        if level == 1:
            prompt = prompt + tree.question_tokens  # the plan turn ends with the question
        # Identical: every node of a level, and every rerun of the question, answers alike.
        key = "same" if self.identical else f"c{client.index}/t{tree.seq}/n{node}"
        n_out = self._output_len(tree.question, level, key)
        output = synth_tokens(f"tot-skylb/q{tree.question}/L{level}/{key}/out", n_out)
        tokens = prompt + output
        return len(prompt), tokens, extend_token_blocks(list(parent_hashes), tokens,
                                                        BLOCK_SIZE)

    def _issue(self, client: _Client, tree: _Tree, node: int, level: int,
               parent: tuple[list[int], list[int]]) -> WorkItem:
        built = tree.levels.get(level) if self.identical else None
        if built is None:
            built = self._content(client, tree, node, level, parent)
            if self.identical:
                tree.levels[level] = built
        prompt_len, tokens, hashes = built
        n_out = len(tokens) - prompt_len
        tree.pending.add(node)
        if level < self.depth:
            tree.streams[node] = (tokens, hashes)
        affinity = (client.region if self.hash_key == "region"
                    else f"gsm8k-train-{tree.question}")
        return WorkItem(
            request_id=f"tot-skylb-c{client.index}-t{tree.seq}-n{node}",
            region=client.region,
            prompt_len=prompt_len,
            output_len=n_out,
            block_hashes=list(hashes),
            model=self.model,
            affinity_key=affinity,
            max_new_tokens=self.max_tokens,
            meta={"client": client.index, "tree_seq": tree.seq, "node": node,
                  "level": level},
        )


class MixedTreeSkyLBWorkload(SkyLBTreeWorkload):
    """``mixed-tree-skylb``: SkyLB's client with its mixed-tree setup as the defaults (the
    first region: 2 clients of 4-branch trees; every other region: 20 of 2-branch)."""

    name = "mixed-tree-skylb"

    def __init__(
        self,
        *,
        regions: Sequence[str],
        seed: int = 0,
        duration_s: float | None = None,
        clients_per_region: int | Mapping[str, int] | None = None,
        branching: int = 2,
        branching_per_region: Mapping[str, int] | None = None,
        max_tokens: int = 256,
        output_scale: float = 3.0,
        sibling_outputs: str = "identical",
        hash_key: str = "region",
        model: str = "default",
    ) -> None:
        names = check_regions(regions)
        if clients_per_region is None:
            clients_per_region = {r: 2 if i == 0 else 20 for i, r in enumerate(names)}
        if branching_per_region is None:
            branching_per_region = {names[0]: 4}
        super().__init__(
            regions=names, seed=seed, duration_s=duration_s,
            clients_per_region=clients_per_region, branching=branching,
            branching_per_region=branching_per_region, max_tokens=max_tokens,
            output_scale=output_scale, sibling_outputs=sibling_outputs, hash_key=hash_key,
            model=model,
        )
