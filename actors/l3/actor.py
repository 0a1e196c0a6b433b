"""L3 actor (shell): the node's store of saved slot states, its inventory on the bus, and peer fetch.

It owns one `Store` (`<data_dir>/l3`) through its `keeper.StoreKeeper`, the only writer of it: every blocking
store call runs in the keeper's worker threads, and store mutations (ingest, the commit of a fetch,
eviction, gc) are serialised by the keeper's lock; network waits never hold it. The decisions are the pure
cores' (`entry_index`: what is held, pinned, listed; `prefix`: the longest stored prefix; `budget`: what an
eviction pass removes; `commit`: what may be loadable). The same object is the runner's `L3Access`
(in-process: a state file never crosses the bus locally): while the actor is not running, `lookup` finds
nothing, `materialize` raises `L3Unavailable` and `capture` drops the file (with an `l3_capture_dropped`
event when it can). This module is the actor's lifecycle, capture, materialize and inventory; its other
parts are `peer` (fetching an entry from a peer) and `serve` (the endpoints peers and `mesh-actor l3` call).

* Start: `reconcile` (temporary files removed, bad manifests quarantined: `l3_quarantined`, orphan segments
  collected), the entry index filled, the budget enforced once, the endpoints added, the inventory published.
* Quarantine: a task deletes quarantined manifests when the policy says (`budget.quarantine_due`: after
  `quarantine_retention_s`, or `quarantine_keep_s` once the store needs its room), sleeping until the next
  one is due or the store needs room; the segments only they named are freed (`l3_quarantine_cleared`). So
  an unreadable manifest blocks eviction for `quarantine_keep_s` at most, with no operator;
  `mesh-actor l3 gc --quarantine` still deletes every one at once.
* Capture: a bounded queue drained by one task: ingest (the entry is servable from here on), one eviction
  pass (`l3_evicted`), the flush that makes it durable, then `l3_captured`. The slot file is deleted
  whatever happens. A state already stored is only touched. While eviction is blocked (an unreadable
  manifest in quarantine: `l3_eviction_blocked`), a capture that does not fit the budget first has the
  quarantine policy run (the store needs room), and is dropped (`eviction_blocked`) instead of growing the
  store past it if that freed nothing. `store` is a capture whose outcome the caller
  awaits (stored, or dropped and why): what a handoff into this node waits for, so it learns at once that
  the state was not kept instead of waiting for it to appear.
* Materialize: single-flight per entry. The first caller's fill assembles the payload (verified segment by
  segment) into `staging/`; every caller of that flight gets a hard link of it at its own `dest` (a temporary
  name next to it, then a rename), so there is never a partial file at `dest` and never a second disk read
  or fetch. A peer entry is first fetched (`peer.PeerFetch`: the manifest, then each segment this store
  lacks, hashed as it arrives and committed with the manifest), so a second fetch moves nothing.
* Inventory: `L3Inventory` under this node's key in `MESH_L3`, with a per-key TTL, refreshed periodically
  and soon after every change (debounced). Peers' inventories are watched for `l3_peer` hits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import nats.errors
from nats.js.kv import KeyValue

from actors.l3 import layout
from actors.l3.api import CaptureOutcome, L3Hit, L3Unavailable
from actors.l3.budget import default_budget
from actors.l3.entry_index import PeerView, items_within
from actors.l3.keeper import StoreKeeper
from actors.l3.peer import PeerFetch
from actors.l3.serve import L3Endpoints
from actors.l3.store import CommitRefused, CorruptEntry, Store, StoreError, UnknownEntry
from messages.errors import UNAVAILABLE
from messages.events import L3Captured, L3CaptureDropped
from messages.l3 import L3Inventory, WarmReply, WarmRequest
from runtime import buckets, tracing
from runtime.actor import Actor, ActorContext, RequestError
from runtime.buckets import TTL_HEADER
from runtime.bus import BadMessage, BusError, encode
from runtime.datapath import DataPathConfig
from runtime.logging import get_logger

__all__ = ["TTL_HEADER", "L3Actor", "L3Limits"]

_STAGING: Final = "staging"
#: The quarantine task looks again at least this often (a clock that jumped), and waits this long after a
#: deletion that failed before it tries again.
_QUARANTINE_IDLE_S: Final = 3600.0
_QUARANTINE_RETRY_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class L3Limits:
    capture_queue: int = 8  # captures waiting for ingest; more are dropped (`queue_full`)
    inventory_ttl_s: float = 30.0  # the MESH_L3 key of a node that stopped refreshing disappears after this
    inventory_refresh_s: float = 10.0
    inventory_debounce_s: float = 0.2  # changes within this are published together
    publish_timeout_s: float = 5.0
    chunk_timeout_s: float = 5.0  # one chunk request to a peer: a stalled peer is given up after this
    fetch_window: int = 8  # chunk requests in flight per segment being fetched
    fill_deadline_s: float = 900.0  # a fill never outlives this, whatever its callers' deadlines
    max_probes: int = 64
    segment_workers: int = 8  # segment chunks served concurrently
    threads: int = 8  # worker threads for store I/O
    # A quarantined manifest is deleted after this (the journal keeps why it was quarantined)...
    quarantine_retention_s: float = 86_400.0
    # ...or after this, once the store needs its room (an unreadable one blocks every eviction meanwhile).
    quarantine_keep_s: float = 600.0


@dataclass(slots=True)
class _Capture:
    source: Path
    identity: str
    tokens: tuple[int, ...]
    payload_kind: str
    outcome: asyncio.Future[CaptureOutcome] | None = None  # resolved once it is stored or dropped (`store`)
    # the trace of the request it was captured for: its capture is a hop of that trace
    trace: tracing.TraceContext | None = field(default_factory=tracing.current)

    def settle(self, outcome: CaptureOutcome) -> None:
        if self.outcome is not None and not self.outcome.done():
            self.outcome.set_result(outcome)


class _Flight:
    """One fill of one entry, shared by every caller that asks for it while it runs."""

    def __init__(self, future: asyncio.Future[Path]) -> None:
        self.future = future
        self.users = 0
        self.staged: Path | None = None


class L3Actor(Actor):
    name = "l3"
    description = "L3 store of saved slot states: capture, lookup, restore, peer fetch"

    def __init__(
        self,
        node_id: str,
        data_dir: Path,
        *,
        budget_bytes: int | None = None,
        segment_bytes: int = layout.DEFAULT_SEGMENT_BYTES,
        limits: L3Limits | None = None,
        clock: Callable[[], float] = time.time,
        datapath: DataPathConfig | None = None,
    ) -> None:
        """`budget_bytes`: what the store may hold (0 disables capture; None: `budget.default_budget` of the
        disk it is on). `datapath`: segments between nodes over the direct data path (None: over NATS only)."""
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError("an L3 budget cannot be negative")
        self.node_id = node_id
        self.root = data_dir / "l3"
        self.limits = limits or L3Limits()
        self._configured_budget = budget_bytes
        self._segment_bytes = layout.check_segment_bytes(segment_bytes)
        self._clock = clock
        self._keeper = StoreKeeper(
            self.root,
            budget_bytes=budget_bytes or 0,
            threads=self.limits.threads,
            clock=clock,
            quarantine_retention_s=self.limits.quarantine_retention_s,
            quarantine_keep_s=self.limits.quarantine_keep_s,
        )
        self._peer_fetch = PeerFetch(
            self._keeper,
            chunk_timeout_s=self.limits.chunk_timeout_s,
            window=self.limits.fetch_window,
            clock=clock,
            datapath=datapath,
        )
        self._endpoints = L3Endpoints(self._keeper, node_id, busy=self._busy, datapath=datapath)
        self._ctx: ActorContext | None = None
        self._peers = PeerView()
        self._queue: asyncio.Queue[_Capture] | None = None
        self._flights: dict[str, _Flight] = {}

    @property
    def budget_bytes(self) -> int:
        """What the store may hold (0: capture is off); the disk's default share once started, if not given."""
        return self._keeper.budget_bytes

    @property
    def running(self) -> bool:
        return self._ctx is not None

    # ---- L3Access: what the runner calls ----------------------------------------------------------------

    async def lookup(self, identity: str, tokens: Sequence[int], *, max_tokens: int) -> L3Hit | None:
        if self._ctx is None or max_tokens < 1 or not layout.is_digest(identity):
            return None
        probes = self.limits.max_probes
        try:
            local = self._keeper.entry_index.lookup(identity, tokens, max_tokens=max_tokens, max_probes=probes)
            peer = self._peers.lookup(
                identity,
                tokens,
                max_tokens=max_tokens,
                longer_than=local.n_tokens if local else 0,
                max_bytes=self.budget_bytes,
                max_probes=probes,
            )
        except ValueError:  # a token id outside int32: nothing can be stored under it
            return None
        if peer is not None:
            return L3Hit(entry=peer.entry, n_tokens=peer.n_tokens, bytes=peer.bytes, node=peer.node, source="l3_peer")
        if local is not None:
            held = self._keeper.entry_index.get(local.entry)
            size = held.bytes if held else 0
            return L3Hit(entry=local.entry, n_tokens=local.n_tokens, bytes=size, node=self.node_id, source="l3_local")
        return None

    async def materialize(self, hit: L3Hit, dest: Path, *, deadline_s: float) -> None:
        ctx = self._ctx
        if ctx is None:
            raise L3Unavailable("the node's L3 actor is not running")
        if not layout.is_digest(hit.entry):
            raise L3Unavailable("not an entry id")
        flight = self._flights.get(hit.entry)
        if flight is None:
            future: asyncio.Future[Path] = asyncio.get_running_loop().create_future()
            future.add_done_callback(_retrieve)
            flight = self._flights[hit.entry] = _Flight(future)
            ctx.spawn(self._fill(ctx, hit, flight, deadline_s), f"fill:{hit.entry[:12]}")
        flight.users += 1
        try:
            try:
                async with asyncio.timeout(deadline_s):
                    staged = await asyncio.shield(flight.future)
            except TimeoutError as exc:
                raise L3Unavailable(f"entry {hit.entry[:16]}… was not ready within {deadline_s:g}s") from exc
            try:
                await self._keeper.blocking(_link_into, staged, dest)
            except OSError as exc:
                raise L3Unavailable(f"cannot write {dest}: {exc}") from exc
        finally:
            flight.users -= 1
            await self._release(flight)

    def capture(self, source: Path, *, identity: str, tokens: Sequence[int], payload_kind: str) -> None:
        self._enqueue(_Capture(source=source, identity=identity, tokens=tuple(tokens), payload_kind=payload_kind))

    async def store(self, source: Path, *, identity: str, tokens: Sequence[int], payload_kind: str) -> CaptureOutcome:
        outcome: asyncio.Future[CaptureOutcome] = asyncio.get_running_loop().create_future()
        job = _Capture(
            source=source, identity=identity, tokens=tuple(tokens), payload_kind=payload_kind, outcome=outcome
        )
        self._enqueue(job)
        # The capture task resolves it whatever happens (stored, dropped, the incarnation stopping); the
        # caller's own deadline bounds the wait. Shielded: a caller that gives up does not cancel the capture.
        return await asyncio.shield(outcome)

    def _enqueue(self, job: _Capture) -> None:
        if self._ctx is None or self._queue is None:
            self._drop(job, "not_running")
        elif self.budget_bytes == 0:
            self._drop(job, "disabled")
        elif not layout.is_digest(job.identity):
            self._drop(job, "refused: identity is not a digest")
        else:
            try:
                self._queue.put_nowait(job)
            except asyncio.QueueFull:
                self._drop(job, "queue_full")

    # ---- the incarnation -------------------------------------------------------------------------------

    async def run(self, ctx: ActorContext) -> None:
        self._ctx = None
        store = await self._keeper.blocking(Store, self.root, segment_bytes=self._segment_bytes)
        await self._keeper.blocking(shutil.rmtree, self.root / _STAGING, True)
        await self._keeper.blocking(os.makedirs, self.root / _STAGING, 0o700, True)
        await self._keeper.blocking(store.clear_incoming)  # what fetches of an earlier incarnation left
        async with self._keeper.mutate:
            inventory = await self._keeper.blocking(store.reconcile)
            if self._configured_budget is None:
                self._keeper.budget_bytes = await self._keeper.blocking(self._default_budget, inventory.bytes)
            self._keeper.store = store
            self._keeper.refill(ctx, inventory)
            await self._keeper.enforce(ctx, store)
        kv = await buckets.l3(ctx.bus, ctx.subjects)
        self._queue = asyncio.Queue(maxsize=self.limits.capture_queue)
        self._flights.clear()
        self._keeper.fetching = 0
        await self._endpoints.add_to(ctx, segment_workers=self.limits.segment_workers)
        await ctx.add_endpoint("warm", ctx.subjects.l3(self.node_id, "warm"), WarmRequest, self._on_warm)
        ctx.spawn(self._capture_loop(ctx), "capture")
        ctx.spawn(self._inventory_loop(ctx), "inventory")
        ctx.spawn(self._quarantine_loop(ctx, store), "quarantine")
        ctx.spawn(self._watch_peers(ctx, kv), "peers")
        self._ctx = ctx
        self._keeper.changed.set()
        ctx.log.info(
            "l3_started",
            entries=len(self._keeper.entry_index),
            bytes=self._keeper.entry_index.stored_bytes,
            budget=self.budget_bytes,
        )

    def _busy(self) -> bool:
        """A fetch or a restore is running, or an entry is pinned: gc (which rereads the disk) must wait."""
        return bool(self._keeper.fetching or self._flights or self._keeper.entry_index.pinned())

    def _default_budget(self, store_bytes: int) -> int:  # worker thread
        usage = shutil.disk_usage(self.root)
        return default_budget(usage.total, usage.free, store_bytes)

    # ---- capture -----------------------------------------------------------------------------------------

    def _drop(self, job: _Capture, reason: str) -> None:
        job.settle(CaptureOutcome(entry=None, reason=reason[:200]))
        ctx = self._ctx
        if ctx is not None:
            ctx.emit(L3CaptureDropped, identity=job.identity, n_tokens=len(job.tokens), reason=reason[:200])
        _log(ctx).info("l3_capture_dropped", reason=reason, n_tokens=len(job.tokens))
        with contextlib.suppress(OSError):
            os.unlink(job.source)  # one unlink; the L3 side owns the file from the hand-over

    async def _capture_loop(self, ctx: ActorContext) -> None:
        queue = self._queue
        assert queue is not None
        try:
            while True:
                job = await queue.get()
                try:
                    with tracing.use(job.trace), tracing.hop("l3 capture", kind="internal") as span:
                        span.update({"mesh.node": ctx.node_id, "mesh.tokens": len(job.tokens)})
                        await self._capture_one(ctx, job)
                finally:
                    job.settle(CaptureOutcome(entry=None, reason="stopping"))  # unless settled already
                    await self._keeper.blocking(_unlink_quietly, job.source)
        finally:
            while not queue.empty():
                self._drop(queue.get_nowait(), "stopping")
            self._ctx = None  # the incarnation is ending: the runner goes cold from here on

    async def _capture_one(self, ctx: ActorContext, job: _Capture) -> None:
        store = self._keeper.require_store()
        try:
            entry = layout.entry_id(job.identity, job.tokens)
        except ValueError as exc:
            self._drop(job, f"refused: {exc}")
            return
        if entry in self._keeper.entry_index:  # the same state again: a use, not a second copy
            self._keeper.entry_index.touch(entry, self._clock())
            await self._keeper.blocking(store.touch, entry)
            self._keeper.changed.set()
            job.settle(CaptureOutcome(entry=entry))
            return
        try:
            size = (await self._keeper.blocking(os.stat, job.source)).st_size
        except OSError as exc:
            self._drop(job, f"io_error: {exc.strerror or exc}")
            return
        if size > self.budget_bytes:
            self._drop(job, f"over_budget: {size} bytes, budget {self.budget_bytes}")
            return
        if not self._keeper.room_for(size):  # the store needs its room: quarantined manifests may go first
            self._keeper.need_room()
            async with self._keeper.mutate:
                await self._keeper.clear_quarantine(ctx, store)
        if not self._keeper.room_for(size):
            stored, blocked = self._keeper.entry_index.stored_bytes, self._keeper.entry_index.eviction_blocked
            detail = f"{stored} + {size} bytes over the budget {self.budget_bytes}; unreadable in quarantine: "
            self._drop(job, f"eviction_blocked: {detail}{', '.join(blocked[:3])}")
            return
        started = time.monotonic()
        self._keeper.entry_index.pin(entry)
        try:
            async with self._keeper.mutate:
                before = self._keeper.entry_index.stored_bytes
                manifest = await self._keeper.blocking(
                    store.ingest, job.source, identity=job.identity, tokens=job.tokens, payload_kind=job.payload_kind
                )
                ingest_ms = (time.monotonic() - started) * 1000
                self._keeper.entry_index.add(
                    entry,
                    identity=job.identity,
                    n_tokens=len(job.tokens),
                    bytes=manifest.total_bytes,
                    last_use=self._clock(),
                    segments=[(seg.digest, seg.length) for seg in manifest.segments],
                )
                plan = await self._keeper.enforce(ctx, store)
        except CommitRefused as exc:
            self._keeper.unsure = True  # segments may have landed: the next pass counts the disk again
            self._drop(job, f"refused: {exc.refusal.rule.value}: {exc.refusal.detail}")
            return
        except (StoreError, OSError) as exc:
            self._keeper.unsure = True
            self._drop(job, f"io_error: {exc}")
            return
        finally:
            self._keeper.entry_index.unpin(entry)
        if entry not in self._keeper.entry_index:  # evicted at once: a budget smaller than pinned entries need
            job.settle(CaptureOutcome(entry=None, reason="over_budget: evicted at once"))
            return
        job.settle(CaptureOutcome(entry=entry))  # loadable from here on; the flush makes it durable
        durable_ms: float | None = None
        try:
            await self._keeper.blocking(store.flush)
            durable_ms = round((time.monotonic() - started) * 1000, 3)
        except OSError as exc:  # the entry stays pending: the next flush, or the next start's reconcile, settles it
            ctx.log.warning("l3_flush_failed", entry=entry, error=str(exc))
        ctx.emit(
            L3Captured,
            durable_ms=durable_ms,
            entry=entry,
            identity=job.identity,
            n_tokens=len(job.tokens),
            bytes=manifest.total_bytes,
            new_bytes=max(0, plan.bytes_before - before),
            ingest_ms=round(ingest_ms, 3),
        )

    # ---- materialize -------------------------------------------------------------------------------------

    async def _fill(self, ctx: ActorContext, hit: L3Hit, flight: _Flight, deadline_s: float) -> None:
        """(a task of the incarnation) Fills `flight`; never raises but for cancellation."""
        try:
            async with asyncio.timeout(min(deadline_s, self.limits.fill_deadline_s)):
                flight.staged = await self._fill_entry(ctx, hit)
            flight.future.set_result(flight.staged)
        except asyncio.CancelledError:
            flight.future.set_exception(L3Unavailable("the node's L3 actor stopped"))
            raise
        except L3Unavailable as exc:
            flight.future.set_exception(exc)
        except TimeoutError:
            flight.future.set_exception(L3Unavailable(f"the fill did not finish within {deadline_s:g}s"))
        except (StoreError, OSError, BusError) as exc:
            flight.future.set_exception(L3Unavailable(str(exc)))
        except Exception as exc:  # one fill's bug is that fill's: the caller goes cold, the actor keeps serving
            ctx.log.exception("l3_fill_failed", entry=hit.entry, error=repr(exc))
            flight.future.set_exception(L3Unavailable(f"fill failed: {exc!r}"))
        finally:
            if self._flights.get(hit.entry) is flight:
                del self._flights[hit.entry]
            await self._release(flight)

    async def _release(self, flight: _Flight) -> None:
        """The staged payload goes once the fill is over and its last caller has its link."""
        if flight.future.done() and flight.users == 0 and flight.staged is not None:
            staged, flight.staged = flight.staged, None
            await self._keeper.blocking(_unlink_quietly, staged)

    async def _fill_entry(self, ctx: ActorContext, hit: L3Hit) -> Path:
        store = self._keeper.require_store()
        entry = hit.entry
        self._keeper.entry_index.pin(entry)
        try:
            if entry not in self._keeper.entry_index:
                if hit.source != "l3_peer" or hit.node == self.node_id:
                    raise L3Unavailable(f"entry {entry[:16]}… is no longer stored")
                await self._peer_fetch.fetch(ctx, store, hit)
            try:
                manifest = await self._keeper.blocking(store.load_manifest, entry)
                staged = self.root / _STAGING / layout.temp_name(entry, secrets.token_hex(8))
                await self._keeper.blocking(store.assemble, manifest, staged)
            except CorruptEntry as exc:
                self._keeper.forget(ctx, entry, quarantined=f"{exc.refusal.rule.value}: {exc.refusal.detail}")
                raise L3Unavailable(str(exc)) from exc
            except UnknownEntry as exc:
                self._keeper.forget(ctx, entry)
                raise L3Unavailable(f"entry {entry[:16]}… is no longer stored") from exc
            except StoreError as exc:  # an unreadable manifest: reconcile (the next start, or gc) quarantines it
                raise L3Unavailable(str(exc)) from exc
            self._keeper.entry_index.touch(entry, self._clock())
            await self._keeper.blocking(store.touch, entry)
            self._keeper.changed.set()
            return staged
        finally:
            self._keeper.entry_index.unpin(entry)

    # ---- warm ------------------------------------------------------------------------------------------

    async def _on_warm(self, request: WarmRequest) -> WarmReply:
        """Fetches the peers' most recently used entries of an identity that this store lacks (a new replica's
        node: its first requests then restore locally), one after another, each within the fill deadline."""
        ctx = self._ctx
        if ctx is None:
            raise RequestError(UNAVAILABLE, "the node's L3 store is starting")
        store = self._keeper.require_store()
        room = max(0, min(request.max_bytes, self.budget_bytes - self._keeper.entry_index.stored_bytes))
        fetched = already = failed = 0
        moved = 0
        for peer in self._peers.hottest(request.identity, max_entries=request.max_entries, max_bytes=room):
            if peer.entry in self._keeper.entry_index:
                already += 1
                continue
            hit = L3Hit(entry=peer.entry, n_tokens=peer.n_tokens, bytes=peer.bytes, node=peer.node, source="l3_peer")
            try:
                async with asyncio.timeout(self.limits.fill_deadline_s):
                    await self._peer_fetch.fetch(ctx, store, hit)
            except (L3Unavailable, StoreError, OSError, BusError, TimeoutError) as exc:
                failed += 1
                ctx.log.warning("l3_warm_fetch_failed", entry=peer.entry, node=peer.node, error=str(exc))
                continue
            fetched += 1
            moved += peer.bytes
        ctx.log.info("l3_warmed", identity=request.identity, fetched=fetched, bytes=moved, already=already,
                     failed=failed)  # fmt: skip
        return WarmReply(node_id=self.node_id, fetched=fetched, bytes=moved, already=already, failed=failed)

    # ---- quarantine --------------------------------------------------------------------------------------

    async def _quarantine_loop(self, ctx: ActorContext, store: Store) -> None:
        """Deletes the quarantined manifests the policy says are due: sleeps until the next one is, or until
        the store needs room or quarantines another (`keeper.pressure`)."""
        keeper = self._keeper
        while True:
            due = keeper.next_quarantine_due()
            wait = _QUARANTINE_IDLE_S if due is None else min(_QUARANTINE_IDLE_S, max(0.0, due - keeper.clock()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await keeper.pressure.wait()
            keeper.pressure.clear()
            async with keeper.mutate:
                cleared = await keeper.clear_quarantine(ctx, store)
            due = keeper.next_quarantine_due()
            if not cleared and due is not None and due <= keeper.clock():  # due but not deleted (an I/O error)
                await asyncio.sleep(_QUARANTINE_RETRY_S)

    # ---- inventory ---------------------------------------------------------------------------------------

    async def _inventory_loop(self, ctx: ActorContext) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.limits.inventory_refresh_s):
                    await self._keeper.changed.wait()
            if self._keeper.changed.is_set():
                await asyncio.sleep(self.limits.inventory_debounce_s)  # let a burst of changes settle
            self._keeper.changed.clear()
            await self._publish(ctx)

    def inventory(self) -> L3Inventory:
        """What this node publishes now."""
        max_items = items_within(self._ctx.bus.max_payload if self._ctx else 1 << 20)
        return self._keeper.entry_index.inventory(
            self.node_id, budget_bytes=self.budget_bytes, max_items=max_items, sent_at=self._clock()
        )

    async def _publish(self, ctx: ActorContext) -> None:
        subject = f"$KV.{ctx.subjects.l3_bucket}.{self.node_id}"
        ttl = max(1, round(self.limits.inventory_ttl_s))
        try:
            await ctx.bus.js.publish(
                subject,
                encode(self.inventory()),
                timeout=self.limits.publish_timeout_s,
                headers={TTL_HEADER: f"{ttl}s"},
            )
        except (nats.errors.Error, TimeoutError) as exc:
            ctx.log.warning("l3_inventory_not_published", error=str(exc) or type(exc).__name__)

    async def _watch_peers(self, ctx: ActorContext, kv: KeyValue) -> None:
        ready = asyncio.Event()
        self._peers = PeerView()
        async for entry in buckets.watch(kv, ready):
            if entry.key == self.node_id:
                continue
            if buckets.removed(entry):
                self._peers.drop(entry.key)
                continue
            try:
                inventory = buckets.decode_keyed(entry, L3Inventory, lambda i: i.node_id, "L3 inventory")
            except BadMessage as exc:
                ctx.log.warning("l3_peer_inventory_skipped", node=entry.key, error=str(exc))
                self._peers.drop(entry.key)
                continue
            self._peers.update(inventory)


# ---- helpers -----------------------------------------------------------------------------------------------


def _log(ctx: ActorContext | None) -> Any:
    return ctx.log if ctx is not None else get_logger(actor="l3")


def _retrieve(future: asyncio.Future[Path]) -> None:
    """Marks a flight's outcome as seen: a fill nobody waits for any more must not log 'never retrieved'."""
    if not future.cancelled():
        future.exception()


def _link_into(staged: Path, dest: Path) -> None:  # worker thread
    """`dest` holds the staged payload, complete or not at all: a hard link (or a copy across file systems)
    under a temporary name next to it, renamed into place."""
    tmp = dest.with_name(layout.temp_name(dest.name, secrets.token_hex(8)))
    try:
        try:
            os.link(staged, tmp)
        except OSError:
            shutil.copyfile(staged, tmp)
        os.replace(tmp, dest)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
