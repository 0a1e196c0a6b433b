"""Reservation lifecycle (placement core, pure): what should happen to each reservation, and whether a
change decided on one ledger revision still applies to another.

Everything that changes a reservation after it is booked is decided here; the shell (`actor.py`) only reads
buckets, feeds what it saw, and writes the ledgers this module returns, with compare-and-set. The rules:

- States: `reserved` (booked, no instance), `starting` (the node's runner claimed it for one instance with
  compare-and-set: `reserved` -> `starting`, `instance_id` set), `running` (that instance is ready).
- Only `reserved` reservations expire: `hold_s` after *this* placement actor first saw them, measured on its
  own monotonic clock. No time written by another host is ever compared with ours.
- A claimed reservation is held while its instance lives, as the instance's record in the instances bucket
  says (the runner rewrites it every few seconds with a TTL, so a dead runner's records disappear): a final
  record (`stopped`, `failed`, `rejected`) or one that disappeared releases it; a `ready` record promotes a
  `starting` entry that missed its `instance_ready`; a claim whose record never appears within
  `claim_grace_s` of our first seeing the claim is released too. Restarts, slow loads and backoffs before the
  first ready keep the record live, so they keep the memory.
- A claim whose record is missing (it disappeared, or never appeared) is released only once its node has
  been reporting for `claim_grace_s` since: counted from when the record disappeared (or the claim was first
  seen), restarted by every pass that finds the node away (not in the view). A record disappears when its
  runner could not refresh it for its TTL: a runner that is gone, or one cut off (JetStream away, a
  partition, a stalled loop) whose servers still run. Nothing can be booked on a node that is away, and a
  runner back from an outage rewrites its records well within the grace (every third of their TTL), so the
  memory of a live server is kept across the outage instead of being released and re-booked (issue 30: in
  between, it looked free and could be booked twice). A runner that stays away keeps its claims until its
  node reports again: one that restarted releases them itself at start (`booking.orphaned`), and placement
  on `node_restarted`.
- A record that disappears releases only the claims seen before it disappeared: a runner whose reservation
  was released all the same (its node reported for the whole grace without it) re-books it while its server
  still runs (see `actors/runner/ledger_rules.py`), and that booking gets `claim_grace_s` for the record to
  return, as a new claim does. So the ledger converges to what runs in both directions: what stopped running
  is released, what runs is booked again.
- Runner events (`instance_ready`, `instance_stopped`, ...) are the fast path to the same outcomes; an event
  about another instance than the one that claimed the reservation changes nothing.
- A split instance holds one reservation per node, all with one id (`Reservation.split`). The head's part
  follows the rules above (the head's runner claims it). A member's part follows its head's part: it is held
  while the head's part is in the head's ledger, becomes `running` (with the head's instance) once the head's
  part is, on the member's own clock (the sent time of the member's latest report: a later report sees the
  memory), and is released once the head's part is gone (`head_released`); it never expires on its own and
  is not released for its node's restart (the head's runner restarts the instance on the member's new RPC
  server). A head part still unclaimed whose members are not all booked `claim_grace_s` after it was first seen
  belongs to a booking that failed half-way: it is released (`split_incomplete`). The booking writes the head's
  part first (`booking.py`), so the members' parts are never seen without it while it is being booked.
- Every change names the state it was decided on, and `apply` re-checks it against the ledger revision it
  is about to overwrite: a sweep never removes a reservation a runner just claimed or that became running,
  and a late `instance_ready` never revives a released reservation (it is no longer there to change).

Theory of operation: the shell calls `Reconciler.saw_ledger` / `saw_record` as its watches deliver, then
every few seconds `changes(...)` per node; each change is applied with `apply` to the latest revision and
written with compare-and-set (on a conflict: re-read, `apply` again). Every pass is idempotent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec

from actors.placement.ledger import replaced, without
from messages.placement import NodeLedger, Reservation, ReservationState
from messages.runner import InstanceStatus

#: The hold of a reservation written before `hold_s` was recorded, when it cannot be derived.
DEFAULT_HOLD_S = 600.0

ReleaseReason = Literal[
    "stopped",  # the instance stopped (event or final record)
    "failed",  # the instance failed for good
    "rejected",  # drift: the instance was refused or stopped for settings that differ from its stamp
    "refused",  # worker-side admission refused to start it
    "expired",  # reserved, never claimed within its hold
    "node_restarted",  # the node process that ran it has restarted (its runner took its servers down)
    "instance_gone",  # the instance's record disappeared or never appeared: its runner is gone
    "rolled_back",  # the booking that made it failed half-way
    "head_released",  # a member's part of a split whose head's part is gone
    "split_incomplete",  # a split's head part whose members were not all booked (the booking failed half-way)
    "undelivered",  # its decision could not be sent (too large, or the request's deadline passed first)
]

_FINAL: dict[str, ReleaseReason] = {"stopped": "stopped", "failed": "failed", "rejected": "rejected"}


@dataclass(frozen=True, slots=True)
class Release:
    """Remove one reservation from its node's ledger.

    `seen` is the (state, instance) it was decided on: it applies only while the reservation is still
    exactly that. None means it comes from a runner event about `instance_id`: it applies unless another
    instance claimed the reservation."""

    node: str
    reservation_id: str
    reason: ReleaseReason
    seen: tuple[ReservationState, str | None] | None
    instance_id: str | None = None


@dataclass(frozen=True, slots=True)
class Promote:
    """The instance is ready: the reservation becomes `running`, held at the observed footprint when the
    layout allows (see `observed_held`). `running_since` is on the node's own clock."""

    node: str
    reservation_id: str
    instance_id: str
    observed_total: int | None
    running_since: float
    node_started_at: float | None


Change = Release | Promote


def apply(change: Change, ledger: NodeLedger | None) -> NodeLedger | None:
    """The ledger with `change` made, or None when it no longer applies to this revision (nothing to write)."""
    if ledger is None:
        return None
    current = next((r for r in ledger.reservations if r.reservation_id == change.reservation_id), None)
    if current is None:
        return None  # released meanwhile: nothing to do, and nothing is revived
    if isinstance(change, Release):
        if change.seen is not None:
            if (current.state, current.instance_id) != change.seen:
                return None  # claimed, promoted or re-claimed since the decision: not what was judged
        elif current.instance_id is not None and current.instance_id != change.instance_id:
            return None  # an event about another instance than the one holding the reservation
        return without(ledger, change.reservation_id)
    if current.state == "running" or current.instance_id not in (None, change.instance_id):
        return None  # already running (a duplicate), or claimed by another instance
    running = msgspec.structs.replace(
        current,
        state="running",
        instance_id=change.instance_id,
        held=observed_held(current, change.observed_total),
        expires_at=None,
        running_since=change.running_since,
        node_started_at=change.node_started_at,
    )
    return replaced(ledger, running)


def observed_held(reservation: Reservation, observed_total: int | None) -> dict[str, int]:
    """Held memory once running: the observed footprint plus the host extras (prompt cache, checkpoints)
    that grow at run time and are not in the startup figures. Multi-device layouts keep the prediction, and so
    does every part of a split (the head's observation counts its members' buffers too)."""
    if reservation.split is not None or len(reservation.devices) != 1 or not observed_total or observed_total <= 0:
        return dict(reservation.held)
    device = reservation.devices[0]
    return {device.device: observed_total + device.host_extra_bytes}


def hold_of(reservation: Reservation) -> float:
    """How long an unclaimed reservation is held. For old ledgers: its expiry minus its creation, both
    written by the same (booking) actor, so the difference is a duration and no clocks are compared."""
    if reservation.hold_s is not None:
        return reservation.hold_s
    if reservation.expires_at is not None:
        return max(0.0, reservation.expires_at - reservation.created_at)
    return DEFAULT_HOLD_S


def released_by_event(node: str, reservation_id: str, instance_id: str, reason: ReleaseReason) -> Release:
    """A runner event (stopped, failed, drift, refused) about `instance_id`."""
    return Release(node=node, reservation_id=reservation_id, reason=reason, seen=None, instance_id=instance_id)


class Reconciler:
    """What one placement actor remembers between passes, all on its own monotonic clock: when it first saw
    each reservation and each claim, the instance records it has, and the instances whose record vanished.

    Memory is bounded by what the buckets hold (entries are forgotten once gone from the ledger), plus at
    most `max_gone` vanished instance ids and one time per node with a ledger."""

    def __init__(self, *, claim_grace_s: float = 30.0, max_gone: int = 10_000) -> None:
        self.claim_grace_s = claim_grace_s
        self._max_gone = max_gone
        # (node, reservation id) -> (state, instance id, when we first saw it in that state)
        self._seen: dict[tuple[str, str], tuple[ReservationState, str | None, float]] = {}
        self._records: dict[str, InstanceStatus] = {}
        self._gone: OrderedDict[str, float] = OrderedDict()  # instance id -> when its record disappeared
        self._away: dict[str, float] = {}  # node -> the last pass that found it away (not in the view)

    # --- what the watches deliver ---------------------------------------------------------------------

    def saw_ledger(self, node: str, ledger: NodeLedger | None, now: float) -> None:
        """A node's ledger as the watch delivered it (None: deleted)."""
        present = {r.reservation_id for r in ledger.reservations} if ledger else set()
        for r in ledger.reservations if ledger else ():
            self._saw(node, r, now)
        for key in [k for k in self._seen if k[0] == node and k[1] not in present]:
            del self._seen[key]
        if ledger is None:
            self._away.pop(node, None)

    def saw_record(self, instance_id: str, record: InstanceStatus | None, now: float) -> None:
        """An instance record as the watch delivered it at `now`; None: deleted or expired (its runner is gone,
        or could not refresh it)."""
        if record is not None:
            self._records[instance_id] = record
            self._gone.pop(instance_id, None)
            return
        if self._records.pop(instance_id, None) is not None:
            self._gone[instance_id] = now
            while len(self._gone) > self._max_gone:
                self._gone.popitem(last=False)

    def record(self, instance_id: str) -> InstanceStatus | None:
        return self._records.get(instance_id)

    # --- the periodic pass ----------------------------------------------------------------------------

    def changes(
        self,
        node: str,
        ledger: NodeLedger,
        *,
        node_started_at: float | None,
        now: float,
        records_complete: bool,
        ledgers: Mapping[str, NodeLedger | None] | None = None,
        node_sent_at: float | None = None,
    ) -> tuple[Change, ...]:
        """What should change in `ledger` now. `node_started_at` is the start time in the node's latest
        report (None when the node is not in the view); `records_complete` says the instance records have
        all been read once (until then, a missing record proves nothing). `ledgers`: every node's ledger as
        watched, which a split's parts are judged on (None for a deleted ledger; a node left out is not known,
        and a member part whose head is not known is left alone; None: nothing known); `node_sent_at`:
        when the node's latest report was sent, on its own clock."""
        if node_started_at is None:
            self._away[node] = now  # its claims' grace starts again once it reports
        out: list[Change] = []
        for r in ledger.reservations:
            if r.split is not None:
                change = self._split_change(node, r, now, ledgers, node_sent_at)
                if change is not None or node != r.split.head:
                    if change is not None:
                        out.append(change)
                    continue
            change = self._change(node, r, node_started_at, now, records_complete)
            if change is not None:
                out.append(change)
        return tuple(out)

    def _change(
        self, node: str, r: Reservation, node_started_at: float | None, now: float, records_complete: bool
    ) -> Change | None:
        seen = (r.state, r.instance_id)
        rid = r.reservation_id
        first = self._saw(node, r, now)
        # Both start times come from the node's own reports: no clocks of two hosts are compared.
        if r.node_started_at is not None and node_started_at is not None and r.node_started_at != node_started_at:
            return Release(node, rid, "node_restarted", seen)
        if r.state == "reserved" or r.instance_id is None:
            # Unclaimed (or claimed without naming its instance, which the runner never does): its hold runs.
            if r.state != "running" and now - first >= hold_of(r):
                return Release(node, rid, "expired", seen)
            return None
        record = self._records.get(r.instance_id)
        if record is not None and (record.node != node or record.reservation_id != rid):
            record = None  # a record that is not about this reservation proves nothing about it
        if record is None:
            if node_started_at is None:
                return None  # the node is away: nothing is booked there meanwhile, and its runner may be alive
            gone_at = self._gone.get(r.instance_id)
            # A claim first seen after the record vanished is a re-booking by a runner that came back: it waits
            # for the record like a new claim.
            vanished = gone_at is not None and first <= gone_at
            since = max(gone_at if vanished and gone_at is not None else first, self._away.get(node, first))
            missing = (vanished or records_complete) and now - since >= self.claim_grace_s
            return Release(node, rid, "instance_gone", seen) if missing else None
        if record.state in _FINAL:
            return Release(node, rid, _FINAL[record.state], seen)
        if record.state == "ready" and r.state == "starting":
            observed = record.observed_memory.total_bytes if record.observed_memory else None
            return Promote(node, rid, r.instance_id, observed, record.updated_at, node_started_at)
        return None  # starting, restarting, stopping or ready: the instance lives, its memory stays held

    def _split_change(
        self,
        node: str,
        r: Reservation,
        now: float,
        ledgers: Mapping[str, NodeLedger | None] | None,
        node_sent_at: float | None,
    ) -> Change | None:
        """A split's part judged against the other parts (None: nothing to do, or, for the head's part, judge it
        as any reservation)."""
        split = r.split
        assert split is not None
        seen = (r.state, r.instance_id)
        first = self._saw(node, r, now)
        if ledgers is None:
            return None
        if node != split.head:
            if split.head not in ledgers:
                return None  # the head's ledger is not known (unreadable, or not delivered yet): nothing is judged
            head = _part(ledgers, split.head, r.reservation_id)
            if head is None:
                return Release(node, r.reservation_id, "head_released", seen)
            if head.state == "running" and r.state != "running" and head.instance_id and node_sent_at is not None:
                # reports the member sends after this one see the memory its RPC server holds
                return Promote(node, r.reservation_id, head.instance_id, None, node_sent_at, None)
            return None
        incomplete = any(_part(ledgers, member, r.reservation_id) is None for member in split.members)
        if r.state == "reserved" and incomplete and now - first >= self.claim_grace_s:
            return Release(node, r.reservation_id, "split_incomplete", seen)
        return None

    def _saw(self, node: str, r: Reservation, now: float) -> float:
        """Records a sighting; returns when this reservation was first seen in its current state (a
        reserved entry keeps its first sighting across rewrites of the ledger; a claim starts its own)."""
        key = (node, r.reservation_id)
        known = self._seen.get(key)
        if known is not None and known[:2] == (r.state, r.instance_id):
            return known[2]
        first = known[2] if known is not None and known[0] == r.state == "reserved" else now
        self._seen[key] = (r.state, r.instance_id, first)
        return first


def _part(ledgers: Mapping[str, NodeLedger | None], node: str, reservation_id: str) -> Reservation | None:
    """The part of a split that `node`'s ledger holds, or None."""
    ledger = ledgers.get(node)
    if ledger is None:
        return None
    return next((r for r in ledger.reservations if r.reservation_id == reservation_id), None)
