"""Placement actor (shell): answers `mesh.placement.request` and `mesh.placement.fit`, keeps reservations.

- The cluster view comes only from events: a watch on the nodes KV bucket (telemetry with per-key TTL; an
  expired key arrives as an empty delete marker and removes the node). A report that repeats the node's last
  but for its sequence number and time is taken in as a heartbeat (`intake.py`: not decoded whole, the index not
  told); any other is decoded in full. Each report's arrival is noted on
  this actor's monotonic clock: staleness is the time since it arrived, never a comparison with the time
  the node wrote into it.
- Ledgers (memory held per node) live in the reservations KV bucket, key `node.<id>`. A decision reads the
  ledgers of the nodes it considers from a watched local copy, decides with the pure core, and writes the
  chosen node's ledger with compare-and-set on the revision it read (a split's: every node's, in the order
  `booking.py` gives, all or none). If another placement actor wrote first, it re-reads the bucket and
  decides again, so two actors never book the same memory; a refusal decided from the local copy is
  re-checked against the bucket before it is answered.
- Everything that happens to a reservation afterwards is decided by `reservations.py` (pure) and written
  with compare-and-set: runner events through a durable JetStream consumer shared by every placement actor
  are the fast path, and a periodic reconcile compares the ledgers with the instance records of the
  instances bucket, so memory is released (or a missed ready applied) even when events are lost or late.
- Model files named by clients are hostile input: `model_reader.py` reads them in worker threads (no FIFO
  can block, no path can escape the models dir) and verifies registry entries.
- Every `placement.request` decision is a `placement_decided` journal event with its inputs (replayable);
  large inputs go to a side record (`decision_records.py`). `placement.fit` answers the same question,
  reserves nothing and is not journaled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.object_store import ObjectStore

from actors.files.transfer import Holder, TransferRefusal, choose_source
from actors.placement import decision_records, shares
from actors.placement.admission import ModelFacts, Outcome, ViewEntry, natural_key, rejected
from actors.placement.booking import Booking, booking_order
from actors.placement.fleet import NO_LEDGER, FleetIndex, IndexStats, Inputs, LedgerEntry, decide, snapshot
from actors.placement.intake import Known, heartbeat_of, remember
from actors.placement.ledger import with_reservation
from actors.placement.model_reader import ModelProblem, ModelReader
from actors.placement.reservations import (
    Change,
    Promote,
    Reconciler,
    Release,
    ReleaseReason,
    apply,
    released_by_event,
)
from messages.errors import INTERNAL
from messages.events import (
    DecisionInputs,
    DriftRejected,
    InstanceFailed,
    InstanceReady,
    InstanceRefused,
    InstanceStopped,
    PlacementDecided,
    ReservationObserved,
    ReservationReleased,
    event_type,
)
from messages.files import FileFacts, HeldRequest
from messages.placement import (
    LEDGER_KEY_PREFIX,
    LISTED_REFUSALS,
    NodeLedger,
    NodeRejection,
    PlacementDecision,
    PlacementRequest,
    Reservation,
)
from messages.runner import InstanceStatus
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.actor import Actor, ActorContext, RequestError, request_headers
from runtime.bus import BadMessage, BusError, PayloadTooLarge, decode_checked, encode
from runtime.logging import get_logger
from runtime.model_files import FileDigests
from runtime.roles import PLACEMENT_CONSUMER, placement_consumer, requesting_client

QUEUE_GROUP = "placement"
RUNNER_EVENTS_CONSUMER = PLACEMENT_CONSUMER  # each node's own: `placement-reservations-<node>`
#: A node gone this long has its consumer removed by the server (the other nodes' placements applied its events).
_CONSUMER_IDLE_S = 3600.0
_RELEASING: dict[str, ReleaseReason] = {
    "instance_stopped": "stopped",
    "instance_failed": "failed",
    "drift_rejected": "rejected",
    "instance_refused": "refused",
}
#: A decision event larger than this stores its inputs in a side record (the journal's own limit is larger).
INLINE_EVENT_BYTES = 32 * 1024
#: What the bounded summary of a large decision keeps inline.
SUMMARY_NODES = 64
SUMMARY_REJECTIONS = 8
#: Refusals that depend on a ledger, re-checked against the bucket when decided from the local copy.
_LEDGER_REASONS = frozenset({"insufficient_memory", "ledger_unreadable"})
_CHANGE_DEADLINE_S = 10.0
#: A model file this node lacks: how many live nodes are asked for its facts, and how long each may take (a
#: holder hashes a file version once, then answers from its cache).
_MAX_FACT_PEERS = 64
_PEER_FACTS_S = 10.0
#: Booking requests one placement actor answers at a time (per endpoint): their writes overlap.
BOOKING_WORKERS = 8
#: The longest unclaimed hold a request may ask for, unless the node says otherwise (`--max-hold`).
MAX_HOLD_S = 3600.0
#: Whom a request on the clients' subject is counted for when nats-server named no client (an admin's).
UNNAMED_CLIENT = "clients"


#: The runner events that change a reservation.
RunnerOutcome = InstanceReady | InstanceStopped | InstanceFailed | DriftRejected | InstanceRefused


class _EventType(msgspec.Struct):
    type: str


_EVENT_TYPE = msgspec.json.Decoder(_EventType)
_RUNNER_OUTCOME = msgspec.json.Decoder(RunnerOutcome)


@dataclass(frozen=True, slots=True)
class _Decided:
    outcome: Outcome
    ledgers: Mapping[str, LedgerEntry]  # what the decision read for the nodes it booked or refused for memory
    inputs: Inputs | None  # as journaled (None for a dry run decided from the index)


@dataclass(frozen=True, slots=True)
class PlacementStats:
    view_nodes: int
    ledgers: int
    reports_seen: int  # telemetry reports applied to the view since the actor started
    heartbeats: int  # of those, the ones that repeated the node's last (`intake`: not decoded whole, not indexed)
    index: IndexStats


def ledger_key(node_id: str) -> str:
    return f"{LEDGER_KEY_PREFIX}{node_id}"


class PlacementActor(Actor):
    name = "placement"
    description = "admission and reservations"

    def __init__(
        self,
        *,
        trusted_registry_keys: tuple[str, ...] = (),
        models_dir: Path | None = None,
        digests: FileDigests | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        max_attempts: int = 8,
        sweep_interval_s: float = 2.0,
        claim_grace_s: float = 30.0,
        inline_event_bytes: int = INLINE_EVENT_BYTES,
        max_hold_s: float = MAX_HOLD_S,
        model_roots: tuple[Path, ...] | None = None,
        client_share: float | None = None,
        clients_share: float | None = None,
    ) -> None:
        """`models_dir`: where relative model paths live (as for the runner); without one they are refused.
        `sweep_interval_s`: how often reservations are reconciled. `claim_grace_s`: how long a claimed
        reservation is held before its instance's record first appears. `max_hold_s`: the longest unclaimed
        hold a request may ask for (longer: refused with `hold_too_long`). `model_roots`: the directories model
        files may be in besides `models_dir` (None: an absolute path may be anywhere; `mesh-actor run` always
        gives the node's directories, so no client can read a file outside them). `client_share`: the share of
        each node's devices one client may hold booked at once (`shares.py`; None: clients are not bounded,
        `mesh-actor run` always gives one). `clients_share`: what every client together may hold of each node's
        devices (None: as much as one client)."""
        for share in (client_share, clients_share):
            if share is not None and not 0 < share <= 1:
                raise ValueError("a client share is in (0, 1]")
        self._max_hold_s = max_hold_s
        self._client_share = client_share
        self._clients_share = clients_share
        self._clock = clock
        self._monotonic = monotonic
        self._max_attempts = max_attempts
        self._sweep_interval = sweep_interval_s
        self._claim_grace = claim_grace_s
        self._inline_event_bytes = inline_event_bytes
        self._view: dict[str, ViewEntry] = {}
        self._arrived: dict[str, float] = {}  # node -> when its report arrived (our monotonic clock)
        self._known: dict[str, Known] = {}  # node -> its last report decoded in full (`intake`: its heartbeats)
        self._view_ready = asyncio.Event()
        self._ledger_cache: dict[str, tuple[NodeLedger | None, int]] = {}
        # Bookings whose compare-and-set is in flight, per node, and the node's ledger with them (at the revision
        # they are written over): what decisions see (`_seen`), so concurrent requests spread instead of racing
        # for one node. A booking is written over the ledger itself, never over another one in flight.
        self._in_flight: dict[str, list[Reservation]] = {}
        self._overlay: dict[str, LedgerEntry] = {}
        self._seen: Mapping[str, LedgerEntry] = ChainMap(self._overlay, self._ledger_cache)
        self._ledgers_ready = asyncio.Event()
        self._ledger_seq = 0  # the newest revision of the reservations bucket the local copy holds
        self._ledger_moved = asyncio.Event()  # set (and replaced) each time the local copy takes a revision
        self._records_ready = asyncio.Event()
        self._reconciler = Reconciler(claim_grace_s=claim_grace_s)
        self._index = FleetIndex(tracked=True)  # told of every change below: judges only what changed
        self._reports_seen = 0
        self._heartbeats = 0
        self.models = ModelReader(
            trusted_registry_keys=trusted_registry_keys, models_dir=models_dir, digests=digests, roots=model_roots
        )
        self._log = get_logger(actor=self.name)

    # --- wiring ---------------------------------------------------------------------------------------

    async def run(self, ctx: ActorContext) -> None:
        subjects = ctx.subjects
        self._nodes = await buckets.nodes(ctx.bus, subjects)
        self._ledgers = await buckets.reservations(ctx.bus, subjects)
        self._registry = await buckets.registry(ctx.bus, subjects)
        self._instances = await buckets.instances(ctx.bus, subjects)
        self._records: ObjectStore = await decision_records.open_store(ctx.bus, subjects)
        self._view, self._arrived, self._known = {}, {}, {}
        self._view_ready = asyncio.Event()
        self._ledger_cache = {}
        self._in_flight, self._overlay = {}, {}
        self._seen = ChainMap(self._overlay, self._ledger_cache)
        self._ledgers_ready = asyncio.Event()
        self._ledger_seq = 0
        self._ledger_moved = asyncio.Event()
        self._records_ready = asyncio.Event()
        self._reconciler = Reconciler(claim_grace_s=self._claim_grace)
        self._index = FleetIndex(tracked=True)  # told of every change below: judges only what changed
        ctx.spawn(self._watch_nodes(ctx), "watch-nodes")
        ctx.spawn(self._watch_ledgers(), "watch-ledgers")
        ctx.spawn(self._watch_instances(ctx), "watch-instances")
        async with asyncio.timeout(10):
            await self._view_ready.wait()
            await self._ledgers_ready.wait()
        ctx.spawn(self._follow_runner_events(ctx), "runner-events")
        ctx.spawn(self._reconcile_forever(ctx), "reconcile")
        # Bookings overlap their writes (ledger, journal): each decides on the loop, seeing those in flight.
        await ctx.add_endpoint(
            "request", subjects.placement_request, PlacementRequest, lambda r: self.place(ctx, r, dry_run=False),
            queue_group=QUEUE_GROUP, workers=BOOKING_WORKERS,
        )  # fmt: skip
        await ctx.add_endpoint(
            "fit", subjects.placement_fit, PlacementRequest, lambda r: self.place(ctx, r, dry_run=True),
            queue_group=QUEUE_GROUP,
        )  # fmt: skip

        async def from_client(request: PlacementRequest) -> PlacementDecision:
            # Only the clients' account reaches this subject, and nats-server names the user who asked (it
            # writes the header itself); a request without one came from an admin posing as a client.
            requester = requesting_client(request_headers()) or UNNAMED_CLIENT
            return await self.place(ctx, request, dry_run=False, requester=requester)

        await ctx.add_endpoint(
            "client-request", subjects.client_placement_request, PlacementRequest, from_client,
            queue_group=QUEUE_GROUP, workers=BOOKING_WORKERS,
        )  # fmt: skip

    async def _watch_nodes(self, ctx: ActorContext) -> None:
        # each report is taken in as the client delivers it (`buckets.follow`: no KV watcher entry, queues or task
        # per message, about a tenth of the actor's busy time at 3,000 reports a second)
        await buckets.follow(self._nodes, self._view_ready, lambda change: self._take_report(ctx, change))

    def _take_report(self, ctx: ActorContext, change: buckets.Change) -> None:
        key, payload = change.key, change.value
        if change.removed:
            self._forget_node(key)  # expired (delete marker) or removed
            return
        # The same report again, only newer (most are): its first fields decoded, the rest compared, and the
        # index not told (`intake`, `FleetIndex.refreshed`).
        node = heartbeat_of(self._known.get(key), key, payload)
        if node is not None:
            self._view[key] = view_entry = ViewEntry(resources=node, revision=change.revision)
            self._arrived[key] = self._monotonic()
            self._index.refreshed(key, view_entry)
            self._heartbeats += 1
            self._saw_report(node)
            return
        try:
            node = buckets.decode_value(key, payload, NodeResources, lambda n: n.node_id, "telemetry of node")
        except BadMessage as exc:
            ctx.log.warning("bad_telemetry", key=key, error=str(exc))
            self._forget_node(key)  # what it said before is no longer what it says
            return
        self._view[key] = ViewEntry(resources=node, revision=change.revision)
        self._arrived[key] = self._monotonic()
        self._known[key] = remember(node, payload)
        self._index.touch(key)
        self._saw_report(node)

    def _saw_report(self, node: NodeResources) -> None:
        """Called for every report applied to the view (a benchmark measures the view's lag here)."""
        del node
        self._reports_seen += 1

    def _forget_node(self, node: str) -> None:
        self._view.pop(node, None)
        self._arrived.pop(node, None)
        self._known.pop(node, None)
        self._index.touch(node)

    async def _watch_ledgers(self) -> None:
        """A local copy of every node's ledger: decisions read it first (compare-and-set still guards every
        write, and a conflict or a refusal re-reads the bucket), so a decision costs no round trip per node."""
        async for entry in buckets.watch(self._ledgers, self._ledgers_ready):
            node = entry.key.removeprefix(LEDGER_KEY_PREFIX)
            revision = entry.revision or 0
            self._ledger_seq = max(self._ledger_seq, revision)
            if self._ledger_cache.get(node, NO_LEDGER)[1] < revision:  # not one of ours applied already (`_wrote`)
                decoded = self._decode_ledger(node, entry.value, revision)
                self._set_ledger(node, decoded)
                self._reconciler.saw_ledger(node, decoded[0], self._monotonic())
            moved, self._ledger_moved = self._ledger_moved, asyncio.Event()
            moved.set()

    async def _catch_up(self) -> bool:
        """Waits until the local copy of the ledgers holds every write the bucket held when asked (one stream
        info, then the watch): a decision from the copy is then as new as a read of every ledger, without
        reading any. False when the bucket cannot be asked or the watch did not get there in time."""
        try:
            async with asyncio.timeout(_CHANGE_DEADLINE_S):
                status = await self._ledgers.status()
                last = status.stream_info.state.last_seq
                while self._ledger_seq < last:
                    await self._ledger_moved.wait()
        except (nats.errors.Error, TimeoutError) as exc:
            self._log.warning("ledgers_not_caught_up", error=repr(exc))
            return False
        return True

    async def _watch_instances(self, ctx: ActorContext) -> None:
        """The runners' instance records: what the reconcile compares the ledgers with."""
        async for entry in buckets.watch(self._instances, self._records_ready):
            instance_id = entry.key.rsplit(".", 1)[-1]  # keys are <node>.<instance id>
            if buckets.removed(entry):
                self._reconciler.saw_record(instance_id, None, self._monotonic())  # expired: not refreshed
                continue
            try:
                record = buckets.decode_keyed(
                    entry, InstanceStatus, lambda r: ctx.subjects.instance_key(r.node, r.id), "instance record"
                )
            except BadMessage as exc:
                ctx.log.warning("bad_instance_record", key=entry.key, error=str(exc))
                continue
            self._reconciler.saw_record(instance_id, record, self._monotonic())

    def _decode_ledger(self, node: str, value: bytes | None, revision: int) -> tuple[NodeLedger | None, int]:
        """A ledger and its revision; revision -1 marks one that does not decode (nothing is booked there)."""
        if not value:
            return None, revision
        try:
            return decode_checked(value, NodeLedger, f"ledger of node {node}"), revision
        except BadMessage as exc:
            self._log.error("ledger_unreadable", node=node, error=str(exc))
            return None, -1

    async def _peer_facts(self, ctx: ActorContext, path: str) -> ModelFacts | None:
        """A model file this node lacks, as the live nodes that hold it read it (`mesh.files.<node>.facts`, each
        asked under `_PEER_FACTS_S`): the version most of them hold (`files.transfer.choose_source`), with
        its header facts and digest; the node that runs it fetches it at that digest. None: nobody answered."""
        nodes = sorted(set(self._view) - {ctx.node_id})[:_MAX_FACT_PEERS]

        async def ask(node: str) -> FileFacts | None:
            try:
                return await ctx.bus.request(
                    ctx.subjects.files(node, "facts"), HeldRequest(path=path), FileFacts, timeout=_PEER_FACTS_S
                )
            except (BusError, nats.errors.Error):
                return None

        found = [f for f in await asyncio.gather(*(ask(node) for node in nodes)) if f is not None]
        source = choose_source([Holder(node=f.node_id, size=f.size, digest=f.blake3) for f in found])
        if isinstance(source, TransferRefusal):
            return None
        held = next(f for f in found if f.blake3 == source.digest)
        ctx.log.info("model_facts_from_peers", path=path, blake3=source.digest, holders=list(source.peers))
        return ModelFacts(geometry=held.geometry, path=path, digest=source.digest)

    # --- decisions ------------------------------------------------------------------------------------

    async def place(
        self, ctx: ActorContext, request: PlacementRequest, *, dry_run: bool, requester: str | None = None
    ) -> PlacementDecision:
        """Decides (and books, unless a dry run) `request`; `requester`: the client it is for (held to the client
        share), None for the mesh's own requests."""
        decision_id = uuid.uuid4().hex
        now = self._clock()
        if request.hold_s > self._max_hold_s:
            # A policy of this node, checked before anything is read (not journaled: no node was considered, and
            # replay, which does not know the node's limit, would decide it differently).
            message = f"hold_s {request.hold_s:g} is over this placement node's maximum of {self._max_hold_s:g}s"
            ctx.log.info("placement_hold_refused", hold_s=request.hold_s, max_hold_s=self._max_hold_s)
            return rejected(
                request,
                "hold_too_long",
                message,
                decision_id=decision_id,
                now=now,
                dry_run=dry_run,
                view=self._named(request),
            )
        try:
            facts = await self.models.facts(
                request.model, self._registry, peers=lambda path: self._peer_facts(ctx, path)
            )
        except ModelProblem as exc:
            decision = rejected(
                request,
                exc.reason,
                str(exc),
                decision_id=decision_id,
                now=now,
                dry_run=dry_run,
                view=self._named(request),
            )
            if not dry_run:  # no node was considered: none is recorded (the view would be megabytes at scale)
                await self._journal(ctx, request, {}, {}, None, decision)
            return decision

        reservation_id = uuid.uuid4().hex[:16]
        # A client's booking stays within its share of every node, and within the clients' share together
        # (`shares.py`): nodes where either is held are not considered, and a node a booking would overfill is
        # dropped and the decision taken again. What is decided (and journaled, so replay decides alike) is the
        # request with the nodes left.
        bounds = self._client_bounds(requester) if not dry_run else []
        over_share: dict[str, NodeRejection] = {}
        ledgers = {name: ledger for name, (ledger, _) in self._ledger_cache.items()}
        for who, share in bounds:
            found = shares.exhausted((e.resources for e in self._view.values()), ledgers, who, share)
            over_share = {**found, **over_share}
        asked = request
        booking: tuple[Reservation, ...] = ()
        # The local copy first; after a lost compare-and-set or a refusal, the bucket itself (`fresh`).
        fresh: dict[str, LedgerEntry] = {}
        from_bucket = False
        decided: _Decided | None = None
        for _ in range(self._max_attempts):
            now = self._clock()
            seen, overlaid = self._ledger_seq, bool(self._overlay)
            if over_share:
                left = [n for n in (request.nodes or sorted(self._view, key=natural_key)) if n not in over_share]
                if not left:
                    ctx.log.info("placement_over_client_share", requester=requester, nodes=len(over_share))
                    return self._over_share(request, requester, over_share, decision_id, now)
                asked = msgspec.structs.replace(request, nodes=tuple(left))
            decided = await self._decide(asked, facts, fresh, now, decision_id, reservation_id, dry_run)
            outcome = decided.outcome
            if outcome.reservations:
                booking = outcome.reservations
                if bounds:
                    over = {
                        r.node_id: rejection
                        for r in outcome.reservations
                        for who, share in bounds
                        if (rejection := self._breach(r, decided.ledgers, who, share)) is not None
                    }
                    if over:
                        over_share.update(over)
                        continue
                    booking = shares.booked_for(outcome.reservations, requester)
                if await self._commit(ctx, booking, decided.ledgers):
                    break
                # Another placement booked first, so the local copy lagged the bucket: decided again once the
                # copy holds what the bucket held (no ledger read), or from the bucket itself.
                from_bucket = True
                if not await self._catch_up():
                    names = [name for name in (request.nodes or self._view) if name in self._view]
                    fresh = await self._read_ledgers(names)
                continue
            if outcome.decision.admitted or from_bucket:
                break
            # A refusal from the local copy may be a copy that lags the bucket: decided again if the copy, caught
            # up, took a revision since; else the ledgers it relied on are read from the bucket.
            from_bucket = True
            if await self._catch_up():
                if self._ledger_seq == seen and not overlaid:  # (a booking in flight then may have failed since)
                    break
                continue
            suspects = [r.node_id for r in outcome.decision.rejections if r.reason in _LEDGER_REASONS]
            read = await self._read_ledgers(suspects)
            if all(read[name][1] == decided.ledgers.get(name, NO_LEDGER)[1] for name in read):
                break
            fresh.update(read)
        else:
            conflict = rejected(
                request,
                "reservation_conflict",
                f"other placements kept taking the memory first ({self._max_attempts} attempts)",
                decision_id=decision_id,
                now=now,
                dry_run=dry_run,
                view=self._named(request),
            )
            if not dry_run and decided is not None and decided.inputs is not None:
                inputs = decided.inputs
                await self._journal(ctx, asked, inputs.view, inputs.held, facts, conflict, inputs.unreadable)
            return conflict
        assert decided is not None  # max_attempts >= 1
        booked = booking if not dry_run else ()
        try:
            if not dry_run and decided.inputs is not None:
                inputs = decided.inputs
                await self._journal(ctx, asked, inputs.view, inputs.held, facts, outcome.decision, inputs.unreadable)
                ctx.log.info(
                    "placement_decided",
                    decision=decision_id,
                    admitted=outcome.decision.admitted,
                    reason=outcome.decision.reason,
                    message=outcome.decision.message,
                )
            if over_share:  # said to the client, not journaled: the share is this node's policy, as the hold is
                rejections = (*sorted(over_share.values(), key=lambda r: natural_key(r.node_id)),)
                listed = (*rejections, *outcome.decision.rejections)
                answer = msgspec.structs.replace(
                    outcome.decision, rejections=listed if request.explain else listed[:LISTED_REFUSALS]
                )
                outcome = dataclasses.replace(outcome, decision=answer)
            # Checked here, where the booking can still be taken back: the shell would only fail to send it.
            ctx.bus.check_size(ctx.subjects.placement_request, encode(outcome.decision))
        except PayloadTooLarge as exc:
            self._undo_later(ctx, booked, decision_id)
            raise RequestError(INTERNAL, f"the decision cannot be sent ({exc}); nothing stays booked") from exc
        except BaseException:
            # Cancelled at the request deadline (or failed) after booking: the requester never learns of the
            # reservation, so nobody would start it; released now rather than when its hold ends.
            self._undo_later(ctx, booked, decision_id)
            raise
        return outcome.decision

    def _named(self, request: PlacementRequest) -> Mapping[str, ViewEntry]:
        """The view a refusal before any node was considered names: every node's revision when the request asks
        for them (`explain`), else none (a brief answer names only what it chose)."""
        return self._view if request.explain else {}

    def _client_bounds(self, requester: str | None) -> list[tuple[str, float]]:
        """The shares a client's booking is held to (the client's own, then every client's together); none for
        the mesh's own requests, or when clients are not bounded."""
        if requester is None or self._client_share is None:
            return []
        return [(requester, self._client_share), (shares.EVERY_CLIENT, self._clients_share or self._client_share)]

    def _breach(
        self, reservation: Reservation, ledgers: Mapping[str, LedgerEntry], requester: str, share: float
    ) -> NodeRejection | None:
        """Whether booking `reservation` takes `requester` past its share of the node, judged on the ledger the
        booking's compare-and-set writes over (a concurrent booking of the same client is seen on retry)."""
        entry = self._view.get(reservation.node_id)
        if entry is None:
            return None
        ledger, _ = ledgers.get(reservation.node_id, NO_LEDGER)
        return shares.breach(entry.resources, ledger, requester, share, reservation.held)

    def _over_share(
        self,
        request: PlacementRequest,
        requester: str | None,
        over: Mapping[str, NodeRejection],
        decision_id: str,
        now: float,
    ) -> PlacementDecision:
        """A refusal because the client holds its share of every node it could use (not journaled: the share
        is this node's policy, which replay does not know)."""
        message = (
            f"client {requester} holds its share ({self._client_share:g} of each device), or the clients together "
            f"hold theirs ({self._clients_share or self._client_share:g}), of every node it could use: stop an "
            f"instance or let a reservation go first"
        )
        refused = rejected(
            request,
            "over_client_share",
            message,
            decision_id=decision_id,
            now=now,
            dry_run=False,
            view=self._named(request),
        )
        listed = tuple(sorted(over.values(), key=lambda r: natural_key(r.node_id)))
        return msgspec.structs.replace(refused, rejections=listed if request.explain else listed[:LISTED_REFUSALS])

    def _undo_later(self, ctx: ActorContext, booked: tuple[Reservation, ...], decision_id: str) -> None:
        """Releases `booked` in a task of its own (the caller may be cancelled: it must not wait)."""
        if not booked:
            return
        try:
            ctx.spawn(self._undo(ctx, booked), f"undo:{decision_id}")
        except RuntimeError:  # the incarnation is ending: the reservations expire after their hold instead
            ctx.log.warning("undelivered_release_skipped", decision=decision_id)

    async def _undo(self, ctx: ActorContext, booked: tuple[Reservation, ...]) -> None:
        """Releases the reservations of a decision that was not delivered (only while still unclaimed): a split's
        members first, its head last, so no member's part is ever left without its head's."""
        for done in reversed(booking_order(booked)):
            release = Release(done.node_id, done.reservation_id, "undelivered", seen=("reserved", None))
            try:
                await self._make(ctx, release)
            except (nats.errors.Error, TimeoutError) as exc:  # left to expire after its hold
                ctx.log.error("undelivered_release_failed", node=done.node_id, reservation=done.reservation_id,
                              error=repr(exc))  # fmt: skip

    async def _decide(
        self,
        request: PlacementRequest,
        facts: ModelFacts,
        fresh: Mapping[str, LedgerEntry],
        now: float,
        decision_id: str,
        reservation_id: str,
        dry_run: bool,
    ) -> _Decided:
        """One decision over the current view and ledgers (`fresh` first), with the ledgers it relied on and,
        unless a dry run, its inputs as the journal records them."""
        monotonic_now = self._monotonic()
        if self._index.covers(request):
            # A comparison per node against shared sizings (about a microsecond each): on the event loop,
            # which keeps the view and the ledgers still while it runs.
            decision = self._index.decision(
                request, facts, self._view, self._arrived, self._seen, now=now, monotonic_now=monotonic_now,
                decision_id=decision_id, reservation_id=reservation_id, dry_run=dry_run, fresh=fresh,
            )  # fmt: skip
            outcome = decision.outcome
            inputs = None
            if not dry_run:  # journaled: the nodes replay needs to decide it again (`witnesses`), or every node
                inputs = snapshot(
                    request, self._view, self._arrived, self._seen, fresh, monotonic_now, decision.witnesses
                )
            relied = [r.node_id for r in outcome.reservations]
            relied += [r.node_id for r in outcome.decision.rejections if r.reason in _LEDGER_REASONS]
            # written over the ledger as stored (not over a booking in flight), at the revision the decision saw
            ledgers = {name: fresh.get(name) or self._ledger_cache.get(name, NO_LEDGER) for name in relied}
            return _Decided(outcome, ledgers, inputs)
        inputs = snapshot(request, self._view, self._arrived, self._seen, fresh, monotonic_now)
        # A booking is written over the ledger as stored, at the revision the decision saw (not over one in flight).
        stored = {name: fresh.get(name) or self._ledger_cache.get(name, NO_LEDGER) for name in inputs.ledgers}
        # Each node sized at its own ceiling, CPU work that grows with the view: off the event loop, on a copy.
        outcome = await asyncio.to_thread(
            decide,
            request,
            facts,
            inputs.view,
            inputs.held,
            now=now,
            decision_id=decision_id,
            reservation_id=reservation_id,
            dry_run=dry_run,
            unreadable=inputs.unreadable,
        )
        return _Decided(outcome, stored, inputs)

    def stats(self) -> PlacementStats:
        """The size of what this actor keeps (bounded by the view and the index's limits)."""
        return PlacementStats(
            view_nodes=len(self._view), ledgers=len(self._ledger_cache), reports_seen=self._reports_seen,
            heartbeats=self._heartbeats, index=self._index.stats(),
        )  # fmt: skip

    async def _journal(
        self,
        ctx: ActorContext,
        request: PlacementRequest,
        view: Mapping[str, ViewEntry],
        ledgers: Mapping[str, NodeLedger],
        facts: ModelFacts | None,
        decision: PlacementDecision,
        unreadable: frozenset[str] | None = None,
    ) -> None:
        """Records the decision: inline when small, else its inputs in a side record and a bounded event."""
        inputs = DecisionInputs(
            request=request,
            view=tuple(entry.resources for entry in view.values()),
            view_revisions={name: entry.revision for name, entry in view.items()},
            view_ages={name: entry.age_s for name, entry in view.items() if entry.age_s is not None},
            ledgers=tuple(ledgers.values()),
            geometry=facts.geometry if facts else None,
            model_path=facts.path if facts else request.model.path,
            unreadable_ledgers=tuple(sorted(unreadable or ())),
            decision=decision,
            draft_geometry=facts.draft if facts else None,
            projector_geometry=facts.projector if facts else None,
        )
        data, ref = decision_records.encode_record(inputs)
        if ref.size_bytes <= self._inline_event_bytes:
            ctx.emit(PlacementDecided, **{f: getattr(inputs, f) for f in DecisionInputs.__struct_fields__})
            return
        try:
            async with asyncio.timeout(_CHANGE_DEADLINE_S):
                await decision_records.store(self._records, data, ref)
        except (nats.errors.Error, TimeoutError) as exc:
            # The event still names the record, so replay says which decision lost its inputs.
            ctx.log.error("decision_record_not_stored", decision=decision.decision_id, error=repr(exc))
        ctx.emit(
            PlacementDecided,
            request=msgspec.structs.replace(request, nodes=request.nodes[:SUMMARY_NODES]),
            model_path=inputs.model_path,
            unreadable_ledgers=inputs.unreadable_ledgers[:SUMMARY_NODES],
            decision=msgspec.structs.replace(decision, rejections=decision.rejections[:SUMMARY_REJECTIONS], view={}),
            record=ref,
        )

    async def _read_ledgers(self, names: Iterable[str]) -> dict[str, tuple[NodeLedger | None, int]]:
        """Each node's ledger and the revision to compare-and-set against (0: the key does not exist).

        A ledger that does not decode is reported with revision -1: nothing may be booked on that node (we
        cannot know what it holds), and it is never overwritten here, so an operator can inspect it."""
        out: dict[str, tuple[NodeLedger | None, int]] = {}
        limit = asyncio.Semaphore(32)

        async def read(name: str) -> None:
            async with limit:
                try:
                    entry = await self._ledgers.get(ledger_key(name))
                except nats.js.errors.KeyNotFoundError:
                    out[name] = (None, 0)
                    return
                out[name] = self._decode_ledger(name, entry.value, entry.revision or 0)

        async with asyncio.TaskGroup() as tg:
            for name in dict.fromkeys(names):
                tg.create_task(read(name))
        return out

    async def _write_ledger(self, node: str, ledger: NodeLedger, revision: int) -> int | None:
        """Compare-and-set; the new revision, or None when someone else wrote first. What is written is the
        local copy's at once (`_wrote`)."""
        try:
            if revision == 0:
                written = int(await self._ledgers.create(ledger_key(node), encode(ledger)))
            else:
                written = int(await self._ledgers.update(ledger_key(node), encode(ledger), last=revision))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None
        self._wrote(node, ledger, written)
        return written

    def _set_ledger(self, node: str, entry: LedgerEntry) -> None:
        self._ledger_cache[node] = entry
        self._overlaid(node)

    def _overlaid(self, node: str) -> None:
        """The ledger decisions see for `node`: the local copy's, with the bookings in flight there."""
        booking = self._in_flight.get(node)
        if booking:
            ledger, revision = self._ledger_cache.get(node, NO_LEDGER)
            for reservation in booking:
                ledger = with_reservation(ledger, node, reservation)
            self._overlay[node] = (ledger, revision)
        else:
            self._overlay.pop(node, None)
        self._index.touch(node)

    def _wrote(self, node: str, ledger: NodeLedger, revision: int) -> None:
        """A ledger this actor wrote, in the local copy before the watch brings it back: the decisions taken
        meanwhile see the booking (else every concurrent request would pick the same node and lose its
        compare-and-set). The watch then skips that revision and any older one of the node's."""
        if self._ledger_cache.get(node, NO_LEDGER)[1] < revision:
            self._set_ledger(node, (ledger, revision))
            self._reconciler.saw_ledger(node, ledger, self._monotonic())

    async def _commit(
        self,
        ctx: ActorContext,
        reservations: tuple[Reservation, ...],
        ledgers: Mapping[str, LedgerEntry],
    ) -> bool:
        """Books every part of a decision (`booking.py`: the head's first, all or none). False when another
        placement wrote one of the ledgers first (what was written is taken back; the caller decides again).
        A write that fails for another reason is taken back too (it may have landed), then raised."""
        booking = Booking(reservations)
        while (reservation := booking.next_write()) is not None:
            node = reservation.node_id
            ledger, revision = ledgers.get(node, (None, 0))
            self._in_flight.setdefault(node, []).append(reservation)
            self._overlaid(node)
            try:
                new_revision = await self._write_ledger(node, with_reservation(ledger, node, reservation), revision)
            except BaseException:
                await self._take_back(ctx, booking.failed(reservation, uncertain=True))
                raise
            finally:
                self._in_flight[node].remove(reservation)
                if not self._in_flight[node]:
                    del self._in_flight[node]
                self._overlaid(node)
            if new_revision is None:
                await self._take_back(ctx, booking.failed(reservation, uncertain=False))
                return False
            booking.wrote(reservation)
        return True

    async def _take_back(self, ctx: ActorContext, releases: tuple[Release, ...]) -> None:
        """Releases what a failed booking wrote (each only while unclaimed); one that fails is left to the
        reconcile (an orphaned member part) or to its hold (a head part)."""
        for rollback in releases:
            try:
                if not await self._make(ctx, rollback, emit=False):
                    ctx.log.info("rollback_not_needed", node=rollback.node, reservation=rollback.reservation_id)
            except (nats.errors.Error, TimeoutError) as exc:
                ctx.log.error("rollback_failed", node=rollback.node, reservation=rollback.reservation_id,
                              error=repr(exc))  # fmt: skip

    # --- reservation lifecycle ------------------------------------------------------------------------

    async def _follow_runner_events(self, ctx: ActorContext) -> None:
        subjects = ctx.subjects
        # A consumer of this node's own (only its user may create, change, pull or acknowledge it, `runtime.roles`):
        # every node's placement applies every event, and a change is written once (compare-and-set).
        sub = await ctx.bus.js.pull_subscribe(
            subjects.events_of("runner"),
            durable=placement_consumer(ctx.node_id),
            stream=subjects.events_stream,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.NEW,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=30,
                inactive_threshold=_CONSUMER_IDLE_S,
            ),
        )
        while True:
            try:
                messages = await sub.fetch(16, timeout=5)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            for msg in messages:
                try:
                    kind = _EVENT_TYPE.decode(msg.data).type
                    if kind == "instance_ready" or kind in _RELEASING:
                        event = _RUNNER_OUTCOME.decode(msg.data)
                        # nats-server lets a node publish only events ending in its own id: one that names
                        # another node is a forgery and changes nothing.
                        if msg.subject.rsplit(".", 1)[-1] != event.node:
                            ctx.log.warning("runner_event_not_from_its_node", subject=msg.subject, node=event.node)
                        else:
                            await self._apply_runner_event(ctx, event)
                except msgspec.MsgspecError as exc:
                    # Malformed or from a peer that lies: it changes nothing, and is not retried forever.
                    ctx.log.warning("bad_runner_event", subject=msg.subject, error=str(exc))
                except (nats.errors.Error, TimeoutError) as exc:
                    # Not acknowledged: redelivered after ack_wait (the reconcile converges meanwhile).
                    ctx.log.warning("runner_event_not_applied", subject=msg.subject, error=repr(exc))
                    continue
                await msg.ack()

    async def _apply_runner_event(self, ctx: ActorContext, event: RunnerOutcome) -> None:
        node, rid = event.node, event.reservation_id
        change: Change
        if isinstance(event, InstanceReady):
            entry = self._view.get(node)
            change = Promote(
                node=node,
                reservation_id=rid,
                instance_id=event.instance_id,
                observed_total=event.observed.total_bytes,
                running_since=event.time,  # the node's clock, compared only with the node's own reports
                node_started_at=entry.resources.started_at if entry else None,
            )
        else:
            change = released_by_event(node, rid, event.instance_id, _RELEASING[event_type(event)])
        await self._make(ctx, change)

    async def _make(self, ctx: ActorContext, change: Change, *, emit: bool = True) -> bool:
        """Applies `change` to the latest revision of its node's ledger with compare-and-set, re-checking on
        every attempt that it still applies. True when it was written."""
        node = change.node
        async with asyncio.timeout(_CHANGE_DEADLINE_S):
            for _ in range(self._max_attempts):
                ledger, revision = (await self._read_ledgers([node]))[node]
                if revision < 0:
                    return False  # unreadable: left for an operator
                new = apply(change, ledger)
                if new is None:
                    return False
                if await self._write_ledger(node, new, revision) is not None:
                    if emit:
                        self._announce(ctx, change, new)
                    return True
        return False

    def _announce(self, ctx: ActorContext, change: Change, ledger: NodeLedger) -> None:
        rid = change.reservation_id
        if isinstance(change, Release):
            ctx.emit(ReservationReleased, reservation_id=rid, node_id_released=change.node, reason=change.reason)
            ctx.log.info("reservation_released", node=change.node, reservation=rid, reason=change.reason)
            return
        running = next(r for r in ledger.reservations if r.reservation_id == rid)
        ctx.emit(ReservationObserved, reservation_id=rid, held=dict(running.held))

    async def _reconcile_forever(self, ctx: ActorContext) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval)
            await self.reconcile(ctx)

    async def reconcile(self, ctx: ActorContext) -> None:
        """One pass: compares every ledger with the instance records and the view, and writes what the
        core says should change. Failures are logged and retried by the next pass."""
        # a split's parts are judged against each other: every ledger as watched (in the bucket's order, so a
        # member's part is never seen without the head's part it was booked after)
        ledgers = {name: ledger for name, (ledger, revision) in self._ledger_cache.items() if revision >= 0}
        for node, (ledger, revision) in list(self._ledger_cache.items()):
            if ledger is None or revision < 0:
                continue
            entry = self._view.get(node)
            changes = self._reconciler.changes(
                node,
                ledger,
                node_started_at=entry.resources.started_at if entry else None,
                now=self._monotonic(),
                records_complete=self._records_ready.is_set(),
                ledgers=ledgers,
                node_sent_at=entry.resources.sent_at if entry else None,
            )
            for change in changes:
                try:
                    await self._make(ctx, change)
                except (nats.errors.Error, TimeoutError) as exc:
                    ctx.log.warning("reconcile_change_failed", node=node, change=repr(change), error=repr(exc))
