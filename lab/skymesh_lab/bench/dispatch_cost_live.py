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

    ``default-told``: the default where sp-p's limit does not bind, so the cost is the
    default path's own and not a standing queue's. The stubs publish neither
    ``max_num_seqs`` nor a KV capacity, and without a KV capacity sp-p gives a replica
    one request until its first byte whatever its cap: a told ``max_num_seqs`` of 256
    alone leaves the queue standing. So each replica is told a cap of 256 and a queue of
    256 for the prompt's prefix (``pushing.prefer_queue``: the replica holding a
    request's prefix takes it while fewer are pending there), in a ``--config`` file.

Each segment starts with ``--warmup`` seconds of the same load (1 by default), not
counted: the time the balancer takes to learn each stub's admission limit (the stubs
publish none; ``skymesh.balancer.seqcap``) before the measured run. After the measured
run the balancer's ``/status`` gives the limit sp-p then applied per stub
(``max_num_seqs``), kept per segment.

``--workers N`` (default 1) serves each segment from N worker processes behind one port
(``listen.workers``); the CPU is then the supervisor's and every worker's, and the worker
count is in the JSON (``setup.workers``) and on the page that shows it (1 worker: the
dispatch-cost page; 2: the lb-workers page, ``dispatch-cost-live-workers2.json``).

The plain arms run skymesh-lb's default HTTP server, the lean one (``listen.http_server:
lean``, skymesh.net.lean, the default since session 25). ``--lean`` adds two arms on
aiohttp's server (``listen.http_server: aiohttp`` in a ``--config`` file):
``default-aiohttp`` and ``rr-aiohttp``, each paired in every round with its arm on the
lean server (``lean_ratios``: lean over aiohttp per round). With ``--base`` on a
revision from before session 25, whose default was aiohttp's server, the base's plain
arms are aiohttp too: its ``lean_ratios`` are then near 1 and say nothing.

``--base REV`` also runs the ``skymesh`` package of git revision ``REV`` (or a directory
holding a checkout), put first on the balancer's PYTHONPATH, in the same rounds; segments
are shuffled in every round. Prints the medians, each round's default/rr ratio, and their
median; ``--json PATH`` writes them too (the dispatch-cost results page shows them,
``dispatch_cost_page``). Not in ``make test``; needs gcc and wrk.

    python -m skymesh_lab.bench.dispatch_cost_live [--base b6a33fb] [--rounds 4]
        [--duration 4] [--warmup 1] [--workers 1] [--lean]
        [--json docs/results/data/dispatch-cost-live.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skymesh.net.serving import DEFAULT_HTTP_SERVER
from skymesh.util.procs import start_daemon
from skymesh_lab.bench import lb_workers
from skymesh_lab.bench import router_overhead as ro
from skymesh_lab.bench import router_overhead_stats as st

TOLD_YAML = "pushing:\n  max_num_seqs: 256\n  prefer_queue: 256\n"
TOLD_FILE = "{tmp}/told.yaml"
CONFIGS: dict[str, list[str]] = {
    "default": [],
    "rr": ["--policy", "round-robin", "--push-mode", "bp"],
    "default-told": ["--config", TOLD_FILE],
}
# The configurations measured against rr, each with its per-round ratio.
RATIOS = ("default", "default-told")
AIOHTTP_YAML = "listen:\n  http_server: aiohttp\n"
AIOHTTP_FILE = "{tmp}/aiohttp.yaml"
# --lean: each arm on aiohttp's server, and the arm on the (default) lean server it is
# paired with: the ratio is the lean arm over its aiohttp arm.
AIOHTTP_CONFIGS: dict[str, tuple[str, list[str]]] = {
    "default-aiohttp": ("default", ["--config", AIOHTTP_FILE]),
    "rr-aiohttp": ("rr", ["--config", AIOHTTP_FILE, "--policy", "round-robin",
                          "--push-mode", "bp"]),
}


def configs_of(lean: bool) -> dict[str, list[str]]:
    """The configurations a run measures: ``CONFIGS``, and the aiohttp arms with ``lean``."""
    return {**CONFIGS, **({c: f for c, (_, f) in AIOHTTP_CONFIGS.items()} if lean else {})}


def _checkout(base: str, tmp: str) -> str:
    """``base`` if it is a directory, else the tree of git revision ``base`` in ``tmp``."""
    if os.path.isdir(base):
        return base
    tree = subprocess.run(["git", "archive", base, "skymesh"], capture_output=True,
                          check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=tree, check=True)
    return tmp


_DEFAULT_SERVER = re.compile(r'^DEFAULT_HTTP_SERVER = "(\w+)"', re.M)


def default_http_server(tree: str | None) -> str:
    """The HTTP server a version's balancer runs by default: this checkout's (``tree``
    None), or the one ``tree/skymesh/net/serving.py`` names; aiohttp's for a revision
    from before the choice existed (session 25)."""
    if tree is None:
        return DEFAULT_HTTP_SERVER
    try:
        text = (Path(tree) / "skymesh" / "net" / "serving.py").read_text()
    except OSError:
        return "aiohttp"
    m = _DEFAULT_SERVER.search(text)
    return m.group(1) if m else "aiohttp"


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def workers_arm(workers: int) -> tuple[list[str], Callable[[int], float]]:
    """The balancer's flags for ``workers`` processes, and how to read their CPU: with
    more than one, the supervisor's pid and its children's (each worker's)."""
    return ["--workers", str(workers)], (_cpu_s if workers == 1 else lb_workers._cpu_s)


def _limits(d: Any) -> list[int | None]:
    """The admission limit sp-p applies to each replica (``/status``'s ``max_num_seqs``)."""
    status, text = ro.http_request(d.url, "GET", "/status", b"")
    if status != 200:
        return []
    return [r.get("max_num_seqs") for r in json.loads(text)["replicas"].values()]


def segment(urls: str, flags: list[str], pythonpath: str | None, duration_s: float,
            workers: int = 1, warmup_s: float = 1.0) -> tuple[float, list[int | None]]:
    """CPU microseconds per request of a fresh balancer over one wrk run after a warm-up
    of ``warmup_s``, and the limits sp-p applied to the replicas at its end."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
        # Workers start as ``python -m``, which would put the working directory (this
        # checkout) ahead of PYTHONPATH: the base's workers would run the current code.
        env["PYTHONSAFEPATH"] = "1"
    wflags, cpu_s = workers_arm(workers)
    d = start_daemon("skymesh-lb", ["--port", "0", "--replicas", urls, *wflags,
                                    *flags], timeout=ro.READY_TIMEOUT_S, env=env)
    try:
        ro.wait_ready(d)
        ro.run_wrk(d.url, ro.Case("warmup", "", 64, False, "prefix"), warmup_s)
        c0 = cpu_s(d.proc.pid)
        out = ro.run_wrk(d.url, ro.Case("x", "", 64, False, "prefix"), duration_s)
        c1 = cpu_s(d.proc.pid)
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
    ap.add_argument("--workers", type=int, default=1, help="skymesh-lb worker processes")
    ap.add_argument("--lean", action="store_true",
                    help="also the arms on aiohttp's server (listen.http_server: aiohttp), "
                         "each paired with its arm on the default lean server")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    configs = configs_of(args.lean)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dispatch-cost-live-") as tmp:
        Path(TOLD_FILE.format(tmp=tmp)).write_text(TOLD_YAML)
        Path(AIOHTTP_FILE.format(tmp=tmp)).write_text(AIOHTTP_YAML)
        trees: dict[str, str | None] = {"current": None}
        if args.base:
            trees["base"] = _checkout(args.base, tmp)
        # the plain arms' server, per version (the --lean arms name theirs)
        servers = {v: default_http_server(t) for v, t in trees.items()}
        binary = ro.build_stub(Path(tmp))
        stubs = [ro.start_stub(binary, ro.STREAM_EVENTS, Path(tmp), i) for i in range(2)]
        try:
            urls = ",".join(s.url for s in stubs)
            res: dict[tuple[str, str], list[float]] = {
                (v, c): [] for v in trees for c in configs}
            limits: dict[tuple[str, str], list[list[int | None]]] = {k: [] for k in res}
            rng = random.Random(args.seed)
            for r in range(args.rounds):
                order = list(res)
                rng.shuffle(order)
                for v, c in order:
                    flags = [f.format(tmp=tmp) for f in configs[c]]
                    us, lim = segment(urls, flags, trees[v], args.duration, args.workers,
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
        for c in RATIOS:
            ratios = [a / b for a, b in zip(res[(v, c)], res[(v, "rr")], strict=True)]
            print(f"{v} {c}/rr per round {[round(x, 2) for x in ratios]}, "
                  f"median {statistics.median(ratios):.2f}")
        for c, (paired, _) in AIOHTTP_CONFIGS.items() if args.lean else ():
            ratios = [a / b for a, b in zip(res[(v, paired)], res[(v, c)], strict=True)]
            print(f"{v} {paired} (lean)/{c} per round {[round(x, 2) for x in ratios]}, "
                  f"median {statistics.median(ratios):.2f}")
    if args.json is not None:
        doc = summary(res, list(trees), args, load, limits)
        doc["setup"]["http_server"] = servers
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def summary(res: dict[tuple[str, str], list[float]], versions: list[str],
            args: argparse.Namespace, load_at_start: float,
            limits: dict[tuple[str, str], list[list[int | None]]] | None = None
            ) -> dict[str, Any]:
    """What ``--json`` writes: per version, each configuration's CPU us per request in
    every round, its median and spread, the limits sp-p applied to the replicas at each
    segment's end, and the ratio to rr of every round (``ratio_rounds``,
    ``ratio_median``: the default's; ``ratios``: each of ``RATIOS``)."""
    out: dict[str, Any] = {}
    lean = bool(getattr(args, "lean", False))
    configs = configs_of(lean)
    for v in versions:
        ratios = {c: [a / b for a, b in zip(res[(v, c)], res[(v, "rr")], strict=True)]
                  for c in RATIOS}
        out[v] = {
            "configs": {c: {"rounds": [round(x, 1) for x in res[(v, c)]],
                            "median": round(statistics.median(res[(v, c)]), 1),
                            "min": round(min(res[(v, c)]), 1),
                            "max": round(max(res[(v, c)]), 1),
                            "limits": (limits or {}).get((v, c), [])} for c in configs},
            "ratio_rounds": [round(x, 2) for x in ratios["default"]],
            "ratio_median": round(statistics.median(ratios["default"]), 2),
            "ratios": {c: {"rounds": [round(x, 2) for x in r],
                           "median": round(statistics.median(r), 2)}
                       for c, r in ratios.items()},
        }
        if lean:  # each lean arm over its aiohttp arm, per round
            out[v]["lean_ratios"] = {}
            for c, (paired, _) in AIOHTTP_CONFIGS.items():
                r = [a / b for a, b in zip(res[(v, paired)], res[(v, c)], strict=True)]
                out[v]["lean_ratios"][paired] = {"over": c,
                                                 "rounds": [round(x, 2) for x in r],
                                                 "median": round(statistics.median(r), 2)}
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                            text=True, check=False).stdout.strip()
    command = "python -m skymesh_lab.bench.dispatch_cost_live" + (
        f" --base {args.base}" if args.base else "") + (
        f" --rounds {args.rounds} --duration {args.duration:g}") + (
        f" --warmup {args.warmup:g}" if args.warmup != 1.0 else "") + (
        f" --workers {args.workers}" if args.workers != 1 else "") + (
        " --lean" if lean else "")
    if args.json is not None:
        command += f" --json {args.json}"
    return {"setup": {"rounds": args.rounds, "duration_s": args.duration,
                      "warmup_s": args.warmup,
                      "seed": args.seed, "connections": 64, "workers": args.workers,
                      "configs": {c: " ".join(f) or "(no flags)" for c, f in configs.items()},
                      "told_yaml": TOLD_YAML,
                      **({"aiohttp_yaml": AIOHTTP_YAML} if lean else {}),
                      "base": args.base, "commit": commit or None,
                      "load_average_1m_at_start": round(load_at_start, 2),
                      "cpus": os.cpu_count(),
                      "date": datetime.now(UTC).strftime("%Y-%m-%d")},
            "command": command, "versions": out}


if __name__ == "__main__":
    raise SystemExit(main())
