"""The balancer's edge for clients: API keys, the key it shows the replicas, and TLS.

The keys are loaded at start (:func:`load_client_keys`) and again when their file changes
(:class:`EdgeFiles`, which also reloads the TLS certificate); they are kept as SHA-256
digests (:class:`ClientKeys`). Requests a peer balancer forwarded over the
mesh are let through by the caller: the peer authenticated itself with its certificate,
and the client with the peer.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from skymesh.balancer.config import AuthConfig, ConfigError, ListenTlsConfig

log = logging.getLogger(__name__)

# Keys are opaque; these bounds only keep a mistake (a whole file in one variable, a
# binary file) from becoming a start-up surprise.
MAX_KEYS = 10_000
MAX_KEY_CHARS = 512


@dataclass(frozen=True)
class ClientKeys:
    """SHA-256 digests of the keys. A request's key is hashed and looked up: one hash and
    one set probe whatever the number of keys, and the lookup's timing can only tell an
    attacker about digests, which say nothing of the keys without a preimage."""

    digests: frozenset[bytes] = frozenset()

    @classmethod
    def of(cls, keys: list[str]) -> ClientKeys:
        return cls(frozenset(hashlib.sha256(k.encode()).digest() for k in keys))

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys."""
        return not self.digests or self.digest_of(authorization) is not None

    def digest_of(self, authorization: str | None) -> bytes | None:
        """The digest of the key the header carries, if it is one of ours."""
        if not authorization:
            return None
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return None
        token = given.strip().encode("utf-8", "surrogateescape")
        digest = hashlib.sha256(token).digest()
        return digest if digest in self.digests else None


def _one_key(text: str) -> bool:
    return len(text) <= MAX_KEY_CHARS and not any(c.isspace() for c in text)


def _parse_keys(text: str, source: str) -> list[str]:
    keys = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _one_key(line):
            raise ConfigError(f"{source}, line {n}: not an API key (one key per line, "
                              f"no spaces, at most {MAX_KEY_CHARS} characters)")
        keys.append(line)
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def load_client_keys(auth: AuthConfig, listen_host: str,
                     environ: dict[str, str] | None = None) -> ClientKeys:
    """The configured keys; raises ConfigError naming the key at fault (an unreadable
    file, a malformed line, or no keys on a public address without allow_anonymous)."""
    env = os.environ if environ is None else environ
    keys: list[str] = []
    from_env = env.get(auth.api_keys_env, "")
    if from_env.strip():
        keys += _parse_keys(from_env.replace(",", "\n"), f"${auth.api_keys_env}")
    if auth.api_keys_file is not None:
        try:
            text = Path(auth.api_keys_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"auth.api_keys_file: cannot read {auth.api_keys_file}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
        keys += _parse_keys(text, f"auth.api_keys_file ({auth.api_keys_file})")
    if len(keys) > MAX_KEYS:
        raise ConfigError(f"auth: {len(keys)} API keys, more than {MAX_KEYS}")
    if not keys and not auth.allow_anonymous and not is_loopback(listen_host):
        where = f"${auth.api_keys_env}"
        if auth.api_keys_file is not None:
            where += f" or {auth.api_keys_file}"
        raise ConfigError(
            f"auth: listen.host {listen_host} is not a loopback address and no client API "
            f"key is configured; put keys in {where}, or set auth.allow_anonymous: true "
            "to serve anyone")
    return ClientKeys.of(keys)


def upstream_key(env_name: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The key for the replicas from ``upstream.api_key_env``, or None when unset."""
    if env_name is None:
        return None
    value = (os.environ if environ is None else environ).get(env_name, "").strip()
    if not value:
        raise ConfigError(f"upstream.api_key_env: ${env_name} is not set or empty")
    if not _one_key(value):
        raise ConfigError(f"upstream.api_key_env: ${env_name} does not hold one API key")
    return value


def server_ssl_context(tls: ListenTlsConfig, ctx: ssl.SSLContext | None = None
                       ) -> ssl.SSLContext:
    """The HTTPS context for ``listen.tls``; ConfigError naming the file at fault.
    With ``ctx``, its certificate is replaced in place (new handshakes use the new one)."""
    if ctx is None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = (ssl.TLSVersion.TLSv1_3 if tls.min_version == "1.3"
                               else ssl.TLSVersion.TLSv1_2)
    for key, path in (("cert_file", tls.cert_file), ("key_file", tls.key_file)):
        if not Path(path).is_file():
            raise ConfigError(f"listen.tls.{key}: {path} is not a readable file")
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"listen.tls: cannot load {tls.cert_file} with {tls.key_file}: "
                          f"{getattr(exc, 'reason', None) or exc}") from None
    return ctx


def _stamp(paths: tuple[str, ...]) -> tuple[tuple[int, int, int], ...] | None:
    """What identifies the files' current contents, or None if one cannot be read (a
    Kubernetes Secret's files disappear for a moment while it is swapped)."""
    try:
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino)
                     for st in (os.stat(p) for p in paths))
    except OSError:
        return None


class EdgeFiles:
    """The keys file and the TLS pair, read again when they change.

    ``check`` is cheap (a stat per file) and is called every ``auth.reload_interval_s``.
    A change that does not load (a malformed key line, a key that does not match its
    certificate, no keys left on a public address) keeps what was loaded before and says
    why in the log: a rotation half done must not lock clients out or take TLS down."""

    def __init__(self, auth: AuthConfig, listen_host: str, tls: ListenTlsConfig | None,
                 environ: dict[str, str] | None = None) -> None:
        self.auth = auth
        self.listen_host = listen_host
        self.tls = tls
        self.environ = environ
        self.keys = load_client_keys(auth, listen_host, environ)
        self.ssl_context = server_ssl_context(tls) if tls is not None else None
        # What each watched group of files reloads: (name, paths, reload).
        self._watched: list[tuple[str, tuple[str, ...], Callable[[], None]]] = []
        if auth.api_keys_file is not None:
            self._watched.append(("keys", (auth.api_keys_file,), self._reload_keys))
        if tls is not None:
            self._watched.append(("tls", (tls.cert_file, tls.key_file), self._reload_tls))
        self._stamps = [_stamp(paths) for _, paths, _ in self._watched]
        self.reloads = 0
        self.errors = 0

    @property
    def watching(self) -> bool:
        """Whether there is a file to watch at all."""
        return bool(self._watched)

    def _reload_keys(self) -> None:
        self.keys = load_client_keys(self.auth, self.listen_host, self.environ)

    def _reload_tls(self) -> None:
        assert self.tls is not None and self.ssl_context is not None
        server_ssl_context(self.tls, self.ssl_context)

    def check(self) -> list[str]:
        """Reload what changed; returns what was reloaded ("keys", "tls")."""
        done: list[str] = []
        for i, (name, paths, reload) in enumerate(self._watched):
            stamp = _stamp(paths)
            if stamp is None or stamp == self._stamps[i]:
                continue
            self._stamps[i] = stamp
            try:
                reload()
            except ConfigError as exc:
                self.errors += 1
                log.error("%s not reloaded, what was loaded before stays: %s", name, exc)
            else:
                done.append(name)
        if done:
            self.reloads += 1
            log.warning("reloaded %s", " and ".join(done))
        return done
