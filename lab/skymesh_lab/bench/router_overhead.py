"""``skymesh bench router-overhead``: skymesh-lb beside sglang-router and vllm-router.

What is measured
    Each router runs in front of the same two stub backends (``stub/stub.c``, compiled
    with gcc at run time: C, epoll, a ready-made answer in microseconds), and wrk
    (``stub/post.lua`` builds the POST bodies) drives it closed-loop. Cases:

    * ``rr-c64``: non-streaming, 64 connections, every router at round-robin
      (skymesh-lb ``--policy round-robin --push-mode bp``, the others ``round_robin``);
    * ``default-c64``: non-streaming, 64 connections, each router's default (cache-aware)
      configuration (skymesh-lb with no policy flags), bodies with 16 shared 2 KB
      prefixes and a question of their own, so the prefix structures grow and match;
    * ``stream-c64``: streaming, K server-sent events per answer (64), 64 connections;
    * ``stream-c1``: the same streamed request on one connection: the added latency
      (router p50/p99 minus the direct path's in the same round);
    * ``tail-c256``: non-streaming, 256 connections: p99 against p50.

    ``direct`` is wrk straight at one stub with the same case: the generator's ceiling,
    measured in every round beside the routers, so a reader sees how far above the
    routers the client was.

    The floors (``skymesh_lab.bench.proxy_floor``) run the two non-streaming c=64 cases in
    the same rounds: reverse proxies with no logic at all on skymesh-lb's stack (uvloop,
    as many worker processes as skymesh-lb's default, ``SO_REUSEPORT``):
    ``aiohttp-floor`` (aiohttp's server and ``ClientSession``), ``lb-stack-floor``
    (aiohttp's server and skymesh-lb's own httptools client) and ``asyncio-floor``
    (asyncio protocols and httptools, no aiohttp). They bound what skymesh-lb could reach
    on this stack and machine, and split its CPU into the HTTP stack's and its own.

How
    Every round runs every (router, case) once in a freshly shuffled order (the machine
    drifts: other tenants, thermal state), ``--duration`` seconds each; figures are the
    medians over the rounds with their min-max spread. Router CPU comes from
    /proc/PID/stat (utime + stime of the router and its children) around each segment,
    per 1,000 completed requests: the figure to compare on a shared machine. RSS of each
    router is read after warm-up and at the end; ``--requests N`` adds a long run (every
    router, cases in turn, until N requests each) with RSS after every segment. The
    machine's busy share over each segment and the part of it used by processes outside
    the benchmark are recorded. The stubs model a prefix cache (``STUB_PREFIX_CACHE``
    most recently used prefixes each, fewer than the ``PREFIX_GROUPS`` of the default
    case: a prefix stays cached only on a stub it keeps going to); their /metrics
    counters around each default segment give every router's prefix hit rate.

    skymesh bench router-overhead --rounds 3 --duration 5 --json out/router-overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import random
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skymesh.util.jsonio import write_json
from skymesh.util.procs import Daemon, executable, free_port, start_daemon
from skymesh_lab.bench import proxy_floor
from skymesh_lab.bench import router_overhead_stats as st
from skymesh_lab.bench.venvs import ensure_package

MODES = ("live",)
STUB_DIR = Path(__file__).with_name("stub")
SKYMESH = "skymesh-lb"
PEERS: dict[str, dict[str, str]] = {
    "sglang-router": {"package": "sglang-router", "version": "0.3.2",
                      "module": "sglang_router.launch_router", "import": "sglang_router",
                      "venv": "/tmp/skymesh-bench-sglr", "log_level": "warn"},
    "vllm-router": {"package": "vllm-router", "version": "0.1.17",
                    "module": "vllm_router.launch_router", "import": "vllm_router",
                    "venv": "/tmp/skymesh-bench-vllmr", "log_level": "warning"},
}
FLOORS = st.FLOORS
FLOOR_CASES = ("rr-c64", "default-c64")
ROUTERS = (SKYMESH, *PEERS, *FLOORS)
CONFIG_FLAGS: dict[str, dict[str, list[str]]] = {
    SKYMESH: {"rr": ["--policy", "round-robin", "--push-mode", "bp"], "default": []},
    "sglang-router": {"rr": ["--policy", "round_robin"], "default": []},
    "vllm-router": {"rr": ["--policy", "round_robin"], "default": []},
}
STREAM_EVENTS = 64
PREFIX_GROUPS = 16
# Prefixes each stub keeps (LRU): the groups fit only if each stays on one stub (a split
# up to 12:4 still fits, so a router is not marked down for an uneven one); round-robin,
# each stub sees every group and hits about 2/3 of the time (measured: 64-68%).
STUB_PREFIX_CACHE = PREFIX_GROUPS * 3 // 4
READY_TIMEOUT_S = 90.0
SETTLE_S = 0.3  # between segments: the previous one's connections close


@dataclass(frozen=True)
class Case:
    name: str
    config: str  # "rr" or "default"
    connections: int
    stream: bool
    body: str  # "fixed" or "prefix" (post.lua's modes)

    @property
    def threads(self) -> int:
        return 1 if self.connections < 2 else 2  # the machine's cores


CASES = (
    Case("rr-c64", "rr", 64, False, "fixed"),
    Case("default-c64", "default", 64, False, "prefix"),
    Case("stream-c64", "rr", 64, True, "fixed"),
    Case("stream-c1", "rr", 1, True, "fixed"),
    Case("tail-c256", "rr", 256, False, "fixed"),
)


@dataclass
class Options:
    rounds: int = 3
    duration_s: float = 5.0
    routers: tuple[str, ...] = ROUTERS
    cases: tuple[str, ...] = tuple(c.name for c in CASES)
    seed: int = 0
    skymesh_args: list[str] = field(default_factory=list)
    skymesh_workers: int | None = None
    long_requests: int = 0
    keep_logs: bool = False


@dataclass
class Instance:
    """One router process in one configuration."""

    router: str
    config: str
    daemon: Daemon
    flags: list[str]


# -- processes -------------------------------------------------------------------------
def build_stub(workdir: Path) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("gcc is needed to build the stub backend (apt-get install gcc)")
    out = workdir / "stub"
    subprocess.run([gcc, "-O2", "-o", str(out), str(STUB_DIR / "stub.c")], check=True,
                   capture_output=True, timeout=120)
    return out


def start_stub(binary: Path, events: int, workdir: Path, idx: int) -> Daemon:
    """A stub on a free port; its Daemon once it printed "ready PORT"."""
    log_path = workdir / f"stub{idx}.log"
    out = workdir / f"stub{idx}.port"
    with out.open("wb") as o, log_path.open("wb") as log:
        proc = subprocess.Popen([str(binary), "0", str(events), str(STUB_PREFIX_CACHE)],
                                stdout=o, stderr=log)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = out.read_text()
        if text.startswith("ready ") and text.endswith("\n"):
            return Daemon(f"stub{idx}", proc, f"http://127.0.0.1:{int(text.split()[1])}",
                          log_path)
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.kill()
    raise RuntimeError(f"stub did not start: {log_path.read_text()[-500:]}")


def skymesh_help() -> str:
    r = subprocess.run([*executable(SKYMESH), "--help"], capture_output=True, text=True,
                       timeout=60)
    return r.stdout + r.stderr


def skymesh_flags(config: str, opts: Options, help_text: str) -> list[str]:
    """skymesh-lb's flags for ``config``, the run's extra flags, and ``--workers N`` when
    asked for and this skymesh-lb has that flag (a later change adds worker processes)."""
    flags = [*CONFIG_FLAGS[SKYMESH][config], *opts.skymesh_args]
    if opts.skymesh_workers is not None:
        if "--workers" not in help_text:
            raise RuntimeError("--skymesh-workers: this skymesh-lb has no --workers flag")
        flags += ["--workers", str(opts.skymesh_workers)]
    return flags


def start_peer(name: str, py: Path, config: str, stubs: Sequence[str], workdir: Path
               ) -> Daemon:
    port = free_port()
    log_path = workdir / f"{name}-{config}.log"
    # Own Prometheus port: the default is shared by both routers and would clash.
    cmd = [str(py), "-m", PEERS[name]["module"], "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *stubs, *CONFIG_FLAGS[name][config],
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--log-level", PEERS[name]["log_level"]]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return Daemon(name, proc, f"http://127.0.0.1:{port}", log_path)


def floor_workers(opts: Options) -> int:
    """The floors' worker count: skymesh-lb's in this run (its default unless asked)."""
    return (opts.skymesh_workers if opts.skymesh_workers is not None
            else proxy_floor.default_workers())


def start_floor(name: str, workers: int, config: str, stubs: Sequence[str], workdir: Path
                ) -> tuple[Daemon, list[str]]:
    """A floor proxy (``proxy_floor``), its Daemon once it printed its URL, and its flags."""
    flags = ["--kind", FLOORS[name], "--workers", str(workers)]
    log_path = workdir / f"{name}-{config}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "skymesh_lab.bench.proxy_floor",
                                 *flags, "--upstreams", ",".join(stubs)],
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        text = log_path.read_text(errors="replace")
        if "listening on " in text:
            url = text.split("listening on ", 1)[1].split()[0]
            return Daemon(name, proc, url, log_path), flags
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    raise RuntimeError(f"{name} did not start: {log_path.read_text()[-2000:]}")


def http_request(url: str, method: str, path: str, body: bytes | None = None,
          timeout: float = 5.0) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def wait_ready(d: Daemon) -> None:
    """Until a chat completion through ``d`` answers 200 (a router may open its port
    before its workers are registered)."""
    body = b'{"model":"stub","messages":[{"role":"user","content":"hi"}]}'
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        if not d.alive():
            break
        try:
            status, text = http_request(d.url, "POST", "/v1/chat/completions", body)
            if status == 200:
                return
            last = f"HTTP {status}: {text[:200]!r}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{d.name} at {d.url} never answered ({last}):\n{d.log()[-2000:]}")


# -- /proc -----------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_snapshot() -> list[st.ProcStat]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError), \
                open(f"/proc/{name}/stat") as f:
            out.append(st.parse_stat(f.read()))
    return out


def machine_cpu() -> list[int]:
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:]]


def rss_mb(pid: int) -> float:
    return st.tree_rss_bytes(st.tree(proc_snapshot(), pid), _PAGE) / 2**20


def prefix_metrics(stubs: Sequence[str]) -> dict[str, float]:
    """The stubs' prefix-cache counters, summed over the stubs."""
    out: dict[str, float] = {}
    for url in stubs:
        with contextlib.suppress(OSError):
            status, text = http_request(url, "GET", "/metrics")
            if status == 200:
                for k, v in st.prefix_samples(text.decode(errors="replace")).items():
                    out[k] = out.get(k, 0.0) + v
    return out


# -- segments --------------------------------------------------------------------------
def run_wrk(url: str, case: Case, duration_s: float) -> str:
    cmd = ["wrk", "-t", str(case.threads), "-c", str(case.connections),
           "-d", f"{duration_s:g}s", "--timeout", "10s", "-s", str(STUB_DIR / "post.lua"),
           url + "/v1/chat/completions", "--", case.body, "1" if case.stream else "0",
           str(PREFIX_GROUPS)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60)
    if r.returncode != 0:
        raise RuntimeError(f"wrk failed ({r.returncode}): {r.stderr[-500:]}")
    return r.stdout


def segment(target: str, inst: Instance | None, url: str, case: Case, rnd: int,
            duration_s: float, ours: Sequence[int], stubs: Sequence[str]
            ) -> dict[str, Any]:
    """One wrk run at ``url``, with the router's CPU and the machine's load around it, and
    the stubs' prefix hits in the default case."""
    pid = inst.daemon.proc.pid if inst else None
    before_p = proc_snapshot()
    before_m = machine_cpu()
    before_wrk = resource.getrusage(resource.RUSAGE_CHILDREN)
    before_x = prefix_metrics(stubs) if inst and case.config == "default" else {}
    t0 = time.monotonic()
    out = run_wrk(url, case, duration_s)
    wall = time.monotonic() - t0
    after_x = prefix_metrics(stubs) if inst and case.config == "default" else {}
    after_wrk = resource.getrusage(resource.RUSAGE_CHILDREN)
    after_m = machine_cpu()
    after_p = proc_snapshot()
    res: dict[str, Any] = {"router": target, "case": case.name, "round": rnd,
                           **st.parse_wrk(out)}
    if pid is not None:
        a, b = (st.tree_cpu_ticks(st.tree(s, pid)) for s in (before_p, after_p))
        res["cpu_ms"] = (b - a) / _TICK * 1e3
        res["cpu_ms_per_1k"] = st.cpu_ms_per_1k(a, b, res["requests"], _TICK)
    busy = st.machine_busy(before_m, after_m)
    cores = os.cpu_count() or 1
    ours_s = sum(st.tree_cpu_ticks(st.tree(after_p, p)) - st.tree_cpu_ticks(st.tree(before_p, p))
                 for p in ours) / _TICK
    ours_s += (after_wrk.ru_utime + after_wrk.ru_stime
               - before_wrk.ru_utime - before_wrk.ru_stime)
    res["machine_busy"] = busy
    # Cores' worth of CPU used by everything outside the benchmark during the segment.
    res["foreign_cores"] = max(0.0, busy * cores - ours_s / wall) if wall > 0 else 0.0
    if after_x:
        res["prefix_samples"] = after_x
        rate = st.prefix_hit_rate(before_x, after_x)
        if rate is not None:
            res["prefix_hit_rate"] = rate
    return res


def _fmt(s: dict[str, Any]) -> str:
    cpu = f" cpu {s['cpu_ms_per_1k']:.0f} ms/1k" if "cpu_ms_per_1k" in s else ""
    return (f"r{s['round']} {s['router']:<14} {s['case']:<12} {s['rps']:>9.0f} req/s "
            f"p50 {s.get('p50_ms', 0):.2f} p99 {s.get('p99_ms', 0):.2f} ms{cpu} "
            f"err {s['errors']:.0f}/{s['non_2xx']:.0f} busy {s['machine_busy']:.0%} "
            f"foreign {s['foreign_cores']:.2f}")


@contextlib.contextmanager
def _stack(opts: Options, workdir: Path, notes: dict[str, str]
           ) -> Iterator[tuple[list[Daemon], dict[tuple[str, str], Instance]]]:
    with contextlib.ExitStack() as exits:
        binary = build_stub(workdir)
        stubs = []
        for i in range(2):
            d = start_stub(binary, STREAM_EVENTS, workdir, i)
            exits.callback(d.stop)
            stubs.append(d)
        urls = [d.url for d in stubs]
        configs = sorted({c.config for c in CASES if c.name in opts.cases})
        insts: dict[tuple[str, str], Instance] = {}
        help_text = skymesh_help() if SKYMESH in opts.routers else ""
        notes["skymesh_workers_flag"] = str("--workers" in help_text)
        floor_configs = sorted({c.config for c in CASES
                                if c.name in opts.cases and c.name in FLOOR_CASES})
        for router in opts.routers:
            py: Path | None = None
            if router in FLOORS:
                for config in floor_configs:
                    d, flags = start_floor(router, floor_workers(opts), config, urls, workdir)
                    exits.callback(d.stop)
                    insts[(router, config)] = Instance(router, config, d, flags)
                continue
            if router != SKYMESH:
                spec = PEERS[router]
                py, why = ensure_package(Path(spec["venv"]), spec["package"], spec["version"],
                                         spec["import"])
                notes[router] = why
                if py is None:
                    print(f"skipping {router}: {why}", file=sys.stderr)
                    continue
            for config in configs:
                if router == SKYMESH:
                    flags = skymesh_flags(config, opts, help_text)
                    d = start_daemon(SKYMESH, ["--port", "0", "--replicas", ",".join(urls),
                                               *flags], timeout=READY_TIMEOUT_S)
                else:
                    assert py is not None
                    flags = CONFIG_FLAGS[router][config]
                    d = start_peer(router, py, config, urls, workdir)
                exits.callback(d.stop)
                insts[(router, config)] = Instance(router, config, d, flags)
        for key, inst in list(insts.items()):
            try:
                wait_ready(inst.daemon)
            except RuntimeError as exc:
                if inst.router == SKYMESH:  # what the benchmark is for: no run without it
                    raise
                # A PyPI router that will not serve is left out, as one that will not
                # install is: the run still measures the others.
                notes[f"{inst.router}/{inst.config}"] = f"left out: {exc}"[:500]
                print(f"leaving out {inst.router}/{inst.config}: {exc}", file=sys.stderr)
                inst.daemon.stop()
                del insts[key]
        yield stubs, insts


def run(opts: Options) -> dict[str, Any]:
    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is needed (apt-get install wrk, or make system-deps)")
    cases = [c for c in CASES if c.name in opts.cases]
    notes: dict[str, str] = {}
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    rng = random.Random(opts.seed)
    segments: list[dict[str, Any]] = []
    rss: dict[str, dict[str, float]] = {}
    long_run: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp, \
            _stack(opts, Path(tmp), notes) as (stubs, insts):
        ours = [d.proc.pid for d in stubs] + [i.daemon.proc.pid for i in insts.values()]
        routers = sorted({r for r, _ in insts})
        print(f"stubs {[d.url for d in stubs]}; routers {routers}", flush=True)
        for inst in insts.values():  # warm-up: connections, caches, lazy imports
            run_wrk(inst.daemon.url, Case("warmup", inst.config, 64, False, "prefix"), 1.0)
        for (r, c), inst in insts.items():
            rss[f"{r}/{c}"] = {"before_mb": rss_mb(inst.daemon.proc.pid)}
        for rnd in range(opts.rounds):
            plan = [(r, c) for c in cases for r in (st.DIRECT, *routers)
                    if r == st.DIRECT or ((r, c.config) in insts
                                          and (r not in FLOORS or c.name in FLOOR_CASES))]
            rng.shuffle(plan)
            for target, case in plan:
                chosen = insts.get((target, case.config))
                url = chosen.daemon.url if chosen else stubs[0].url
                s = segment(target, chosen, url, case, rnd, opts.duration_s, ours,
                            [d.url for d in stubs])
                segments.append(s)
                print(_fmt(s), flush=True)
                time.sleep(SETTLE_S)
        for (r, c), inst in insts.items():
            rss[f"{r}/{c}"]["after_mb"] = rss_mb(inst.daemon.proc.pid)
            rss[f"{r}/{c}"]["requests"] = sum(
                s["requests"] for s in segments
                if s["router"] == r and _case(s["case"]).config == c)
        if opts.long_requests:
            try:
                _long_run(insts, opts, long_run)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                notes["long_run"] = f"stopped early: {exc}"[:500]
        for inst in insts.values():
            if not inst.daemon.alive():
                notes[f"{inst.router}/{inst.config}"] = "exited during the run"
    return {
        "setup": {"command": command_line(opts), "rounds": opts.rounds,
                  "duration_s": opts.duration_s, "cases": [asdict(c) for c in cases],
                  "stream_events": STREAM_EVENTS, "prefix_groups": PREFIX_GROUPS,
                  "stub_prefix_cache": STUB_PREFIX_CACHE, "floor_cases": list(FLOOR_CASES),
                  "floor_workers": floor_workers(opts),
                  "floor_cpus": proxy_floor.floor_cpus(floor_workers(opts)),
                  "routers": {r: {c: i.flags for (rr, c), i in insts.items() if rr == r}
                              for r in routers},
                  "versions": {r: PEERS[r]["version"] for r in routers if r in PEERS},
                  "skymesh_args": opts.skymesh_args, "skymesh_workers": opts.skymesh_workers,
                  "cores": os.cpu_count(), "wrk": _wrk_version(),
                  "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
                  "started": started,
                  "finished": datetime.now(UTC).isoformat(timespec="seconds"),
                  "notes": notes},
        "segments": segments, "rss": rss, "long_run": long_run,
    }


def _case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


def _long_run(insts: dict[tuple[str, str], Instance], opts: Options,
              out: dict[str, list[dict[str, float]]]) -> None:
    """Every router (default configuration: what users run) through non-streaming,
    prefix and streaming segments in turn until ``long_requests``; RSS after each, into
    ``out`` as it goes (a failure keeps what was measured)."""
    mix = [Case("long-fixed", "default", 64, False, "fixed"),
           Case("long-prefix", "default", 64, False, "prefix"),
           Case("long-stream", "default", 64, True, "fixed")]
    for (router, config), inst in insts.items():
        if config != "default" or router in FLOORS:  # the floors bound speed, not memory
            continue
        done, i = 0.0, 0
        trace = out[router] = [{"requests": 0.0, "rss_mb": rss_mb(inst.daemon.proc.pid)}]
        while done < opts.long_requests and inst.daemon.alive():
            res = st.parse_wrk(run_wrk(inst.daemon.url, mix[i % len(mix)], 10.0))
            done += res["requests"]
            i += 1
            trace.append({"requests": done, "rss_mb": rss_mb(inst.daemon.proc.pid)})
            print(f"long {router}: {done:.0f} requests, RSS {trace[-1]['rss_mb']:.1f} MB",
                  flush=True)


def _wrk_version() -> str:
    r = subprocess.run(["wrk", "-v"], capture_output=True, text=True, timeout=10)
    first = (r.stdout + r.stderr).strip().splitlines()[:1]
    return first[0].split(" Copyright")[0].strip() if first else ""


def command_line(opts: Options) -> str:
    cmd = f"skymesh bench router-overhead --rounds {opts.rounds} --duration {opts.duration_s:g}"
    if tuple(opts.routers) != ROUTERS:
        cmd += f" --routers {','.join(opts.routers)}"
    if tuple(opts.cases) != tuple(c.name for c in CASES):
        cmd += f" --cases {','.join(opts.cases)}"
    if opts.seed:
        cmd += f" --seed {opts.seed}"
    if opts.skymesh_workers is not None:
        cmd += f" --skymesh-workers {opts.skymesh_workers}"
    if opts.skymesh_args:
        cmd += f" --skymesh-args {shlex.quote(shlex.join(opts.skymesh_args))}"
    if opts.long_requests:
        cmd += f" --requests {opts.long_requests}"
    return cmd


def print_summary(res: dict[str, Any]) -> None:
    summary = st.summarize(res["segments"])
    for router, cases in sorted(summary.items()):
        for case, row in cases.items():
            parts = [f"{router:<14} {case:<12}"]
            for m in ("rps", "p50_ms", "p99_ms", "cpu_ms_per_1k", "added_p50_ms",
                      "added_p99_ms"):
                if m in row:
                    parts.append(f"{m} {row[m]['median']:.2f} [{row[m]['min']:.2f}, "
                                 f"{row[m]['max']:.2f}]")
            print("  ".join(parts))
    for r, v in res["rss"].items():
        print(f"RSS {r}: {v.get('before_mb', 0):.1f} -> {v.get('after_mb', 0):.1f} MB")


# -- entry points ----------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=None,
                    help="router-overhead: interleaved rounds (default 3)")
    ap.add_argument("--routers", default=None, metavar="NAMES",
                    help=f"router-overhead: among {','.join(ROUTERS)} (default all)")
    ap.add_argument("--cases", default=None, metavar="NAMES",
                    help=f"router-overhead: among {','.join(c.name for c in CASES)}")
    ap.add_argument("--skymesh-workers", type=int, default=None, metavar="N",
                    help="router-overhead: run skymesh-lb with --workers N (if it has it)")
    ap.add_argument("--skymesh-args", default="", metavar="FLAGS",
                    help="router-overhead: extra skymesh-lb flags, e.g. '--config lb.yaml'")
    ap.add_argument("--requests", type=int, default=0, metavar="N",
                    help="router-overhead: a long run of N requests per router, RSS traced")


def options_from_args(args: argparse.Namespace) -> Options:
    opts = Options(seed=getattr(args, "seed", 0) or 0)
    if getattr(args, "rounds", None):
        opts.rounds = args.rounds
    if getattr(args, "duration", None):
        opts.duration_s = args.duration
    if getattr(args, "quick", False):
        opts.rounds, opts.duration_s = 1, 2.0
    if getattr(args, "routers", None):
        opts.routers = tuple(args.routers.split(","))
    if getattr(args, "cases", None):
        opts.cases = tuple(args.cases.split(","))
    unknown = [r for r in opts.routers if r not in ROUTERS] + \
        [c for c in opts.cases if c not in {c.name for c in CASES}]
    if unknown:
        raise SystemExit(f"router-overhead: unknown router or case: {', '.join(unknown)}")
    opts.skymesh_workers = getattr(args, "skymesh_workers", None)
    opts.skymesh_args = shlex.split(getattr(args, "skymesh_args", "") or "")
    opts.long_requests = getattr(args, "requests", 0) or 0
    return opts


def run_experiment(args: argparse.Namespace) -> dict[str, Any]:
    """``skymesh bench router-overhead`` entry point."""
    res = run(options_from_args(args))
    print_summary(res)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.router_overhead",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None, metavar="PATH")
    add_arguments(ap)
    args = ap.parse_args(argv)
    res = run_experiment(args)
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
