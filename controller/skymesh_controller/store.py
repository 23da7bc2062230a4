"""Durable controller state behind one interface: an in-process store and Redis.

State is a few collections of JSON objects (``regions``, ``balancers``, ``replicas``,
``models``) plus capped time series (telemetry). Every change goes through ``commit``,
which applies all its puts and deletes atomically and bumps a global revision: a replica
is never half-registered, and balancers long-poll on the revision.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import deque
from typing import Any

Obj = dict[str, Any]
Put = tuple[str, str, Obj]
Delete = tuple[str, str]

KINDS = ("regions", "balancers", "replicas", "models")


class StoreError(RuntimeError):
    """The state store cannot be reached or refused an operation."""


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


class MemoryStore(Store):
    """The zero-setup store: everything in this process (lost when it exits)."""

    def __init__(self) -> None:
        self._data: dict[str, dict[str, str]] = {k: {} for k in KINDS}
        self._series: dict[str, deque[str]] = {}
        self._rev = 0

    async def get(self, kind: str, key: str) -> Obj | None:
        raw = self._data[kind].get(key)
        return None if raw is None else json.loads(raw)

    async def all(self, kind: str) -> dict[str, Obj]:
        return {k: json.loads(v) for k, v in self._data[kind].items()}

    async def commit(self, puts: list[Put], deletes: list[Delete] | None = None) -> int:
        # Serialise everything first: a value that cannot be encoded aborts the whole commit.
        encoded = [(kind, key, json.dumps(obj)) for kind, key, obj in puts]
        for kind, key, raw in encoded:
            self._data[kind][key] = raw
        for kind, key in deletes or ():
            self._data[kind].pop(key, None)
        self._rev += 1
        return self._rev

    async def revision(self) -> int:
        return self._rev

    async def append(self, series: str, obj: Obj, keep: int) -> None:
        q = self._series.get(series)
        if q is None or q.maxlen != keep:
            q = self._series[series] = deque(q or (), maxlen=keep)
        q.append(json.dumps(obj))

    async def tail(self, series: str, n: int) -> list[Obj]:
        q = self._series.get(series, deque())
        return [json.loads(v) for v in list(q)[-n:]] if n > 0 else []

    async def series(self) -> list[str]:
        return sorted(self._series)


class RedisStore(Store):
    """Redis (redis-py asyncio). Collections are hashes, series are capped lists.

    Run Redis with AOF (``appendonly yes``) for durability across a Redis restart.
    """

    def __init__(self, url: str, prefix: str = "skymesh") -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        # redis-py's default pool raises past max_connections; the blocking pool waits.
        # After a Redis restart every pooled connection is dead: the retry policy
        # reconnects and runs the command again (up to 3 times, 50 ms doubling to 1 s)
        # instead of answering the first caller with a 503.
        self._pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=32, timeout=5, decode_responses=True,
            socket_connect_timeout=2, socket_timeout=5, health_check_interval=10,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
            retry_on_error=[RedisConnectionError, RedisTimeoutError])
        self._r = aioredis.Redis(connection_pool=self._pool)
        self._p = prefix

    def _k(self, *parts: str) -> str:
        return ":".join((self._p, *parts))

    async def _call(self, coro: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise StoreError(f"redis: {exc}") from exc

    async def get(self, kind: str, key: str) -> Obj | None:
        raw = await self._call(self._r.hget(self._k("obj", kind), key))
        return None if raw is None else json.loads(raw)

    async def all(self, kind: str) -> dict[str, Obj]:
        raw = await self._call(self._r.hgetall(self._k("obj", kind)))
        return {k: json.loads(v) for k, v in raw.items()}

    async def commit(self, puts: list[Put], deletes: list[Delete] | None = None) -> int:
        encoded = [(kind, key, json.dumps(obj)) for kind, key, obj in puts]

        async def run() -> int:
            # MULTI/EXEC: Redis applies the whole block or nothing.
            async with self._r.pipeline(transaction=True) as pipe:
                for kind, key, raw in encoded:
                    pipe.hset(self._k("obj", kind), key, raw)
                for kind, key in deletes or ():
                    pipe.hdel(self._k("obj", kind), key)
                pipe.incr(self._k("rev"))
                res = await pipe.execute()
            return int(res[-1])

        return int(await self._call(run()))

    async def revision(self) -> int:
        raw = await self._call(self._r.get(self._k("rev")))
        return int(raw or 0)

    async def append(self, series: str, obj: Obj, keep: int) -> None:
        key = self._k("ts", series)

        async def run() -> None:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.rpush(key, json.dumps(obj))
                pipe.ltrim(key, -keep, -1)
                pipe.sadd(self._k("series"), series)
                await pipe.execute()

        await self._call(run())

    async def tail(self, series: str, n: int) -> list[Obj]:
        if n <= 0:
            return []
        raw = await self._call(self._r.lrange(self._k("ts", series), -n, -1))
        return [json.loads(v) for v in raw]

    async def series(self) -> list[str]:
        return sorted(await self._call(self._r.smembers(self._k("series"))))

    async def ping(self) -> None:
        await self._call(self._r.ping())

    async def close(self) -> None:
        await self._r.aclose()
        await self._pool.disconnect()


def open_store(spec: str) -> Store:
    if spec == "memory":
        return MemoryStore()
    return RedisStore(spec)
