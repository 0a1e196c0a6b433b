"""The runner's stream to a requester (`actors/runner/stream.py`) with a real nats-server: its watch ends when the
answer is done, even when nothing cancels it (a cancellation that arrives as a ping's answer does is lost inside
nats-py's `request` on Python 3.11: the watch then pinged on until the client left, holding the generation and
its slot), and ends with `ClientGone` once nobody listens."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.msg import Msg

from actors.runner.stream import ChunkStream, ClientGone
from messages.generate import STREAM_PING_S
from runtime.bus import Bus


async def _listening(bus: Bus, subject: str) -> list[Msg]:
    pings: list[Msg] = []

    async def answer(msg: Msg) -> None:
        pings.append(msg)
        await msg.respond(b"")

    await bus.nc.subscribe(subject, cb=answer)
    return pings


async def test_a_watch_ends_once_the_answer_is_done_even_when_nothing_cancels_it(bus: Bus) -> None:
    subject = bus.nc.new_inbox()
    pings = await _listening(bus, subject)
    stream = ChunkStream(bus, subject, "r1", silence_s=10)
    watching = asyncio.create_task(stream.watch())
    async with asyncio.timeout(10):
        while len(pings) < 2:  # the requester answers pings: the watch goes on
            await asyncio.sleep(0.05)
    assert not watching.done()
    stream.done()  # and no cancel: as when the cancellation was lost
    async with asyncio.timeout(4 * STREAM_PING_S + 2):
        await watching


async def test_a_watch_ends_with_client_gone_once_nobody_listens(bus: Bus) -> None:
    stream = ChunkStream(bus, bus.nc.new_inbox(), "r2", silence_s=10)
    with pytest.raises(ClientGone, match="no subscriber"):
        async with asyncio.timeout(4 * STREAM_PING_S + 2):
            await stream.watch()
