"""A split's reservation over several ledgers: booked all or none (head first, taken back members first), and
reconciled as one (a member's part follows its head's part)."""

from __future__ import annotations

import msgspec
import pytest

from actors.placement.booking import Booking, booking_order
from actors.placement.ledger import available, with_reservation
from actors.placement.reservations import Promote, Reconciler, Release, apply, observed_held
from messages.placement import NodeLedger, Reservation, ReservationState, SplitPart
from tests.harness.admission import node
from tests.harness.reservations import GIB, T0, record, reservation

SPLIT = SplitPart(head="h", members=("m1", "m2"))


def part(
    node_id: str,
    rid: str = "r1",
    state: ReservationState = "reserved",
    instance: str | None = None,
    **fields: object,
) -> Reservation:
    booked = reservation(rid, state, instance, **fields)
    return msgspec.structs.replace(booked, node_id=node_id, split=SPLIT, multi_node=True)


def ledger_of(node_id: str, *reservations: Reservation) -> NodeLedger:
    return NodeLedger(node_id=node_id, reservations=reservations)


def test_the_head_part_is_written_first_and_members_in_rpc_order() -> None:
    parts = [part("m2"), part("h"), part("m1")]
    assert [r.node_id for r in booking_order(parts)] == ["h", "m1", "m2"]
    booking = Booking(parts)
    written = []
    while (next_part := booking.next_write()) is not None:
        written.append(next_part.node_id)
        booking.wrote(next_part)
    assert written == ["h", "m1", "m2"] and booking.state == "booked"


def test_a_lost_compare_and_set_takes_back_every_part_written_members_first() -> None:
    booking = Booking([part("h"), part("m1"), part("m2")])
    for _ in range(2):
        written = booking.next_write()
        assert written is not None
        booking.wrote(written)
    lost = booking.next_write()
    assert lost is not None and lost.node_id == "m2"
    releases = booking.failed(lost, uncertain=False)
    assert [(r.node, r.reason, r.seen) for r in releases] == [
        ("m1", "rolled_back", ("reserved", None)),
        ("h", "rolled_back", ("reserved", None)),
    ]
    assert booking.state == "failed" and booking.next_write() is None


def test_a_write_whose_outcome_is_unknown_is_taken_back_too() -> None:
    booking = Booking([part("h"), part("m1")])
    head = booking.next_write()
    assert head is not None
    booking.wrote(head)
    uncertain = booking.next_write()
    assert uncertain is not None
    assert [r.node for r in booking.failed(uncertain, uncertain=True)] == ["m1", "h"]


def test_a_take_back_never_touches_a_part_a_runner_claimed() -> None:
    head = part("h")
    booking = Booking([head])
    (release,) = booking.failed(head, uncertain=True)
    claimed = ledger_of("h", part("h", state="starting", instance="i1"))
    assert apply(release, claimed) is None


def test_reports_out_of_order_are_refused() -> None:
    booking = Booking([part("h"), part("m1")])
    with pytest.raises(RuntimeError):
        booking.wrote(part("m1"))


def _changes(
    reconciler: Reconciler,
    node_id: str,
    ledgers: dict[str, NodeLedger | None],
    now: float,
    sent_at: float | None = None,
) -> tuple[object, ...]:
    led = ledgers[node_id]
    assert led is not None
    return reconciler.changes(
        node_id, led, node_started_at=None, now=now, records_complete=True, ledgers=ledgers, node_sent_at=sent_at
    )


def test_a_member_part_is_held_while_its_head_part_is_and_released_after() -> None:
    r = Reconciler(claim_grace_s=30)
    ledgers: dict[str, NodeLedger | None] = {"h": ledger_of("h", part("h")), "m1": ledger_of("m1", part("m1"))}
    assert _changes(r, "m1", ledgers, T0 + 10_000) == ()  # never expires on its own hold
    ledgers["h"] = ledger_of("h")
    (change,) = _changes(r, "m1", ledgers, T0 + 10_001)
    assert isinstance(change, Release) and change.reason == "head_released" and change.node == "m1"
    del ledgers["h"]  # the head's ledger unknown (unreadable): nothing is judged
    assert _changes(r, "m1", ledgers, T0 + 10_002) == ()


def test_a_member_part_runs_once_its_head_part_runs_on_the_members_clock() -> None:
    r = Reconciler()
    running_head = part("h", state="running", instance="i1", running_since=1.0)
    ledgers: dict[str, NodeLedger | None] = {"h": ledger_of("h", running_head), "m1": ledger_of("m1", part("m1"))}
    (change,) = _changes(r, "m1", ledgers, T0, sent_at=777.0)
    assert isinstance(change, Promote) and change.running_since == 777.0 and change.instance_id == "i1"
    after = apply(change, ledgers["m1"])
    assert after is not None
    (promoted,) = after.reservations
    assert promoted.state == "running" and promoted.held == part("m1").held  # the prediction is kept
    # the member's report sent at 777 did not see the memory yet; the next one does
    member = node("m1", 10 * GIB, total=16 * GIB, sent_at=777.0)
    later = msgspec.structs.replace(member, sent_at=778.0)
    assert available(member, after)["CPU"] == 10 * GIB - 2 * GIB
    assert available(later, after)["CPU"] == 10 * GIB


def test_an_unclaimed_head_whose_members_never_all_booked_is_released_after_the_grace() -> None:
    r = Reconciler(claim_grace_s=30)
    ledgers: dict[str, NodeLedger | None] = {"h": ledger_of("h", part("h")), "m1": ledger_of("m1", part("m1"))}
    assert _changes(r, "h", ledgers, T0) == ()  # m2's part is being written
    (change,) = _changes(r, "h", ledgers, T0 + 31)
    assert isinstance(change, Release) and change.reason == "split_incomplete"
    complete = {**ledgers, "m2": ledger_of("m2", part("m2"))}
    assert _changes(Reconciler(claim_grace_s=0), "h", complete, T0) == ()


def test_the_head_part_follows_its_instance_like_any_reservation() -> None:
    r = Reconciler(claim_grace_s=30)
    head = part("h", state="starting", instance="i1")
    ledgers: dict[str, NodeLedger | None] = {"h": ledger_of("h", head)}
    r.saw_record("i1", msgspec.structs.replace(record("i1", "stopped"), node="h"), T0)
    (change,) = _changes(r, "h", ledgers, T0)
    assert isinstance(change, Release) and change.reason == "stopped"
    assert observed_held(head, 123) == head.held  # a split keeps its prediction once running


def test_a_booked_split_adds_one_part_to_each_ledger() -> None:
    ledgers = {n: with_reservation(None, n, part(n)) for n in ("h", "m1", "m2")}
    assert all(led.reservations[0].split == SPLIT for led in ledgers.values())
    assert {led.reservations[0].held["CPU"] for led in ledgers.values()} == {2 * GIB}
