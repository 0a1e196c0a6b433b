"""Placement actor (shell): answers `mesh.placement.request` and `mesh.placement.fit`, keeps reservations.

- The cluster view comes only from events: a watch on the nodes KV bucket (telemetry with per-key TTL;
  an expired key arrives as an empty delete marker and removes the node).
- Ledgers (memory held per node) live in the reservations KV bucket, key `node.<id>`. A decision reads the
  ledgers of the nodes it considers, decides with the pure core, and writes each chosen node's ledger with
  compare-and-set on the revision it read. If another placement actor wrote first, it re-reads and decides
  again, so two actors never book the same memory; a multi-node booking that fails half-way is rolled back.
- Runner events (ready, stopped, failed, refused, drift) arrive through a durable JetStream consumer shared
  by every placement actor, so none is lost while placement restarts: ready replaces the prediction by the
  observed footprint, the others release the reservation. Reservations never started expire.
- Every `placement.request` decision is a `placement_decided` journal event with its inputs (replayable);
  `placement.fit` answers the same question, reserves nothing and is not journaled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from stat import S_ISREG

import blake3
import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from actors.placement.admission import ModelFacts, ViewEntry, decide, rejected
from actors.placement.geometry import GeometryError, UnsupportedArchitecture, geometry_from_header
from actors.placement.gguf_header import GGUFFormatError, read_header
from actors.placement.ledger import expired, replaced, with_reservation, without
from actors.placement.registry import RegistryUntrusted, check_file, verify
from messages.events import (
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
from messages.model import ModelGeometry
from messages.placement import (
    LEDGER_KEY_PREFIX,
    NodeLedger,
    PlacementDecision,
    PlacementRequest,
    RejectReason,
    Reservation,
)
from messages.registry import RegistryEntry
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.actor import Actor, ActorContext
from runtime.bus import BadMessage, decode_checked, encode
from runtime.logging import get_logger

QUEUE_GROUP = "placement"
RUNNER_EVENTS_CONSUMER = "placement-reservations"
_RELEASING = {"instance_stopped": "stopped", "instance_failed": "failed", "drift_rejected": "rejected"}
_RELEASING["instance_refused"] = "refused"


#: The runner events that change a reservation.
RunnerOutcome = InstanceReady | InstanceStopped | InstanceFailed | DriftRejected | InstanceRefused


class _EventType(msgspec.Struct):
    type: str


_EVENT_TYPE = msgspec.json.Decoder(_EventType)
_RUNNER_OUTCOME = msgspec.json.Decoder(RunnerOutcome)


class ModelProblem(Exception):
    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Cached:
    key: tuple[int, int]  # size, mtime_ns
    geometry: ModelGeometry
    digest: str | None = None


def ledger_key(node_id: str) -> str:
    return f"{LEDGER_KEY_PREFIX}{node_id}"


class PlacementActor(Actor):
    name = "placement"
    description = "admission and reservations"

    def __init__(
        self,
        *,
        trusted_registry_keys: tuple[str, ...] = (),
        clock: Callable[[], float] = time.time,
        max_attempts: int = 8,
        sweep_interval_s: float = 2.0,
    ) -> None:
        self.trusted = trusted_registry_keys
        self._clock = clock
        self._max_attempts = max_attempts
        self._sweep_interval = sweep_interval_s
        self._view: dict[str, ViewEntry] = {}
        self._models: dict[str, _Cached] = {}
        self._view_ready = asyncio.Event()
        self._ledger_cache: dict[str, tuple[NodeLedger | None, int]] = {}
        self._ledgers_ready = asyncio.Event()
        self._log = get_logger(actor=self.name)

    # --- wiring ---------------------------------------------------------------------------------------

    async def run(self, ctx: ActorContext) -> None:
        subjects = ctx.subjects
        self._nodes = await buckets.nodes(ctx.bus, subjects)
        self._ledgers = await buckets.reservations(ctx.bus, subjects)
        self._registry = await buckets.registry(ctx.bus, subjects)
        self._view = {}
        self._view_ready = asyncio.Event()
        self._ledger_cache = {}
        self._ledgers_ready = asyncio.Event()
        ctx.spawn(self._watch_nodes(ctx), "watch-nodes")
        ctx.spawn(self._watch_ledgers(), "watch-ledgers")
        async with asyncio.timeout(10):
            await self._view_ready.wait()
            await self._ledgers_ready.wait()
        ctx.spawn(self._follow_runner_events(ctx), "runner-events")
        ctx.spawn(self._sweep(ctx), "sweep")
        await ctx.add_endpoint(
            "request", subjects.placement_request, PlacementRequest, lambda r: self.place(ctx, r, dry_run=False),
            queue_group=QUEUE_GROUP,
        )  # fmt: skip
        await ctx.add_endpoint(
            "fit", subjects.placement_fit, PlacementRequest, lambda r: self.place(ctx, r, dry_run=True),
            queue_group=QUEUE_GROUP,
        )  # fmt: skip

    async def _watch_nodes(self, ctx: ActorContext) -> None:
        watcher = await self._nodes.watchall()
        try:
            async for entry in watcher:
                if entry is None:  # the initial values are all in
                    self._view_ready.set()
                    continue
                if not entry.value or entry.operation in ("DEL", "PURGE"):
                    self._view.pop(entry.key, None)  # expired (delete marker) or removed
                    continue
                try:
                    node = decode_checked(entry.value, NodeResources, f"telemetry of {entry.key}")
                    if node.node_id != entry.key:
                        raise BadMessage(f"telemetry under key {entry.key}", f"claims to be node {node.node_id!r}")
                except BadMessage as exc:
                    ctx.log.warning("bad_telemetry", key=entry.key, error=str(exc))
                    self._view.pop(entry.key, None)  # what it said before is no longer what it says
                    continue
                self._view[entry.key] = ViewEntry(resources=node, revision=entry.revision or 0)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await watcher.stop()  # type: ignore[no-untyped-call]

    async def _watch_ledgers(self) -> None:
        """A local copy of every node's ledger: decisions read it first (compare-and-set still guards every
        write, and a conflict re-reads the bucket), so a decision costs no bucket round trip per node."""
        watcher = await self._ledgers.watchall()
        try:
            async for entry in watcher:
                if entry is None:
                    self._ledgers_ready.set()
                    continue
                node = entry.key.removeprefix(LEDGER_KEY_PREFIX)
                self._ledger_cache[node] = self._decode_ledger(node, entry.value, entry.revision or 0)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await watcher.stop()  # type: ignore[no-untyped-call]

    def _decode_ledger(self, node: str, value: bytes | None, revision: int) -> tuple[NodeLedger | None, int]:
        """A ledger and its revision; revision -1 marks one that does not decode (nothing is booked there)."""
        if not value:
            return None, revision
        try:
            return decode_checked(value, NodeLedger, f"ledger of node {node}"), revision
        except BadMessage as exc:
            self._log.error("ledger_unreadable", node=node, error=str(exc))
            return None, -1

    # --- decisions ------------------------------------------------------------------------------------

    async def place(self, ctx: ActorContext, request: PlacementRequest, *, dry_run: bool) -> PlacementDecision:
        decision_id = uuid.uuid4().hex
        now = self._clock()
        view = dict(self._view)
        try:
            facts = await self._model_facts(request)
        except ModelProblem as exc:
            decision = rejected(
                request, exc.reason, str(exc), decision_id=decision_id, now=now, dry_run=dry_run, view=view
            )
            if not dry_run:
                self._journal(ctx, request, view, {}, None, decision)
            return decision

        reservation_id = uuid.uuid4().hex[:16]
        names = list(request.nodes or view)
        held: dict[str, NodeLedger] = {}
        unreadable: set[str] = set()
        for attempt in range(self._max_attempts):
            now = self._clock()
            view = dict(self._view)
            # The local copy first; after a lost compare-and-set, the bucket itself.
            if attempt == 0:
                ledgers = {name: self._ledger_cache.get(name, (None, 0)) for name in names}
            else:
                ledgers = await self._read_ledgers(names)
            unreadable = {name for name, (_, revision) in ledgers.items() if revision < 0}
            held = {name: ledger for name, (ledger, _) in ledgers.items() if ledger is not None}
            outcome = decide(
                request,
                facts,
                view,
                held,
                now=now,
                decision_id=decision_id,
                reservation_id=reservation_id,
                dry_run=dry_run,
                unreadable=frozenset(unreadable),
            )
            if not outcome.reservations or await self._commit(ctx, outcome.reservations, ledgers, now):
                break
        else:
            conflict = rejected(
                request,
                "reservation_conflict",
                f"other placements kept taking the memory first ({self._max_attempts} attempts)",
                decision_id=decision_id,
                now=now,
                dry_run=dry_run,
                view=view,
            )
            self._journal(ctx, request, view, held, facts, conflict, unreadable)
            return conflict
        if not dry_run:
            self._journal(ctx, request, view, held, facts, outcome.decision, unreadable)
            ctx.log.info(
                "placement_decided",
                decision=decision_id,
                admitted=outcome.decision.admitted,
                reason=outcome.decision.reason,
                message=outcome.decision.message,
            )
        return outcome.decision

    def _journal(
        self,
        ctx: ActorContext,
        request: PlacementRequest,
        view: Mapping[str, ViewEntry],
        ledgers: Mapping[str, NodeLedger],
        facts: ModelFacts | None,
        decision: PlacementDecision,
        unreadable: set[str] | None = None,
    ) -> None:
        ctx.emit(
            PlacementDecided,
            request=request,
            view=tuple(entry.resources for entry in view.values()),
            view_revisions={name: entry.revision for name, entry in view.items()},
            ledgers=tuple(ledgers.values()),
            geometry=facts.geometry if facts else None,
            model_path=facts.path if facts else request.model.path,
            unreadable_ledgers=tuple(sorted(unreadable or ())),
            decision=decision,
        )

    async def _read_ledgers(self, names: list[str]) -> dict[str, tuple[NodeLedger | None, int]]:
        """Each node's ledger and the revision to compare-and-set against (0: the key does not exist).

        A ledger that does not decode is reported with revision -1: nothing may be booked on that node (we
        cannot know what it holds), and it is never overwritten here, so an operator can inspect it."""
        out: dict[str, tuple[NodeLedger | None, int]] = {}
        for name in names:
            try:
                entry = await self._ledgers.get(ledger_key(name))
            except nats.js.errors.KeyNotFoundError:
                out[name] = (None, 0)
                continue
            out[name] = self._decode_ledger(name, entry.value, entry.revision or 0)
        return out

    async def _write_ledger(self, node: str, ledger: NodeLedger, revision: int) -> int | None:
        """Compare-and-set; the new revision, or None when someone else wrote first."""
        try:
            if revision == 0:
                return int(await self._ledgers.create(ledger_key(node), encode(ledger)))
            return int(await self._ledgers.update(ledger_key(node), encode(ledger), last=revision))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def _commit(
        self,
        ctx: ActorContext,
        reservations: tuple[Reservation, ...],
        ledgers: dict[str, tuple[NodeLedger | None, int]],
        now: float,
    ) -> bool:
        written: list[Reservation] = []
        for reservation in reservations:
            node = reservation.node_id
            ledger, revision = ledgers.get(node, (None, 0))
            new_revision = await self._write_ledger(node, with_reservation(ledger, node, reservation, now), revision)
            if new_revision is None:
                # Lost the race on this node: take back what this booking already wrote, then let the caller
                # retry. Taking back is itself compare-and-set, so it never drops another placement's booking.
                for done in written:
                    if not await self._release(done.node_id, done.reservation_id):
                        ctx.log.error(
                            "rollback_failed",
                            node=done.node_id,
                            reservation=done.reservation_id,
                            expires=done.expires_at,
                        )
                return False
            written.append(reservation)
        return True

    async def _update_reservation(
        self, node: str, reservation_id: str, change: Callable[[NodeLedger, Reservation], NodeLedger | None]
    ) -> Reservation | None:
        """Applies `change` to one reservation with compare-and-set, retrying on conflicts."""
        for _ in range(self._max_attempts):
            ledger, revision = (await self._read_ledgers([node]))[node]
            if ledger is None or revision < 0:
                return None
            current = next((r for r in ledger.reservations if r.reservation_id == reservation_id), None)
            if current is None:
                return None
            new = change(ledger, current)
            if new is None or await self._write_ledger(node, new, revision) is not None:
                return current
        return None

    # --- models ---------------------------------------------------------------------------------------

    async def _model_facts(self, request: PlacementRequest) -> ModelFacts:
        ref = request.model
        if ref.path is None and ref.registry is None:
            raise ModelProblem("model_unreadable", "the request names no model: give model.path or model.registry")
        if ref.registry is not None:
            return await self._registry_facts(ref.registry, ref.path)
        assert ref.path is not None
        cached = self._cached_model(ref.path)
        geometry = cached.geometry if cached else (await asyncio.to_thread(self._read_model, ref.path, False))[0]
        return ModelFacts(geometry=geometry, path=ref.path)

    def _cached_model(self, path: str) -> _Cached | None:
        """The cached header facts when the file has not changed (one stat: cheap enough for the loop)."""
        cached = self._models.get(path)
        if cached is None:
            return None
        try:
            stat = os.stat(path)
        except OSError:
            return None  # let the full read report the problem
        return cached if cached.key == (stat.st_size, stat.st_mtime_ns) else None

    def _read_model(self, path: str, want_digest: bool) -> tuple[ModelGeometry, str | None]:
        """Header facts of a local file, cached by (size, mtime); the blake3 digest on demand."""
        try:
            stat = os.stat(path)
            if not S_ISREG(stat.st_mode):  # a FIFO or device would block or never end
                raise ModelProblem("model_unreadable", f"{path} is not a regular file")
            key = (stat.st_size, stat.st_mtime_ns)
            cached = self._models.get(path)
            if cached is None or cached.key != key:
                cached = _Cached(key=key, geometry=geometry_from_header(read_header(path)))
            if want_digest and cached.digest is None:
                hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
                hasher.update_mmap(path)
                cached = _Cached(key=key, geometry=cached.geometry, digest=hasher.hexdigest())
            self._models[path] = cached
            return cached.geometry, cached.digest
        except UnsupportedArchitecture as exc:
            raise ModelProblem("unsupported_architecture", str(exc)) from exc
        except (GGUFFormatError, GeometryError) as exc:
            raise ModelProblem("model_unreadable", f"{path}: {exc}") from exc
        except OSError as exc:
            raise ModelProblem("model_unreadable", f"cannot read {path}: {exc.strerror or exc}") from exc

    async def _registry_facts(self, name: str, path: str | None) -> ModelFacts:
        try:
            entry_raw = await self._registry.get(name)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyValueError, ValueError) as exc:
            raise ModelProblem("model_unreadable", f"no registry entry named {name!r}") from exc
        if not entry_raw.value:
            raise ModelProblem("model_unreadable", f"no registry entry named {name!r}")
        try:
            entry = decode_checked(entry_raw.value, RegistryEntry, f"registry entry {name!r}")
            verify(entry, self.trusted)
            if path is not None:
                await asyncio.to_thread(self._check_registry_file, entry, path)
        except (BadMessage, RegistryUntrusted) as exc:
            raise ModelProblem("registry_untrusted", str(exc)) from exc
        except ModelProblem:
            raise
        except OSError as exc:
            raise ModelProblem("model_unreadable", f"cannot read {path}: {exc}") from exc
        return ModelFacts(geometry=entry.geometry, path=path or entry.file_name, digest=entry.blake3)

    def _check_registry_file(self, entry: RegistryEntry, path: str) -> None:
        """When the placement node has the file, it must be the one that was signed (size, then digest)."""
        if not os.path.exists(path):
            return
        size = os.stat(path).st_size
        check_file(entry, size=size, digest=None)  # cheap check before hashing
        _, digest = self._read_model(path, True)
        check_file(entry, size=size, digest=digest)

    # --- reservation lifecycle ------------------------------------------------------------------------

    async def _follow_runner_events(self, ctx: ActorContext) -> None:
        subjects = ctx.subjects
        sub = await ctx.bus.js.pull_subscribe(
            subjects.events_of("runner"),
            durable=RUNNER_EVENTS_CONSUMER,
            stream=subjects.events_stream,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, ack_wait=30),
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
                        event: RunnerOutcome = _RUNNER_OUTCOME.decode(msg.data)
                        await self._apply_runner_event(ctx, event)
                except msgspec.MsgspecError as exc:
                    # Malformed or from a peer that lies: it changes nothing, and is not retried forever.
                    ctx.log.warning("bad_runner_event", subject=msg.subject, error=str(exc))
                await msg.ack()

    async def _apply_runner_event(self, ctx: ActorContext, event: RunnerOutcome) -> None:
        node, reservation_id = event.node, event.reservation_id
        if isinstance(event, InstanceReady):
            now = self._clock()
            total = event.observed.total_bytes
            entry = self._view.get(node)
            node_started_at = entry.resources.started_at if entry else None

            def ready(ledger: NodeLedger, current: Reservation) -> NodeLedger:
                held = _observed_held(current, total)
                running = msgspec.structs.replace(
                    current,
                    state="running",
                    held=held,
                    expires_at=None,
                    running_since=now,
                    node_started_at=node_started_at,
                )
                return replaced(ledger, running)

            if (current := await self._update_reservation(node, reservation_id, ready)) is not None:
                ctx.emit(ReservationObserved, reservation_id=reservation_id, held=_observed_held(current, total))
        elif await self._release(node, reservation_id):
            reason = _RELEASING[event_type(event)]
            ctx.emit(ReservationReleased, reservation_id=reservation_id, node_id_released=node, reason=reason)

    async def _release(self, node: str, reservation_id: str) -> bool:
        def remove(ledger: NodeLedger, _: Reservation) -> NodeLedger:
            return without(ledger, reservation_id)

        return await self._update_reservation(node, reservation_id, remove) is not None

    async def _sweep(self, ctx: ActorContext) -> None:
        """Releases what nobody will use: reservations never started before their deadline, and instances of
        a node process that has since restarted (its runner took its llama-servers down when it died)."""
        while True:
            await asyncio.sleep(self._sweep_interval)
            now = self._clock()
            for name, entry in list(self._view.items()):
                ledger, _ = self._ledger_cache.get(name, (None, 0))  # releasing re-reads and compares-and-sets
                if ledger is None:
                    continue
                started = entry.resources.started_at  # the node's own clock on both sides: no skew
                stale = [(r, "expired") for r in expired(ledger, now)]
                stale += [
                    (r, "node_restarted")
                    for r in ledger.reservations
                    if r.node_started_at is not None and r.node_started_at != started
                ]
                for reservation, reason in stale:
                    rid = reservation.reservation_id
                    if await self._release(name, rid):
                        ctx.emit(ReservationReleased, reservation_id=rid, node_id_released=name, reason=reason)


def _observed_held(reservation: Reservation, observed_total: int) -> dict[str, int]:
    """Held memory once running: the observed footprint, plus the host extras (prompt cache, checkpoints)
    that grow at run time and are not in the startup figures. Multi-device layouts keep the prediction."""
    if len(reservation.devices) != 1 or observed_total <= 0:
        return dict(reservation.held)
    device = reservation.devices[0]
    return {device.device: observed_total + device.host_extra_bytes}
