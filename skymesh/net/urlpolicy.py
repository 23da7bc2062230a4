"""The outbound URL policy: which URLs the controller and the balancers may fetch.

Replica, balancer and peer addresses reach us from API callers (an ``agent`` token is
enough to register one), so every one is checked before anything connects to it, or the
controller becomes a proxy into its own network (SSRF). A URL passes when:

- the scheme is ``http`` or ``https``, there is no userinfo (``user:pass@``), and a base
  URL has no query or fragment (fixed paths are appended by URL joining: :func:`join`);
- the host is a DNS name of letters, digits, ``-``, ``_`` and ``.``, or an IP literal
  written canonically (dotted-decimal IPv4, bracketed IPv6 without a zone id): integer,
  octal, hex and short IPv4 spellings (``2852039166``, ``0251.0376.0251.0376``, ``127.1``)
  are refused, whatever address they stand for;
- every address the host resolves to (``getaddrinfo`` through an injectable
  :data:`Resolver`), and any IPv4 address embedded in an IPv6 one (mapped, compatible,
  NAT64, 6to4, Teredo), is allowed by :meth:`UrlPolicy.verdict`.

Never allowed: link-local (169.254/16, fe80::/10), cloud metadata addresses and names
(169.254.169.254, fd00:ec2::254, 100.100.100.200, metadata.google.internal, ...),
multicast, unspecified (0.0.0.0/8, ::), broadcast. Allowed only when the deployment says
so: loopback (``allow_loopback``), private (``allow_private``: RFC 1918, 100.64/10, ULA
fc00::/7) and other special-purpose ranges (listed in ``allow_networks``). Defaults: private
allowed (replicas live on VPC addresses), loopback denied. ``allow_hosts`` names hosts whose
addresses skip the private/loopback/special test (never the never-allowed list).

DNS can change between registration and fetch, so callers check again when they fetch;
:class:`skymesh.net.resolver.PolicyResolver` plugs the check (:func:`resolve_checked`)
into aiohttp's connector, so the addresses the connection actually uses are the ones that
were checked (no rebinding window). It lives apart so that what only checks URLs (the
balancer's config, and with it the workers' supervisor) does not load aiohttp.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import SplitResult, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host, port) -> the addresses it resolves to, as strings.
Resolver = Callable[[str, int], Awaitable[list[str]]]

_net = ipaddress.ip_network
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "169.254.169.253", "169.254.169.123",  # AWS
    "fd00:ec2::254", "fd00:ec2::23", "fd00:ec2::123",                         # AWS IPv6
    "100.100.100.200",                                                        # Alibaba
    "168.63.129.16",                                                          # Azure
))
METADATA_HOSTS = frozenset((
    "metadata", "metadata.google.internal", "metadata.goog", "metadata.azure.internal",
    "instance-data", "instance-data.ec2.internal", "metadata.tencentyun.com",
    "metadata.packet.net", "metadata.platformequinix.com",
))
_NEVER = (_net("0.0.0.0/8"), _net("169.254.0.0/16"), _net("224.0.0.0/4"),
          _net("255.255.255.255/32"), _net("::/128"), _net("fe80::/10"), _net("ff00::/8"))
_PRIVATE = (_net("10.0.0.0/8"), _net("172.16.0.0/12"), _net("192.168.0.0/16"),
            _net("100.64.0.0/10"), _net("fc00::/7"))
_NAT64 = _net("64:ff9b::/96")
_HOST_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*$")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")


class UrlRejected(ValueError):
    """The URL may not be fetched; the message says why in one line."""


@dataclass(frozen=True)
class UrlPolicy:
    allow_private: bool = True
    allow_loopback: bool = False
    allow_networks: tuple[IPNetwork, ...] = ()
    allow_hosts: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def build(cls, allow_private: bool = True, allow_loopback: bool = False,
              allow_networks: Iterable[str] = (), allow_hosts: Iterable[str] = ()
              ) -> UrlPolicy:
        return cls(allow_private, allow_loopback,
                   tuple(ipaddress.ip_network(n, strict=False) for n in allow_networks),
                   frozenset(_name(h) for h in allow_hosts))

    def verdict(self, ip: IPAddress, host_allowed: bool = False) -> str | None:
        """Why ``ip`` may not be fetched, or None when it may."""
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            why = self._one(ip.ipv4_mapped, host_allowed)  # it *is* that IPv4 address
            return None if why is None else f"{why} (as {ip})"
        for addr in (*_embedded_v4(ip), ip):
            why = self._one(addr, host_allowed)
            if why is not None:
                return why if addr == ip else f"{why} (embedded in {ip})"
        return None

    def _one(self, ip: IPAddress, host_allowed: bool) -> str | None:
        if ip in METADATA_ADDRESSES:
            return f"{ip} is a cloud metadata address"
        if ip.is_link_local:
            return f"{ip} is link-local"
        if ip.is_multicast:
            return f"{ip} is multicast"
        if any(ip in n for n in _NEVER):
            return f"{ip} is unspecified or broadcast"
        if host_allowed or any(ip in n for n in self.allow_networks):
            return None
        if ip.is_loopback:
            return None if self.allow_loopback else (
                f"{ip} is loopback (allowed only with url_policy.allow_loopback)")
        if any(ip in n for n in _PRIVATE):
            return None if self.allow_private else (
                f"{ip} is private (allowed only with url_policy.allow_private)")
        if not ip.is_global:
            return f"{ip} is a special-purpose address (list it in url_policy.allow_networks)"
        return None


def _name(host: str) -> str:
    return host.lower().removesuffix(".")


def _embedded_v4(ip: IPAddress) -> list[ipaddress.IPv4Address]:
    if not isinstance(ip, ipaddress.IPv6Address):
        return []
    out = [a for a in (ip.sixtofour,) if a is not None]
    if ip.teredo is not None:
        out.append(ip.teredo[1])
    packed = int(ip)
    if ip in _NAT64 or (packed >> 32 == 0 and packed > 1):  # NAT64, or ::a.b.c.d
        out.append(ipaddress.IPv4Address(packed & 0xFFFFFFFF))
    return out


@dataclass(frozen=True)
class Target:
    """A URL that passed the syntax checks: its parts, and the IP when it is a literal."""

    url: str
    scheme: str
    host: str  # lower case, no trailing dot, IPv6 without brackets
    port: int
    ip: IPAddress | None


def parse(url: str) -> Target:
    """Syntax checks only (no DNS): scheme, userinfo, query, fragment, host spelling."""
    if not isinstance(url, str) or any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise UrlRejected("must be a URL without spaces or control characters")
    try:
        parts: SplitResult = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UrlRejected(f"not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise UrlRejected("must be an http:// or https:// URL")
    if "@" in parts.netloc or parts.username is not None:
        raise UrlRejected("must not carry credentials (user:password@)")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise UrlRejected("a base URL may not have a query (?) or fragment (#)")
    if "\\" in url:
        raise UrlRejected("must not contain backslashes")
    raw = parts.netloc.rpartition(":")[0] if port is not None else parts.netloc
    raw = raw.removesuffix(":")  # "http://host:/" has an empty port
    if not raw:
        raise UrlRejected("has no host")
    ip: IPAddress | None
    if raw.startswith("["):
        inner = raw[1:-1] if raw.endswith("]") else ""
        if "%" in inner:
            raise UrlRejected("IPv6 zone ids (%...) are not allowed")
        try:
            ip = ipaddress.IPv6Address(inner)
        except ValueError:
            raise UrlRejected(f"host {raw} is not a valid IPv6 address") from None
        host = str(ip)
    else:
        host = _name(raw)
        ip = _ipv4_literal(host)
        if ip is None and not _HOST_NAME.match(host):
            raise UrlRejected(f"host {raw!r} is not a DNS name or an IP address")
    if port is None:
        port = 443 if scheme == "https" else 80
    if port == 0:
        raise UrlRejected("port 0 cannot be fetched")
    return Target(url, scheme, host, port, ip)


def _ipv4_literal(host: str) -> ipaddress.IPv4Address | None:
    """The host as IPv4 when it ends in a numeric label (WHATWG URL rules); anything but
    canonical dotted decimal is refused, since resolvers and browsers read those forms as
    addresses (``2852039166`` is 169.254.169.254)."""
    labels = host.split(".")
    if not _NUMERIC_LABEL.match(labels[-1]):
        return None
    try:
        return ipaddress.IPv4Address(host)
    except ValueError:
        pass
    decoded = _inet_aton(labels)
    shown = f" ({decoded})" if decoded is not None else ""
    raise UrlRejected(f"host {host!r}{shown} is not a canonical IPv4 address: write it as "
                      "four decimal numbers, a.b.c.d")


def _inet_aton(labels: list[str]) -> ipaddress.IPv4Address | None:
    """What inet_aton(3) makes of a numeric host, for the error message."""
    try:
        nums = [int(p, 16) if p.startswith("0x") else int(p, 8) if len(p) > 1 and
                p.startswith("0") else int(p) for p in labels]
    except ValueError:
        return None
    if not 1 <= len(nums) <= 4 or any(n > 255 for n in nums[:-1]):
        return None
    value = 0
    for n in nums[:-1]:
        value = value << 8 | n
    value = value << 8 * (5 - len(nums)) | nums[-1]
    return ipaddress.IPv4Address(value) if value < 2**32 else None


def check_static(url: str, policy: UrlPolicy) -> Target:
    """Everything that needs no DNS: syntax, an IP literal's address, metadata host names."""
    t = parse(url)
    if t.host in METADATA_HOSTS:
        raise UrlRejected(f"host {t.host} is a cloud metadata service")
    if t.ip is not None:
        why = policy.verdict(t.ip)
        if why is not None:
            raise UrlRejected(why)
    return t


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def check_addresses(t: Target, addresses: Iterable[str], policy: UrlPolicy) -> list[IPAddress]:
    """Every address must pass; a resolver answering with none is a refusal too."""
    allowed_name = t.host in policy.allow_hosts
    out: list[IPAddress] = []
    for a in addresses:
        try:
            ip = ipaddress.ip_address(a.split("%", 1)[0])
        except ValueError:
            raise UrlRejected(f"host {t.host} resolved to {a!r}, not an address") from None
        why = policy.verdict(ip, allowed_name)
        if why is not None:
            raise UrlRejected(f"host {t.host} resolves to a denied address: {why}")
        out.append(ip)
    if not out:
        raise UrlRejected(f"host {t.host} does not resolve")
    return out


async def check(url: str, policy: UrlPolicy, resolver: Resolver = system_resolver
                ) -> list[IPAddress]:
    """The whole check; returns the addresses the URL may be fetched at."""
    t = check_static(url, policy)
    if t.ip is not None:
        return [t.ip]
    try:
        addresses = await resolver(t.host, t.port)
    except OSError as exc:
        raise UrlRejected(f"host {t.host} does not resolve: {exc}") from None
    return check_addresses(t, addresses, policy)


def check_hostport(address: str, policy: UrlPolicy) -> Target:
    """A ``host:port`` (a gRPC peering listener) under the same static rules."""
    t = check_static(f"http://{address}", policy)
    if ":" not in address.rsplit("]", 1)[-1]:
        raise UrlRejected("must be host:port")
    return t


def join(base: str, path: str) -> str:
    """``base`` with the fixed ``path`` appended as path segments (never string pasting:
    a ``?`` or ``#`` in either part cannot change which resource is fetched)."""
    # Here, not at the top: the balancer's config (and the workers' supervisor) checks URLs
    # but joins none; yarl brings multidict, idna and propcache with it.
    from yarl import URL

    u = URL(base)
    if "?" in base or "#" in base:
        raise UrlRejected("a base URL may not have a query (?) or fragment (#)")
    return str(u.joinpath(*[p for p in path.split("/") if p]))


async def resolve_checked(host: str, port: int, policy: UrlPolicy,
                          resolver: Resolver = system_resolver) -> list[IPAddress]:
    """The addresses ``host`` resolves to now, each allowed by ``policy``; else an
    ``OSError`` (``EACCES``), which a connector reports as a connect error. What
    :class:`skymesh.net.resolver.PolicyResolver` asks for every name aiohttp connects to."""
    t = Target(host, "http", _name(host), port, None)
    if t.host in METADATA_HOSTS:
        raise OSError(errno.EACCES, f"refused by the URL policy: {host} is a cloud "
                                    "metadata service")
    try:
        return check_addresses(t, await resolver(host, port), policy)
    except UrlRejected as exc:
        raise OSError(errno.EACCES, f"refused by the URL policy: {exc}") from None


class UrlPolicyConfig(BaseModel):
    """The ``url_policy`` section of the controller's and the balancer's config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow_private: bool = True
    allow_loopback: bool = False
    allow_networks: list[str] = Field(default_factory=list,
                                      description="CIDRs allowed although special-purpose")
    allow_hosts: list[str] = Field(default_factory=list,
                                   description="host names whose addresses are allowed")

    @field_validator("allow_networks")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for n in v:
            try:
                net = ipaddress.ip_network(n, strict=False)
            except ValueError:
                raise ValueError(f"{n!r} is not a CIDR network") from None
            never = [m for m in (*_NEVER, *(_net(f"{a}/{a.max_prefixlen}")
                                            for a in METADATA_ADDRESSES))
                     if m.version == net.version and net.subnet_of(m)]  # type: ignore[arg-type]
            if never:
                raise ValueError(f"{n} is never allowed (link-local, metadata, multicast or "
                                 "unspecified)")
        return v

    def policy(self) -> UrlPolicy:
        return UrlPolicy.build(self.allow_private, self.allow_loopback, self.allow_networks,
                               self.allow_hosts)
