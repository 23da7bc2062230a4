"""Security checks that are not covered elsewhere.

Already covered, not repeated here: the admin API refusing missing, wrong and
under-privileged tokens (tests/controller/test_controller_api.py), schemathesis against
the controller (tests/controller/test_controller_fuzz.py), peers without a valid
certificate at the gRPC layer (tests/integration/test_peering.py; the live-daemon version
is in tests/faults/test_fuzz_mesh.py).

Here: every daemon binds to loopback unless told otherwise, and a full debug-level run
of the three-region mesh under a controller never writes a secret to its logs.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
from pathlib import Path

import pytest

from skymesh.util.procs import start_daemon
from skymesh_lab.faults import client as fc
from skymesh_lab.faults.cluster import Mesh, status

pytestmark = pytest.mark.timeout(120)

CLIENT_KEY = "sk-client-" + "c0ffee" * 6  # what an OpenAI client sends as its API key


def _outside_address() -> str | None:
    """This machine's address on its default route (not loopback), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_daemons_bind_to_loopback_by_default(tmp_path: Path) -> None:
    rep = start_daemon("skymesh-replica", ["--port", "0"], log_path=tmp_path / "r.log")
    daemons = [rep]
    try:
        daemons.append(start_daemon("skymesh-lb", ["--port", "0", "--replicas", rep.url],
                                    log_path=tmp_path / "lb.log"))
        daemons.append(start_daemon(
            "skymesh-controller", ["--port", "0"], log_path=tmp_path / "c.log",
            env={**os.environ, "SKYMESH_ADMIN_TOKEN": "t" * 32}))
        outside = _outside_address()
        for d in daemons:
            host, port = d.url.removeprefix("http://").rsplit(":", 1)
            assert host == "127.0.0.1", (d.name, d.url)
            if outside is not None:  # not reachable on the machine's other address
                with pytest.raises(OSError), socket.create_connection((outside, int(port)),
                                                                      timeout=2):
                    pass
    finally:
        for d in daemons:
            d.stop()


async def test_secrets_never_reach_the_logs(tmp_path: Path) -> None:
    mesh = Mesh(tmp_path, forwarding=True, controller=True, log_level="debug",
                replicas={"us": 1, "eu": 1, "asia": 1}, time_scale=0.1)
    try:
        await mesh.start()
        async with fc.session() as s:
            await mesh.wait_ready(s)
            for lb in mesh.lbs.values():  # peering listens on loopback by default too
                assert (await status(s, lb.url))["mesh"]["address"].startswith("127.0.0.1:")
            tally = fc.Tally()
            headers = {"Authorization": f"Bearer {CLIENT_KEY}", "api-key": CLIENT_KEY,
                       "X-Session-ID": "session-1"}
            # Long prompts saturate us's one replica, so some requests are forwarded and
            # carry the mesh's secret header over loopback on the receiving side.
            bodies = [fc.chat_body(f"q{i}", 16, i % 2 == 0, prompt_words=1500)
                      for i in range(24)]
            await asyncio.gather(*(fc.send(s, mesh.lbs["us"].url, b, tally, 60, headers)
                                   for b in bodies))
            assert tally.completed == len(bodies), tally.row()
            st = await status(s, mesh.lbs["us"].url)
            assert st["mesh"]["forwarded_out"] > 0  # the secret header was exercised
            assert mesh.controller is not None
            async with s.get(mesh.controller.url + "/v1/status", headers=mesh.auth) as r:
                assert r.status == 200
            async with s.get(mesh.controller.url + "/v1/status",
                             headers={"Authorization": "Bearer wrong-" + mesh.token}) as r:
                assert r.status == 401
    finally:
        await mesh.stop()
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    assert len(logs) >= 7 and any("DEBUG" in t for t in logs.values())
    keys = [p.read_text() for p in (tmp_path / "pki").glob("*.key")]
    key_lines = [ln for k in keys for ln in k.splitlines() if ln and "-----" not in ln]
    hexes = re.compile(r"(?i)x-skymesh-forwarded\W+[0-9a-f]{16,}")
    for name, text in logs.items():
        assert mesh.token not in text, f"admin/agent token in {name}"
        assert CLIENT_KEY not in text, f"client API key in {name}"
        assert "PRIVATE KEY" not in text, f"key material in {name}"
        assert not any(ln in text for ln in key_lines), f"key material in {name}"
        assert not hexes.search(text), f"mesh secret header value in {name}"


def test_unreachable_when_bound_elsewhere_is_explicit(tmp_path: Path) -> None:
    # Binding elsewhere takes an explicit flag; a bad address fails loudly, not silently
    # falling back to all interfaces.
    with pytest.raises(RuntimeError, match="did not start"):
        start_daemon("skymesh-replica", ["--port", "0", "--host", "203.0.113.7"],
                     log_path=tmp_path / "bad.log", timeout=10)


# -- issue #23, item 5 ----------------------------------------------------------------------
@pytest.mark.parametrize("field", ["request_id", "affinity_key"])
@pytest.mark.parametrize("value", ["id\r\nX-Injected: 1", "id\n", "id\x00", "id\x1b[31m"])
async def test_forward_with_control_characters_is_invalid_argument(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, value: str) -> None:
    import grpc

    from skymesh.mesh import certs
    from skymesh.mesh.client import channel_options
    from skymesh.mesh.node import MeshNode
    from skymesh.mesh.proto import pb, pb_grpc
    from skymesh.mesh.state import new_identity
    from skymesh.mesh.tls import TlsFiles

    certs.create_ca(tmp_path)
    for name in ("lb-a", "lb-b"):
        certs.issue_cert(tmp_path, name)
    handled: list[pb.ForwardRequest] = []

    async def handle(req: pb.ForwardRequest, ctx: object) -> object:
        handled.append(req)
        yield pb.ForwardChunk(data=b"x")

    node = MeshNode(new_identity("eu", "lb-b"), TlsFiles.in_dir(tmp_path, "lb-b"),
                    local_summary=lambda include_prefix: pb.HeartbeatMsg(),
                    forward_handler=handle, on_heartbeat=lambda msg: None)
    await node.start()
    await node.add_peer("lb-a", "127.0.0.1:9")  # allowed to call; never dialled here
    try:
        ca, cert, key = TlsFiles.in_dir(tmp_path, "lb-a").read()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                             certificate_chain=cert)
        req = pb.ForwardRequest(request_id="req-1", model="m", path="/v1/completions",
                                body=b"{}")
        setattr(req, field, value)
        async with grpc.aio.secure_channel(node.address, creds,
                                           options=channel_options("lb-b")) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in pb_grpc.PeeringStub(ch).Forward(req, timeout=5):
                    pass
    finally:
        await node.stop(grace=0)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "") and "control character" in (
        info.value.details() or "")
    assert handled == []
    # (asyncio may log gRPC's poller finding an earlier test's loop closed: not ours)
    assert not [r for r in caplog.records
                if r.levelname in ("ERROR", "CRITICAL") and r.name != "asyncio"]


@pytest.mark.parametrize("days", ["-1", "0", "826", "100000"])
def test_certs_days_out_of_range_is_refused(tmp_path: Path, days: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from skymesh.cli import main

    assert main(["certs", "--out", str(tmp_path), "--ca", "--name", "lb-a",
                 "--days", days]) == 2
    assert "--days must be between 1 and 825" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing issued


@pytest.mark.parametrize("days", [1, 30, 825])
def test_certs_days_issues_exactly_that_many_days(tmp_path: Path, days: int) -> None:
    import datetime as dt

    from cryptography import x509

    from skymesh.cli import main

    assert main(["certs", "--out", str(tmp_path), "--ca", "--name", "lb-a",
                 "--days", str(days)]) == 0
    for pem in ("ca.crt", "lb-a.crt"):
        cert = x509.load_pem_x509_certificate((tmp_path / pem).read_bytes())
        assert (cert.not_valid_after_utc - cert.not_valid_before_utc
                == dt.timedelta(days=days)), pem
