"""The handoff actor under test: its identity, quick timings, a sender of prompt states, waiting for a condition."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import blake3
import msgspec

from actors.handoff import sender as tx
from actors.handoff.actor import HandoffLimits
from actors.l3 import layout
from actors.l3.layout import SegmentRef
from messages.datapath import DataHello, DirectOffer
from messages.handoff import (
    CreditGrant,
    HandoffCommit,
    HandoffControl,
    HandoffOpen,
    HandoffOpened,
    HandoffResult,
    SessionAborted,
)
from messages.subjects import Subjects
from runtime.bus import Bus, encode, parse_reply

S = Subjects()


IDENTITY = "1d" * 32


FAST = HandoffLimits(
    idle_timeout_s=0.6, window_bytes=4 << 20, open_timeout_s=5, commit_timeout_s=10, segment_bytes=1 << 20
)


async def _until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    async with asyncio.timeout(timeout):
        while not (value := check()):
            await asyncio.sleep(0.02)
        return value


class HandSender:
    """A sender driven by hand through the bus, for fault injection (no mock of NATS)."""

    def __init__(self, bus: Bus, segments: list[bytes], *, announce: bool = False) -> None:
        self.bus = bus
        self.segments = segments
        self.refs: list[SegmentRef] = []
        offset = 0
        for i, seg in enumerate(segments):
            self.refs.append(SegmentRef(i, offset, len(seg), blake3.blake3(seg).hexdigest()))
            offset += len(seg)
        self.total = offset
        self.announce = announce
        self.controls: list[CreditGrant | SessionAborted] = []
        self.opened: HandoffOpened | None = None

    async def open(self) -> HandoffOpened:
        inbox = self.bus.nc.new_inbox()

        async def on_control(msg: Any) -> None:
            self.controls.append(msgspec.json.decode(msg.data, type=HandoffControl))

        await self.bus.nc.subscribe(inbox, cb=on_control)
        request = HandoffOpen(
            sender_node="hand",
            identity=IDENTITY,
            n_tokens=2,
            tokens=(5, 6),
            max_bytes=self.total,
            total_bytes=self.total if self.announce else None,
            credit_subject=inbox,
        )
        self.opened = await self.bus.request(S.handoff("node-b", "open"), request, HandoffOpened, timeout=5)
        return self.opened

    async def chunk(self, ref: SegmentRef, data: bytes, chunk: int = 0, **headers: str) -> None:
        assert self.opened is not None
        h = tx.chunk_headers(self.opened.session, ref, chunk)
        h.update(headers)
        await self.bus.nc.publish(self.opened.subject + ".data", data, headers=h)

    async def segment(self, i: int, data: bytes | None = None, ref: SegmentRef | None = None) -> None:
        assert self.opened is not None
        data = self.segments[i] if data is None else data
        step = self.opened.chunk_bytes
        for c in range(0, len(data), step):
            await self.chunk(ref or self.refs[i], data[c : c + step], c)

    async def commit(self, **changes: Any) -> HandoffResult:
        assert self.opened is not None
        commit = HandoffCommit(
            session=self.opened.session,
            n_segments=len(self.refs),
            total_bytes=self.total,
            n_tokens=2,
            payload_digest=layout.payload_root(self.refs),
        )
        commit = msgspec.structs.replace(commit, **changes)
        msg = await self.bus.request_raw(self.opened.subject + ".commit", encode(commit), timeout=10)
        return parse_reply("commit", msg, HandoffResult)


async def raw_push(offer: DirectOffer | None, hello: DataHello, then: bytes) -> bytes:
    """Connects to the offer, sends `hello` and `then`; what the listener answered before it closed."""
    assert offer is not None
    reader, writer = await asyncio.open_connection(offer.host, offer.port)
    try:
        body = msgspec.json.encode(hello)
        writer.write(len(body).to_bytes(4, "big") + body + then)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read(65536)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
