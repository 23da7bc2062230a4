"""``skymesh dns sync`` against a small real HTTP server standing in for the controller's
``POST /v1/dns/sync`` (the end-to-end test through the real controller lives with it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from support import serving

from skymesh.cli import main
from skymesh.util.procs import executable

TOKEN = "s3cret-token"
REPORT = {"created": ["lb-us"], "updated": ["lb-eu"], "deleted": ["lb-ap"],
          "unchanged": [], "health_checks_created": ["lb-us"], "health_checks_deleted": [],
          "errors": ["lb-lab: region 'lab' has no cloud_region"], "dry_run": True}


class FakeController:
    def __init__(self) -> None:
        self.bodies: list[Any] = []
        self.answer: tuple[int, str] | None = None

    async def sync(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": {"message": "bad or missing token"}},
                                     status=401)
        self.bodies.append(await request.json())
        if self.answer is not None:
            return web.Response(status=self.answer[0], text=self.answer[1])
        return web.json_response({**REPORT, "dry_run": self.bodies[-1]["dry_run"]})


@pytest.fixture
async def controller() -> AsyncIterator[tuple[str, FakeController]]:
    fake = FakeController()
    app = web.Application()
    app.router.add_post("/v1/dns/sync", fake.sync)
    async with serving(app) as port:
        yield f"http://127.0.0.1:{port}", fake


async def run_cli(*argv: str) -> int:
    # The CLI blocks on its HTTP call: run it off the loop that serves the fake controller.
    return await asyncio.to_thread(main, ["dns", "sync", *argv])


async def test_prints_the_report_and_sends_the_token(
        controller: tuple[str, FakeController], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    url, fake = controller
    monkeypatch.setenv("SKYMESH_ADMIN_TOKEN", TOKEN)
    out_json = tmp_path / "report.json"
    assert await run_cli("--controller", url, "--dry-run", "--json", str(out_json)) == 0
    assert fake.bodies == [{"dry_run": True}]
    out = capsys.readouterr().out
    assert out.startswith("dry run: nothing was changed")
    lines = [line.split() for line in out.splitlines()]
    assert ["record", "created", "lb-us"] in lines
    assert ["record", "withdrawn", "lb-ap"] in lines
    assert ["health", "check", "created", "lb-us"] in lines
    assert "  - lb-lab: region 'lab' has no cloud_region" in out
    assert json.loads(out_json.read_text())["created"] == ["lb-us"]

    assert await run_cli("--controller", url) == 0
    assert fake.bodies[-1] == {"dry_run": False}
    assert capsys.readouterr().out.startswith("Route53 synced")


async def test_token_file_is_read(controller: tuple[str, FakeController],
                                  monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    url, fake = controller
    monkeypatch.delenv("SKYMESH_ADMIN_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert await run_cli("--controller", url, "--token-file", str(token_file)) == 0
    assert fake.bodies == [{"dry_run": False}]


@pytest.mark.parametrize(("token", "answer", "fragment"), [
    ("wrong", None, "the controller answered 401: bad or missing token"),
    (TOKEN, (409, '{"error": {"message": "DNS is not configured"}}'),
     "answered 409: DNS is not configured"),
    (TOKEN, (500, "boom"), "answered 500: boom"),
    (TOKEN, (200, "not json"), "not JSON"),
])
async def test_controller_refusals_exit_2_with_the_reason(
        controller: tuple[str, FakeController], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], token: str, answer: tuple[int, str] | None,
        fragment: str) -> None:
    url, fake = controller
    fake.answer = answer
    monkeypatch.setenv("SKYMESH_ADMIN_TOKEN", token)
    assert await run_cli("--controller", url) == 2
    err = capsys.readouterr().err
    assert err.startswith("skymesh dns sync: ") and fragment in err
    assert "Traceback" not in err


async def test_no_token_or_no_controller_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    monkeypatch.delenv("SKYMESH_ADMIN_TOKEN", raising=False)
    assert await run_cli("--controller", "http://127.0.0.1:9") == 2
    assert "no admin token" in capsys.readouterr().err
    assert await run_cli("--token-file", str(tmp_path / "missing")) == 2
    assert "cannot read --token-file" in capsys.readouterr().err

    monkeypatch.setenv("SKYMESH_ADMIN_TOKEN", TOKEN)
    # Nothing listens on the discard port of loopback.
    assert await run_cli("--controller", "http://127.0.0.1:9") == 2
    assert "cannot reach the controller at http://127.0.0.1:9" in capsys.readouterr().err
    assert await run_cli("--controller", "ftp://127.0.0.1:9") == 2
    assert "must start with http://" in capsys.readouterr().err


async def test_console_script_uses_the_controller_url_from_the_environment(
        controller: tuple[str, FakeController]) -> None:
    url, fake = controller
    proc = await asyncio.create_subprocess_exec(
        *executable("skymesh"), "dns", "sync", "--dry-run",
        env={"PATH": "/usr/bin:/bin", "SKYMESH_CONTROLLER_URL": url,
             "SKYMESH_ADMIN_TOKEN": TOKEN},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    assert fake.bodies == [{"dry_run": True}]
    assert "record created" in out.decode()
