"""This runner's bookings in its node's ledger (runner core, pure): what a starting runner releases of its
predecessor's, and what becomes of an instance that runs while its reservation is gone.

The ledger should say what runs on the node, in both directions. Placement releases what no longer runs (its
reconcile, from the instance records); this module decides the rest, on the runner's own knowledge of what
it runs:

- **At start**, nothing runs in this incarnation yet: every claimed reservation of the node (`starting` or
  `running`) belongs to an instance of a predecessor, whose servers died with it (their parent-death signal)
  or were reaped when its incarnation ended. Each is released (`instance_gone`) on the state it was read in,
  as placement's reconcile would once the records expired (`reservations.apply` re-checks it on the revision
  it overwrites). Unclaimed (`reserved`) ones stay: a placement may have just booked them, and a start may
  follow.
- **While it runs**, an instance that lives (any state but a final one) and whose reservation is missing
  from the ledger lost its booking while the runner could not refresh its records for their TTL (JetStream
  away, a partition, a stalled loop: placement released it, `instance_gone`). It is booked again as it runs
  (`running` at its observed footprint once ready, else as claimed) when it fits beside what the node's other
  *claimed* instances hold. Otherwise the memory it used was given to an instance that is starting or running
  now, and keeping both would run the node past its capacity: a starting or ready instance is stopped (the one
  whose booking lapsed; the other kept its booking all along), and its memory is booked until its server is
  gone. A stopping or stuck one is booked as it is (its server still holds the memory, and it is ending).
  Unclaimed bookings do not count against it: the runner's own memory check refuses them when they start.

Capacity is the node's device sizes, capped by its memory limit (`ledger.device_sizes`, the capacity term of
placement's accounting); without a report of the node it is not judged (re-booking states what runs, which is
never less safe than leaving it out).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from actors.placement.ledger import with_reservation
from actors.placement.reservations import Release, observed_held
from messages.placement import NodeLedger, Reservation
from messages.runner import InstanceState

#: Instance states whose server is gone: their bookings are placement's to release.
FINAL: frozenset[InstanceState] = frozenset({"stopped", "failed", "rejected"})
#: States a runner can still stop (a stopping or stuck server is already on its way out).
STOPPABLE: frozenset[InstanceState] = frozenset({"starting", "ready", "restarting"})


@dataclass(frozen=True, slots=True)
class Live:
    """An instance this runner drives, as its booking should read."""

    instance_id: str
    reservation: Reservation  # as claimed (state `starting`, this instance's id)
    state: InstanceState
    observed_total: int | None = None  # its observed footprint once ready


@dataclass(frozen=True, slots=True)
class Rebook:
    """Write `ledger` (the lapsed booking added back) with compare-and-set."""

    instance_id: str
    ledger: NodeLedger
    booking: Reservation


@dataclass(frozen=True, slots=True)
class Stop:
    """The instance runs without a booking and no longer fits: stop it (and book it until it is gone)."""

    instance_id: str
    ledger: NodeLedger
    booking: Reservation
    reason: str


def orphaned(ledger: NodeLedger | None, node_id: str) -> tuple[Release, ...]:
    """The releases a starting runner makes: every claimed reservation of its node (none is this incarnation's).
    A member's part of a split is not this node's instance (its head's runner runs it, and placement releases
    the part with the head's): it stays."""
    if ledger is None:
        return ()
    return tuple(
        Release(node_id, r.reservation_id, "instance_gone", seen=(r.state, r.instance_id))
        for r in ledger.reservations
        if r.state != "reserved" and (r.split is None or r.split.head == node_id)
    )


def lapsed(ledger: NodeLedger | None, live: Iterable[Live]) -> list[Live]:
    """The instances that live but whose reservation is not in `ledger`."""
    held = {r.reservation_id for r in ledger.reservations} if ledger is not None else set()
    return [i for i in live if i.state not in FINAL and i.reservation.reservation_id not in held]


def booking_of(instance: Live, *, now: float, node_started_at: float | None) -> Reservation:
    """The reservation as it should read for what runs: `running` at the observed footprint once ready (from
    `now`, the node's clock: reports sent before it do not count its memory), else as claimed."""
    claimed = msgspec.structs.replace(instance.reservation, instance_id=instance.instance_id, expires_at=None)
    if instance.state != "ready":
        return msgspec.structs.replace(claimed, state="starting")
    return msgspec.structs.replace(
        claimed,
        state="running",
        held=observed_held(claimed, instance.observed_total),
        running_since=now,
        node_started_at=node_started_at,
    )


def rebook(
    ledger: NodeLedger | None,
    node_id: str,
    instance: Live,
    *,
    capacity: Mapping[str, int] | None,
    now: float,
    node_started_at: float | None,
) -> Rebook | Stop:
    """What to do about one lapsed instance, given the ledger as read and the node's capacity per device (None:
    no report of the node)."""
    booking = booking_of(instance, now=now, node_started_at=node_started_at)
    new = with_reservation(ledger, node_id, booking)
    if capacity is None or instance.state not in STOPPABLE:
        return Rebook(instance.instance_id, new, booking)
    claimed: dict[str, int] = {}
    for r in ledger.reservations if ledger is not None else ():
        if r.state != "reserved":
            for device, n_bytes in r.held.items():
                claimed[device] = claimed.get(device, 0) + n_bytes
    over = [
        f"{device} {claimed.get(device, 0) + n_bytes} > {capacity.get(device, 0)} bytes"
        for device, n_bytes in booking.held.items()
        if claimed.get(device, 0) + n_bytes > capacity.get(device, 0)
    ]
    if not over:
        return Rebook(instance.instance_id, new, booking)
    reason = (
        f"its reservation {booking.reservation_id} was released while this runner was cut off, and the memory was "
        f"given to instances now running ({', '.join(over)} with it): stopped"
    )
    return Stop(instance.instance_id, new, booking, reason)


__all__ = ["FINAL", "STOPPABLE", "Live", "Rebook", "Stop", "booking_of", "lapsed", "orphaned", "rebook"]
