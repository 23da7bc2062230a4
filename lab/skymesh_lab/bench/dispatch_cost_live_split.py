"""Where a second worker's CPU goes: the dispatch-cost-live set-up, split per process.

What is measured
    The set-up of :mod:`skymesh_lab.bench.dispatch_cost_live` (two C stubs, wrk on 64
    connections with the prefix bodies, a fresh ``skymesh-lb`` per segment after a warm-up
    of the same load), with ``--workers`` 1 and 2 in the same rounds, segments shuffled.
    Per segment, counted over wrk's measured run and divided by its completed requests:

    - each balancer process's user and system CPU (``/proc/PID/stat``), and its voluntary
      and involuntary context switches (``/proc/PID/status``); the supervisor apart from
      the workers (it should do no per-request work);
    - wrk's and the stubs' CPU (wrk's from ``wait4``'s rusage), and the machine's busy
      share of its cores (``/proc/stat``): with 2 workers, wrk and 2 stubs on 2 cores the
      machine is full, and a worker's CPU per request then includes what sharing a core
      costs it (the scheduler, the caches);
    - with ``--trace S``, after the measured run, a second wrk run of ``S`` seconds with
      every balancer process's system calls counted by kind (``perf stat`` on the
      syscall tracepoints: counted in the kernel, not traced through ptrace as ``strace
      -c`` does, which slows the process it counts), per request; ``epoll_pwait`` per
      request is the inverse of the requests each loop iteration serves;
    - with two workers, where they run: sampled every 5 ms, of the samples where both were
      runnable, the share where both were on one core (``one_core_share``).

``--pair`` adds arms of two independent 1-worker balancers (no supervisor, no share, each
sp-p's share of a replica its own), each driven by a wrk of its own on half the
connections: two balancer processes on the machine without the workers' machinery.
``--floor`` adds the stack floor (``proxy_floor --kind stack``: aiohttp proxying to the
stubs, no balancer) with the same worker counts. ``--base REV`` (or a directory) runs that
revision's ``skymesh`` too, in the same rounds. Prints a summary per arm (medians over
rounds, and each arm's per-round ratio to its 1-worker arm); ``--json PATH`` writes
every segment, ``--report PATH`` prints such a file's summary again. Not in ``make
test``; needs gcc, wrk, and for ``--trace`` perf. Findings: docs/notes/second-worker-cost.md.

    python -m skymesh_lab.bench.dispatch_cost_live_split [--workers 1 2] [--config default]
        [--rounds 3] [--duration 4] [--trace 2] [--pair] [--floor] [--base 6b2f2cd]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skymesh.util.procs import Daemon, start_daemon
from skymesh_lab.bench import dispatch_cost_live as dcl
from skymesh_lab.bench import router_overhead as ro
from skymesh_lab.bench import router_overhead_stats as st

_TICK = os.sysconf("SC_CLK_TCK")
CONNECTIONS = 64


@dataclass(frozen=True)
class ProcCounters:
    utime: float  # seconds
    stime: float
    vcsw: int
    ivcsw: int


def read_counters(pid: int) -> ProcCounters | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    sw = dict(re.findall(r"^(\w*ctxt_switches):\s+(\d+)", status, re.M))
    return ProcCounters(int(stat[11]) / _TICK, int(stat[12]) / _TICK,
                        int(sw["voluntary_ctxt_switches"]),
                        int(sw["nonvoluntary_ctxt_switches"]))


def balancer_pids(pid: int) -> dict[str, int]:
    """The balancer's processes by role: ``worker`` alone (1 worker: no supervisor), or
    ``supervisor`` and ``w0``, ``w1``, ... (its children, in pid order)."""
    with contextlib.suppress(OSError):
        kids = sorted(int(p) for p in
                      Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
        if kids:
            return {"supervisor": pid, **{f"w{i}": k for i, k in enumerate(kids)}}
    return {"w0": pid}


def per_request(before: dict[str, ProcCounters | None], after: dict[str, ProcCounters | None],
                requests: int) -> dict[str, dict[str, float]]:
    """Each process's user/system CPU (us) and context switches per request."""
    out: dict[str, dict[str, float]] = {}
    for name, a in after.items():
        b = before.get(name)
        if a is None or b is None:
            continue
        out[name] = {"user_us": (a.utime - b.utime) / requests * 1e6,
                     "sys_us": (a.stime - b.stime) / requests * 1e6,
                     "vcsw": (a.vcsw - b.vcsw) / requests,
                     "ivcsw": (a.ivcsw - b.ivcsw) / requests}
    return out


SYSCALLS = ("read", "write", "readv", "writev", "recvfrom", "sendto", "recvmsg", "sendmsg",
            "epoll_wait", "epoll_pwait", "getpid", "futex", "accept4", "close", "setsockopt",
            "getsockopt", "getsockname", "getpeername", "ioctl", "io_uring_enter")


def parse_perf_stat(text: str) -> dict[int, dict[str, int]]:
    """``perf stat --per-thread -x,``'s counts: system calls by kind (``all``: every
    one), per thread id."""
    out: dict[int, dict[str, int]] = {}
    for line in text.splitlines():
        parts = line.split(",")
        if len(parts) < 4 or not parts[1].isdigit() or "-" not in parts[0]:
            continue
        tid = int(parts[0].rsplit("-", 1)[1])
        event = parts[3].split(":", 1)[-1]
        kind = "all" if event == "sys_enter" else event.removeprefix("sys_enter_")
        out.setdefault(tid, {})[kind] = int(parts[1])
    return out


def perf_stat_start(pids: dict[str, int]) -> subprocess.Popen[str]:
    events = ["raw_syscalls:sys_enter", *(f"syscalls:sys_enter_{k}" for k in SYSCALLS)]
    p = subprocess.Popen(["perf", "stat", "--per-thread", "-x,", "-e", ",".join(events),
                          "-p", ",".join(map(str, pids.values()))],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)  # attached by then
    return p


def per_process(by_tid: dict[int, dict[str, int]], tids: dict[str, set[int]],
                requests: int) -> dict[str, dict[str, float]]:
    """System calls per request by kind, per process (its threads summed), most first."""
    res: dict[str, dict[str, float]] = {}
    for name, ids in tids.items():
        calls: dict[str, float] = {}
        for tid in ids:
            for k, v in by_tid.get(tid, {}).items():
                calls[k] = calls.get(k, 0.0) + v / requests
        res[name] = dict(sorted(calls.items(), key=lambda kv: -kv[1]))
    return res


def perf_stat_stop(p: subprocess.Popen[str], pids: dict[str, int], requests: int
                   ) -> dict[str, dict[str, float]]:
    tids = {name: set(_tids(pid)) | {pid} for name, pid in pids.items()}
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    return per_process(parse_perf_stat(out), tids, requests)


def _tids(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return []


def _wrk(url: str, duration_s: float, connections: int = 64) -> subprocess.Popen[str]:
    case = ro.Case("x", "", connections, False, "prefix")
    cmd = ["wrk", "-t", str(case.threads), "-c", str(case.connections),
           "-d", f"{duration_s:g}s", "--timeout", "10s", "-s", str(ro.STUB_DIR / "post.lua"),
           url + "/v1/chat/completions", "--", case.body, "0", str(ro.PREFIX_GROUPS)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_wrk(p: subprocess.Popen[str]) -> tuple[str, float]:
    """wrk's output and its CPU seconds (user + system, from ``wait4``)."""
    assert p.stdout is not None
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"wrk failed ({p.returncode})")
    return out, ru.ru_utime + ru.ru_stime


def _trace(pids: dict[str, int], url: str, seconds: float) -> dict[str, dict[str, float]]:
    """System calls per request by kind, per balancer process, over a wrk run of
    ``seconds`` (counted by perf from before it starts to after it ends: the idle
    balancer's calls around it are a few timers')."""
    perf = perf_stat_start(pids)
    try:
        out, _ = _wait_wrk(_wrk(url, seconds))
    except BaseException:
        perf.kill()
        perf.wait()
        raise
    return perf_stat_stop(perf, pids, int(st.parse_wrk(out)["requests"]))


def workers_of(pids: dict[str, int]) -> dict[str, int]:
    return {k: p for k, p in pids.items() if not k.endswith("supervisor")}


def _placement(pid: int) -> tuple[str, int] | None:
    """A process's (main thread's) state and the core it last ran on."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[36])


def watch_placement(workers: dict[str, int], wrks: list[subprocess.Popen[str]],
                    every_s: float = 0.005) -> tuple[int, int]:
    """Until the wrk runs end, sample where two workers run: (samples with both runnable
    on one core, samples with both runnable). Nothing to watch for one worker."""
    if len(workers) != 2:
        return 0, 0
    shared = both = 0
    # Not ``poll()``: it would reap wrk, whose CPU ``wait4`` reads afterwards.
    while any((g := _placement(w.pid)) is not None and g[0] != "Z" for w in wrks):
        got = [_placement(p) for p in workers.values()]
        if all(g is not None and g[0] == "R" for g in got):
            both += 1
            shared += got[0] == got[1]
        time.sleep(every_s)
    return shared, both


def _machine_busy(a: list[int], b: list[int]) -> float:
    """The share of the cores busy between two ``/proc/stat`` readings."""
    total = sum(b) - sum(a)
    idle = (b[3] + b[4]) - (a[3] + a[4])
    return (total - idle) / total if total else 0.0


def segment(start: Callable[[], list[Daemon]], stubs: list[Daemon], duration_s: float,
            warmup_s: float, trace_s: float) -> dict[str, Any]:
    """One measured load of fresh balancers (module docstring): one balancer, or the
    ``pair``'s two, each then driven by a wrk of its own on half the connections."""
    ds = start()
    stub_pids = {f"stub{i}": s.proc.pid for i, s in enumerate(stubs)}
    try:
        for d in ds:
            ro.wait_ready(d)
        pids: dict[str, int] = {}
        for i, d in enumerate(ds):
            pids.update({(f"b{i}." if len(ds) > 1 else "") + k: p
                         for k, p in balancer_pids(d.proc.pid).items()})
        conns = CONNECTIONS // len(ds)
        for w in [_wrk(d.url, warmup_s, conns) for d in ds]:
            _wait_wrk(w)
        allp = {**pids, **stub_pids}
        m0 = ro.machine_cpu()
        c0 = {k: read_counters(p) for k, p in allp.items()}
        wrks = [_wrk(d.url, duration_s, conns) for d in ds]
        shared, both = watch_placement(workers_of(pids), wrks)
        outs = [_wait_wrk(w) for w in wrks]
        c1 = {k: read_counters(p) for k, p in allp.items()}
        m1 = ro.machine_cpu()
        n = sum(int(st.parse_wrk(out)["requests"]) for out, _ in outs)
        procs = per_request(c0, c1, n)
        workers = list(workers_of(pids))
        res: dict[str, Any] = {
            "requests": n, "req_s": n / duration_s,
            "procs": procs,
            "balancer_us": sum(v["user_us"] + v["sys_us"]
                               for k, v in procs.items() if k in pids),
            "workers": {f: sum(procs[w][f] for w in workers if w in procs)
                        for f in ("user_us", "sys_us", "vcsw", "ivcsw")},
            "stubs_us": sum(v["user_us"] + v["sys_us"]
                            for k, v in procs.items() if k in stub_pids),
            "wrk_us": sum(cpu for _, cpu in outs) / n * 1e6,
            "machine_busy": _machine_busy(m0, m1),
            # Of the moments both workers were runnable, the share on one core.
            "one_core_share": shared / both if both else None,
        }
        if trace_s > 0 and shutil.which("perf") and len(ds) == 1:
            res["syscalls"] = _trace(pids, ds[0].url, trace_s)
        return res
    finally:
        for d in ds:
            d.stop()


def _balancer(urls: str, flags: list[str], workers: int, pythonpath: str | None,
              pair: bool = False) -> Callable[[], list[Daemon]]:
    def one() -> Daemon:
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
            env["PYTHONSAFEPATH"] = "1"
        return start_daemon("skymesh-lb", ["--port", "0", "--replicas", urls,
                                           "--workers", str(workers), *flags],
                            timeout=ro.READY_TIMEOUT_S, env=env)

    def start() -> list[Daemon]:
        out = [one()]
        try:
            if pair:
                out.append(one())
        except BaseException:
            out[0].stop()
            raise
        return out
    return start


def _floor(stubs: list[Daemon], workers: int, tmp: Path) -> Callable[[], list[Daemon]]:
    def start() -> list[Daemon]:
        d, _ = ro.start_floor("lb-stack-floor", workers, "split", [s.url for s in stubs],
                              tmp)
        return [d]
    return start


def _syscall_line(calls: dict[str, float], top: int = 8) -> str:
    total = calls.get("all", 0.0)
    parts = ", ".join(f"{k} {v:.2f}" for k, v in list(calls.items())[:top + 1] if k != "all")
    return f"{total:.1f} ({parts})"


def report(rows: dict[str, list[dict[str, Any]]]) -> None:
    med = statistics.median
    for arm, segs in rows.items():
        w = [s["workers"] for s in segs]
        sup = [s["procs"].get("supervisor", {}) for s in segs]
        print(f"\n{arm}: {len(segs)} segments, load {segs[0].get('load', 0):.2f}")
        print(f"  balancer CPU us/request {med(s['balancer_us'] for s in segs):.1f} "
              f"[{min(s['balancer_us'] for s in segs):.1f}, "
              f"{max(s['balancer_us'] for s in segs):.1f}], req/s "
              f"{med(s['req_s'] for s in segs):.0f}")
        print(f"  workers: user {med(x['user_us'] for x in w):.1f} sys "
              f"{med(x['sys_us'] for x in w):.1f} us/request; ctx switches per request "
              f"voluntary {med(x['vcsw'] for x in w):.3f} involuntary "
              f"{med(x['ivcsw'] for x in w):.3f}")
        if any(sup):
            print(f"  supervisor: {med(x.get('user_us', 0) + x.get('sys_us', 0) for x in sup):.2f}"
                  f" us/request, vcsw {med(x.get('vcsw', 0) for x in sup):.4f}")
        placed = [s["one_core_share"] for s in segs if s.get("one_core_share") is not None]
        if placed:
            print(f"  both workers runnable on one core: {[f'{x:.0%}' for x in placed]}")
        print(f"  stubs {med(s['stubs_us'] for s in segs):.1f} us/request, wrk "
              f"{med(s['wrk_us'] for s in segs):.1f}, machine busy "
              f"{med(s['machine_busy'] for s in segs):.0%}")
        traced = [s["syscalls"] for s in segs if "syscalls" in s]
        for name in traced[0] if traced else []:
            print(f"  syscalls/request {name}: {_syscall_line(median_calls(traced, name))}")
    for arm, ratios in paired_ratios(rows).items():
        print(f"{arm}: per round {[round(r, 2) for r in ratios]}, "
              f"median {med(ratios):.2f}")


def median_calls(traced: list[dict[str, dict[str, float]]], name: str) -> dict[str, float]:
    """Process ``name``'s system calls per request by kind, the median over segments."""
    kinds = {k for t in traced for k in t.get(name, {})}
    got = {k: statistics.median(t.get(name, {}).get(k, 0.0) for t in traced) for k in kinds}
    return dict(sorted(got.items(), key=lambda kv: -kv[1]))


def paired_ratios(rows: dict[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Each arm's balancer CPU per request over its 1-worker arm's (``... w1``), round by
    round (the same round: the same machine, as near as a shared one allows)."""
    out: dict[str, list[float]] = {}
    for arm, segs in rows.items():
        base = arm.rsplit(" ", 1)[0] + " w1"
        if arm == base or base not in rows:
            continue
        out[f"{arm} / w1"] = [s["balancer_us"] / b["balancer_us"]
                              for s, b in zip(segs, rows[base], strict=False)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--config", nargs="+", default=["default"], choices=list(dcl.CONFIGS))
    ap.add_argument("--base", default=None, help="git revision or checkout to compare")
    ap.add_argument("--floor", action="store_true", help="add the stack floor's arms")
    ap.add_argument("--pair", action="store_true",
                    help="add arms of two independent 1-worker balancers, each with its "
                         "own wrk on half the connections")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--trace", type=float, default=0.0,
                    help="seconds of perf trace per segment (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None,
                    help="print the summary of a --json file written before; run nothing")
    args = ap.parse_args(argv)
    if args.report is not None:
        report(json.loads(args.report.read_text())["arms"])
        return 0
    rows: dict[str, list[dict[str, Any]]] = {}
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dcl-split-") as tmpdir:
        tmp = Path(tmpdir)
        Path(dcl.TOLD_FILE.format(tmp=tmp)).write_text(dcl.TOLD_YAML)
        trees: dict[str, str | None] = {"now": None}
        if args.base:
            trees["base"] = dcl._checkout(args.base, str(tmp))
        binary = ro.build_stub(tmp)
        stubs = [ro.start_stub(binary, ro.STREAM_EVENTS, tmp, i) for i in range(2)]
        try:
            urls = ",".join(s.url for s in stubs)
            arms: dict[str, Callable[[], list[Daemon]]] = {}
            for v, tree in trees.items():
                for c in args.config:
                    flags = [f.format(tmp=tmp) for f in dcl.CONFIGS[c]]
                    for n in args.workers:
                        arms[f"{v} {c} w{n}"] = _balancer(urls, flags, n, tree)
                    if args.pair:
                        arms[f"{v} {c} pair"] = _balancer(urls, flags, 1, tree, pair=True)
            if args.floor:
                for n in args.workers:
                    arms[f"floor w{n}"] = _floor(stubs, n, tmp)
            rng = random.Random(args.seed)
            for r in range(args.rounds):
                order = list(arms)
                rng.shuffle(order)
                for arm in order:
                    seg = segment(arms[arm], stubs, args.duration, args.warmup, args.trace)
                    seg["load"] = os.getloadavg()[0]
                    rows.setdefault(arm, []).append(seg)
                    print(f"round {r} {arm}: {seg['balancer_us']:.1f} us/request "
                          f"(workers user {seg['workers']['user_us']:.1f} sys "
                          f"{seg['workers']['sys_us']:.1f}), {seg['req_s']:.0f} req/s, "
                          f"load {seg['load']:.2f}", flush=True)
        finally:
            for s in stubs:
                s.stop()
    report(rows)
    if args.json is not None:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"],
                                capture_output=True, text=True, check=False).stdout.strip()
        args.json.write_text(json.dumps({
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "argv": sys.argv[1:], "commit": commit or None,
            "load_average_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
            "arms": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
