"""Keeping the node's instance records and bookings true to what this runner runs (runner shell).

The decisions are `actors.runner.ledger_rules`'s; this module reads and writes the buckets.

- `clear_predecessor`, once at the start of each incarnation, before anything can start: deletes every
  `<node>.*` record in `MESH_INSTANCES` (none is this incarnation's: its servers died with its predecessor,
  which may have been killed with -9 or lost its connection before it could say so), so routers stop listing
  them at once instead of when their TTL ends, and releases the predecessor's claimed reservations in the
  node's ledger (`reservation_released`, reason `instance_gone`) instead of when placement's reconcile notices.
  A ledger that does not decode is replaced by an empty one (nothing of this incarnation runs yet).
- `keep_booked`, every few seconds while the runner lives: an instance whose reservation is missing from the
  ledger (released while the runner could not refresh its records) is booked again, or stopped when it no
  longer fits (see `ledger_rules.py` for which and why); and a record of this node that says an instance is live
  when this runner drives no such instance is removed (`drop_phantoms`): records normally go by their TTL,
  but a NATS server killed with -9 brought records purged before its crash back from its store, their TTLs
  no longer running (benchmarks/chaos.py), and they would have listed a dead instance for ever. The ledger is
  read on an idle node too: one that was deleted is written again, and one that does not decode (any node may
  write it) is replaced by what runs, with an error logged, instead of leaving the node out of placement.

Both are best effort against a bus that may be away: a failure is logged and tried again (the next
incarnation, the next pass), never a crash of the runner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import nats.errors
import nats.js.errors

from actors.placement.ledger import device_sizes
from actors.placement.reservations import apply
from actors.runner.ledger_rules import Live, Rebook, lapsed, orphaned, rebook
from actors.runner.preflight import NodeState
from actors.runner.records import FINAL_STATES
from actors.runner.start_checks import StartRefused
from messages.events import ReservationRebooked, ReservationReleased
from messages.placement import NodeLedger
from messages.runner import InstanceStatus
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.actor import ActorContext
from runtime.bus import BadMessage, decode_checked

__all__ = ["MARKER_TTL_S", "check_bookings", "clear_predecessor", "drop_phantoms", "keep_booked"]

#: How long the delete marker of a predecessor's record stays (watchers see it, then it goes).
MARKER_TTL_S = 60.0
_ATTEMPTS = 8


async def clear_predecessor(ctx: ActorContext, node: NodeState, *, deadline_s: float) -> None:
    """Removes what a predecessor of this runner left: its instance records and its claimed reservations."""
    try:
        async with asyncio.timeout(deadline_s):
            removed = await _delete_records(ctx, node.node_id)
            released = await _release_orphans(ctx, node)
    except (nats.errors.Error, TimeoutError, StartRefused) as exc:
        # Placement's reconcile releases them once the records expire; the next incarnation tries again.
        ctx.log.warning("predecessor_not_cleared", error=repr(exc))
        return
    if removed or released:
        ctx.log.info("predecessor_cleared", records=removed, reservations=released)


async def _delete_records(ctx: ActorContext, node_id: str) -> list[str]:
    kv = await buckets.instances(ctx.bus, ctx.subjects)
    prefix = ctx.subjects.instance_key(node_id, "")
    watcher = await kv.watch(f"{prefix}*", ignore_deletes=True, meta_only=True)
    keys: list[str] = []
    try:
        async for entry in watcher:
            if entry is None:  # every current key delivered
                break
            if entry.key.startswith(prefix) and entry.operation not in ("DEL", "PURGE"):  # headers only: no value
                keys.append(entry.key)
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]
    for key in keys:
        await kv.purge(key, msg_ttl=MARKER_TTL_S)  # the record goes; its marker, seen by watchers, goes later
    return keys


async def _release_orphans(ctx: ActorContext, node: NodeState) -> list[str]:
    released: list[str] = []
    for _ in range(_ATTEMPTS):
        read = await node.ledger(ctx, strict=False)
        ledger, revision = read.ledger, read.revision
        if read.unreadable:
            if await node.write_ledger(ctx, NodeLedger(node_id=node.node_id), revision):
                return released
            continue
        changes = orphaned(ledger, node.node_id)
        if not changes:
            return released
        new = ledger
        for change in changes:
            new = apply(change, new) or new
        assert new is not None  # orphaned() found reservations, so there is a ledger
        if await node.write_ledger(ctx, new, revision):
            for change in changes:
                ctx.emit(
                    ReservationReleased,
                    reservation_id=change.reservation_id,
                    node_id_released=node.node_id,
                    reason=change.reason,
                )
                released.append(change.reservation_id)
            return released
    ctx.log.warning("predecessor_reservations_not_released", attempts=_ATTEMPTS)
    return released


async def keep_booked(
    ctx: ActorContext,
    node: NodeState,
    live: Callable[[], Iterable[Live]],
    stop: Callable[[str, str], None],
    clock: Callable[[], float],
    *,
    interval_s: float,
) -> None:
    """Every `interval_s`: books again what runs without a booking, or stops it (`stop(instance, reason)`), and
    removes this node's records of instances it does not drive."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            dropped = await drop_phantoms(ctx, node.node_id, lambda: {i.instance_id for i in live()})
        except (nats.errors.Error, TimeoutError) as exc:  # the bus is away: the next pass tries again
            ctx.log.warning("records_not_checked", error=repr(exc))
        else:
            if dropped:
                ctx.log.warning("phantom_records_removed", records=dropped)
        try:
            await check_bookings(ctx, node, live, stop, clock)
        except (nats.errors.Error, TimeoutError, StartRefused) as exc:  # the bus is away: the next pass tries again
            ctx.log.warning("bookings_not_checked", error=repr(exc))


async def drop_phantoms(ctx: ActorContext, node_id: str, driven: Callable[[], set[str]]) -> list[str]:
    """Removes the records of this node in a live state (not stopped, failed or rejected) whose instance this
    runner does not drive; returns their keys. A final record is kept (it says how an instance ended, for its
    TTL). `driven` is asked after each record is read: a driver writes its record only once it exists."""
    kv = await buckets.instances(ctx.bus, ctx.subjects)
    root = f"$KV.{ctx.subjects.instances_bucket}."
    prefix = ctx.subjects.instance_key(node_id, "")
    info = await ctx.bus.js.stream_info(f"KV_{ctx.subjects.instances_bucket}", subjects_filter=f"{root}{prefix}*")
    phantoms: list[str] = []
    for key in sorted(subject.removeprefix(root) for subject in info.state.subjects or {}):
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:  # deleted, purged or expired meanwhile
            continue
        if not entry.value:
            continue
        try:
            status = decode_checked(entry.value, InstanceStatus, f"instance record {key}")
        except BadMessage:  # not a record this runner can judge: left for an operator (and its TTL)
            continue
        if status.state not in FINAL_STATES and status.id not in driven():
            phantoms.append(key)
    for key in phantoms:
        await kv.purge(key, msg_ttl=MARKER_TTL_S)
    return phantoms


async def check_bookings(
    ctx: ActorContext,
    node: NodeState,
    live: Callable[[], Iterable[Live]],
    stop: Callable[[str, str], None],
    clock: Callable[[], float],
) -> None:
    """One pass (see `keep_booked`). The ledger is read before the instances are asked, so an instance that
    ended and was released meanwhile is seen ended; each booking is written with compare-and-set on the
    revision read (on a conflict, judged again on what the other writer wrote)."""
    telemetry: NodeResources | None = None
    for _ in range(_ATTEMPTS):
        read = await node.ledger(ctx, strict=False)
        missing = lapsed(read.ledger, live())
        if not missing:
            if read.unreadable and not await node.write_ledger(ctx, NodeLedger(node_id=node.node_id), read.revision):
                continue  # what runs is booked: an empty ledger replaces the unreadable one
            return
        if telemetry is None:
            telemetry = await node.telemetry(ctx)
        capacity = {d: size for d, (size, _) in device_sizes(telemetry).items()} if telemetry else None
        instance = missing[0]
        outcome = rebook(
            read.ledger,
            node.node_id,
            instance,
            capacity=capacity,
            now=clock(),
            node_started_at=telemetry.started_at if telemetry else None,
        )
        if not await node.write_ledger(ctx, outcome.ledger, read.revision):
            continue
        booking = outcome.booking
        log = ctx.log.bind(instance_id=instance.instance_id, reservation_id=booking.reservation_id)
        if isinstance(outcome, Rebook):
            log.warning("reservation_rebooked", state=booking.state)
            ctx.emit(
                ReservationRebooked, instance_id=instance.instance_id, reservation_id=booking.reservation_id,
                state=booking.state, held=dict(booking.held), outcome="rebooked",
                reason="the ledger did not decode: replaced by what runs" if read.unreadable else "",
            )  # fmt: skip
            continue
        log.error("instance_unbooked_stopping", reason=outcome.reason)
        ctx.emit(
            ReservationRebooked, instance_id=instance.instance_id, reservation_id=booking.reservation_id,
            state=booking.state, held=dict(booking.held), outcome="stopping", reason=outcome.reason,
        )  # fmt: skip
        stop(instance.instance_id, outcome.reason)
