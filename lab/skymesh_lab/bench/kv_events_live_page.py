"""The results page of ``skymesh_lab.bench.kv_events_live``: prefix routing on the trie vs
on real vLLM's KV-cache events, through 1, 2 and 4 balancers.

Kept apart from the measurement so the results registry (``results_pages``) renders the
page from the JSON alone.
"""

from __future__ import annotations

import statistics
from typing import Any


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:,.0f}"


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


# Arms in table order. "events-only": an earlier run's events arm, when a prompt cached
# nowhere went by load instead of to the trie's pick (its rows name their commit).
LABELS = {"trie": "trie", "events-only": "events, none cached: by load", "exact": "events"}


def table(doc: dict[str, Any]) -> str:
    runs = doc["runs"] + doc.get("earlier_runs", [])
    out = ["| balancers | routing | prefix cache hit rate | TTFT mean, ms | TTFT p50, ms "
           "| TTFT p90, ms | failed | runs |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in doc["setup"]["balancers"]:
        for mode, label in LABELS.items():
            rows = [r for r in runs if r["balancers"] == n and r["mode"] == mode]
            if not rows:
                continue
            out.append(f"| {n} | {label} "
                       f"| {_pct(_med(rows, 'hit_rate'))} | {_ms(_med(rows, 'ttft_mean_s'))} "
                       f"| {_ms(_med(rows, 'ttft_p50_s'))} | {_ms(_med(rows, 'ttft_p90_s'))} "
                       f"| {sum(r['failed'] for r in rows)} | {len(rows)} |")
    return "\n".join(out)


def simulator_table(doc: dict[str, Any]) -> str:
    sim = doc.get("simulator")
    if not sim:
        return "(not measured in this run)"
    out = ["| workload | balancers | routing | prefix hit rate, mean of seeds | per seed "
           "| TTFT mean, ms | throughput, req/s |",
           "| --- | ---: | --- | ---: | --- | ---: | ---: |"]
    for wl, rows in sim.items():
        for r in rows:
            hit = statistics.fmean(r["hit_rate"])
            out.append(f"| `{wl}` | {r['balancers']} "
                       f"| {'events' if r['mode'] == 'exact' else 'trie'} | {100 * hit:.1f}% "
                       f"| {', '.join(f'{100 * h:.1f}' for h in r['hit_rate'])} "
                       f"| {_ms(statistics.fmean(r['ttft_mean_s']))} "
                       f"| {statistics.fmean(r['throughput_rps']):.2f} |")
    return "\n".join(out)


def page(doc: dict[str, Any]) -> str:
    s = doc["setup"]
    cache = s.get("cache", {})
    load = ""
    if "load_average_1m_at_start" in s:
        load = (f" The machine is shared with other sessions: load average "
                f"(1 min) {s['load_average_1m_at_start']:g} at the start, "
                f"{s['load_average_1m_at_end']:g} at the end, so TTFT is noisy; the hit "
                "rate depends on routing only.")
    cache_txt = ""
    if cache:
        cache_txt = (f" Each server's KV cache: {cache.get('num_gpu_blocks', '?')} blocks of "
                     f"{cache.get('block_size', '?')} tokens "
                     f"({s['kv_cache_memory_bytes']:,} bytes).")
    return "\n".join([
        f"Engine: {s['engine']}, {s['replicas']} servers with KV events on.{cache_txt} "
        f"{s['docs']} documents of about {s['doc_chars']:,} characters (GSM8K questions), "
        f"{s['requests_per_arm']} streamed chat requests per run (the document as system "
        f"message, a GSM8K test question, `max_tokens` {s['max_tokens']}), "
        f"{s['clients']} closed-loop clients spread round-robin over the balancers, "
        f"`{s['policy']}`, {s['workers_per_balancer']} worker per balancer, "
        f"{s['repeats']} repeat(s), arms interleaved.{load}", "",
        "The hit rate is vLLM's own: added `vllm:prefix_cache_hits_total` over added "
        "`vllm:prefix_cache_queries_total` (prompt tokens), both servers. TTFT is the "
        "client's, to the first streamed event. Medians over repeats.", "",
        table(doc), "",
        "`trie`: each balancer scores prefixes on its own trie of its own decisions (it "
        "knows nothing of the other balancers' routing, nor of evictions). `events`: the "
        "replicas' `kv_events` and the model folder as `tokenizer`, every balancer scoring "
        "on the same exact block index ([KV-cache events](../kv-events.md)); a prompt no "
        "replica holds a block of is left to the balancer's trie, which knows where it sent "
        "the requests still in prefill (unpublished)."
        + (f" `events, none cached: by load`: the same arm at commit "
           f"`{doc['earlier_runs'][0]['commit']}`, when such a prompt went to the least "
           "loaded replica instead." if doc.get("earlier_runs") else ""), "",
        "## In the simulator", "",
        "`skymesh_lab.sim` with `exact_prefix_state` (each balancer reads its replicas' "
        "cache state at a request's arrival, as following the events gives, without their "
        "delay): one region of 4 emulated replicas (the default profile), 1, 2 and 4 "
        "balancers sharing nothing (each its own trie, each pushing with its share of the "
        "free slots), prefix-tree with sp-p, 120 s per run, seeds 0-2.", "",
        simulator_table(doc)])


__all__ = ["LABELS", "page", "simulator_table", "table"]
