"""`buckets.follow` on a real nats-server: the same keys, values, revisions and removals, in the same order, as
nats-py's KV watcher (`buckets.watch`) gives for the same bucket, its current values first and then `ready`,
server-placed expiry markers as removals, and a `take` that raises ends it with that error."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
from nats.js.kv import KeyValue

from messages.subjects import Subjects
from runtime import buckets
from runtime.buckets import TTL_HEADER, Change
from runtime.bus import Bus

SUBJECTS = Subjects()


@contextlib.asynccontextmanager
async def following(kv: KeyValue, take: Callable[[Change], None]) -> AsyncIterator[asyncio.Event]:
    ready = asyncio.Event()
    task = asyncio.create_task(buckets.follow(kv, ready, take))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        yield ready
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def watched(kv: KeyValue, seen: list[Change]) -> None:
    async for entry in buckets.watch(kv, None):
        seen.append(Change(entry.key, entry.value or b"", entry.revision or 0, buckets.removed(entry)))


async def until(condition: Callable[[], bool], what: str) -> None:
    try:
        async with asyncio.timeout(15):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within 15 s: {what}") from None


async def test_follow_gives_what_the_watcher_gives_current_values_first_then_each_change(bus: Bus) -> None:
    kv = await buckets.nodes(bus, SUBJECTS)
    stored = {key: await kv.put(key, f"{key}-1".encode()) for key in ("a", "b", "c")}
    stored["a"] = await kv.put("a", b"a-2")  # only its newest value is current
    followed: list[Change] = []
    seen: list[Change] = []
    async with following(kv, followed.append):
        current = list(followed)
        assert current == [
            Change("b", b"b-1", stored["b"], False), Change("c", b"c-1", stored["c"], False),
            Change("a", b"a-2", stored["a"], False),
        ]  # fmt: skip
        watcher = asyncio.create_task(watched(kv, seen))
        try:
            await until(lambda: len(seen) == 3, "the watcher's current values")
            put = await kv.put("d", b"d-1")
            await kv.delete("b")
            await kv.purge("c")
            again = await kv.put("a", b"a-3")
            await until(lambda: len(followed) == 7 and len(seen) == 7, "four changes")
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    assert followed == seen
    assert [(c.key, c.value, c.removed) for c in followed[3:]] == [
        ("d", b"d-1", False), ("b", b"", True), ("c", b"", True), ("a", b"a-3", False)
    ]  # fmt: skip
    assert followed[3].revision == put and followed[6].revision == again


async def test_an_empty_bucket_is_ready_at_once_and_a_key_that_expires_is_removed(bus: Bus) -> None:
    kv = await buckets.nodes(bus, SUBJECTS)  # per-key TTLs, expiry leaving a marker
    followed: list[Change] = []
    async with following(kv, followed.append):
        assert followed == []
        await bus.js.publish(f"$KV.{SUBJECTS.nodes_bucket}.n1", b"alive", headers={TTL_HEADER: "1s"})
        await until(lambda: len(followed) == 2, "the value and its expiry")
    assert [(c.key, c.value, c.removed) for c in followed] == [("n1", b"alive", False), ("n1", b"", True)]


async def test_what_take_raises_ends_the_follow_with_that_error(bus: Bus) -> None:
    kv = await buckets.nodes(bus, SUBJECTS)
    await kv.put("a", b"fine")

    def take(change: Change) -> None:
        if change.value == b"bad":
            raise ValueError(f"refused {change.key}")

    ready = asyncio.Event()
    task = asyncio.create_task(buckets.follow(kv, ready, take))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        await kv.put("b", b"bad")
        with pytest.raises(ValueError, match="refused b"):
            async with asyncio.timeout(10):
                await task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


pytestmark = pytest.mark.timeout(60)
