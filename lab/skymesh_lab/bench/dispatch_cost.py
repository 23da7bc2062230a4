"""CPU per request of the balancer's decision core: the dispatcher, the policy, the keys.

What is measured
    The pure :class:`~skymesh.balancer.dispatch.Dispatcher` and its policy, driven as the
    live daemon drives them (``skymesh.balancer.server``/``relay``), on a virtual clock:
    per request the prompt's prefix keys (policies that read them), ``offer`` and a pump,
    the first byte and a pump, the completion, the cached keys of prompt + output and a
    pump; every 50 ms each replica's probe and a pump. Only those calls are timed
    (``time.thread_time_ns`` around each: CPU, not wall time, so the other sessions on a
    shared machine cost little accuracy; the clock's own cost, measured on a call that
    does nothing, is taken off each); the stub replicas and the clients are not.

Workload
    Tree-of-thoughts-like, shared prefixes: ``--clients`` closed-loop clients (default 96)
    each walk a tree of 13 nodes (branching 3, depth 3) one request at a time, a parent
    before its children; a node's prompt is one of 8
    system prompts (1,600 characters), the tree's question (300) and, for a child, its
    parent's prompt and answer (400) and a step line. 8 replicas of 8 slots each (sp-p's
    ``max_num_seqs``, with ``prefer_queue`` 3), so at 96 clients a queue stands at the
    balancer, as it does under load: the case where rescans per pump cost the most.

Modes
    ``round-robin`` + ``bp`` (the cheapest), ``prefix-tree`` + ``sp-p`` (the default),
    ``least-load`` + ``sp-p``. The same three at ``@stubs``: the live benchmark's shape
    (``dispatch_cost_live``): 2 replicas that publish neither ``max_num_seqs`` nor a KV
    capacity (so sp-p gives each one request until its first byte, and up to
    ``prefer_queue`` 3 to the one holding the prompt's prefix), 64 clients each sending one
    of 16 shared system prompts of about 2,000 characters (the wrk script's) with a short
    question of its own, rendered as the daemon renders a chat, answers at once
    (first byte after 0.3 ms, the end after 0.6 ms), with ``prefix-tree`` + ``bp`` in place
    of ``least-load`` to show what sp-p's queue adds. ``prefix-tree`` + ``sp-p`` at
    ``@told``: the same shape where sp-p's limit does not bind (``dispatch_cost_live``'s
    ``default-told``): each replica told a cap of 256 and a queue of 256 for the prompt's
    prefix, timed after the first 1,000 completions (until the trie has learnt the
    shared prompts, every client waits in a queue). Runs are interleaved, ``--repeat``
    times (default 3); each
    figure is the median, with the spread (min-max). Each run also prints a digest of its
    decisions (request, replica, in order): two versions of the dispatcher that decide the
    same give the same digest.

``--base REV``: also run this file against the ``skymesh`` package of git revision ``REV``
(extracted with ``git archive`` into a temporary directory; or a directory holding a
checkout), interleaved with the current one, and print the ratios. The file imports
nothing from the lab for that.

    python -m skymesh_lab.bench.dispatch_cost [--requests 8000] [--repeat 3]
        [--base 8061ca5] [--json docs/results/data/dispatch-cost.json]
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.prefix import keys as _keys
from skymesh.prefix.keys import text_prefix_keys
from skymesh.prefix.prompt import render_chat

# The daemon's keys of prompt + reply (skymesh.balancer.relay): from the two apart, or
# (older commits) from the text joined, or (older still) the whole text rehashed.
reply_keys = getattr(_keys, "reply_keys", None)
cached_keys = getattr(_keys, "cached_keys", None)
# The daemon's keys of a prompt (remembered by keyed text); older commits hash each.
prompt_keys = getattr(_keys, "prompt_keys", text_prefix_keys)

MODES: tuple[tuple[str, str], ...] = (
    ("round-robin", "bp"), ("prefix-tree", "sp-p"), ("least-load", "sp-p"))
STUB_MODES: tuple[tuple[str, str], ...] = (
    ("round-robin", "bp"), ("prefix-tree", "sp-p"), ("prefix-tree", "bp"))
STUBS = "@stubs"
# The default where sp-p's limit does not bind (``TOLD``): the stubs' shape with each
# replica told a cap of 256 and a queue of 256 for the prompt's prefix.
TOLD = "@told"
TOLD_MODES: tuple[tuple[str, str], ...] = (("prefix-tree", "sp-p"),)
TOLD_CAP = 256
TOLD_WARMUP = 1000  # completions before the @told rows are timed
MODE_NAMES = (tuple(f"{p}+{m}" for p, m in MODES)
              + tuple(f"{p}+{m}{STUBS}" for p, m in STUB_MODES)
              + tuple(f"{p}+{m}{TOLD}" for p, m in TOLD_MODES))
STUB_REPLICAS, STUB_CLIENTS, STUB_PROMPTS, STUB_PROMPT_CHARS = 2, 64, 16, 2000
STUB_METRICS_LAG_S = 1.0  # a vllm-kind replica's default (the live balancer's config)
REPLICAS = 8
SEQS = 8
PREFER_QUEUE = 3
KV_CAPACITY = 200_000
PROBE_S = 0.05
BRANCHING, DEPTH = 3, 3
SYSTEMS, SYSTEM_CHARS, QUESTION_CHARS, ANSWER_CHARS = 8, 1600, 300, 400
CHARS_PER_TOKEN = 4


def _text(rng: random.Random, n: int) -> str:
    return rng.randbytes((n + 1) // 2).hex()[:n]


def _words(seed: int, count: int) -> str:
    """post.lua's ``words``: ``count`` words from a small LCG, the same in every run."""
    out = []
    x = seed
    for _ in range(count):
        x = (x * 1103515245 + 12345) % 2147483648
        out.append(f"w{x % 5000}")
    return " ".join(out)


# -- the stub cluster ------------------------------------------------------------------
@dataclass
class _Replica:
    id: str
    running: set[str] = field(default_factory=set)
    waiting: list[Ticket] = field(default_factory=list)


@dataclass
class _Node:
    prompt: str
    answer: str


@dataclass
class _Client:
    tree: list[_Node | None] = field(default_factory=list)
    next_node: int = 0


class Bench:
    """One run: ``requests`` completions of one (policy, mode), timed per call."""

    def __init__(self, policy: str, mode: str, *, clients: int, seed: int,
                 replicas: int = REPLICAS, systems: int = SYSTEMS,
                 system_chars: int = SYSTEM_CHARS) -> None:
        self.rng = random.Random(seed)
        self.policy = build_policy(policy, rng=random.Random(seed))
        self.d = Dispatcher(self.policy, PushMode(mode), prefer_queue=PREFER_QUEUE,
                            hold_queue_max=48)
        self.replicas = {f"r{i}": _Replica(f"r{i}") for i in range(replicas)}
        self.d.set_targets({rid: ("m",) for rid in self.replicas})
        self.keys = self.policy.uses_prefix_keys
        self.systems = [_text(self.rng, system_chars) for _ in range(systems)]
        self.clients = [_Client() for _ in range(clients)]
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.cpu_ns = 0
        self.sections = 0
        self.completed = 0
        self.digest = hashlib.sha256()
        self.requests = 0
        # Completions before the timing starts (the cost and the digest count after them).
        self.warmup = 0

    # -- timing ------------------------------------------------------------------------
    def timed(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        t0 = time.thread_time_ns()
        out = fn(*args, **kw)
        self.cpu_ns += time.thread_time_ns() - t0
        self.sections += 1
        return out

    def at(self, t: float, kind: str, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    # -- the balancer's side (timed) ---------------------------------------------------
    def _pump(self) -> list[Ticket]:
        d = self.d
        return d.pump(self.now) if d.queued else []

    def _arrive(self, rid: str, prompt: str) -> list[Ticket]:
        keys = prompt_keys(prompt) if self.keys else ()
        route = RouteRequest(rid, model="m", prompt_len=max(1, len(prompt) // CHARS_PER_TOKEN),
                             prefix_keys=keys)
        self.d.offer(Ticket(route, self.now), self.now)
        return self._pump()

    def _first_byte(self, ticket: Ticket) -> list[Ticket]:
        self.d.first_byte(ticket)
        return self._pump()

    def _done(self, ticket: Ticket, prompt: str, answer: str) -> list[Ticket]:
        target = ticket.target or ""
        self.d.complete(ticket, self.now, ok=True)
        if self.keys:
            keys: Sequence[int]
            if reply_keys is not None:
                keys = reply_keys(prompt, ticket.route.prefix_keys, answer)
            else:
                text = prompt + answer  # as the daemon joined them (output_text.cached_text)
                keys = (cached_keys(text, prompt, ticket.route.prefix_keys) if cached_keys
                        else text_prefix_keys(text))
            self.d.cached(ticket.route, target, keys)
        return self._pump()

    def _probe(self, rep: _Replica) -> list[Ticket]:
        used = sum(1 for _ in rep.running) * 600
        self.d.on_probe(rep.id, self.now, len(rep.waiting), len(rep.running),
                        used / KV_CAPACITY, KV_CAPACITY, max_num_seqs=SEQS,
                        prefer_queue=PREFER_QUEUE)
        return self._pump()

    # -- the stubs (untimed) -----------------------------------------------------------
    def _sent(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            target = t.target or ""
            self.digest.update(f"{t.route.request_id}>{target};".encode())
            rep = self.replicas[target]
            if len(rep.running) < SEQS:
                self._admit(rep, t)
            else:
                rep.waiting.append(t)

    def _admit(self, rep: _Replica, t: Ticket) -> None:
        rep.running.add(t.key)
        prefill = 0.002 + t.route.prompt_len * 2e-6
        self.at(self.now + prefill, "first", t)
        self.at(self.now + prefill + self.rng.uniform(0.05, 0.3), "done", t)

    def _issue(self, ci: int) -> None:
        c = self.clients[ci]
        if c.next_node >= len(c.tree):  # one request at a time: a parent has ended
            c.tree = [None] * sum(BRANCHING ** k for k in range(DEPTH))
            c.next_node = 0
        n = c.next_node
        c.next_node += 1
        if n == 0:
            prompt = (self.rng.choice(self.systems) + "\nQ: "
                      + _text(self.rng, QUESTION_CHARS))
        else:
            parent = c.tree[(n - 1) // BRANCHING]
            assert parent is not None
            prompt = f"{parent.prompt}\nA: {parent.answer}\nstep {n}:"
        node = _Node(prompt, _text(self.rng, ANSWER_CHARS))
        c.tree[n] = node
        self.requests += 1
        rid = f"c{ci}n{n}q{self.requests}"
        self._sent(self.timed(self._arrive, rid, prompt))
        self._inflight[rid] = (ci, node)

    def run(self, requests: int) -> dict[str, Any]:
        requests += self.warmup
        self._inflight: dict[str, tuple[int, _Node]] = {}
        for rep in self.replicas.values():
            self.at(self.rng.uniform(0, PROBE_S), "probe", rep)
        for ci in range(len(self.clients)):
            self._issue(ci)
        while self.completed < requests:
            self.now, _, kind, data = heapq.heappop(self.events)
            if kind == "probe":
                self._sent(self.timed(self._probe, data))
                self.at(self.now + PROBE_S, "probe", data)
            elif kind == "first":
                self._sent(self.timed(self._first_byte, data))
            else:
                t: Ticket = data
                ci, node = self._inflight.pop(t.route.request_id)
                rep = self.replicas[t.target or ""]
                rep.running.discard(t.key)
                self._sent(self.timed(self._done, t, node.prompt, node.answer))
                if rep.waiting and len(rep.running) < SEQS:
                    self._admit(rep, rep.waiting.pop(0))
                self.completed += 1
                if self.completed == self.warmup:  # steady state from here on
                    self.cpu_ns = self.sections = 0
                self._issue(ci)
        # The clock's own cost (a system call, about 1 us here) is taken off each section.
        net = self.cpu_ns - self.sections * timer_overhead_ns()
        timed = self.completed - self.warmup
        return {"us_per_request": net / 1e3 / timed,
                "requests": timed, "digest": self.digest.hexdigest()[:16]}


class StubBench(Bench):
    """The live benchmark's shape (module docstring, ``@stubs``)."""

    def __init__(self, policy: str, mode: str, *, seed: int, told: bool = False) -> None:
        super().__init__(policy, mode, clients=STUB_CLIENTS, seed=seed,
                         replicas=STUB_REPLICAS, systems=STUB_PROMPTS,
                         system_chars=STUB_PROMPT_CHARS)
        # The wrk script's shared system prompts (router_overhead's post.lua), about
        # 2,000 characters each.
        self.systems = [f"You are assistant {g}. Context: " + _words(g * 7919, 320)
                        for g in range(1, STUB_PROMPTS + 1)]
        self.seqs: int | None = TOLD_CAP if told else None
        self.prefer = TOLD_CAP if told else PREFER_QUEUE
        if told:
            # At the start every client waits for a replica until the trie has learnt
            # the shared prompts (a queue, sp-p's limit binding): not what this row shows.
            self.warmup = TOLD_WARMUP

    def _probe(self, rep: _Replica) -> list[Ticket]:
        self.d.on_probe(rep.id, self.now, 0, len(rep.running), 0.0, None,
                        max_num_seqs=self.seqs, metrics_lag_s=STUB_METRICS_LAG_S,
                        prefer_queue=self.prefer)
        return self._pump()

    def _sent(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            target = t.target or ""
            self.digest.update(f"{t.route.request_id}>{target};".encode())
            self.replicas[target].running.add(t.key)
            self.at(self.now + 0.0003, "first", t)
            self.at(self.now + 0.0006, "done", t)

    def _issue(self, ci: int) -> None:
        self.requests += 1
        # As the live benchmark's wrk script builds them (two threads), rendered as the
        # daemon renders a chat: where the question reaches into a full chunk, the
        # prompt's keyed text is new and its keys are hashed.
        prompt = render_chat([
            {"role": "system", "content": self.rng.choice(self.systems)},
            {"role": "user", "content": f"question {ci % 2}-{self.requests}"}])
        rid = f"c{ci}q{self.requests}"
        self._sent(self.timed(self._arrive, rid, prompt))
        self._inflight[rid] = (ci, _Node(prompt, f"stub answer {self.requests}"))


def _noop() -> None:
    return None


def timer_overhead_ns(samples: int = 20_000) -> float:
    """What ``Bench.timed`` measures around a call that does nothing (median of runs)."""
    global _OVERHEAD
    if _OVERHEAD is None:
        b = Bench.__new__(Bench)
        runs = []
        for _ in range(5):
            b.cpu_ns = b.sections = 0
            for _ in range(samples // 5):
                b.timed(_noop)
            runs.append(b.cpu_ns / b.sections)
        _OVERHEAD = statistics.median(runs)
    return _OVERHEAD


_OVERHEAD: float | None = None


def run_modes(requests: int, clients: int, seed: int) -> dict[str, dict[str, Any]]:
    out = {}
    for policy, mode in MODES:
        out[f"{policy}+{mode}"] = Bench(policy, mode, clients=clients, seed=seed).run(requests)
    for policy, mode in STUB_MODES:
        out[f"{policy}+{mode}{STUBS}"] = StubBench(policy, mode, seed=seed).run(requests)
    for policy, mode in TOLD_MODES:
        out[f"{policy}+{mode}{TOLD}"] = StubBench(policy, mode, seed=seed,
                                                  told=True).run(requests)
    return out


def _worker(args: argparse.Namespace) -> None:
    out: dict[str, Any] = run_modes(args.requests, args.clients, args.seed)
    out["timer_overhead_ns"] = timer_overhead_ns()
    print(json.dumps(out))


def _spawn(base: str | None, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    if base is not None:
        env["PYTHONPATH"] = base + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker",
           "--requests", str(args.requests), "--clients", str(args.clients),
           "--seed", str(args.seed)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                         cwd=base or None)
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for name in MODE_NAMES:
        vals = [r[name]["us_per_request"] for r in runs]
        modes[name] = {"us_per_request": round(statistics.median(vals), 1),
                       "min": round(min(vals), 1), "max": round(max(vals), 1),
                       "digest": runs[0][name]["digest"],
                       "digests_agree": len({r[name]["digest"] for r in runs}) == 1}
    def ratio(suffix: str, base: str = "") -> float:
        return round(modes[f"prefix-tree+sp-p{suffix}"]["us_per_request"]
                     / modes[f"round-robin+bp{base or suffix}"]["us_per_request"], 2)

    return {"modes": modes,
            "told_default_over_round_robin": ratio(TOLD, STUBS),
            "timer_overhead_ns": round(statistics.median(
                r["timer_overhead_ns"] for r in runs)),
            "default_over_round_robin": ratio(""),
            "stubs_default_over_round_robin": ratio(STUBS)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8000)
    ap.add_argument("--clients", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base", default=None,
                    help="a git revision (or a directory holding a checkout) to compare")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        return _measure(args, _checkout(args.base, tmp) if args.base else None)


def _checkout(base: str, tmp: str) -> str:
    """``base`` if it is a directory, else the tree of git revision ``base`` in ``tmp``."""
    if os.path.isdir(base):
        return base
    tree = subprocess.run(["git", "archive", base], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=tree, check=True)
    return tmp


def _measure(args: argparse.Namespace, base_dir: str | None) -> int:
    cur: list[dict[str, Any]] = []
    base: list[dict[str, Any]] = []
    t0 = time.time()
    for _ in range(args.repeat):  # interleaved: the machine's load hits both alike
        cur.append(_spawn(None, args))
        if base_dir:
            base.append(_spawn(base_dir, args))
    doc: dict[str, Any] = {
        "setup": {"requests": args.requests, "clients": args.clients, "seed": args.seed,
                  "repeat": args.repeat, "replicas": REPLICAS, "max_num_seqs": SEQS,
                  "prefer_queue": PREFER_QUEUE, "cpus": os.cpu_count(),
                  "stubs": {"replicas": STUB_REPLICAS, "clients": STUB_CLIENTS,
                            "prompts": STUB_PROMPTS, "prompt_chars": STUB_PROMPT_CHARS,
                            "metrics_lag_s": STUB_METRICS_LAG_S},
                  "told": {"max_num_seqs": TOLD_CAP, "prefer_queue": TOLD_CAP,
                           "warmup": TOLD_WARMUP}},
        "current": summarise(cur)}
    if base:
        doc["base"] = summarise(base)
        doc["base"]["label"] = args.base
        doc["same_decisions"] = {
            m: doc["base"]["modes"][m]["digest"] == v["digest"]
            for m, v in doc["current"]["modes"].items()}
        doc["speedup"] = {
            m: round(doc["base"]["modes"][m]["us_per_request"] / v["us_per_request"], 2)
            for m, v in doc["current"]["modes"].items()}
    doc["wall_seconds"] = round(time.time() - t0, 1)
    for label in ("base", "current"):
        if label in doc:
            print(f"{label}: " + ", ".join(
                f"{m} {v['us_per_request']} us [{v['min']}, {v['max']}]"
                for m, v in doc[label]["modes"].items())
                + f"; default/round-robin {doc[label]['default_over_round_robin']}x")
    if base:
        print("same decisions:", doc["same_decisions"], "speedup:", doc["speedup"])
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
