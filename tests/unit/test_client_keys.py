"""Client API keys at the balancer: loading them, checking them, the key for replicas."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skymesh.balancer.auth import ClientKeys, is_loopback, load_client_keys, upstream_key
from skymesh.balancer.config import AuthConfig, ConfigError, parse_config


def test_a_key_from_the_environment_opens_the_door_and_only_it() -> None:
    keys = load_client_keys(AuthConfig(), "127.0.0.1", {"SKYMESH_API_KEYS": "k1, k2"})
    assert keys.required
    assert keys.allows("Bearer k1") and keys.allows("bearer k2")
    for header in (None, "", "Bearer", "Bearer k3", "Basic k1", "k1", "Bearer k1x"):
        assert not keys.allows(header), header


def test_keys_file_takes_one_key_per_line_with_comments(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team a\nsk-a\n\n  sk-b   # rotated 2026-11\n")
    keys = load_client_keys(AuthConfig(api_keys_file=str(f)), "0.0.0.0", {})
    assert keys.allows("Bearer sk-a") and keys.allows("Bearer sk-b")
    assert not keys.allows("Bearer # team a")


def test_a_malformed_keys_file_is_refused_naming_the_line(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("sk-a\ntwo words\n")
    with pytest.raises(ConfigError, match=r"api_keys_file .*line 2"):
        load_client_keys(AuthConfig(api_keys_file=str(f)), "127.0.0.1", {})


def test_an_unreadable_keys_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"auth\.api_keys_file: cannot read"):
        load_client_keys(AuthConfig(api_keys_file=str(tmp_path / "missing")), "::1", {})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.1.5", "lb.example.com"])
def test_a_public_address_without_keys_refuses_to_start(host: str) -> None:
    with pytest.raises(ConfigError, match="allow_anonymous"):
        load_client_keys(AuthConfig(), host, {})
    assert not load_client_keys(AuthConfig(allow_anonymous=True), host, {}).required


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.1.2.3"])
def test_loopback_serves_without_keys(host: str) -> None:
    assert is_loopback(host)
    keys = load_client_keys(AuthConfig(), host, {})
    assert not keys.required and keys.allows(None)


def test_upstream_key_comes_from_the_named_variable() -> None:
    assert upstream_key(None, {}) is None
    assert upstream_key("REPLICA_KEY", {"REPLICA_KEY": " sk-up "}) == "sk-up"
    with pytest.raises(ConfigError, match=r"upstream.api_key_env: \$REPLICA_KEY"):
        upstream_key("REPLICA_KEY", {})


def test_auth_section_is_strict() -> None:
    cfg = parse_config({"auth": {"api_keys_file": "/etc/skymesh/api-keys",
                                 "allow_anonymous": False}})
    assert cfg.auth.api_keys_file == "/etc/skymesh/api-keys"
    with pytest.raises(ConfigError, match=r"auth\.api_key"):
        parse_config({"auth": {"api_key": "inline keys are not a thing"}})


def test_duplicate_keys_are_kept_once_and_never_in_the_clear() -> None:
    keys = load_client_keys(AuthConfig(), "127.0.0.1", {"SKYMESH_API_KEYS": "a,a,b"})
    assert keys == ClientKeys.of(["b", "a"]) and len(keys.digests) == 2
    assert b"a" not in keys.digests and keys.allows("Bearer a")


def test_tls_context_loads_a_pair_and_names_what_is_wrong(tmp_path: Path) -> None:
    from skymesh.balancer.auth import server_ssl_context
    from skymesh.balancer.config import ListenTlsConfig
    from skymesh.mesh import certs

    certs.create_ca(tmp_path)
    a, b = certs.issue_cert(tmp_path, "edge-a"), certs.issue_cert(tmp_path, "edge-b")
    ctx = server_ssl_context(ListenTlsConfig(cert_file=str(a.cert), key_file=str(a.key),
                                             min_version="1.3"))
    assert ctx.minimum_version.name == "TLSv1_3"
    with pytest.raises(ConfigError, match=r"listen\.tls: cannot load"):
        server_ssl_context(ListenTlsConfig(cert_file=str(a.cert), key_file=str(b.key)))
    with pytest.raises(ConfigError, match=r"listen\.tls\.key_file"):
        server_ssl_context(ListenTlsConfig(cert_file=str(a.cert),
                                           key_file=str(tmp_path / "missing.key")))


def _rewrite(path: Path, text: str) -> None:
    """Replace a file the way deploy tools do: a new file renamed over the old one."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(path)


def test_edge_files_pick_up_a_rotated_keys_file_and_keep_the_old_on_a_bad_one(
        tmp_path: Path) -> None:
    from skymesh.balancer.auth import EdgeFiles

    f = tmp_path / "keys"
    f.write_text("sk-old\n")
    edge = EdgeFiles(AuthConfig(api_keys_file=str(f)), "0.0.0.0", None, {})
    assert edge.check() == []  # nothing changed
    _rewrite(f, "sk-new\n")
    assert edge.check() == ["keys"]
    assert edge.keys.allows("Bearer sk-new") and not edge.keys.allows("Bearer sk-old")
    _rewrite(f, "two words\n")  # malformed: the previous keys stay
    assert edge.check() == [] and edge.errors == 1
    assert edge.keys.allows("Bearer sk-new")
    _rewrite(f, "# emptied\n")  # no keys on a public address: refused too
    assert edge.check() == [] and edge.errors == 2
    assert edge.keys.allows("Bearer sk-new")
    f.unlink()  # gone for a moment (a Secret being swapped): nothing happens
    assert edge.check() == [] and edge.errors == 2
    _rewrite(f, "sk-third\n")
    assert edge.check() == ["keys"] and edge.keys.allows("Bearer sk-third")


def test_edge_files_swap_the_certificate_in_the_live_context(tmp_path: Path) -> None:
    from skymesh.balancer.auth import EdgeFiles
    from skymesh.balancer.config import ListenTlsConfig
    from skymesh.mesh import certs

    certs.create_ca(tmp_path / "ca")
    first = certs.issue_cert(tmp_path / "a", "edge", ca_dir=tmp_path / "ca")
    second = certs.issue_cert(tmp_path / "b", "edge", ca_dir=tmp_path / "ca")
    live_cert, live_key = tmp_path / "edge.crt", tmp_path / "edge.key"
    live_cert.write_bytes(first.cert.read_bytes())
    live_key.write_bytes(first.key.read_bytes())
    tls = ListenTlsConfig(cert_file=str(live_cert), key_file=str(live_key))
    edge = EdgeFiles(AuthConfig(), "127.0.0.1", tls, {})
    ctx = edge.ssl_context
    assert ctx is not None
    # A certificate whose key has not arrived yet does not load: the old pair stays.
    _rewrite(live_cert, second.cert.read_text())
    assert edge.check() == [] and edge.errors == 1
    _rewrite(live_key, second.key.read_text())
    assert edge.check() == ["tls"] and edge.ssl_context is ctx


def test_nothing_to_watch_without_a_keys_file_or_tls() -> None:
    from skymesh.balancer.auth import EdgeFiles

    assert not EdgeFiles(AuthConfig(), "127.0.0.1", None, {"SKYMESH_API_KEYS": "k"}).watching


@given(st.text(max_size=80))
def test_any_header_value_is_refused_unless_it_is_bearer_and_a_key(value: str) -> None:
    keys = ClientKeys.of(["sk-right"])
    scheme, _, rest = value.partition(" ")
    expected = scheme.lower() == "bearer" and rest.strip() == "sk-right"
    assert keys.allows(value) is expected
