"""Fixtures for the controller: a real redis-server process, and each store in turn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from controller_support import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(params=["memory", "redis"])
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "memory":
        yield "memory"
        return
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv.url
    srv.stop()
