"""Client API keys on a live skymesh-lb, in front of a replica that wants its own key
(as vLLM with --api-key): clients need the balancer's key, replicas get theirs, and a
public address without keys refuses to start."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml
from support import content_of, read_sse, until

from skymesh.procs import Daemon, executable, start_daemon

CLIENT_KEY = "sk-client-3f9a"
REPLICA_KEY = "sk-replica-77c1"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    tmp = tmp_path_factory.mktemp("auth")
    rep = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.05",
                                           "--api-key", REPLICA_KEY],
                       log_path=tmp / "replica.log")
    cfg = {"region": "test", "listen": {"host": "127.0.0.1", "port": 0},
           "probe": {"interval_s": 0.05}, "replicas": [{"url": rep.url}],
           "upstream": {"api_key_env": "TEST_REPLICA_KEY"}}
    (tmp / "lb.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "SKYMESH_API_KEYS": f"sk-other,{CLIENT_KEY}",
           "TEST_REPLICA_KEY": REPLICA_KEY}
    try:
        lb = start_daemon("skymesh-lb", ["--config", str(tmp / "lb.yaml")],
                          log_path=tmp / "lb.log", env=env)
    except BaseException:
        rep.stop()
        raise
    try:
        yield lb, rep
    finally:
        lb.stop()
        rep.stop()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_clients_need_a_key_and_replicas_get_theirs(guarded: tuple[Daemon, Daemon]
                                                          ) -> None:
    lb, rep = guarded
    async with aiohttp.ClientSession() as s:
        async def listed() -> bool:
            async with s.get(lb.url + "/v1/models", headers=_bearer(CLIENT_KEY)) as r:
                return r.status == 200 and len((await r.json())["data"]) == 1
        # The model list comes from the replica's /v1/models, which wants its own key.
        await until(listed, "the replica's model behind the balancer")
        async with s.get(lb.url + "/v1/models") as r:
            model_status, body = r.status, await r.json()
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert model_status == 401
        assert body["error"]["code"] == "invalid_api_key"
        assert body["error"]["type"] == "invalid_request_error"
        async with s.get(lb.url + "/v1/models", headers=_bearer(CLIENT_KEY)) as r:
            model = (await r.json())["data"][0]["id"]

        chat = {"model": model, "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "hello"}]}
        for headers in ({}, _bearer("sk-wrong"), {"Authorization": CLIENT_KEY}):
            async with s.post(lb.url + "/v1/chat/completions", json=chat,
                              headers=headers) as r:
                assert r.status == 401, headers
                assert (await r.json())["error"]["code"] == "invalid_api_key"
        # Served: so the replica saw its own key, not the client's (it answers 401 to
        # anything else, as the direct calls below show).
        async with s.post(lb.url + "/v1/chat/completions", json=chat,
                          headers=_bearer(CLIENT_KEY)) as r:
            assert r.status == 200
            assert content_of(await read_sse(r))
        async with s.post(rep.url + "/v1/chat/completions", json=chat,
                          headers=_bearer(CLIENT_KEY)) as r:
            assert r.status == 401
        async with s.get(rep.url + "/health") as r:
            assert r.status == 200

        for path in ("/health", "/ready", "/metrics"):
            async with s.get(lb.url + path) as r:
                assert r.status == 200, path
        async with s.get(lb.url + "/status") as r:
            assert r.status == 401
        async with s.get(lb.url + "/metrics") as r:
            metrics = await r.text()
        assert 'outcome="Unauthorized"' in metrics


def test_a_public_address_without_keys_does_not_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SKYMESH_API_KEYS"}
    proc = subprocess.run(
        [*executable("skymesh-lb"), "--host", "0.0.0.0", "--port", "0",
         "--replicas", "http://127.0.0.1:9"], env=env, capture_output=True, text=True,
        timeout=60)
    assert proc.returncode == 2
    assert "allow_anonymous" in proc.stderr and "0.0.0.0" in proc.stderr
