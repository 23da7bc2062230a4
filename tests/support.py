"""Helpers shared by the integration tests (real processes on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from skymesh.util.procs import Daemon, start_daemon
from skymesh_lab.faults.cluster import parse_metrics


async def until(cond: Callable[[], Awaitable[bool]], what: str, timeout: float = 15.0,
                interval: float = 0.02) -> None:
    """Wait for ``cond`` with a deadline (never sleep-and-hope)."""
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
        await asyncio.sleep(interval)


async def eventually(pred: Callable[[], bool], what: str, timeout: float = 5.0) -> float:
    """``until`` for a plain predicate; returns the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    poll = 0.005  # a polling cadence, not a wait for the condition
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
        await asyncio.sleep(poll)
    return time.monotonic()


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 30.0,
             interval: float = 0.05) -> Any:
    """Blocking form of ``until``: polls ``cond`` until it returns something truthy, which
    it returns; fails with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(interval)  # polling cadence; the deadline bounds the wait
    return got


def http_call(url: str, body: Any = None, token: str | None = None,
              method: str | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """One blocking HTTP request with an optional JSON body and bearer token: (status,
    body), or (0, b"") when nothing answered."""
    req = urllib.request.Request(url, method=method or ("GET" if body is None else "POST"))
    if body is not None:
        req.data = json.dumps(body).encode()
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def run_bounded(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` (text, output captured) of a command that starts daemons of its
    own: it runs in a session of its own, and on timeout the whole session is killed, so
    no replica or balancer it started outlives the test."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


async def get_metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as r:
        assert r.status == 200
        return parse_metrics(await r.text())


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """All ``data:`` events of a streamed response, JSON-decoded (``[DONE]`` kept as str)."""
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def content_of(events: list[Any]) -> str:
    parts = []
    for ev in events:
        if isinstance(ev, dict):
            for ch in ev.get("choices", []):
                parts.append(ch.get("delta", {}).get("content") or ch.get("text") or "")
    return "".join(parts)


_MASK = (1 << 63) - 1


def chain(seq: list[int]) -> list[int]:
    """Chained keys, like engine block hashes: key i stands for the prefix seq[: i + 1]."""
    out, h = [], 0
    for x in seq:
        h = hash((h, x)) & _MASK
        out.append(h)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def mesh_pair(tmp: Path, **extra: Any) -> Callable[[str, str], dict[str, Any]]:
    """Certificates for ``lb-us`` and ``lb-eu`` under ``tmp/pki`` and free peering ports;
    returns ``mesh(me, peer)``, the ``mesh:`` section of ``me`` peered with ``peer``
    (heartbeats every 0.1 s, ``extra`` keys added)."""
    from skymesh.mesh import certs
    from skymesh.util.procs import free_port

    pki = tmp / "pki"
    certs.create_ca(pki)
    for name in ("lb-us", "lb-eu"):
        certs.issue_cert(pki, name)
    ports = {"lb-us": free_port(), "lb-eu": free_port()}

    def mesh(me: str, peer: str) -> dict[str, Any]:
        return {"id": me, "certs_dir": str(pki), "listen_port": ports[me],
                "heartbeat_interval_s": 0.1, **extra,
                "peers": [{"id": peer, "address": f"127.0.0.1:{ports[peer]}"}]}

    return mesh


def make_pki(d: Path, rogue_id: str) -> Path:
    """A mesh CA with certificates for lb-a, lb-b and lb-x, plus a rogue CA in ``d/rogue``
    that issued ``rogue_id`` (same balancer id, wrong CA: must be refused)."""
    from skymesh.mesh import certs

    certs.create_ca(d)
    for name in ("lb-a", "lb-b", "lb-x"):
        certs.issue_cert(d, name)
    certs.create_ca(d / "rogue")
    certs.issue_cert(d / "rogue", rogue_id)
    return d


@dataclass
class Load:
    """A target's load as a policy reads it (policies.base.TargetLoad), set by hand."""

    outstanding: int = 0
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    kv_capacity_tokens: int | None = None


@dataclass
class View:
    """A LoadView over hand-set loads; unknown targets start idle."""

    loads: dict[str, Load] = field(default_factory=dict)
    now: float = 0.0

    def load(self, target: str) -> Load:
        return self.loads.setdefault(target, Load())

    def set(self, **outstanding: int) -> View:
        for t, n in outstanding.items():
            self.load(t).outstanding = n
        return self


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """Serve ``app`` on a free loopback port (yielded) for the block: in-test stand-ins for
    a controller or a replica, where the test needs to see what the daemon sent."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def idle_vllm_metrics(model: str) -> str:
    """The ``/metrics`` page of an idle vLLM replica serving ``model``: what a stub replica
    answers the balancer's probes with."""
    return (f'vllm:num_requests_waiting{{model_name="{model}"}} 0\n'
            f'vllm:num_requests_running{{model_name="{model}"}} 0\n')


def chat_reply(model: str) -> dict[str, Any]:
    """A whole chat completion, as a stub replica answers."""
    return {"id": "x", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def chat_replica(model: str) -> web.Application:
    """A stand-in replica answering the balancer's probes, its model list and whole chats
    (:func:`chat_reply`)."""
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=idle_vllm_metrics(model))

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model}]})

    async def chat(request: web.Request) -> web.Response:
        return web.json_response(chat_reply(model))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def lb_status(s: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    """The balancer's ``/status`` JSON."""
    async with s.get(base + "/status") as r:
        out: dict[str, Any] = await r.json()
        return out


async def ready_replicas(s: aiohttp.ClientSession, base: str, n: int) -> None:
    """Wait until the balancer's ``/ready`` counts ``n`` healthy replicas."""
    async def ready() -> bool:
        async with s.get(base + "/ready") as r:
            return bool((await r.json())["healthy_replicas"] == n)
    await until(ready, f"{n} healthy replica(s)")


@cache
def length_samples() -> tuple[list[Any], list[Any]]:
    """Slices of the default length-prediction split (seed 0): 2,000 training samples and
    600 test samples, for the predictor tests."""
    from skymesh_lab.predict.data import limit, load_samples, split

    train, test = split(load_samples(), seed=0)
    return limit(train, 2000), limit(test, 600)


def mae_against_constant(pred: Any, train: list[Any], test: list[Any],
                         constant: Callable[[list[int]], float]) -> tuple[float, float]:
    """(MAE of ``pred`` on ``test``, MAE of ``constant`` of the training lengths), after
    checking there is one prediction per test sample and none below one token."""
    import numpy as np

    from skymesh_lab.predict.metrics import accuracy

    actual = np.array([s.output_tokens for s in test])
    assert pred.shape == actual.shape and pred.min() >= 1
    c = float(constant([s.output_tokens for s in train]))
    return (accuracy(pred, actual)["mae_tokens"],
            accuracy(np.full(len(test), c), actual)["mae_tokens"])


def start_lb_with(tmp: Path, base: dict[str, Any], overrides: dict[str, Any]) -> Daemon:
    """Start ``skymesh-lb`` on a config file made of ``base`` with each override merged in
    (a dict updates that section, anything else replaces it)."""
    cfg = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict):
            cfg[key] = {**cfg.get(key, {}), **value}
        else:
            cfg[key] = value
    path = tmp / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(path)], log_path=tmp / "lb.log")
