"""What the access log costs a request through skymesh-lb (issue #35 item 3).

What is measured
    Process CPU per request of ``skymesh-lb --workers 1 --policy round-robin --push-mode
    bp`` (``--config default``: ``skymesh-lb --workers 1``, its own policy and push mode,
    and shared-prefix bodies) in front of two C stub replicas (``stub/stub.c``, an answer
    in microseconds), driven by wrk (``-c32``, non-streaming, ``stub/post.lua``), with the
    access log on
    (the default: its lines go to the daemon's stderr, a file here) and off
    (``--no-access-log``). CPU is read from /proc/PID/task/*/stat around each segment,
    per thread (``schedstat``'s nanoseconds; ``stat`` for the loop's kernel share), so
    the loop's share and the writer thread's share show apart; the
    stubs and wrk are not counted.

How
    Both set-ups run side by side for the whole run and take short turns (on, off, off,
    on: four turns of ``--duration``/4 seconds each per round, summed), so both see the
    same stretch of the machine: on a machine shared with other work, runs a few seconds
    apart differ by tens of percent in CPU per request (the balancer wakes up for fewer
    requests at a time when it gets less CPU). The cost of the access log is the paired
    difference (on minus off, same round) over the CPU per request with it on; the
    figure is the median over ``--rounds`` rounds, with its spread.

``--fresh-every K``: new balancer processes every ``K`` rounds. A process has an offset
of its own in CPU per request (where its memory lies, its hash seed: the same build in
two processes differed by several microseconds per request, round after round), which
one set of processes for the whole run adds to every round's difference; fresh ones make
it vary from round to round, inside the interval, instead.

``--toggle``: each build's "on" and "off" in one balancer process, the log switched
between turns (``skymesh_lab.bench.access_log_toggle``): the process's own offset is then
common to both turns and cancels from their difference rather than widening its spread.
The process is still new every ``--fresh-every`` rounds, so the figure is over many.

``--ablate record,lines,loop``: also run this checkout with parts of the access log
switched off (``skymesh_lab.bench.access_log_ablate``), each on and off in the same
rounds: where the live cost goes.

``--base REV``: also run skymesh-lb of git revision ``REV`` (extracted with ``git
archive``), on and off, in the same rounds: the before and after of a change.

``--http-server lean``: every daemon serves with ``listen.http_server: lean`` (a config
file the run writes), as against the daemon's default; ``aiohttp`` the same for aiohttp's.

``--sink pipe``: the daemons' stderr (where the access log goes) is a pipe, as in a
container whose runtime collects the logs, rather than a file: the balancer's loop then
writes its batches itself (``skymesh.obs.logsink``), not the writer thread. The bench
drains each pipe with a child of its own (its first 64 KB kept in a file for the
daemon's "listening on" line, the rest read by ``cat`` into /dev/null); that child is
not in the balancer's process tree, so its CPU is not counted.

Each build is also measured in process (``skymesh_lab.bench.access_log_loop``: the same
request through the access log without the network, the loop thread's CPU): a steadier
figure for the loop's part, next to the live one's spread.

    python -m skymesh_lab.bench.access_log_cost --rounds 5 --duration 5 --base b6a33fb \\
        --json docs/results/data/access-log-cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skymesh.util.jsonio import write_json
from skymesh.util.procs import Daemon, executable, start_daemon, wait_listening
from skymesh_lab.bench import access_log_ablate as ablation
from skymesh_lab.bench import access_log_toggle as toggle
from skymesh_lab.bench import router_overhead as ro
from skymesh_lab.bench import router_overhead_stats as st


@dataclass(frozen=True)
class Lane:
    """A configuration the log is measured on (``--config``): the daemons' flags and
    the requests wrk sends."""

    flags: tuple[str, ...]
    case: ro.Case


# rr: round-robin with bp, the cheapest request (fixed bodies); default: the daemon's own
# policy and push mode with router_overhead's default-c64 bodies (shared prefixes), the
# path users run. One worker and 32 connections in both.
LANES = {config: Lane((*ro.CONFIG_FLAGS[ro.SKYMESH][config], "--workers", "1"),
                      ro.Case(f"access-{config}-c32", config, 32, False, body))
         for config, body in (("rr", "fixed"), ("default", "prefix"))}
LB_FLAGS = list(LANES["rr"].flags)
CASE = LANES["rr"].case
SLICES = 4  # turns of on and off per round
_TICK = os.sysconf("SC_CLK_TCK")
LOOP, WRITER, THREADS = "loop", "writer", "threads"
LOOP_SYS = "loop_sys"  # the loop's kernel time (system calls), part of LOOP
CONFIDENCE = 0.95
WRITER_COMM = "skymesh-access"  # skymesh.obs.access.AccessWriter's OS thread name
REPO = Path(__file__).resolve().parents[3]
IN_PROCESS_REQUESTS, IN_PROCESS_REPEATS = 20000, 7
SINKS = ("file", "pipe")  # where the daemons' stderr goes (--sink)
# A pipe's drain (--sink pipe): its first bytes to the file named by its argument,
# unbuffered (the daemon's "listening on" line is read there), then cat into /dev/null.
_DRAIN = ("import os, sys\n"
          "keep = 65536\n"
          "with open(sys.argv[1], 'wb', buffering=0) as log:\n"
          "    while keep > 0:\n"
          "        data = os.read(0, 65536)\n"
          "        if not data:\n"
          "            sys.exit(0)\n"
          "        log.write(data)\n"
          "        keep -= len(data)\n"
          "null = os.open(os.devnull, os.O_WRONLY)\n"
          "os.dup2(null, 1)\n"
          "os.execvp('cat', ['cat'])\n")
# The ablation's builds from the least of the log to the most (--ablate).
ABLATION_ORDER = ("record", "lines", "floor", "current", "thread", "tlines")
# The floor's parts switched off (--ablate floor-nolines,...): each against the whole floor.
FLOOR_PARTS = ("floor-nolines", "floor-nonotes")


def thread_ticks(root: int) -> dict[str, int]:
    """CPU ticks of ``root``'s process tree: ``loop`` (each process's main thread, where
    its event loop runs), ``writer`` (the access log's thread, which names itself) and
    ``threads`` (the others: the executor's, the probes' parsing); ``loop_sys``: the
    loop's kernel time alone (counted in ``loop`` too)."""
    pids = [p.pid for p in st.tree(ro.proc_snapshot(), root)]
    out = {LOOP: 0, WRITER: 0, THREADS: 0, LOOP_SYS: 0}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError), \
                        open(f"/proc/{pid}/task/{tid}/stat") as f:
                    text = f.read()
                comm = text[text.index("(") + 1:text.rindex(")")]
                fields = text[text.rindex(")") + 2:].split()
                kind = LOOP if int(tid) == pid else WRITER if comm == WRITER_COMM else THREADS
                out[kind] += int(fields[11]) + int(fields[12])
                if kind == LOOP:
                    out[LOOP_SYS] += int(fields[12])
    return out


def process_ticks(root: int) -> int:
    """All CPU ticks of ``root``'s process tree (``loop_sys`` is part of ``loop``: not
    counted twice)."""
    ticks = thread_ticks(root)
    return ticks[LOOP] + ticks[WRITER] + ticks[THREADS]


def thread_cpu(root: int) -> dict[str, float]:
    """:func:`thread_ticks` in seconds, ``loop``, ``writer`` and ``threads`` from each
    thread's ``schedstat`` (its run time in nanoseconds): a tick is 10 ms, which over a
    turn of a few thousand requests is a microsecond per request of rounding, more than
    the differences looked for. ``loop_sys`` stays in ticks' precision (only /proc's
    ``stat`` splits user and kernel time)."""
    ticks = thread_ticks(root)
    out = {k: v / _TICK for k, v in ticks.items()}
    ns = {LOOP: 0, WRITER: 0, THREADS: 0}
    pids = [p.pid for p in st.tree(ro.proc_snapshot(), root)]
    try:
        for pid in pids:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                        comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                        run = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text()
                                  .split()[0])
                        kind = (LOOP if int(tid) == pid else WRITER if comm == WRITER_COMM
                                else THREADS)
                        ns[kind] += run
    except (OSError, ValueError, IndexError):  # no schedstat here: ticks it is
        return out
    out.update({k: v / 1e9 for k, v in ns.items()})
    return out


def _has_schedstat() -> bool:
    return Path(f"/proc/{os.getpid()}/schedstat").exists()


def extract(rev: str, into: Path) -> Path:
    """The ``skymesh`` package of git revision ``rev``, for PYTHONPATH."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "skymesh"],
                             check=True, capture_output=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=120)
    return into


def in_process(pythonpath: Path | None, cwd: Path) -> dict[str, Any]:
    """``access_log_loop`` of the build on ``pythonpath`` (None: this checkout), run in
    ``cwd``: ``python -m`` puts the working directory first on the path, and a checkout's
    own ``skymesh`` there would win over ``pythonpath``."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    r = subprocess.run([sys.executable, "-m", "skymesh_lab.bench.access_log_loop",
                        "--requests", str(IN_PROCESS_REQUESTS),
                        "--repeats", str(IN_PROCESS_REPEATS)],
                       env=env, cwd=cwd, capture_output=True, text=True, timeout=900,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def start_lb(stubs: list[str], access_log: bool, pythonpath: Path | None,
             extra: list[str] | None = None, toggled: Path | None = None,
             sink: str = "file", lane: Lane = LANES["rr"]) -> Daemon:
    """``toggled``: the folder of a toggle's ``sitecustomize`` (put first on the path);
    the daemon then writes its state to ``toggled / "ack"``. ``sink``: ``file`` (the
    daemon's stderr a file) or ``pipe`` (a pipe drained by a child: :func:`stop_lb`
    ends both)."""
    env = dict(os.environ)
    paths = [str(p) for p in (toggled, pythonpath) if p is not None]
    if paths:  # PYTHONSAFEPATH: see overhead_ab (the workers' python -m)
        env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONSAFEPATH="1")
    if toggled is not None:
        env[toggle.ACK_ENV] = str(toggled / "ack")
    args = ["--port", "0", "--replicas", ",".join(stubs), *lane.flags, *(extra or [])]
    if not access_log:
        args.append("--no-access-log")
    if sink == "pipe":
        return _start_piped("skymesh-lb", args, ro.READY_TIMEOUT_S, env)
    return start_daemon("skymesh-lb", args, timeout=ro.READY_TIMEOUT_S, env=env)


# Each piped daemon's drain (--sink pipe), by the daemon's pid.
_DRAINS: dict[int, subprocess.Popen[bytes]] = {}


def _start_piped(name: str, args: list[str], timeout: float, env: dict[str, str]
                 ) -> Daemon:
    """``start_daemon`` with the daemon's stdout and stderr a pipe that a child of this
    process drains (its first bytes kept in the daemon's log file, for its "listening
    on" line): a lab set-up, the product's ``start_daemon`` takes a file only."""
    fd, tmp = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
    os.close(fd)
    log_path = Path(tmp)
    drain = subprocess.Popen([sys.executable, "-c", _DRAIN, str(log_path)],
                             stdin=subprocess.PIPE)
    assert drain.stdin is not None
    try:
        proc = subprocess.Popen([*executable(name), *args], stdout=drain.stdin,
                                stderr=subprocess.STDOUT, env=env)
    except BaseException:
        drain.kill()
        drain.wait()
        raise
    finally:
        drain.stdin.close()  # the daemon holds the pipe's only writing end now
    _DRAINS[proc.pid] = drain
    try:
        return wait_listening(name, proc, log_path, timeout)
    except RuntimeError:  # the daemon killed: its drain ends with the pipe
        stop_lb(Daemon(name, proc, "", log_path, True))
        raise


def stop_lb(d: Daemon) -> None:
    """Stop ``d`` and, for a piped one, its drain (which ends when the pipe closes)."""
    d.stop()
    drain = _DRAINS.pop(d.proc.pid, None)
    if drain is not None:
        try:
            drain.wait(10)
        except subprocess.TimeoutExpired:  # a worker of the daemon holds the pipe still
            drain.kill()
            drain.wait()


@contextlib.contextmanager
def _builds(base: str | None, workdir: Path, ablate: tuple[str, ...] = ()
            ) -> Iterator[tuple[list[str], dict[str, Path | None]]]:
    """The stub replicas (running) and each build's PYTHONPATH (None: this checkout)."""
    with contextlib.ExitStack() as exits:
        binary = ro.build_stub(workdir)
        stubs = []
        for i in range(2):
            d = ro.start_stub(binary, ro.STREAM_EVENTS, workdir, i)
            exits.callback(d.stop)
            stubs.append(d.url)
        builds: dict[str, Path | None] = {"current": None}
        if base is not None:
            (workdir / "base").mkdir()
            builds["base"] = extract(base, workdir / "base")
        for variant in ablate:  # this checkout, parts of the log switched off
            builds[variant] = ablation.sitecustomize(workdir / f"ablate-{variant}", variant)
        yield stubs, builds


@contextlib.contextmanager
def _balancers(stubs: list[str], builds: dict[str, Path | None], extra: list[str],
               toggles: dict[str, Path] | None = None, sink: str = "file",
               lane: Lane = LANES["rr"]) -> Iterator[dict[str, Daemon]]:
    """Each build's skymesh-lb with the access log on and off, ready and warmed up.
    ``toggles``: each build's toggle folder (``--toggle``): one daemon per build, the
    same for "on" and "off" (:func:`pair` switches it)."""
    with contextlib.ExitStack() as exits:
        lbs: dict[str, Daemon] = {}
        for build, path in builds.items():
            if toggles is not None:
                (toggles[build] / "ack").unlink(missing_ok=True)
                d = start_lb(stubs, True, path, extra, toggled=toggles[build], sink=sink,
                             lane=lane)
                exits.callback(stop_lb, d)
                _ACKS[d.proc.pid] = toggles[build] / "ack"
                lbs[f"{build}/on"] = lbs[f"{build}/off"] = d
                continue
            for on in (False, True):
                d = start_lb(stubs, on, path, extra, sink=sink, lane=lane)
                exits.callback(stop_lb, d)
                lbs[f"{build}/{'on' if on else 'off'}"] = d
        for d in {id(d): d for d in lbs.values()}.values():
            ro.wait_ready(d)
        for name, d in lbs.items():  # warm-up: connections, caches, lazy imports
            _switch(lbs[name.split("/")[0] + "/on"], lbs[name.split("/")[0] + "/off"],
                    name.endswith("/on"))
            ro.run_wrk(d.url, lane.case, 1.0)
        yield lbs


# A toggled daemon's state file, by its pid (--toggle).
_ACKS: dict[int, Path] = {}


def _switch(on: Daemon, off: Daemon, is_on: bool) -> None:
    """With one daemon for both (``--toggle``): put its access log on or off."""
    if on is off:
        toggle.switch(on.proc.pid, _ACKS[on.proc.pid], is_on)


def segment(d: Daemon, duration_s: float, case: ro.Case = CASE) -> dict[str, Any]:
    """One wrk run of ``case`` at ``d`` with its CPU ticks around it, per thread kind."""
    before = thread_cpu(d.proc.pid)
    out = ro.run_wrk(d.url, case, duration_s)
    after = thread_cpu(d.proc.pid)
    wrk = st.parse_wrk(out)
    return {"requests": wrk["requests"], "wall_s": wrk["requests"] / max(wrk["rps"], 1e-9),
            "errors": wrk["errors"] + wrk["non_2xx"],
            "ticks": {k: after[k] - before[k] for k in after}}


def pair(on: Daemon, off: Daemon, duration_s: float, slices: int = SLICES,
         case: ro.Case = CASE) -> tuple[dict[str, Any], dict[str, Any]]:
    """A build's "on" and "off" in short turns (on, off, off, on, ...), each
    ``duration_s / slices`` long, summed: both see the same stretch of a machine whose
    other tenants come and go. Not at the same time: two balancers racing each other
    for CPU settle unevenly (the one that falls behind wakes up for fewer requests at a
    time, which costs it more CPU per request, so it falls further behind)."""
    sums = {True: _empty(), False: _empty()}
    for i in range(slices):
        order = (True, False) if i % 2 == 0 else (False, True)
        for is_on in order:
            _switch(on, off, is_on)
            seg = segment(on if is_on else off, duration_s / slices, case)
            acc = sums[is_on]
            for key in ("requests", "wall_s", "errors"):
                acc[key] += seg[key]
            for k, v in seg["ticks"].items():
                acc["ticks"][k] = acc["ticks"].get(k, 0) + v
    return _per_request(sums[True]), _per_request(sums[False])


def _empty() -> dict[str, Any]:
    return {"requests": 0.0, "wall_s": 0.0, "errors": 0.0, "ticks": {}}


def _per_request(acc: dict[str, Any]) -> dict[str, Any]:
    n = acc["requests"]
    threads = {k: v / n * 1e6 for k, v in acc["ticks"].items()}  # seconds, by now
    return {"requests": n, "rps": n / acc["wall_s"] if acc["wall_s"] else 0.0,
            "errors": acc["errors"],
            "cpu_us": sum(v for k, v in threads.items() if k != LOOP_SYS),
            "threads_us": {k: round(v, 2) for k, v in threads.items()}}


def summarize(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """Per build: CPU per request on and off (medians, spreads) and the access log's
    paired cost (on minus off in each round), absolute and as a share of "on"."""
    out: dict[str, Any] = {}
    rounds = sorted({s["round"] for s in segments})
    by = {(s["setup"], s["round"]): s for s in segments}
    for build in sorted({s["setup"].split("/")[0] for s in segments}):
        on = [by[(f"{build}/on", r)]["cpu_us"] for r in rounds]
        off = [by[(f"{build}/off", r)]["cpu_us"] for r in rounds]
        diff = [a - b for a, b in zip(on, off, strict=True)]
        share = [d / a for d, a in zip(diff, on, strict=True)]
        loop = [by[(f"{build}/on", r)]["threads_us"][LOOP]
                - by[(f"{build}/off", r)]["threads_us"][LOOP] for r in rounds]
        writer = [by[(f"{build}/on", r)]["threads_us"][WRITER] for r in rounds]
        threads = [by[(f"{build}/on", r)]["threads_us"][THREADS]
                   - by[(f"{build}/off", r)]["threads_us"][THREADS] for r in rounds]
        loop_sys = [by[(f"{build}/on", r)]["threads_us"].get(LOOP_SYS, 0.0)
                    - by[(f"{build}/off", r)]["threads_us"].get(LOOP_SYS, 0.0)
                    for r in rounds]
        out[build] = {"off_us": _spread(off), "on_us": _spread(on), "cost_us": _spread(diff),
                      "share": _spread(share), "loop_cost_us": _spread(loop),
                      "loop_sys_cost_us": _spread(loop_sys),
                      "writer_us": _spread(writer), "threads_cost_us": _spread(threads)}
    costs = {b: [by[(f"{b}/on", r)]["cpu_us"] - by[(f"{b}/off", r)]["cpu_us"]
                 for r in rounds] for b in out}
    if "base" in out and "current" in out:  # now's cost minus before's, same rounds
        out["paired_vs_base_us"] = _spread(
            [c - b for c, b in zip(costs["current"], costs["base"], strict=True)])
    # With --ablate: what each part adds, each variant's cost minus the one before it
    # in ABLATION_ORDER, paired by round.
    present = [b for b in ABLATION_ORDER if b in out]
    pairs = [*itertools.pairwise(present),
             *((part, "floor") for part in FLOOR_PARTS if part in out and "floor" in out)]
    if any(b in out for b in ablation.VARIANTS):
        out["ablation_steps_us"] = {
            f"{b}-{a}": _spread([y - x for x, y in zip(costs[a], costs[b], strict=True)])
            for a, b in pairs}
    return out


def median_interval(values: list[float], level: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free ``level`` confidence interval of the median of ``values``
    (order statistics: the k-th smallest and largest, k from the binomial(n, 1/2) tail),
    so rounds with an outlier do not widen it as min and max do. Under six values no
    interval of 95% exists: min and max then."""
    xs = sorted(values)
    n = len(xs)
    k, tail = 0, 0.0  # the largest k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2
    while k < n // 2:
        tail += math.comb(n, k) / 2 ** n
        if tail > (1 - level) / 2:
            break
        k += 1
    if k == 0:
        return xs[0], xs[-1]
    return xs[k - 1], xs[n - k]

def _spread(values: list[float]) -> dict[str, float]:
    low, high = median_interval(values)
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "ci_low": round(low, 4), "ci_high": round(high, 4)}


def run(rounds: int, duration_s: float, base: str | None, seed: int,
        extra: list[str] | None = None, ablate: tuple[str, ...] = (),
        http_server: str | None = None, fresh_every: int = 0, toggled: bool = False,
        sink: str = "file", config: str = "rr") -> dict[str, Any]:
    extra = extra or []
    lane = LANES[config]
    started = datetime.now(UTC).isoformat(timespec="seconds")
    current = _head()  # what the daemons start with: a commit made meanwhile is not it
    load_before = os.getloadavg()
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="access-log-cost-") as tmp:
        daemon_args = list(extra)
        if http_server is not None:  # flags given after --config override it
            listen = Path(tmp) / "listen.yaml"
            listen.write_text(f"listen:\n  http_server: {http_server}\n")
            daemon_args = ["--config", str(listen), *daemon_args]
        segments, loop_only = _measure(rounds, duration_s, base, Path(tmp), daemon_args,
                                       ablate, rng, fresh_every, toggled, sink, lane)
    cmd = (f"python -m skymesh_lab.bench.access_log_cost --rounds {rounds} "
           f"--duration {duration_s:g}" + (f" --base {base}" if base else "")
           + (f" --ablate {','.join(ablate)}" if ablate else "")
           + (f" --http-server {http_server}" if http_server else "")
           + (f" --fresh-every {fresh_every}" if fresh_every else "")
           + (" --toggle" if toggled else "")
           + (f" --sink {sink}" if sink != "file" else "")
           + (f" --config {config}" if config != "rr" else "")
           + (f" --lb-args {shlex.quote(shlex.join(extra))}" if extra else ""))
    return {"setup": {"command": cmd, "lb_flags": [*lane.flags, *extra],
                      "config": config, "body": lane.case.body,
                      "http_server": http_server, "fresh_every": fresh_every,
                      "toggle": toggled, "sink": sink,
                      "connections": lane.case.connections,
                      "rounds": rounds, "duration_s": duration_s, "base": base,
                      "ablate": list(ablate),
                      "cpu_source": "schedstat" if _has_schedstat() else "stat",
                      "current": current, "cores": os.cpu_count(),
                      "loadavg_before": list(load_before),
                      "loadavg_after": list(os.getloadavg()), "started": started,
                      "finished": datetime.now(UTC).isoformat(timespec="seconds")},
            "summary": summarize(segments), "in_process": loop_only, "segments": segments}


def _measure(rounds: int, duration_s: float, base: str | None, tmp: Path,
             extra: list[str], ablate: tuple[str, ...], rng: random.Random,
             fresh_every: int = 0, toggled: bool = False, sink: str = "file",
             lane: Lane = LANES["rr"]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rounds' segments, then each build's in-process figure. ``fresh_every``: new
    balancer processes every that many rounds (0: the same ones throughout);
    ``toggled``: one process per build, its log switched (``--toggle``)."""
    segments: list[dict[str, Any]] = []
    with _builds(base, tmp, ablate) as (stubs, paths):
        builds = sorted(paths)
        toggles = ({b: _toggle_dir(tmp / f"toggle-{b}", b if b in ablate else None)
                    for b in builds} if toggled else None)
        span = fresh_every if fresh_every > 0 else rounds
        for first in range(0, rounds, span):
            with _balancers(stubs, paths, extra, toggles, sink, lane) as lbs:
                for rnd in range(first, min(first + span, rounds)):
                    rng.shuffle(builds)
                    for build in builds:
                        got = pair(lbs[f"{build}/on"], lbs[f"{build}/off"], duration_s,
                                   case=lane.case)
                        for name, seg in zip((f"{build}/on", f"{build}/off"), got,
                                             strict=True):
                            s = {"setup": name, "round": rnd, **seg}
                            segments.append(s)
                            print(f"r{rnd} {name:<12} {s['rps']:>8.0f} req/s "
                                  f"{s['cpu_us']:6.1f} us/req {s['threads_us']}", flush=True)
                        time.sleep(ro.SETTLE_S)
        loop_only = {}
        for build in builds:
            path = (tmp / "base" if build == "base"
                    else tmp / f"ablate-{build}" if build in ablate else None)
            loop_only[build] = in_process(path, tmp)
            print(f"in process {build}: {loop_only[build]['cost_us']}", flush=True)
    return segments, loop_only


def _toggle_dir(into: Path, variant: str | None) -> Path:
    """The toggle's ``sitecustomize`` folder, applying the ablation ``variant`` first
    (an ablated build's own ``sitecustomize`` would be shadowed by this one)."""
    toggle.sitecustomize(into)
    if variant is not None:
        site = into / "sitecustomize.py"
        site.write_text("from skymesh_lab.bench.access_log_ablate import apply\n"
                        f"apply({variant!r})\n" + site.read_text())
    return into


def _head() -> str:
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True, timeout=30)
    return r.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.access_log_cost",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--base", default=None, metavar="REV")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--lb-args", default="", metavar="FLAGS",
                    help="more skymesh-lb flags for every set-up, e.g. '--log-format json'")
    ap.add_argument("--fresh-every", type=int, default=0, metavar="K",
                    help="start new balancer processes every K rounds (0: one set for the "
                         "whole run); a process's own offset (its memory layout, its hash "
                         "seed) then varies across the rounds instead of biasing them all")
    ap.add_argument("--toggle", action="store_true",
                    help="each build's on and off in one balancer process, its access log "
                         "switched between turns (skymesh_lab.bench.access_log_toggle): "
                         "the process's own offset cancels")
    ap.add_argument("--http-server", choices=("aiohttp", "lean"), default=None,
                    help="every daemon with listen.http_server set so (default: the "
                         "daemon's own default)")
    ap.add_argument("--config", choices=tuple(LANES), default="rr",
                    help="rr: round-robin with bp, fixed bodies (the cheapest request); "
                         "default: the daemon's own policy and push mode, shared-prefix "
                         "bodies (router_overhead's default-c64 requests)")
    ap.add_argument("--sink", choices=SINKS, default="file",
                    help="where the daemons' stderr (the access log) goes: a file, or a "
                         "pipe the bench drains (the loop then writes the batches itself)")
    ap.add_argument("--ablate", default="", metavar="VARIANTS",
                    help="also run this checkout with parts of the access log switched off, "
                         f"comma-separated: {', '.join(ablation.VARIANTS)} "
                         "(skymesh_lab.bench.access_log_ablate)")
    args = ap.parse_args(argv)
    ablate = tuple(v for v in args.ablate.split(",") if v)
    for v in ablate:
        if v not in ablation.VARIANTS:
            ap.error(f"--ablate: unknown variant {v!r} (one of {', '.join(ablation.VARIANTS)})")
    executable("skymesh-lb")  # fails early without it
    res = run(args.rounds, args.duration, args.base, args.seed, shlex.split(args.lb_args),
              ablate, args.http_server, args.fresh_every, args.toggle, args.sink,
              args.config)
    for build in ("base", "current", *ablate):
        row = res["summary"].get(build)
        if row is None:
            continue
        print(f"{build}: off {row['off_us']['median']:.1f} us, on {row['on_us']['median']:.1f}"
              f" us, cost {row['cost_us']['median']:.1f} us "
              f"[{row['cost_us']['min']:.1f}, {row['cost_us']['max']:.1f}] = "
              f"{row['share']['median']:.1%} [{row['share']['min']:.1%}, "
              f"{row['share']['max']:.1%}] (loop {row['loop_cost_us']['median']:.1f} us, "
              f"writer {row['writer_us']['median']:.1f} us, "
              f"other threads {row['threads_cost_us']['median']:.1f} us)")
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
