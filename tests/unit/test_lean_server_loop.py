"""The in-process bench of the HTTP server (lean_server_loop) runs each arm's own protocol
behind the guard: aiohttp's requests are aiohttp's, the lean arms' are lean (the direct
writes arm answers without prepare(), lean-prepare through it), and every request is
answered."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from skymesh_lab.bench import lean_server_loop as bench


async def test_each_arm_serves_every_request_with_its_own_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kinds: list[str] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        kinds.append(type(request).__name__)
        await request.read()
        return web.Response(body=bench.BODY, content_type="application/json")

    def app() -> web.Application:
        a = web.Application()
        a.router.add_post(bench.PATH, generate)
        return a

    monkeypatch.setattr(bench, "_app", app)
    arms, runner = await bench._arms()
    try:
        assert await bench._one(arms["aiohttp"], 20) > 0
        assert await bench._one(arms["lean"], 30) > 0
        assert await bench._one(arms["lean-prepare"], 10) > 0
        prepared: list[str] = []
        real = web.StreamResponse.prepare

        async def counted(self: web.StreamResponse, request: Any) -> Any:
            prepared.append(type(request).__name__)
            return await real(self, request)

        monkeypatch.setattr(web.StreamResponse, "prepare", counted)
        await bench._one(arms["lean"], 5)  # written directly
        await bench._one(arms["lean-prepare"], 5)  # through prepare()
    finally:
        await runner.cleanup()
    assert kinds == ["Request"] * 20 + ["LeanRequest"] * 50
    assert prepared == ["LeanRequest"] * 5
