"""The client side of `mesh.generate`: one call, optionally streamed (used by the CLI and the front door).

Every call subscribes to a fresh inbox subject, names it as the request's `stream` and answers the runner's
liveness pings there; with `on_chunk` it also asks for chunks and hands them to `on_chunk` in `seq` order (a
chunk that arrives early waits for the ones before it; at most `max_pending` wait). The reply ends the stream:
chunks still missing then are reported as a gap (`StreamGap`), never silently dropped. Cancelling the call
unsubscribes, so the runner's next ping finds no listener and stops the generation, streamed or not.

`forward` does the same for a pass-through request (`api`): the relayed answer's head goes to `on_head` and its
data, in order, to `on_data`; it always subscribes, so a requester that leaves stops the server's work whether
the answer is streamed or whole. `forward_until_taken` asks again while an answer says nothing ran, by one policy
(`ask_again`): the caller's own router away or full, nobody listening, a router whose view lags.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import msgspec
import nats.errors
from nats.aio.msg import Msg

from messages.errors import BUSY, NO_INSTANCE
from messages.generate import (
    RELAY_HEADER,
    RELAY_SEQ_HEADER,
    STREAM_PING_HEADER,
    GenerateChunk,
    GenerateRequest,
    GenerateResult,
    RelayHead,
)
from messages.subjects import Subjects
from runtime.bus import NO_RESPONDERS_RETRY_S, BadMessage, Bus, BusError, NoResponders, RemoteError, decode_checked

__all__ = ["ROUTER_LAG_S", "Again", "StreamGap", "ask_again", "forward", "forward_until_taken", "generate"]

#: How long the reply may take beyond the generation's own timeout (routing and forwarding).
REPLY_SLACK_S = 15.0
#: How long a call whose requester left still waits for the runner's word on what the server did (it stops
#: within a ping, `STREAM_PING_S`; a request still queued or routed answers later, and is not charged).
SETTLE_S = 5.0


#: How long a router may lag behind its caller in seeing an instance ready (its `no_instance` is asked again).
ROUTER_LAG_S: Final = 5.0
#: How soon a router that lags is asked again.
LAG_RETRY_S: Final = 0.2


class StreamGap(Exception):
    """The reply came but some chunks never did (the bus dropped them: a slow consumer)."""


@dataclass(frozen=True, slots=True)
class Again:
    """Nothing ran: ask again, of `router` (a subject; None: any node's router), `delay_s` from now."""

    router: str | None
    delay_s: float


def ask_again(
    error: Exception, tried: str | None, *, own: str | None, now: float, first_try: float, deadline: float
) -> Again | None:
    """Whether a request whose try of `tried` (None: any node's router) failed with `error` is asked again, of
    which router and when; None: `error` is the answer. Only an answer that says nothing ran is asked again,
    never past `deadline`:

    - the caller's `own` router does not listen (restarting) or is full (`busy`: its workers all hold
      generations): any node's router, at once;
    - nobody listens (a node starting): its own router first again, every `NO_RESPONDERS_RETRY_S`;
    - `no_instance` from a router whose view of the records lags the caller's, which saw the instance ready:
      every `LAG_RETRY_S`, for at most `ROUTER_LAG_S` after the first try."""
    if (
        tried is not None
        and tried == own
        and (isinstance(error, NoResponders) or (isinstance(error, RemoteError) and error.reply.code == BUSY))
    ):
        return Again(None, 0.0)
    if isinstance(error, NoResponders):
        return Again(own, NO_RESPONDERS_RETRY_S) if now + NO_RESPONDERS_RETRY_S < deadline else None
    if isinstance(error, RemoteError) and error.reply.code == NO_INSTANCE:
        lag_until = min(deadline, first_try + ROUTER_LAG_S)
        return Again(own, LAG_RETRY_S) if now + LAG_RETRY_S < lag_until else None
    return None


async def generate(
    bus: Bus,
    subjects: Subjects,
    request: GenerateRequest,
    on_chunk: Callable[[GenerateChunk], Awaitable[None]] | None = None,
    *,
    max_pending: int = 4096,
) -> GenerateResult:
    timeout = request.timeout_s + REPLY_SLACK_S
    subject = bus.nc.new_inbox()  # even without chunks: its pings let the runner stop when this call is gone
    chunks: asyncio.Queue[GenerateChunk | None] = asyncio.Queue()  # None: the reply came

    async def on_message(msg: Msg) -> None:
        if msg.headers and STREAM_PING_HEADER in msg.headers:
            if msg.reply:
                await bus.respond(msg, b"")  # inboxes only: a pinger cannot aim our answer elsewhere
            return
        with contextlib.suppress(BadMessage):  # a stray message on our inbox is not a chunk
            chunks.put_nowait(decode_checked(msg.data, GenerateChunk, "stream chunk"))

    sub = await bus.nc.subscribe(subject, cb=on_message, pending_msgs_limit=max_pending * 4)
    next_seq = 0
    early: dict[int, GenerateChunk] = {}

    async def deliver() -> None:
        nonlocal next_seq
        while True:
            chunk = await chunks.get()
            if chunk is None:
                return
            if chunk.seq < next_seq:
                continue  # a duplicate
            early[chunk.seq] = chunk
            if len(early) > max_pending:
                raise StreamGap(f"chunk {next_seq} is missing and {len(early)} later ones wait")
            while next_seq in early:
                if on_chunk is not None:
                    await on_chunk(early.pop(next_seq))
                else:
                    early.pop(next_seq)
                next_seq += 1

    delivering = asyncio.create_task(deliver(), name="generate-stream")
    try:
        streamed = msgspec.structs.replace(request, stream=subject, chunks=on_chunk is not None)
        try:
            result = await bus.request(subjects.generate, streamed, GenerateResult, timeout=timeout)
        except BaseException:
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError, StreamGap):
                await delivering
            raise
        chunks.put_nowait(None)  # the runner published every chunk before its reply: they are queued by now
        await delivering  # raises StreamGap from a stream that overflowed
        if early:
            raise StreamGap(f"chunks {next_seq}..{max(early)} incomplete when the reply came")
        return result
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


async def _settle(call: asyncio.Task[GenerateResult]) -> GenerateResult | None:
    """The reply of a call whose requester left (the runner, told by its next ping, answers what it did), or
    None when none comes within `SETTLE_S` or it is an error."""
    try:
        async with asyncio.timeout(SETTLE_S):
            return await call
    except (TimeoutError, BusError):
        return None


async def forward(
    bus: Bus,
    subjects: Subjects,
    request: GenerateRequest,
    on_head: Callable[[RelayHead], Awaitable[None]],
    on_data: Callable[[bytes], Awaitable[None]],
    *,
    max_pending: int = 4096,
    router: str | None = None,
    on_gone: Callable[[GenerateResult], None] | None = None,
) -> GenerateResult:
    """A pass-through request (`request.api`): its answer relayed to `on_head`, then `on_data` in order. To
    `router` (a subject) when given, else to any node's router (`mesh.generate`, the queue group).

    A requester that leaves (this call cancelled, or `on_head`/`on_data` failing with a `ConnectionError`: its
    connection closed) stops the server's work: the relay's subject is dropped at once, so the runner's next
    ping finds nobody. The runner still answers with what the server did (the tokens it generated before it
    stopped): that result goes to `on_gone` (to charge it), then the cancellation or the connection's error is
    raised as it came."""
    subject = bus.nc.new_inbox()
    pieces: asyncio.Queue[tuple[int, bytes | RelayHead] | None] = asyncio.Queue()  # None: the reply came
    gone: list[ConnectionError] = []  # the requester's connection closed while its answer was relayed

    async def on_message(msg: Msg) -> None:
        headers = msg.headers or {}
        if STREAM_PING_HEADER in headers:
            if msg.reply:
                await bus.respond(msg, b"")  # inboxes only: a pinger cannot aim our answer elsewhere
            return
        kind = headers.get(RELAY_HEADER)
        if kind == "head":
            with contextlib.suppress(BadMessage):
                pieces.put_nowait((-1, decode_checked(msg.data, RelayHead, "relay head")))
        elif kind == "data" and (headers.get(RELAY_SEQ_HEADER) or "").isdigit():
            pieces.put_nowait((int(headers[RELAY_SEQ_HEADER]), msg.data))

    sub = await bus.nc.subscribe(subject, cb=on_message, pending_msgs_limit=max_pending * 4)
    next_seq = 0
    early: dict[int, bytes] = {}

    async def relay() -> None:
        nonlocal next_seq
        while True:
            piece = await pieces.get()
            if piece is None:
                return
            seq, payload = piece
            if isinstance(payload, RelayHead):
                await on_head(payload)
                continue
            if seq < next_seq:
                continue  # a duplicate
            early[seq] = payload
            if len(early) > max_pending:
                raise StreamGap(f"relayed data {next_seq} is missing and {len(early)} later pieces wait")
            while next_seq in early:
                await on_data(early.pop(next_seq))
                next_seq += 1

    async def deliver() -> None:
        try:
            await relay()
        except ConnectionError as exc:  # the requester's connection closed: the runner is told by its next ping
            gone.append(exc)
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    delivering = asyncio.create_task(deliver(), name="forward-relay")
    try:
        relayed = msgspec.structs.replace(request, stream=subject)
        call = asyncio.create_task(
            bus.request(
                router or subjects.generate, relayed, GenerateResult, timeout=request.timeout_s + REPLY_SLACK_S
            ),
            name="forward-request",
        )
        try:
            result = await asyncio.shield(call)
        except asyncio.CancelledError:
            delivering.cancel()
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()  # first: the runner's next ping finds nobody and the server stops
            settled = await _settle(call) if on_gone is not None else None
            call.cancel()
            if settled is not None and on_gone is not None:
                on_gone(settled)
            raise
        except BaseException:
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError, StreamGap):
                await delivering
            raise
        pieces.put_nowait(None)  # the runner relayed everything before its reply: it is queued by now
        await delivering
        if gone:
            if on_gone is not None:
                on_gone(result)
            raise gone[0]
        if early or next_seq != result.relayed:
            raise StreamGap(f"{next_seq} of {result.relayed} relayed pieces arrived before the reply")
        return result
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


async def forward_until_taken(
    bus: Bus,
    subjects: Subjects,
    request: GenerateRequest,
    on_head: Callable[[RelayHead], Awaitable[None]],
    on_data: Callable[[bytes], Awaitable[None]],
    *,
    deadline: float,
    own_router: str | None = None,
    on_gone: Callable[[GenerateResult], None] | None = None,
) -> GenerateResult:
    """`forward`, to `own_router` first (a request the queue group handed to a frozen peer's router would wait
    there until its deadline), asked again as `ask_again` says while an answer says nothing ran; each try carries
    the time left to `deadline` (the loop's clock) as its timeout."""
    loop = asyncio.get_running_loop()
    first_try = loop.time()
    router = own_router
    while True:
        timed = msgspec.structs.replace(request, timeout_s=max(1.0, deadline - loop.time()))
        try:
            return await forward(bus, subjects, timed, on_head, on_data, router=router, on_gone=on_gone)
        except (NoResponders, RemoteError) as exc:
            again = ask_again(exc, router, own=own_router, now=loop.time(), first_try=first_try, deadline=deadline)
            if again is None:
                raise
        router = again.router
        if again.delay_s:
            await asyncio.sleep(again.delay_s)
