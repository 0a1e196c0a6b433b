"""Memory accounting of a node (placement core, pure): what it can offer a new model right now.

Two limits apply to every device and the smaller one wins:
- the *capacity* term: the device's size (capped by the node's `--memory-limit`) minus everything held by
  reservations on it, predicted or observed. It keeps our own instances from ever summing past the cap,
  whatever the live readings say (mapped weights, for instance, do not show up as used host RAM).
- the *live* term: what the node reports usable now, minus what is held by reservations the report cannot
  see yet (admitted but not running, or ready after the report was taken). It respects every other
  consumer of the device.
An instance being stopped keeps its memory until its reservation is released, i.e. until it is gone.
Every reservation in the ledger holds its memory until it is removed from it: expiry is decided by the
placement actor on its own clock (`actors.placement.reservations`), so nothing here compares a time written
by one host with another host's clock. The one comparison of times (`running_since` against the report's
`sent_at`) is between two readings of the same node's clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from messages.placement import NodeLedger, Reservation
from messages.telemetry import NodeResources


def device_sizes(node: NodeResources) -> dict[str, tuple[int, int]]:
    """Device name -> (size capped by the memory limit, usable now)."""
    limit = node.memory_limit_bytes

    def cap(total: int) -> int:
        return total if limit is None else min(total, limit)

    sizes = {"CPU": (cap(node.host.ram_total_bytes), node.host.usable_bytes)}
    for gpu in node.gpus:
        sizes[f"GPU{gpu.index}"] = (cap(gpu.total_bytes), gpu.usable_bytes)
    return sizes


def _sum(reservations: Iterable[Reservation]) -> dict[str, int]:
    held: dict[str, int] = {}
    for reservation in reservations:
        for device, n_bytes in reservation.held.items():
            held[device] = held.get(device, 0) + n_bytes
    return held


def available(node: NodeResources, ledger: NodeLedger | None, now: float | None = None) -> dict[str, int]:
    """Bytes a new reservation may take on each device of `node`.

    `now` is not used (every reservation in the ledger holds memory until it is removed); it is accepted so
    that callers written when expiry was checked here keep working."""
    del now
    reservations = ledger.reservations if ledger is not None else ()
    held_all = _sum(reservations)
    # running_since and sent_at are both the node's own clock: the report sent after the instance became
    # ready already shows its memory as used.
    unseen = _sum(r for r in reservations if r.running_since is None or r.running_since >= node.sent_at)
    return {
        device: max(0, min(size - held_all.get(device, 0), usable - unseen.get(device, 0)))
        for device, (size, usable) in device_sizes(node).items()
    }


def with_reservation(ledger: NodeLedger | None, node_id: str, reservation: Reservation) -> NodeLedger:
    """The ledger with `reservation` added."""
    return NodeLedger(node_id=node_id, reservations=(*(ledger.reservations if ledger else ()), reservation))


def without(ledger: NodeLedger, reservation_id: str) -> NodeLedger:
    return NodeLedger(
        node_id=ledger.node_id,
        reservations=tuple(r for r in ledger.reservations if r.reservation_id != reservation_id),
    )


def replaced(ledger: NodeLedger, reservation: Reservation) -> NodeLedger:
    return NodeLedger(
        node_id=ledger.node_id,
        reservations=tuple(
            reservation if r.reservation_id == reservation.reservation_id else r for r in ledger.reservations
        ),
    )
