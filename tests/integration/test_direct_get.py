"""Reading the journal without a consumer (batched direct gets) against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from typing import Any

import pytest
from nats.js.api import StreamConfig

from messages.subjects import Subjects
from runtime import direct_get
from runtime.bus import Bus
from runtime.direct_get import DirectGetFailed, StoredMessage, follow_stored, read_batch, read_stored
from runtime.journal import ensure_events_stream

S = Subjects()


async def _publish(bus: Bus, count: int, node: str = "n1", start: int = 0) -> list[int]:
    seqs = []
    for i in range(start, start + count):
        ack = await bus.js.publish(S.event("test", "numbered", node), str(i).encode(), timeout=5)
        seqs.append(ack.seq)
    return seqs


async def test_stored_messages_are_read_in_order_across_batches_and_filtered(bus: Bus) -> None:
    mine = await _publish(bus, 9)
    await _publish(bus, 4, node="n2")
    read = [m async for m in read_stored(bus, S.events_stream, S.event("test", "numbered", "n1"), batch=4)]
    assert [m.seq for m in read] == mine
    assert [m.data for m in read] == [str(i).encode() for i in range(9)]
    assert {m.subject for m in read} == {S.event("test", "numbered", "n1")}
    assert all(m.time.tzinfo is not None for m in read)
    # From a sequence on, and nothing at all past the end (the read just ends).
    later = [m.seq async for m in read_stored(bus, S.events_stream, S.events_all, start_seq=mine[5])]
    assert later[:4] == mine[5:] and len(later) == 4 + 4
    assert [m async for m in read_stored(bus, S.events_stream, S.events_all, start_seq=10_000)] == []


async def test_a_read_from_a_time_starts_at_the_first_message_stored_since(bus: Bus) -> None:
    await _publish(bus, 3)
    await asyncio.sleep(0.01)  # the time below is strictly after those three
    since = datetime.now(UTC)
    newer = await _publish(bus, 2, start=3)
    read = [m async for m in read_stored(bus, S.events_stream, S.events_all, start_time=since)]
    assert [m.seq for m in read] == newer


async def test_following_yields_what_is_stored_later_as_it_comes(bus: Bus) -> None:
    first = await _publish(bus, 2)
    got: list[StoredMessage] = []
    arrived = asyncio.Event()

    async def follow() -> None:
        async for message in follow_stored(bus, S.events_stream, S.event("test", "*", "n1")):
            got.append(message)
            if len(got) == 5:
                arrived.set()

    task = asyncio.create_task(follow())
    try:
        async with asyncio.timeout(10):
            while len(got) < 2:
                await asyncio.sleep(0.01)
            later = await _publish(bus, 3, start=2)
            await _publish(bus, 2, node="n2")  # not followed
            await arrived.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [m.seq for m in got] == first + later


async def test_following_from_a_time_with_nothing_stored_since_waits_for_new_messages(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    first_read = asyncio.Event()

    async def watched(*args: Any, **kwargs: Any) -> tuple[list[StoredMessage], int]:
        found = await read_batch(*args, **kwargs)
        first_read.set()
        return found

    monkeypatch.setattr(direct_get, "read_batch", watched)
    await _publish(bus, 2)
    await asyncio.sleep(0.01)
    since = datetime.now(UTC)
    got: list[StoredMessage] = []

    async def follow() -> None:
        async for message in follow_stored(bus, S.events_stream, S.events_all, start_time=since):
            got.append(message)

    task = asyncio.create_task(follow())
    try:
        async with asyncio.timeout(10):
            await first_read.wait()  # it found nothing: the next must not fall back to the stream's start
        later = await _publish(bus, 1, start=2)
        async with asyncio.timeout(10):
            while not got:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [m.seq for m in got] == later


async def test_a_stream_without_direct_gets_is_a_clear_error(bus: Bus) -> None:
    # (under `$KV.`: a subject the mesh's users reach JetStream on, `runtime.roles.jetstream_subjects`)
    await bus.js.add_stream(StreamConfig(name="PLAIN", subjects=["$KV.PLAIN.>"]))
    await bus.js.publish("$KV.PLAIN.x", b"1")
    with pytest.raises(DirectGetFailed, match="PLAIN"):
        await read_batch(bus, "PLAIN", "$KV.PLAIN.>", timeout_s=5)
    with pytest.raises(DirectGetFailed, match="NOPE"):
        await read_batch(bus, "NOPE", "$KV.PLAIN.>", timeout_s=5)


async def test_a_journal_created_before_direct_gets_gets_them_at_the_next_start(bus: Bus) -> None:
    name = "OLD_EVENTS"
    old = Subjects("old")
    await bus.js.add_stream(StreamConfig(name=old.events_stream, subjects=[old.events_all], max_age=3600.0))
    assert name == old.events_stream and not (await bus.js.stream_info(name)).config.allow_direct
    await ensure_events_stream(bus, old, max_age_s=3600.0, max_bytes=64 << 20)
    assert (await bus.js.stream_info(name)).config.allow_direct


async def test_a_follower_whose_cancellation_the_client_library_swallowed_still_stops(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On Python 3.11 nats-py's `asyncio.wait_for` can return a request's answer and drop the cancel that landed
    # with it; the task still counts that cancel (`cancelling()`). Played here by a read that swallows one.
    async def swallowing(*args: Any, **kwargs: Any) -> tuple[list[StoredMessage], int]:
        found = await read_batch(*args, **kwargs)
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, as the library does
            await asyncio.sleep(0)
        return found

    monkeypatch.setattr(direct_get, "read_batch", swallowing)
    await _publish(bus, 2)

    async def follow() -> None:
        async for _ in follow_stored(bus, S.events_stream, S.event("test", "*", "n1")):
            pass

    task = asyncio.create_task(follow())
    done, _ = await asyncio.wait({task}, timeout=5)
    try:
        assert task in done and task.cancelled(), "the follower read on after its cancellation"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
