"""The journal against a real nats-server: one oversized event never jams it, and nothing is retried forever."""

from __future__ import annotations

import asyncio

from nats.js.api import StreamConfig, StreamInfo

from messages.events import ActorStarted, NodeStarted
from messages.subjects import Subjects
from runtime.buckets import create_replicated
from runtime.bus import Bus
from runtime.journal import Journal
from tests.conftest import JournalReader, of_type


async def _running(journal: Journal) -> asyncio.Task[None]:
    return asyncio.create_task(journal.run())


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.wait({task}, timeout=5)


async def test_an_event_over_the_limit_is_replaced_by_a_marker_and_later_events_flow(
    bus: Bus, journal_reader: JournalReader
) -> None:
    journal = Journal(bus, Subjects(), "n1", max_event_bytes=4096)
    task = await _running(journal)
    try:
        huge = journal.emit(NodeStarted, "node", version="x" * 10_000, nats_url="u", embedded_nats=True, actors=())
        journal.emit(ActorStarted, "placement", attempt=1)
        assert await journal.flush(10)
    finally:
        await _stop(task)
    marker = (await journal_reader.wait_for(of_type("event_too_large")))[0]
    assert marker["event_type"] == "node_started" and marker["event_id"] == huge.id
    assert marker["size_bytes"] > 10_000 and marker["limit_bytes"] == 4096
    await journal_reader.wait_for(of_type("actor_started", actor="placement"))
    assert journal.dropped == 1 and journal.pending == 0


async def test_the_limit_never_exceeds_the_servers_max_payload(bus: Bus) -> None:
    journal = Journal(bus, Subjects(), "n1", max_event_bytes=1 << 40)
    assert journal.max_event_bytes < bus.max_payload


async def test_a_publish_the_server_refuses_for_good_is_dropped_not_retried(
    bus: Bus, journal_reader: JournalReader
) -> None:
    journal = Journal(bus, Subjects(), "n1")
    journal.emit(NodeStarted, "node", version="y" * 4000, nats_url="u", embedded_nats=True, actors=())
    journal.emit(ActorStarted, "runner", attempt=1)
    # The server's limit can drop below a queued event (another server after a reconnect announces a smaller
    # max_payload); the client then refuses the publish with MaxPayloadError, which no retry can fix.
    original = bus.nc._max_payload
    bus.nc._max_payload = 2048
    task = await _running(journal)
    try:
        assert await journal.flush(10), "the outbox stayed jammed behind an event the server refuses"
    finally:
        bus.nc._max_payload = original
        await _stop(task)
    await journal_reader.wait_for(of_type("actor_started", actor="runner"))
    assert journal.dropped == 1


async def test_a_stream_another_node_created_a_moment_earlier_is_used_as_it_is(bus: Bus) -> None:
    """Two nodes creating the journal (or a bucket) at once: the loser's definition differs (other replicas, or
    another version's description), the server answers "name already in use", and the existing one is used."""
    theirs = await bus.js.add_stream(StreamConfig(name="RACE", subjects=["race.>"], description="theirs"))

    async def ours(replicas: int) -> StreamInfo:
        config = StreamConfig(name="RACE", subjects=["race.>"], description="ours", num_replicas=replicas)
        return await bus.js.add_stream(config)

    found = await create_replicated(bus, "race stream", ours, lambda: bus.js.stream_info("RACE"))
    assert found.config.description == theirs.config.description == "theirs"
