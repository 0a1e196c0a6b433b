"""The receiving side of a KV handoff session, as a pure state machine (sans-I/O, h11 style).

Rules this module keeps:

* Everything that decides what a receiving session does lives here; the shell (`actor.py`) only moves
  bytes: it feeds events in (a chunk's headers arrived, a chunk is staged and hashed, the commit arrived, the
  restore finished, the clock passed the deadline this object named) and performs the actions that come out
  (stage these bytes, grant credit, restore, answer the commit, abort). No I/O, no clock, no NATS here: a time
  is an argument.
* Nothing uncommitted is restorable. `Restore` is emitted once, only after every segment was hashed from the
  bytes as staged and equal to its header, the segments tile the payload in order, the counts are what the
  commit says, and the payload digest recomputed from the observed segments (`layout.payload_root`) equals
  the commit's; the tiling and digest rules are L3's own (`actors/l3/commit.validate`).
* Credits, not hope: the sender may publish at most `granted` payload bytes in all; a chunk past it is
  refused (`credit_exceeded`). Credit is granted back only for bytes already staged, so what sits between
  the network and the disk is bounded by the window. What every session together may have in flight stays
  within the receiver's credit budget (`session_window`), however sessions open, progress and end.
* Every refusal has a name (`ReceiveReason`); the first check that fails aborts the session. After `ABORTED` or
  `DONE` every event is ignored.
* No sender holds a session without moving bytes. Progress against the idle timeout is a step of bytes
  (`progress_bytes`, or one chunk if smaller) received or staged, the payload's end, or the commit: not any
  message, so one byte every few seconds does not keep a session (and its slot among `max_sessions`) alive.
  A session must also average `min_rate_bytes_per_s` after a grace period (`rate_grace_s`), and no session
  outlives `deadline_s`. `admit` refuses a session the staging disk cannot hold, with what open sessions may
  still write and a free-space floor kept aside.
* No sender holds every session. `seat` gives each sending node (as its open names it) a share of
  `max_sessions` among the nodes that hold sessions or ask for one: one over its share is refused (`busy`),
  and when every session is held, a newcomer under its share takes the place of an empty session (no byte
  received yet) of a node over its share (aborted `preempted`). An empty session costs little anyway: one
  that receives no chunk within `first_chunk_timeout_s` of its open is aborted (`empty`), long before the
  idle timeout. (A node's name is what its open says: one that rotates names is bounded by that timeout,
  not by the share.)

Theory of operation: a session is accepted by `admit` (the open's own rules and the receiver's limits), then
`RECEIVING`: chunks arrive in order (one NATS subscription, one publisher), each checked against the position
expected next (duplicate, out of order, gap, overlap, the announced layout, credit) and staged by the shell,
which reports it back with the segment's blake3 when it completed one. `COMMIT` moves to `DRAINING` until the
shell has staged every accepted chunk, then the commit is judged: `RESTORING` (the shell restores and
reports back: `DONE`) or `ABORTED`. The deadline (`next_deadline`) is the idle timeout from the last progress
and the session's overall deadline (and, until a first chunk arrived, the first-chunk timeout); in
`RESTORING`, the restore timeout.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from actors.l3 import layout
from actors.l3.commit import check_manifest, validate
from actors.l3.layout import MAX_SEGMENT_BYTES, Manifest, SegmentRef
from messages.handoff import (
    CHUNK_HEADER,
    DIGEST_HEADER,
    INDEX_HEADER,
    LENGTH_HEADER,
    OFFSET_HEADER,
    SESSION_HEADER,
    HandoffCommit,
    HandoffOpen,
    HandoffResult,
)

__all__ = [
    "Abort",
    "Answer",
    "ChunkArrived",
    "ChunkStaged",
    "CommitArrived",
    "Failed",
    "Grant",
    "ReceiveReason",
    "Receiver",
    "ReceiverLimits",
    "Restore",
    "RestoreFailed",
    "Restored",
    "Seat",
    "Seated",
    "SenderAborted",
    "Stage",
    "State",
    "Tick",
    "admit",
    "seat",
    "share",
]


class State(enum.Enum):
    RECEIVING = "receiving"
    DRAINING = "draining"  # the commit arrived; chunks accepted before it are still being staged
    RESTORING = "restoring"
    DONE = "done"
    ABORTED = "aborted"


class ReceiveReason(enum.Enum):
    """Why a session was refused or aborted. Stable names: they cross the bus and land in the journal."""

    BUSY = "busy"  # the receiver holds its maximum of sessions, or of staging bytes
    TOO_LARGE = "too_large"  # more bytes than the receiver accepts, or than the open announced
    BAD_OPEN = "bad_open"  # the announced layout does not tile, or its digest or token count disagrees
    BAD_CHUNK = "bad_chunk"  # headers missing or malformed, empty or oversized chunk, metadata changed mid-segment
    CREDIT_EXCEEDED = "credit_exceeded"  # published past the credit granted
    DUPLICATE = "duplicate"  # a segment or chunk already received
    OUT_OF_ORDER = "out_of_order"  # a segment or chunk ahead of the one expected (reordered, or one dropped)
    GAP = "gap"  # a segment starts past where the previous one ended
    OVERLAP = "overlap"  # a segment starts before where the previous one ended
    LAYOUT_MISMATCH = "layout_mismatch"  # a segment differs from the layout announced at open
    DIGEST_MISMATCH = "digest_mismatch"  # the bytes of a segment do not hash to its blake3 (corrupt)
    INCOMPLETE = "incomplete"  # the commit arrived in the middle of a segment
    SEGMENT_COUNT = "segment_count"  # the commit's segment count differs from what was received
    TOTAL = "total"  # the commit's (or the open's) byte count differs from what was received
    TOKENS = "tokens"  # the commit's token count differs from the open's
    PAYLOAD_DIGEST = "payload_digest"  # the commit's payload digest differs from the one recomputed
    TILING = "tiling"  # the observed segments do not pass L3's commit rules
    UNEXPECTED = "unexpected"  # a message this state does not take (a chunk after the commit, a second commit)
    STALLED = "stalled"  # no progress within the idle timeout (the sender stopped or vanished)
    EXPIRED = "expired"  # the session outlived its overall deadline
    SENDER_ABORTED = "sender_aborted"  # the sender gave the session up (`HandoffAbort`)
    STAGING_FAILED = "staging_failed"  # the shell could not write the staging file
    RESTORE_FAILED = "restore_failed"  # the restore hook raised: nothing is loadable from this session
    RESTORE_TIMEOUT = "restore_timeout"  # the restore hook did not finish within the restore timeout
    TOO_SLOW = "too_slow"  # the sender averaged less than the receiver's minimum rate (after its grace period)
    NO_SPACE = "no_space"  # the staging disk cannot hold the session's max_bytes beside its free-space floor
    EMPTY = "empty"  # no chunk arrived within the first-chunk timeout of the open: an empty session holds a place
    PREEMPTED = "preempted"  # an empty session of a sender over its share gave its place to one under its share
    SHUTDOWN = "shutdown"  # the receiving actor is stopping
    INTERNAL = "internal"  # a bug in the receiving shell met by this session (logged); the actor keeps serving


@dataclass(frozen=True, slots=True)
class ReceiverLimits:
    chunk_bytes: int  # the most payload bytes one data message may carry
    window_bytes: int = 32 << 20  # the most credit one session grants ahead of what it staged
    credit_budget_bytes: int = 40 << 20  # what every open session may have in flight, together (`session_window`)
    idle_timeout_s: float = 10.0
    deadline_s: float = 600.0
    restore_timeout_s: float = 120.0
    max_session_bytes: int = 64 << 30
    max_sessions: int = 4
    max_staging_bytes: int = 128 << 30  # reserved by open sessions (their `max_bytes`), all together
    progress_bytes: int = 1 << 20  # bytes (or one chunk, if smaller) that count as progress against idle_timeout_s
    min_rate_bytes_per_s: float = float(1 << 20)  # a session averaging less (after rate_grace_s) is too slow; 0: off
    rate_grace_s: float = 30.0
    min_free_bytes: int = 1 << 30  # free space the staging disk keeps beside what open sessions may write
    first_chunk_timeout_s: float = 2.0  # a session with no chunk this long after its open is aborted (`empty`)

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.window_bytes < 2 * self.chunk_bytes:
            raise ValueError("the credit window must hold at least two chunks")
        if self.max_sessions < 1 or not self.first_chunk_timeout_s > 0:
            raise ValueError("a receiver holds at least one session, and gives each a first-chunk timeout")
        if self.credit_budget_bytes < self.max_sessions * 2 * self.chunk_bytes:
            raise ValueError("the credit budget must hold two chunks for every session")


# ---- events (what the shell feeds in) ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkArrived:
    headers: Mapping[str, str]
    size: int
    now: float


@dataclass(frozen=True, slots=True)
class ChunkStaged:
    """A chunk from a `Stage` is in the staging file; `digest`: the segment's blake3 when it completed one."""

    index: int
    chunk: int
    size: int
    digest: str | None
    now: float


@dataclass(frozen=True, slots=True)
class CommitArrived:
    commit: HandoffCommit
    now: float


@dataclass(frozen=True, slots=True)
class Restored:
    restored: str | None
    restore_ms: float
    now: float


@dataclass(frozen=True, slots=True)
class RestoreFailed:
    detail: str
    now: float


@dataclass(frozen=True, slots=True)
class SenderAborted:
    reason: str
    detail: str
    now: float


@dataclass(frozen=True, slots=True)
class Tick:
    """The clock reached (or passed) `next_deadline`."""

    now: float


@dataclass(frozen=True, slots=True)
class Failed:
    """Something local ended the session (the staging write failed, the actor is stopping)."""

    reason: ReceiveReason
    detail: str
    now: float


Event = ChunkArrived | ChunkStaged | CommitArrived | Restored | RestoreFailed | SenderAborted | Tick | Failed


# ---- actions (what the shell performs) -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stage:
    """Write the chunk's `size` bytes at `payload_offset` of the staging file, hashing them into segment
    `index` (`first`: a new segment starts; `last`: it ends, report its blake3)."""

    index: int
    chunk: int
    payload_offset: int
    size: int
    first: bool
    last: bool


@dataclass(frozen=True, slots=True)
class Grant:
    limit: int


@dataclass(frozen=True, slots=True)
class Restore:
    """The payload is verified: restore it (the staging file holds exactly these segments)."""

    segments: tuple[SegmentRef, ...]
    total_bytes: int
    payload_digest: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Reply to the commit request."""

    result: HandoffResult


@dataclass(frozen=True, slots=True)
class Abort:
    """Free the staging and tell the sender (unless it was the one that aborted)."""

    reason: ReceiveReason
    detail: str
    notify_sender: bool = True


Action = Stage | Grant | Restore | Answer | Abort


# ---- admission ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SeatRefusal:
    reason: ReceiveReason
    detail: str


def session_window(limits: ReceiverLimits, others: Iterable[int]) -> int:
    """The window a session may have while the other open sessions reserve `others` (their `credit_reserved`).

    Each open session counts for at least two chunks (its floor), and every session that could still open is
    set a floor aside too; the rest of the budget, at most `window_bytes`, is this one's. So, by induction over
    opens, closes, shrinking reservations and widening (`Receiver.widen`), every session's reservation together
    (and so every byte in flight to the receiver) stays within `credit_budget_bytes`, and each session keeps at
    least two chunks: it always moves."""
    floor = 2 * limits.chunk_bytes
    held = [max(floor, r) for r in others]
    spare = limits.credit_budget_bytes - sum(held) - floor * (limits.max_sessions - 1 - len(held))
    return max(floor, min(limits.window_bytes, spare))


@dataclass(frozen=True, slots=True)
class Seat:
    """An open session as `seat` weighs it: whose it is, and whether it has moved a byte."""

    session: str
    sender: str  # the sending node, as its open names it
    received: int  # payload bytes accepted so far (0: an empty session)
    opened_at: float


@dataclass(frozen=True, slots=True)
class Seated:
    """The sender may open a session; `evict`: the empty session that gives its place first (`preempted`)."""

    evict: str | None = None


def share(limits: ReceiverLimits, senders: int) -> int:
    """The sessions one sending node may hold while `senders` nodes hold or ask for one: an equal part of
    `max_sessions`, at least one."""
    return max(1, limits.max_sessions // max(1, senders))


def seat(sender: str, seats: Sequence[Seat], limits: ReceiverLimits) -> Seated | SeatRefusal:
    """Whether `sender` may open one more session beside the open `seats`, and whose place it takes.

    A sender at its share (`share`, counting the senders holding seats and this one) is refused `busy`. Below
    it, it is seated while a session is free; when none is, it takes the place of an empty session of a sender
    over its share (of the sender holding most, its newest), or is refused `busy` when there is none: a
    session that moves bytes is never cut short for another."""
    held = Counter(s.sender for s in seats)
    senders = len(held) + (sender not in held)
    fair = share(limits, senders)
    if held[sender] >= fair:
        detail = (
            f"sender {sender} holds {held[sender]} sessions: its share of {limits.max_sessions} among {senders} "
            f"sending nodes is {fair}"
        )
        return SeatRefusal(ReceiveReason.BUSY, detail)
    if len(seats) < limits.max_sessions:
        return Seated()
    over = [s for s in seats if s.received == 0 and held[s.sender] > fair]
    if not over:
        return SeatRefusal(ReceiveReason.BUSY, f"{len(seats)} sessions open, at most {limits.max_sessions}")
    victim = max(over, key=lambda s: (held[s.sender], s.opened_at, s.session))
    return Seated(evict=victim.session)


def admit(
    open_: HandoffOpen,
    limits: ReceiverLimits,
    *,
    sessions: int,
    reserved_bytes: int,
    free_bytes: int | None = None,
    unwritten_bytes: int = 0,
) -> SeatRefusal | None:
    """Whether a session may open: the receiver's limits, the staging disk (`free_bytes` free on it, of which
    open sessions may still write `unwritten_bytes`; None: not checked), then the open's own rules."""
    if sessions >= limits.max_sessions:
        return SeatRefusal(ReceiveReason.BUSY, f"{sessions} sessions open, at most {limits.max_sessions}")
    if open_.max_bytes > limits.max_session_bytes:
        return SeatRefusal(
            ReceiveReason.TOO_LARGE, f"{open_.max_bytes} bytes, at most {limits.max_session_bytes} per session"
        )
    if reserved_bytes + open_.max_bytes > limits.max_staging_bytes:
        return SeatRefusal(ReceiveReason.BUSY, f"staging holds {reserved_bytes} of {limits.max_staging_bytes} bytes")
    if free_bytes is not None:
        room = free_bytes - unwritten_bytes - limits.min_free_bytes
        if open_.max_bytes > room:
            detail = (
                f"{open_.max_bytes} bytes do not fit the staging disk: {free_bytes} free, {unwritten_bytes} "
                f"promised to open sessions, {limits.min_free_bytes} kept free"
            )
            return SeatRefusal(ReceiveReason.NO_SPACE, detail)
    if open_.tokens and len(open_.tokens) != open_.n_tokens:
        return SeatRefusal(
            ReceiveReason.BAD_OPEN, f"n_tokens is {open_.n_tokens} but {len(open_.tokens)} token ids are listed"
        )
    if open_.total_bytes is not None and open_.total_bytes > open_.max_bytes:
        return SeatRefusal(
            ReceiveReason.BAD_OPEN, f"total_bytes {open_.total_bytes} is over max_bytes {open_.max_bytes}"
        )
    if open_.segments or open_.payload_digest is not None:
        if open_.total_bytes is None or open_.payload_digest is None:
            return SeatRefusal(ReceiveReason.BAD_OPEN, "a layout comes with total_bytes and payload_digest")
        announced = _announced(open_)
        refusal = check_manifest(_manifest(open_, announced, open_.total_bytes, open_.payload_digest))
        if refusal is not None:
            return SeatRefusal(
                ReceiveReason.BAD_OPEN, f"announced layout refused ({refusal.rule.value}): {refusal.detail}"
            )
        if layout.payload_root(announced) != open_.payload_digest:
            return SeatRefusal(ReceiveReason.BAD_OPEN, "payload_digest is not the root of the announced segments")
    return None


def _announced(open_: HandoffOpen) -> tuple[SegmentRef, ...]:
    return tuple(SegmentRef(s.index, s.offset, s.length, s.digest) for s in open_.segments)


def _manifest(open_: HandoffOpen, segments: tuple[SegmentRef, ...], total: int, digest: str) -> Manifest:
    return Manifest(
        identity=open_.identity,
        tokens=open_.tokens,
        n_tokens=len(open_.tokens),
        payload_kind=open_.payload_kind,
        total_bytes=total,
        payload_digest=digest,
        segments=segments,
    )


# ---- the session -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Segment:
    """A segment whose first chunk was accepted: its claimed metadata and how much of it arrived."""

    ref: SegmentRef
    arrived: int = 0


@dataclass(slots=True)
class _Progress:
    received: int = 0  # payload bytes accepted
    staged: int = 0  # payload bytes the shell reported staged
    begun: list[_Segment] = field(default_factory=list)
    observed: list[SegmentRef] = field(default_factory=list)  # complete segments, with the digest as hashed


class Receiver:
    """One receiving session. `handle(event)` returns the actions to perform, in order."""

    def __init__(
        self, session: str, open_: HandoffOpen, limits: ReceiverLimits, now: float, window: int | None = None
    ) -> None:
        self.session = session
        self.open = open_
        self.limits = limits
        self.window = limits.window_bytes if window is None else window  # `session_window` at the open
        if self.window < 2 * limits.chunk_bytes:
            raise ValueError("the credit window must hold at least two chunks")
        self._ceiling = open_.max_bytes if open_.total_bytes is None else open_.total_bytes
        self.state = State.RECEIVING
        self.opened_at = now
        self.last_progress = now
        self.restore_started: float | None = None
        self.reason: ReceiveReason | None = None
        self.detail = ""
        self.granted = min(self.window, open_.max_bytes)
        self.progress = _Progress()
        self._step = max(1, min(limits.progress_bytes, limits.chunk_bytes))
        self._marks = [0, 0]  # bytes received, staged at the last progress
        self.commit: HandoffCommit | None = None
        self.restored: Restored | None = None
        self._announced = _announced(open_)

    @property
    def received(self) -> int:
        return self.progress.received

    @property
    def credit_reserved(self) -> int:
        """The most payload bytes this session may still have in flight to the receiver (published or about to
        be, not yet staged): its window, or what is left of its payload if less; nothing once its commit came
        (every chunk is in) or it ended. It never grows but by `widen`."""
        if self.state is not State.RECEIVING:
            return 0
        return min(self.window, self._ceiling - self.progress.staged)

    def widen(self, window: int) -> None:
        """Takes a larger window (`session_window` once other sessions reserve less); the next grant uses it."""
        self.window = max(self.window, window)

    @property
    def unwritten(self) -> int:
        """Bytes this session may still write to its staging file (what `admit` keeps free for it)."""
        return max(0, self._ceiling - self.progress.staged) if self.state is not State.ABORTED else 0

    def _rate_deadline(self) -> float | None:
        """When the bytes received so far stop meeting the minimum average rate (None: no such rule now)."""
        rate = self.limits.min_rate_bytes_per_s
        if self.state is not State.RECEIVING or rate <= 0 or self.progress.received >= self._ceiling:
            return None
        return self.opened_at + self.limits.rate_grace_s + self.progress.received / rate

    def _first_chunk_deadline(self) -> float | None:
        """When a session that has received nothing is given up (None: a chunk arrived, or the commit did)."""
        if self.state is not State.RECEIVING or self.progress.received:
            return None
        return self.opened_at + self.limits.first_chunk_timeout_s

    def _progressed(self, which: int, count: int, now: float) -> None:
        """Counts as progress only a step of bytes since the last one, or the payload's end."""
        if count - self._marks[which] >= self._step or count >= self._ceiling:
            self._marks[which] = count
            self.last_progress = now

    @property
    def next_deadline(self) -> float | None:
        """When the shell must feed `Tick` (None: the session is over)."""
        if self.state in (State.RECEIVING, State.DRAINING):
            deadline = min(self.last_progress + self.limits.idle_timeout_s, self.opened_at + self.limits.deadline_s)
            first = self._first_chunk_deadline()
            if first is not None:
                deadline = min(deadline, first)
            rate = self._rate_deadline()
            return deadline if rate is None else min(deadline, rate)
        if self.state is State.RESTORING:
            assert self.restore_started is not None
            return self.restore_started + self.limits.restore_timeout_s
        return None

    def handle(self, event: Event) -> list[Action]:
        if self.state in (State.DONE, State.ABORTED):
            return []
        allowed = _TRANSITIONS[self.state]
        if type(event) not in allowed:
            return self._abort(ReceiveReason.UNEXPECTED, f"{type(event).__name__} while {self.state.value}")
        actions, moved = _HANDLERS[type(event)](self, event)
        if not self._aborted():
            self.state = moved or allowed[type(event)]
        return actions

    # -- handlers: each returns (actions, the state it moved to, or None for the table's) --

    def _on_chunk(self, event: ChunkArrived) -> tuple[list[Action], State | None]:
        parsed = _parse(event.headers, self.session)
        if isinstance(parsed, str):
            return self._abort(ReceiveReason.BAD_CHUNK, parsed), None
        index, offset, length, digest, chunk = parsed
        if not 0 < event.size <= self.limits.chunk_bytes:
            return self._abort(
                ReceiveReason.BAD_CHUNK, f"a chunk of {event.size} bytes (at most {self.limits.chunk_bytes})"
            ), None
        p = self.progress
        if p.received + event.size > self.granted:
            detail = f"{p.received + event.size} bytes published, {self.granted} granted"
            return self._abort(ReceiveReason.CREDIT_EXCEEDED, detail), None
        current = p.begun[-1] if p.begun and p.begun[-1].arrived < p.begun[-1].ref.length else None
        if current is not None:
            refusal = _within(current, index, offset, length, digest, chunk)
        else:
            refusal = self._starts(index, offset, length, digest, chunk)
        if refusal is not None:
            return self._abort(refusal.reason, refusal.detail), None
        if current is None:
            current = _Segment(SegmentRef(index, offset, length, digest))
            p.begun.append(current)
        if chunk + event.size > length:
            return self._abort(
                ReceiveReason.BAD_CHUNK, f"chunk at {chunk} of {event.size} bytes overruns segment {index}"
            ), None
        current.arrived += event.size
        p.received += event.size
        self._progressed(0, p.received, event.now)
        stage = Stage(
            index=index,
            chunk=chunk,
            payload_offset=offset + chunk,
            size=event.size,
            first=chunk == 0,
            last=current.arrived == length,
        )
        return [stage], None

    def _starts(self, index: int, offset: int, length: int, digest: str, chunk: int) -> SeatRefusal | None:
        """The first chunk of a new segment: the next index, where the previous ended, as announced."""
        p = self.progress
        expected = len(p.begun)
        if index < expected:
            return SeatRefusal(ReceiveReason.DUPLICATE, f"segment {index} again (expected {expected})")
        if index > expected or chunk != 0:
            return SeatRefusal(
                ReceiveReason.OUT_OF_ORDER, f"segment {index} chunk {chunk}, expected segment {expected} chunk 0"
            )
        end = p.begun[-1].ref.offset + p.begun[-1].ref.length if p.begun else 0
        if offset > end:
            return SeatRefusal(ReceiveReason.GAP, f"segment {index} starts at {offset}, the previous ones end at {end}")
        if offset < end:
            return SeatRefusal(
                ReceiveReason.OVERLAP, f"segment {index} starts at {offset}, the previous ones end at {end}"
            )
        if not 0 < length <= MAX_SEGMENT_BYTES:
            return SeatRefusal(ReceiveReason.BAD_CHUNK, f"segment {index} has length {length}")
        ceiling = self.open.max_bytes if self.open.total_bytes is None else self.open.total_bytes
        if offset + length > ceiling:
            return SeatRefusal(
                ReceiveReason.TOO_LARGE, f"segment {index} ends at {offset + length}, past {ceiling} bytes"
            )
        if self._announced:
            claimed = SegmentRef(index, offset, length, digest)
            if index >= len(self._announced) or self._announced[index] != claimed:
                return SeatRefusal(ReceiveReason.LAYOUT_MISMATCH, f"segment {index} is not the one announced at open")
        return None

    def _on_staged(self, event: ChunkStaged) -> tuple[list[Action], State | None]:
        p = self.progress
        p.staged += event.size
        self._progressed(1, p.staged, event.now)
        actions: list[Action] = []
        if event.digest is not None:
            claimed = p.begun[event.index].ref if event.index < len(p.begun) else None
            if claimed is None or len(p.observed) != event.index:
                return self._abort(ReceiveReason.STAGING_FAILED, f"segment {event.index} staged out of turn"), None
            if event.digest != claimed.digest:
                detail = f"segment {event.index} hashes to {event.digest[:16]}…, its header says {claimed.digest[:16]}…"
                return self._abort(ReceiveReason.DIGEST_MISMATCH, detail), None
            p.observed.append(claimed)
        ceiling = self._ceiling
        if self.granted < ceiling and self.granted - p.staged <= self.window // 2:
            self.granted = min(ceiling, p.staged + self.window)
            actions.append(Grant(self.granted))
        if self.state is State.DRAINING and p.staged == p.received:
            judged, moved = self._judge()
            return actions + judged, moved
        return actions, None

    def _on_commit(self, event: CommitArrived) -> tuple[list[Action], State | None]:
        self.last_progress = event.now
        self.commit = event.commit
        if self.progress.staged == self.progress.received:
            return self._judge()
        return [], State.DRAINING

    def _judge(self) -> tuple[list[Action], State | None]:
        """The commit against what was observed; Restore, or the first refusal."""
        commit = self.commit
        assert commit is not None
        refusal = self._commit_refusal(commit)
        if refusal is not None:
            return self._abort(refusal.reason, refusal.detail), None
        p = self.progress
        self.restore_started = self.last_progress
        return [Restore(tuple(p.observed), p.received, commit.payload_digest)], State.RESTORING

    def _commit_refusal(self, commit: HandoffCommit) -> SeatRefusal | None:
        p, open_ = self.progress, self.open
        if p.begun and p.begun[-1].arrived < p.begun[-1].ref.length:
            return SeatRefusal(ReceiveReason.INCOMPLETE, f"segment {len(p.begun) - 1} is not complete")
        if commit.n_tokens != open_.n_tokens:
            return SeatRefusal(ReceiveReason.TOKENS, f"commit says {commit.n_tokens} tokens, the open {open_.n_tokens}")
        if commit.n_segments != len(p.observed):
            return SeatRefusal(
                ReceiveReason.SEGMENT_COUNT, f"commit says {commit.n_segments} segments, {len(p.observed)} arrived"
            )
        if commit.total_bytes != p.received:
            return SeatRefusal(ReceiveReason.TOTAL, f"commit says {commit.total_bytes} bytes, {p.received} arrived")
        if open_.total_bytes is not None and open_.total_bytes != p.received:
            return SeatRefusal(
                ReceiveReason.TOTAL, f"the open announced {open_.total_bytes} bytes, {p.received} arrived"
            )
        if self._announced and len(self._announced) != len(p.observed):
            return SeatRefusal(
                ReceiveReason.SEGMENT_COUNT, f"{len(self._announced)} announced, {len(p.observed)} arrived"
            )
        observed = tuple(p.observed)
        root = layout.payload_root(observed)
        if open_.payload_digest is not None and open_.payload_digest != root:
            return SeatRefusal(ReceiveReason.PAYLOAD_DIGEST, "the payload differs from the digest announced at open")
        refusal = validate(_manifest(open_, observed, p.received, commit.payload_digest), observed, root)
        if refusal is None:
            return None
        if refusal.rule.value == "payload_digest":
            return SeatRefusal(ReceiveReason.PAYLOAD_DIGEST, refusal.detail)
        return SeatRefusal(ReceiveReason.TILING, f"{refusal.rule.value}: {refusal.detail}")

    def _on_restored(self, event: Restored) -> tuple[list[Action], State | None]:
        self.restored = event
        p = self.progress
        result = HandoffResult(
            session=self.session,
            committed=True,
            bytes=p.received,
            segments=len(p.observed),
            payload_digest=layout.payload_root(tuple(p.observed)),
            restored=event.restored,
            restore_ms=event.restore_ms,
        )
        return [Answer(result)], None

    def _on_restore_failed(self, event: RestoreFailed) -> tuple[list[Action], State | None]:
        return self._abort(ReceiveReason.RESTORE_FAILED, event.detail), None

    def _on_sender_aborted(self, event: SenderAborted) -> tuple[list[Action], State | None]:
        if self.state is State.RESTORING:
            return [], None  # verified already: the restore finishes; the sender just stopped waiting for it
        return self._abort(ReceiveReason.SENDER_ABORTED, f"{event.reason}: {event.detail}"[:1024], notify=False), None

    def _on_tick(self, event: Tick) -> tuple[list[Action], State | None]:
        deadline = self.next_deadline
        if deadline is None or event.now < deadline:
            return [], None
        if self.state is State.RESTORING:
            return self._abort(
                ReceiveReason.RESTORE_TIMEOUT, f"no restore within {self.limits.restore_timeout_s:g}s"
            ), None
        if event.now >= self.opened_at + self.limits.deadline_s:
            return self._abort(ReceiveReason.EXPIRED, f"the session outlived {self.limits.deadline_s:g}s"), None
        first = self._first_chunk_deadline()
        if first is not None and event.now >= first and event.now < self.last_progress + self.limits.idle_timeout_s:
            detail = f"no chunk within {self.limits.first_chunk_timeout_s:g}s of the open"
            return self._abort(ReceiveReason.EMPTY, detail), None
        rate = self._rate_deadline()
        if rate is not None and event.now >= rate and event.now < self.last_progress + self.limits.idle_timeout_s:
            elapsed = event.now - self.opened_at
            detail = (
                f"{self.progress.received} bytes in {elapsed:.1f}s, under "
                f"{self.limits.min_rate_bytes_per_s:g} bytes/s after {self.limits.rate_grace_s:g}s"
            )
            return self._abort(ReceiveReason.TOO_SLOW, detail), None
        idle = self.limits.idle_timeout_s
        return self._abort(
            ReceiveReason.STALLED, f"no progress for {idle:g}s ({self.progress.received} bytes arrived)"
        ), None

    def _on_failed(self, event: Failed) -> tuple[list[Action], State | None]:
        return self._abort(event.reason, event.detail), None

    def _aborted(self) -> bool:
        return self.state is State.ABORTED  # a handler may have aborted

    def _abort(self, reason: ReceiveReason, detail: str, *, notify: bool = True) -> list[Action]:
        self.state = State.ABORTED
        self.reason, self.detail = reason, detail
        actions: list[Action] = [Abort(reason, detail, notify_sender=notify)]
        if self.commit is not None:  # the sender waits for an answer to its commit
            result = HandoffResult(session=self.session, committed=False, reason=reason.value, detail=detail[:1024])
            actions.append(Answer(result))
        return actions


def _within(current: _Segment, index: int, offset: int, length: int, digest: str, chunk: int) -> SeatRefusal | None:
    """A chunk in the middle of the current segment: the same segment, the next position."""
    ref = current.ref
    if index < ref.index or (index == ref.index and chunk < current.arrived):
        return SeatRefusal(
            ReceiveReason.DUPLICATE, f"segment {index} chunk {chunk} again (at {ref.index}:{current.arrived})"
        )
    if index > ref.index or chunk > current.arrived:
        return SeatRefusal(
            ReceiveReason.OUT_OF_ORDER,
            f"segment {index} chunk {chunk}, expected segment {ref.index} chunk {current.arrived}",
        )
    if (offset, length, digest) != (ref.offset, ref.length, ref.digest):
        return SeatRefusal(ReceiveReason.BAD_CHUNK, f"segment {index}'s offset, length or digest changed mid-segment")
    return None


_INT_HEADERS: Final = (INDEX_HEADER, OFFSET_HEADER, LENGTH_HEADER, CHUNK_HEADER)
_MAX_HEADER_INT: Final = 1 << 40


def _parse(headers: Mapping[str, str], session: str) -> tuple[int, int, int, str, int] | str:
    """(index, offset, length, digest, chunk) from a chunk's headers, or why not."""
    if headers.get(SESSION_HEADER) != session:
        return f"{SESSION_HEADER} is not this session"
    values: list[int] = []
    for name in _INT_HEADERS:
        text = headers.get(name)
        if text is None or not text.isascii() or not text.isdigit() or len(text) > 13:
            return f"{name} missing or not a decimal integer"
        value = int(text)
        if value > _MAX_HEADER_INT:
            return f"{name} out of range"
        values.append(value)
    digest = headers.get(DIGEST_HEADER)
    if not layout.is_digest(digest):
        return f"{DIGEST_HEADER} is not 64 lowercase hex"
    assert digest is not None
    index, offset, length, chunk = values
    return index, offset, length, digest, chunk


#: state -> event type -> the state it leads to (unless its handler aborts or moves on). Not listed: unexpected.
_TRANSITIONS: Final[dict[State, dict[type, State]]] = {
    State.RECEIVING: {
        ChunkArrived: State.RECEIVING,
        ChunkStaged: State.RECEIVING,
        CommitArrived: State.RESTORING,  # or DRAINING while chunks are still being staged, or ABORTED
        SenderAborted: State.ABORTED,
        Tick: State.RECEIVING,
        Failed: State.ABORTED,
    },
    State.DRAINING: {
        ChunkStaged: State.DRAINING,  # RESTORING once every accepted chunk is staged and the commit holds
        SenderAborted: State.ABORTED,
        Tick: State.DRAINING,
        Failed: State.ABORTED,
    },
    State.RESTORING: {
        Restored: State.DONE,
        RestoreFailed: State.ABORTED,
        SenderAborted: State.RESTORING,
        Tick: State.RESTORING,
        Failed: State.ABORTED,
    },
    State.DONE: {},
    State.ABORTED: {},
}

_HANDLERS: Final[dict[type, Callable[..., tuple[list[Action], State | None]]]] = {
    ChunkArrived: Receiver._on_chunk,
    ChunkStaged: Receiver._on_staged,
    CommitArrived: Receiver._on_commit,
    Restored: Receiver._on_restored,
    RestoreFailed: Receiver._on_restore_failed,
    SenderAborted: Receiver._on_sender_aborted,
    Tick: Receiver._on_tick,
    Failed: Receiver._on_failed,
}
