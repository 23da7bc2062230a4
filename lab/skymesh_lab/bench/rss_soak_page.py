"""The results page of ``skymesh_lab.bench.rss_soak``: skymesh-lb's memory and CPU over a
long run of mixed requests (issue #35 item 5, docs/notes/memory-1m.md).

Kept apart from the measurement so the results registry (``results_pages``) renders the
page from the JSON alone.
"""

from __future__ import annotations

from typing import Any

EVERY = 100_000  # the table's step, in requests


def _row(s: dict[str, Any], first: dict[str, Any], prev: dict[str, Any] | None) -> str:
    done = s["requests"]
    cpu = (f"{(s['cpu_s'] - prev['cpu_s']) * 1e6 / (done - prev['requests']):.0f}"
           if prev is not None and done > prev["requests"] else "")
    return (f"| {done:,} | {s['rss_mb']:.1f} | {s['rss_mb'] - first['rss_mb']:+.1f} | "
            f"{s.get('procs', 1)} | {cpu} |")


def _table(samples: list[dict[str, Any]]) -> str:
    first = samples[0]
    # every 100,000 requests; every sample of a run too short for that
    step = EVERY if samples[-1]["requests"] >= 2 * EVERY else 1
    picked = [s for s in samples if s["requests"] % step == 0]
    if picked[-1] is not samples[-1]:
        picked.append(samples[-1])  # a run that stopped between two steps
    out = ["| requests | RSS, MB | since the start | processes | CPU ms per 1,000 requests "
           "since the row before | 503s since the row before |",
           "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    prev = None
    for s in picked:
        lo = prev["requests"] if prev is not None else -1
        # older runs recorded no outcomes: the column stays empty for them
        busy = [x["outcomes"].get("503", 0) for x in samples
                if lo < x["requests"] <= s["requests"] and "outcomes" in x]
        out.append(f"{_row(s, first, prev)} {sum(busy) if busy else ''} |")
        prev = s
    return "\n".join(out)


# Which scenarios end in which outcome of skymesh_requests_total.
_WHY = {"ok": "the replies, and clients that left after theirs was written",
        "BadRequest": "bad_json", "ModelNotFound": "unknown_model",
        "UpstreamFailed": "replica_error, after its retry",
        "cancelled": "clients that left while their request was queued",
        "client_disconnected": "clients that left while a replica held their request or "
                               "mid-stream"}


def outcomes_note(outcomes: dict[str, int]) -> str:
    """The balancer's own count by outcome, each with the scenarios it comes from."""
    parts = [f"`{k}` {v:,}" + (f" ({_WHY[k]})" if k in _WHY else "")
             for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])]
    errors = outcomes.get("error", 0)
    verdict = (f"**{errors:,} `error`**: exceptions the balancer did not expect (its log "
               "says which)" if errors else
               "no `error` (an exception the balancer did not expect)")
    return (f"The balancer's own count at the end (`skymesh_requests_total` by outcome, all "
            f"workers): {'; '.join(parts)}. The clients that leave do so by design; "
            f"{verdict}.")


def rss_soak(doc: dict[str, Any]) -> str:
    samples = doc["samples"]
    first, last = samples[0], samples[-1]
    warm = next((s for s in samples if s["requests"] >= doc.get("warmup", 0)), last)
    top = max(samples, key=lambda s: s["rss_mb"])
    after_warm = [s for s in samples if s["requests"] >= warm["requests"]]
    low = min(after_warm, key=lambda s: s["rss_mb"])
    done = doc["requests"]
    stopped = ("" if doc.get("complete", True) else
               f" The run was stopped at {done:,} of the {doc['requests_asked']:,} requests "
               "asked: the figures are those of the requests made.")
    summary = [
        "| | requests | RSS, MB (all processes) |", "| --- | ---: | ---: |",
        f"| at the start | 0 | {first['rss_mb']:.1f} |",
        f"| after the warm-up | {warm['requests']:,} | {warm['rss_mb']:.1f} |",
        f"| at the end | {last['requests']:,} | {last['rss_mb']:.1f} |",
        f"| highest | {top['requests']:,} | {top['rss_mb']:.1f} |",
        f"| lowest after the warm-up | {low['requests']:,} | {low['rss_mb']:.1f} |",
    ]
    growth = last["rss_mb"] - warm["rss_mb"]
    span = last["requests"] - warm["requests"]
    slope = f"{growth * EVERY / span:+.2f} MB per 100,000 requests" if span else "no span"
    workers = doc.get("workers", "default")
    policy = doc.get("policy", "default")
    return "\n\n".join([
        "\n".join(summary),
        f"From the warm-up to the end RSS moved by **{growth:+.1f} MB** over {span:,} "
        f"requests ({slope}); the balancer used **{doc['cpu_ms_per_1000']:.0f} ms of CPU "
        f"per 1,000 requests** (all its processes, user + system).{stopped}",
        _table(samples),
        *([outcomes_note(doc["lb_outcomes"])] if "lb_outcomes" in doc else []),
        f"Setup: `skymesh-lb` with policy `{policy}` and workers `{workers}` (\"default\": "
        f"the balancer's own, prefix-tree with sp-p and `listen.workers: auto`), "
        f"{doc.get('processes', 1)} processes at the end (the supervisor and its workers; "
        "RSS and CPU are their sums, read from /proc every "
        f"{samples[1]['requests'] - samples[0]['requests'] if len(samples) > 1 else 0:,} "
        f"requests), {doc['concurrency']} clients cycling through "
        f"{len(doc['scenarios'])} scenarios ({', '.join(doc['scenarios'])}), access log "
        f"{'on' if doc.get('access_log', True) else 'off'}. The soak ran at nice "
        f"{doc.get('nice', 0)} on a 2-core machine shared with other sessions (load average "
        f"{doc.get('loadavg_now', [0.0])[0]:.1f} at the end; {last.get('t_s', 0) / 60:.0f} "
        "minutes): RSS is exact, CPU per request is not (a starved balancer wakes for fewer "
        "requests at a time).",
    ])
