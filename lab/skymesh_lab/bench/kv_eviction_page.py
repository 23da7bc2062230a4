"""The results page of ``skymesh_lab.bench.kv_eviction``: requests for a prefix a replica
lost (restart, eviction), routed on the trie vs on the engines' KV-cache events.

Kept apart from the measurement so the results registry (``results_pages``) renders the
page from the JSON alone.
"""

from __future__ import annotations

import statistics
from typing import Any

ARMS = {"trie": "trie", "events": "events"}
SCENARIOS = {"restart": "A restarted (empty cache, event seq from 0)",
             "evict": "A evicted it (`BlockRemoved`, other clients filled its cache)"}


def _spread(vals: list[float], fmt: str) -> str:
    """Median, and the range when the runs differ."""
    if not vals:
        return "-"
    med, lo, hi = statistics.median(vals), min(vals), max(vals)
    if lo == hi:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(lo, fmt)}-{format(hi, fmt)})"


def table(doc: dict[str, Any]) -> str:
    n = doc["setup"]["followups"]
    out = ["| loss | routing | follow-ups sent to A, of " f"{n} | last one sent to A, s after "
           "the loss | A's event batches by then | cache hit rate | full hits | runs |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for scenario, what in SCENARIOS.items():
        for arm, label in ARMS.items():
            rows = [r for r in doc["runs"] if r["scenario"] == scenario and r["arm"] == arm]
            if not rows:
                continue
            last_s = [r["last_to_lost_after_s"] for r in rows
                      if r["last_to_lost_after_s"] is not None]
            last_b = [r["last_to_lost_batches"] for r in rows
                      if r["last_to_lost_batches"] is not None]
            out.append(
                f"| {what} | {label} | {_spread([r['to_lost'] for r in rows], 'g')} "
                f"| {_spread(last_s, '.2f') if last_s else 'none'} "
                f"| {_spread(last_b, 'g') if last_b else 'none'} "
                f"| {_spread([100 * r['hit_rate'] for r in rows], '.1f')}% "
                f"| {_spread([r['hits'] for r in rows], 'g')} | {len(rows)} |")
    return "\n".join(out)


def detection(doc: dict[str, Any]) -> str:
    rows = [r["a_back_in_balancer_s"] for r in doc["runs"]
            if r["scenario"] == "restart" and r["arm"] == "events"
            and r.get("a_back_in_balancer_s") is not None]
    trie = [r["a_back_in_balancer_s"] for r in doc["runs"]
            if r["scenario"] == "restart" and r["arm"] == "trie"
            and r.get("a_back_in_balancer_s") is not None]
    if not rows:
        return ""
    return (f"After the restart, the balancer's `/status` showed A healthy with its events "
            f"`live` and its index empty {_spread(rows, '.2f')} s after the new process "
            f"was up (events arm; A healthy again after {_spread(trie, '.2f')} s in the "
            "trie arm, which has no index to empty).")


def page(doc: dict[str, Any]) -> str:
    s = doc["setup"]
    return "\n".join([
        f"Setup: one `skymesh-lb` (`{s['policy']}`, the default push mode; events: "
        f"`heartbeat_s` {s['heartbeat_s']:g}, `stale_after_s` {s['stale_after_s']:g}) in "
        f"front of {s['replicas']} emulated replicas (`{s['profile']}`: {s['kv_blocks']:,} "
        f"KV blocks of {s['block_size']} tokens, `--time-scale` {s['time_scale']:g}) "
        "publishing KV-cache events, real processes over loopback, fresh for every run. A "
        f"document of {s['doc_tokens']:,} token ids is cached on replica A, then sent once "
        "through the balancer, which routes it to A. Then A loses it: it is killed and "
        f"started again on the same ports, or other clients send it {s['fill_prompts']} "
        f"prompts of {s['fill_tokens']:,} tokens and its LRU evicts the document. Then, "
        "with A kept busy by another client's long generation (so that load points away "
        f"from A), {s['followups']} requests for the document (each with its own "
        f"{s['question_tokens']}-token question) go through the balancer one after another. "
        f"{s['repeats']} runs per row, arms interleaved; medians, the range in brackets. "
        f"Load average (1 min) {s['load_average_1m_at_start']:g} at the start, "
        f"{s['load_average_1m_at_end']:g} at the end (the machine is shared; the counts "
        "depend on routing only, the times on the machine too).", "",
        table(doc), "",
        "`trie`: the balancer without `kv_events`, scoring prefixes on its trie of its own "
        "decisions, which still says A holds the document: every follow-up goes to the busy "
        "replica A, until the trie's entries age out (they did not in these runs). `events`: "
        "the replicas' `kv_events` in the balancer's config; A's index drops the document "
        "with the batch that says so (a restart clears it: the new publisher's sequence "
        "numbers go back to 0, or its replay endpoint no longer holds the last batch), and "
        "the balancer does not believe its trie's record of A for a prompt whose leading "
        "block A's events removed ([KV-cache events](../kv-events.md#when-a-replica-evicts-"
        "or-restarts)). The follow-ups are then scored by load. \"A's event batches by "
        "then\": batches A published between the loss (the batch that removed the "
        "document's first block; for a restart, the new process's start) and the last "
        "follow-up sent to A. The hit rate is the replicas' own "
        "(`usage.prompt_tokens_details.cached_tokens` over prompt tokens); a full hit "
        "served the whole document from cache. Whichever replica takes the first "
        "follow-up computes the document again and serves the rest from cache, so the hit "
        "rates are alike: what the events change is where the requests for a lost prefix "
        "go (to the busy replica for no cache benefit, or by load).", "",
        detection(doc)])


__all__ = ["page", "table"]
