"""The L3 actor's endpoints: what peers and `mesh-actor l3` ask of a node's store.

* Peer fetch, the serving side: `mesh.l3.<node>.manifests` (the entries held, as a listing),
  `.manifest` and `.segment` (one chunk of the stored manifest or of a segment per request, raw bytes with
  `CHUNK_OFFSET_HEADER`/`CHUNK_TOTAL_HEADER`, each at most `peer.chunk_bytes` of the bus's `max_payload`:
  see messages/l3.py). Only entries in the entry index are served; the bytes are read as stored, the fetching
  side checks them (`peer`).
* The direct data path, the serving side: `.offer` (`SegmentOfferRequest` -> `DirectOffer`): a one-shot ticket
  for this node's data listener, which then sends the whole segment as frames, each chunk read from the store
  and hashed (runtime/datapath.py); without a listener it is `unavailable` and the fetcher asks `.segment`.
* Administration: `.stat` (an entry's manifest and use), `.verify` (re-hash it; a corrupt entry is
  quarantined), `.gc` (a reconcile pass, refused while a fetch or restore runs; with `quarantine`, every
  quarantined manifest is deleted first, which is what unblocks an eviction an unreadable one blocked) and
  `.evict` (one entry or all but the pinned, then an eviction pass). Mutations take the keeper's lock, like every other.

Requests are checked at the edge: a digest that does not parse is `BAD_REQUEST`, an entry not held
`NOT_FOUND`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import blake3

from actors.l3 import layout, store_fetch
from actors.l3.keeper import StoreKeeper
from actors.l3.peer import chunk_bytes
from actors.l3.store import CorruptEntry, Store, StoreError, UnknownEntry
from messages.datapath import DirectOffer
from messages.errors import BAD_REQUEST, BUSY, NOT_FOUND, UNAVAILABLE
from messages.events import L3Evicted
from messages.l3 import (
    CHUNK_OFFSET_HEADER,
    CHUNK_TOTAL_HEADER,
    EntryRequest,
    EntryStat,
    EvictReply,
    EvictRequest,
    GcReply,
    GcRequest,
    ManifestList,
    ManifestRequest,
    ManifestsRequest,
    SegmentOfferRequest,
    SegmentRequest,
    VerifyReply,
)
from runtime.actor import ActorContext, RawReply, RequestError
from runtime.datapath import ChunkReader, DataListener, DataPathConfig, send_range
from runtime.tickets import Grant, TicketRefusal

__all__ = ["L3Endpoints"]


class L3Endpoints:
    """The handlers, bound to one keeper; `add_to` registers them for an incarnation."""

    def __init__(
        self,
        keeper: StoreKeeper,
        node_id: str,
        *,
        busy: Callable[[], bool],
        datapath: DataPathConfig | None = None,
    ) -> None:
        """`busy`: whether a fetch or restore is running, or an entry is pinned (gc then refuses). `datapath`:
        this node's data listener's place and certificates (None: segments are served over NATS only)."""
        self._keeper = keeper
        self.node_id = node_id
        self._busy = busy
        self._ctx: ActorContext | None = None
        self._datapath = datapath
        self.listener: DataListener | None = None  # this incarnation's data listener, while it runs

    async def add_to(self, ctx: ActorContext, *, segment_workers: int) -> None:
        self._ctx = ctx
        s, node = ctx.subjects, self.node_id
        await ctx.add_endpoint("manifests", s.l3(node, "manifests"), ManifestsRequest, self._on_manifests)
        await ctx.add_endpoint("manifest", s.l3(node, "manifest"), ManifestRequest, self._on_manifest, workers=2)
        await ctx.add_endpoint(
            "segment", s.l3(node, "segment"), SegmentRequest, self._on_segment, workers=segment_workers
        )
        if self._datapath is not None:
            listener = DataListener(node, self._datapath)
            await listener.start()
            self.listener = listener
            ctx.spawn(self._keep_listener(listener), "data-listener")
        await ctx.add_endpoint("offer", s.l3(node, "offer"), SegmentOfferRequest, self._on_offer, workers=2)
        await ctx.add_endpoint("stat", s.l3(node, "stat"), EntryRequest, self._on_stat)
        await ctx.add_endpoint("verify", s.l3(node, "verify"), EntryRequest, self._on_verify)
        await ctx.add_endpoint("gc", s.l3(node, "gc"), GcRequest, self._on_gc)
        await ctx.add_endpoint("evict", s.l3(node, "evict"), EvictRequest, self._on_evict)

    async def _on_manifests(self, request: ManifestsRequest) -> ManifestList:
        listed = [e for e in self._keeper.entry_index.entries() if request.identity in (None, e.identity)]
        inventory = self._keeper.entry_index.inventory(self.node_id, budget_bytes=0, max_items=len(listed), sent_at=0)
        items = tuple(i for i in inventory.items if request.identity in (None, i.identity))
        return ManifestList(node_id=self.node_id, items=items[: request.limit], truncated=len(items) > request.limit)

    async def _on_manifest(self, request: ManifestRequest) -> RawReply:
        entry = _checked(request.entry, "entry")
        if entry not in self._keeper.entry_index:
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds no entry {entry}")
        try:
            data = await self._keeper.blocking(store_fetch.manifest_bytes, self._keeper.require_store(), entry)
        except UnknownEntry as exc:
            raise RequestError(NOT_FOUND, str(exc)) from exc
        if request.offset > len(data):
            raise RequestError(BAD_REQUEST, f"offset {request.offset} is past the manifest's {len(data)} bytes")
        assert self._ctx is not None
        part = data[request.offset : request.offset + chunk_bytes(self._ctx.bus.max_payload)]
        return RawReply(part, {CHUNK_OFFSET_HEADER: str(request.offset), CHUNK_TOTAL_HEADER: str(len(data))})

    async def _on_segment(self, request: SegmentRequest) -> RawReply:
        digest = _checked(request.digest, "digest")
        assert self._ctx is not None
        length = min(request.length, chunk_bytes(self._ctx.bus.max_payload))
        try:
            data, total = await self._keeper.blocking(
                store_fetch.read_chunk, self._keeper.require_store(), digest, request.offset, length
            )
        except UnknownEntry as exc:
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds no segment {digest}") from exc
        if request.offset >= total:
            raise RequestError(BAD_REQUEST, f"offset {request.offset} is past the segment's {total} bytes")
        return RawReply(data, {CHUNK_OFFSET_HEADER: str(request.offset), CHUNK_TOTAL_HEADER: str(total)})

    async def _keep_listener(self, listener: DataListener) -> None:
        try:
            await asyncio.Event().wait()  # lives as long as the incarnation
        finally:
            if self.listener is listener:
                self.listener = None
            await listener.close()

    async def _on_offer(self, request: SegmentOfferRequest) -> DirectOffer:
        """A one-shot ticket for the whole stored segment, sent by the listener chunk by chunk (each read from the
        store and hashed as it goes: the fetcher checks every chunk, then the segment's digest)."""
        digest = _checked(request.digest, "digest")
        listener = self.listener
        if listener is None:
            raise RequestError(UNAVAILABLE, f"node {self.node_id} has no direct data path; use .segment")
        store = self._keeper.require_store()
        if not await self._keeper.blocking(store_fetch.has_segment, store, digest, request.length):
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds no segment {digest} of {request.length} bytes")
        limits = listener.limits
        read = _segment_reader(store, digest)

        async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, grant: Grant[Any]) -> None:
            await send_range(writer, grant, read, limits)

        offer = listener.offer(
            send, receiver=request.receiver, digest=digest, offset=0, length=request.length, chunk=request.chunk
        )
        if isinstance(offer, TicketRefusal):
            raise RequestError(BUSY, str(offer), {"reason": offer.reason.value})
        return offer

    async def _on_stat(self, request: EntryRequest) -> EntryStat:
        entry = _checked(request.entry, "entry")
        held = self._keeper.entry_index.get(entry)
        if held is None:
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds no entry {entry}")
        try:
            manifest = await self._keeper.blocking(self._keeper.require_store().load_manifest, entry)
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
            pinned=entry in self._keeper.entry_index.pinned(),
        )

    async def _on_verify(self, request: EntryRequest) -> VerifyReply:
        entry = _checked(request.entry, "entry")
        ctx = self._ctx
        assert ctx is not None
        if entry not in self._keeper.entry_index:
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds no entry {entry}")
        store = self._keeper.require_store()
        self._keeper.entry_index.pin(entry)
        try:
            manifest = await self._keeper.blocking(store.load_manifest, entry)
            await self._keeper.blocking(store.verify, manifest)
        except CorruptEntry as exc:
            self._keeper.forget(ctx, entry, quarantined=f"{exc.refusal.rule.value}: {exc.refusal.detail}")
            return VerifyReply(node_id=self.node_id, entry=entry, ok=False, detail=str(exc))
        except StoreError as exc:
            return VerifyReply(node_id=self.node_id, entry=entry, ok=False, detail=str(exc))
        finally:
            self._keeper.entry_index.unpin(entry)
        return VerifyReply(node_id=self.node_id, entry=entry, ok=True)

    async def _on_gc(self, request: GcRequest) -> GcReply:
        ctx = self._ctx
        assert ctx is not None
        if self._busy():
            raise RequestError(BUSY, f"node {self.node_id}'s L3 is fetching or restoring; retry")
        store = self._keeper.require_store()
        reclaimed = 0
        async with self._keeper.mutate:
            if self._busy():  # a restore may have started while this waited for the lock
                raise RequestError(BUSY, f"node {self.node_id}'s L3 is fetching or restoring; retry")
            if request.quarantine:
                reclaimed, _ = await self._keeper.blocking(store.clear_quarantine)
            inventory = await self._keeper.blocking(store.reconcile)
            self._keeper.refill(ctx, inventory)
            await self._keeper.enforce(ctx, store)  # what the reclaim unblocked
        self._keeper.changed.set()
        moved = tuple(q.name for q in inventory.quarantined if q.reason != "found in quarantine")
        return GcReply(
            node_id=self.node_id,
            entries=len(inventory.entries),
            bytes=inventory.bytes,
            removed_temp=inventory.removed_temp,
            removed_orphans=inventory.removed_orphans,
            quarantined=moved,
            gc_suspended=inventory.gc_suspended,
            reclaimed_quarantine=reclaimed,
        )

    async def _on_evict(self, request: EvictRequest) -> EvictReply:
        ctx = self._ctx
        assert ctx is not None
        if (request.entry is None) == (not request.all):
            raise RequestError(BAD_REQUEST, "name one entry, or ask for all", {"path": "$.entry"})
        store = self._keeper.require_store()
        async with self._keeper.mutate:
            if request.entry is not None:
                wanted = [_checked(request.entry, "entry")]
                if wanted[0] not in self._keeper.entry_index:
                    raise RequestError(NOT_FOUND, f"node {self.node_id} holds no entry {wanted[0]}")
            else:
                wanted = [e.entry for e in self._keeper.entry_index.entries()]
            pinned = self._keeper.entry_index.pinned()
            chosen = tuple(e for e in wanted if e not in pinned)
            before = self._keeper.entry_index.stored_bytes
            await self._keeper.blocking(store.remove_entries, chosen)
            self._keeper.entry_index.remove(chosen)
            plan = await self._keeper.enforce(ctx, store)  # frees the segments nothing names now
            if chosen:
                ctx.emit(
                    L3Evicted,
                    entries=chosen,
                    freed_bytes=max(0, before - plan.bytes_after),
                    budget_bytes=self._keeper.budget_bytes,
                    stored_bytes=plan.bytes_after,
                )
        return EvictReply(
            node_id=self.node_id,
            evicted=chosen + plan.evict,
            freed_bytes=max(0, before - plan.bytes_after),
            pinned=tuple(e for e in wanted if e in pinned),
        )


def _segment_reader(store: Store, digest: str) -> ChunkReader:
    """Chunks of a stored segment and their blake3 (the listener's worker threads)."""

    def read(offset: int, length: int) -> tuple[bytes, bytes]:
        data, _ = store_fetch.read_chunk(store, digest, offset, length)
        return data, blake3.blake3(data).digest()

    return read


def _checked(value: str, what: str) -> str:
    try:
        return layout.check_digest(value, what)
    except layout.DigestError as exc:
        raise RequestError(BAD_REQUEST, str(exc), {"path": f"$.{what}"}) from exc
