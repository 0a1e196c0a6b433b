"""The runner's bookings core: what a starting runner releases of its predecessor's, and what becomes of an
instance that runs while its reservation is gone (booked again, or stopped when it no longer fits)."""

from __future__ import annotations

import msgspec

from actors.placement.reservations import Release, apply
from actors.runner.ledger_rules import Live, Rebook, Stop, lapsed, orphaned, rebook
from messages.placement import NodeLedger, Reservation, ReservationState, SplitPart
from tests.harness.reservations import GIB, STARTED, device, reservation

NOW = STARTED + 1000.0  # the node's clock


def ledger(*reservations: Reservation) -> NodeLedger:
    return NodeLedger(node_id="a", reservations=reservations)


def claimed(rid: str, instance: str, state: ReservationState = "starting", gib: int = 2) -> Reservation:
    return reservation(rid, state=state, instance=instance, held={"CPU": gib * GIB}, expires_at=None)


def live(rid: str = "r1", instance: str = "i1", state: str = "ready", observed: int | None = GIB) -> Live:
    return Live(instance, claimed(rid, instance), state, observed)  # type: ignore[arg-type]


def test_a_starting_runner_releases_every_claim_of_its_node_and_leaves_unclaimed_bookings() -> None:
    book = ledger(claimed("r1", "old-1"), claimed("r2", "old-2", "running"), reservation("r3"))
    releases = orphaned(book, "a")
    assert [(r.reservation_id, r.reason, r.seen) for r in releases] == [
        ("r1", "instance_gone", ("starting", "old-1")),
        ("r2", "instance_gone", ("running", "old-2")),
    ]
    after = book
    for release in releases:
        after = apply(release, after) or after
    assert after == ledger(reservation("r3"))  # a booking a placement just made stays for its start
    assert orphaned(None, "a") == () and orphaned(ledger(reservation("r3")), "a") == ()


def test_a_starting_runner_leaves_the_parts_it_lends_to_a_split() -> None:
    """A member's part of a split runs on its head (whose runner restarts it on this node's new RPC server):
    placement releases it with the head's part; the head's own part on its node is released as any claim."""
    split = SplitPart(head="h", members=("a",))
    lent = msgspec.structs.replace(claimed("r1", "i1", "running"), split=split, multi_node=True)
    headed = msgspec.structs.replace(claimed("r2", "i2"), split=SplitPart(head="a", members=("m",)), multi_node=True)
    assert [r.reservation_id for r in orphaned(ledger(lent, headed), "a")] == ["r2"]


def test_a_release_decided_at_start_does_not_touch_a_claim_made_since() -> None:
    (release,) = orphaned(ledger(claimed("r1", "old-1")), "a")
    reclaimed = ledger(claimed("r1", "new-1"))  # not possible for a starting runner, and checked all the same
    assert isinstance(release, Release) and apply(release, reclaimed) is None


def test_only_live_instances_whose_reservation_is_missing_have_lapsed() -> None:
    instances = [live("r1", "i1"), live("r2", "i2"), live("r3", "i3", state="stopped")]
    assert [i.instance_id for i in lapsed(ledger(claimed("r2", "i2")), instances)] == ["i1"]
    assert [i.instance_id for i in lapsed(None, instances)] == ["i1", "i2"]


def test_a_ready_instance_is_booked_again_as_it_runs() -> None:
    outcome = rebook(ledger(), "a", live(observed=GIB), capacity={"CPU": 64 * GIB}, now=NOW, node_started_at=STARTED)
    assert isinstance(outcome, Rebook)
    (booked,) = outcome.ledger.reservations
    assert (booked.state, booked.instance_id, booked.expires_at) == ("running", "i1", None)
    assert booked.held == {"CPU": GIB + device().host_extra_bytes}  # observed plus what grows at run time
    assert (booked.running_since, booked.node_started_at) == (NOW, STARTED)  # the node's clock


def test_a_loading_instance_is_booked_again_as_claimed() -> None:
    outcome = rebook(ledger(), "a", live(state="starting", observed=None), capacity=None, now=NOW, node_started_at=None)
    assert isinstance(outcome, Rebook)
    (booked,) = outcome.ledger.reservations
    assert (booked.state, booked.instance_id, booked.held) == ("starting", "i1", {"CPU": 2 * GIB})


def test_an_instance_whose_memory_went_to_a_running_one_is_stopped_and_booked_until_it_is_gone() -> None:
    newcomer = claimed("r9", "i9", "running", gib=63)  # booked into the memory while the runner was cut off
    book = ledger(newcomer)
    outcome = rebook(book, "a", live(observed=GIB), capacity={"CPU": 64 * GIB}, now=NOW, node_started_at=STARTED)
    assert isinstance(outcome, Stop) and "r1" in outcome.reason and "CPU" in outcome.reason
    assert [r.reservation_id for r in outcome.ledger.reservations] == ["r9", "r1"]  # held until its server is gone


def test_unclaimed_bookings_never_stop_a_running_instance() -> None:
    # A booking nobody started yet: the runner's own memory check refuses it when it is started.
    book = ledger(reservation("r9", held={"CPU": 63 * GIB}))
    outcome = rebook(book, "a", live(observed=GIB), capacity={"CPU": 64 * GIB}, now=NOW, node_started_at=STARTED)
    assert isinstance(outcome, Rebook)


def test_without_a_report_or_for_an_ending_instance_it_is_booked_whatever_it_takes() -> None:
    full = ledger(claimed("r9", "i9", "running", gib=64))
    unknown = rebook(full, "a", live(), capacity=None, now=NOW, node_started_at=None)
    assert isinstance(unknown, Rebook)
    for state in ("stopping", "stuck"):
        ending = rebook(full, "a", live(state=state), capacity={"CPU": 64 * GIB}, now=NOW, node_started_at=None)
        assert isinstance(ending, Rebook), state  # its server still holds the memory and is on its way out
    fits = rebook(ledger(claimed("r9", "i9", "running", gib=62)), "a", live(observed=GIB), capacity={"CPU": 64 * GIB},
                  now=NOW, node_started_at=None)  # fmt: skip
    assert isinstance(fits, Rebook)
    assert msgspec.structs.asdict(fits.booking)["reservation_id"] == "r1"
