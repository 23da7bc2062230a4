"""The request path's CPU per request, now against a base revision (issue #35).

What is measured
    Process CPU per request of ``skymesh-lb --workers 1 --no-access-log`` in front of two
    C stub replicas (``stub/stub.c``, an answer in microseconds), driven by wrk
    (``-c64``, non-streaming, ``stub/post.lua``), for the working tree ("current") and
    for git revision ``--base`` ("base", extracted with ``git archive``). Configurations
    (``--configs``): ``rr`` (``--policy round-robin --push-mode bp``: the request path
    with the least routing work), ``stream`` (the same, streamed replies of 64 events)
    and ``default`` (the default policy and push mode, shared-prefix bodies). CPU is read
    from /proc/PID/task/*/stat around each wrk run (every thread of the balancer; the
    stubs and wrk are not counted).

How
    Both builds run side by side for the whole run and take short turns (current, base,
    base, current: four turns of ``--duration``/4 seconds each per round, summed), so both
    see the same stretch of a machine whose other tenants come and go (see
    ``access_log_cost.pair``: two balancers racing each other for CPU settle unevenly, so
    they never run at the same time). The figure is current over base within each round;
    the page shows the median over ``--rounds`` rounds with its spread.

    python -m skymesh_lab.bench.request_path_cost --rounds 8 --duration 4 --base 73b4d9b \\
        --json docs/results/data/request-path-cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skymesh.util.jsonio import write_json
from skymesh.util.procs import Daemon, executable, start_daemon
from skymesh_lab.bench import access_log_cost as alc
from skymesh_lab.bench import router_overhead as ro
from skymesh_lab.bench import router_overhead_stats as st

CONNECTIONS = 64
RR_FLAGS = ["--policy", "round-robin", "--push-mode", "bp"]
CONFIGS: dict[str, tuple[list[str], str, bool]] = {  # flags, post.lua's body mode, stream
    "rr": (RR_FLAGS, "fixed", False),
    "stream": (RR_FLAGS, "fixed", True),
    "default": ([], "prefix", False),
}
COMMON_FLAGS = ["--workers", "1", "--no-access-log"]
BUILDS = ("current", "base")
SLICES = 4  # turns per build per round
_TICK = os.sysconf("SC_CLK_TCK")


def start_lb(stubs: list[str], config: str, pythonpath: Path | None) -> Daemon:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    args = ["--port", "0", "--replicas", ",".join(stubs), *CONFIGS[config][0], *COMMON_FLAGS]
    return start_daemon("skymesh-lb", args, timeout=ro.READY_TIMEOUT_S, env=env)


@contextlib.contextmanager
def _stack(base: str, configs: list[str], workdir: Path) -> Iterator[dict[str, Daemon]]:
    with contextlib.ExitStack() as exits:
        binary = ro.build_stub(workdir)
        stubs = [exits.enter_context(_stopping(ro.start_stub(binary, ro.STREAM_EVENTS,
                                                             workdir, i))).url
                 for i in range(2)]
        (workdir / "base").mkdir()
        paths: dict[str, Path | None] = {"current": None,
                                         "base": alc.extract(base, workdir / "base")}
        lbs = {f"{config}/{build}": exits.enter_context(_stopping(start_lb(stubs, config,
                                                                           path)))
               for config in configs for build, path in paths.items()}
        for d in lbs.values():
            ro.wait_ready(d)
        yield lbs


@contextlib.contextmanager
def _stopping(d: Daemon) -> Iterator[Daemon]:
    try:
        yield d
    finally:
        d.stop()


def case(config: str) -> ro.Case:
    _, body, stream = CONFIGS[config]
    return ro.Case(f"{config}-c{CONNECTIONS}", config, CONNECTIONS, stream, body)


def segment(d: Daemon, config: str, duration_s: float) -> dict[str, Any]:
    """One wrk run at ``d`` with the balancer's CPU ticks (all threads) around it."""
    before = alc.process_ticks(d.proc.pid)
    out = ro.run_wrk(d.url, case(config), duration_s)
    after = alc.process_ticks(d.proc.pid)
    wrk = st.parse_wrk(out)
    return {"requests": wrk["requests"], "wall_s": wrk["requests"] / max(wrk["rps"], 1e-9),
            "errors": wrk["errors"] + wrk["non_2xx"], "ticks": after - before}


def turns(lbs: dict[str, Daemon], config: str, duration_s: float,
          slices: int = SLICES) -> dict[str, dict[str, float]]:
    """Each build of ``config`` in alternating turns (current, base, base, current, ...),
    summed per build: CPU us per request, req/s, errors."""
    sums = {b: {"requests": 0.0, "wall_s": 0.0, "errors": 0.0, "ticks": 0.0} for b in BUILDS}
    for i in range(slices):
        for build in BUILDS if i % 2 == 0 else BUILDS[::-1]:
            seg = segment(lbs[f"{config}/{build}"], config, duration_s / slices)
            for k, v in seg.items():
                sums[build][k] += v
    out = {}
    for build, acc in sums.items():
        n = max(acc["requests"], 1.0)
        out[build] = {"requests": acc["requests"], "errors": acc["errors"],
                      "rps": acc["requests"] / acc["wall_s"] if acc["wall_s"] else 0.0,
                      "cpu_us": acc["ticks"] / _TICK / n * 1e6}
    return out


def _spread(values: list[float], digits: int = 4) -> dict[str, float]:
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits)}


def summarize(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: CPU us per request of each build and current/base, paired by
    round (medians with [min, max])."""
    out: dict[str, Any] = {}
    for config in sorted({s["config"] for s in segments}):
        by = {(s["build"], s["round"]): s for s in segments if s["config"] == config}
        rounds = sorted({r for _, r in by})
        cur = [by[("current", r)]["cpu_us"] for r in rounds]
        base = [by[("base", r)]["cpu_us"] for r in rounds]
        out[config] = {
            "current_us": _spread(cur), "base_us": _spread(base),
            "ratio": _spread([c / b for c, b in zip(cur, base, strict=True)]),
            "current_rps": _spread([by[("current", r)]["rps"] for r in rounds], 1),
            "base_rps": _spread([by[("base", r)]["rps"] for r in rounds], 1),
            "errors": sum(s["errors"] for s in by.values()),
        }
    return out


def run(rounds: int, duration_s: float, base: str, configs: list[str],
        seed: int) -> dict[str, Any]:
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    rng = random.Random(seed)
    segments: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="request-path-cost-") as tmp, \
            _stack(base, configs, Path(tmp)) as lbs:
        for name, d in lbs.items():  # warm-up: connections, caches, lazy imports
            ro.run_wrk(d.url, case(name.split("/")[0]), 1.0)
        order = list(configs)
        for rnd in range(rounds):
            rng.shuffle(order)
            for config in order:
                for build, row in turns(lbs, config, duration_s).items():
                    segments.append({"config": config, "build": build, "round": rnd, **row})
                    print(f"r{rnd} {config:<8} {build:<8} {row['rps']:>8.0f} req/s "
                          f"{row['cpu_us']:6.1f} us/req", flush=True)
                time.sleep(ro.SETTLE_S)
    cmd = (f"python -m skymesh_lab.bench.request_path_cost --rounds {rounds} "
           f"--duration {duration_s:g} --base {base} --configs {','.join(configs)}")
    return {"setup": {"command": cmd, "common_flags": COMMON_FLAGS,
                      "config_flags": {c: CONFIGS[c][0] for c in configs},
                      "bodies": {c: CONFIGS[c][1] for c in configs},
                      "streamed": {c: CONFIGS[c][2] for c in configs},
                      "stream_events": ro.STREAM_EVENTS,
                      "connections": CONNECTIONS, "rounds": rounds, "duration_s": duration_s,
                      "base": base, "current": alc._head(), "cores": os.cpu_count(),
                      "loadavg_before": list(load_before),
                      "loadavg_after": list(os.getloadavg()), "started": started,
                      "finished": datetime.now(UTC).isoformat(timespec="seconds")},
            "summary": summarize(segments), "segments": segments}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.request_path_cost",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, metavar="REV", help="the revision to compare")
    ap.add_argument("--configs", default="rr", help="comma-separated: rr, stream, default")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        ap.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    executable("skymesh-lb")  # fails early without it
    res = run(args.rounds, args.duration, args.base, configs, args.seed)
    write_json(args.json, res)
    print("\n".join(verdict(config, row) for config, row in res["summary"].items()))
    return 0


def verdict(config: str, row: dict[str, Any]) -> str:
    r = row["ratio"]
    return (f"{config}: base {row['base_us']['median']:.1f} us, current "
            f"{row['current_us']['median']:.1f} us per request; current/base "
            f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]")


if __name__ == "__main__":
    sys.exit(main())
