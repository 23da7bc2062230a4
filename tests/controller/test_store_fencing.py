"""The store's lease and fencing primitives, on each store (the in-process one and a real
redis-server): the checks run in the same atomic step as the write they guard."""

from __future__ import annotations

import asyncio

import pytest

from skymesh_controller.store import FENCE, WRITER, Fenced, open_store


async def test_the_lease_goes_to_one_and_every_new_holder_gets_a_new_epoch(
        store_spec: str) -> None:
    store = open_store(store_spec)
    try:
        got = await store.lease_acquire("a|1.0||", 200)
        assert got is not None and got == (1, "a|1.0||1")
        assert await store.lease_acquire("b|1.0||", 200) is None  # held
        assert await store.lease_renew("a|1.0||1", 200)
        assert not await store.lease_renew("b|1.0||1", 200)  # not its lease
        value, ttl_ms = await store.lease()
        assert value == "a|1.0||1" and 0 < ttl_ms <= 200
        await store.lease_release("b|1.0||1")  # not its own: nothing happens
        assert (await store.lease())[0] == "a|1.0||1"
        await store.lease_release("a|1.0||1")
        assert (await store.lease())[0] is None
        assert await store.lease_acquire("b|2.0||", 200) == (2, "b|2.0||2")
    finally:
        await store.close()


async def test_a_write_under_a_lapsed_lease_changes_nothing(store_spec: str) -> None:
    store = open_store(store_spec)
    try:
        _, mine = await store.lease_acquire("a|1.0||", 100)  # type: ignore[misc]
        token = FENCE.set(mine)
        try:
            rev = await store.commit([("regions", "us", {"name": "us"})])
            await store.append("planner:rounds", {"id": "p1"}, 10)
            # The lease lapses (a pause) and another controller takes it.
            async def taken() -> None:
                while await store.lease_acquire("b|1.0||", 5000) is None:
                    await asyncio.sleep(0.01)
            await asyncio.wait_for(taken(), 5)
            with pytest.raises(Fenced):
                await store.commit([("regions", "eu", {"name": "eu"})],
                                   [("regions", "us")])
            with pytest.raises(Fenced):
                await store.append("planner:rounds", {"id": "p2"}, 10)
        finally:
            FENCE.reset(token)
        assert await store.all("regions") == {"us": {"name": "us"}}
        assert await store.revision() == rev
        assert [r["id"] for r in await store.tail("planner:rounds", 10)] == ["p1"]
        assert store.fenced_total == 2
        # Without a fence (the admin API's writes) the store takes it.
        await store.commit([("regions", "eu", {"name": "eu"})])
        assert set(await store.all("regions")) == {"us", "eu"}
    finally:
        await store.close()


async def test_a_commit_under_a_writer_lock_someone_else_now_holds_is_refused(
        redis_server: object) -> None:
    store = open_store(redis_server.url, writer_lock_s=5.0)  # type: ignore[attr-defined]
    try:
        async with store.writer():
            assert WRITER.get() is not None
            await store.commit([("regions", "us", {"name": "us"})])
        assert WRITER.get() is None
        token = WRITER.set("a-token-that-does-not-hold-the-lock")
        try:
            with pytest.raises(Fenced):
                await store.commit([("regions", "eu", {"name": "eu"})])
        finally:
            WRITER.reset(token)
        assert set(await store.all("regions")) == {"us"}
    finally:
        await store.close()
