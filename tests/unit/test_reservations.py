"""Reservation lifecycle core: expiry on our own clock, claims held while their instance lives, lost and late
runner events repaired from instance records, and changes that re-check the revision they overwrite."""

from __future__ import annotations

import msgspec

from actors.placement.reservations import Promote, Reconciler, Release, apply, released_by_event
from messages.memory import ContextShape, DeviceMemory, MemoryBreakdown
from messages.placement import NodeLedger, Reservation, ReservationState, Stamp
from messages.runner import InstanceState, InstanceStatus, ObservedMemory
from messages.settings import ServingSettings

GIB = 1 << 30
T0 = 5_000.0  # our monotonic clock when the reservation was first seen
STARTED = 1_700_000_000.0  # the node process's start time, on the node's clock


def device() -> DeviceMemory:
    sizes = dict.fromkeys(("weights_bytes", "kv_bytes", "recurrent_bytes", "draft_kv_bytes", "compute_bytes"), 0)
    return DeviceMemory(device="CPU", **sizes, output_bytes=0, host_extra_bytes=100, total_bytes=2 * GIB)


def _zeros(struct: type, **given: object) -> dict[str, object]:
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.name: 0 for f in info.fields if f.required} | given


PREDICTED = msgspec.convert(
    _zeros(
        MemoryBreakdown,
        estimator_version="test",
        llama_cpp_version="test",
        architecture="llama",
        context=_zeros(ContextShape),
        devices=[],
        compute_error_ratio=0.0,
    ),
    MemoryBreakdown,
)


def reservation(
    rid: str = "r1", state: ReservationState = "reserved", instance: str | None = None, **fields: object
) -> Reservation:
    base = Reservation(
        reservation_id=rid,
        decision_id="d",
        node_id="a",
        state=state,
        model_path="m.gguf",
        stamp=Stamp(settings=ServingSettings(), ctx=4096, n_gpu_layers=0),
        layers=(0, 8),
        devices=(device(),),
        held={"CPU": 2 * GIB},
        created_at=1_000_000.0,  # the booking actor's wall clock: never compared with anything here
        expires_at=1_000_060.0,
        hold_s=60.0,
        instance_id=instance,
    )
    return msgspec.structs.replace(base, **fields)


def ledger(*reservations: Reservation) -> NodeLedger:
    return NodeLedger(node_id="a", reservations=reservations)


def record(instance: str, state: InstanceState, *, rid: str = "r1", observed: int | None = None) -> InstanceStatus:
    memory = None
    if observed is not None:
        memory = ObservedMemory(
            kv_bytes=0, recurrent_bytes=0, draft_kv_bytes=0, weights_bytes=0, compute_bytes=0, output_bytes=0,
            total_bytes=observed,
        )  # fmt: skip
    return InstanceStatus(
        id=instance,
        node="a",
        reservation_id=rid,
        state=state,
        port=None,
        model_path="m.gguf",
        settings=Stamp(settings=ServingSettings(), ctx=4096, n_gpu_layers=0),
        predicted_memory=PREDICTED,
        observed_memory=memory,
        updated_at=STARTED + 500,  # the node's clock
    )


def changes(rec: Reconciler, book: NodeLedger, now: float, *, complete: bool = True) -> tuple[object, ...]:
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
    for final, reason in (("stopped", "stopped"), ("failed", "failed"), ("rejected", "rejected")):
        rec.saw_record("i1", record("i1", final), T0)
        (release,) = changes(rec, running, T0 + 10)
        assert isinstance(release, Release) and release.reason == reason
        assert apply(release, running) == ledger()


def test_a_record_that_expired_releases_the_reservation_of_its_dead_runner() -> None:
    rec = Reconciler()
    running = ledger(reservation(state="running", instance="i1", expires_at=None))
    rec.saw_ledger("a", running, T0)
    rec.saw_record("i1", record("i1", "ready"), T0)
    rec.saw_record("i1", None, T0 + 1)  # the TTL removed it: nobody refreshes it any more
    (release,) = changes(rec, running, T0 + 1)
    assert isinstance(release, Release) and release.reason == "instance_gone"


def test_a_runner_back_from_an_outage_rebooks_and_its_booking_waits_for_the_record() -> None:
    # The runner could not refresh its records for their TTL (JetStream away, a partition): placement released
    # the reservation of a server that still runs. The runner books it again; that booking is not released
    # for the record that vanished before it, and stays once the record returns.
    rec = Reconciler(claim_grace_s=30)
    running = ledger(reservation(state="running", instance="i1", expires_at=None, node_started_at=STARTED))
    rec.saw_ledger("a", running, T0)
    rec.saw_record("i1", record("i1", "ready"), T0)
    rec.saw_record("i1", None, T0 + 30)
    (release,) = changes(rec, running, T0 + 31)
    assert isinstance(release, Release) and release.reason == "instance_gone"
    rec.saw_ledger("a", ledger(), T0 + 31)  # released
    rec.saw_ledger("a", running, T0 + 40)  # the runner is back and books it again, before its record returns
    assert changes(rec, running, T0 + 41) == ()
    rec.saw_record("i1", record("i1", "ready"), T0 + 42)
    assert changes(rec, running, T0 + 100) == ()  # converged: the record and the booking of what runs
    rec.saw_record("i1", None, T0 + 200)  # and if the runner dies for good later, it is released again
    (again,) = changes(rec, running, T0 + 201)
    assert isinstance(again, Release) and again.reason == "instance_gone"


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
