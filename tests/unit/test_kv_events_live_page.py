"""The kv-events results page's simulator section (skymesh_lab.bench.kv_events_live_page):
three regions, 1 to 8 balancers per region, trie against delayed events."""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.kv_events_live_page import page, regions_verdict, simulator_part


def row(n: int, mode: str, hit: float) -> dict[str, Any]:
    return {"balancers": n, "mode": mode, "hit_rate": [hit, hit], "ttft_mean_s": [0.1, 0.3],
            "ttft_p90_s": [0.2, 0.2], "throughput_rps": [5.0, 7.0], "forwarded": [2, 4]}


def sim(exact_at_8: float) -> dict[str, Any]:
    return {"setup": {"regions": ["us", "eu", "asia"], "replicas_per_region": 4,
                      "balancers_per_region": [1, 8], "seeds": [0, 1], "duration_s": 120.0,
                      "policy": "prefix-tree", "forwarding": True, "slow_delay_s": 1.0,
                      "workload_params": {"sharegpt-chat": {"clients_per_region": {
                          "us": 120, "eu": 40, "asia": 40}}}},
            "results": {"tot-gsm8k": [
                row(1, "trie", 0.9), row(1, "exact", 0.9), row(8, "trie", 0.6),
                row(8, "exact", exact_at_8), row(8, "exact-no-delay", 0.89),
                row(8, "exact-slow", 0.8)]}}


def live_doc(**extra: Any) -> dict[str, Any]:
    setup = {"engine": "vllm", "replicas": 2, "docs": 3, "doc_chars": 100,
             "requests_per_arm": 10, "max_tokens": 4, "clients": 2, "policy": "prefix-tree",
             "workers_per_balancer": 1, "repeats": 1, "balancers": [1]}
    run = {"balancers": 1, "mode": "trie", "hit_rate": 0.5, "ttft_mean_s": 0.1,
           "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "failed": 0}
    return {"setup": setup, "runs": [run], **extra}


def test_the_table_has_every_arm_with_its_share_of_one_balancers_hit_rate() -> None:
    text = simulator_part(live_doc(simulator_regions=sim(0.88)))
    assert "three regions, up to 8 balancers per region" in text
    assert "us 120, eu 40, asia 40" in text
    assert "| `tot-gsm8k` | 8 | trie | 60.0% | 60.0, 60.0 | 66.7% | 200 | 200 | 6.00 | 3 |" \
        in text
    assert "| `tot-gsm8k` | 8 | events | 88.0% |" in text
    assert "| `tot-gsm8k` | 8 | events, no delay | 89.0% |" in text
    assert "| `tot-gsm8k` | 8 | events, 1 s behind | 80.0% |" in text


def test_the_verdict_says_whether_the_bar_is_met() -> None:
    met = regions_verdict(sim(0.88))  # 97.8% of 0.9
    assert "events keep 97.8% of one balancer's hit rate" in met
    assert "the trie 66.7%" in met and "is met." in met
    assert "TTFT mean on events 200 ms against 200 ms at one balancer" in met
    assert "requests forwarded 3 against 3." in met
    assert "no delay 89.0%, 1 s behind 80.0%, against 88.0% with the default" in met
    assert "is NOT met." in regions_verdict(sim(0.8))  # 88.9% < 95%


def test_the_page_renders_the_three_region_section_or_an_older_files_table() -> None:
    assert "## In the simulator: three regions" in page(live_doc(simulator_regions=sim(0.88)))
    old = {"tot-gsm8k": [{"balancers": 1, "mode": "exact", "hit_rate": [0.9],
                          "ttft_mean_s": [0.1], "throughput_rps": [7.0]}]}
    text = page(live_doc(simulator=old))
    assert "## In the simulator\n" in text and "| `tot-gsm8k` | 1 | events | 90.0% |" in text
