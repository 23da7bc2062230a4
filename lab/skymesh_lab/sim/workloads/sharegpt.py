"""Multi-turn ShareGPT chat (closed loop): ``sharegpt-chat``.

Follows SkyLB's conversation workload (Xia et al., "SkyLB: A Locality-Aware Cross-Region
Load Balancer for LLM Inference", 2025): a fixed number of clients per region, each running
one conversation at a time, turn by turn, sending the next turn as soon as the previous
response arrives. Data: ``sharegpt_partial/sharegpt_v3_partial_turns.jsonl.gz`` (one row
per human/ChatGPT turn pair, with Qwen2.5 token counts).

Turn ``k``'s prompt is the whole conversation so far (optional shared system prompt, every
earlier prompt and response) plus the turn's own prompt; its output is the recorded
response length (at least 1 token). Each conversation keeps a synthetic token stream, so
turn ``k + 1``'s prompt blocks start with every full block of turn ``k``'s prompt + output
(the responses' blocks the engine registered are hit by the next turn).

Conversations are shuffled with the seed and dealt round robin to clients (client ``i``
gets conversations ``i, i + N, i + 2N, ...``); a client whose share is used up stops.
Conversations whose turns are not numbered ``0..n-1`` in file order are skipped. A failed
request ends its conversation: the client moves on to its next one.

Parameters (defaults):

- ``regions`` (required), ``seed`` = 0 (conversation order)
- ``duration_s`` = None: no request is issued at or after this simulated time
- ``clients_per_region`` = 20: an int, or a dict region -> int (missing regions: 0)
- ``system_prompt_tokens`` = 0: a system prompt, identical for all conversations
- ``think_time_s`` = 0.0: delay between a response and the client's next request
- ``model`` = "default"
"""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
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


@dataclass(frozen=True, slots=True)
class Conversation:
    conv_id: str
    # (prompt tokens, response tokens) per turn, in turn order.
    turns: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class ShareGPTData:
    # Only conversations whose turns are 0..n-1 in file order, file order kept.
    conversations: tuple[Conversation, ...]
    # Per row (every row, valid conversation or not): history + prompt tokens, and
    # response tokens; what the Poisson workload draws lengths from.
    row_prompt_tokens: tuple[int, ...]
    row_response_tokens: tuple[int, ...]


def sharegpt_path() -> Path:
    return data_file("sharegpt_partial", "sharegpt_v3_partial_turns.jsonl.gz")


@lru_cache(maxsize=2)
def load_sharegpt(path: Path) -> ShareGPTData:
    """Parse the turn file once per process (~0.6 s for 61k rows)."""
    # (conv_id, turn numbers, (prompt, response) per turn) per run of equal conv_ids.
    groups: list[tuple[str, list[int], list[tuple[int, int]]]] = []
    prompts: list[int] = []
    responses: list[int] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            conv_id = str(row["conv_id"])
            prompt = int(row["prompt_tokens_qwen25"])
            response = int(row["response_tokens_qwen25"])
            prompts.append(int(row["history_tokens_qwen25"]) + prompt)
            responses.append(response)
            if not groups or groups[-1][0] != conv_id:
                groups.append((conv_id, [], []))
            groups[-1][1].append(int(row["turn"]))
            groups[-1][2].append((prompt, response))
    # A conversation split across the file, or with missing turns, cannot be replayed in
    # order: skip it.
    runs = Counter(g[0] for g in groups)
    convs = tuple(
        Conversation(conv_id, tuple(turns))
        for conv_id, numbers, turns in groups
        if runs[conv_id] == 1 and numbers == list(range(len(numbers)))
    )
    return ShareGPTData(convs, tuple(prompts), tuple(responses))


@dataclass(slots=True)
class _Client:
    index: int
    region: str
    # How many conversations this client has started (its k-th is order[i + k * N]).
    started: int = 0
    conv: Conversation | None = None
    turn: int = 0
    # The conversation so far (prompt + output of every issued turn) and its block hashes.
    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


class ShareGPTChatWorkload(Workload):
    """Closed-loop multi-turn chat over ShareGPT; see the module docstring."""

    name = "sharegpt-chat"

    def __init__(
        self,
        *,
        regions: Sequence[str],
        seed: int = 0,
        duration_s: float | None = None,
        clients_per_region: int | Mapping[str, int] = 20,
        system_prompt_tokens: int = 0,
        think_time_s: float = 0.0,
        model: str = "default",
    ) -> None:
        check_duration(duration_s)
        if system_prompt_tokens < 0:
            raise ValueError(f"system_prompt_tokens must be >= 0, got {system_prompt_tokens}")
        if think_time_s < 0:
            raise ValueError(f"think_time_s must be >= 0, got {think_time_s}")
        self.regions = check_regions(regions)
        self.seed = seed
        self.duration_s = duration_s
        self.client_regions = client_regions(self.regions, clients_per_region)
        self.think_time_s = think_time_s
        self.model = model
        data = load_sharegpt(sharegpt_path())
        order = list(data.conversations)
        random.Random(f"sharegpt-chat/{seed}").shuffle(order)
        self.order: list[Conversation] = order
        self.system_tokens = list(shared_tokens("sharegpt/system", system_prompt_tokens))
        self.system_hashes = hash_token_blocks(self.system_tokens, BLOCK_SIZE)
        self._clients: list[_Client] = []

    def initial(self) -> Iterator[Arrival]:
        # Fresh client state, so a workload object can drive more than one run.
        self._clients = [_Client(i, r) for i, r in enumerate(self.client_regions)]
        arrivals = [self._next_conversation(c, 0.0) for c in self._clients]
        return iter([a for a in arrivals if a is not None])

    def on_complete(self, item: WorkItem, now: float, ok: bool = True) -> Iterable[Arrival]:
        client = self._clients[meta_int(item, "client")]
        if (
            client.conv is None
            or meta_int(item, "conv_seq") != client.started - 1
            or meta_int(item, "turn") != client.turn
        ):
            return ()  # not the client's outstanding request (stale or duplicate)
        t = now + self.think_time_s
        if ok and client.turn + 1 < len(client.conv.turns):
            client.turn += 1
            arrival = self._issue(client, t)
        else:
            arrival = self._next_conversation(client, t)
        return () if arrival is None else (arrival,)

    def _next_conversation(self, client: _Client, t: float) -> Arrival | None:
        pos = client.index + client.started * len(self._clients)
        if pos >= len(self.order):
            client.conv = None
            return None
        client.started += 1
        client.conv = self.order[pos]
        client.turn = 0
        client.tokens = list(self.system_tokens)
        client.hashes = list(self.system_hashes)
        return self._issue(client, t)

    def _issue(self, client: _Client, t: float) -> Arrival | None:
        conv = client.conv
        assert conv is not None
        if self.duration_s is not None and t >= self.duration_s:
            client.conv = None  # the run is over for this client
            return None
        prompt_tokens, response_tokens = conv.turns[client.turn]
        key = f"sharegpt/{conv.conv_id}/{client.turn}"
        # Empty prompts/responses exist in the data; a request needs at least one token.
        new_prompt = synth_tokens(f"{key}/prompt", max(1, prompt_tokens))
        output = synth_tokens(f"{key}/response", max(1, response_tokens))
        prompt_len = len(client.tokens) + len(new_prompt)
        client.tokens += new_prompt
        client.tokens += output
        client.hashes = extend_token_blocks(client.hashes, client.tokens, BLOCK_SIZE)
        item = WorkItem(
            request_id=f"sharegpt-c{client.index}-{conv.conv_id}-t{client.turn}",
            region=client.region,
            prompt_len=prompt_len,
            output_len=len(output),
            block_hashes=list(client.hashes),
            model=self.model,
            affinity_key=conv.conv_id,
            meta={"client": client.index, "conv_seq": client.started - 1, "turn": client.turn},
        )
        return t, item
