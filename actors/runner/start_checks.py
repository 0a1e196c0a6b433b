"""Worker-side admission: what the runner decides before it starts an instance (runner core).

Placement admitted a reservation with what it knew then; the runner decides again with what its node has now,
and claims the reservation so that nobody else starts it. Everything here is a pure function of the values
the shell read (the node's ledger, its telemetry, its serving settings, the model's prediction); the shell
(`actors/runner/preflight.py`) reads them, performs the claim this module builds and journals the refusals.

Rules this module keeps:

* A refusal is a `StartRefused` with a stable `code`. One that makes the reservation unusable on this node has
  `releases=True`: the shell journals it (`instance_refused`), so placement releases the memory at once.
* Clocks of different hosts are never compared. `expires_at` is written with placement's clock, so the runner
  does not look at it: expiring reservations is placement's job. For the same reason every reservation in
  the ledger counts as holding its memory in the runner's own memory check (the conservative side).
* The claim turns one reservation `reserved` -> `starting` with the instance id set. The shell writes it with
  compare-and-set on the revision the memory check read, so the check and the claim see the same ledger;
  a reservation that is not `reserved` any more is refused (`reservation_state`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from actors.placement.ledger import available, replaced, without
from messages.errors import (
    ENGINE_UNAVAILABLE,
    INSUFFICIENT_MEMORY,
    NOT_FOUND,
    RESERVATION_STATE,
    SETTINGS_DRIFT,
    TELEMETRY_STALE,
    TOO_MANY_INSTANCES,
    UNSUPPORTED,
)
from messages.memory import MemoryBreakdown
from messages.placement import NodeLedger, Reservation
from messages.runner import FieldDrift
from messages.telemetry import NodeResources

__all__ = [
    "StartRefused",
    "check_memory",
    "check_reservation",
    "claim",
    "describe_drift",
    "find",
]

#: Every reservation counts as live: the runner never compares placement's `expires_at` with its own clock.
_EVERY_RESERVATION_HOLDS = float("-inf")


class StartRefused(Exception):
    """The start is refused. `releases`: the reservation cannot be used on this node (journal it, so placement
    releases its memory); otherwise it is someone else's or a passing condition, and is left alone."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        releases: bool,
        details: Mapping[str, Any] | None = None,
        need_bytes: Mapping[str, int] | None = None,
        have_bytes: Mapping[str, int] | None = None,
        drift: Sequence[FieldDrift] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.releases = releases
        self.details = dict(details or {})
        self.need_bytes = dict(need_bytes or {})
        self.have_bytes = dict(have_bytes or {})
        self.drift = tuple(drift)


def find(ledger: NodeLedger | None, reservation_id: str, node_id: str) -> Reservation:
    for reservation in ledger.reservations if ledger is not None else ():
        if reservation.reservation_id == reservation_id:
            return reservation
    raise StartRefused(NOT_FOUND, f"no reservation {reservation_id!r} on node {node_id}", releases=False)


def check_reservation(
    reservation: Reservation,
    *,
    node_id: str,
    has_engine: bool,
    running: int,
    max_instances: int,
    drift: Sequence[FieldDrift],
    can_head_split: bool = False,
) -> None:
    """The checks that need no file and no memory reading, in the order a person would want to hear them.
    `can_head_split`: this node has the cluster certificates that reach a split's members."""
    rid = reservation.reservation_id
    if reservation.multi_node:
        split = reservation.split
        if split is None or split.head != node_id or not reservation.stamp.rpc:
            head = split.head if split is not None else "its head"
            message = f"reservation {rid} is this node's part of a split headed by {head}: the head starts it"
            raise StartRefused(UNSUPPORTED, message, releases=False)
        if not can_head_split:
            message = f"node {node_id} has no cluster certificates (--cluster-secret-file): it cannot head a split"
            raise StartRefused(UNSUPPORTED, message, releases=True)
    if reservation.state != "reserved":
        raise StartRefused(RESERVATION_STATE, f"reservation {rid} is {reservation.state}, not reserved", releases=False)
    if not has_engine:
        raise StartRefused(ENGINE_UNAVAILABLE, f"node {node_id} has no llama-server to run", releases=True)
    if running >= max_instances:
        raise StartRefused(TOO_MANY_INSTANCES, f"node {node_id} runs {running} instances", releases=False)
    if drift:
        raise StartRefused(
            SETTINGS_DRIFT,
            "the node's settings changed since admission: " + describe_drift(drift),
            releases=True,
            details={"drift": msgspec.to_builtins(tuple(drift))},
            drift=drift,
        )


def check_memory(
    reservation: Reservation, predicted: MemoryBreakdown, node: NodeResources | None, ledger: NodeLedger | None
) -> None:
    """The model, re-sized now, must fit what the node reports minus what the other reservations hold."""
    need = {device.device: device.total_bytes for device in predicted.devices}
    if node is None:
        message = f"node {reservation.node_id} has no current telemetry; cannot check its memory"
        raise StartRefused(TELEMETRY_STALE, message, releases=True, need_bytes=need)
    others = without(ledger, reservation.reservation_id) if ledger is not None else None
    have = available(node, others, _EVERY_RESERVATION_HOLDS)
    short = {d: n for d, n in need.items() if n > have.get(d, 0)}
    if short:
        message = "the model no longer fits: " + ", ".join(
            f"{d} needs {n} bytes, has {have.get(d, 0)}" for d, n in short.items()
        )
        raise StartRefused(
            INSUFFICIENT_MEMORY,
            message,
            releases=True,
            details={"need_bytes": need, "have_bytes": have},
            need_bytes=need,
            have_bytes={d: have.get(d, 0) for d in need},
        )


def claim(ledger: NodeLedger | None, reservation_id: str, node_id: str, instance_id: str) -> NodeLedger:
    """The ledger with the reservation claimed for `instance_id` (`reserved` -> `starting`)."""
    reservation = find(ledger, reservation_id, node_id)
    if reservation.state != "reserved":
        message = f"reservation {reservation_id} is {reservation.state}, not reserved"
        raise StartRefused(RESERVATION_STATE, message, releases=False)
    assert ledger is not None  # find found it there
    claimed = msgspec.structs.replace(reservation, state="starting", instance_id=instance_id)
    return replaced(ledger, claimed)


def describe_drift(drift: Sequence[FieldDrift]) -> str:
    return "; ".join(f"{d.field}: stamped {d.stamped}, now {d.current}" for d in drift)
