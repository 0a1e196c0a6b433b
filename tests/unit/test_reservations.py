"""Reservation lifecycle core: expiry on our own clock, claims held while their instance lives, lost and late
runner events repaired from instance records, and changes that re-check the revision they overwrite."""

from __future__ import annotations

from actors.placement.reservations import Change, Promote, Reconciler, Release, apply, released_by_event
from messages.placement import NodeLedger, Reservation
from messages.runner import InstanceState
from tests.harness.reservations import GIB, STARTED, T0, record, reservation


def ledger(*reservations: Reservation) -> NodeLedger:
    return NodeLedger(node_id="a", reservations=reservations)


def changes(rec: Reconciler, book: NodeLedger, now: float, *, complete: bool = True) -> tuple[Change, ...]:
    return rec.changes("a", book, node_started_at=STARTED, now=now, records_complete=complete)


def test_an_unclaimed_reservation_expires_after_its_hold_on_our_own_clock() -> None:
    rec = Reconciler()
    book = ledger(reservation())
    rec.saw_ledger("a", book, T0)
    assert changes(rec, book, T0 + 59.9) == ()
    (release,) = changes(rec, book, T0 + 60)
    assert isinstance(release, Release) and release.reason == "expired"
    assert apply(release, book) == ledger()


def test_rewriting_the_ledger_does_not_extend_an_unclaimed_hold() -> None:
    rec = Reconciler()
    rec.saw_ledger("a", ledger(reservation()), T0)
    rewritten = ledger(reservation(), reservation("r2"))  # another booking rewrote the node's ledger
    rec.saw_ledger("a", rewritten, T0 + 50)
    (release,) = changes(rec, rewritten, T0 + 60)
    assert isinstance(release, Release) and release.reservation_id == "r1"


def test_expiry_during_a_slow_load_never_releases_a_claimed_reservation() -> None:
    rec = Reconciler()
    claimed = ledger(reservation(state="starting", instance="i1"))
    rec.saw_ledger("a", claimed, T0)
    rec.saw_record("i1", record("i1", "starting"), T0)
    assert changes(rec, claimed, T0 + 3600) == ()  # an hour of loading, far past the 60 s hold: still held


def test_a_crash_restart_backoff_before_the_first_ready_keeps_the_memory() -> None:
    rec = Reconciler()
    claimed = ledger(reservation(state="starting", instance="i1"))
    rec.saw_ledger("a", claimed, T0)
    for state in ("starting", "restarting", "starting", "restarting"):
        rec.saw_record("i1", record("i1", state), T0)
        assert changes(rec, claimed, T0 + 900) == (), state


def test_a_lost_instance_stopped_is_repaired_from_the_final_record() -> None:
    rec = Reconciler()
    running = ledger(reservation(state="running", instance="i1", expires_at=None, running_since=STARTED + 10))
    rec.saw_ledger("a", running, T0)
    rec.saw_record("i1", record("i1", "ready"), T0)
    assert changes(rec, running, T0 + 5) == ()
    finals: tuple[tuple[InstanceState, str], ...] = (
        ("stopped", "stopped"),
        ("failed", "failed"),
        ("rejected", "rejected"),
    )
    for final, reason in finals:
        rec.saw_record("i1", record("i1", final), T0)
        (release,) = changes(rec, running, T0 + 10)
        assert isinstance(release, Release) and release.reason == reason
        assert apply(release, running) == ledger()


def test_a_record_that_expired_releases_the_reservation_once_its_node_reported_the_whole_grace_without_it() -> None:
    rec = Reconciler(claim_grace_s=30)
    running = ledger(reservation(state="running", instance="i1", expires_at=None))
    rec.saw_ledger("a", running, T0)
    rec.saw_record("i1", record("i1", "ready"), T0)
    rec.saw_record("i1", None, T0 + 1)  # the TTL removed it: nobody refreshes it any more
    assert changes(rec, running, T0 + 1) == ()
    assert changes(rec, running, T0 + 30.9) == ()  # a runner back from an outage would have rewritten it by now
    (release,) = changes(rec, running, T0 + 31)
    assert isinstance(release, Release) and release.reason == "instance_gone"


def test_an_outage_never_releases_a_live_servers_reservation() -> None:
    # Issue 30: the runner could not refresh its record for its TTL (JetStream away, a partition), so the record
    # expired, and placement released the reservation of a server that still ran; the runner booked it again
    # seconds later, but in between its memory looked free and could be booked twice. Now the claim is kept:
    # the runner rewrites its record within the grace, and nothing is released, or re-booked.
    rec = Reconciler(claim_grace_s=30)
    running = ledger(reservation(state="running", instance="i1", expires_at=None, node_started_at=STARTED))
    rec.saw_ledger("a", running, T0)
    rec.saw_record("i1", record("i1", "ready"), T0)
    rec.saw_record("i1", None, T0 + 30)
    for now in (T0 + 31, T0 + 45, T0 + 59):
        assert changes(rec, running, now) == (), now
    rec.saw_record("i1", record("i1", "ready"), T0 + 40)  # the runner is back and rewrites it
    assert changes(rec, running, T0 + 1000) == ()  # converged, and the booking was never out of the ledger
    rec.saw_record("i1", None, T0 + 2000)  # and if the runner dies for good later, it is released after the grace
    assert changes(rec, running, T0 + 2001) == ()
    (again,) = changes(rec, running, T0 + 2030)
    assert isinstance(again, Release) and again.reason == "instance_gone"


def test_a_node_that_is_away_keeps_its_claims_and_their_grace_starts_again_when_it_reports() -> None:
    # Its telemetry (TTL 15 s) expires before its records (30 s): when the records vanish, the node is away, and
    # nothing can be booked on it. However long it stays away, its claims stay; back, its runner has the whole
    # grace to rewrite its records.
    rec = Reconciler(claim_grace_s=30)
    running = ledger(reservation(state="running", instance="i1", expires_at=None, node_started_at=STARTED))
    claimed = reservation("r2", state="starting", instance="i2")
    both = ledger(*running.reservations, claimed)
    rec.saw_ledger("a", both, T0)
    rec.saw_record("i1", record("i1", "ready"), T0)
    rec.saw_record("i1", None, T0 + 30)
    for now in (T0 + 31, T0 + 100, T0 + 5000):  # away: not in the view
        assert rec.changes("a", both, node_started_at=None, now=now, records_complete=True) == (), now
    assert changes(rec, both, T0 + 5001) == ()  # it reports again, with the same process start
    assert changes(rec, both, T0 + 5029) == ()  # the grace counts from the last pass that found it away
    released = changes(rec, both, T0 + 5030)  # reported for the whole grace, and no record came back
    assert {(c.reservation_id, c.reason) for c in released if isinstance(c, Release)} == {
        ("r1", "instance_gone"),
        ("r2", "instance_gone"),
    }
    rec.saw_record("i1", record("i1", "ready"), T0 + 5040)
    assert changes(rec, both, T0 + 5041) == tuple(
        c for c in released if isinstance(c, Release) and c.reservation_id == "r2"
    )


def test_a_rebooking_whose_record_never_returns_is_released_after_the_grace() -> None:
    rec = Reconciler(claim_grace_s=30)
    running = ledger(reservation(state="running", instance="i1", expires_at=None, node_started_at=STARTED))
    rec.saw_ledger("a", running, T0)
    rec.saw_record("i1", record("i1", "ready"), T0)
    rec.saw_record("i1", None, T0 + 30)
    rec.saw_ledger("a", ledger(), T0 + 31)
    rec.saw_ledger("a", running, T0 + 40)
    assert changes(rec, running, T0 + 69) == ()
    (release,) = changes(rec, running, T0 + 70)
    assert isinstance(release, Release) and release.reason == "instance_gone"


def test_a_claim_whose_record_never_appears_is_released_after_the_grace_only_once_records_are_read() -> None:
    rec = Reconciler(claim_grace_s=30)
    claimed = ledger(reservation(state="starting", instance="i1"))
    rec.saw_ledger("a", claimed, T0)
    assert changes(rec, claimed, T0 + 29) == ()
    assert changes(rec, claimed, T0 + 31, complete=False) == ()  # the records are not all read yet
    (release,) = changes(rec, claimed, T0 + 31)
    assert isinstance(release, Release) and release.reason == "instance_gone"


def test_a_lost_instance_ready_is_repaired_from_the_ready_record() -> None:
    rec = Reconciler()
    claimed = ledger(reservation(state="starting", instance="i1"))
    rec.saw_ledger("a", claimed, T0)
    rec.saw_record("i1", record("i1", "ready", observed=GIB), T0)
    (promote,) = changes(rec, claimed, T0 + 700)
    assert isinstance(promote, Promote)
    (running,) = (apply(promote, claimed) or ledger()).reservations
    assert running.state == "running" and running.instance_id == "i1" and running.expires_at is None
    assert running.held == {"CPU": GIB + 100}  # observed plus the host extras that grow at run time
    assert running.running_since == STARTED + 500 and running.node_started_at == STARTED  # the node's clock
    assert changes(rec, ledger(running), T0 + 701) == ()  # converged: nothing more to do


def test_a_late_ready_for_a_released_reservation_does_not_revive_it() -> None:
    ready = Promote("a", "r1", "i1", observed_total=GIB, running_since=STARTED + 5, node_started_at=STARTED)
    assert apply(ready, ledger()) is None  # released (expired, stopped): nothing to change, nothing revived
    assert apply(ready, None) is None
    other = ledger(reservation("r2"))
    assert apply(ready, other) is None


def test_a_ready_from_another_instance_than_the_claimant_changes_nothing() -> None:
    claimed = ledger(reservation(state="starting", instance="i1"))
    impostor = Promote("a", "r1", "i2", observed_total=GIB, running_since=STARTED, node_started_at=STARTED)
    assert apply(impostor, claimed) is None
    assert apply(released_by_event("a", "r1", "i2", "stopped"), claimed) is None
    assert apply(released_by_event("a", "r1", "i1", "stopped"), claimed) == ledger()


def test_a_duplicate_ready_writes_nothing() -> None:
    ready = Promote("a", "r1", "i1", observed_total=GIB, running_since=STARTED, node_started_at=STARTED)
    once = apply(ready, ledger(reservation(state="starting", instance="i1")))
    assert once is not None and apply(ready, once) is None


def test_a_sweep_racing_a_claim_leaves_the_claimed_reservation_alone() -> None:
    rec = Reconciler()
    read = ledger(reservation())
    rec.saw_ledger("a", read, T0)
    (release,) = changes(rec, read, T0 + 61)  # decided on the revision where it was still reserved
    claimed_meanwhile = ledger(reservation(state="starting", instance="i1"))
    assert apply(release, claimed_meanwhile) is None  # the runner won: nothing is removed
    became_running = ledger(reservation(state="running", instance="i1", expires_at=None))
    assert apply(release, became_running) is None


def test_a_node_process_restart_releases_what_it_ran() -> None:
    rec = Reconciler()
    running = ledger(reservation(state="running", instance="i1", expires_at=None, node_started_at=STARTED - 900))
    rec.saw_ledger("a", running, T0)
    rec.saw_record("i1", record("i1", "ready"), T0)
    (release,) = changes(rec, running, T0)
    assert isinstance(release, Release) and release.reason == "node_restarted"


def test_a_record_about_another_reservation_proves_nothing() -> None:
    rec = Reconciler(claim_grace_s=30)
    claimed = ledger(reservation(state="starting", instance="i1"))
    rec.saw_ledger("a", claimed, T0)
    rec.saw_record("i1", record("i1", "stopped", rid="someone-else"), T0)
    assert changes(rec, claimed, T0 + 1) == ()  # not released on a record that names another reservation


def test_forgotten_once_gone_from_the_ledger() -> None:
    rec = Reconciler()
    rec.saw_ledger("a", ledger(reservation()), T0)
    rec.saw_ledger("a", ledger(), T0 + 1)
    again = ledger(reservation())  # the same id booked again later is a new sighting
    rec.saw_ledger("a", again, T0 + 100)
    assert changes(rec, again, T0 + 120) == ()
