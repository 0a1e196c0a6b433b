"""A receiver's sessions are shared fairly between sending nodes (issue 30, F10): one peer re-opening empty
sessions held all four places, 10 s each, and refused an honest peer 16 times in 20. Each node now has its
share, a newcomer under its share takes the place of an empty session of a node over its share, and an empty
session is given up within its first-chunk timeout."""

from __future__ import annotations

import blake3
from hypothesis import given
from hypothesis import strategies as st

from actors.handoff import receiver as rx
from actors.handoff import sender as tx
from actors.l3.layout import SegmentRef
from messages.handoff import HandoffOpen

CHUNK = 1000
LIMITS = rx.ReceiverLimits(chunk_bytes=CHUNK, window_bytes=4 * CHUNK, idle_timeout_s=10.0, first_chunk_timeout_s=2.0)
SESSION = "5e" * 16


def _seat(session: str, sender: str, received: int = 0, opened_at: float = 0.0) -> rx.Seat:
    return rx.Seat(session=session, sender=sender, received=received, opened_at=opened_at)


def test_one_sender_alone_may_hold_every_session_but_not_one_more() -> None:
    seats = [_seat(f"s{i}", "mallory", opened_at=i) for i in range(3)]
    assert rx.seat("mallory", seats, LIMITS) == rx.Seated()
    full = [*seats, _seat("s3", "mallory", opened_at=3)]
    refusal = rx.seat("mallory", full, LIMITS)
    assert isinstance(refusal, rx.SeatRefusal) and refusal.reason is rx.ReceiveReason.BUSY
    assert "its share of 4 among 1 sending nodes is 4" in refusal.detail


def test_a_newcomer_takes_the_place_of_the_newest_empty_session_of_a_sender_over_its_share() -> None:
    seats = [_seat(f"s{i}", "mallory", opened_at=i) for i in range(4)]  # every place, all empty
    assert rx.seat("honest", seats, LIMITS) == rx.Seated(evict="s3")
    # Two senders: two places each. The one over it cannot open more, even once a place is free.
    three = [*seats[:2], _seat("h0", "honest", received=5 * CHUNK)]
    refusal = rx.seat("mallory", three, LIMITS)
    assert isinstance(refusal, rx.SeatRefusal) and refusal.reason is rx.ReceiveReason.BUSY and "share" in refusal.detail
    assert rx.seat("honest", three, LIMITS) == rx.Seated()


def test_a_session_that_moves_bytes_is_never_preempted() -> None:
    seats = [_seat(f"s{i}", "busy-node", received=CHUNK, opened_at=i) for i in range(4)]
    refusal = rx.seat("honest", seats, LIMITS)
    assert isinstance(refusal, rx.SeatRefusal) and refusal.reason is rx.ReceiveReason.BUSY
    assert "4 sessions open, at most 4" in refusal.detail
    # among the senders over their share, the one holding most gives its empty place first
    mixed = [_seat("a0", "a", opened_at=5), _seat("b0", "b", opened_at=1), _seat("b1", "b", opened_at=2)]
    mixed.append(_seat("b2", "b", received=CHUNK, opened_at=3))
    assert rx.seat("c", mixed, LIMITS) == rx.Seated(evict="b1")


def test_a_sender_under_its_share_waits_when_no_sender_is_over_it() -> None:
    seats = [_seat(f"s{i}", f"node-{i}") for i in range(4)]  # four senders, one place each: everyone at its share
    refusal = rx.seat("node-5", seats, LIMITS)
    assert isinstance(refusal, rx.SeatRefusal) and refusal.reason is rx.ReceiveReason.BUSY


@given(
    st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), st.booleans(), st.integers(0, 100)), max_size=6),
    st.sampled_from(["a", "b", "c", "f"]),
    st.integers(1, 6),
)
def test_a_seat_never_exceeds_the_bounds_nor_cuts_a_session_that_moves_bytes(
    held: list[tuple[str, bool, int]], sender: str, max_sessions: int
) -> None:
    limits = rx.ReceiverLimits(
        chunk_bytes=CHUNK, window_bytes=4 * CHUNK, max_sessions=max_sessions, credit_budget_bytes=64 * CHUNK
    )
    seats = [
        _seat(f"s{i}", who, received=CHUNK if moving else 0, opened_at=t) for i, (who, moving, t) in enumerate(held)
    ]
    decision = rx.seat(sender, seats, limits)
    if isinstance(decision, rx.SeatRefusal):
        assert decision.reason is rx.ReceiveReason.BUSY
        return
    staying = [s for s in seats if s.session != decision.evict]
    assert len(staying) < max_sessions or len(seats) > max_sessions  # a place is free for it
    senders = {s.sender for s in seats} | {sender}
    mine = sum(s.sender == sender for s in staying) + 1
    assert mine <= rx.share(limits, len(senders))  # within its share once seated
    if decision.evict is not None:
        [victim] = [s for s in seats if s.session == decision.evict]
        assert victim.received == 0 and victim.sender != sender
        assert sum(s.sender == victim.sender for s in seats) > rx.share(limits, len(senders))


def _open(total: int) -> HandoffOpen:
    return HandoffOpen(
        sender_node="a", identity="ab" * 32, n_tokens=1, total_bytes=total, max_bytes=total, credit_subject="_INBOX.x"
    )


def test_an_empty_session_is_aborted_at_its_first_chunk_deadline_long_before_the_idle_timeout() -> None:
    core = rx.Receiver(SESSION, _open(4 * CHUNK), LIMITS, now=100.0)
    assert core.next_deadline == 102.0  # not 110 (the idle timeout)
    assert core.handle(rx.Tick(101.9)) == []
    [abort] = core.handle(rx.Tick(102.0))
    assert isinstance(abort, rx.Abort) and abort.reason is rx.ReceiveReason.EMPTY and abort.notify_sender


def test_a_first_chunk_in_time_leaves_the_session_to_the_idle_timeout() -> None:
    data = bytes(4 * CHUNK)
    ref = SegmentRef(0, 0, len(data), blake3.blake3(data).hexdigest())
    core = rx.Receiver(SESSION, _open(len(data)), LIMITS, now=100.0)
    [stage] = core.handle(rx.ChunkArrived(tx.chunk_headers(SESSION, ref, 0), CHUNK, 101.5))
    assert isinstance(stage, rx.Stage)
    assert core.next_deadline == 111.5  # a chunk is progress: the idle timeout from it, not the first-chunk one
    assert core.handle(rx.Tick(102.0)) == [] and core.state is rx.State.RECEIVING
