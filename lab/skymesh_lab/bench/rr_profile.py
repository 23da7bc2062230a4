"""Where skymesh-lb's round-robin request path spends its CPU, beside the stack floor's
(issue #35): a py-spy profile of each, split by stage, per request.

What is run (``--run``)
    Two C stub replicas (``stub/stub.c``), ``skymesh-lb --workers 1 --no-access-log
    --policy round-robin --push-mode bp`` and the ``lb-stack-floor`` (``proxy_floor``
    ``--kind stack --workers 1``: aiohttp's server and skymesh-lb's own upstream client,
    no logic) in front of them. Each in turn gets wrk (``-c64``, non-streaming, fixed
    bodies) with ``py-spy record --format raw`` attached to its serving process; its CPU
    (utime and stime of every thread, /proc) is read around the wrk run.

How a profile is read (:func:`split`)
    py-spy samples wall time, not CPU: a thread that is runnable but waiting for a core
    is sampled where the scheduler took it off, mostly in the two socket writes (the
    upstream request in ``Upstream._request``, the reply in aiohttp's ``_writelines``).
    On a shared machine those leaves hold half to two thirds of the samples, so they are
    left out (with the few cheap lines of those two functions around the write), as are
    the event loop's own C code (``Runner.run`` as the leaf: epoll, the socket reads) and
    every thread but the loop's (the probe parsing pool: under 1% of the CPU by /proc,
    though py-spy shows its GIL waits). What is left is Python on the loop thread;
    ``samples x 1/rate / requests`` is its time per request, bucketed by
    the innermost frame that matches a stage (:data:`STAGES`).

    python -m skymesh_lab.bench.rr_profile --run --seconds 14 [--out DIR]
    python -m skymesh_lab.bench.rr_profile --profile lb.txt --requests 45622 \\
        [--against floor.txt --against-requests 138052]

py-spy is a tool, not a dependency: ``.venv/bin/pip install py-spy``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from skymesh.util.procs import Daemon
from skymesh_lab.bench import request_path_cost as rpc
from skymesh_lab.bench import router_overhead as ro
from skymesh_lab.bench import router_overhead_stats as st

RATE = 400  # py-spy samples per second
# Leaves that are a socket write (wall time waiting for a core lands there); line
# numbers as in the profiled build, so checked by name and the C call they make.
WRITE_LEAVES = ("Upstream._request (", "StreamWriter._writelines (")
LOOP_LEAF = "Runner.run ("

Match = Callable[[str], bool]


def _in(*parts: str) -> Match:
    return lambda frame: any(p in frame for p in parts)


# (stage, match on a frame's text): the innermost frame that matches any stage names it.
STAGES: tuple[tuple[str, Match], ...] = (
    ("metrics (prometheus children, histograms)", _in("prometheus_client", "metrics.py")),
    ("upstream client (upstream.py)", _in("balancer/upstream.py")),
    ("dispatcher, pump, policy (dispatch.py, server.py, policies/)",
     _in("balancer/dispatch",  # dispatch.py and its parts, dispatch_*.py
         "balancer/server.py", "skymesh/policies/")),
    ("body parse and checks (parse_request, jsonbody, prompt)",
     _in("parse_request", "jsonbody", "prefix/prompt")),
    ("route_request, Ticket, RouteRequest", _in("route_request", "request_deadline",
                                                "__create_fn__")),
    ("request id (edge.request_id, the on_response_prepare stamp)",
     _in("balancer/edge.py", "aiosignal", "_prepare_hook")),
    ("access-log notes, spans (obs)", _in("skymesh/obs/")),
    ("upstream and reply headers (relay.py)", _in("balancer/relay.py")),
    ("load probes (loop side)", _in("balancer/probing.py")),
    ("overload checks, tally", _in("balancer/overload.py", "controller_link.py")),
    ("connection guard (net/limits.py)", _in("net/limits.py")),
    ("handlers.py's own lines", _in("balancer/handlers.py")),
    ("forwarding.py's own lines", _in("balancer/forwarding.py")),
    ("floor handler (proxy_floor.py)", _in("proxy_floor.py")),
    ("aiohttp app layer (Application._handle, router, Request)",
     _in("aiohttp/web_app.py", "web_urldispatcher", "aiohttp/web_request.py")),
    ("aiohttp server and response", _in("aiohttp/", "yarl/", "multidict/")),
)


def parse_raw(lines: Iterable[str]) -> Iterator[tuple[list[str], int]]:
    """py-spy's raw format: ``frame;frame;... count`` per line, outermost first."""
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def kept(frames: list[str]) -> bool:
    """A sample of Python on the loop thread (see the module docstring)."""
    if not any(f.startswith(LOOP_LEAF) for f in frames):
        return False  # another thread
    leaf = frames[-1]
    return not (leaf.startswith(WRITE_LEAVES) or leaf.startswith(LOOP_LEAF))


def stage(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, match in STAGES:
            if match(frame):
                return name
    return "other"


def split(lines: Iterable[str], requests: float, rate: int = RATE) -> dict[str, float]:
    """Microseconds per request by stage, of the kept samples."""
    per = collections.Counter[str]()
    for frames, n in parse_raw(lines):
        if kept(frames):
            per[stage(frames)] += n
    scale = 1e6 / rate / max(requests, 1.0)
    return {name: n * scale for name, n in per.items()}


def table(a: dict[str, float], b: dict[str, float] | None = None,
          names: tuple[str, str] = ("skymesh-lb", "floor")) -> str:
    b = b or {}
    rows = [f"| stage | {names[0]}, us per request | {names[1]} |", "| --- | ---: | ---: |"]
    for k in sorted(set(a) | set(b), key=lambda k: (-a.get(k, 0.0), k)):
        if max(a.get(k, 0.0), b.get(k, 0.0)) >= 0.1:
            rows.append(f"| {k} | {a.get(k, 0.0):.1f} | {b.get(k, 0.0):.1f} |")
    rows.append(f"| total | {sum(a.values()):.1f} | {sum(b.values()):.1f} |")
    return "\n".join(rows)


# -- the live run -------------------------------------------------------------------
def _serving_pid(d: Daemon) -> int:
    """The process that serves: the floor forks its one worker; skymesh-lb with
    ``--workers 1`` serves in its own."""
    kids = subprocess.run(["pgrep", "-P", str(d.proc.pid)], capture_output=True,
                          text=True, timeout=10).stdout.split()
    return int(kids[0]) if kids else d.proc.pid


def profile(d: Daemon, out: Path, seconds: int, spy: str) -> dict[str, float]:
    """wrk against ``d`` with py-spy attached: requests, req/s and CPU us per request
    (user and system apart)."""
    pid = _serving_pid(d)
    rec = subprocess.Popen([spy, "record", "-p", str(pid), "-r", str(RATE), "-d",
                            str(seconds), "-f", "raw", "-o", str(out), "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.7)  # py-spy attached before the load starts
    before = _user_sys(pid)
    wrk = st.parse_wrk(ro.run_wrk(d.url, rpc.case("rr"), seconds - 2))
    after = _user_sys(pid)
    rec.wait(timeout=seconds + 60)
    n = max(wrk["requests"], 1.0)
    tick = 1e6 / os.sysconf("SC_CLK_TCK")
    return {"requests": wrk["requests"], "rps": wrk["rps"],
            "user_us": (after[0] - before[0]) * tick / n,
            "sys_us": (after[1] - before[1]) * tick / n}


def _user_sys(pid: int) -> tuple[int, int]:
    user = system = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            user, system = user + int(fields[11]), system + int(fields[12])
    return user, system


def run(seconds: int, out: Path) -> str:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("py-spy is needed: .venv/bin/pip install py-spy")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rr-profile-") as tmp, \
            contextlib.ExitStack() as exits:
        work = Path(tmp)
        binary = ro.build_stub(work)
        stubs = [exits.enter_context(rpc._stopping(ro.start_stub(binary, ro.STREAM_EVENTS,
                                                                  work, i))).url
                 for i in range(2)]
        lb = exits.enter_context(rpc._stopping(rpc.start_lb(stubs, "rr", None)))
        floor, _ = ro.start_floor("lb-stack-floor", 1, "rr", stubs, work)
        exits.enter_context(rpc._stopping(floor))
        figures: dict[str, dict[str, float]] = {}
        splits: dict[str, dict[str, float]] = {}
        for name, d in (("skymesh-lb", lb), ("floor", floor)):
            ro.wait_ready(d)
            ro.run_wrk(d.url, rpc.case("rr"), 2.0)  # warm: connections, lazy imports
            path = out / f"{name}.txt"
            figures[name] = profile(d, path, seconds, spy)
            with path.open() as f:
                splits[name] = split(f, figures[name]["requests"])
    head = [f"{name}: {f['rps']:,.0f} req/s, CPU {f['user_us']:.1f} us user + "
            f"{f['sys_us']:.1f} us system per request" for name, f in figures.items()]
    load = os.getloadavg()[0]
    return "\n".join([*head, f"load average {load:.1f}; profiles in {out}", "",
                      table(splits["skymesh-lb"], splits["floor"])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.rr_profile",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="start the stack and profile it")
    ap.add_argument("--seconds", type=int, default=14)
    ap.add_argument("--out", default="rr-profile", metavar="DIR")
    ap.add_argument("--profile", metavar="RAW", help="a py-spy raw profile to split")
    ap.add_argument("--requests", type=float, help="requests served during --profile")
    ap.add_argument("--against", metavar="RAW", help="a second profile, for a column")
    ap.add_argument("--against-requests", type=float)
    args = ap.parse_args(argv)
    if args.run:
        print(run(args.seconds, Path(args.out)))
        return 0
    if not args.profile or not args.requests:
        ap.error("--run, or --profile RAW --requests N")
    with open(args.profile) as f:
        a = split(f, args.requests)
    b = None
    if args.against:
        if not args.against_requests:
            ap.error("--against needs --against-requests")
        with open(args.against) as f:
            b = split(f, args.against_requests)
    print(table(a, b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
