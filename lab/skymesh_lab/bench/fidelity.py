"""Fidelity check: the same small workload through the simulator and through real replicas.

The issue's acceptance test for the emulation: one open-loop workload run (a) inside the
discrete-event simulator (:class:`skymesh_lab.sim.runner.Simulation`, virtual time) and (b)
against real ``skymesh-replica`` processes over HTTP (real, optionally scaled time) must
give throughput and TTFT within 10% of each other.

What is compared
    Per request: arrival (when the client sends), first token (when the client receives
    the first content chunk), done (when it receives the last one), prompt tokens and
    prompt tokens served from the prefix cache. From these, for both sides with the same
    code (:func:`summarize`): completed requests, throughput (completed requests over the
    span from the first arrival to the last completion), TTFT and end-to-end latency
    (mean, p50, p90), and the prefix hit rate (cached prompt tokens over prompt tokens,
    i.e. ``usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens`` summed).

How the two runs are made equal
    The workload (:func:`build_requests`) is a seeded Poisson arrival schedule; each
    prompt is a shared prefix of words plus a unique tail of words, where every " word"
    is one Qwen token, and its token ids come from the same tokenizer the replica uses
    (``/v1/completions`` tokenises the raw string: no chat template, no BOS). The
    simulator gets those ids' block hashes, so prefix sharing is identical. Every request
    asks for exactly ``output_len`` tokens (``ignore_eos``). Both sides place request
    ``i`` on replica ``i mod R`` (simulator: round robin with blind pushing, so nothing
    waits at the balancer; live: the client itself round-robins). The simulator adds its
    default 1 ms of same-region network per request; the live run pays loopback HTTP.

Units
    Everything is reported in emulated-GPU seconds. The simulator is already in them.
    The live run is in wall seconds scaled by ``--time-scale`` (replicas stretch every
    engine step by it and the client stretches the arrival schedule by it), so live
    latencies are divided by ``time_scale`` and live throughput multiplied by it.

    python -m skymesh_lab.bench.fidelity --replicas 2 --requests 60 --rate 3.0 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from skymesh.prefix.prompt import get_tokenizer
from skymesh.util.jsonio import write_json
from skymesh.util.procs import Daemon, start_daemon
from skymesh.util.stats import fmt, summary
from skymesh_lab.sim.runner import SimConfig, Simulation
from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_replica.driver import WORDS
from skymesh_replica.engine.hashing import BLOCK_SIZE, hash_token_blocks
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile

REGION = "us"
TARGET = 0.10
# The metrics held to TARGET; the rest of the table is informative.
GATED = ("throughput_rps", "ttft_mean_s", "ttft_p50_s")
METRICS = ("completed", "throughput_rps", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
           "e2e_mean_s", "e2e_p50_s", "e2e_p90_s", "prefix_hit_rate")
# Wall seconds between the last task being created and the schedule's time zero, so the
# first requests are not already late when the schedule starts.
LEAD_S = 0.2
STARTUP_TIMEOUT_S = 30.0


# -- workload ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FidelityRequest:
    index: int
    arrival_s: float  # emulated seconds after the schedule's start
    prompt: str
    prompt_ids: tuple[int, ...]
    output_len: int
    num_words: int  # words in the prompt; equals len(prompt_ids) when each is one token

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def _single_token_words() -> list[str]:
    # The driver keeps only words whose " word" is one token; re-check with this process's
    # tokenizer (the fallback tokenizer also maps each " word" to one piece).
    tok = get_tokenizer()
    return [w for w in WORDS if len(tok.encode(" " + w)) == 1]


def build_requests(
    n: int,
    rate_rps: float,
    seed: int,
    shared_prefix_tokens: int = 256,
    unique_tokens: tuple[int, int] = (64, 512),
    output_tokens: tuple[int, int] = (16, 160),
) -> list[FidelityRequest]:
    """``n`` requests with Poisson arrivals at ``rate_rps``, all drawn from ``seed``.

    Each prompt is ``shared_prefix_tokens`` words common to every request followed by a
    tail of uniform ``unique_tokens`` random words; ``output_len`` is uniform in
    ``output_tokens`` (bounds inclusive). ``prompt_ids`` is the tokenizer's encoding of
    the prompt text, the same call the replica makes, so its length is the truth even if
    a word ever tokenised differently in context.
    """
    if n < 1:
        raise ValueError("need at least one request")
    if rate_rps <= 0:
        raise ValueError("rate_rps must be positive")
    rng = random.Random(seed)
    words = _single_token_words()
    tok = get_tokenizer()
    shared = rng.choices(words, k=shared_prefix_tokens)
    out: list[FidelityRequest] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate_rps)
        tail = rng.choices(words, k=rng.randint(*unique_tokens))
        pieces = shared + tail
        text = "".join(" " + w for w in pieces)
        out.append(FidelityRequest(
            index=i, arrival_s=t, prompt=text, prompt_ids=tuple(tok.encode(text)),
            output_len=rng.randint(*output_tokens), num_words=len(pieces),
        ))
    return out


# -- shared summary --------------------------------------------------------------------
@dataclass(slots=True)
class Outcome:
    """One request as the client saw it, in emulated seconds from the schedule's start."""

    arrival: float
    first: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ok: bool = False
    error: str = ""


def summarize(outcomes: Sequence[Outcome], detail: dict[str, Any]) -> dict[str, Any]:
    """The compared metrics; the same function for both sides keeps definitions equal."""
    done = [o for o in outcomes if o.ok and o.first is not None and o.done is not None]
    start = min((o.arrival for o in outcomes), default=0.0)
    end = max((o.done for o in done if o.done is not None), default=start)
    span = end - start
    ttft = [o.first - o.arrival for o in done if o.first is not None]
    e2e = [o.done - o.arrival for o in done if o.done is not None]
    prompt = sum(o.prompt_tokens for o in done)
    res: dict[str, Any] = {
        "requests": len(outcomes),
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "throughput_rps": len(done) / span if span > 0 else 0.0,
    }
    res.update(summary(ttft, prefix="ttft_", suffix="_s"))
    res.update(summary(e2e, prefix="e2e_", suffix="_s"))
    res["prefix_hit_rate"] = sum(o.cached_tokens for o in done) / prompt if prompt else 0.0
    res["detail"] = detail
    return res


def compare(sim: dict[str, Any], live: dict[str, Any]) -> dict[str, float | None]:
    """``(live - sim) / sim`` per metric; None where the simulator's value is zero or
    either side has no data."""
    out: dict[str, float | None] = {}
    for key in METRICS:
        if sim[key] is None or live[key] is None:
            out[key] = None
            continue
        s, v = float(sim[key]), float(live[key])
        out[key] = (v - s) / s if s != 0 else (0.0 if v == 0 else None)
    return out


# -- simulator -------------------------------------------------------------------------
class _Replay(Workload):
    """The request list as an open-loop workload, in arrival order."""

    name = "fidelity-replay"

    def __init__(self, requests: Sequence[FidelityRequest]) -> None:
        self.requests = sorted(requests, key=lambda r: r.arrival_s)

    def initial(self) -> Iterator[Arrival]:
        for r in self.requests:
            # Prompt blocks only: the live driver also hashes its synthetic output, but
            # those blocks are random text no other prompt contains, so never hit.
            item = WorkItem(
                request_id=f"req-{r.index}", region=REGION, prompt_len=r.prompt_len,
                output_len=r.output_len,
                block_hashes=hash_token_blocks(list(r.prompt_ids), BLOCK_SIZE),
                meta={"index": r.index},
            )
            yield r.arrival_s, item


def run_sim(
    requests: Sequence[FidelityRequest], replicas: int, profile: str, time_scale: float = 1.0
) -> dict[str, Any]:
    """The workload through the simulator; results in emulated (virtual) seconds.

    ``time_scale`` does not change the simulation (virtual time has no scale); it is
    accepted so both runners take the same arguments, and recorded in ``detail``.
    """
    cfg = SimConfig(
        workload="fidelity-replay", regions=[REGION], replicas={REGION: replicas},
        policy="round-robin", push_mode="bp", profile=profile,
    )
    sim = Simulation(cfg, _Replay(requests))
    summary = sim.run()
    outcomes = []
    for rec in sim.records:
        outcomes.append(Outcome(
            arrival=rec.t_arrival,
            first=rec.t_first if rec.ok else None,
            done=rec.t_done if rec.ok else None,
            prompt_tokens=rec.item.prompt_len,
            cached_tokens=rec.hit_tokens,
            ok=rec.ok,
            error=rec.error,
        ))
    detail = {
        "time_scale": time_scale,
        "preemptions": summary["preemptions"],
        "sim_seconds": summary["sim_seconds"],
        "wall_seconds": summary["wall_seconds"],
        "per_replica_completed": {k: v["completed"] for k, v in summary["per_replica"].items()},
        "per_replica_busy_fraction": {
            k: v["busy_fraction"] for k, v in summary["per_replica"].items()
        },
    }
    return summarize(outcomes, detail)


# -- live replicas ---------------------------------------------------------------------
def _spawn(profile: str, time_scale: float, seed: int) -> Daemon:
    return start_daemon("skymesh-replica", ["--port", "0", "--profile", profile,
                                            "--time-scale", repr(time_scale),
                                            "--seed", str(seed)], timeout=STARTUP_TIMEOUT_S)


async def _wait_healthy(session: aiohttp.ClientSession, d: Daemon, deadline: float) -> str:
    loop = asyncio.get_running_loop()
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(d.url + "/health") as resp:
                if resp.status == 200:
                    return d.url
        if loop.time() > deadline or not d.alive():
            raise RuntimeError(f"replica at {d.url} never became healthy:\n{d.log()[-2000:]}")
        await asyncio.sleep(0.05)


@dataclass(slots=True)
class _LiveStats:
    send_lag_max: float = 0.0
    token_mismatches: int = 0
    prompt_token_mismatches: int = 0
    errors: list[str] = field(default_factory=list)


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    req: FidelityRequest,
    t0: float,
    time_scale: float,
    stats: _LiveStats,
) -> Outcome:
    loop = asyncio.get_running_loop()
    due = t0 + req.arrival_s * time_scale
    await asyncio.sleep(max(0.0, due - loop.time()))
    sent = loop.time()
    stats.send_lag_max = max(stats.send_lag_max, sent - due)
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    first: float | None = None
    last: float | None = None
    usage: dict[str, Any] | None = None
    finished = False
    error = ""
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        finished = True
                        break
                    chunk = json.loads(data)
                    # The usage chunk has no choices; every token chunk carries text.
                    if any(c.get("text") for c in chunk.get("choices") or ()):
                        last = loop.time()
                        if first is None:
                            first = last
                    if chunk.get("usage"):
                        usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    out = Outcome(arrival=(sent - t0) / time_scale)
    if not error and not finished:
        error = "stream ended without [DONE]"
    if not error and usage is None:
        error = "no usage chunk"
    if usage is not None:
        out.prompt_tokens = int(usage.get("prompt_tokens", 0))
        out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        if out.prompt_tokens != req.prompt_len:
            stats.prompt_token_mismatches += 1
        got = usage.get("completion_tokens")
        if got != req.output_len:
            stats.token_mismatches += 1
            error = error or f"completion_tokens {got} != max_tokens {req.output_len}"
    if error:
        stats.errors.append(f"req-{req.index}: {error}")
        out.error = error
        return out
    out.ok = True
    out.first = None if first is None else (first - t0) / time_scale
    out.done = None if last is None else (last - t0) / time_scale
    return out


async def _run_live(
    requests: Sequence[FidelityRequest], replicas: int, profile: str, time_scale: float,
    seed: int,
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    wall0 = loop.time()
    model = get_profile(profile).model
    procs: list[Daemon] = []
    stats = _LiveStats()
    # No total timeout: a request may legitimately queue; a dead replica closes the socket.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)
    try:
        for i in range(replicas):
            procs.append(_spawn(profile, time_scale, seed + i))
        # No connection cap: an open-loop client must never queue requests on its side.
        async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        ) as session:
            deadline = loop.time() + STARTUP_TIMEOUT_S
            urls = await asyncio.gather(*(_wait_healthy(session, rp, deadline) for rp in procs))
            ordered = sorted(requests, key=lambda r: r.arrival_s)
            t0 = loop.time() + LEAD_S
            outcomes = await asyncio.gather(*(
                _one(session, urls[i % len(urls)], model, r, t0, time_scale, stats)
                for i, r in enumerate(ordered)
            ))
    finally:
        for d in procs:
            d.stop()
    detail = {
        "time_scale": time_scale,
        "wall_seconds": loop.time() - wall0,
        "max_send_lag_s": stats.send_lag_max,
        "token_mismatches": stats.token_mismatches,
        "prompt_token_mismatches": stats.prompt_token_mismatches,
        "errors": stats.errors[:10],
    }
    return summarize(outcomes, detail)


def run_live(
    requests: Sequence[FidelityRequest],
    replicas: int,
    profile: str,
    time_scale: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """The workload against ``replicas`` real ``skymesh-replica`` processes.

    Replica ``i`` runs with ``--seed seed+i`` (only the synthetic output text depends on
    it). Results are in emulated seconds: wall-clock latencies divided by ``time_scale``.
    The processes are always terminated, whatever happens.
    """
    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    return asyncio.run(_run_live(requests, replicas, profile, time_scale, seed))


# -- CLI -------------------------------------------------------------------------------
def _fmt(key: str, v: float | None) -> str:
    if v is None:
        return fmt(v)
    if key == "completed":
        return f"{int(v)}"
    if key == "prefix_hit_rate":
        return f"{v:.3f}"
    return f"{v:.4f}"


def format_table(sim: dict[str, Any], live: dict[str, Any], diff: dict[str, float | None],
                 target: float = TARGET) -> str:
    rows = [f"{'metric':<18} {'sim':>10} {'live':>10} {'diff %':>8}  check"]
    for key in METRICS:
        d = diff[key]
        dtxt = "n/a" if d is None else f"{100 * d:+.1f}"
        check = ""
        if key in GATED:
            check = "PASS" if d is not None and abs(d) <= target else "FAIL"
        rows.append(f"{key:<18} {_fmt(key, sim[key]):>10} {_fmt(key, live[key]):>10} "
                    f"{dtxt:>8}  {check}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m skymesh_lab.bench.fidelity",
        description="Run one workload through the simulator and through real replicas "
                    "and compare throughput, TTFT and latency.",
    )
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--requests", type=int, default=60)
    # ~1.5 req/s per L4 replica: prefill keeps the GPU ~30% busy and ~8 requests decode
    # together, so batching is real but queueing stays small.
    ap.add_argument("--rate", type=float, default=3.0, help="arrivals per emulated second")
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=TARGET,
                    help="relative tolerance for the gated metrics (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="write config, both results and diffs here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    get_profile(args.profile)  # fail on a bad name before starting anything
    reqs = build_requests(args.requests, args.rate, args.seed)
    sim = run_sim(reqs, args.replicas, args.profile, args.time_scale)
    live = run_live(reqs, args.replicas, args.profile, args.time_scale, args.seed)
    diff = compare(sim, live)
    gated = {k: diff[k] is not None and abs(diff[k] or 0.0) <= args.target for k in GATED}
    ok = all(gated.values())
    print(f"fidelity: {args.requests} requests at {args.rate} req/s on {args.replicas} x "
          f"{args.profile}, time scale {args.time_scale} (emulated seconds)")
    print(format_table(sim, live, diff, args.target))
    for name, res in (("sim", sim), ("live", live)):
        if res["failed"]:
            print(f"{name}: {res['failed']} failed requests: {res['detail'].get('errors', [])}")
    if live["detail"]["prompt_token_mismatches"]:
        print(f"live: {live['detail']['prompt_token_mismatches']} prompts tokenised to a "
              "different length on the replica")
    print(f"{'PASS' if ok else 'FAIL'}: throughput and TTFT within {100 * args.target:.0f}%"
          f" (live wall {live['detail']['wall_seconds']:.1f} s)")
    if args.json is not None:
        out = {"config": {k: (str(v) if isinstance(v, Path) else v)
                          for k, v in vars(args).items()},
               "sim": sim, "live": live, "diff": diff, "pass": gated,
               "requests": [{"index": r.index, "arrival_s": r.arrival_s,
                             "prompt_len": r.prompt_len, "output_len": r.output_len}
                            for r in reqs]}
        write_json(str(args.json), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
