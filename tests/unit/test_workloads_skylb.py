"""SkyLB's own tree-of-thoughts client as workloads: ``tot-skylb``, ``mixed-tree-skylb``."""

from __future__ import annotations

from collections import Counter

import pytest

from skymesh_lab.sim.runner import SimConfig, run
from skymesh_lab.sim.workload import WorkItem
from skymesh_lab.sim.workloads import WORKLOAD_NAMES, build_workload
from skymesh_lab.sim.workloads.tot_skylb import SkyLBTreeWorkload
from skymesh_replica.engine.hashing import BLOCK_SIZE


def play(w: SkyLBTreeWorkload, trees: int) -> tuple[list[WorkItem], int]:
    """Complete requests oldest first (one at a time) until ``trees`` trees of client 0
    ended; every issued request, and the most client 0 had outstanding at once."""
    queue = [item for _, item in w.initial()]
    issued = list(queue)
    peak = 0
    while queue:
        outstanding = sum(1 for i in queue if i.meta["client"] == 0)
        peak = max(peak, outstanding)
        item = queue.pop(0)
        if item.meta["client"] == 0 and w._clients[0].started > trees:
            break
        new = [i for _, i in w.on_complete(item, 1.0)]
        issued += new
        queue += new
    return issued, peak


def test_both_are_registered() -> None:
    assert {"tot-skylb", "mixed-tree-skylb"} <= set(WORKLOAD_NAMES)
    w = build_workload("tot-skylb", regions=["us"], seed=0, duration_s=None)
    assert isinstance(w, SkyLBTreeWorkload)


def test_a_binary_tree_is_30_requests_of_four_levels_with_16_at_once() -> None:
    w = SkyLBTreeWorkload(regions=["us"], clients_per_region=1)
    issued, peak = play(w, trees=1)
    first = [i for i in issued if i.meta["tree_seq"] == 0]
    assert Counter(i.meta["level"] for i in first) == {1: 2, 2: 4, 3: 8, 4: 16}
    assert peak == 16
    assert {i.max_new_tokens for i in issued} == {256}
    assert all(16 <= i.output_len <= 256 for i in issued)


def test_siblings_are_identical_requests_and_children_extend_their_parent() -> None:
    w = SkyLBTreeWorkload(regions=["us"], clients_per_region=1)
    issued, _ = play(w, trees=1)
    tree = [i for i in issued if i.meta["tree_seq"] == 0]
    by_level: dict[int, set[tuple[int, ...]]] = {}
    for i in tree:
        by_level.setdefault(int(i.meta["level"]), set()).add(tuple(i.block_hashes))
    assert all(len(v) == 1 for v in by_level.values())  # identical prompt and answer
    for level in (1, 2, 3):
        (parent,) = by_level[level]
        (child,) = by_level[level + 1]
        assert child[: len(parent)] == parent  # the chat history grows
    nodes = {int(i.meta["node"]): i for i in tree}
    assert nodes[1].prompt_len > 27 + 63  # system header + plan turn + the question
    assert nodes[3].prompt_len > nodes[1].prompt_len + nodes[1].output_len


def test_distinct_siblings_differ_in_their_answers_only() -> None:
    w = SkyLBTreeWorkload(regions=["us"], clients_per_region=1, sibling_outputs="distinct")
    level1 = [i for _, i in w.initial()]
    a, b = level1
    assert a.prompt_len == b.prompt_len
    n = a.prompt_len // BLOCK_SIZE
    assert a.block_hashes[:n] == b.block_hashes[:n]
    assert a.block_hashes != b.block_hashes


def test_questions_follow_skylbs_split_and_repeat() -> None:
    w = SkyLBTreeWorkload(regions=["us", "eu"], clients_per_region=30)
    list(w.initial())
    for c in w._clients:
        r = 0 if c.region == "us" else 1
        assert c.questions and all(q % 30 == r for q in c.questions)
    us = [c for c in w._clients if c.region == "us"]
    assert us[0].questions[:2] == [0, 900]  # lines 0, 30, 60... dealt round robin
    one = SkyLBTreeWorkload(regions=["us"], clients_per_region=1)
    issued, _ = play(one, trees=2)
    assert one._clients[0].questions[:2] == [0, 1]
    # The single client's second tree is the next question; items carry the region key.
    assert {i.affinity_key for i in issued} == {"us"}
    # 7,473 train questions: 120 clients split 63 lines, so only 63 of them ever send.
    many = SkyLBTreeWorkload(regions=["us"], clients_per_region=120)
    assert len({i.meta["client"] for _, i in many.initial()}) == 63


def test_mixed_tree_defaults_follow_skylbs_setup() -> None:
    w = build_workload("mixed-tree-skylb", regions=["us", "eu", "asia"], seed=0,
                       duration_s=None)
    level1 = [i for _, i in w.initial()]
    per_region = Counter(i.region for i in level1)
    assert per_region == {"us": 2 * 4, "eu": 20 * 2, "asia": 20 * 2}


def test_nothing_is_issued_after_the_duration() -> None:
    w = SkyLBTreeWorkload(regions=["us"], clients_per_region=2, duration_s=5.0)
    first = [i for _, i in w.initial()]
    assert list(w.on_complete(first[0], 5.0)) == []


@pytest.mark.parametrize("scheduler", ["vllm", "sglang"])
def test_a_short_simulation_completes_every_request(scheduler: str) -> None:
    cfg = SimConfig(workload="tot-skylb", regions=["us"], replicas={"us": 1},
                    policy="least-load", scheduler=scheduler, duration_s=90.0,
                    workload_params={"clients_per_region": 3})
    res = run(cfg)
    assert res["scheduler"] == scheduler
    assert res["requests"] == res["completed"] >= 3 * 30  # every first tree ended
    assert res["prefix_hit_rate"] > 0.5  # identical siblings share their prompts
