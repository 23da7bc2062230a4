"""The outbound URL policy (skymesh/net/urlpolicy.py): tables of spellings, and properties."""

from __future__ import annotations

import ipaddress
import socket

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.net.resolver import PolicyResolver
from skymesh.net.urlpolicy import (
    UrlPolicy,
    UrlPolicyConfig,
    UrlRejected,
    check,
    check_hostport,
    check_static,
    join,
)

DEFAULT = UrlPolicy()
LOCAL = UrlPolicy(allow_loopback=True)

# Every spelling of a metadata or link-local address an attacker tried, plus neighbours.
NEVER = [
    "http://169.254.169.254/", "http://169.254.169.254./latest", "http://169.254.170.2/",
    "http://[::ffff:169.254.169.254]/", "http://[::ffff:a9fe:a9fe]/",
    "http://[0:0:0:0:0:ffff:169.254.169.254]/", "http://[::169.254.169.254]/",
    "http://[64:ff9b::a9fe:a9fe]/", "http://[2002:a9fe:a9fe::1]/",
    "http://2852039166/", "http://0xa9fea9fe/", "http://0251.0376.0251.0376/",
    "http://0xa9.0xfe.0xa9.0xfe/", "http://169.254.43518/", "http://169.16689662/",
    "http://[fd00:ec2::254]/", "http://[FD00:EC2::254]:80/", "http://100.100.100.200/",
    "http://metadata.google.internal/", "http://METADATA.google.internal./",
    "http://metadata/", "http://instance-data/", "http://169.254.1.1:8000",
    "http://[fe80::1]/", "http://[fe80::1%25eth0]/", "http://224.0.0.1/", "http://[ff02::1]/",
    "http://0.0.0.0:8000", "http://0/", "http://[::]/", "http://255.255.255.255/",
]
SYNTAX = [
    "ftp://10.0.0.1/", "file:///etc/passwd", "gopher://10.0.0.1/", "10.0.0.1:80",
    "http://user:pw@10.0.0.1/", "http://user@10.0.0.1/", "http://10.0.0.1@evil.example/",
    "http://10.0.0.1/?x=1", "http://10.0.0.1/#frag", "http://10.0.0.1?", "http://10.0.0.1/#",
    "http://10.0.0.1\\@evil/", "http://10.0.0.1/a b", "http://10.0.0.1/\r\nX: y",
    "http://%31%30.0.0.1/", "http://127.1/", "http://127.000.000.001/", "http:///path",
    "http://10.0.0.1:0/", "http://10.0.0.1:99999/", "http://[::1/", "http://exa mple.com/",
]
LOOPBACK = ["http://127.0.0.1:8000", "http://127.9.9.9/", "http://[::1]:8000/",
            "http://[::ffff:127.0.0.1]/"]
PRIVATE = ["http://10.0.0.1:8000", "http://172.16.5.4/", "http://192.168.1.1/v1",
           "http://100.64.0.1/", "http://[fd12:3456::1]:8000/", "http://[::ffff:10.1.1.1]/"]
PUBLIC = ["http://8.8.8.8/", "https://api.example.com/v1", "http://replica-1.internal:8000",
          "http://my_service:8000/", "http://[2606:4700::1111]/", "https://example.com./"]


@pytest.mark.parametrize("url", NEVER + SYNTAX)
def test_denied_whatever_the_policy_allows(url: str) -> None:
    everything = UrlPolicy.build(allow_private=True, allow_loopback=True,
                                 allow_networks=["0.0.0.0/0", "::/0"],
                                 allow_hosts=["metadata.google.internal", "metadata"])
    for policy in (DEFAULT, LOCAL, everything):
        with pytest.raises(UrlRejected):
            check_static(url, policy)


@pytest.mark.parametrize("url", LOOPBACK)
def test_loopback_only_when_allowed(url: str) -> None:
    with pytest.raises(UrlRejected, match="loopback"):
        check_static(url, DEFAULT)
    check_static(url, LOCAL)
    check_static(url, UrlPolicy.build(allow_networks=["127.0.0.0/8", "::1/128"]))


@pytest.mark.parametrize("url", PRIVATE)
def test_private_allowed_by_default_and_deniable(url: str) -> None:
    check_static(url, DEFAULT)
    with pytest.raises(UrlRejected, match="private"):
        check_static(url, UrlPolicy(allow_private=False))


@pytest.mark.parametrize("url", PUBLIC)
def test_public_addresses_and_names_pass(url: str) -> None:
    check_static(url, UrlPolicy(allow_private=False))


def test_messages_name_the_real_address() -> None:
    with pytest.raises(UrlRejected, match=r"169\.254\.169\.254"):
        check_static("http://2852039166/", DEFAULT)
    with pytest.raises(UrlRejected, match="credentials"):
        check_static("http://a:b@10.0.0.1/", DEFAULT)
    with pytest.raises(UrlRejected, match="query"):
        check_static("http://10.0.0.1/?", DEFAULT)


def fake_dns(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    async def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]
    return resolve


DNS = fake_dns({
    "evil.example": ["169.254.169.254"], "mixed.example": ["10.0.0.5", "169.254.169.254"],
    "mapped.example": ["::ffff:169.254.169.254"], "replica.internal": ["10.0.0.5", "fd00::5"],
    "lo.example": ["127.0.0.1"], "empty.example": [], "zone.example": ["fe80::1%eth0"],
})


@pytest.mark.parametrize(("url", "ok"), [
    ("http://replica.internal:8000", True), ("http://evil.example/", False),
    ("http://mixed.example/", False), ("http://mapped.example/", False),
    ("http://lo.example/", False), ("http://empty.example/", False),
    ("http://nowhere.example/", False), ("http://zone.example/", False),
])
async def test_every_resolved_address_is_checked(url: str, ok: bool) -> None:
    if ok:
        assert await check(url, DEFAULT, DNS)
    else:
        with pytest.raises(UrlRejected):
            await check(url, DEFAULT, DNS)


async def test_allow_hosts_skips_the_loopback_test_but_never_the_metadata_one() -> None:
    policy = UrlPolicy.build(allow_hosts=["lo.example.", "evil.example"])
    assert await check("http://LO.example:1/", policy, DNS) == [
        ipaddress.ip_address("127.0.0.1")]
    with pytest.raises(UrlRejected, match="metadata"):
        await check("http://evil.example/", policy, DNS)


def test_hostport_for_peering_listeners() -> None:
    assert check_hostport("10.0.0.1:7001", DEFAULT).port == 7001
    for bad in ("169.254.169.254:7001", "10.0.0.1", "u@10.0.0.1:1", "10.0.0.1:1/x?y"):
        with pytest.raises(UrlRejected):
            check_hostport(bad, DEFAULT)


@pytest.mark.parametrize(("base", "path", "want"), [
    ("http://h:1", "/health", "http://h:1/health"),
    ("http://h:1/", "health", "http://h:1/health"),
    ("http://h:1/v1", "/health", "http://h:1/v1/health"),
    ("http://h:1/v1/", "get_load", "http://h:1/v1/get_load"),
])
def test_join_appends_path_segments(base: str, path: str, want: str) -> None:
    assert join(base, path) == want


def test_join_refuses_a_base_that_would_choose_the_path() -> None:
    for base in ("http://h:1/admin?", "http://h:1/admin#", "http://h:1/?x=/"):
        with pytest.raises(UrlRejected):
            join(base, "/health")


def test_config_rejects_bad_or_useless_networks() -> None:
    assert UrlPolicyConfig().policy() == UrlPolicy()
    with pytest.raises(ValueError, match="CIDR"):
        UrlPolicyConfig(allow_networks=["not-a-net"])
    with pytest.raises(ValueError, match="never allowed"):
        UrlPolicyConfig(allow_networks=["169.254.0.0/16"])
    p = UrlPolicyConfig(allow_networks=["192.0.2.0/24"], allow_hosts=["A.example."]).policy()
    check_static("http://192.0.2.7/", p)
    assert p.allow_hosts == frozenset({"a.example"})


async def test_policy_resolver_refuses_at_connect_time() -> None:
    # DNS answered something harmless at registration and the metadata address now: the
    # connector itself refuses, so nothing is sent.
    connector = aiohttp.TCPConnector(resolver=PolicyResolver(DEFAULT, DNS))
    async with aiohttp.ClientSession(connector=connector) as s:
        with pytest.raises(aiohttp.ClientConnectorError, match="URL policy"):
            await s.get("http://evil.example:80/health")
    ok = await PolicyResolver(DEFAULT, DNS).resolve("replica.internal", 8000)
    assert {r["host"] for r in ok} == {"10.0.0.5", "fd00::5"}


# -- properties ---------------------------------------------------------------------------
ipv4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
never_v4 = st.one_of(st.integers(0xA9FE0000, 0xA9FEFFFF), st.integers(0xE0000000, 0xEFFFFFFF),
                     st.integers(0, 0x00FFFFFF)).map(ipaddress.IPv4Address)


@settings(max_examples=300, deadline=None)
@given(never_v4)
def test_never_allowed_v4_is_denied_in_every_spelling(ip: ipaddress.IPv4Address) -> None:
    everything = UrlPolicy.build(allow_loopback=True, allow_networks=["0.0.0.0/0", "::/0"])
    n = int(ip)
    spellings = [str(ip), f"[::ffff:{ip}]", f"[::ffff:{n >> 16:x}:{n & 0xFFFF:x}]", str(n),
                 hex(n), "0" + oct(n)[2:], ".".join(hex(int(p)) for p in str(ip).split("."))]
    for host in spellings:
        with pytest.raises(UrlRejected):
            check_static(f"http://{host}:8000/", everything)


@settings(max_examples=300, deadline=None)
@given(ipv4)
def test_mapped_v6_gets_the_same_verdict_as_its_v4(ip: ipaddress.IPv4Address) -> None:
    for policy in (DEFAULT, LOCAL, UrlPolicy(allow_private=False)):
        mapped = ipaddress.IPv6Address(f"::ffff:{ip}")
        assert (policy.verdict(ip) is None) == (policy.verdict(mapped) is None)


@settings(max_examples=300, deadline=None)
@given(ipv4, st.booleans(), st.booleans())
def test_allowing_more_never_denies_more(ip: ipaddress.IPv4Address, private: bool,
                                         loopback: bool) -> None:
    narrow = UrlPolicy(allow_private=private, allow_loopback=loopback)
    wide = UrlPolicy(allow_private=True, allow_loopback=True)
    if narrow.verdict(ip) is None:
        assert wide.verdict(ip) is None
