"""The sending side of a KV handoff session, as a pure state machine (sans-I/O, h11 style).

Rules this module keeps:

* Everything that decides what a sending session does lives here; the shell reads the bytes, publishes and
  waits. Events in (the open was answered, credit arrived, a segment's bytes are ready, the payload ended, the
  commit was answered, the deadline passed), actions out (publish these chunks, request the commit, abort,
  finished). No I/O, no clock, no NATS: a time is an argument.
* Credits, not hope: `sendable` hands out chunks only while the payload bytes published stay within the
  receiver's cumulative credit limit; nothing is ever published past it, so the receiver can never be a slow
  consumer. A grant that would shrink the limit is ignored (grants are cumulative, so a late one is harmless).
* A segment travels as consecutive chunks of at most `chunk_bytes` (the receiver's figure, under the bus's
  max_payload), each with the segment's index, offset, length and blake3 and its own place in it
  (`chunk_headers`). The commit carries the counts and `layout.payload_root` of every segment sent.
* While chunks wait for credit, the deadline is the receiver's idle timeout from the last grant; while the
  commit is out, the commit timeout; always the session's overall deadline.
* The receiver is not trusted. Its figures are wishes the sender's own limits bound: a credit stall lasts at
  most `SenderLimits.credit_stall_s` whatever idle timeout the receiver announces, a chunk is at most the
  sender's own `max_chunk_bytes` and at least its `min_chunk_bytes`, and the session's deadline is the
  sender's. The session subject must be the one the protocol defines for that session (`Opened.subject`,
  computed by the shell from the peer and the session id), so no receiver can make the sender publish state
  into another subject. A commit counts only when the result names the payload the sender sent: its
  digest, byte and segment counts equal the sender's own.

States: `OPENING` → `STREAMING` (segments queued and sent as credit allows) → `COMMITTING` → `DONE`; any of
them → `ABORTED` (the reason is `SendReason`; `notify_receiver` says whether the receiver must be told).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from actors.l3 import layout
from actors.l3.layout import SegmentRef
from messages.handoff import (
    CHUNK_HEADER,
    DIGEST_HEADER,
    INDEX_HEADER,
    LENGTH_HEADER,
    OFFSET_HEADER,
    SESSION_HEADER,
    HandoffCommit,
    HandoffOpen,
    HandoffOpened,
    HandoffResult,
)

__all__ = [
    "Abort",
    "Credit",
    "EndOfPayload",
    "Failed",
    "Finished",
    "OpenRefused",
    "Opened",
    "ReceiverAborted",
    "ResultArrived",
    "SegmentReady",
    "SendChunk",
    "SendCommit",
    "SendReason",
    "Sender",
    "SenderLimits",
    "State",
    "Tick",
    "chunk_headers",
]


class State(enum.Enum):
    OPENING = "opening"
    STREAMING = "streaming"
    COMMITTING = "committing"
    DONE = "done"
    ABORTED = "aborted"


class SendReason(enum.Enum):
    OPEN_REFUSED = "open_refused"  # the receiver refused the open (busy, too large, a bad layout, …)
    OPEN_TIMEOUT = "open_timeout"  # no answer to the open in time
    RECEIVER_STALLED = "receiver_stalled"  # no credit within the idle timeout while chunks waited for it
    RECEIVER_ABORTED = "receiver_aborted"  # the receiver gave the session up (`SessionAborted`, with its reason)
    COMMIT_REFUSED = "commit_refused"  # the receiver answered the commit with a refusal
    COMMIT_TIMEOUT = "commit_timeout"  # no result within the commit timeout (restore included)
    EXPIRED = "expired"  # the send outlived its overall deadline
    TOO_LARGE = "too_large"  # the source produced more than the open's max_bytes
    SOURCE_FAILED = "source_failed"  # reading or producing the payload failed
    BUS_ERROR = "bus_error"  # the commit request failed on the bus (no responders, connection closed)
    UNEXPECTED = "unexpected"  # a message or call this state does not take (a bug on one side)
    CANCELLED = "cancelled"  # the caller gave up, or the handoff actor is not running
    BAD_REPLY = "bad_reply"  # the receiver's answer breaks the protocol (another session subject, a tiny chunk)
    RESULT_MISMATCH = "result_mismatch"  # the receiver committed other bytes than sent (digest or counts differ)


@dataclass(frozen=True, slots=True)
class SenderLimits:
    open_timeout_s: float = 10.0
    commit_timeout_s: float = 180.0  # includes the receiver's restore
    deadline_s: float = 900.0
    credit_stall_s: float = 30.0  # the longest wait for credit, whatever idle timeout the receiver announces
    max_chunk_bytes: int = 1 << 30  # the most one data message may carry on the sender's bus (its max_payload)
    # A receiver's smaller chunk is refused: 1-byte chunks would make a 32 MiB segment 33 million messages.
    min_chunk_bytes: int = layout.MIN_SEGMENT_BYTES


# ---- events ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Opened:
    reply: HandoffOpened
    now: float
    subject: str  # the session subject the protocol defines for `reply.session` on the peer asked


@dataclass(frozen=True, slots=True)
class OpenRefused:
    reason: str
    detail: str
    now: float


@dataclass(frozen=True, slots=True)
class Credit:
    limit: int
    now: float


@dataclass(frozen=True, slots=True)
class ReceiverAborted:
    reason: str
    detail: str
    now: float


@dataclass(frozen=True, slots=True)
class SegmentReady:
    """The next segment's bytes are in hand: `length` bytes hashing to `digest`."""

    length: int
    digest: str
    now: float


@dataclass(frozen=True, slots=True)
class EndOfPayload:
    now: float


@dataclass(frozen=True, slots=True)
class ResultArrived:
    result: HandoffResult
    now: float


@dataclass(frozen=True, slots=True)
class Tick:
    now: float


@dataclass(frozen=True, slots=True)
class Failed:
    reason: SendReason
    detail: str
    now: float


Event = Opened | OpenRefused | Credit | ReceiverAborted | SegmentReady | EndOfPayload | ResultArrived | Tick | Failed


# ---- actions -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendChunk:
    """Publish bytes [chunk, chunk + size) of segment `segment` on the session's data subject."""

    segment: SegmentRef
    chunk: int
    size: int


@dataclass(frozen=True, slots=True)
class SendCommit:
    commit: HandoffCommit


@dataclass(frozen=True, slots=True)
class Abort:
    reason: SendReason
    detail: str
    notify_receiver: bool


@dataclass(frozen=True, slots=True)
class Finished:
    result: HandoffResult


Action = SendChunk | SendCommit | Abort | Finished


def chunk_headers(session: str, segment: SegmentRef, chunk: int) -> dict[str, str]:
    """The headers of one data chunk."""
    return {
        SESSION_HEADER: session,
        INDEX_HEADER: str(segment.index),
        OFFSET_HEADER: str(segment.offset),
        LENGTH_HEADER: str(segment.length),
        DIGEST_HEADER: segment.digest,
        CHUNK_HEADER: str(chunk),
    }


class Sender:
    """One sending session, from the open request it was built for."""

    def __init__(self, open_: HandoffOpen, limits: SenderLimits, now: float) -> None:
        self.open = open_
        self.limits = limits
        self.state = State.OPENING
        self.started = now
        self.last_credit = now
        self.commit_sent: float | None = None
        self.reply: HandoffOpened | None = None
        self.chunk_bytes = 0  # the receiver's chunk size within the sender's bounds
        self.credit_stall_s = limits.credit_stall_s  # the receiver's idle timeout, at most the sender's own
        self.limit = 0
        self.sent = 0  # payload bytes handed out to publish
        self.produced = 0  # payload bytes of the segments queued
        self.segments: list[SegmentRef] = []
        self.reason: SendReason | None = None
        self.detail = ""
        self.result: HandoffResult | None = None
        self._queue: deque[SendChunk] = deque()

    @property
    def session(self) -> str:
        return self.reply.session if self.reply else ""

    @property
    def pending(self) -> bool:
        """Chunks wait to be sent (for credit)."""
        return bool(self._queue)

    @property
    def blocked(self) -> bool:
        """The next chunk does not fit the credit granted."""
        return bool(self._queue) and self.sent + self._queue[0].size > self.limit

    @property
    def next_deadline(self) -> float | None:
        overall = self.started + self.limits.deadline_s
        if self.state is State.OPENING:
            return min(overall, self.started + self.limits.open_timeout_s)
        if self.state is State.STREAMING:
            if self.blocked:
                return min(overall, self.last_credit + self.credit_stall_s)
            return overall
        if self.state is State.COMMITTING:
            assert self.commit_sent is not None
            return min(overall, self.commit_sent + self.limits.commit_timeout_s)
        return None

    def handle(self, event: Event) -> list[Action]:
        if self.state in (State.DONE, State.ABORTED):
            return []
        allowed = _TRANSITIONS[self.state]
        if type(event) not in allowed:
            return self._abort(SendReason.UNEXPECTED, f"{type(event).__name__} while {self.state.value}")
        actions = _HANDLERS[type(event)](self, event)
        if not self._aborted():
            self.state = allowed[type(event)]
        return actions

    def sendable(self) -> list[SendChunk]:
        """The queued chunks that fit the credit now, in order; the caller publishes them all."""
        out: list[SendChunk] = []
        if self.state is not State.STREAMING:
            return out
        while self._queue and self.sent + self._queue[0].size <= self.limit:
            chunk = self._queue.popleft()
            self.sent += chunk.size
            out.append(chunk)
        return out

    # -- handlers --

    def _on_opened(self, event: Opened) -> list[Action]:
        reply = event.reply
        if reply.subject != event.subject:
            detail = f"the receiver named session subject {reply.subject[:80]!r}, the protocol's is {event.subject!r}"
            return self._abort(SendReason.BAD_REPLY, detail, notify=False)
        if reply.chunk_bytes < self.limits.min_chunk_bytes or reply.credit < 0:
            detail = (
                f"chunks of {reply.chunk_bytes} bytes (at least {self.limits.min_chunk_bytes}), credit {reply.credit}"
            )
            return self._abort(SendReason.BAD_REPLY, detail, notify=False)
        self.reply = reply
        self.chunk_bytes = min(reply.chunk_bytes, self.limits.max_chunk_bytes)
        self.credit_stall_s = min(max(reply.idle_timeout_s, 0.0), self.limits.credit_stall_s)
        self.limit = reply.credit
        self.last_credit = event.now
        return []

    def _on_open_refused(self, event: OpenRefused) -> list[Action]:
        return self._abort(SendReason.OPEN_REFUSED, f"{event.reason}: {event.detail}", notify=False)

    def _on_credit(self, event: Credit) -> list[Action]:
        if event.limit > self.limit:
            self.limit = event.limit
            self.last_credit = event.now
        return []

    def _on_receiver_aborted(self, event: ReceiverAborted) -> list[Action]:
        return self._abort(SendReason.RECEIVER_ABORTED, f"{event.reason}: {event.detail}", notify=False)

    def _on_segment(self, event: SegmentReady) -> list[Action]:
        assert self.reply is not None
        if self._queue:
            return self._abort(SendReason.UNEXPECTED, "a segment queued before the previous one was sent")
        if not 0 < event.length <= layout.MAX_SEGMENT_BYTES or not layout.is_digest(event.digest):
            return self._abort(SendReason.SOURCE_FAILED, f"a segment of {event.length} bytes or with a bad digest")
        if self.produced + event.length > self.open.max_bytes:
            return self._abort(SendReason.TOO_LARGE, f"the payload passed max_bytes {self.open.max_bytes}")
        ref = SegmentRef(len(self.segments), self.produced, event.length, event.digest)
        self.segments.append(ref)
        self.produced += event.length
        step = self.chunk_bytes
        self._queue.extend(SendChunk(ref, c, min(step, ref.length - c)) for c in range(0, ref.length, step))
        return []

    def _on_end(self, event: EndOfPayload) -> list[Action]:
        if self._queue:
            return self._abort(SendReason.UNEXPECTED, "the payload ended with chunks still unsent")
        if self.open.total_bytes is not None and self.produced != self.open.total_bytes:
            return self._abort(
                SendReason.SOURCE_FAILED, f"{self.produced} bytes produced, {self.open.total_bytes} announced"
            )
        self.commit_sent = event.now
        commit = HandoffCommit(
            session=self.session,
            n_segments=len(self.segments),
            total_bytes=self.produced,
            n_tokens=self.open.n_tokens,
            payload_digest=layout.payload_root(self.segments),
        )
        return [SendCommit(commit)]

    def _on_result(self, event: ResultArrived) -> list[Action]:
        result = event.result
        self.result = result
        if not result.committed:
            return self._abort(SendReason.COMMIT_REFUSED, f"{result.reason}: {result.detail}", notify=False)
        sent = (self.session, self.produced, len(self.segments), layout.payload_root(self.segments))
        said = (result.session, result.bytes, result.segments, result.payload_digest)
        if said != sent:
            detail = (
                f"the receiver committed {result.bytes} bytes in {result.segments} segments, digest "
                f"{str(result.payload_digest)[:16]}…; sent {self.produced} bytes in {len(self.segments)}, "
                f"digest {sent[3][:16]}…"
            )
            return self._abort(SendReason.RESULT_MISMATCH, detail, notify=False)
        return [Finished(result)]

    def _on_tick(self, event: Tick) -> list[Action]:
        deadline = self.next_deadline
        if deadline is None or event.now < deadline:
            return []
        if event.now >= self.started + self.limits.deadline_s:
            return self._abort(SendReason.EXPIRED, f"the handoff outlived {self.limits.deadline_s:g}s")
        if self.state is State.OPENING:
            return self._abort(SendReason.OPEN_TIMEOUT, f"no answer to the open within {self.limits.open_timeout_s:g}s")
        if self.state is State.COMMITTING:
            return self._abort(SendReason.COMMIT_TIMEOUT, f"no result within {self.limits.commit_timeout_s:g}s")
        detail = f"no credit for {self.credit_stall_s:g}s ({self.sent} bytes sent, {self.limit} granted)"
        return self._abort(SendReason.RECEIVER_STALLED, detail)

    def _on_failed(self, event: Failed) -> list[Action]:
        return self._abort(event.reason, event.detail)

    def _aborted(self) -> bool:
        return self.state is State.ABORTED  # a handler may have aborted

    def _abort(self, reason: SendReason, detail: str, *, notify: bool = True) -> list[Action]:
        self.state = State.ABORTED
        self.reason, self.detail = reason, detail
        self._queue.clear()
        return [Abort(reason, detail, notify_receiver=notify and self.reply is not None)]


#: state -> event type -> the state it leads to (unless its handler aborts). Not listed: unexpected.
_TRANSITIONS: Final[dict[State, dict[type, State]]] = {
    State.OPENING: {Opened: State.STREAMING, OpenRefused: State.ABORTED, Tick: State.OPENING, Failed: State.ABORTED},
    State.STREAMING: {
        Credit: State.STREAMING,
        SegmentReady: State.STREAMING,
        EndOfPayload: State.COMMITTING,
        ReceiverAborted: State.ABORTED,
        Tick: State.STREAMING,
        Failed: State.ABORTED,
    },
    State.COMMITTING: {
        Credit: State.COMMITTING,  # a late grant: harmless
        ResultArrived: State.DONE,
        ReceiverAborted: State.ABORTED,
        Tick: State.COMMITTING,
        Failed: State.ABORTED,
    },
    State.DONE: {},
    State.ABORTED: {},
}

_HANDLERS: Final[dict[type, Callable[..., list[Action]]]] = {
    Opened: Sender._on_opened,
    OpenRefused: Sender._on_open_refused,
    Credit: Sender._on_credit,
    ReceiverAborted: Sender._on_receiver_aborted,
    SegmentReady: Sender._on_segment,
    EndOfPayload: Sender._on_end,
    ResultArrived: Sender._on_result,
    Tick: Sender._on_tick,
    Failed: Sender._on_failed,
}
