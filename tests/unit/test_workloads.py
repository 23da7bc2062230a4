"""Invariants of the simulator's workloads (skymesh_lab.sim.workloads)."""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import common_prefix

from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_lab.sim.workloads import WORKLOAD_NAMES, build_workload, workload_params
from skymesh_lab.sim.workloads.azure import parse_timestamp
from skymesh_lab.sim.workloads.common import VOCAB_SIZE, meta_int, synth_tokens
from skymesh_lab.sim.workloads.data import DATA_DIR_ENV, data_dir
from skymesh_lab.sim.workloads.sharegpt import Conversation, ShareGPTChatWorkload
from skymesh_lab.sim.workloads.tot import TreeOfThoughtsWorkload
from skymesh_replica.engine.hashing import (
    BLOCK_SIZE,
    expand_block_ids,
    extend_token_blocks,
    hash_token_blocks,
)

REGIONS = ["us-east", "eu-west", "ap-south"]

# Small, fast settings per workload; every name of the contract must be here.
SMALL: dict[str, dict[str, object]] = {
    "mooncake-conversation": {"max_requests": 300},
    "mooncake-synthetic": {"max_requests": 300},
    "azure2023-code": {"max_requests": 300},
    "azure2023-conv": {"max_requests": 300},
    "sharegpt-chat": {"clients_per_region": 3},
    "tot-gsm8k": {"clients_per_region": 2},
    "tot-skylb": {"clients_per_region": 2},
    "mixed-tree-skylb": {"clients_per_region": 1},
    "poisson": {"rate_rps": 20.0},
}
DURATION_S = 30.0
CLOSED_LOOP = {"sharegpt-chat", "tot-gsm8k", "tot-skylb", "mixed-tree-skylb"}


def build(
    name: str, seed: int = 0, duration_s: float | None = DURATION_S, **extra: Any
) -> Workload:
    params = {**SMALL[name], **extra}
    return build_workload(name, regions=REGIONS, seed=seed, duration_s=duration_s, **params)


def service_time(item: WorkItem) -> float:
    return 0.05 + 0.002 * item.output_len


def drive(
    workload: Workload,
    *,
    fail: Callable[[WorkItem], bool] = lambda item: False,
    max_items: int = 20_000,
) -> list[Arrival]:
    """Run the workload against an ideal server; every issued arrival, in issue order."""
    issued: list[Arrival] = []
    tie = itertools.count()
    heap: list[tuple[float, int, WorkItem]] = []

    def accept(arrivals: Iterator[Arrival] | tuple[Arrival, ...] | list[Arrival]) -> None:
        for t, item in arrivals:
            issued.append((t, item))
            heapq.heappush(heap, (t + service_time(item), next(tie), item))

    accept(workload.initial())
    while heap and len(issued) < max_items:
        done, _, item = heapq.heappop(heap)
        accept(list(workload.on_complete(item, done, not fail(item))))
    return issued


def signature(arrivals: list[Arrival]) -> list[tuple[object, ...]]:
    return [
        (t, i.request_id, i.region, i.prompt_len, i.output_len, tuple(i.block_hashes))
        for t, i in arrivals
    ]



# --------------------------------------------------------------------------- registry


def test_contract_names() -> None:
    assert set(WORKLOAD_NAMES) == set(SMALL)


def test_unknown_workload_names_it_and_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="no-such-workload") as err:
        build_workload("no-such-workload", regions=REGIONS, seed=0, duration_s=None)
    for name in WORKLOAD_NAMES:
        assert name in str(err.value)


def test_unknown_parameter_is_rejected() -> None:
    with pytest.raises(ValueError, match="rate"):
        build_workload("poisson", regions=REGIONS, seed=0, duration_s=None, rate=3.0)
    assert workload_params("poisson")["rate_rps"] == 5.0


def test_data_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert data_dir() == tmp_path
    missing = tmp_path / "missing"
    monkeypatch.setenv(DATA_DIR_ENV, str(missing))
    with pytest.raises(FileNotFoundError, match=DATA_DIR_ENV) as err:
        data_dir()
    assert str(missing) in str(err.value)


# ------------------------------------------------------------------- all workloads


@pytest.mark.parametrize("name", sorted(SMALL))
def test_invariants(name: str) -> None:
    workload = build(name)
    initial = list(workload.initial())
    assert initial, name
    times = [t for t, _ in initial]
    assert times == sorted(times)
    arrivals = drive(build(name)) if name in CLOSED_LOOP else initial
    ids = [item.request_id for _, item in arrivals]
    assert len(ids) == len(set(ids))
    for t, item in arrivals:
        assert 0.0 <= t < DURATION_S
        assert item.region in REGIONS
        assert item.prompt_len > 0
        assert item.output_len >= 1
        assert item.model == "default"
        assert item.affinity_key
        n = len(item.block_hashes)
        assert (
            item.prompt_len // BLOCK_SIZE <= n <= (item.prompt_len + item.output_len) // BLOCK_SIZE
        )
        assert item.num_prompt_blocks == item.prompt_len // BLOCK_SIZE


@pytest.mark.parametrize("name", sorted(SMALL))
def test_same_seed_same_items(name: str) -> None:
    def run() -> list[tuple[object, ...]]:
        w = build(name, seed=7)
        return signature(drive(w) if name in CLOSED_LOOP else list(w.initial()))

    assert run() == run()


@pytest.mark.parametrize("name", ["sharegpt-chat", "tot-gsm8k", "poisson"])
def test_different_seed_different_items(name: str) -> None:
    def run(seed: int) -> list[tuple[object, ...]]:
        w = build(name, seed=seed)
        return signature(drive(w) if name in CLOSED_LOOP else list(w.initial()))

    assert run(1) != run(2)


@pytest.mark.parametrize("name", ["mooncake-conversation", "azure2023-conv", "poisson"])
def test_open_loop_duration_and_time_scale(name: str) -> None:
    extra: dict[str, Any] = {"max_requests": None} if name != "poisson" else {}
    full = list(build(name, duration_s=20.0, **extra).initial())
    assert full and all(t < 20.0 for t, _ in full)
    if name == "poisson":
        return
    fast = list(build(name, duration_s=10.0, time_scale=0.5, **extra).initial())
    # Compressing 2x fits the same first 20 s of trace into 10 s.
    assert [i.request_id for _, i in fast] == [i.request_id for _, i in full]
    assert [t for t, _ in fast] == pytest.approx([t / 2 for t, _ in full])


# ---------------------------------------------------------------------- sharegpt


def one_client_chat(**params: Any) -> ShareGPTChatWorkload:
    return ShareGPTChatWorkload(
        regions=REGIONS, seed=3, duration_s=None, clients_per_region={"eu-west": 1}, **params
    )


def test_sharegpt_turns_extend_the_conversation() -> None:
    workload = one_client_chat()
    arrivals = drive(workload, max_items=60)
    assert all(item.region == "eu-west" for _, item in arrivals)
    convs = iter(workload.order)
    conv = next(convs)
    checked = 0
    for (_, prev), (_, item) in itertools.pairwise(arrivals):
        turn = meta_int(item, "turn")
        if turn == 0:
            conv = next(convs)
            assert item.affinity_key == conv.conv_id
            continue
        assert turn == meta_int(prev, "turn") + 1
        new_prompt = max(1, conv.turns[turn][0])
        assert item.prompt_len == prev.prompt_len + prev.output_len + new_prompt
        assert item.output_len == max(1, conv.turns[turn][1])
        known = (prev.prompt_len + prev.output_len) // BLOCK_SIZE
        assert len(prev.block_hashes) == known
        assert item.block_hashes[:known] == prev.block_hashes
        checked += 1
    assert checked > 5


def test_sharegpt_empty_turns_still_send_tokens() -> None:
    workload = one_client_chat()
    workload.order = [Conversation("empty", ((0, 0), (5, 0)))]
    ((_, first),) = list(workload.initial())
    assert (first.prompt_len, first.output_len) == (1, 1)
    ((_, second),) = list(workload.on_complete(first, 1.0))
    assert (second.prompt_len, second.output_len) == (1 + 1 + 5, 1)
    assert list(workload.on_complete(second, 2.0)) == []  # no conversation left


def test_sharegpt_system_prompt_shared_by_all_conversations() -> None:
    workload = ShareGPTChatWorkload(
        regions=REGIONS, seed=0, duration_s=None, clients_per_region=2, system_prompt_tokens=40
    )
    firsts = [item for _, item in workload.initial()]
    assert len(firsts) == 6
    assert len({tuple(i.block_hashes[:2]) for i in firsts}) == 1  # 40 tokens: 2 full blocks
    assert len({i.block_hashes[2] for i in firsts}) == 6


def test_sharegpt_failure_moves_to_next_conversation() -> None:
    workload = one_client_chat()
    ((_, first),) = list(workload.initial())
    ((_, nxt),) = list(workload.on_complete(first, 1.0, ok=False))
    assert nxt.meta["turn"] == 0
    assert nxt.affinity_key == workload.order[1].conv_id
    assert common_prefix(first.block_hashes, nxt.block_hashes) == 0


def test_sharegpt_think_time_and_duration() -> None:
    workload = one_client_chat(think_time_s=2.0)
    workload.duration_s = 10.0
    ((_, first),) = list(workload.initial())
    ((t, _),) = list(workload.on_complete(first, 3.0))
    assert t == 5.0
    workload = one_client_chat(think_time_s=2.0)
    workload.duration_s = 10.0
    ((_, first),) = list(workload.initial())
    assert list(workload.on_complete(first, 8.5)) == []  # would be issued at 10.5
    # The client is finished: even a late duplicate completion issues nothing.
    assert list(workload.on_complete(first, 1.0)) == []


def test_sharegpt_clients_per_region_mapping() -> None:
    w = ShareGPTChatWorkload(
        regions=REGIONS, seed=0, duration_s=None, clients_per_region={"us-east": 2, "ap-south": 1}
    )
    regions = sorted(item.region for _, item in w.initial())
    assert regions == ["ap-south", "us-east", "us-east"]
    with pytest.raises(ValueError, match="mars"):
        ShareGPTChatWorkload(regions=REGIONS, clients_per_region={"mars": 1})


# --------------------------------------------------------------------------- tot


def one_tree_client(branching: int = 2, seed: int = 0) -> TreeOfThoughtsWorkload:
    return TreeOfThoughtsWorkload(
        regions=REGIONS,
        seed=seed,
        duration_s=None,
        clients_per_region={"us-east": 1},
        branching=branching,
    )


def run_one_tree(
    workload: TreeOfThoughtsWorkload, fail: Callable[[WorkItem], bool] = lambda i: False
) -> tuple[list[WorkItem], WorkItem]:
    """Every node of the first tree, completing them breadth first; and the next root."""
    ((_, root),) = list(workload.initial())
    queue, nodes = [root], []
    while queue:
        item = queue.pop(0)
        nodes.append(item)
        for _, nxt in workload.on_complete(item, float(len(nodes)), not fail(item)):
            if nxt.meta["tree_seq"] != root.meta["tree_seq"]:
                return nodes, nxt
            queue.append(nxt)
    raise AssertionError("the client did not start a next tree")


@pytest.mark.parametrize(("branching", "size"), [(2, 15), (4, 85)])
def test_tot_tree_size(branching: int, size: int) -> None:
    nodes, nxt = run_one_tree(one_tree_client(branching))
    assert len(nodes) == size
    assert {n.affinity_key for n in nodes} == {nodes[0].affinity_key}
    assert nxt.affinity_key != nodes[0].affinity_key
    assert nxt.meta["node"] == 0


def test_tot_children_share_parent_context_and_siblings_diverge() -> None:
    nodes, _ = run_one_tree(one_tree_client())
    by_node = {meta_int(n, "node"): n for n in nodes}
    for node, item in by_node.items():
        if node == 0:
            continue
        parent = by_node[(node - 1) // 2]
        known = (parent.prompt_len + parent.output_len) // BLOCK_SIZE
        assert item.block_hashes[:known] == parent.block_hashes[:known]
        assert item.prompt_len == parent.prompt_len + parent.output_len + 12
        sibling = by_node[node + 1 if node % 2 else node - 1]
        assert common_prefix(item.block_hashes, sibling.block_hashes) == known


def test_tot_trees_share_exactly_the_system_prefix() -> None:
    nodes, next_root = run_one_tree(one_tree_client())
    shared = common_prefix(nodes[0].block_hashes, next_root.block_hashes)
    assert shared == 150 // BLOCK_SIZE


def test_tot_failure_abandons_subtree() -> None:
    nodes, nxt = run_one_tree(one_tree_client(), fail=lambda i: i.meta["node"] == 1)
    # Root, both children, then only node 2's subtree (2 + 4 nodes).
    assert len(nodes) == 9
    assert all(n.meta["node"] in {0, 1, 2, 5, 6, 11, 12, 13, 14} for n in nodes)
    assert nxt.meta["node"] == 0


def test_tot_no_request_after_duration() -> None:
    workload = one_tree_client()
    workload.duration_s = 5.0
    ((_, root),) = list(workload.initial())
    assert len(list(workload.on_complete(root, 4.0))) == 2
    assert list(workload.on_complete(root, 4.0)) == []  # duplicate completion
    workload = one_tree_client()
    workload.duration_s = 5.0
    ((_, root),) = list(workload.initial())
    assert list(workload.on_complete(root, 5.0)) == []


# ---------------------------------------------------------------------- mooncake


def test_mooncake_full_trace() -> None:
    w = build_workload(
        "mooncake-conversation", regions=REGIONS, seed=0, duration_s=None, max_requests=None
    )
    n, last = 0, 0.0
    for t, _item in w.initial():
        assert t >= last
        last = t
        n += 1
    assert n == 12_031
    assert last > 3000


def test_mooncake_rows_with_common_ids_share_blocks() -> None:
    path = data_dir() / "mooncake_fast25" / "conversation_trace.jsonl"
    with path.open() as f:
        rows = [json.loads(line) for line in itertools.islice(f, 400)]
    items = [i for _, i in build("mooncake-conversation", duration_s=None).initial()]
    assert len(items) == 300
    pairs = 0
    for a, b in itertools.combinations(range(300), 2):
        ids_a, ids_b = rows[a]["hash_ids"], rows[b]["hash_ids"]
        common_ids = common_prefix(ids_a, ids_b)
        if common_ids < 2:
            continue
        pairs += 1
        ha, hb = items[a].block_hashes, items[b].block_hashes
        expected = min(common_ids * 512 // BLOCK_SIZE, len(ha), len(hb))
        assert common_prefix(ha, hb) == expected
        # Same chain under the first id after block 0: same region.
        assert items[a].region == items[b].region
    assert pairs > 0
    for row, item in zip(rows, items, strict=False):
        assert item.block_hashes == expand_block_ids(
            row["hash_ids"], 512, row["input_length"], BLOCK_SIZE
        )


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 50), max_size=4),
    tail_a=st.lists(st.integers(51, 100), max_size=3),
    tail_b=st.lists(st.integers(101, 150), max_size=3),
    cut=st.integers(0, 511),
)
def test_expand_block_ids_shares_exactly_the_common_id_prefix(
    prefix: list[int], tail_a: list[int], tail_b: list[int], cut: int
) -> None:
    a, b = prefix + tail_a, prefix + tail_b
    ha = expand_block_ids(a, 512, len(a) * 512, BLOCK_SIZE)
    hb = expand_block_ids(b, 512, len(b) * 512, BLOCK_SIZE)
    shared = len(prefix) * 512 // BLOCK_SIZE
    assert ha[:shared] == hb[:shared]
    assert all(x != y for x, y in zip(ha[shared:], hb[shared:], strict=False))
    # A shorter prompt gives a prefix of the same hashes (memoised or not).
    short = max(0, len(a) * 512 - cut)
    assert expand_block_ids(a, 512, short, BLOCK_SIZE) == ha[: short // BLOCK_SIZE]


# ---------------------------------------------------------------- hashing / tokens


@settings(max_examples=80, deadline=None)
@given(
    head=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=80),
    tail=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=80),
)
def test_extend_token_blocks_prefix_property(head: list[int], tail: list[int]) -> None:
    known = hash_token_blocks(head, BLOCK_SIZE)
    full = hash_token_blocks(head + tail, BLOCK_SIZE)
    assert extend_token_blocks(known, head + tail, BLOCK_SIZE) == full
    assert full[: len(known)] == known
    assert len(full) == (len(head) + len(tail)) // BLOCK_SIZE


def test_synth_tokens_deterministic_and_in_range() -> None:
    a = synth_tokens("conv/1", 500)
    assert a == synth_tokens("conv/1", 500)
    assert synth_tokens("conv/1", 20) == a[:20]
    assert a != synth_tokens("conv/2", 500)
    assert all(0 <= x < VOCAB_SIZE for x in a)
    assert synth_tokens("x", 0) == []


# ------------------------------------------------------------------ azure / poisson


def test_azure_prompts_share_nothing() -> None:
    items = [i for _, i in build("azure2023-code", duration_s=None).initial()]
    blocks = [h for i in items for h in i.block_hashes]
    assert len(blocks) == len(set(blocks))
    assert [i.region for i in items[:6]] == REGIONS * 2
    assert parse_timestamp("2023-11-16 18:17:04.0319600") - parse_timestamp(
        "2023-11-16 18:17:03.9799600"
    ) == pytest.approx(0.052)


def test_poisson_fixed_lengths_and_rate() -> None:
    w = build_workload(
        "poisson",
        regions=REGIONS,
        seed=5,
        duration_s=None,
        rate_rps=50.0,
        prompt_len=100,
        output_len=20,
    )
    items = list(w.initial())
    assert all(t < 60.0 for t, _ in items)  # default duration
    assert 2700 < len(items) < 3300
    assert {(i.prompt_len, i.output_len) for _, i in items} == {(100, 20)}
    assert [i.region for _, i in items[:3]] == REGIONS
    assert len({i.block_hashes[0] for _, i in items}) == len(items)
