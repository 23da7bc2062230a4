"""Durable controller state behind one interface: an in-process store and Redis.

State is a few collections of JSON objects (``regions``, ``balancers``, ``replicas``,
``models``, ``tenants``) plus capped time series (telemetry). Every change goes through ``commit``,
which applies all its puts and deletes atomically and bumps a global revision: a replica
is never half-registered, and balancers long-poll on the revision.

Several controllers may share one Redis store (docs/operations-control-ha.md). Two
context variables carry what a write must still hold when it lands, checked in the same
Redis transaction (a Lua script) as the write itself:

- ``FENCE``: the leader lease's value, set in the leader's loops (leadership.py). A
  leader that lost its lease (stopped, partitioned, slow) has its writes refused
  (:class:`Fenced`) rather than acting after another controller took over.
- ``WRITER``: the token of the store-wide writer lock (``writer()``), so the
  read-decide-commit of one controller never interleaves with another's.
"""

from __future__ import annotations

import contextlib
import json
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

Obj = dict[str, Any]
Put = tuple[str, str, Obj]
Delete = tuple[str, str]

KINDS = ("regions", "balancers", "replicas", "models", "tenants")

FENCE: ContextVar[str | None] = ContextVar("skymesh_fence", default=None)
WRITER: ContextVar[str | None] = ContextVar("skymesh_writer", default=None)


class StoreError(RuntimeError):
    """The state store cannot be reached or refused an operation."""


class Fenced(StoreError):
    """A write refused because the lease (or writer lock) it was made under is gone."""


Lease = tuple[str | None, int]  # (the lease's value, milliseconds it has left); None: free


class Store(ABC):
    @abstractmethod
    async def get(self, kind: str, key: str) -> Obj | None: ...

    @abstractmethod
    async def all(self, kind: str) -> dict[str, Obj]: ...

    @abstractmethod
    async def commit(self, puts: list[Put], deletes: list[Delete] | None = None) -> int:
        """Apply every put and delete or none; return the new revision."""

    @abstractmethod
    async def revision(self) -> int: ...

    @abstractmethod
    async def append(self, series: str, obj: Obj, keep: int) -> None:
        """Append to a time series, keeping only its last ``keep`` entries."""

    @abstractmethod
    async def tail(self, series: str, n: int) -> list[Obj]: ...

    @abstractmethod
    async def series(self) -> list[str]: ...

    async def ping(self) -> None:
        """Raise StoreError when the store is unreachable."""

    async def close(self) -> None:
        """Release connections."""

    fenced_total = 0  # writes refused by the fencing checks, for /metrics

    # -- the leader lease (leadership.py) ------------------------------------------------
    @abstractmethod
    async def lease_acquire(self, prefix: str, ttl_ms: int) -> tuple[int, str] | None:
        """Take the lease if it is free, under a new epoch (a counter that only grows),
        with the value ``prefix + str(epoch)``; return (epoch, value), or None when it is
        held."""

    @abstractmethod
    async def lease_renew(self, value: str, ttl_ms: int) -> bool:
        """Extend the lease if it still holds ``value``."""

    @abstractmethod
    async def lease_release(self, value: str) -> None:
        """Free the lease if it still holds ``value``."""

    @abstractmethod
    async def lease(self) -> Lease: ...

    # -- cross-process writer lock and shared notes --------------------------------------
    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        """Held around a read-decide-commit: one writer at a time across processes."""
        yield

    @abstractmethod
    async def note_max(self, name: str, field: str, value: int) -> None:
        """Raise ``name[field]`` to ``value`` (kept outside the revisioned records)."""

    @abstractmethod
    async def notes(self, name: str) -> dict[str, int]: ...


class MemoryStore(Store):
    """The zero-setup store: everything in this process (lost when it exits)."""

    def __init__(self) -> None:
        self._data: dict[str, dict[str, str]] = {k: {} for k in KINDS}
        self._series: dict[str, deque[str]] = {}
        self._rev = 0
        self._lease: tuple[str, float] | None = None  # (value, monotonic expiry)
        self._epoch = 0
        self._notes: dict[str, dict[str, int]] = {}

    def _check_fence(self) -> None:
        fence = FENCE.get()
        if fence is not None and self._holder() != fence:
            self.fenced_total += 1
            raise Fenced("the leader lease this write was made under is gone")

    def _holder(self) -> str | None:
        if self._lease is not None and self._lease[1] > time.monotonic():
            return self._lease[0]
        return None

    async def get(self, kind: str, key: str) -> Obj | None:
        raw = self._data[kind].get(key)
        return None if raw is None else json.loads(raw)

    async def all(self, kind: str) -> dict[str, Obj]:
        return {k: json.loads(v) for k, v in self._data[kind].items()}

    async def commit(self, puts: list[Put], deletes: list[Delete] | None = None) -> int:
        # Serialise everything first: a value that cannot be encoded aborts the whole commit.
        encoded = [(kind, key, json.dumps(obj)) for kind, key, obj in puts]
        self._check_fence()
        for kind, key, raw in encoded:
            self._data[kind][key] = raw
        for kind, key in deletes or ():
            self._data[kind].pop(key, None)
        self._rev += 1
        return self._rev

    async def revision(self) -> int:
        return self._rev

    async def append(self, series: str, obj: Obj, keep: int) -> None:
        self._check_fence()
        q = self._series.get(series)
        if q is None or q.maxlen != keep:
            q = self._series[series] = deque(q or (), maxlen=keep)
        q.append(json.dumps(obj))

    async def tail(self, series: str, n: int) -> list[Obj]:
        q = self._series.get(series, deque())
        return [json.loads(v) for v in list(q)[-n:]] if n > 0 else []

    async def series(self) -> list[str]:
        return sorted(self._series)

    async def lease_acquire(self, prefix: str, ttl_ms: int) -> tuple[int, str] | None:
        if self._holder() is not None:
            return None
        self._epoch += 1
        value = f"{prefix}{self._epoch}"
        self._lease = (value, time.monotonic() + ttl_ms / 1000)
        return self._epoch, value

    async def lease_renew(self, value: str, ttl_ms: int) -> bool:
        if self._holder() != value:
            return False
        self._lease = (value, time.monotonic() + ttl_ms / 1000)
        return True

    async def lease_release(self, value: str) -> None:
        if self._holder() == value:
            self._lease = None

    async def lease(self) -> Lease:
        holder = self._holder()
        if holder is None or self._lease is None:
            return None, 0
        return holder, int((self._lease[1] - time.monotonic()) * 1000)

    async def note_max(self, name: str, field: str, value: int) -> None:
        book = self._notes.setdefault(name, {})
        book[field] = max(value, book.get(field, value))

    async def notes(self, name: str) -> dict[str, int]:
        return dict(self._notes.get(name, {}))


# Lua scripts run atomically on the Redis primary: the checks and the writes they guard
# are one step, with no window between them for an expiry or another writer.
_GUARDS = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[2] then return -2 end
"""
# KEYS: rev, lease, writer lock, hashes...; ARGV: fence, writer token, puts, then
# (hash index, field, value) per put, deletes, (hash index, field) per delete.
_COMMIT = _GUARDS + """
local i = 4
for _ = 1, tonumber(ARGV[3]) do
  redis.call('HSET', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2]); i = i + 3
end
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HDEL', KEYS[tonumber(ARGV[i])], ARGV[i + 1]); i = i + 2 end
return redis.call('INCR', KEYS[1])
"""
# KEYS: series list, lease, writer lock, series set; ARGV: fence, writer, value, keep, name
_APPEND = _GUARDS + """
redis.call('RPUSH', KEYS[1], ARGV[3])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[4]), -1)
redis.call('SADD', KEYS[4], ARGV[5])
return 1
"""
# KEYS: lease, epoch counter; ARGV: ttl ms, value prefix (the epoch is appended)
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local epoch = redis.call('INCR', KEYS[2])
local value = ARGV[2] .. epoch
redis.call('SET', KEYS[1], value, 'PX', tonumber(ARGV[1]))
return {epoch, value}
"""
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""
_NOTE_MAX = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > cur then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""


class RedisStore(Store):
    """Redis (redis-py asyncio). Collections are hashes, series are capped lists.

    ``url``: ``redis://``, ``rediss://``, ``unix://``, or
    ``redis+sentinel://[:password@]host:port[,host:port...]/service[/db]``, which asks
    the sentinels for the service's primary and follows a failover to the new one.
    ``wait_replicas`` > 0: every commit waits (Redis ``WAIT``) until that many replicas
    have it, up to ``wait_timeout_ms``, and fails with StoreError if they did not.
    Run Redis with AOF (``appendonly yes``) for durability across a Redis restart;
    docs/operations-control-ha.md says what a failover can lose.
    """

    def __init__(self, url: str, prefix: str = "skymesh", *, wait_replicas: int = 0,
                 wait_timeout_ms: int = 1000, writer_lock_s: float = 5.0) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        # After a Redis restart (or a failover) every pooled connection is dead: the
        # retry policy reconnects and runs the command again (up to 3 times, 50 ms
        # doubling to 1 s) instead of answering the first caller with a 503.
        opts: dict[str, Any] = dict(
            decode_responses=True, socket_connect_timeout=2, socket_timeout=5,
            health_check_interval=10,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
            retry_on_error=[RedisConnectionError, RedisTimeoutError])
        self._sentinel: Any = None
        if url.startswith("redis+sentinel://"):
            from redis.asyncio.sentinel import Sentinel

            hosts, service, db, password = parse_sentinel_url(url)
            self._sentinel = Sentinel(hosts, socket_timeout=1, socket_connect_timeout=1)
            self._r = self._sentinel.master_for(service, db=db, password=password, **opts)
            self._pool = self._r.connection_pool
        else:
            # redis-py's default pool raises past max_connections; the blocking pool waits.
            self._pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=32, timeout=5, **opts)
            self._r = aioredis.Redis(connection_pool=self._pool)
        self._p = prefix
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, wait_timeout_ms
        self.writer_lock_s = writer_lock_s
        self._commit = self._r.register_script(_COMMIT)
        self._append = self._r.register_script(_APPEND)
        self._acquire = self._r.register_script(_ACQUIRE)
        self._renew = self._r.register_script(_RENEW)
        self._release = self._r.register_script(_RELEASE)
        self._note_max = self._r.register_script(_NOTE_MAX)

    def _k(self, *parts: str) -> str:
        return ":".join((self._p, *parts))

    async def _call(self, coro: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise StoreError(f"redis: {exc}") from exc

    def _guards(self) -> tuple[list[str], list[str]]:
        return ([self._k("leader"), self._k("writer")],
                [FENCE.get() or "", WRITER.get() or ""])

    def _refused(self, code: int) -> None:
        if code in (-1, -2):
            self.fenced_total += 1
            what = "leader lease" if code == -1 else "writer lock"
            raise Fenced(f"the {what} this write was made under is gone")

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a write script; with ``wait_replicas``, on the same connection as a WAIT."""
        if not self.wait_replicas:
            return await self._call(script(keys=keys, args=args))

        async def run() -> Any:
            async with self._r.pipeline(transaction=False) as pipe:
                await script(keys=keys, args=args, client=pipe)
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
                res, acked = await pipe.execute()
            if isinstance(res, int) and res < 0:
                return res
            if int(acked) < self.wait_replicas:
                raise StoreError(f"redis: the write reached {acked} of {self.wait_replicas} "
                                 f"replicas in {self.wait_timeout_ms} ms (it is on the "
                                 "primary and may be lost if it fails now)")
            return res

        return await self._call(run())

    async def get(self, kind: str, key: str) -> Obj | None:
        raw = await self._call(self._r.hget(self._k("obj", kind), key))
        return None if raw is None else json.loads(raw)

    async def all(self, kind: str) -> dict[str, Obj]:
        raw = await self._call(self._r.hgetall(self._k("obj", kind)))
        return {k: json.loads(v) for k, v in raw.items()}

    async def commit(self, puts: list[Put], deletes: list[Delete] | None = None) -> int:
        # Serialise everything first: a value that cannot be encoded aborts the whole commit.
        encoded = [(kind, key, json.dumps(obj)) for kind, key, obj in puts]
        guard_keys, guard_args = self._guards()
        hashes: list[str] = []

        def index(kind: str) -> int:
            name = self._k("obj", kind)
            if name not in hashes:
                hashes.append(name)
            return 4 + hashes.index(name)  # KEYS is 1-based, after rev and the guards

        args: list[Any] = [*guard_args, len(encoded)]
        for kind, key, raw in encoded:
            args += [index(kind), key, raw]
        args.append(len(deletes or ()))
        for kind, key in deletes or ():
            args += [index(kind), key]
        res = int(await self._run(self._commit, [self._k("rev"), *guard_keys, *hashes], args))
        self._refused(res)
        return res

    async def revision(self) -> int:
        raw = await self._call(self._r.get(self._k("rev")))
        return int(raw or 0)

    async def append(self, series: str, obj: Obj, keep: int) -> None:
        guard_keys, guard_args = self._guards()
        res = await self._run(self._append,
                              [self._k("ts", series), *guard_keys, self._k("series")],
                              [*guard_args, json.dumps(obj), keep, series])
        self._refused(int(res))

    async def tail(self, series: str, n: int) -> list[Obj]:
        if n <= 0:
            return []
        raw = await self._call(self._r.lrange(self._k("ts", series), -n, -1))
        return [json.loads(v) for v in raw]

    async def series(self) -> list[str]:
        return sorted(await self._call(self._r.smembers(self._k("series"))))

    async def lease_acquire(self, prefix: str, ttl_ms: int) -> tuple[int, str] | None:
        got = await self._call(self._acquire(keys=[self._k("leader"), self._k("epoch")],
                                             args=[ttl_ms, prefix]))
        return None if not got else (int(got[0]), str(got[1]))

    async def lease_renew(self, value: str, ttl_ms: int) -> bool:
        return bool(await self._call(self._renew(keys=[self._k("leader")],
                                                 args=[value, ttl_ms])))

    async def lease_release(self, value: str) -> None:
        await self._call(self._release(keys=[self._k("leader")], args=[value]))

    async def lease(self) -> Lease:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.get(self._k("leader"))
            pipe.pttl(self._k("leader"))
            value, ttl = await self._call(pipe.execute())
        return value, max(0, int(ttl))

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        from redis.exceptions import LockError

        # redis-py's lock: SET NX PX with a random token, released by a script that
        # checks the token. It expires after writer_lock_s should its holder die, and
        # commits made under it check the token (WRITER) in their own script.
        lock = self._r.lock(self._k("writer"), timeout=self.writer_lock_s, sleep=0.005,
                            blocking_timeout=self.writer_lock_s * 2)
        if not await self._call(lock.acquire()):
            raise StoreError("redis: the store's writer lock stayed busy "
                             f"{self.writer_lock_s * 2:.0f} s")
        token = lock.local.token
        reset = WRITER.set(token.decode() if isinstance(token, bytes) else token)
        try:
            yield
        finally:
            WRITER.reset(reset)
            with contextlib.suppress(LockError, StoreError):
                await self._call(lock.release())

    async def note_max(self, name: str, field: str, value: int) -> None:
        await self._call(self._note_max(keys=[self._k("notes", name)], args=[field, value]))

    async def notes(self, name: str) -> dict[str, int]:
        raw = await self._call(self._r.hgetall(self._k("notes", name)))
        return {k: int(v) for k, v in raw.items()}

    async def ping(self) -> None:
        await self._call(self._r.ping())

    async def close(self) -> None:
        await self._r.aclose()
        await self._pool.disconnect()
        if self._sentinel is not None:
            for s in self._sentinel.sentinels:
                await s.aclose()


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """``redis+sentinel://[:password@]h1:p1,h2:p2/service[/db]`` -> (sentinels, service,
    db, password of the primary)."""
    rest = url.removeprefix("redis+sentinel://")
    password = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        password = cred.split(":", 1)[-1] or None
    hostlist, _, path = rest.partition("/")
    parts = [p for p in path.split("/") if p]
    if not hostlist or not parts or len(parts) > 2:
        raise ValueError("redis+sentinel:// needs host:port[,host:port...]/service[/db]")
    hosts = []
    for item in hostlist.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel {item!r}: host:port expected")
        hosts.append((host.strip("[]"), int(port)))
    db = int(parts[1]) if len(parts) == 2 and parts[1].isdigit() else 0
    if len(parts) == 2 and not parts[1].isdigit():
        raise ValueError(f"database {parts[1]!r}: a number expected")
    return hosts, parts[0], db, password


def open_store(spec: str, **redis_opts: Any) -> Store:
    if spec == "memory":
        return MemoryStore()
    return RedisStore(spec, **redis_opts)
