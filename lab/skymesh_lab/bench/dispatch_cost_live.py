"""Live CPU per request of skymesh-lb's default (prefix-tree + sp-p) against round-robin + bp.

What is measured
    One skymesh-lb (``--workers 1``) in front of the router-overhead benchmark's two C stub
    backends, driven by wrk with its prefix bodies (16 shared 2 KB system prompts and a
    question of each request's own) on 64 connections, once with no policy flags (the
    default) and once with ``--policy round-robin --push-mode bp``. The balancer's CPU
    (utime + stime from /proc) around each wrk run, per completed request. A fresh
    balancer serves each segment: the trie's state is path-dependent (whether the shared
    prompts end up on one replica or on both decides how often prefix-tree's answer is a
    tie, asked again on every pump), and one long-lived process per configuration
    carries its luck through every round.

Each segment starts with ``--warmup`` seconds of the same load (1 by default), not
counted: the time the balancer takes to learn each stub's admission limit (the stubs
publish none; ``skymesh.balancer.seqcap``) before the measured run. After the measured
run the balancer's ``/status`` gives the limit sp-p then applied per stub
(``max_num_seqs``), kept per segment.

``--base REV`` also runs the ``skymesh`` package of git revision ``REV`` (or a directory
holding a checkout), put first on the balancer's PYTHONPATH, in the same rounds; segments
are shuffled in every round. Prints the medians, each round's default/rr ratio, and their
median; ``--json PATH`` writes them too (the dispatch-cost results page shows them,
``dispatch_cost_page``). Not in ``make test``; needs gcc and wrk.

    python -m skymesh_lab.bench.dispatch_cost_live [--base b6a33fb] [--rounds 4]
        [--duration 4] [--warmup 1] [--json docs/results/data/dispatch-cost-live.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skymesh.util.procs import start_daemon
from skymesh_lab.bench import router_overhead as ro
from skymesh_lab.bench import router_overhead_stats as st

CONFIGS: dict[str, list[str]] = {
    "default": [],
    "rr": ["--policy", "round-robin", "--push-mode", "bp"],
}


def _checkout(base: str, tmp: str) -> str:
    """``base`` if it is a directory, else the tree of git revision ``base`` in ``tmp``."""
    if os.path.isdir(base):
        return base
    tree = subprocess.run(["git", "archive", base, "skymesh"], capture_output=True,
                          check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=tree, check=True)
    return tmp


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _limits(d: Any) -> list[int | None]:
    """The admission limit sp-p applies to each replica (``/status``'s ``max_num_seqs``)."""
    status, text = ro.http_request(d.url, "GET", "/status", b"")
    if status != 200:
        return []
    return [r.get("max_num_seqs") for r in json.loads(text)["replicas"].values()]


def segment(urls: str, flags: list[str], pythonpath: str | None, duration_s: float,
            warmup_s: float = 1.0) -> tuple[float, list[int | None]]:
    """CPU microseconds per request of a fresh balancer over one wrk run after a warm-up
    of ``warmup_s``, and the limits sp-p applied to the replicas at its end."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    d = start_daemon("skymesh-lb", ["--port", "0", "--replicas", urls, "--workers", "1",
                                    *flags], timeout=ro.READY_TIMEOUT_S, env=env)
    try:
        ro.wait_ready(d)
        ro.run_wrk(d.url, ro.Case("warmup", "", 64, False, "prefix"), warmup_s)
        c0 = _cpu_s(d.proc.pid)
        out = ro.run_wrk(d.url, ro.Case("x", "", 64, False, "prefix"), duration_s)
        c1 = _cpu_s(d.proc.pid)
        limits = _limits(d)
    finally:
        d.stop()
    return (c1 - c0) / st.parse_wrk(out)["requests"] * 1e6, limits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--base", default=None, help="git revision or checkout to compare")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per segment")
    ap.add_argument("--warmup", type=float, default=1.0,
                    help="seconds of load before each segment's measured run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dispatch-cost-live-") as tmp:
        trees: dict[str, str | None] = {"current": None}
        if args.base:
            trees["base"] = _checkout(args.base, tmp)
        binary = ro.build_stub(Path(tmp))
        stubs = [ro.start_stub(binary, ro.STREAM_EVENTS, Path(tmp), i) for i in range(2)]
        try:
            urls = ",".join(s.url for s in stubs)
            res: dict[tuple[str, str], list[float]] = {
                (v, c): [] for v in trees for c in CONFIGS}
            limits: dict[tuple[str, str], list[list[int | None]]] = {k: [] for k in res}
            rng = random.Random(args.seed)
            for r in range(args.rounds):
                order = list(res)
                rng.shuffle(order)
                for v, c in order:
                    us, lim = segment(urls, CONFIGS[c], trees[v], args.duration,
                                      args.warmup)
                    res[(v, c)].append(us)
                    limits[(v, c)].append(lim)
                    print(f"round {r} {v} {c}: {us:.0f} us/request, limits {lim}",
                          flush=True)
        finally:
            for s in stubs:
                s.stop()
    for (v, c), xs in res.items():
        print(f"{v} {c}: median {statistics.median(xs):.0f} us/request "
              f"[{min(xs):.0f}, {max(xs):.0f}]")
    for v in trees:
        ratios = [a / b for a, b in zip(res[(v, "default")], res[(v, "rr")], strict=True)]
        print(f"{v} default/rr per round {[round(x, 2) for x in ratios]}, "
              f"median {statistics.median(ratios):.2f}")
    if args.json is not None:
        doc = summary(res, list(trees), args, load, limits)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def summary(res: dict[tuple[str, str], list[float]], versions: list[str],
            args: argparse.Namespace, load_at_start: float,
            limits: dict[tuple[str, str], list[list[int | None]]] | None = None
            ) -> dict[str, Any]:
    """What ``--json`` writes: per version, each configuration's CPU us per request in
    every round, its median and spread, the limits sp-p applied to the replicas at each
    segment's end, and the default/rr ratio of every round."""
    out: dict[str, Any] = {}
    for v in versions:
        ratios = [a / b for a, b in zip(res[(v, "default")], res[(v, "rr")], strict=True)]
        out[v] = {
            "configs": {c: {"rounds": [round(x, 1) for x in res[(v, c)]],
                            "median": round(statistics.median(res[(v, c)]), 1),
                            "min": round(min(res[(v, c)]), 1),
                            "max": round(max(res[(v, c)]), 1),
                            "limits": (limits or {}).get((v, c), [])} for c in CONFIGS},
            "ratio_rounds": [round(x, 2) for x in ratios],
            "ratio_median": round(statistics.median(ratios), 2),
        }
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                            text=True, check=False).stdout.strip()
    command = "python -m skymesh_lab.bench.dispatch_cost_live" + (
        f" --base {args.base}" if args.base else "") + (
        f" --rounds {args.rounds} --duration {args.duration:g}") + (
        f" --warmup {args.warmup:g}" if args.warmup != 1.0 else "")
    if args.json is not None:
        command += f" --json {args.json}"
    return {"setup": {"rounds": args.rounds, "duration_s": args.duration,
                      "warmup_s": args.warmup,
                      "seed": args.seed, "connections": 64, "workers": 1,
                      "configs": {c: " ".join(f) or "(no flags)" for c, f in CONFIGS.items()},
                      "base": args.base, "commit": commit or None,
                      "load_average_1m_at_start": round(load_at_start, 2),
                      "cpus": os.cpu_count(),
                      "date": datetime.now(UTC).strftime("%Y-%m-%d")},
            "command": command, "versions": out}


if __name__ == "__main__":
    raise SystemExit(main())
