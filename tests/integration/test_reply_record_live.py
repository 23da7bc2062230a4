"""A whole (non-streamed) reply read once for a recording policy
(skymesh.balancer.output_text.reply_record): the prefix tree is told the reply's text,
and the access log its usage, from the one typed decode, through a real balancer app on
loopback."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest
from support import chat_replica, eventually, serving, until

from skymesh.balancer.config import parse_config
from skymesh.balancer.relay import RequestCore
from skymesh.balancer.server import build_app
from skymesh.net.limits import ConnLimits
from skymesh.net.serving import start_app
from skymesh.obs.access import ACCESS_LOGGER

MODEL = "m"


async def test_a_whole_reply_tells_the_prefix_tree_its_text_and_the_log_its_usage(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    told: list[str] = []
    real = RequestCore.record_cached

    def spy(self: RequestCore, route: Any, target: str, intake: Any, output: str) -> None:
        told.append(output)
        real(self, route, target, intake, output)

    monkeypatch.setattr(RequestCore, "record_cached", spy)
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with serving(chat_replica(MODEL)) as port:
        cfg = parse_config({"listen": {"host": "127.0.0.1", "port": 0},
                            "policy": {"name": "prefix-tree"},
                            "replicas": [{"url": f"http://127.0.0.1:{port}",
                                          "models": [MODEL]}],
                            "logging": {"access_log": True}})
        runner, _ = await start_app(build_app(cfg), "127.0.0.1", 0, "lb", ConnLimits())
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as s:
                async def served() -> bool:
                    async with s.post(url + "/v1/chat/completions", json={
                            "model": MODEL, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "x" * 300}]}) as r:
                        body = await r.json()
                        return r.status == 200 and bool(body["choices"])
                await until(served, "a request served through the balancer")
            await eventually(lambda: bool(told), "the reply recorded")
            await eventually(lambda: _ok_line(caplog.records) is not None, "its access line")
        finally:
            await runner.cleanup()
    assert told[0] == "hi"  # support.chat_reply's content
    ok = _ok_line(caplog.records)
    assert (getattr(ok, "prompt_tokens", None), getattr(ok, "completion_tokens", None)) \
        == (3, 1)


def _ok_line(records: list[logging.LogRecord]) -> logging.LogRecord | None:
    return next((r for r in records if getattr(r, "status", None) == 200), None)
