"""A generation's chunks to the client's stream subject (runner shell): in order, with a liveness check.

Chunks are `GenerateChunk`s with `seq` 0, 1, 2, …; a pass-through's answer is relayed instead as a `RelayHead`
then raw data messages (headers `RELAY_HEADER`, `RELAY_SEQ_HEADER`), each under the bus's `max_payload`. Every
`STREAM_PING_S` a `StreamPing` goes to the same subject as a request (header `STREAM_PING_HEADER`). No
responders (the client unsubscribed), no answer for `silence_s`, or a subject the server refuses ends the stream
with `ClientGone`: the generation stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors

from messages.generate import (
    RELAY_HEADER,
    RELAY_SEQ_HEADER,
    STREAM_PING_HEADER,
    STREAM_PING_S,
    GenerateChunk,
    RelayHead,
    StreamPing,
)
from runtime.bus import Bus, encode

#: Room left in a relayed data message for its headers and the protocol's own framing.
_HEADROOM = 1024

__all__ = ["ChunkStream", "ClientGone"]

T = TypeVar("T")


class ClientGone(Exception):
    """The streaming client stopped listening."""


class ChunkStream:
    """Chunks to a client's subject, in order, with a liveness check."""

    def __init__(self, bus: Bus, subject: str, request_id: str, silence_s: float) -> None:
        self._bus = bus
        self.subject = subject
        self.request_id = request_id
        self.seq = 0
        self._silence_s = silence_s
        self._done = False

    async def send(self, text: str, tokens: list[int]) -> None:
        chunk = GenerateChunk(request_id=self.request_id, seq=self.seq, text=text, tokens=tokens)
        self.seq += 1
        await self._publish(encode(chunk), None)

    async def head(self, status: int, content_type: str) -> None:
        """A relayed answer's status and content type (before any of its data)."""
        await self._publish(encode(RelayHead(status=status, content_type=content_type)), {RELAY_HEADER: "head"})

    async def data(self, data: bytes) -> None:
        """A piece of a relayed answer's body, cut to fit the bus; `seq` counts the data messages sent."""
        room = max(1024, self._bus.max_payload - _HEADROOM)
        for start in range(0, len(data), room):
            headers = {RELAY_HEADER: "data", RELAY_SEQ_HEADER: str(self.seq)}
            self.seq += 1
            await self._publish(data[start : start + room], headers)

    async def _publish(self, payload: bytes, headers: dict[str, str] | None) -> None:
        try:
            await self._bus.nc.publish(self.subject, payload, headers=headers)
        except nats.errors.Error as exc:  # a subject the server refuses, a connection gone: nobody can listen
            raise ClientGone(f"cannot publish to the stream subject: {exc!r}") from exc

    def done(self) -> None:
        """The answer is complete: `watch` returns (it checks after each ping and each pause)."""
        self._done = True

    async def watched(self, work: Awaitable[T], on_gone: Callable[[ClientGone], Awaitable[None]] | None = None) -> T:
        """`work` while the requester is watched (`watch`): once nobody listens, `on_gone` runs (while the work's
        own connection is still open), the work is cancelled and `ClientGone` raised in an `ExceptionGroup`, with
        whatever the work raised as it ended."""

        async def watch() -> None:
            try:
                await self.watch()
            except ClientGone as gone:
                if on_gone is not None:
                    await on_gone(gone)
                raise

        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(watch())
            result = await work
            self.done()  # first: the cancellation alone can be lost (`watch`)
            watcher.cancel()
        return result

    async def watch(self) -> None:
        """Raises `ClientGone` once nobody listens on the subject (or answers for too long); returns once `done`.

        The caller cancels it when the answer is complete, and calls `done` first: on Python 3.11 a cancellation
        that arrives as a ping's answer does is lost inside nats-py's `request` (`asyncio.wait_for` returns the
        answer and drops the cancellation), and a watch that only a cancellation could stop then pinged on until
        the client left, holding its generation, and its slot, that long."""
        loop = asyncio.get_running_loop()
        answered = loop.time()
        while not self._done:
            await asyncio.sleep(STREAM_PING_S)
            if self._done:
                return
            ping = encode(StreamPing(request_id=self.request_id, seq=self.seq))
            try:
                await self._bus.nc.request(
                    self.subject, ping, timeout=STREAM_PING_S * 2, headers={STREAM_PING_HEADER: "1"}
                )
                answered = loop.time()
            except nats.errors.NoRespondersError as exc:
                raise ClientGone("no subscriber on the stream subject") from exc
            except nats.errors.TimeoutError as exc:
                if loop.time() - answered > self._silence_s:
                    raise ClientGone(f"the client answered no ping for {self._silence_s:g}s") from exc
            except nats.errors.Error as exc:
                raise ClientGone(f"cannot ping the stream subject: {exc!r}") from exc
