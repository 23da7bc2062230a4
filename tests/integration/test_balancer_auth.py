"""Client API keys on a live skymesh-lb, in front of a replica that wants its own key
(as vLLM with --api-key): clients need the balancer's key, replicas get theirs, and a
public address without keys refuses to start."""

from __future__ import annotations

import contextlib
import os
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import content_of, read_sse, until

from skymesh.mesh import certs
from skymesh.util.procs import Daemon, executable, start_daemon

CLIENT_KEY = "sk-client-3f9a"
REPLICA_KEY = "sk-replica-77c1"


# The keys a test gives, not the ones the shell running it may have.
_INHERITED = {k: v for k, v in os.environ.items() if k != "SKYMESH_API_KEYS"}


@contextlib.contextmanager
def replica_and_lb(tmp: Path, replica_args: list[str], cfg: dict[str, Any],
                   env: dict[str, str] | None = None) -> Iterator[tuple[Daemon, Daemon]]:
    """A replica, and a balancer in front of it (``cfg`` plus the replica); both stopped
    afterwards, whatever happens."""
    rep = start_daemon("skymesh-replica", ["--port", "0", *replica_args],
                       log_path=tmp / "replica.log")
    try:
        (tmp / "lb.yaml").write_text(yaml.safe_dump({**cfg, "replicas": [{"url": rep.url}]}))
        lb = start_daemon("skymesh-lb", ["--config", str(tmp / "lb.yaml")],
                          log_path=tmp / "lb.log", env={**_INHERITED, **(env or {})})
        try:
            yield lb, rep
        finally:
            lb.stop()
    finally:
        rep.stop()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    cfg = {"region": "test", "listen": {"host": "127.0.0.1", "port": 0},
           "probe": {"interval_s": 0.05}, "upstream": {"api_key_env": "TEST_REPLICA_KEY"}}
    env = {"SKYMESH_API_KEYS": f"sk-other,{CLIENT_KEY}", "TEST_REPLICA_KEY": REPLICA_KEY}
    with replica_and_lb(tmp_path_factory.mktemp("auth"),
                        ["--time-scale", "0.05", "--api-key", REPLICA_KEY], cfg, env) as pair:
        yield pair


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
    proc = subprocess.run(
        [*executable("skymesh-lb"), "--host", "0.0.0.0", "--port", "0",
         "--replicas", "http://127.0.0.1:9"], env=_INHERITED, capture_output=True, text=True,
        timeout=60)
    assert proc.returncode == 2
    assert "allow_anonymous" in proc.stderr and "0.0.0.0" in proc.stderr


def _swap(src: Path, dst: Path) -> None:
    """Replace ``dst`` with ``src``'s bytes the way deploy tools do (a rename)."""
    tmp = dst.with_name(dst.name + ".new")
    tmp.write_bytes(src.read_bytes())
    tmp.replace(dst)


async def test_a_tls_edge_serves_clients_that_trust_it_and_rotates_keys_and_certificate(
        tmp_path: Path) -> None:
    certs.create_ca(tmp_path / "ca1")
    first = certs.issue_cert(tmp_path / "ca1", "lb-edge")
    live_cert, live_key = tmp_path / "edge.crt", tmp_path / "edge.key"
    _swap(first.cert, live_cert)
    _swap(first.key, live_key)
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(f"{CLIENT_KEY}\n")
    cfg = {"listen": {"host": "127.0.0.1", "port": 0,
                      "tls": {"cert_file": str(live_cert), "key_file": str(live_key),
                              "min_version": "1.3"}},
           "auth": {"api_keys_file": str(keys_file), "reload_interval_s": 0.1}}
    with replica_and_lb(tmp_path, ["--time-scale", "0.05"], cfg) as (lb, _):
        assert lb.url.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=str(first.ca))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trust)) as s:
            async def ready() -> bool:
                async with s.get(lb.url + "/ready") as r:
                    return r.status == 200
            await until(ready, "a healthy replica behind the TLS edge")
            async with s.get(lb.url + "/v1/models", headers=_bearer(CLIENT_KEY)) as r:
                model = (await r.json())["data"][0]["id"]
            chat = {"model": model, "stream": True, "max_tokens": 6,
                    "messages": [{"role": "user", "content": "over TLS"}]}
            async with s.post(lb.url + "/v1/chat/completions", json=chat,
                              headers=_bearer(CLIENT_KEY)) as r:
                assert r.status == 200
                assert content_of(await read_sse(r))

            # A rotated keys file takes effect without a restart.
            (tmp_path / "keys.new").write_text("sk-rotated\n")
            _swap(tmp_path / "keys.new", keys_file)

            async def models_status(key: str) -> int:
                async with s.get(lb.url + "/v1/models", headers=_bearer(key)) as r:
                    return r.status

            async def rotated_in() -> bool:
                return await models_status("sk-rotated") == 200
            await until(rotated_in, "the rotated key accepted")
            assert await models_status(CLIENT_KEY) == 401

        # So does a certificate from another CA: new connections get it.
        certs.create_ca(tmp_path / "ca2")
        second = certs.issue_cert(tmp_path / "ca2", "lb-edge")
        _swap(second.key, live_key)
        _swap(second.cert, live_cert)
        trust2 = ssl.create_default_context(cafile=str(second.ca))

        async def new_certificate_served() -> bool:
            try:
                async with aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(ssl=trust2)) as s2, \
                        s2.get(lb.url + "/health") as r:
                    return r.status == 200
            except aiohttp.ClientConnectorCertificateError:
                return False
        await until(new_certificate_served, "the new certificate served")

        # Plain HTTP to the TLS port, and TLS without trusting the CA, get nothing.
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientError):
                async with s.get(lb.url.replace("https://", "http://") + "/health") as r:
                    await r.read()
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with s.get(lb.url + "/health") as r:
                    await r.read()


def test_a_missing_certificate_stops_the_start(tmp_path: Path) -> None:
    cfg = {"listen": {"port": 0, "tls": {"cert_file": str(tmp_path / "none.crt"),
                                         "key_file": str(tmp_path / "none.key")}},
           "replicas": [{"url": "http://127.0.0.1:9"}]}
    (tmp_path / "lb.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([*executable("skymesh-lb"), "--config", str(tmp_path / "lb.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "listen.tls.cert_file" in proc.stderr


async def test_one_key_cannot_hold_more_than_its_share(tmp_path: Path) -> None:
    # One process: the cap holds per worker, and two could each let one request in.
    cfg = {"listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
           "probe": {"interval_s": 0.05},
           "auth": {"max_in_flight_per_key": 1}, "pushing": {"mode": "bp"}}
    with replica_and_lb(tmp_path, [], cfg, {"SKYMESH_API_KEYS": "sk-a,sk-b"}) as (lb, _):
        async with aiohttp.ClientSession() as s:
            async def status() -> dict[str, Any]:
                async with s.get(lb.url + "/status", headers=_bearer("sk-a")) as r:
                    out: dict[str, Any] = await r.json()
                    return out

            async def ready() -> bool:
                async with s.get(lb.url + "/ready") as r:
                    return r.status == 200
            await until(ready, "the replica healthy")
            async with s.get(lb.url + "/v1/models", headers=_bearer("sk-a")) as r:
                model = (await r.json())["data"][0]["id"]
            # Real-time emulation: 400 tokens keep the first stream open for seconds.
            long = {"model": model, "stream": True, "max_tokens": 400, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "a long answer"}]}
            short = {**long, "max_tokens": 2}
            first = await s.post(lb.url + "/v1/chat/completions", json=long,
                                 headers=_bearer("sk-a"))
            try:
                assert first.status == 200
                await first.content.readany()  # it has started
                async with s.post(lb.url + "/v1/chat/completions", json=short,
                                  headers=_bearer("sk-a")) as r:
                    assert r.status == 429
                    assert r.headers["Retry-After"] == "1"
                    assert "max_in_flight_per_key" in (await r.json())["error"]["message"]
                async with s.post(lb.url + "/v1/chat/completions", json=short,
                                  headers=_bearer("sk-b")) as r:
                    assert r.status == 200  # another key is not held back
                    await r.read()
                assert (await status())["auth"]["keys_in_flight"] == 1
            finally:
                first.close()  # the client goes away: its slot must come back

            async def released() -> bool:
                return (await status())["auth"]["keys_in_flight"] == 0
            await until(released, "the key's slot released")
            async with s.post(lb.url + "/v1/chat/completions", json=short,
                              headers=_bearer("sk-a")) as r:
                assert r.status == 200
                await r.read()
            async with s.get(lb.url + "/metrics") as r:
                metrics = await r.text()
            # Told apart from a full queue (outcome "Overloaded").
            assert 'outcome="KeyAtCap"} 1.0' in metrics
