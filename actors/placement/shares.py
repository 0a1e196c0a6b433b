"""What one client may hold booked on a node: its share (placement core, pure).

Issue 17: nineteen `placement.request`s of one client, each holding a day, booked every byte of a node, and
requests of others were refused. A hold is bounded by the node's `--max-hold`; what one client holds at once
is bounded here. Rules this module keeps:

* A client is a user of the clients' NATS account. Its requests arrive on their own subject, and nats-server
  names the user on each (`runtime.roles.requesting_client`), so no client can speak for another or for the
  mesh. The mesh's own requests (the front door on a node, an admin) carry no requester and are not bounded
  here.
* What every client together holds is bounded the same way (`EVERY_CLIENT`, the clients' share): client users
  are issued freely, so a share per user alone bounds nothing.
* Every reservation booked for a client names it (`Reservation.requester`). On each node, what the client
  holds (the `held` of its reservations in the node's ledger, whatever their state: reserved, starting or
  running) plus what a new booking adds stays within `share` of each device's size, the size the capacity
  term of `ledger.available` uses (capped by the node's `--memory-limit`).
* A node where the client already holds its share of some device is not considered at all (`exhausted`); a
  booking on another node is checked before it is written (`breach`), and the node it would overfill is not
  considered again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

import msgspec

from actors.placement.ledger import device_sizes
from messages.placement import DeviceShortfall, NodeLedger, NodeRejection, Reservation
from messages.telemetry import NodeResources

__all__ = ["EVERY_CLIENT", "booked_for", "breach", "exhausted", "held_by", "limits"]


#: The requester that stands for every client together: what the clients' account may hold of a node, however
#: many client users it has (two users, each within its own share, once held every byte of a node). No user is
#: named so: a user name is a subject token.
EVERY_CLIENT: Final = "*"


def held_by(ledger: NodeLedger | None, requester: str) -> dict[str, int]:
    """Device -> bytes the reservations of `requester` (`EVERY_CLIENT`: of any client) hold on the ledger's node."""
    held: dict[str, int] = {}
    for reservation in ledger.reservations if ledger is not None else ():
        if reservation.requester == requester or (requester == EVERY_CLIENT and reservation.requester is not None):
            for device, n_bytes in reservation.held.items():
                held[device] = held.get(device, 0) + n_bytes
    return held


def limits(node: NodeResources, share: float) -> dict[str, int]:
    """Device -> the most one client may hold there: `share` of its size (capped by the memory limit)."""
    if not 0 < share <= 1:
        raise ValueError("a share is in (0, 1]")
    return {device: int(size * share) for device, (size, _) in device_sizes(node).items()}


def _rejection(node_id: str, requester: str, share: float, over: list[DeviceShortfall]) -> NodeRejection:
    worst = over[0]
    who, whose = ("the clients together", "their") if requester == EVERY_CLIENT else (f"client {requester}", "its")
    message = (
        f"{who} would hold {worst.need_bytes} bytes of {node_id}'s {worst.device}; {whose} share is "
        f"{share:g} of the device, {worst.have_bytes} bytes (stop an instance or let a reservation go first)"
    )
    return NodeRejection(node_id=node_id, reason="over_client_share", message=message, shortfalls=tuple(over))


def breach(
    node: NodeResources, ledger: NodeLedger | None, requester: str, share: float, adding: Mapping[str, int]
) -> NodeRejection | None:
    """Why booking `adding` (device -> bytes) for `requester` on `node` would take it past its share; None when
    it stays within. A shortfall's `need_bytes` is what the client would hold, `have_bytes` its share."""
    bound, held = limits(node, share), held_by(ledger, requester)
    over = [
        DeviceShortfall(device=device, need_bytes=held.get(device, 0) + n_bytes, have_bytes=bound.get(device, 0))
        for device, n_bytes in sorted(adding.items())
        if n_bytes > 0 and held.get(device, 0) + n_bytes > bound.get(device, 0)
    ]
    return _rejection(node.node_id, requester, share, over) if over else None


def exhausted(
    nodes: Iterable[NodeResources], ledgers: Mapping[str, NodeLedger | None], requester: str, share: float
) -> dict[str, NodeRejection]:
    """The nodes where `requester` already holds all its share of some device: nothing more fits there."""
    found: dict[str, NodeRejection] = {}
    for node in nodes:
        bound, held = limits(node, share), held_by(ledgers.get(node.node_id), requester)
        over = [
            DeviceShortfall(device=device, need_bytes=n_bytes, have_bytes=bound.get(device, 0))
            for device, n_bytes in sorted(held.items())
            if n_bytes > 0 and n_bytes >= bound.get(device, 0)
        ]
        if over:
            found[node.node_id] = _rejection(node.node_id, requester, share, over)
    return found


def booked_for(reservations: Iterable[Reservation], requester: str | None) -> tuple[Reservation, ...]:
    """The reservations of a decision as written: each names the client it holds memory for."""
    return tuple(msgspec.structs.replace(r, requester=requester) for r in reservations)
