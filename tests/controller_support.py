"""Helpers for the controller tests: a real redis-server process, tokens and auth headers."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from skymesh.util.procs import Daemon, free_port, start_daemon
from skymesh_lab.faults.cluster import RedisProcess

ADMIN = "admin-token-for-tests"
READER = "read-token-for-tests"
AGENT = "agent-token-for-tests"


# One restartable redis-server (AOF on) for the tests and the fault scenarios.
RedisServer = RedisProcess
__all__ = ["ADMIN", "AGENT", "READER", "RedisServer", "auth", "free_port", "planner_controller",
           "start_controller", "token_config"]


def token_config() -> list[dict[str, str]]:
    from skymesh_controller.auth import digest

    return [{"name": "ops", "sha256": digest(ADMIN), "role": "admin"},
            {"name": "dash", "sha256": digest(READER), "role": "read"},
            {"name": "lbs", "sha256": digest(AGENT), "role": "agent"}]


def auth(token: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def start_controller(tmp: Path, *, probe_s: float, timeout_s: float) -> Daemon:
    """A ``skymesh-controller`` with the test tokens, probing every ``probe_s``; two
    failed probes in a row mark a balancer down."""
    path = tmp / "controller.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0}, "tokens": token_config(),
        "url_policy": {"allow_loopback": True},
        "probe": {"interval_s": probe_s, "timeout_s": timeout_s, "failure_threshold": 2}}))
    return start_daemon("skymesh-controller", ["--config", str(path)],
                        log_path=tmp / "controller.log")


@contextlib.contextmanager
def planner_controller(tmp: Path, planner: dict[str, Any], *, probe_s: float | None = 0.5,
                       start_timeout_s: float = 30.0,
                       env: dict[str, str] | None = None) -> Iterator[Daemon]:
    """A ``skymesh-controller`` (memory store, the test tokens, loopback URLs allowed) with
    the ``planner`` section given, probing every ``probe_s`` (None: the default), stopped
    on exit."""
    cfg: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0}, "tokens": token_config(),
        "url_policy": {"allow_loopback": True}, "planner": planner}
    if probe_s is not None:
        cfg["probe"] = {"interval_s": probe_s}
    path = tmp / "controller.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ctl = start_daemon("skymesh-controller", ["--config", str(path)],
                       log_path=tmp / "controller.log", timeout=start_timeout_s, env=env)
    try:
        yield ctl
    finally:
        ctl.stop()


class TelemetryFeeder:
    """Telemetry as each region's balancer ``lb-REGION`` reports it: ``tps[region]``
    prompt tokens/s of ``model`` every 0.25 s, from a thread (the planner tests' demand)."""

    def __init__(self, base: str, model: str, tps: dict[str, float]) -> None:
        self.base, self.model, self.tps = base, model, tps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, headers=auth(AGENT), timeout=5) as c:
            while not self._stop.wait(0.25):
                for region, tps in list(self.tps.items()):
                    # A report lost on a busy machine: the next one follows.
                    with contextlib.suppress(httpx.HTTPError):
                        c.post(f"/v1/balancers/lb-{region}/telemetry", json={
                            "window_s": 0.25, "models": {self.model: {
                                "requests": 1, "prompt_tokens": int(tps * 0.25),
                                "output_tokens": 0}}})

    def __enter__(self) -> TelemetryFeeder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
