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
    med, lo, hi = (format(v, fmt) for v in (statistics.median(vals), min(vals), max(vals)))
    return med if lo == hi else f"{med} ({lo}-{hi})"


def table(doc: dict[str, Any]) -> str:
    n = doc["setup"]["followups"]
    out = ["| loss | routing | first follow-up, s after the loss | A's event batches by then "
           f"| follow-ups sent to A, of {n} | last one sent to A, s after the loss "
           "| A's event batches by then | cache hit rate | full hits | runs |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    arms = [("runs", arm, label) for arm, label in ARMS.items()]
    if doc.get("before_fix"):
        arms.append(("before_fix", "events", "events, before this change"))
    for scenario, what in SCENARIOS.items():
        for key, arm, label in arms:
            rows = [r for r in doc.get(key, ())
                    if r["scenario"] == scenario and r["arm"] == arm]
            if not rows:
                continue
            last_s = [r["last_to_lost_after_s"] for r in rows
                      if r["last_to_lost_after_s"] is not None]
            last_b = [r["last_to_lost_batches"] for r in rows
                      if r["last_to_lost_batches"] is not None]
            first = [r["requests"][0] for r in rows]
            out.append(
                f"| {what} | {label} "
                f"| {_spread([f['after_loss_s'] for f in first], '.2f')} "
                f"| {_spread([f['batches_after_loss'] for f in first], 'g')} "
                f"| {_spread([r['to_lost'] for r in rows], 'g')} "
                f"| {_spread(last_s, '.2f') if last_s else 'none'} "
                f"| {_spread(last_b, 'g') if last_b else 'none'} "
                f"| {_spread([100 * r['hit_rate'] for r in rows], '.1f')}% "
                f"| {_spread([r['hits'] for r in rows], 'g')} | {len(rows)} |")
    return "\n".join(out)


def _back_s(doc: dict[str, Any], arm: str) -> list[float]:
    return [r["a_back_in_balancer_s"] for r in doc["runs"]
            if r["scenario"] == "restart" and r["arm"] == arm
            and r.get("a_back_in_balancer_s") is not None]


def detection(doc: dict[str, Any]) -> str:
    rows, trie = _back_s(doc, "events"), _back_s(doc, "trie")
    if not rows:
        return ""
    return (f"After the restart, the balancer's `/status` showed A healthy with its events "
            f"`live` and its index empty {_spread(rows, '.2f')} s after the new process "
            f"was up (events arm; A healthy again after {_spread(trie, '.2f')} s in the "
            "trie arm, which has no index to empty).")


def vllm_section(doc: dict[str, Any]) -> str:
    v = doc.get("vllm")
    if not v:
        return ("(Not measured in this run. `skymesh_lab.bench.kv_eviction_vllm` runs the "
                "eviction case on two vLLM CPU servers; it needs the e2e lane's environment.)")
    s = v["setup"]
    cache = s.get("cache", {})
    return "\n".join([
        f"Engine: {s['engine']}, {s['replicas']} servers with KV events on, each KV cache "
        f"{cache.get('num_gpu_blocks', '?')} blocks of {cache.get('block_size', '?')} "
        f"tokens (`--kv-cache-memory-bytes` {s['kv_cache_memory_bytes']:,}); the servers "
        "shared by the runs, their prefix caches reset between runs, a fresh balancer for "
        f"each. A document of {s['doc_tokens']:,} token ids cached on server A and routed "
        f"there once; other clients' prompts of {s['fill_tokens']:,} tokens sent to A until "
        f"its events removed the document's first block; then {s['followups']} follow-ups "
        "through the balancer with A busy, one at a time. The cache hit is vLLM's own "
        "(`vllm:prefix_cache_hits_total` added on the server that took the request). "
        f"{s['repeats']} runs per row. Load average (1 min) "
        f"{s['load_average_1m_at_start']:g} at the start, {s['load_average_1m_at_end']:g} "
        "at the end. No restart here: a vLLM CPU server takes minutes to start on this "
        "shared machine. The first follow-up waits for the balancer's probe to see A "
        "busy, which took seconds on this load (its batches meanwhile are A's own "
        "generation's).", "",
        table(v), "",
        "Measured with `.venv/bin/python -m skymesh_lab.bench.kv_eviction_vllm --json "
        "docs/results/data/kv-eviction.json --vllm-env $SKYMESH_E2E_ENV` (it adds its runs "
        "under `vllm`)."])


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
        "block A's events removed ([KV-cache events]"
        "(../kv-events.md#when-a-replica-evicts-or-restarts)). The follow-ups are then "
        "scored by load. \"A's event batches by "
        "then\": batches A published between the loss (the batch that removed the "
        "document's first block; for a restart, the new process's start) and the last "
        "follow-up sent to A; the first follow-up's column bounds how soon the balancer knew "
        "(already then, where none went to A). The hit rate is the replicas' own "
        "(`usage.prompt_tokens_details.cached_tokens` over prompt tokens); a full hit "
        "served the whole document from cache. Whichever replica takes the first "
        "follow-up computes the document again and serves the rest from cache, so the hit "
        "rates are alike: what the events change is where the requests for a lost prefix "
        "go (to the busy replica for no cache benefit, or by load)."
        + (f" `events, before this change`: the events arm at "
           f"`{doc['before_fix'][0]['commit']}`, when a prompt no replica's events held "
           "went by the trie's record, stale or not: the events emptied A's index, and the "
           "trie sent the requests back to A all the same (recorded with `--arms events "
           "--into before_fix` on that code)." if doc.get("before_fix")
           else ""), "",
        detection(doc), "",
        "## On real vLLM (eviction)", "",
        vllm_section(doc)])


__all__ = ["page", "table", "vllm_section"]
