"""L3 actor (shell): the node's store of saved slot states, its inventory on the bus, and peer fetch.

It owns one `Store` (`<data_dir>/l3`) and is the only writer of it; every blocking store call runs in the
actor's own worker threads. The decisions are the pure cores' (`catalog`: what is held, pinned, listed;
`prefix`: the longest stored prefix; `budget`: what an eviction pass removes; `commit`: what may be
loadable). The same object is the runner's `L3Access` (in-process: a state file never crosses the bus
locally): while the actor is not running, `lookup` finds nothing, `materialize` raises `L3Unavailable` and
`capture` drops the file (with an `l3_capture_dropped` event when it can).

* Start: `reconcile` (temporary files removed, bad manifests quarantined: `l3_quarantined`, orphan segments
  collected), the catalog filled, the budget enforced once, the inventory published.
* Capture: a bounded queue drained by one task: ingest, then one eviction pass (`l3_evicted`), then
  `l3_captured`. The slot file is deleted whatever happens. A state already stored is only touched.
* Materialize: single-flight per entry. The first caller's fill assembles the payload (verified segment by
  segment) into `staging/`; every caller of that flight gets a hard link of it at its own `dest` (a temporary
  name next to it, then a rename), so there is never a partial file at `dest` and never a second disk read
  or fetch. A peer entry is first fetched: the manifest, then each segment this store lacks, hashed as it
  arrives and committed with the manifest (`Store.commit_fetched`), so a second fetch moves nothing.
* Store mutations (ingest, the commit of a fetch, eviction, gc) are serialised by one lock; network waits
  never hold it, so a stalled peer delays nobody but the fetch from it, which has per-chunk deadlines.
* Inventory: `L3Inventory` under this node's key in `MESH_L3`, with a per-key TTL, refreshed periodically
  and soon after every change (debounced). Peers' inventories are watched for `l3_peer` hits.
* Endpoints `mesh.l3.<node>.manifests|manifest|segment` (peer fetch; see messages/l3.py for the chunked raw
  replies) and `.stat|verify|gc|evict` (what `mesh-actor l3` sends).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import secrets
import shutil
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from actors.l3 import layout
from actors.l3.api import L3Hit, L3Unavailable
from actors.l3.budget import Eviction, default_budget
from actors.l3.catalog import Catalog, PeerView, items_within
from actors.l3.commit import check_manifest
from actors.l3.layout import Manifest, SegmentRef
from actors.l3.store import (
    CommitRefused,
    CorruptEntry,
    Inventory,
    SegmentReceiver,
    Store,
    StoreError,
    UnknownEntry,
)
from messages.errors import BAD_REQUEST, BUSY, ERROR_HEADER, MESH_ERROR_HEADER, NOT_FOUND
from messages.events import L3Captured, L3CaptureDropped, L3Evicted, L3Fetched, L3Quarantined
from messages.l3 import (
    CHUNK_OFFSET_HEADER,
    CHUNK_TOTAL_HEADER,
    EntryRequest,
    EntryStat,
    EvictReply,
    EvictRequest,
    GcReply,
    GcRequest,
    L3Inventory,
    ManifestList,
    ManifestRequest,
    ManifestsRequest,
    SegmentRequest,
    VerifyReply,
)
from runtime import buckets
from runtime.actor import Actor, ActorContext, RawReply, RequestError
from runtime.bus import BadMessage, BusError, encode, parse_reply
from runtime.logging import get_logger

__all__ = ["TTL_HEADER", "L3Actor", "L3Limits"]

T = TypeVar("T")
TTL_HEADER: Final = "Nats-TTL"
#: Room left in a chunk reply for its headers (ours and the server's).
_HEADER_ROOM: Final = 4096
_STAGING: Final = "staging"


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


@dataclass(slots=True)
class _Capture:
    source: Path
    identity: str
    tokens: tuple[int, ...]
    payload_kind: str


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
    ) -> None:
        """`budget_bytes`: what the store may hold (0 disables capture; None: `budget.default_budget` of the
        disk it is on)."""
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError("an L3 budget cannot be negative")
        self.node_id = node_id
        self.root = data_dir / "l3"
        self.limits = limits or L3Limits()
        self._configured_budget = budget_bytes
        self.budget_bytes = budget_bytes or 0
        self._segment_bytes = layout.check_segment_bytes(segment_bytes)
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=self.limits.threads, thread_name_prefix="l3")
        self._ctx: ActorContext | None = None
        self._store: Store | None = None
        self._catalog = Catalog()
        self._peers = PeerView()
        self._queue: asyncio.Queue[_Capture] | None = None
        self._mutate = asyncio.Lock()
        self._changed = asyncio.Event()
        self._flights: dict[str, _Flight] = {}
        self._fetching = 0

    @property
    def running(self) -> bool:
        return self._ctx is not None

    # ---- L3Access: what the runner calls ----------------------------------------------------------------

    async def lookup(self, identity: str, tokens: Sequence[int], *, max_tokens: int) -> L3Hit | None:
        if self._ctx is None or max_tokens < 1 or not layout.is_digest(identity):
            return None
        probes = self.limits.max_probes
        try:
            local = self._catalog.lookup(identity, tokens, max_tokens=max_tokens, max_probes=probes)
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
            held = self._catalog.get(local.entry)
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
                await self._blocking(_link_into, staged, dest)
            except OSError as exc:
                raise L3Unavailable(f"cannot write {dest}: {exc}") from exc
        finally:
            flight.users -= 1
            await self._release(flight)

    def capture(self, source: Path, *, identity: str, tokens: Sequence[int], payload_kind: str) -> None:
        job = _Capture(source=source, identity=identity, tokens=tuple(tokens), payload_kind=payload_kind)
        if self._ctx is None or self._queue is None:
            self._drop(job, "not_running")
        elif self.budget_bytes == 0:
            self._drop(job, "disabled")
        elif not layout.is_digest(identity):
            self._drop(job, "refused: identity is not a digest")
        else:
            try:
                self._queue.put_nowait(job)
            except asyncio.QueueFull:
                self._drop(job, "queue_full")

    # ---- the incarnation -------------------------------------------------------------------------------

    async def run(self, ctx: ActorContext) -> None:
        self._ctx = None
        store = await self._blocking(Store, self.root, segment_bytes=self._segment_bytes)
        await self._blocking(shutil.rmtree, self.root / _STAGING, True)
        await self._blocking(os.makedirs, self.root / _STAGING, 0o700, True)
        async with self._mutate:
            inventory = await self._blocking(store.reconcile)
            if self._configured_budget is None:
                self.budget_bytes = await self._blocking(self._default_budget, inventory.bytes)
            self._store = store
            self._refill(ctx, inventory)
            await self._enforce(ctx, store)
        kv = await buckets.l3(ctx.bus, ctx.subjects)
        self._queue = asyncio.Queue(maxsize=self.limits.capture_queue)
        self._flights.clear()
        self._fetching = 0
        s, node = ctx.subjects, self.node_id
        await ctx.add_endpoint("manifests", s.l3(node, "manifests"), ManifestsRequest, self._on_manifests)
        await ctx.add_endpoint("manifest", s.l3(node, "manifest"), ManifestRequest, self._on_manifest, workers=2)
        await ctx.add_endpoint(
            "segment", s.l3(node, "segment"), SegmentRequest, self._on_segment, workers=self.limits.segment_workers
        )
        await ctx.add_endpoint("stat", s.l3(node, "stat"), EntryRequest, self._on_stat)
        await ctx.add_endpoint("verify", s.l3(node, "verify"), EntryRequest, self._on_verify)
        await ctx.add_endpoint("gc", s.l3(node, "gc"), GcRequest, self._on_gc)
        await ctx.add_endpoint("evict", s.l3(node, "evict"), EvictRequest, self._on_evict)
        ctx.spawn(self._capture_loop(ctx), "capture")
        ctx.spawn(self._inventory_loop(ctx), "inventory")
        ctx.spawn(self._watch_peers(ctx, kv), "peers")
        self._ctx = ctx
        self._changed.set()
        ctx.log.info(
            "l3_started", entries=len(self._catalog), bytes=self._catalog.stored_bytes, budget=self.budget_bytes
        )

    def _default_budget(self, store_bytes: int) -> int:  # worker thread
        usage = shutil.disk_usage(self.root)
        return default_budget(usage.total, usage.free, store_bytes)

    def _refill(self, ctx: ActorContext, inventory: Inventory) -> None:
        """The catalog from a reconcile pass (known entries keep their last use); quarantines are events."""
        before = self._catalog.last_use()
        catalog = Catalog()
        for e in inventory.entries:
            catalog.add(
                e.entry,
                identity=e.identity,
                n_tokens=e.n_tokens,
                bytes=e.bytes,
                last_use=before.get(e.entry, e.mtime_ns / 1e9),
            )
        catalog.stored_bytes = inventory.bytes
        catalog.quarantined = len(inventory.quarantined)
        self._catalog = catalog
        for q in inventory.quarantined:
            if q.reason != "found in quarantine":  # moved there by this pass
                ctx.emit(L3Quarantined, entry=q.name.split(".", 1)[0], reason=q.reason)

    async def _blocking(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Runs blocking store work in the actor's threads. A thread cannot be stopped: when the caller is
        cancelled, it first waits (bounded) for the work to end, so a lock it holds is not released early."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait({future}, timeout=5.0)
            raise

    # ---- capture -----------------------------------------------------------------------------------------

    def _drop(self, job: _Capture, reason: str) -> None:
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
                    await self._capture_one(ctx, job)
                finally:
                    await self._blocking(_unlink_quietly, job.source)
        finally:
            while not queue.empty():
                self._drop(queue.get_nowait(), "stopping")
            self._ctx = None  # the incarnation is ending: the runner goes cold from here on

    async def _capture_one(self, ctx: ActorContext, job: _Capture) -> None:
        store = self._require_store()
        try:
            entry = layout.entry_id(job.identity, job.tokens)
        except ValueError as exc:
            self._drop(job, f"refused: {exc}")
            return
        if entry in self._catalog:  # the same state again: a use, not a second copy
            self._catalog.touch(entry, self._clock())
            await self._blocking(store.touch, entry)
            self._changed.set()
            return
        try:
            size = (await self._blocking(os.stat, job.source)).st_size
        except OSError as exc:
            self._drop(job, f"io_error: {exc.strerror or exc}")
            return
        if size > self.budget_bytes:
            self._drop(job, f"over_budget: {size} bytes, budget {self.budget_bytes}")
            return
        started = time.monotonic()
        self._catalog.pin(entry)
        try:
            async with self._mutate:
                before = self._catalog.stored_bytes
                manifest = await self._blocking(
                    store.ingest, job.source, identity=job.identity, tokens=job.tokens, payload_kind=job.payload_kind
                )
                ingest_ms = (time.monotonic() - started) * 1000
                self._catalog.add(
                    entry,
                    identity=job.identity,
                    n_tokens=len(job.tokens),
                    bytes=manifest.total_bytes,
                    last_use=self._clock(),
                )
                plan = await self._enforce(ctx, store)
        except CommitRefused as exc:
            self._drop(job, f"refused: {exc.refusal.rule.value}: {exc.refusal.detail}")
            return
        except (StoreError, OSError) as exc:
            self._drop(job, f"io_error: {exc}")
            return
        finally:
            self._catalog.unpin(entry)
        if entry not in self._catalog:  # evicted at once: a budget smaller than pinned entries need
            return
        ctx.emit(
            L3Captured,
            entry=entry,
            identity=job.identity,
            n_tokens=len(job.tokens),
            bytes=manifest.total_bytes,
            new_bytes=max(0, plan.bytes_before - before),
            ingest_ms=round(ingest_ms, 3),
        )

    async def _enforce(self, ctx: ActorContext, store: Store) -> Eviction:
        """One eviction pass (call it holding `_mutate`); the catalog follows, the eviction is an event."""
        plan = await self._blocking(
            store.enforce_budget,
            self.budget_bytes,
            pinned=self._catalog.pinned(),
            last_use=self._catalog.last_use(),
        )
        self._catalog.stored_bytes = plan.bytes_after
        if plan.evict:
            self._catalog.remove(plan.evict)
            ctx.emit(
                L3Evicted,
                entries=plan.evict,
                freed_bytes=plan.bytes_before - plan.bytes_after,
                budget_bytes=self.budget_bytes,
                stored_bytes=plan.bytes_after,
            )
        self._changed.set()
        return plan

    def _require_store(self) -> Store:
        if self._store is None:
            raise L3Unavailable("the node's L3 store is not open")
        return self._store

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
            await self._blocking(_unlink_quietly, staged)

    async def _fill_entry(self, ctx: ActorContext, hit: L3Hit) -> Path:
        store = self._require_store()
        entry = hit.entry
        self._catalog.pin(entry)
        try:
            if entry not in self._catalog:
                if hit.source != "l3_peer" or hit.node == self.node_id:
                    raise L3Unavailable(f"entry {entry[:16]}… is no longer stored")
                await self._fetch(ctx, store, hit)
            try:
                manifest = await self._blocking(store.load_manifest, entry)
                staged = self.root / _STAGING / layout.temp_name(entry, secrets.token_hex(8))
                await self._blocking(store.assemble, manifest, staged)
            except CorruptEntry as exc:
                self._forget(ctx, entry, quarantined=f"{exc.refusal.rule.value}: {exc.refusal.detail}")
                raise L3Unavailable(str(exc)) from exc
            except UnknownEntry as exc:
                self._forget(ctx, entry)
                raise L3Unavailable(f"entry {entry[:16]}… is no longer stored") from exc
            except StoreError as exc:  # an unreadable manifest: reconcile (the next start, or gc) quarantines it
                raise L3Unavailable(str(exc)) from exc
            self._catalog.touch(entry, self._clock())
            await self._blocking(store.touch, entry)
            self._changed.set()
            return staged
        finally:
            self._catalog.unpin(entry)

    def _forget(self, ctx: ActorContext, entry: str, *, quarantined: str | None = None) -> None:
        self._catalog.remove([entry])
        if quarantined is not None:
            self._catalog.quarantined += 1
            ctx.emit(L3Quarantined, entry=entry, reason=quarantined[:200])
        self._changed.set()

    # ---- peer fetch (the fetching side) ------------------------------------------------------------------

    def _chunk_bytes(self, ctx: ActorContext) -> int:
        return max(layout.MIN_SEGMENT_BYTES, ctx.bus.max_payload - _HEADER_ROOM)

    async def _fetch(self, ctx: ActorContext, store: Store, hit: L3Hit) -> None:
        """Brings `hit` from its peer into this store: the manifest, then every segment not held here,
        each verified as it arrives; committed with the manifest last. Leaves nothing loadable on failure."""
        if hit.bytes > self.budget_bytes:
            raise L3Unavailable(f"entry of {hit.bytes} bytes does not fit this node's L3 budget")
        started = time.monotonic()
        peer = hit.node
        receivers: dict[str, SegmentReceiver] = {}
        self._fetching += 1
        try:
            raw = await self._fetch_chunks(
                ctx,
                ctx.subjects.l3(peer, "manifest"),
                lambda offset: ManifestRequest(entry=hit.entry, offset=offset),
                layout.MAX_MANIFEST_BYTES,
            )
            manifest = _peer_manifest(raw, hit.entry)
            wanted: dict[str, SegmentRef] = {}
            for seg in manifest.segments:
                if seg.digest not in wanted and not await self._blocking(store.has_segment, seg.digest, seg.length):
                    wanted[seg.digest] = seg
            for digest, seg in wanted.items():
                receiver = await self._blocking(store.receive_segment, digest, seg.length)
                receivers[digest] = receiver
                await self._fetch_segment(ctx, peer, seg, receiver)
                await self._blocking(receiver.finish)
            self._catalog.pin(hit.entry)
            try:
                async with self._mutate:
                    await self._blocking(store.commit_fetched, manifest, receivers)
                    self._catalog.add(
                        hit.entry,
                        identity=manifest.identity,
                        n_tokens=manifest.n_tokens,
                        bytes=manifest.total_bytes,
                        last_use=self._clock(),
                    )
                    await self._enforce(ctx, store)
            finally:
                self._catalog.unpin(hit.entry)
        except CommitRefused as exc:
            raise L3Unavailable(f"the entry from {peer} was refused: {exc}") from exc
        finally:
            for receiver in receivers.values():
                await self._blocking(receiver.abort)
            self._fetching -= 1
        moved = sum(r.received for r in receivers.values())
        fetch_ms = round((time.monotonic() - started) * 1000, 3)
        ctx.emit(
            L3Fetched, entry=hit.entry, peer=peer, bytes=manifest.total_bytes, moved_bytes=moved, fetch_ms=fetch_ms
        )
        ctx.log.info("l3_fetched", entry=hit.entry, peer=peer, bytes=manifest.total_bytes, moved_bytes=moved)

    async def _request_chunk(self, ctx: ActorContext, subject: str, request: Any) -> Msg | BaseException:
        try:
            return await ctx.bus.request_raw(subject, encode(request), timeout=self.limits.chunk_timeout_s)
        except (BusError, nats.errors.Error) as exc:
            return exc

    async def _fetch_chunks(self, ctx: ActorContext, subject: str, make: Callable[[int], Any], ceiling: int) -> bytes:
        """A whole object fetched chunk after chunk (a manifest: small, so one request at a time)."""
        parts: list[bytes] = []
        offset, total = 0, None
        while total is None or offset < total:
            reply = await self._request_chunk(ctx, subject, make(offset))
            data, total = _chunk(subject, reply, offset, total, ceiling)
            parts.append(data)
            offset += len(data)
        return b"".join(parts)

    async def _fetch_segment(self, ctx: ActorContext, peer: str, seg: SegmentRef, receiver: SegmentReceiver) -> None:
        """One segment, `fetch_window` chunk requests in flight, written and hashed in order."""
        subject = ctx.subjects.l3(peer, "segment")
        chunk = self._chunk_bytes(ctx)
        offsets = iter(range(0, seg.length, chunk))

        def request(offset: int) -> SegmentRequest:
            return SegmentRequest(digest=seg.digest, offset=offset, length=min(chunk, seg.length - offset))

        try:
            async with asyncio.TaskGroup() as tg:
                pending: deque[tuple[int, asyncio.Task[Msg | BaseException]]] = deque()

                def ask(offset: int) -> None:
                    pending.append((offset, tg.create_task(self._request_chunk(ctx, subject, request(offset)))))

                for offset in itertools.islice(offsets, self.limits.fetch_window):
                    ask(offset)
                while pending:
                    offset, task = pending.popleft()
                    data, _ = _chunk(subject, await task, offset, seg.length, seg.length)
                    if len(data) != min(chunk, seg.length - offset):
                        raise L3Unavailable(f"{subject}: short chunk at {offset}")
                    await self._blocking(receiver.write, data)
                    following = next(offsets, None)
                    if following is not None:
                        ask(following)
        except BaseExceptionGroup as group:
            raise _first(group) from None

    # ---- peer fetch (the serving side) and administration --------------------------------------------------

    async def _on_manifests(self, request: ManifestsRequest) -> ManifestList:
        listed = [e for e in self._catalog.entries() if request.identity in (None, e.identity)]
        inventory = self._catalog.inventory(self.node_id, budget_bytes=0, max_items=len(listed), sent_at=0)
        items = tuple(i for i in inventory.items if request.identity in (None, i.identity))
        return ManifestList(node_id=self.node_id, items=items[: request.limit], truncated=len(items) > request.limit)

    async def _on_manifest(self, request: ManifestRequest) -> RawReply:
        entry = _checked(request.entry, "entry")
        if entry not in self._catalog:
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds no entry {entry}")
        try:
            data = await self._blocking(self._require_store().manifest_bytes, entry)
        except UnknownEntry as exc:
            raise RequestError(NOT_FOUND, str(exc)) from exc
        if request.offset > len(data):
            raise RequestError(BAD_REQUEST, f"offset {request.offset} is past the manifest's {len(data)} bytes")
        assert self._ctx is not None
        part = data[request.offset : request.offset + self._chunk_bytes(self._ctx)]
        return RawReply(part, {CHUNK_OFFSET_HEADER: str(request.offset), CHUNK_TOTAL_HEADER: str(len(data))})

    async def _on_segment(self, request: SegmentRequest) -> RawReply:
        digest = _checked(request.digest, "digest")
        assert self._ctx is not None
        length = min(request.length, self._chunk_bytes(self._ctx))
        try:
            data, total = await self._blocking(self._require_store().read_chunk, digest, request.offset, length)
        except UnknownEntry as exc:
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds no segment {digest}") from exc
        if request.offset >= total:
            raise RequestError(BAD_REQUEST, f"offset {request.offset} is past the segment's {total} bytes")
        return RawReply(data, {CHUNK_OFFSET_HEADER: str(request.offset), CHUNK_TOTAL_HEADER: str(total)})

    async def _on_stat(self, request: EntryRequest) -> EntryStat:
        entry = _checked(request.entry, "entry")
        held = self._catalog.get(entry)
        if held is None:
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds no entry {entry}")
        try:
            manifest = await self._blocking(self._require_store().load_manifest, entry)
        except StoreError as exc:
            raise RequestError(NOT_FOUND, str(exc)) from exc
        return EntryStat(
            node_id=self.node_id,
            entry=entry,
            identity=manifest.identity,
            n_tokens=manifest.n_tokens,
            bytes=manifest.total_bytes,
            payload_kind=manifest.payload_kind,
            payload_digest=manifest.payload_digest,
            segments=len(manifest.segments),
            last_use=held.last_use,
            pinned=entry in self._catalog.pinned(),
        )

    async def _on_verify(self, request: EntryRequest) -> VerifyReply:
        entry = _checked(request.entry, "entry")
        ctx = self._ctx
        assert ctx is not None
        if entry not in self._catalog:
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds no entry {entry}")
        store = self._require_store()
        self._catalog.pin(entry)
        try:
            manifest = await self._blocking(store.load_manifest, entry)
            await self._blocking(store.verify, manifest)
        except CorruptEntry as exc:
            self._forget(ctx, entry, quarantined=f"{exc.refusal.rule.value}: {exc.refusal.detail}")
            return VerifyReply(node_id=self.node_id, entry=entry, ok=False, detail=str(exc))
        except StoreError as exc:
            return VerifyReply(node_id=self.node_id, entry=entry, ok=False, detail=str(exc))
        finally:
            self._catalog.unpin(entry)
        return VerifyReply(node_id=self.node_id, entry=entry, ok=True)

    async def _on_gc(self, request: GcRequest) -> GcReply:
        ctx = self._ctx
        assert ctx is not None
        if self._fetching or self._flights or self._catalog.pinned():
            raise RequestError(BUSY, f"node {self.node_id}'s L3 is fetching or restoring; retry")
        store = self._require_store()
        async with self._mutate:
            inventory = await self._blocking(store.reconcile)
            self._refill(ctx, inventory)
        self._changed.set()
        moved = tuple(q.name for q in inventory.quarantined if q.reason != "found in quarantine")
        return GcReply(
            node_id=self.node_id,
            entries=len(inventory.entries),
            bytes=inventory.bytes,
            removed_temp=inventory.removed_temp,
            removed_orphans=inventory.removed_orphans,
            quarantined=moved,
            gc_suspended=inventory.gc_suspended,
        )

    async def _on_evict(self, request: EvictRequest) -> EvictReply:
        ctx = self._ctx
        assert ctx is not None
        if (request.entry is None) == (not request.all):
            raise RequestError(BAD_REQUEST, "name one entry, or ask for all", {"path": "$.entry"})
        store = self._require_store()
        async with self._mutate:
            if request.entry is not None:
                wanted = [_checked(request.entry, "entry")]
                if wanted[0] not in self._catalog:
                    raise RequestError(NOT_FOUND, f"node {self.node_id} holds no entry {wanted[0]}")
            else:
                wanted = [e.entry for e in self._catalog.entries()]
            pinned = self._catalog.pinned()
            chosen = tuple(e for e in wanted if e not in pinned)
            before = self._catalog.stored_bytes
            await self._blocking(store.remove_entries, chosen)
            self._catalog.remove(chosen)
            plan = await self._enforce(ctx, store)  # frees the segments nothing names now
            if chosen:
                ctx.emit(
                    L3Evicted,
                    entries=chosen,
                    freed_bytes=max(0, before - plan.bytes_after),
                    budget_bytes=self.budget_bytes,
                    stored_bytes=plan.bytes_after,
                )
        return EvictReply(
            node_id=self.node_id,
            evicted=chosen + plan.evict,
            freed_bytes=max(0, before - plan.bytes_after),
            pinned=tuple(e for e in wanted if e in pinned),
        )

    # ---- inventory ---------------------------------------------------------------------------------------

    async def _inventory_loop(self, ctx: ActorContext) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.limits.inventory_refresh_s):
                    await self._changed.wait()
            if self._changed.is_set():
                await asyncio.sleep(self.limits.inventory_debounce_s)  # let a burst of changes settle
            self._changed.clear()
            await self._publish(ctx)

    def inventory(self) -> L3Inventory:
        """What this node publishes now."""
        max_items = items_within(self._ctx.bus.max_payload if self._ctx else 1 << 20)
        return self._catalog.inventory(
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


def _checked(value: str, what: str) -> str:
    try:
        return layout.check_digest(value, what)
    except layout.DigestError as exc:
        raise RequestError(BAD_REQUEST, str(exc), {"path": f"$.{what}"}) from exc


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first error inside (nested) exception groups."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _chunk(subject: str, reply: Msg | BaseException, offset: int, total: int | None, ceiling: int) -> tuple[bytes, int]:
    """The data of one chunk reply and the object's total size, checked: no error, the offset asked for,
    a total that stays what it was and under `ceiling`, no bytes past the total."""
    if isinstance(reply, BaseException):
        raise L3Unavailable(f"{subject}: {reply}")
    headers = reply.headers or {}
    if ERROR_HEADER in headers or MESH_ERROR_HEADER in headers:
        try:
            parse_reply(subject, reply, bytes)
        except BusError as exc:
            raise L3Unavailable(str(exc)) from exc
    try:
        got_offset = int(headers[CHUNK_OFFSET_HEADER])
        got_total = int(headers[CHUNK_TOTAL_HEADER])
    except (KeyError, ValueError) as exc:
        raise L3Unavailable(f"{subject}: a chunk reply without its {CHUNK_OFFSET_HEADER}/{CHUNK_TOTAL_HEADER}") from exc
    if got_offset != offset or (total is not None and got_total != total) or not 0 < got_total <= ceiling:
        raise L3Unavailable(f"{subject}: chunk at {got_offset} of {got_total}, expected {offset} of {total}")
    data = reply.data
    if not data or offset + len(data) > got_total:
        raise L3Unavailable(f"{subject}: a chunk of {len(data)} bytes at {offset} does not fit {got_total}")
    return data, got_total


def _peer_manifest(raw: bytes, entry: str) -> Manifest:
    """A manifest a peer sent, judged by the same rules as our own: format, tiling, and filed under its name."""
    try:
        manifest = layout.decode_manifest(raw)
    except msgspec.MsgspecError as exc:
        raise L3Unavailable(f"the peer's manifest does not parse: {exc}") from exc
    refusal = check_manifest(manifest)
    if refusal is not None:
        raise L3Unavailable(f"the peer's manifest is refused ({refusal.rule.value}): {refusal.detail}")
    if layout.entry_id(manifest.identity, manifest.tokens) != entry:
        raise L3Unavailable("the peer's manifest belongs to another entry")
    return manifest


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
