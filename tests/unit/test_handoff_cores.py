"""The handoff sender and receiver cores driven against each other in memory (no bus, no clock): a clean
transfer, and every fault the receiver must refuse by name with nothing restored."""

from __future__ import annotations

import dataclasses
import random

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st
from msgspec.structs import replace

from actors.handoff import receiver as rx
from actors.handoff import sender as tx
from actors.l3 import layout
from actors.l3.layout import SegmentRef
from messages.handoff import HandoffCommit, HandoffOpen, HandoffOpened, SegmentSpec

CHUNK = 1000
LIMITS = rx.ReceiverLimits(chunk_bytes=CHUNK, window_bytes=4 * CHUNK, idle_timeout_s=5.0, deadline_s=100.0)
IDENTITY = "ab" * 32
SENDER = tx.SenderLimits(min_chunk_bytes=1)  # chunks of CHUNK bytes keep these tests small


def _segments(sizes: list[int], seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


def _refs(segments: list[bytes]) -> list[SegmentRef]:
    refs, offset = [], 0
    for i, data in enumerate(segments):
        refs.append(SegmentRef(i, offset, len(data), blake3.blake3(data).hexdigest()))
        offset += len(data)
    return refs


def _open(segments: list[bytes], *, announce: bool = True) -> HandoffOpen:
    refs = _refs(segments)
    total = sum(len(s) for s in segments)
    return HandoffOpen(
        sender_node="a",
        identity=IDENTITY,
        n_tokens=3,
        tokens=(1, 2, 3),
        total_bytes=total if announce else None,
        max_bytes=total,
        segments=tuple(SegmentSpec(index=r.index, offset=r.offset, length=r.length, digest=r.digest) for r in refs)
        if announce
        else (),
        payload_digest=layout.payload_root(refs) if announce else None,
        credit_subject="_INBOX.x",
    )


class Wire:
    """A receiver fed chunk metadata by hand, staging (hashing) as the shell would."""

    def __init__(self, open_: HandoffOpen, segments: list[bytes]) -> None:
        assert rx.admit(open_, LIMITS, sessions=0, reserved_bytes=0) is None
        self.core = rx.Receiver("s" * 32, open_, LIMITS, now=0.0)
        self.segments = segments
        self.refs = _refs(segments)
        self.actions: list[rx.Action] = []
        self.hasher = blake3.blake3()
        self.staged = bytearray(open_.max_bytes)
        self.now = 0.0

    def chunk(self, ref: SegmentRef, chunk: int, data: bytes, *, headers: dict[str, str] | None = None) -> None:
        self.now += 0.01
        headers = headers or tx.chunk_headers(self.core.session, ref, chunk)
        for action in self.core.handle(rx.ChunkArrived(headers, len(data), self.now)):
            self.actions.append(action)
            if isinstance(action, rx.Stage):
                if action.first:
                    self.hasher = blake3.blake3()
                self.hasher.update(data)
                self.staged[action.payload_offset : action.payload_offset + action.size] = data
                digest = self.hasher.hexdigest() if action.last else None
                staged = rx.ChunkStaged(action.index, action.chunk, action.size, digest, self.now)
                self.actions.extend(self.core.handle(staged))

    def segment(self, i: int, data: bytes | None = None, ref: SegmentRef | None = None) -> None:
        data = self.segments[i] if data is None else data
        ref = ref or self.refs[i]
        for c in range(0, len(data), CHUNK):
            self.chunk(ref, c, data[c : c + CHUNK])

    def commit(self, **changes: object) -> None:
        commit = HandoffCommit(
            session=self.core.session,
            n_segments=len(self.refs),
            total_bytes=sum(r.length for r in self.refs),
            n_tokens=3,
            payload_digest=layout.payload_root(self.refs),
        )
        self.actions.extend(self.core.handle(rx.CommitArrived(replace(commit, **changes), self.now)))

    def state(self) -> rx.State:
        return self.core.state  # read through a call: mypy keeps no narrowing of it across handle()

    def restored(self) -> bool:
        return any(isinstance(a, rx.Restore) for a in self.actions)

    def aborted(self) -> rx.ReceiveReason | None:
        aborts = [a for a in self.actions if isinstance(a, rx.Abort)]
        assert len(aborts) <= 1
        return aborts[0].reason if aborts else None


def _refused(open_: HandoffOpen, *, sessions: int = 0) -> rx.ReceiveReason:
    """Why `admit` refuses `open_` (with nothing reserved); the test expects a refusal."""
    refusal = rx.admit(open_, LIMITS, sessions=sessions, reserved_bytes=0)
    assert refusal is not None
    return refusal.reason


SIZES = [2500, 3000, 1200]


@pytest.mark.parametrize("announce", [True, False], ids=["announced", "streamed"])
def test_clean_transfer_restores_exactly_once_with_the_bytes_sent(announce: bool) -> None:
    segs = _segments(SIZES)
    wire = Wire(_open(segs, announce=announce), segs)
    for i in range(len(segs)):
        wire.segment(i)
    wire.commit()
    assert wire.aborted() is None and wire.state() is rx.State.RESTORING
    [restore] = [a for a in wire.actions if isinstance(a, rx.Restore)]
    assert list(restore.segments) == wire.refs and bytes(wire.staged) == b"".join(segs)
    answer = wire.core.handle(rx.Restored("entry", 1.0, wire.now))
    assert isinstance(answer[0], rx.Answer) and answer[0].result.committed and wire.state() is rx.State.DONE


def test_credit_is_granted_only_for_staged_bytes_and_bounds_what_may_be_published() -> None:
    segs = _segments([10 * CHUNK])
    wire = Wire(_open(segs), segs)
    assert wire.core.granted == 4 * CHUNK
    # publish past the window without waiting for a grant: refused
    ref = wire.refs[0]
    for c in range(0, 5 * CHUNK, CHUNK):
        wire.core.handle(rx.ChunkArrived(tx.chunk_headers(wire.core.session, ref, c), CHUNK, 0.1))
    assert wire.core.reason is rx.ReceiveReason.CREDIT_EXCEEDED


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("duplicate", rx.ReceiveReason.DUPLICATE),
        ("reorder", rx.ReceiveReason.OUT_OF_ORDER),
        ("gap", rx.ReceiveReason.GAP),
        ("overlap", rx.ReceiveReason.OVERLAP),
        ("corrupt", rx.ReceiveReason.DIGEST_MISMATCH),
        ("drop", rx.ReceiveReason.SEGMENT_COUNT),
        ("digest_lie", rx.ReceiveReason.PAYLOAD_DIGEST),
        ("count_lie", rx.ReceiveReason.SEGMENT_COUNT),
        ("total_lie", rx.ReceiveReason.TOTAL),
        ("tokens_lie", rx.ReceiveReason.TOKENS),
        ("layout", rx.ReceiveReason.LAYOUT_MISMATCH),
        ("chunk_dup", rx.ReceiveReason.DUPLICATE),
        ("chunk_skip", rx.ReceiveReason.OUT_OF_ORDER),
        ("bad_header", rx.ReceiveReason.BAD_CHUNK),
        ("mid_segment_commit", rx.ReceiveReason.INCOMPLETE),
    ],
)
def test_faults_are_refused_by_name_and_nothing_is_restored(fault: str, reason: rx.ReceiveReason) -> None:
    segs = _segments(SIZES)
    announce = fault not in ("gap", "overlap", "drop", "count_lie", "total_lie")
    wire = Wire(_open(segs, announce=announce), segs)
    r = wire.refs
    if fault == "duplicate":
        wire.segment(0)
        wire.segment(0)
    elif fault == "reorder":
        wire.segment(1)
    elif fault == "gap":
        wire.segment(0)
        wire.segment(1, ref=SegmentRef(1, r[1].offset + 1, r[1].length, r[1].digest))
    elif fault == "overlap":
        wire.segment(0)
        wire.segment(1, ref=SegmentRef(1, r[1].offset - 1, r[1].length, r[1].digest))
    elif fault == "corrupt":
        bad = bytearray(segs[1])
        bad[7] ^= 1
        wire.segment(0)
        wire.segment(1, data=bytes(bad))
    elif fault == "drop":
        wire.segment(0)
        wire.segment(1)
        wire.commit()  # claims three
    elif fault in ("digest_lie", "count_lie", "total_lie", "tokens_lie"):
        for i in range(3):
            wire.segment(i)
        changes: dict[str, object] = {
            "digest_lie": {"payload_digest": "cd" * 32},
            "count_lie": {"n_segments": 2},
            "total_lie": {"total_bytes": 1},
            "tokens_lie": {"n_tokens": 4},
        }[fault]  # type: ignore[assignment]
        wire.commit(**changes)
    elif fault == "layout":
        other = _segments(SIZES, seed=2)
        wire.segment(0, data=other[0], ref=_refs(other)[0])
    elif fault == "chunk_dup":
        wire.chunk(r[0], 0, segs[0][:CHUNK])
        wire.chunk(r[0], 0, segs[0][:CHUNK])
    elif fault == "chunk_skip":
        wire.chunk(r[0], 0, segs[0][:CHUNK])
        wire.chunk(r[0], 2 * CHUNK, segs[0][2 * CHUNK : 3 * CHUNK])
    elif fault == "bad_header":
        headers = tx.chunk_headers(wire.core.session, r[0], 0)
        headers["Handoff-Index"] = "-1"
        wire.chunk(r[0], 0, segs[0][:CHUNK], headers=headers)
    elif fault == "mid_segment_commit":
        wire.chunk(r[0], 0, segs[0][:CHUNK])
        wire.commit()
    assert wire.aborted() is reason
    assert not wire.restored() and wire.core.state is rx.State.ABORTED
    assert wire.core.handle(rx.Tick(1e9)) == []  # over: nothing more happens


def test_stalled_sender_is_aborted_at_the_deadline_the_core_names() -> None:
    segs = _segments(SIZES)
    wire = Wire(_open(segs), segs)
    wire.segment(0)  # 1000 + 1000 + 500 bytes: the short tail is no step of progress (a trickle would be)
    deadline = wire.core.next_deadline
    assert deadline is not None
    assert wire.core.last_progress == pytest.approx(wire.now - 0.01)
    assert deadline == pytest.approx(wire.core.last_progress + LIMITS.idle_timeout_s)
    assert wire.core.handle(rx.Tick(deadline - 0.001)) == []
    [abort] = wire.core.handle(rx.Tick(deadline))
    assert isinstance(abort, rx.Abort) and abort.reason is rx.ReceiveReason.STALLED


def test_a_commit_that_fails_is_answered_with_the_refusal() -> None:
    segs = _segments(SIZES)
    wire = Wire(_open(segs), segs)
    wire.segment(0)
    wire.commit()
    answers = [a for a in wire.actions if isinstance(a, rx.Answer)]
    assert answers and not answers[0].result.committed and answers[0].result.reason == "segment_count"


def test_open_is_refused_when_the_layout_lies_or_limits_are_reached() -> None:
    segs = _segments(SIZES)
    good = _open(segs)
    assert _refused(replace(good, payload_digest="cd" * 32)) is rx.ReceiveReason.BAD_OPEN
    assert rx.admit(replace(good, total_bytes=good.max_bytes - 1), LIMITS, sessions=0, reserved_bytes=0) is not None
    assert _refused(good, sessions=LIMITS.max_sessions) is rx.ReceiveReason.BUSY
    assert _refused(replace(good, tokens=(1,))) is rx.ReceiveReason.BAD_OPEN


def test_sender_never_publishes_past_its_credit_and_commits_the_root_of_what_it_sent() -> None:
    segs = _segments([3500, 1800])
    open_ = _open(segs, announce=False)
    sender = tx.Sender(open_, SENDER, now=0.0)
    reply = HandoffOpened(
        session="s" * 32, subject="x", chunk_bytes=CHUNK, credit=2 * CHUNK, idle_timeout_s=5, deadline_s=9
    )
    sender.handle(tx.Opened(reply, 0.0, "x"))
    receiver = rx.Receiver("s" * 32, open_, LIMITS, now=0.0)
    hasher = blake3.blake3()
    published = 0
    for data in segs:
        sender.handle(tx.SegmentReady(len(data), blake3.blake3(data).hexdigest(), 0.0))
        while sender.pending:
            sendable = sender.sendable()
            if not sendable:
                assert sender.blocked and sender.next_deadline == 5.0
            for c in sendable:
                published += c.size
                assert published <= sender.limit
                for a in receiver.handle(
                    rx.ChunkArrived(tx.chunk_headers(reply.session, c.segment, c.chunk), c.size, 0)
                ):
                    assert isinstance(a, rx.Stage)
                    part = data[c.chunk : c.chunk + c.size]
                    hasher = blake3.blake3() if a.first else hasher
                    hasher.update(part)
                    digest = hasher.hexdigest() if a.last else None
                    for g in receiver.handle(rx.ChunkStaged(a.index, a.chunk, a.size, digest, 0)):
                        assert isinstance(g, rx.Grant)
                        sender.handle(tx.Credit(g.limit, 0.0))
    [commit] = sender.handle(tx.EndOfPayload(0.0))
    assert isinstance(commit, tx.SendCommit)
    [restore] = receiver.handle(rx.CommitArrived(commit.commit, 0.0))
    assert isinstance(restore, rx.Restore) and restore.payload_digest == layout.payload_root(_refs(segs))


def test_sender_gives_up_when_no_credit_comes() -> None:
    segs = _segments([5000])
    sender = tx.Sender(_open(segs, announce=False), SENDER, now=0.0)
    reply = HandoffOpened(
        session="s" * 32, subject="x", chunk_bytes=CHUNK, credit=CHUNK, idle_timeout_s=2, deadline_s=9
    )
    sender.handle(tx.Opened(reply, 0.0, "x"))
    sender.handle(tx.SegmentReady(5000, blake3.blake3(segs[0]).hexdigest(), 0.0))
    assert len(sender.sendable()) == 1 and sender.blocked
    [abort] = sender.handle(tx.Tick(2.0))
    assert isinstance(abort, tx.Abort) and abort.reason is tx.SendReason.RECEIVER_STALLED and abort.notify_receiver


_HEADER_NAMES = [
    "Handoff-Session",
    "Handoff-Index",
    "Handoff-Offset",
    "Handoff-Length",
    "Handoff-Digest",
    "Handoff-Chunk",
]


@given(
    headers=st.dictionaries(
        st.sampled_from(_HEADER_NAMES),
        st.one_of(st.text(max_size=80), st.integers(-5, 1 << 50).map(str), st.just("ab" * 32)),
    ),
    size=st.integers(-1, 3 * CHUNK),
)
def test_any_chunk_headers_are_judged_never_raise(headers: dict[str, str], size: int) -> None:
    segs = _segments(SIZES)
    core = rx.Receiver("s" * 32, _open(segs, announce=False), LIMITS, now=0.0)
    actions = core.handle(rx.ChunkArrived(headers, size, 0.0))
    assert len(actions) == 1 and isinstance(actions[0], (rx.Stage, rx.Abort))
    if isinstance(actions[0], rx.Abort):
        assert core.state is rx.State.ABORTED and not any(isinstance(a, rx.Restore) for a in actions)


BUDGET = dataclasses.replace(LIMITS, window_bytes=6 * CHUNK, credit_budget_bytes=16 * CHUNK)


@given(
    st.lists(st.tuples(st.sampled_from(["open", "step", "close"]), st.integers(0, 7), st.integers(1, 12)), max_size=60)
)
def test_what_every_session_may_have_in_flight_stays_within_the_credit_budget(
    steps: list[tuple[str, int, int]],
) -> None:
    """Sessions of any size opening, moving chunk by chunk (widening as the shell does) and closing in any order:
    each window is two chunks at least and `window_bytes` at most, what a session's grant lets its sender publish
    beyond what is staged never exceeds its reservation, and the reservations together (each counted as two
    chunks at least, with two set aside for every session that could still open) stay within the budget."""
    limits, floor = BUDGET, 2 * CHUNK
    assert rx.session_window(limits, []) == 6 * CHUNK  # alone: the whole window
    wires: list[Wire] = []
    for kind, which, chunks in steps:
        if kind == "open" and len(wires) < limits.max_sessions:
            segs = _segments([chunks * CHUNK], seed=len(wires))
            wire = Wire(_open(segs), segs)
            window = rx.session_window(limits, [w.core.credit_reserved for w in wires])
            wire.core = rx.Receiver(f"{len(wires):032d}", wire.core.open, limits, now=0.0, window=window)
            wires.append(wire)
        elif kind == "step" and wires:
            wire = wires[which % len(wires)]
            ref, sent = wire.refs[0], wire.core.received
            if sent < wire.core.granted:
                wire.chunk(ref, sent, wire.segments[0][sent : sent + CHUNK])
                others = [w.core.credit_reserved for w in wires if w is not wire]
                wire.core.widen(rx.session_window(limits, others))
                assert wire.aborted() is None
        elif kind == "close" and wires:
            wires.pop(which % len(wires))
        for w in wires:
            assert floor <= w.core.window <= limits.window_bytes
            assert w.core.granted - w.core.progress.staged <= w.core.credit_reserved
        held = sum(max(floor, w.core.credit_reserved) for w in wires)
        assert held + floor * (limits.max_sessions - len(wires)) <= limits.credit_budget_bytes


def test_a_session_takes_the_budget_others_gave_back_at_its_next_grant() -> None:
    limits = dataclasses.replace(BUDGET, credit_budget_bytes=12 * CHUNK)
    segs = _segments([12 * CHUNK])
    first, second = Wire(_open(segs), segs), Wire(_open(segs), segs)
    first.core = rx.Receiver("a" * 32, first.core.open, limits, now=0.0, window=rx.session_window(limits, []))
    window = rx.session_window(limits, [first.core.credit_reserved])
    assert window == 2 * CHUNK  # the budget (12), less the first (6) and a floor (2) for each of two more
    second.core = rx.Receiver("b" * 32, second.core.open, limits, now=0.0, window=window)
    assert second.core.granted == 2 * CHUNK
    second.core.widen(rx.session_window(limits, []))  # the first is gone (as the shell does before staging)
    second.chunk(second.refs[0], 0, segs[0][:CHUNK])  # so this chunk's grant reaches the whole window ahead
    assert second.core.granted == CHUNK + 6 * CHUNK


def test_a_session_grants_within_its_own_window() -> None:
    """A session opened when the budget was spent has two chunks of credit: a third chunk before a grant is
    refused, and each grant reaches two chunks past what is staged."""
    segs = _segments([10 * CHUNK])
    open_ = _open(segs)
    core = rx.Receiver("t" * 32, open_, LIMITS, now=0.0, window=2 * CHUNK)
    assert core.granted == 2 * CHUNK
    ref = _refs(segs)[0]
    staged = [
        a for c in (0, CHUNK) for a in core.handle(rx.ChunkArrived(tx.chunk_headers(core.session, ref, c), CHUNK, 0.1))
    ]
    assert [type(a) for a in staged] == [rx.Stage, rx.Stage]
    grants = core.handle(rx.ChunkStaged(0, 0, CHUNK, None, 0.2))
    assert grants == [rx.Grant(3 * CHUNK)]
    core.handle(rx.ChunkArrived(tx.chunk_headers(core.session, ref, 2 * CHUNK), CHUNK, 0.3))
    assert core.reason is None
    core.handle(rx.ChunkArrived(tx.chunk_headers(core.session, ref, 3 * CHUNK), CHUNK, 0.4))
    assert core.reason is rx.ReceiveReason.CREDIT_EXCEEDED
    with pytest.raises(ValueError, match="two chunks"):
        rx.Receiver("u" * 32, open_, LIMITS, now=0.0, window=CHUNK)
    with pytest.raises(ValueError, match="every session"):
        dataclasses.replace(LIMITS, credit_budget_bytes=7 * CHUNK)  # 4 sessions x 2 chunks do not fit
