"""SIGHUP makes a real skymesh-lb re-read its config file: replicas, policy and pushing
change live, the rest is reported as needing a restart, a bad file changes nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from support import until

from skymesh.util.procs import Daemon, start_daemon
from skymesh.version import package_version

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def config(replicas: list[Daemon], **over: Any) -> dict[str, Any]:
    return {"region": "us", "listen": {"port": 0}, "policy": {"name": "least-load"},
            "probe": {"interval_s": 0.05}, "pushing": {"mode": "sp-p"},
            "replicas": [{"url": r.url} for r in replicas], **over}


async def test_sighup_reloads_the_live_sections_and_rejects_a_bad_file(tmp_path: Path) -> None:
    reps = [start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.1"],
                         log_path=tmp_path / f"r{i}.log") for i in range(2)]
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump(config(reps[:1])))
    lb = start_daemon("skymesh-lb", ["--config", str(path)], log_path=tmp_path / "lb.log")
    daemons = [lb, *reps]
    try:
        start_line = next(line for line in lb.log().splitlines() if "listening on" in line)
        for part in (f"skymesh {package_version()}", f"config {path}", "policy least-load",
                     "1 replicas", reps[0].url, lb.url):
            assert part in start_line
        async with aiohttp.ClientSession() as s:
            async def status() -> dict[str, Any]:
                async with s.get(lb.url + "/status") as r:
                    assert r.status == 200
                    out: dict[str, Any] = await r.json()
                    return out

            async def healthy(urls: set[str]) -> bool:
                st = await status()
                return {u for u, r in st["replicas"].items() if r["healthy"]} == urls

            await until(lambda: healthy({reps[0].url}), "the first replica probed healthy")
            # Live: a second replica, another policy, another pushing mode. Not live: the
            # region and the listen port (logged as needing a restart, kept as they are).
            path.write_text(yaml.safe_dump(config(
                reps, region="eu", listen={"port": 1}, policy={"name": "round-robin"},
                pushing={"mode": "bp", "max_outstanding": 4})))
            os.kill(lb.proc.pid, signal.SIGHUP)
            await until(lambda: healthy({r.url for r in reps}), "the added replica in use")
            st = await status()
            assert (st["policy"], st["pushing"], st["region"]) == ("round-robin", "bp", "us")
            await until(_logged(lb, "region, listen changed but needs restart"),
                        "the restart-only sections logged")
            body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "after the reload"}]}
            async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200

            # A bad file: rejected whole, with a line naming it; the balancer keeps going.
            path.write_text(yaml.safe_dump(config(reps[:1], policy={"name": "no-such"})))
            os.kill(lb.proc.pid, signal.SIGHUP)
            await until(_logged(lb, "rejected, keeping the running config"), "rejection")
            assert "no-such" in lb.log()
            st = await status()
            assert set(st["replicas"]) == {r.url for r in reps}
            assert st["policy"] == "round-robin"
            assert lb.alive()
            async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
    finally:
        for d in daemons:
            d.stop()
    assert lb.proc.returncode == 0  # SIGTERM stopped it cleanly: SIGHUP never killed it


def _logged(d: Daemon, text: str) -> Any:
    async def cond() -> bool:
        return text in d.log()
    return cond
