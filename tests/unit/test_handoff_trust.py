"""What a handoff side takes from the other one is bounded by its own limits (pure cores, no bus): the sender
caps a receiver's idle timeout and chunk size, refuses a session subject other than the protocol's, and
counts a commit only when the result names the payload it sent; the receiver ends sessions that trickle,
outlive a deadline sized to them, or would not fit its disk."""

from __future__ import annotations

import blake3
import msgspec
import pytest

from actors.handoff import receiver as rx
from actors.handoff import sender as tx
from actors.l3 import layout
from actors.l3.layout import SegmentRef
from messages.handoff import HandoffOpen, HandoffOpened, HandoffResult

IDENTITY = "ab" * 32
SESSION = "5e" * 16
SUBJECT = f"mesh.handoff.node-b.{SESSION}"
CHUNK = layout.MIN_SEGMENT_BYTES


def _open(total: int) -> HandoffOpen:
    return HandoffOpen(
        sender_node="node-a",
        identity=IDENTITY,
        n_tokens=3,
        tokens=(1, 2, 3),
        total_bytes=total,
        max_bytes=total,
        credit_subject="_INBOX.x",
    )


def _opened(**fields: object) -> HandoffOpened:
    values: dict[str, object] = {
        "session": SESSION,
        "subject": SUBJECT,
        "chunk_bytes": CHUNK,
        "credit": 2 * CHUNK,
        "idle_timeout_s": 10.0,
        "deadline_s": 900.0,
    }
    values.update(fields)
    return HandoffOpened(**values)  # type: ignore[arg-type]


def _streaming(reply: HandoffOpened, total: int = 4 * CHUNK, **limits: object) -> tx.Sender:
    sender = tx.Sender(_open(total), tx.SenderLimits(**limits), now=0.0)  # type: ignore[arg-type]
    sender.handle(tx.Opened(reply, 0.0, SUBJECT))
    return sender


# ---- the sender ------------------------------------------------------------------------------------------


def test_a_receivers_huge_idle_timeout_is_capped_by_the_senders_own_credit_stall() -> None:
    sender = _streaming(_opened(idle_timeout_s=1e9), credit_stall_s=30.0)
    assert sender.state is tx.State.STREAMING
    sender.handle(tx.SegmentReady(4 * CHUNK, "cd" * 32, 0.0))
    assert len(sender.sendable()) == 2 and sender.blocked
    assert sender.next_deadline == 30.0  # was 900 (the deadline): the 1e9 was believed
    assert sender.handle(tx.Tick(29.9)) == []
    [abort] = sender.handle(tx.Tick(30.0))
    assert isinstance(abort, tx.Abort) and abort.reason is tx.SendReason.RECEIVER_STALLED


def test_a_shorter_receiver_timeout_is_kept() -> None:
    sender = _streaming(_opened(idle_timeout_s=2.0), credit_stall_s=30.0)
    sender.handle(tx.SegmentReady(4 * CHUNK, "cd" * 32, 0.0))
    sender.sendable()
    assert sender.next_deadline == 2.0


@pytest.mark.parametrize(
    "subject",
    [
        "MESH_INSTANCES.n1.data",  # a subject clients can read: 9.8 MB of KV state were published there
        f"mesh.handoff.node-c.{SESSION}",  # another node's session
        f"mesh.handoff.node-b.{'00' * 16}",  # another session
        "mesh.events.handoff",
    ],
)
def test_a_session_subject_other_than_the_protocols_is_refused_before_any_byte(subject: str) -> None:
    sender = tx.Sender(_open(CHUNK), tx.SenderLimits(), now=0.0)
    [abort] = sender.handle(tx.Opened(_opened(subject=subject), 0.0, SUBJECT))
    assert isinstance(abort, tx.Abort) and abort.reason is tx.SendReason.BAD_REPLY and not abort.notify_receiver
    assert sender.state is tx.State.ABORTED and sender.sendable() == []


def test_a_tiny_chunk_is_refused_and_a_huge_one_is_capped() -> None:
    sender = tx.Sender(_open(CHUNK), tx.SenderLimits(), now=0.0)
    [abort] = sender.handle(tx.Opened(_opened(chunk_bytes=1), 0.0, SUBJECT))
    assert isinstance(abort, tx.Abort) and abort.reason is tx.SendReason.BAD_REPLY
    sender = _streaming(_opened(chunk_bytes=1 << 30, credit=1 << 30), max_chunk_bytes=CHUNK)
    sender.handle(tx.SegmentReady(4 * CHUNK, "cd" * 32, 0.0))
    assert [c.size for c in sender.sendable()] == [CHUNK] * 4


def _committing(data: bytes) -> tuple[tx.Sender, SegmentRef]:
    sender = _streaming(_opened(credit=len(data)), total=len(data))
    digest = blake3.blake3(data).hexdigest()
    sender.handle(tx.SegmentReady(len(data), digest, 0.0))
    sender.sendable()
    [commit] = sender.handle(tx.EndOfPayload(0.0))
    assert isinstance(commit, tx.SendCommit)
    return sender, SegmentRef(0, 0, len(data), digest)


def test_a_commit_counts_only_when_the_result_names_the_payload_sent() -> None:
    data = bytes(range(256)) * 300
    sender, ref = _committing(data)
    good = HandoffResult(
        session=SESSION, committed=True, bytes=len(data), segments=1, payload_digest=layout.payload_root([ref])
    )
    [done] = sender.handle(tx.ResultArrived(good, 1.0))
    assert isinstance(done, tx.Finished) and sender.state is tx.State.DONE
    for lie in (
        msgspec.structs.replace(good, payload_digest="00" * 32),
        msgspec.structs.replace(good, payload_digest=None),
        msgspec.structs.replace(good, bytes=len(data) - 1),
        msgspec.structs.replace(good, segments=2),
        msgspec.structs.replace(good, session="00" * 16),
    ):
        sender, _ = _committing(data)
        [abort] = sender.handle(tx.ResultArrived(lie, 1.0))
        assert isinstance(abort, tx.Abort) and abort.reason is tx.SendReason.RESULT_MISMATCH, lie


@pytest.mark.parametrize(
    "field",
    [
        {"subject": "$KV.MESH_INSTANCES.n1"},
        {"subject": "mesh.handoff.>"},
        {"subject": "a" * 300},
        {"session": "../x"},
        {"chunk_bytes": 0},
        {"credit": -1},
        {"idle_timeout_s": -1.0},
    ],
)
def test_a_malformed_opened_reply_is_refused_where_it_is_decoded(field: dict[str, object]) -> None:
    raw = msgspec.json.encode({**msgspec.structs.asdict(_opened()), **field})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(raw, type=HandoffOpened)


# ---- the receiver -----------------------------------------------------------------------------------------

LIMITS = rx.ReceiverLimits(chunk_bytes=CHUNK, window_bytes=8 * CHUNK, credit_budget_bytes=64 * CHUNK)


class Trickle:
    """A receiving session fed one chunk at a time, staged at once (as the shell would)."""

    def __init__(self, total: int, limits: rx.ReceiverLimits = LIMITS) -> None:
        self.data = bytes(total)
        self.ref = SegmentRef(0, 0, total, blake3.blake3(self.data).hexdigest())
        self.core = rx.Receiver(SESSION, _open(total), limits, now=0.0)
        self.sent = 0
        self.hasher = blake3.blake3()

    def send(self, size: int, now: float) -> list[rx.Action]:
        headers = tx.chunk_headers(SESSION, self.ref, self.sent)
        out: list[rx.Action] = []
        for action in self.core.handle(rx.ChunkArrived(headers, size, now)):
            out.append(action)
            if isinstance(action, rx.Stage):
                self.hasher.update(self.data[self.sent : self.sent + size])
                digest = self.hasher.hexdigest() if action.last else None
                out += self.core.handle(rx.ChunkStaged(action.index, action.chunk, size, digest, now))
        self.sent += size
        return out

    def tick(self, now: float) -> list[rx.Action]:
        return self.core.handle(rx.Tick(now))


def test_a_byte_every_few_seconds_does_not_keep_a_session_alive() -> None:
    session = Trickle(16 * CHUNK)
    for t in (8.0, 16.0, 24.0):  # one byte every 8 s: each was "progress" before, for the whole 900 s
        assert not any(isinstance(a, rx.Abort) for a in session.send(1, t))
        if session.core.next_deadline is not None and session.core.next_deadline <= t + 8:
            break
    deadline = session.core.next_deadline
    assert deadline is not None and deadline <= LIMITS.idle_timeout_s  # counted from the open: no progress since
    [abort] = session.tick(deadline)
    assert isinstance(abort, rx.Abort) and abort.reason is rx.ReceiveReason.STALLED


def test_full_chunks_are_progress_and_the_payloads_end_too() -> None:
    session = Trickle(2 * CHUNK + 10)
    session.send(CHUNK, 9.0)
    assert session.core.last_progress == 9.0
    session.send(CHUNK, 18.0)
    session.send(10, 27.0)  # the end of the payload: progress though short
    assert session.core.last_progress == 27.0 and session.core.state is rx.State.RECEIVING


def test_a_sender_averaging_under_the_minimum_rate_is_too_slow() -> None:
    limits = rx.ReceiverLimits(
        chunk_bytes=CHUNK,
        window_bytes=8 * CHUNK,
        min_rate_bytes_per_s=float(CHUNK),
        rate_grace_s=5.0,
        first_chunk_timeout_s=10.0,  # its first chunk comes 9 s after the open
    )
    session = Trickle(1000 * CHUNK, limits)
    now = 0.0
    aborted: list[rx.Action] = []
    while not aborted and now < 100:
        now += 9.0  # a full chunk every 9 s: progress for the idle timeout, but ~1/9 of the rate asked
        deadline = session.core.next_deadline
        if deadline is not None and deadline <= now:
            aborted = [a for a in session.tick(deadline) if isinstance(a, rx.Abort)]
            break
        session.send(CHUNK, now)
    [abort] = aborted
    assert isinstance(abort, rx.Abort) and abort.reason is rx.ReceiveReason.TOO_SLOW
    assert now < 30  # not the whole deadline


def test_a_fast_sender_meets_the_rate_and_finishes() -> None:
    limits = rx.ReceiverLimits(
        chunk_bytes=CHUNK, window_bytes=8 * CHUNK, min_rate_bytes_per_s=float(CHUNK), rate_grace_s=5.0
    )
    session = Trickle(20 * CHUNK, limits)
    for i in range(20):
        assert not any(isinstance(a, rx.Abort) for a in session.send(CHUNK, 0.5 * i))
        assert session.tick(0.5 * i) == []
    assert session.core.received == 20 * CHUNK and session.core.next_deadline is not None


def test_an_open_the_staging_disk_cannot_hold_is_refused() -> None:
    open_ = _open(64 << 30)  # 64 GiB: admitted whatever the free disk before
    big = rx.ReceiverLimits(chunk_bytes=CHUNK, window_bytes=8 * CHUNK, min_free_bytes=1 << 30)
    refusal = rx.admit(open_, big, sessions=0, reserved_bytes=0, free_bytes=10 << 30)
    assert refusal is not None and refusal.reason is rx.ReceiveReason.NO_SPACE
    small = _open(1 << 30)
    assert rx.admit(small, big, sessions=0, reserved_bytes=0, free_bytes=3 << 30) is None
    # what open sessions may still write is not free: two such sessions do not both fit
    free = (5 << 30) // 2
    assert rx.admit(small, big, sessions=0, reserved_bytes=0, free_bytes=free) is None
    refusal = rx.admit(small, big, sessions=1, reserved_bytes=1 << 30, free_bytes=free, unwritten_bytes=1 << 30)
    assert refusal is not None and refusal.reason is rx.ReceiveReason.NO_SPACE
    assert rx.admit(small, big, sessions=0, reserved_bytes=0) is None  # not checked without a figure


def test_what_a_session_may_still_write_shrinks_as_it_stages() -> None:
    session = Trickle(4 * CHUNK)
    assert session.core.unwritten == 4 * CHUNK
    session.send(CHUNK, 0.1)
    assert session.core.unwritten == 3 * CHUNK
