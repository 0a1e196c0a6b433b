"""Booking one decision over several ledgers, all or nothing (placement core, pure).

A split instance holds memory on every node of the split: one reservation per node, each in that node's ledger,
all with the reservation id of the decision (`Reservation.split`). NATS has no transaction over several keys,
so the shell writes the ledgers one at a time with compare-and-set, and this module decides the order and what
to take back. The rules:

- The head's part is written first, then each member's in `--rpc` order. So a member's part is never in a
  ledger while its head's part is not: the reconcile releases a member part whose head part is gone
  (`reservations.py`), and a head part whose members are not all booked within the claim grace.
- A write that lost its compare-and-set fails the booking; so does a write whose outcome is unknown (an error
  or a timeout: it may have landed). Every part written, and the uncertain one, is then taken back, members
  first and the head last, each only while it is still unclaimed (`Release` with `seen` reserved): nothing a
  runner has claimed is ever taken back here.
- After a failure nothing more is written. A take-back that itself fails leaves a part for the reconcile: an
  orphaned member part is released at the next pass, an unclaimed head part after its hold.

Theory of operation: the shell asks `next_write()`, writes it, reports `wrote()` or `failed()`; `failed()`
returns the releases to apply (with compare-and-set, each re-checked on the revision it overwrites).
A decision on one node is a booking of one part, with the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from actors.placement.reservations import Release
from messages.placement import Reservation

__all__ = ["Booking", "booking_order"]


def booking_order(reservations: Sequence[Reservation]) -> tuple[Reservation, ...]:
    """The parts in the order they are written: the head's first (a reservation without a split is its own
    head), then the members in `--rpc` order."""

    def rank(reservation: Reservation) -> int:
        split = reservation.split
        if split is None or reservation.node_id == split.head:
            return -1
        return split.members.index(reservation.node_id) if reservation.node_id in split.members else len(split.members)

    return tuple(sorted(reservations, key=rank))


class Booking:
    """The state of one booking: `booking` until every part is written (`booked`), or a write failed (`failed`)."""

    def __init__(self, reservations: Sequence[Reservation]) -> None:
        self._todo = list(booking_order(reservations))
        self._written: list[Reservation] = []
        self.state: Literal["booking", "booked", "failed"] = "booking" if self._todo else "booked"

    @property
    def written(self) -> tuple[Reservation, ...]:
        return tuple(self._written)

    def next_write(self) -> Reservation | None:
        """The part to write next, or None when the booking is over (booked or failed)."""
        return self._todo[0] if self.state == "booking" else None

    def wrote(self, reservation: Reservation) -> None:
        """The compare-and-set of `reservation` succeeded."""
        if self.state != "booking" or not self._todo or self._todo[0] is not reservation:
            raise RuntimeError("wrote() for a part that was not the next write")
        self._written.append(self._todo.pop(0))
        if not self._todo:
            self.state = "booked"

    def failed(self, reservation: Reservation, *, uncertain: bool) -> tuple[Release, ...]:
        """The write of `reservation` lost its compare-and-set (`uncertain` False) or its outcome is unknown
        (True: it may have landed). Returns what to take back, in order: every part written, and the uncertain
        one, members first and the head last."""
        if self.state != "booking" or not self._todo or self._todo[0] is not reservation:
            raise RuntimeError("failed() for a part that was not the next write")
        self.state = "failed"
        landed = [*self._written, reservation] if uncertain else list(self._written)
        self._todo = []
        return tuple(
            Release(part.node_id, part.reservation_id, "rolled_back", seen=("reserved", None))
            for part in reversed(landed)
        )
