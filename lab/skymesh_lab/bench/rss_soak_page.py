"""The results page of ``skymesh_lab.bench.rss_soak``: skymesh-lb's memory and CPU over a
long run of mixed requests (issue #35 item 5, docs/notes/memory-1m.md).

Kept apart from the measurement so the results registry (``results_pages``) renders the
page from the JSON alone.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

EVERY = 100_000  # the table's step, in requests
# "Flat": RSS rises by less than this per EVERY requests over the last FLAT_SPAN requests
# (the least-squares slope of the samples there; one sample's noise is about 0.5 MB).
FLAT_MB = 2.0
FLAT_SPAN = 600_000
STRUCTURES = "rss-soak-structures"  # the attached probe run (results_pages.Source.attach)
LEAVE_HOLD = "rss-soak-leave-hold"  # the attached run with --leave-hold-ms
ATTACHED = (STRUCTURES, LEAVE_HOLD)
DATA = "docs/results/data"


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
    left = any("lb_left" in x for x in samples)  # older runs did not read the count
    out = ["| requests | RSS, MB | since the start | processes | CPU ms per 1,000 requests "
           "since the row before | 503s since the row before |"
           + (" clients that left since the row before, the balancer's count |" if left
              else ""),
           "| ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if left else "")]
    prev = None
    for s in picked:
        lo = prev["requests"] if prev is not None else -1
        # older runs recorded no outcomes: the column stays empty for them
        busy = [x["outcomes"].get("503", 0) for x in samples
                if lo < x["requests"] <= s["requests"] and "outcomes" in x]
        row = f"{_row(s, first, prev)} {sum(busy) if busy else ''} |"
        if left:
            gone = (_left(s) - _left(prev)) if prev is not None and "lb_left" in s else None
            row += f" {'' if gone is None else f'{gone:,}'} |"
        out.append(row)
        prev = s
    return "\n".join(out)


def _left(sample: dict[str, Any]) -> int:
    """Clients that left so far by the balancer's count: requests that ended ``cancelled``
    or ``client_disconnected`` (the writes that found a client gone are among the
    latter)."""
    counts = sample.get("lb_left", {})
    return int(counts.get("cancelled", 0)) + int(counts.get("client_disconnected", 0))


def leaving_note(doc: dict[str, Any]) -> str:
    """Clients that leave: what the balancer's log says of them (no ERROR line, no
    traceback, issue #35) and whether its count of them moved all along."""
    errors = doc["log_errors"]
    counted = [s for s in doc["samples"] if "lb_left" in s]
    n_err, n_tb = errors["error_lines"], errors["tracebacks"]
    verdict = ("**no ERROR line and no traceback**" if not n_err and not n_tb else
               f"**{n_err:,} ERROR line(s) and {n_tb:,} traceback(s)** (the first: "
               + "; ".join(f"`{line}`" for line in errors["first"]) + ")")
    text = (f"Clients that leave (`leave_mid_stream`, `leave_at_once`): the balancer's log "
            f"(stdout and stderr of the supervisor and its workers, at the default level) "
            f"holds {verdict} over the run.")
    if counted:
        last = counted[-1]["lb_left"]
        steps = list(itertools.pairwise(counted))
        moved = sum(_left(b) > _left(a) for a, b in steps)
        writes = {k.removeprefix("write_"): v for k, v in last.items()
                  if k.startswith("write_")}
        text += (f" Its count of them moved in {moved} of the {len(steps)} intervals between "
                 f"samples and stood at the end at `cancelled` {last.get('cancelled', 0):,} "
                 f"(gone while queued) and `client_disconnected` "
                 f"{last.get('client_disconnected', 0):,} (gone while a replica held the "
                 "request or mid-stream: the handler is cancelled) in "
                 "`skymesh_requests_total`; of the latter, a write found the client gone "
                 f"{sum(writes.values()):,} times (`skymesh_client_disconnects_total` by "
                 "phase: " + ", ".join(f"{k} {v:,}" for k, v in writes.items()) + ").")
    hold = doc.get("leave_hold_ms", 0)
    text += (f" The stub replicas held the rest of a `leave_mid_stream` stream {hold:g} ms "
             "after its first event, so those clients left while the balancer still relayed "
             "it." if hold else
             " The stub replicas answer a stream at once, so a `leave_mid_stream` client "
             "often has all of it in its socket before it leaves: a write finds it gone "
             "rarely.")
    return text


# Which scenarios end in which outcome of skymesh_requests_total.
_WHY = {"ok": "the replies, and clients that left after theirs was written",
        "BadRequest": "bad_json", "ModelNotFound": "unknown_model",
        "UpstreamFailed": "replica_error, after its retry",
        "cancelled": "clients that left while their request was queued",
        "client_disconnected": "clients that left while a replica held their request or "
                               "mid-stream",
        "NoHealthyReplica": "no scenario: the health probes found no replica up for a "
                            "while (a 503)"}


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


def flat_verdict(samples: list[dict[str, Any]], span: int = FLAT_SPAN) -> str:
    """Whether RSS is flat over the last ``span`` requests (:data:`FLAT_MB`)."""
    end = samples[-1]["requests"]
    window = [s for s in samples if s["requests"] >= end - span]
    if end < span or len(window) < 3:
        return (f"The run is shorter than {span:,} requests: no verdict on the last "
                f"{span:,}.")
    xs = [s["requests"] / EVERY for s in window]
    slope = statistics.linear_regression(xs, [s["rss_mb"] for s in window]).slope
    lo, hi = (min(s["rss_mb"] for s in window), max(s["rss_mb"] for s in window))
    flat = slope < FLAT_MB
    return (f"**Memory is {'flat' if flat else 'not flat'} over the last {span:,} "
            f"requests** ({window[0]['requests']:,} to {end:,}): RSS rose "
            f"{slope:+.2f} MB per 100,000 requests (least-squares slope of the "
            f"{len(window)} samples; \"flat\" means under {FLAT_MB:g} MB per 100,000), "
            f"between {lo:.1f} and {hi:.1f} MB.")


# What bounds each structure the probe finds growing, keyed as the probe names them
# (rss_soak_probe: module.Class.attribute, or module:global). A growing structure missing
# here shows as "no bound known to this page": a leak to look at.
BOUNDS: dict[str, str] = {
    "skymesh.prefix.trie._Segment.keys":
        "the prefix trie's keys: `max_nodes` (default 100,000, a policy parameter), "
        "then eviction of the oldest down to `max_nodes - max_nodes // 1024`",
    "skymesh.prefix.trie.PrefixTrie._index": "one per segment of the trie (at most its keys)",
    "skymesh.prefix.trie.PrefixTrie._segments": "one per segment of the trie",
    "skymesh.prefix.trie.PrefixTrie._leaf_at": "one per leaf segment of the trie",
    "skymesh.prefix.trie.PrefixTrie._heap":
        "eviction's heap: swept back to the leaves past 2 x leaves + 1,024",
    "skymesh.prefix.trie.PrefixTrie._matches": "256 recent lookups, then cleared",
    "skymesh.prefix.trie.PrefixTrie._mask_cache": "4,096, then cleared",
    "skymesh.prefix.trie.PrefixTrie._name_cache": "4,096, then cleared",
    "skymesh.prefix.keys:_chained": "4,096 chained sums, then cleared",
    "skymesh.prefix.keys:_prompts": "the last 32 prompts' keys",
    "skymesh.balancer.intake.Intake.body":
        "a request's body fields: one `Intake` per request in flight",
    "skymesh.balancer.server.Balancer.failfast":
        "queued requests that may fail fast: each leaves when it ends",
    "skymesh.balancer.forwarding.Forwarder.failfast": "the same map as the balancer's",
    "skymesh.net.lean.LeanProtocol._keys":
        "the plain routes' set, one shared by every lean connection, summed over the "
        "connections alive: those open, and (before session 26's fix) closed ones waiting "
        "for a full collection",
    "skymesh.net.lean_request.LeanRequest._state":
        "a request's own keys (a few), one dict per lean request alive: those in flight, "
        "and (before session 26's fix) a closed connection's last",
    "prometheus_client.metrics.Counter._metrics":
        "a counter's label sets: models and replicas the balancer serves (a departed "
        "replica's are dropped)",
}


def _worker_sizes(probe: dict[str, Any]) -> dict[str, int]:
    """Each structure's entries in the largest worker (the workers hold the same)."""
    out: dict[str, int] = {}
    for proc in probe["processes"]:
        if proc["role"] != "worker":
            continue
        for k, v in proc["containers"].items():
            out[k] = max(out.get(k, 0), v["len"])
    return out


def _file_kib(probe: dict[str, Any]) -> dict[str, float]:
    """tracemalloc's KiB by file of the product, in the largest worker."""
    out: dict[str, float] = {}
    for proc in probe["processes"]:
        if proc["role"] != "worker":
            continue
        for row in proc["tracemalloc"].get("filename", []):
            where = row["where"].rsplit(":", 1)[0]
            if "/skymesh/" in where:
                name = "skymesh/" + where.split("/skymesh/", 1)[1]
                out[name] = max(out.get(name, 0.0), row["kib"])
    return out


def structures_section(doc: dict[str, Any], min_len: int = 100) -> str:
    """What grows inside a worker and what bounds it (a ``--probe`` run of the soak)."""
    probes = doc["probes"]
    sizes = [_worker_sizes(p) for p in probes]
    first, last = sizes[0], sizes[-1]
    grew = sorted(k for k, n in last.items() if n >= min_len and n > first.get(k, 0))
    heads = " | ".join(f"{p['requests']:,}" for p in probes)
    rows = [f"| structure (entries, the larger over the workers) | {heads} | bounded by |",
            "| --- |" + " ---: |" * len(probes) + " --- |"]
    unknown = [k for k in grew if k not in BOUNDS]
    for k in grew:
        cells = " | ".join(f"{s.get(k, 0):,}" for s in sizes)
        rows.append(f"| `{k}` | {cells} | {BOUNDS.get(k, '**no bound known to this page**')} |")
    kib = [_file_kib(p) for p in probes]
    files = sorted(kib[-1], key=lambda f: -kib[-1][f])[:6]
    mem = [f"| file (the larger over the workers) | {heads} |", "| --- |" + " ---: |" * len(probes)]
    mem += [f"| `{f}` | " + " | ".join(f"{k.get(f, 0) / 1024:.1f}" for k in kib) + " |"
            for f in files]
    mem.append("| all of `skymesh/` among the 20 largest files of all | "
               + " | ".join(f"{sum(k.values()) / 1024:.1f}" for k in kib) + " |")
    verdict = (f"**{len(unknown)} growing structure(s) with no known bound**: "
               + ", ".join(f"`{k}`" for k in unknown) if unknown else
               "Every structure that grew has a bound (the last column).")
    tracing = ("MiB still allocated by each of the product's files (tracemalloc, one "
               "frame: the line that allocated; the largest six at the end):"
               if any(kib) else "")
    return "\n\n".join([
        "## What grows inside a worker",
        f"A separate run of {doc['requests']:,} requests of the same mix with `--probe` "
        f"(skymesh_lab.bench.rss_soak_probe), {server_note(doc)}: after the requests in "
        "each column every balancer process walked what it can reach and counted the "
        "entries of each container its objects and modules hold. The structures that grew to "
        f"{min_len:,} entries or more (a structure held by many objects, such as the "
        "trie's segments' key lists, summed over them):",
        "\n".join(rows), verdict, *([tracing, "\n".join(mem)] if tracing else []),
        "The probe's walk and tracemalloc cost memory and time, so that run's RSS is not "
        "the balancer's: the figures above this section come from a run without them. "
        "That run: `.venv/bin/python -m skymesh_lab.bench.rss_soak --requests "
        f"{doc['requests_asked']} --probe DIR --probe-at "
        f"{','.join(str(n) for n in doc.get('probe_at', []))} --probe-tracemalloc "
        f"{doc.get('probe_tracemalloc', 0)} --json {DATA}/{STRUCTURES}.json`.",
    ])


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"


def leave_hold_section(doc: dict[str, Any]) -> str:
    """A shorter run whose stubs hold a ``leave_mid_stream`` stream after its first
    event: clients that leave while the balancer relays, what its log says of them."""
    samples = doc["samples"]
    first, last = samples[0], samples[-1]
    seconds = last.get("t_s", 0)
    rate = f"{doc['requests'] / seconds:,.0f} requests a second, " if seconds else ""
    return "\n\n".join([
        "## Clients that leave mid-stream",
        f"A separate run of {doc['requests']:,} requests of the same mix, "
        f"{server_note(doc)}, {doc.get('processes', 1)} processes, whose stub replicas "
        f"held the rest of each `leave_mid_stream` stream {doc['leave_hold_ms']:g} ms after "
        "its first event (in the run above they answer at once, and a client that reads "
        "the first event often has the whole stream already). RSS "
        f"{first['rss_mb']:.1f} MB at the start, {last['rss_mb']:.1f} at the end; "
        f"{rate}{_duration(seconds)} (load average "
        f"{doc.get('loadavg_now', [0.0])[0]:.1f} at the end); the balancer used "
        f"{doc['cpu_ms_per_1000']:.0f} ms of CPU per 1,000 requests.",
        leaving_note(doc),
        *([outcomes_note(doc["lb_outcomes"])] if "lb_outcomes" in doc else []),
        "That run: `.venv/bin/python -m skymesh_lab.bench.rss_soak --requests "
        f"{doc['requests_asked']} --leave-hold-ms {doc['leave_hold_ms']:g} --json "
        f"{DATA}/{LEAVE_HOLD}.json`.",
    ])


def server_note(doc: dict[str, Any]) -> str:
    """Which HTTP server the balancer ran (``listen.http_server``), as the run recorded."""
    server = doc.get("http_server")
    if server is None:  # the runs before session 26 did not record it
        return ("its HTTP server not recorded in the run (the runs that recorded none were "
                "made before session 25, on aiohttp's server, the default then)")
    return f"HTTP server `{server}` (`listen.http_server`)"


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
    server = server_note(doc)
    return "\n\n".join([
        "\n".join(summary),
        f"From the warm-up to the end RSS moved by **{growth:+.1f} MB** over {span:,} "
        f"requests ({slope}); the balancer used **{doc['cpu_ms_per_1000']:.0f} ms of CPU "
        f"per 1,000 requests** (all its processes, user + system).{stopped}",
        flat_verdict(samples),
        _table(samples),
        *([outcomes_note(doc["lb_outcomes"])] if "lb_outcomes" in doc else []),
        *([leaving_note(doc)] if "log_errors" in doc else []),
        f"Setup: `skymesh-lb` with policy `{policy}` and workers `{workers}` (\"default\": "
        f"the balancer's own, prefix-tree with sp-p and `listen.workers: auto`), {server}, "
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
        *([leave_hold_section(doc[LEAVE_HOLD])] if LEAVE_HOLD in doc else []),
        *([structures_section(doc[STRUCTURES])] if STRUCTURES in doc else []),
    ])
