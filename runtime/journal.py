"""The journal: every event goes to the JetStream stream `MESH_EVENTS` (subjects `mesh.events.>`).

The stream is created idempotently and never deleted or recreated: on start we look it up and only create
it when it does not exist (durable consumers of operators survive restarts). It is file-backed and bounded
by age and bytes. Events are published through a bounded outbox drained by one task, so an actor never
waits on the journal and an outage of NATS loses nothing until the outbox overflows (then the oldest
events are dropped and counted in the log). An event recorded while a request is served carries that
request's trace context (`runtime/tracing.py`: the current traceparent, read here). Each event's id is its
`Nats-Msg-Id`, so a publish retried after a lost acknowledgement is stored once.

Only what can succeed is retried. An event larger than the journal's limit (`max_event_bytes`, and never
more than the server's `max_payload`) is not queued: an `event_too_large` event naming its type, id and
size takes its place, so one oversized event can never jam the outbox (producers that record large inputs,
such as placement's decisions, keep their events under the limit themselves). A publish the server refuses
for good (over its max_payload, which a server may lower at any time) is dropped the same way; outages
and timeouts are retried with capped backoff. Memory accounting never waits on the journal: placement
reconciles reservations from the instances bucket, and the journal only records.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import nats.errors
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, StreamInfo
from nats.js.errors import NotFoundError

from messages.events import Event, EventTooLarge, event_type
from messages.subjects import Subjects
from runtime import tracing
from runtime.buckets import create_replicated
from runtime.bus import Bus, encode
from runtime.logging import get_logger

E = TypeVar("E", bound=Event)

MSG_ID_HEADER = "Nats-Msg-Id"


async def ensure_events_stream(bus: Bus, subjects: Subjects, *, max_age_s: float, max_bytes: int) -> None:
    """Creates the journal's streams if they do not exist (the events stream, and the usage stream of its private
    events); updates their limits if they changed, and turns direct gets on in a stream created before they were
    read that way. Never deletes."""
    await _ensure_stream(
        bus, subjects.events_stream, subjects.events_all, "mesh-actor journal: every decision and lifecycle event",
        max_age_s=max_age_s, max_bytes=max_bytes,
    )  # fmt: skip
    await _ensure_stream(
        bus, subjects.usage_stream, subjects.usage_all, "mesh-actor journal: the tenants' usage (no client reads it)",
        max_age_s=max_age_s, max_bytes=max_bytes,
    )  # fmt: skip


async def _ensure_stream(
    bus: Bus, name: str, subject: str, description: str, *, max_age_s: float, max_bytes: int
) -> None:
    wanted = StreamConfig(
        name=name,
        subjects=[subject],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=max_age_s,
        max_bytes=max_bytes,
        duplicate_window=120.0,
        description=description,
        allow_direct=True,  # read with direct gets: a client's account has no consumers (runtime.roles)
    )
    try:
        info = await bus.js.stream_info(name)
    except NotFoundError:

        async def create(replicas: int) -> StreamInfo:
            wanted.num_replicas = replicas
            return await bus.js.add_stream(wanted)

        info = await create_replicated(bus, f"journal ({name})", create, lambda: bus.js.stream_info(name))
    current = info.config
    if (current.max_age, current.max_bytes, bool(current.allow_direct)) != (max_age_s, max_bytes, True):
        wanted.num_replicas = current.num_replicas  # a limits update keeps the replicas the stream has
        try:
            await bus.js.update_stream(wanted)
        except (nats.errors.Error, TimeoutError) as exc:  # a node's role may create the stream, not change it
            get_logger(component="journal").warning(
                "journal_settings_not_updated",
                stream=name,
                error=str(exc) or type(exc).__name__,
                hint="an admin user changes its limits and direct gets (mesh-actor run with admin credentials)",
            )


class Journal:
    """Records events for one node. `record` never blocks; `run` publishes; `flush` waits for the outbox."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        node_id: str,
        *,
        clock: Callable[[], float] = time.time,
        outbox_limit: int = 10_000,
        publish_timeout_s: float = 5.0,
        max_event_bytes: int = 256 * 1024,
    ) -> None:
        self._bus = bus
        self._subjects = subjects
        self._node_id = node_id
        self._clock = clock
        self._outbox: deque[tuple[str, bytes, str]] = deque()
        self._limit = outbox_limit
        self._timeout = publish_timeout_s
        self._max_event = max_event_bytes
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.dropped = 0
        self._log = get_logger(component="journal", node=node_id)

    def new(self, event_class: type[E], actor: str, **fields: Any) -> E:
        """An event of `event_class` with its envelope (id, time, node, actor, and the trace context of the
        request it is recorded for, if any) filled in."""
        if "trace" not in fields:
            fields["trace"] = tracing.traceparent()
        return event_class(id=uuid.uuid4().hex, time=self._clock(), node=self._node_id, actor=actor, **fields)

    @property
    def max_event_bytes(self) -> int:
        """The largest event this journal stores: its own limit, within the server's max_payload."""
        with contextlib.suppress(AttributeError, TypeError, ValueError):  # not connected yet: the own limit
            server = self._bus.max_payload
            return min(self._max_event, server - min(4096, server // 8))  # room for subject and headers
        return self._max_event

    def record(self, event: Event) -> None:
        where = self._subjects.usage_event if event.PRIVATE else self._subjects.event
        subject = where(event.actor, event_type(event), self._node_id)
        payload = encode(event)
        if len(payload) > self.max_event_bytes:
            self._too_large(event, len(payload))
            return
        self._enqueue(subject, payload, event.id)

    def _too_large(self, event: Event, size: int) -> None:
        self.dropped += 1
        kind = event_type(event)
        self._log.error(
            "journal_event_too_large", type=kind, event_id=event.id, size_bytes=size, limit_bytes=self.max_event_bytes
        )
        marker = self.new(
            EventTooLarge,
            event.actor,
            event_type=kind,
            event_id=event.id,
            size_bytes=size,
            limit_bytes=self.max_event_bytes,
        )
        self._enqueue(self._subjects.event(marker.actor, event_type(marker), self._node_id), encode(marker), marker.id)

    def _enqueue(self, subject: str, payload: bytes, msg_id: str) -> None:
        if len(self._outbox) >= self._limit:
            self._outbox.popleft()
            self.dropped += 1
            self._log.error("journal_outbox_overflow", dropped_total=self.dropped, limit=self._limit)
        self._outbox.append((subject, payload, msg_id))
        self._idle.clear()
        self._wakeup.set()

    def emit(self, event_class: type[E], actor: str, **fields: Any) -> E:
        event = self.new(event_class, actor, **fields)
        self.record(event)
        return event

    async def run(self) -> None:
        """Publishes the outbox in order, retrying each event until JetStream acknowledges it."""
        backoff = 0.1
        while True:
            if not self._outbox:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            subject, payload, msg_id = self._outbox[0]
            try:
                await self._bus.js.publish(subject, payload, timeout=self._timeout, headers={MSG_ID_HEADER: msg_id})
            except nats.errors.MaxPayloadError:
                # The server's limit is below this event (it can be lowered while we run): retrying cannot help.
                self._log.error("journal_event_refused", subject=subject, size_bytes=len(payload))
                self.dropped += 1
                if self._outbox and self._outbox[0][2] == msg_id:
                    self._outbox.popleft()
                continue
            except (nats.errors.Error, TimeoutError) as exc:
                self._log.warning("journal_publish_retry", subject=subject, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.1
            # The head may have been dropped by an overflow while we awaited; only pop what we sent.
            if self._outbox and self._outbox[0][2] == msg_id:
                self._outbox.popleft()

    async def flush(self, timeout_s: float) -> bool:
        """Waits until every recorded event is stored; False if the deadline passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    @property
    def pending(self) -> int:
        return len(self._outbox)
