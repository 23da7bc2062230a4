"""A whole reply's ``usage`` is decoded once per request, whatever the policy: the access
log takes its counts from what the request path decoded (``note_usage``)."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import chat_replica, eventually, serving, until

from skymesh.balancer.config import parse_config
from skymesh.balancer.server import build_app
from skymesh.net.limits import ConnLimits
from skymesh.net.serving import start_app
from skymesh.obs.access import ACCESS_LOGGER

MODEL = "m"


def replica() -> web.Application:
    return chat_replica(MODEL)


@pytest.mark.parametrize("policy", ["prefix-tree", "round-robin"])
async def test_the_access_log_does_not_decode_a_reply_the_request_path_decoded(
        policy: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from skymesh.obs import access

    decodes: list[bytes] = []
    real = access.fast_usage

    def counted(raw: bytes) -> Any:
        decodes.append(raw)
        return real(raw)

    monkeypatch.setattr(access, "fast_usage", counted)
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with serving(replica()) as port:
        cfg = parse_config({"listen": {"host": "127.0.0.1", "port": 0},
                            "policy": {"name": policy},
                            "replicas": [{"url": f"http://127.0.0.1:{port}",
                                          "models": [MODEL]}],
                            "logging": {"access_log": True}})
        runner, _ = await start_app(build_app(cfg), "127.0.0.1", 0, "lb", ConnLimits())
        try:
            await _one_request(f"http://127.0.0.1:{runner.addresses[0][1]}")
            await eventually(lambda: _ok_line(caplog.records) is not None, "its access line")
        finally:
            await runner.cleanup()
    ok = _ok_line(caplog.records)
    assert (getattr(ok, "prompt_tokens", None), getattr(ok, "completion_tokens", None)) \
        == (3, 1)
    assert decodes == []


def _ok_line(records: list[logging.LogRecord]) -> logging.LogRecord | None:
    return next((r for r in records if getattr(r, "status", None) == 200), None)


async def _one_request(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        async def served() -> bool:
            async with s.post(url + "/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "x" * 300}]}) as r:
                await r.read()
                return r.status == 200
        await until(served, "a request served through the balancer")
