"""Reading a stream's stored messages without a consumer: JetStream's batched direct get.

A client of the mesh lives in an account with no consumer API (`runtime.roles`): it reads the journal with
`$JS.API.DIRECT.GET.<stream>` requests, each answered by up to `batch` stored messages (oldest first, from a
sequence or a time, filtered by subject) and then an end-of-batch status that says how many more match.
The mesh's own users read the same way, so there is one reader. It needs nats-server 2.11 or later and a
stream with `allow_direct` (the journal has it).

Following (`follow_stored`) adds a live subscription to the same subjects as a doorbell: it is opened before
the stored messages are read, so nothing published meanwhile is missed; each ring reads what was stored
since the last message seen. A message heard live may not be stored yet when the read arrives, so a ring
that finds nothing is read again a few times, a little later each time, before waiting for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import nats.errors
from nats.aio.msg import Msg

from runtime.bus import Bus, BusError

BATCH: Final = 256
#: How long one batch may take to arrive, from the request to its end-of-batch status.
BATCH_TIMEOUT_S: Final = 10.0
#: Rereads of a doorbell that found nothing stored yet (seconds after the ring).
_RETRIES_S: Final = (0.05, 0.1, 0.2, 0.4, 0.8)

_STATUS = "Status"


class DirectGetFailed(BusError):
    """A direct get was refused or not answered (no such stream, no `allow_direct`, a server before 2.11)."""


@dataclass(frozen=True, slots=True)
class StoredMessage:
    seq: int
    subject: str
    time: datetime
    data: bytes


_STAMP = re.compile(r"^([^.]+?)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?$")


def _timestamp(text: str) -> datetime:
    """`Nats-Time-Stamp` (RFC 3339, nanoseconds) to an aware datetime; Python keeps microseconds."""
    match = _STAMP.match(text)
    if match is None:
        raise ValueError(f"not a timestamp: {text[:64]!r}")
    head, fraction, zone = match.groups()
    stamp = datetime.fromisoformat(f"{head}.{(fraction or '0')[:6]:0<6}{'+00:00' if zone in (None, 'Z') else zone}")
    return stamp.astimezone(UTC)


def _stored(msg: Msg) -> StoredMessage:
    headers = msg.headers or {}
    return StoredMessage(
        seq=int(headers["Nats-Sequence"]),
        subject=headers["Nats-Subject"],
        time=_timestamp(headers["Nats-Time-Stamp"]),
        data=msg.data,
    )


async def read_batch(
    bus: Bus,
    stream: str,
    subjects: str,
    *,
    start_seq: int = 1,
    start_time: datetime | None = None,
    batch: int = BATCH,
    timeout_s: float = BATCH_TIMEOUT_S,
) -> tuple[list[StoredMessage], int]:
    """One batch of messages of `stream` on `subjects` from `start_seq` (or from `start_time`), and how many
    more match after it (0: none, as of this read)."""
    request: dict[str, Any] = {"batch": batch, "next_by_subj": subjects}
    if start_time is not None:
        request["start_time"] = start_time.astimezone(UTC).isoformat().replace("+00:00", "Z")
    else:
        request["seq"] = max(1, start_seq)
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox, pending_msgs_limit=batch + 8)
    found: list[StoredMessage] = []
    try:
        await bus.nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
        async with asyncio.timeout(timeout_s):
            while True:
                msg = await sub.next_msg(timeout=timeout_s)
                headers = msg.headers or {}
                status = headers.get(_STATUS)
                if status is None:
                    found.append(_stored(msg))
                    continue
                if status == "204":  # end of batch
                    return found, int(headers.get("Nats-Num-Pending", "0"))
                if status == "404":  # nothing stored from there on
                    return found, 0
                detail = str(headers.get("Description", "")).strip() or "no direct get for it"
                raise DirectGetFailed(f"direct get on stream {stream} refused ({status}): {detail}")
    except (TimeoutError, nats.errors.TimeoutError) as exc:
        raise DirectGetFailed(f"direct get on stream {stream}: no answer within {timeout_s:g}s") from exc
    except (KeyError, ValueError) as exc:
        raise DirectGetFailed(f"direct get on stream {stream}: a message without its metadata ({exc})") from exc
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


async def read_stored(
    bus: Bus,
    stream: str,
    subjects: str,
    *,
    start_seq: int = 1,
    start_time: datetime | None = None,
    batch: int = BATCH,
) -> AsyncIterator[StoredMessage]:
    """Every message of `stream` on `subjects` from `start_seq` (or `start_time`), oldest first, until caught up."""
    while True:
        found, pending = await read_batch(
            bus, stream, subjects, start_seq=start_seq, start_time=start_time, batch=batch
        )
        for message in found:
            yield message
        if not found or pending == 0:
            return
        start_seq, start_time = found[-1].seq + 1, None


async def follow_stored(
    bus: Bus,
    stream: str,
    subjects: str,
    *,
    start_seq: int = 1,
    start_time: datetime | None = None,
    batch: int = BATCH,
) -> AsyncIterator[StoredMessage]:
    """`read_stored`, then each message stored afterwards as it comes; ends only when the caller stops."""
    doorbell = await bus.nc.subscribe(subjects, pending_msgs_limit=1 << 16)
    cursor: tuple[int, datetime | None] = (start_seq, start_time)  # where the next read starts
    try:
        rings = 0
        while True:
            for delay in (0.0, *(_RETRIES_S if rings else ())):
                await asyncio.sleep(delay)
                before = cursor
                async for message in read_stored(
                    bus, stream, subjects, start_seq=cursor[0], start_time=cursor[1], batch=batch
                ):
                    _unless_cancelled()
                    cursor = (message.seq + 1, None)
                    yield message
                _unless_cancelled()
                if cursor != before:
                    break
            await doorbell.next_msg(timeout=None)
            while doorbell.pending_msgs:  # one read serves every ring already heard
                await doorbell.next_msg(timeout=None)
            _unless_cancelled()
            rings += 1
    finally:
        with contextlib.suppress(nats.errors.Error):
            await doorbell.unsubscribe()


def _unless_cancelled() -> None:
    """Raises the cancellation the client library swallowed: on Python 3.11 a cancel that lands as a request's
    answer or a message arrives is lost inside nats-py (`asyncio.wait_for` returns the result), and a follower
    asked to stop would read on for ever (the task still counts the request: `cancelling()`)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("cancelled while the client library held the call")
