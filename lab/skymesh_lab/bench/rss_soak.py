"""RSS of skymesh-lb over many requests of mixed scenarios (docs/notes/memory-1m.md).

Starts two stub replicas (a raw asyncio protocol answering in microseconds, so the
balancer is what runs out of CPU) and ``skymesh-lb`` in front of them, then drives
``--requests`` requests from ``--concurrency`` clients, cycling through scenarios:
non-streamed and streamed replies (with and without ``include_usage``), clients that
leave mid-stream or right after sending, bad JSON bodies (400), unknown models (404),
replica errors (500, retried then 502) and prompts that never repeat (the prefix state's
growth). The balancer's RSS is sampled every ``--sample-every`` requests from
``/proc/PID/status``, its CPU time from ``/proc/PID/stat``, both summed over the
supervisor and its workers (``listen.workers``, default ``auto``: one per core). The
balancer runs with its default configuration unless ``--policy``/``--workers`` say.

    python -m skymesh_lab.bench.rss_soak --requests 1000000 --json out.json

The JSON: ``{"requests", "scenarios", "samples": [{"requests", "rss_mb", "cpu_s",
"procs", "t_s", "outcomes"}], "rss_start_mb", "rss_warm_mb", "rss_end_mb", "cpu_ms_per_1000",
"lb_outcomes", "http_server", "log_errors", ...}``; ``lb_outcomes`` is the balancer's own
count at the end (``skymesh_requests_total`` by outcome, all workers), each sample's
``lb_left`` its counts of clients that left so far (:func:`clients_left`),
``http_server`` the HTTP server the balancer ran (``--http-server``, else the product's
default) and ``log_errors`` what its log holds at
ERROR level: clients that leave are the mix's, and must cost no ERROR line or traceback.

With ``--probe``, every process of the balancer dumps what it holds
(:mod:`skymesh_lab.bench.rss_soak_probe`: container lengths, object counts, tracemalloc
by line with ``--probe-tracemalloc``) after the requests ``--probe-at`` names and at the
end, into ``"probes"``; such a run's RSS is not the balancer's own (the probe's walk and
tracemalloc take memory), so the page's RSS comes from a run without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.net.serving import DEFAULT_HTTP_SERVER, HTTP_SERVERS
from skymesh.util.procs import start_daemon
from skymesh_lab.bench import rss_soak_probe as probe

MODEL = "m"
_METRICS = (b"vllm:num_requests_waiting{model_name=\"m\"} 0\n"
            b"vllm:num_requests_running{model_name=\"m\"} 0\n")
_MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
_USAGE = {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}
_REPLY = json.dumps({"id": "x", "object": "chat.completion", "model": MODEL,
                     "choices": [{"index": 0, "message": {"role": "assistant",
                                                          "content": "hello there"},
                                  "finish_reason": "stop"}],
                     "usage": _USAGE}).encode()


def _sse(events: int, usage: bool) -> bytes:
    out = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n']
    out += [b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'] * events
    if usage:
        out.append(b"data: " + json.dumps({"choices": [], "usage": _USAGE}).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def _response(status: int, ctype: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
            % (status, ctype, len(body))) + body


# --leave-hold-ms: the stub holds the rest of a stream the client leaves after its first
# event (leave_mid_stream), so the client is gone while the balancer still relays it;
# answered at once (the default, the mix of the runs before), the whole stream is in the
# client's socket before it has read the first event.
_LEAVER = b"leave-mid-stream"


class StubReplica(asyncio.Protocol):
    """Just enough HTTP/1.1 (keep-alive, Content-Length bodies) for the balancer."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.hold_s = hold_s
        self.holding = False  # the rest of a held stream is still to come

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.answer_queued()

    def answer_queued(self) -> None:
        while not self.holding:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            length = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0
                              else None]) if i >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            assert self.transport is not None
            reply = self.answer(head.split(b" ", 2)[1], body)
            if self.hold_s > 0 and _LEAVER in body and b'"stream": true' in body:
                cut = reply.index(b"\n\n", reply.index(b"\r\n\r\n") + 4) + 2
                self.transport.write(reply[:cut])  # the headers and the first event
                self.holding = True
                asyncio.get_running_loop().call_later(self.hold_s, self.release,
                                                      reply[cut:])
                return
            self.transport.write(reply)

    def release(self, rest: bytes) -> None:
        self.holding = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(rest)
            self.answer_queued()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    @staticmethod
    def answer(path: bytes, body: bytes) -> bytes:
        if path == b"/metrics":
            return _response(200, b"text/plain", _METRICS)
        if path == b"/v1/models":
            return _response(200, b"application/json", _MODELS)
        if b"replica-error" in body:
            return _response(500, b"application/json", b'{"error": "boom"}')
        if b'"stream": true' in body:
            return _response(200, b"text/event-stream",
                             _sse(16, b"include_usage" in body))
        return _response(200, b"application/json", _REPLY)


async def serve_stub(hold_s: float = 0.0) -> tuple[asyncio.base_events.Server, str]:
    server = await asyncio.get_running_loop().create_server(
        lambda: StubReplica(hold_s), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (a scan of /proc: /proc/PID/task/*/children needs a
    kernel option not every kernel has)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone since the listing
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry.name))
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants: the supervisor and every worker with
    ``listen.workers`` above 1, the one process otherwise."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(_children(p))
    return tree


def read_one(pid: int, *, reaped: bool = False) -> tuple[float, float]:
    """(RSS in MB, user+system CPU seconds) of ``pid``; with ``reaped``, plus the CPU of
    its children that ended and were waited for (a worker the supervisor restarted)."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11:15 if reaped else 13])
    return rss_kb / 1024, ticks / os.sysconf("SC_CLK_TCK")


def read_proc(pid: int) -> tuple[float, float, int]:
    """(RSS in MB, CPU seconds, processes) of the balancer: ``pid`` and its workers
    summed. RSS counts pages shared after the fork once per process (the figure ``ps``
    and the kernel's OOM accounting of each process give)."""
    rss = cpu = 0.0
    procs = 0
    for p in process_tree(pid):
        try:
            r, c = read_one(p, reaped=p == pid)
        except (OSError, IndexError):  # ended between the scan and the read
            continue
        rss, cpu, procs = rss + r, cpu + c, procs + 1
    return rss, cpu, procs


_OUTCOME = re.compile(r'^skymesh_requests_total\{[^}]*outcome="([^"]+)"[^}]*\} (\S+)$', re.M)


def balancer_outcomes(metrics_text: str) -> dict[str, int]:
    """``skymesh_requests_total`` by outcome, summed over models and workers."""
    out: dict[str, int] = {}
    for outcome, value in _OUTCOME.findall(metrics_text):
        out[outcome] = out.get(outcome, 0) + int(float(value))
    return dict(sorted(out.items()))


_LEFT = re.compile(r'^skymesh_client_disconnects_total\{[^}]*phase="([^"]+)"[^}]*\} (\S+)$',
                   re.M)


def client_disconnects(metrics_text: str) -> dict[str, int]:
    """``skymesh_client_disconnects_total`` by phase, summed over workers."""
    out: dict[str, int] = {}
    for phase, value in _LEFT.findall(metrics_text):
        out[phase] = out.get(phase, 0) + int(float(value))
    return dict(sorted(out.items()))


def clients_left(metrics_text: str) -> dict[str, int]:
    """The balancer's counts of clients that left, so far: requests that ended
    ``cancelled`` (gone while queued) or ``client_disconnected`` (gone while a replica
    held the request or mid-stream: the handler is cancelled) in
    ``skymesh_requests_total``, and ``skymesh_client_disconnects_total`` by phase as
    ``write_<phase>`` (a write to a client already gone failed)."""
    outcomes = balancer_outcomes(metrics_text)
    out = {k: outcomes.get(k, 0) for k in ("cancelled", "client_disconnected")}
    out.update({f"write_{k}": v for k, v in client_disconnects(metrics_text).items()})
    return out


async def read_metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


async def read_outcomes(url: str) -> dict[str, int]:
    return balancer_outcomes(await read_metrics(url))


_TRACEBACK = "Traceback (most recent call last)"


def log_errors(lines: Iterable[str], keep: int = 3) -> dict[str, Any]:
    """What a balancer's text log holds at ERROR level or above (``TEXT_FORMAT``: time,
    level, logger) and its tracebacks: the counts and the first ``keep`` such lines."""
    errors = tracebacks = 0
    first: list[str] = []
    for line in lines:
        head = line.split(" ", 4)  # date, time, level, logger: message
        is_error = len(head) > 3 and head[2] in ("ERROR", "CRITICAL")
        errors += is_error
        tracebacks += line.startswith(_TRACEBACK)
        if (is_error or line.startswith(_TRACEBACK)) and len(first) < keep:
            first.append(line.rstrip("\n")[:300])
    return {"error_lines": errors, "tracebacks": tracebacks, "first": first}


def scan_log(path: Path) -> dict[str, Any]:
    with path.open(errors="replace") as f:
        return log_errors(f)


class Prober:
    """Asks every process of the balancer for a probe dump (rss_soak_probe) and keeps
    the parts the soak's JSON records."""

    def __init__(self, directory: Path, at: set[int], tracemalloc_frames: int) -> None:
        self.dir, self.at, self.frames = directory, at, tracemalloc_frames
        self.asked: dict[int, int] = {}  # pid -> dumps asked of it
        self.probes: list[dict[str, Any]] = []

    def env(self, site: Path) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(probe.write_site(site)),
                                           os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "PYTHONPATH": path, probe.ENV_DIR: str(self.dir),
                probe.ENV_TRACEMALLOC: str(self.frames)}

    def fields(self) -> dict[str, Any]:
        """What the soak's JSON records of the probes."""
        return {"probes": self.probes, "probe_at": sorted(self.at),
                "probe_tracemalloc": self.frames}

    async def take(self, pid: int, requests: int, timeout: float = 300.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        want: dict[int, Path] = {}
        for p in process_tree(pid):
            try:
                os.kill(p, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            self.asked[p] = self.asked.get(p, 0) + 1
            want[p] = self.dir / f"{p}-{self.asked[p]}.json"
        deadline = time.monotonic() + timeout
        while not all(f.exists() for f in want.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no probe dump from {sorted(want)} in {timeout:.0f} s")
            await asyncio.sleep(0.2)
        procs = []
        for p, f in sorted(want.items()):
            doc = json.loads(f.read_text())
            procs.append({"pid": p, "role": "supervisor" if p == pid and len(want) > 1
                          else "worker", "containers": doc["containers"],
                          "types": doc["types"],
                          "tracemalloc": {k: v[:20] for k, v in doc["tracemalloc"].items()}})
        self.probes.append({"requests": requests, "processes": procs})
        print(f"probe at {requests} requests: {len(procs)} processes", file=sys.stderr,
              flush=True)


SCENARIOS = ("plain", "stream", "stream_usage", "unique_prompt", "leave_mid_stream",
             "leave_at_once", "bad_json", "unknown_model", "replica_error")


def _body(scenario: str, n: int, rng: random.Random) -> dict[str, Any]:
    content = f"say hello {rng.randrange(50)}"
    if scenario == "unique_prompt":
        content = f"a prompt never seen before #{n} " + "x" * rng.randrange(10, 400)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8,
                            "messages": [{"role": "user", "content": content}]}
    if scenario in ("stream", "stream_usage", "leave_mid_stream"):
        body["stream"] = True
    if scenario == "stream_usage":
        body["stream_options"] = {"include_usage": True}
    if scenario == "unknown_model":
        body["model"] = f"no-such-model-{n}"
    if scenario == "replica_error":
        body["messages"][0]["content"] = "replica-error"
    if scenario == "leave_mid_stream":  # the stub may hold its stream's rest
        body["messages"][0]["content"] = f"leave-mid-stream {rng.randrange(50)}"
    return body


async def _one(session: aiohttp.ClientSession, url: str, scenario: str, n: int,
               rng: random.Random) -> str:
    """One request; what the client saw: the status, or ``left`` when it went away."""
    target = url + "/v1/chat/completions"
    if scenario == "bad_json":
        async with session.post(target, data=b'{"model": "m", "messages": [',
                                headers={"Content-Type": "application/json"}) as r:
            await r.read()
        return str(r.status)
    body = _body(scenario, n, rng)
    if scenario == "leave_at_once":
        try:
            async with asyncio.timeout(0.0005):
                async with session.post(target, json=body) as r:
                    await r.read()
        except TimeoutError:
            return "left"
        return str(r.status)
    async with session.post(target, json=body) as r:
        if scenario == "leave_mid_stream":
            await r.content.readany()
            r.close()  # drops the connection with the stream half read
            return "left"
        await r.read()
    return str(r.status)


async def drive(url: str, requests: int, concurrency: int, pid: int,
                sample_every: int, seed: int,
                on_sample: Callable[[list[dict[str, Any]]], None] | None = None,
                prober: Prober | None = None) -> list[dict[str, Any]]:
    """Drive the balancer; ``on_sample`` gets the samples so far after each one (a long
    run keeps its figures if it is stopped)."""
    rng = random.Random(seed)
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    rss, cpu, procs = read_proc(pid)
    samples.append({"requests": 0, "rss_mb": round(rss, 2), "cpu_s": cpu, "procs": procs,
                    "t_s": 0.0})
    done = 0
    next_id = 0
    seen: dict[str, int] = {}
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker() -> None:
            nonlocal done, next_id
            while next_id < requests:
                n = next_id
                next_id += 1
                try:
                    got = await _one(session, url, SCENARIOS[n % len(SCENARIOS)], n, rng)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    got = type(exc).__name__
                seen[got] = seen.get(got, 0) + 1
                done += 1
                if done % sample_every == 0:
                    at = done  # the other clients go on while this one awaits below
                    rss, cpu, procs = read_proc(pid)
                    # what the clients saw since the sample before: a stalled balancer
                    # shows as 503s and a long t_s, not in its RSS
                    sample = {"requests": at, "rss_mb": round(rss, 2), "cpu_s": cpu,
                              "procs": procs, "t_s": round(time.monotonic() - t0, 1),
                              "outcomes": dict(sorted(seen.items()))}
                    seen.clear()
                    # read after the RSS: the metrics page's own memory is not in it
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        sample["lb_left"] = clients_left(await read_metrics(url))
                    samples.append(sample)
                    print(f"{at} requests: RSS {rss:.1f} MB in {procs} processes",
                          file=sys.stderr, flush=True)
                    if on_sample is not None:
                        on_sample(samples)
                    if prober is not None and at in prober.at:
                        await prober.take(pid, at)  # the balancer answers no one meanwhile

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    if args.lb_url:  # a balancer started elsewhere (e.g. under tracemalloc)
        samples = await drive(args.lb_url, args.requests, args.concurrency, args.lb_pid,
                              args.sample_every, args.seed, _checkpoint(args))
        return _result(args, samples, lb_outcomes=await read_outcomes(args.lb_url))
    servers = [await serve_stub(args.leave_hold_ms / 1000) for _ in range(2)]
    urls = ",".join(u for _, u in servers)
    extra = [] if args.access_log else ["--no-access-log"]
    log = Path(args.log) if args.log else None
    if args.http_server:  # listen.http_server has no flag: a config file of one key
        config = Path(tempfile.mkdtemp(prefix="rss-soak-")) / "lb.yaml"
        config.write_text(f"listen:\n  http_server: {args.http_server}\n")
        extra += ["--config", str(config)]
    # no --policy / --workers: the balancer's defaults (prefix-tree + sp-p, one worker
    # per core) unless asked
    if args.policy:
        extra += ["--policy", args.policy]
    if args.workers:
        extra += ["--workers", args.workers]
    prober = None
    if args.probe:
        at = {int(x) for x in args.probe_at.split(",") if x}
        prober = Prober(Path(args.probe), at, args.probe_tracemalloc)
    env = prober.env(Path(args.probe) / "site") if prober is not None else None
    lb = await asyncio.to_thread(start_daemon, "skymesh-lb", [
        "--port", "0", "--replicas", urls, *extra], log_path=log, env=env,
        timeout=30.0 if prober is None else 300.0)  # tracemalloc slows the imports
    try:
        await asyncio.sleep(1.0)  # first probes: the replicas are up
        samples = await drive(lb.url, args.requests, args.concurrency, lb.proc.pid,
                              args.sample_every, args.seed, _checkpoint(args, prober), prober)
        outcomes = await read_outcomes(lb.url)
        if prober is not None and samples[-1]["requests"] not in prober.at:
            await prober.take(lb.proc.pid, samples[-1]["requests"])
        errors = await asyncio.to_thread(scan_log, lb.log_path)  # before stop() deletes it
    finally:
        lb.stop()
        for server, _ in servers:
            server.close()
    out = _result(args, samples, lb_outcomes=outcomes)
    out["log_errors"] = errors
    if prober is not None:
        out.update(prober.fields())
    return out


def _checkpoint(args: argparse.Namespace, prober: Prober | None = None
                ) -> Callable[[list[dict[str, Any]]], None]:
    """Writes the result so far to ``--json`` (``"complete": false``) after each sample,
    with the probes taken so far."""
    def write(samples: list[dict[str, Any]]) -> None:
        if args.json:
            out = _result(args, samples, complete=False)
            if prober is not None:
                out.update(prober.fields())
            _write(Path(args.json), out)

    return write


def _write(path: Path, out: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(path)  # a reader never sees half a file


def _result(args: argparse.Namespace, samples: list[dict[str, Any]],
            complete: bool = True, lb_outcomes: dict[str, int] | None = None
            ) -> dict[str, Any]:
    first, last = samples[0], samples[-1]
    done = int(last["requests"]) or 1
    warm = next((s for s in samples if s["requests"] >= args.warmup), last)
    return {"requests": int(last["requests"]), "requests_asked": args.requests,
            "complete": complete, "concurrency": args.concurrency,
            "policy": args.policy or "default", "workers": args.workers or "default",
            "http_server": (args.http_server or DEFAULT_HTTP_SERVER) if not args.lb_url
            else "unknown",
            "processes": last.get("procs", 1), "access_log": args.access_log,
            "leave_hold_ms": args.leave_hold_ms,
            "nice": os.nice(0), "loadavg_now": [round(x, 2) for x in os.getloadavg()],
            "scenarios": list(SCENARIOS), "samples": samples, "warmup": args.warmup,
            "rss_start_mb": first["rss_mb"], "rss_warm_mb": warm["rss_mb"],
            "rss_end_mb": last["rss_mb"],
            "rss_max_mb": max(s["rss_mb"] for s in samples),
            "cpu_ms_per_1000": round((last["cpu_s"] - first["cpu_s"]) * 1e6 / done,
                                     1),
            **({"lb_outcomes": lb_outcomes} if lb_outcomes is not None else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rss_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--sample-every", type=int, default=10_000)
    p.add_argument("--policy", help="default: the balancer's (prefix-tree)")
    p.add_argument("--workers", help="listen.workers (default: the balancer's, auto)")
    p.add_argument("--warmup", type=int, default=20_000,
                   help="requests after which the RSS counts as warmed up")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-access-log", dest="access_log", action="store_false")
    p.add_argument("--leave-hold-ms", type=float, default=0.0,
                   help="the stubs hold the rest of a leave_mid_stream stream this long "
                        "after its first event (0: answer at once)")
    p.add_argument("--http-server", choices=HTTP_SERVERS,
                   help="listen.http_server (default: the balancer's)")
    p.add_argument("--log", help="the balancer's log file (default: a temporary one)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--lb-url", help="drive this balancer instead of starting one ...")
    p.add_argument("--lb-pid", type=int, help="... whose process this is")
    p.add_argument("--probe", metavar="DIR",
                   help="dump what each balancer process holds into DIR (rss_soak_probe)")
    p.add_argument("--probe-at", default="20000,400000",
                   help="requests after which to probe (comma-separated; and at the end)")
    p.add_argument("--probe-tracemalloc", type=int, default=0, metavar="FRAMES",
                   help="with --probe: trace allocations, keeping this many frames")
    args = p.parse_args(argv)
    out = asyncio.run(soak(args))
    if args.json:
        _write(Path(args.json), out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("samples", "probes")}))
    return 0


def stubs_main() -> None:
    """``python -c 'from skymesh_lab.bench.rss_soak import stubs_main; stubs_main()'``:
    two stub replicas until killed; prints their URLs."""
    async def serve() -> None:
        servers = [await serve_stub() for _ in range(2)]
        print(",".join(u for _, u in servers), flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
