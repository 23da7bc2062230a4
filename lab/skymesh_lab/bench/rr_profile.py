"""Where skymesh-lb's request path spends its CPU, beside the stack floor's (issue #35): a
py-spy profile of each, split by stage, per request.

What is run (``--run``)
    Two C stub replicas (``stub/stub.c``), ``skymesh-lb --workers 1 --no-access-log`` with
    the configuration's flags (``--config rr``: ``--policy round-robin --push-mode bp``,
    fixed bodies; ``default``: its default policy, shared-prefix bodies) and a floor
    (``--floor lean``, the default: ``proxy_floor --kind lean --workers 1``, skymesh-lb's
    own serving path, lean server and upstream client with one plain route and no logic;
    ``--floor stack``: aiohttp's server and the same client) in front of them. Each in
    turn gets wrk (``-c64``, non-streaming) with ``py-spy record --format raw --threads``
    attached to its serving process; its CPU (utime and stime of every thread, /proc) is
    read around the wrk run.

How a profile is read (:func:`split`)
    py-spy samples wall time, not CPU: a thread that is runnable but waiting for a core
    is sampled where the scheduler took it off, mostly in the socket writes (the
    upstream request in ``Upstream._request``, the reply in the lean server's
    ``_send_plain`` or aiohttp's ``_writelines``). Those leaves (a line that calls
    ``transport.write`` or ``writelines``, read from the source first on ``sys.path``:
    to read a profile of another revision, put its source first on ``PYTHONPATH``, as
    for the run that made it) are left out, as are the samples with no Python frame or
    with the event loop's ``Runner.run`` as the leaf (the loop's own C code: epoll, the
    socket reads), and every thread but the loop's (the probe parsing pool, uvloop's
    threads). The loop thread is the main
    thread: with ``--threads`` py-spy names it in each sample's first frame. A sample is
    NOT required to be rooted at ``Runner.run``: py-spy walks a resumed coroutine's
    frames only up to the outermost coroutine (the lean server's connection task, a
    protocol callback called from uvloop's C code), so on the lean server most of the
    request path's samples have no ``Runner.run`` under them. What is left is Python on
    the loop thread; ``samples x 1/rate / requests`` is its time per request, bucketed
    by the innermost frame that matches a stage (:data:`STAGES`). The table shows what
    was left out (writes, the loop's C code) below the total, per request too.

    python -m skymesh_lab.bench.rr_profile --run --seconds 14 [--config rr|default]
        [--floor lean|stack] [--out DIR] [--lines 25]
    python -m skymesh_lab.bench.rr_profile --profile lb.txt --requests 45622 \\
        [--against floor.txt --against-requests 138052] [--lines 25]

py-spy is a tool, not a dependency: ``.venv/bin/pip install py-spy``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
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
# Functions whose socket write is a leaf where wall time waiting for a core lands, for a
# profile whose source cannot be read (see :func:`is_write`): checked by name.
WRITE_LEAVES = ("Upstream._request (", "StreamWriter._writelines (",
                "LeanProtocol._send_plain (")
WRITE_CALLS = ("transport.write(", "writelines(", "._write(")
LOOP_LEAF = "Runner.run ("
THREAD_FRAME = "thread ("  # py-spy --threads: "thread (TID): NAME" before the stack
LOOP_THREAD = "MainThread"
LEFT_WRITES = "left out: socket writes (leaf)"
LEFT_LOOP = "left out: the loop's C code (no Python frame, or Runner.run)"
LEFT = (LEFT_WRITES, LEFT_LOOP)

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
    ("lean server (net/lean.py, net/lean_request.py)", _in("net/lean")),
    ("server's request handler (net/front.py)", _in("net/front.py")),
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


def _source_line(where: str) -> str | None:
    """The text of ``path:line`` (a frame's location as py-spy prints it, relative to a
    ``sys.path`` entry), or None when no such file is found."""
    path, _, line = where.rpartition(":")
    if not line.isdigit():
        return None
    for root in sys.path:
        file = Path(root or ".") / path
        if file.is_file():
            lines = _file_lines(str(file))
            n = int(line)
            return lines[n - 1] if 0 < n <= len(lines) else None
    return None


@functools.cache
def _file_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []


@functools.cache
def is_write(frame: str) -> bool:
    """Whether ``frame`` (``func (path:line)``) is a socket write: its line calls
    ``transport.write``, ``writelines`` or a writer's ``_write`` (read from the profiled
    source, so an edit that moves the write keeps it recognised), else, without the
    source, one of :data:`WRITE_LEAVES` by name."""
    where = frame[frame.rfind("(") + 1:-1] if frame.endswith(")") else ""
    text = _source_line(where)
    if text is None:
        return frame.startswith(WRITE_LEAVES)
    return any(call in text for call in WRITE_CALLS)


def on_loop_thread(frames: list[str]) -> bool:
    """A sample of the loop's thread: named so by py-spy (``--threads``), or, in a profile
    without thread names, any sample not of a ``threading`` thread."""
    first = frames[0]
    if first.startswith(THREAD_FRAME):
        return first.endswith(LOOP_THREAD)
    return not any(f.startswith("Thread._bootstrap (") or f.startswith("_bootstrap (")
                   for f in frames)


def python_frames(frames: list[str]) -> list[str]:
    return frames[1:] if frames[0].startswith(THREAD_FRAME) else frames


def left_out(frames: list[str]) -> str | None:
    """Which of :data:`LEFT` a loop thread's sample is, or None: Python on the loop."""
    if not frames or frames[-1].startswith(LOOP_LEAF):
        return LEFT_LOOP
    return LEFT_WRITES if is_write(frames[-1]) else None


def kept(frames: list[str]) -> bool:
    """A sample of Python on the loop thread (see the module docstring)."""
    return on_loop_thread(frames) and left_out(python_frames(frames)) is None


def stage(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, match in STAGES:
            if match(frame):
                return name
    return "other"


def split(lines: Iterable[str], requests: float, rate: int = RATE) -> dict[str, float]:
    """Microseconds per request by stage, of the loop thread's Python samples, and the
    loop thread's samples left out (:data:`LEFT`) under their own names."""
    per = collections.Counter[str]()
    for frames, n in parse_raw(lines):
        if not on_loop_thread(frames):
            continue
        py = python_frames(frames)
        per[left_out(py) or stage(py)] += n
    scale = 1e6 / rate / max(requests, 1.0)
    return {name: n * scale for name, n in per.items()}


def by_line(lines: Iterable[str], requests: float, rate: int = RATE,
            top: int = 25) -> list[tuple[str, float, float]]:
    """The ``top`` functions and lines of the kept samples by self time (the leaf's
    frame), with each one's inclusive time by function (any frame of the stack), us per
    request: ``(frame, self, inclusive of its function)``."""
    self_n = collections.Counter[str]()
    incl_n = collections.Counter[str]()
    for frames, n in parse_raw(lines):
        if not kept(frames):
            continue
        py = python_frames(frames)
        self_n[py[-1]] += n
        for func in {f[:f.rfind(" (")] for f in py}:
            incl_n[func] += n
    scale = 1e6 / rate / max(requests, 1.0)
    return [(frame, n * scale, incl_n[frame[:frame.rfind(" (")]] * scale)
            for frame, n in self_n.most_common(top)]


def line_table(rows: list[tuple[str, float, float]]) -> str:
    out = ["| frame (self time) | self, us per request | its function, inclusive |",
           "| --- | ---: | ---: |"]
    out += [f"| `{frame}` | {s:.2f} | {i:.1f} |" for frame, s, i in rows]
    return "\n".join(out)


def table(a: dict[str, float], b: dict[str, float] | None = None,
          names: tuple[str, str] = ("skymesh-lb", "floor")) -> str:
    b = b or {}
    rows = [f"| stage | {names[0]}, us per request | {names[1]} |", "| --- | ---: | ---: |"]
    for k in sorted(set(a) | set(b), key=lambda k: (-a.get(k, 0.0), k)):
        if k not in LEFT and max(a.get(k, 0.0), b.get(k, 0.0)) >= 0.1:
            rows.append(f"| {k} | {a.get(k, 0.0):.1f} | {b.get(k, 0.0):.1f} |")

    def total(d: dict[str, float]) -> float:
        return sum(v for k, v in d.items() if k not in LEFT)

    rows.append(f"| total | {total(a):.1f} | {total(b):.1f} |")
    for k in LEFT:
        if k in a or k in b:
            rows.append(f"| ({k}) | {a.get(k, 0.0):.1f} | {b.get(k, 0.0):.1f} |")
    return "\n".join(rows)


# -- the live run -------------------------------------------------------------------
def _serving_pid(d: Daemon) -> int:
    """The process that serves: the floor forks its one worker; skymesh-lb with
    ``--workers 1`` serves in its own."""
    kids = subprocess.run(["pgrep", "-P", str(d.proc.pid)], capture_output=True,
                          text=True, timeout=10).stdout.split()
    return int(kids[0]) if kids else d.proc.pid


def profile(d: Daemon, out: Path, seconds: int, spy: str, config: str = "rr"
            ) -> dict[str, float]:
    """wrk against ``d`` with py-spy attached: requests, req/s and CPU us per request
    (user and system apart)."""
    pid = _serving_pid(d)
    rec = subprocess.Popen([spy, "record", "-p", str(pid), "-r", str(RATE), "-d",
                            str(seconds), "-f", "raw", "--threads", "-o", str(out),
                            "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.7)  # py-spy attached before the load starts
    before = _user_sys(pid)
    wrk = st.parse_wrk(ro.run_wrk(d.url, rpc.case(config), seconds - 2))
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


FLOOR_NAMES = {"lean": "lean-stack-floor", "stack": "lb-stack-floor"}


def run(seconds: int, out: Path, config: str = "rr", floor_kind: str = "lean",
        lines: int = 0) -> str:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("py-spy is needed: .venv/bin/pip install py-spy")
    out.mkdir(parents=True, exist_ok=True)
    floor_name = FLOOR_NAMES[floor_kind]
    with tempfile.TemporaryDirectory(prefix="rr-profile-") as tmp, \
            contextlib.ExitStack() as exits:
        work = Path(tmp)
        binary = ro.build_stub(work)
        stubs = [exits.enter_context(rpc._stopping(ro.start_stub(binary, ro.STREAM_EVENTS,
                                                                  work, i))).url
                 for i in range(2)]
        lb = exits.enter_context(rpc._stopping(rpc.start_lb(stubs, config, None)))
        floor, _ = ro.start_floor(floor_name, 1, config, stubs, work)
        exits.enter_context(rpc._stopping(floor))
        figures: dict[str, dict[str, float]] = {}
        splits: dict[str, dict[str, float]] = {}
        top: dict[str, list[tuple[str, float, float]]] = {}
        for name, d in (("skymesh-lb", lb), (floor_name, floor)):
            ro.wait_ready(d)
            ro.run_wrk(d.url, rpc.case(config), 2.0)  # warm: connections, lazy imports
            path = out / f"{name}.txt"
            figures[name] = profile(d, path, seconds, spy, config)
            with path.open() as f:
                splits[name] = split(f, figures[name]["requests"])
            if lines:
                with path.open() as f:
                    top[name] = by_line(f, figures[name]["requests"], top=lines)
    head = [f"{name}: {f['rps']:,.0f} req/s, {f['requests']:,.0f} requests, CPU "
            f"{f['user_us']:.1f} us user + {f['sys_us']:.1f} us system per request"
            for name, f in figures.items()]
    load = os.getloadavg()[0]
    parts = [*head, f"config {config}; load average {load:.1f}; profiles in {out}", "",
             table(splits["skymesh-lb"], splits[floor_name], ("skymesh-lb", floor_name))]
    for name, rows in top.items():
        parts += ["", f"{name}, by line:", "", line_table(rows)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.rr_profile",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="start the stack and profile it")
    ap.add_argument("--seconds", type=int, default=14)
    ap.add_argument("--config", choices=("rr", "default"), default="rr",
                    help="rr: round-robin + bp, fixed bodies; default: the default policy, "
                         "shared-prefix bodies")
    ap.add_argument("--floor", choices=sorted(FLOOR_NAMES), default="lean",
                    help="the floor profiled beside skymesh-lb (proxy_floor --kind)")
    ap.add_argument("--lines", type=int, default=0, metavar="N",
                    help="also the N frames with the most self time, per profile")
    ap.add_argument("--out", default="rr-profile", metavar="DIR")
    ap.add_argument("--profile", metavar="RAW", help="a py-spy raw profile to split")
    ap.add_argument("--requests", type=float, help="requests served during --profile")
    ap.add_argument("--against", metavar="RAW", help="a second profile, for a column")
    ap.add_argument("--against-requests", type=float)
    args = ap.parse_args(argv)
    if args.run:
        print(run(args.seconds, Path(args.out), args.config, args.floor, args.lines))
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
    if args.lines:
        for path, n in ((args.profile, args.requests), (args.against, args.against_requests)):
            if path and n:
                with open(path) as f:
                    print(f"\n{path}, by line:\n\n{line_table(by_line(f, n, top=args.lines))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
