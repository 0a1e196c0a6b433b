"""Handoff actors that do not trust each other, on a real nats-server: a sender refuses a receiver's session
subject other than the protocol's (nothing is published there), caps a receiver's idle timeout with its own,
and refuses a result that names another payload; a receiver ends a session that trickles bytes and refuses
one its staging disk cannot hold."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import blake3
import msgspec
import pytest
from nats.aio.msg import Msg

from actors.handoff import sender as tx
from actors.handoff.actor import HandoffActor, HandoffFailed
from actors.l3 import layout
from actors.l3.layout import SegmentRef
from messages.errors import BUSY
from messages.handoff import (
    HandoffOpen,
    HandoffOpened,
    HandoffResult,
    SessionAborted,
)
from messages.subjects import Subjects
from runtime.bus import Bus, RemoteError, encode
from tests.conftest import JournalReader, of_type, supervised
from tests.harness.handoff import FAST, IDENTITY, HandSender, _until

S = Subjects()
SESSION = "5e" * 16


@contextlib.asynccontextmanager
async def sender(bus: Bus, tmp_path: Path, **limits: Any) -> AsyncIterator[HandoffActor]:
    a = HandoffActor("node-a", tmp_path / "a", limits=dataclasses.replace(FAST, **limits))
    async with supervised(bus, [a]):
        await _until(lambda: a.running)
        yield a


class FakeReceiver:
    """A hostile `node-x`: answers the open with `opened`, records what lands on its session, and answers the
    commit with `result(commit_json)` when given."""

    def __init__(self, bus: Bus, opened: Callable[[HandoffOpen], HandoffOpened]) -> None:
        self.bus = bus
        self.opened = opened
        self.result: Callable[[bytes], HandoffResult] | None = None
        self.data = 0
        self.subs: list[Any] = []

    async def start(self) -> None:
        async def on_open(msg: Msg) -> None:
            request = msgspec.json.decode(msg.data, type=HandoffOpen)
            await msg.respond(encode(self.opened(request)))

        async def on_session(msg: Msg) -> None:
            if msg.subject.endswith(".data"):
                self.data += len(msg.data)
            elif msg.subject.endswith(".commit") and self.result is not None:
                await msg.respond(encode(self.result(msg.data)))

        self.subs.append(await self.bus.nc.subscribe(S.handoff_open("node-x", "node-a"), cb=on_open))
        self.subs.append(await self.bus.nc.subscribe(S.handoff_sessions("node-x"), cb=on_session))

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()


def _opened(**fields: Any) -> Callable[[HandoffOpen], HandoffOpened]:
    values: dict[str, Any] = {
        "session": SESSION,
        "subject": S.handoff_session("node-x", SESSION),
        "chunk_bytes": layout.MIN_SEGMENT_BYTES,
        "credit": 1 << 30,
        "idle_timeout_s": 1.0,
        "deadline_s": 60.0,
    }
    values.update(fields)
    return lambda _: HandoffOpened(**values)


async def test_state_is_never_published_into_a_subject_the_receiver_names(bus: Bus, tmp_path: Path) -> None:
    leaked: list[int] = []

    async def on_leak(msg: Msg) -> None:
        leaked.append(len(msg.data))

    spy = await bus.nc.subscribe("MESH_INSTANCES.>", cb=on_leak)
    fake = FakeReceiver(bus, _opened(subject="MESH_INSTANCES.n1"))  # readable by clients: 9.8 MB went there
    await fake.start()
    source = tmp_path / "slot.bin"
    source.write_bytes(bytes(3 << 20))
    try:
        async with sender(bus, tmp_path) as a:
            with pytest.raises(HandoffFailed) as failed:
                await a.send("node-x", source, identity=IDENTITY, n_tokens=1)
            assert failed.value.reason == tx.SendReason.BAD_REPLY.value
            await bus.nc.flush()
    finally:
        await fake.stop()
        await spy.unsubscribe()
    assert leaked == [] and fake.data == 0


@pytest.mark.timeout(60)
async def test_a_receivers_idle_timeout_is_capped_by_the_senders_credit_stall(bus: Bus, tmp_path: Path) -> None:
    # a receiver that announces 1e9 s and then never grants more than its first credit
    fake = FakeReceiver(bus, _opened(idle_timeout_s=1e9, credit=2 * layout.MIN_SEGMENT_BYTES))
    await fake.start()
    source = tmp_path / "slot.bin"
    source.write_bytes(bytes(1 << 20))
    try:
        async with sender(bus, tmp_path, credit_stall_s=1.0, deadline_s=30.0) as a:
            started = time.monotonic()
            with pytest.raises(HandoffFailed) as failed:
                await a.send("node-x", source, identity=IDENTITY, n_tokens=1)
            elapsed = time.monotonic() - started
    finally:
        await fake.stop()
    assert failed.value.reason == tx.SendReason.RECEIVER_STALLED.value  # not `expired` at the session's deadline
    assert elapsed < 10


async def test_a_result_that_names_another_payload_is_not_a_commit(bus: Bus, tmp_path: Path) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB, one segment
    fake = FakeReceiver(bus, _opened())
    fake.result = lambda _: HandoffResult(
        session=SESSION, committed=True, bytes=len(data), segments=1, payload_digest="00" * 32
    )
    await fake.start()
    source = tmp_path / "slot.bin"
    source.write_bytes(data)
    try:
        async with sender(bus, tmp_path) as a:
            with pytest.raises(HandoffFailed) as failed:
                await a.send("node-x", source, identity=IDENTITY, n_tokens=1)
            assert failed.value.reason == tx.SendReason.RESULT_MISMATCH.value
            # the same receiver telling the truth commits
            ref = SegmentRef(0, 0, len(data), blake3.blake3(data).hexdigest())
            fake.result = lambda _: HandoffResult(
                session=SESSION, committed=True, bytes=len(data), segments=1, payload_digest=layout.payload_root([ref])
            )
            report = await a.send("node-x", source, identity=IDENTITY, n_tokens=1)
            assert report.bytes == len(data)
    finally:
        await fake.stop()


@pytest.mark.timeout(60)
async def test_a_trickling_sender_loses_its_session(bus: Bus, journal_reader: JournalReader, tmp_path: Path) -> None:
    b = HandoffActor("node-b", tmp_path / "b", limits=dataclasses.replace(FAST, idle_timeout_s=1.0))
    async with supervised(bus, [b]):
        await _until(lambda: b.running)
        hand = HandSender(bus, [bytes(4 << 20)])
        await hand.open()
        ref = hand.refs[0]
        started = time.monotonic()
        sent = 0
        while not any(isinstance(c, SessionAborted) for c in hand.controls):  # one byte every 0.3 s
            assert time.monotonic() - started < 20, "the trickle kept its session"
            await hand.chunk(ref, b"\0", sent)
            sent += 1
            await asyncio.sleep(0.3)
        [aborted] = [c for c in hand.controls if isinstance(c, SessionAborted)]
        assert aborted.reason == "stalled" and time.monotonic() - started < 5
        await _until(lambda: b.sessions == 0)
        await journal_reader.wait_for(of_type("handoff_aborted", role="receiver", reason="stalled"))


async def test_an_open_the_staging_disk_cannot_hold_is_refused(bus: Bus, tmp_path: Path) -> None:
    huge = 1 << 40  # 1 TiB: more than this disk holds
    limits = dataclasses.replace(FAST, max_session_bytes=huge, max_staging_bytes=2 * huge)
    b = HandoffActor("node-b", tmp_path / "b", limits=limits)
    async with supervised(bus, [b]):
        await _until(lambda: b.running)
        request = HandoffOpen(
            sender_node="hand", identity=IDENTITY, n_tokens=1, max_bytes=huge, credit_subject="_INBOX.hand"
        )
        with pytest.raises(RemoteError) as refused:
            await bus.request(S.handoff("node-b", "open"), request, HandoffOpened, timeout=5)
        assert refused.value.code == BUSY and refused.value.reply.details["reason"] == "no_space"
        assert b.sessions == 0 and not any(b.staging.iterdir())
        small = msgspec.structs.replace(request, max_bytes=1 << 20)
        opened = await bus.request(S.handoff("node-b", "open"), small, HandoffOpened, timeout=5)
        assert opened.subject == S.handoff_session("node-b", opened.session)


@pytest.mark.timeout(120)
async def test_a_peer_reopening_empty_sessions_does_not_starve_an_honest_one(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    # Issue 30 (F10): four sessions for every sender, an empty one lived the whole idle timeout (10 s), and one
    # peer re-opening empty sessions refused an honest peer's handoffs 16 times in 20. Now each sending node has
    # its share, an empty session over its share gives its place, and an empty session lives 2 s.
    limits = dataclasses.replace(FAST, idle_timeout_s=10.0, first_chunk_timeout_s=2.0)
    a = HandoffActor("node-a", tmp_path / "a", limits=limits)
    b = HandoffActor("node-b", tmp_path / "b", limits=limits)
    hostile = HandoffOpen(
        sender_node="mallory", identity=IDENTITY, n_tokens=1, max_bytes=1 << 20, credit_subject="_INBOX.mallory"
    )
    held = refused = 0

    async def reopen() -> None:  # as fast as the receiver answers: never a byte, never an abort
        nonlocal held, refused
        while True:
            try:
                await bus.request(S.handoff("node-b", "open"), hostile, HandoffOpened, timeout=5)
                held += 1
            except RemoteError as exc:
                assert exc.code == BUSY
                refused += 1
                await asyncio.sleep(0.01)

    data = bytes(range(256)) * 1200  # 300 KiB
    source = tmp_path / "slot.bin"
    source.write_bytes(data)
    async with supervised(bus, [a, b]):
        await _until(lambda: a.running and b.running)
        flood = asyncio.create_task(reopen())
        try:
            await _until(lambda: b.sessions == 4)  # the peer holds every place before the honest one asks
            failures: list[str] = []
            for i in range(20):
                try:
                    report = await a.send("node-b", source, identity=IDENTITY, n_tokens=i + 1)
                    assert report.bytes == len(data)
                except HandoffFailed as exc:
                    failures.append(f"{exc.reason}: {exc.detail}")
            assert failures == [], f"{len(failures)} of 20 refused: {failures[:3]}"
            assert held > 4 and refused > 0  # the flood went on the whole time
        finally:
            flood.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flood
        await journal_reader.wait_for(of_type("handoff_aborted", role="receiver", reason="preempted"))
        await journal_reader.wait_for(of_type("handoff_aborted", role="receiver", reason="empty"))
        await journal_reader.wait_for(of_type("handoff_committed"), count=20)
