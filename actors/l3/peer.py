"""Peer fetch, the fetching side: bringing an entry another node holds into this node's store.

The manifest first (chunk after chunk: it is small), judged by the same rules as our own (`commit`) and
filed under the entry asked for, and its own size (not the one the peer's inventory claimed) held against
this node's budget and what the store can still take; then every segment this store lacks, `fetch_window`
chunk requests in flight per segment, each chunk checked (no error, the offset asked for, a total that
stays what it was and under its ceiling, no bytes past it) and hashed as it arrives
(`store_fetch.SegmentReceiver`); last the commit with the manifest (`store_fetch.commit_fetched`) under the
keeper's lock, then one eviction pass. So a second fetch of the same entry moves nothing, a failure leaves
nothing loadable, and a stalled peer delays only the fetch from it: every chunk request has a deadline
(`chunk_timeout_s`). With a data path, each segment is first asked on the direct stream (a ticket from
`.offer`, the segment's chunks in frames, each checked against its blake3 as it lands, then the segment's own
digest at `finish`); a stream that cannot be opened or breaks off leaves that segment to the chunk requests, from
its first byte. The event says which path the segments took. The serving side is `serve`; the wire format is
messages/l3.py and messages/datapath.py.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import msgspec
import nats.errors
from nats.aio.msg import Msg

from actors.l3 import layout, store_fetch
from actors.l3.api import L3Hit, L3Unavailable
from actors.l3.commit import check_manifest
from actors.l3.keeper import StoreKeeper
from actors.l3.layout import Manifest, SegmentRef
from actors.l3.store import CommitRefused, Store
from actors.l3.store_fetch import SegmentReceiver
from messages.datapath import DirectOffer
from messages.errors import ERROR_HEADER, MESH_ERROR_HEADER
from messages.events import L3Fetched
from messages.l3 import CHUNK_OFFSET_HEADER, CHUNK_TOTAL_HEADER, ManifestRequest, SegmentOfferRequest, SegmentRequest
from runtime import tracing
from runtime.actor import ActorContext
from runtime.bus import BusError, encode, parse_reply
from runtime.datapath import DataFailed, DataPathConfig, DataUnavailable, fetch_range

__all__ = ["PeerFetch", "chunk_bytes"]

#: Room left in a chunk reply for its headers (ours and the server's).
_HEADER_ROOM: Final = 4096


def chunk_bytes(max_payload: int) -> int:
    """The most bytes one chunk reply carries on a bus with this `max_payload` (both sides use it)."""
    return max(layout.MIN_SEGMENT_BYTES, max_payload - _HEADER_ROOM)


class PeerFetch:
    """Fetches entries from peers into the keeper's store (one `fetch` per fill; any number at once)."""

    def __init__(
        self,
        keeper: StoreKeeper,
        *,
        chunk_timeout_s: float,
        window: int,
        clock: Callable[[], float],
        datapath: DataPathConfig | None = None,
    ) -> None:
        """`datapath`: this node's certificates and the direct path's limits (None: every segment over NATS)."""
        self._keeper = keeper
        self._chunk_timeout_s = chunk_timeout_s
        self._window = window
        self._clock = clock
        self._datapath = datapath

    async def fetch(self, ctx: ActorContext, store: Store, hit: L3Hit) -> None:
        """Brings `hit` from its peer into this store: the manifest, then every segment not held here,
        each verified as it arrives; committed with the manifest last. Leaves nothing loadable on failure.
        A hop of the trace of the request that asked for it (its chunk requests carry that trace to the peer)."""
        with tracing.hop("l3 fetch", kind="client") as span:
            span.update({"mesh.node": ctx.node_id, "mesh.l3.entry": hit.entry, "mesh.l3.peer": hit.node,
                         "mesh.l3.bytes": hit.bytes, "mesh.tokens": hit.n_tokens})  # fmt: skip
            await self._fetch(ctx, store, hit)

    async def _fetch(self, ctx: ActorContext, store: Store, hit: L3Hit) -> None:
        keeper = self._keeper
        if hit.bytes > keeper.budget_bytes:
            raise L3Unavailable(f"entry of {hit.bytes} bytes does not fit this node's L3 budget")
        started = time.monotonic()
        peer = hit.node
        receivers: dict[str, SegmentReceiver] = {}
        paths: set[str] = set()
        keeper.fetching += 1
        try:
            raw = await self._fetch_chunks(
                ctx,
                ctx.subjects.l3(peer, "manifest"),
                lambda offset: ManifestRequest(entry=hit.entry, offset=offset),
                layout.MAX_MANIFEST_BYTES,
            )
            manifest = _peer_manifest(raw, hit.entry)
            # The inventory's size was the peer's word; the manifest's is what would be stored.
            if manifest.total_bytes > keeper.budget_bytes:
                raise L3Unavailable(
                    f"the entry is {manifest.total_bytes} bytes (its peer claimed {hit.bytes}): more than this "
                    f"node's L3 budget of {keeper.budget_bytes}"
                )
            if not keeper.room_for(manifest.total_bytes):
                raise L3Unavailable("this node's L3 eviction is blocked by an unreadable quarantined manifest")
            wanted: dict[str, SegmentRef] = {}
            for seg in manifest.segments:
                if seg.digest not in wanted and not await keeper.blocking(
                    store_fetch.has_segment, store, seg.digest, seg.length
                ):
                    wanted[seg.digest] = seg
            for digest, seg in wanted.items():
                receiver = await keeper.blocking(store_fetch.receive_segment, store, digest, seg.length)
                receivers[digest] = receiver
                path = await self._fetch_direct(ctx, peer, seg, receiver)
                if path is None:
                    if receiver.received:  # a stream that broke off: the segment again, from its first byte
                        await keeper.blocking(receiver.abort)
                        receiver = await keeper.blocking(store_fetch.receive_segment, store, digest, seg.length)
                        receivers[digest] = receiver
                    await self._fetch_segment(ctx, peer, seg, receiver)
                    path = "nats"
                paths.add(path)
                await keeper.blocking(receiver.finish)
            keeper.entry_index.pin(hit.entry)
            try:
                async with keeper.mutate:
                    try:
                        await keeper.blocking(store_fetch.commit_fetched, store, manifest, receivers)
                    except BaseException:  # segments may have landed without their manifest
                        keeper.unsure = True
                        raise
                    keeper.entry_index.add(
                        hit.entry,
                        identity=manifest.identity,
                        n_tokens=manifest.n_tokens,
                        bytes=manifest.total_bytes,
                        last_use=self._clock(),
                        segments=[(seg.digest, seg.length) for seg in manifest.segments],
                    )
                    await keeper.enforce(ctx, store)
            finally:
                keeper.entry_index.unpin(hit.entry)
        except CommitRefused as exc:
            raise L3Unavailable(f"the entry from {peer} was refused: {exc}") from exc
        finally:
            for receiver in receivers.values():
                await keeper.blocking(receiver.abort)
            keeper.fetching -= 1
        moved = sum(r.received for r in receivers.values())
        fetch_ms = round((time.monotonic() - started) * 1000, 3)
        transport = "+".join(sorted(paths)) or "nats"
        ctx.emit(
            L3Fetched,
            entry=hit.entry,
            peer=peer,
            bytes=manifest.total_bytes,
            moved_bytes=moved,
            fetch_ms=fetch_ms,
            transport=transport,
        )
        ctx.log.info(
            "l3_fetched", entry=hit.entry, peer=peer, bytes=manifest.total_bytes, moved_bytes=moved, transport=transport
        )

    async def _fetch_direct(
        self, ctx: ActorContext, peer: str, seg: SegmentRef, receiver: SegmentReceiver
    ) -> str | None:
        """The whole segment over the direct stream (a ticket asked on `.offer`), each chunk checked against its
        blake3 as it lands and written; the path it took, or None when NATS must carry it (the stream could not
        be opened, or broke off: what it wrote is the caller's to discard)."""
        if self._datapath is None:
            return None
        chunk = min(self._datapath.limits.max_chunk_bytes, 4 << 20, seg.length) if seg.length >= 4096 else 4096
        request = SegmentOfferRequest(digest=seg.digest, length=seg.length, chunk=chunk, receiver=ctx.node_id)
        try:
            offer = await ctx.bus.request(
                ctx.subjects.l3(peer, "offer"), request, DirectOffer, timeout=self._chunk_timeout_s
            )
        except (BusError, nats.errors.Error) as exc:
            ctx.log.debug("l3_direct_unavailable", peer=peer, error=str(exc))
            return None

        def sink(offset: int, data: memoryview, digest: str) -> None:  # the receiving thread
            receiver.write(data)

        try:
            await fetch_range(
                offer,
                receiver=ctx.node_id,
                digest=seg.digest,
                offset=0,
                length=seg.length,
                chunk=chunk,
                sink=sink,
                tls=self._datapath.tls,
                limits=self._datapath.limits,
                deadline_s=max(self._chunk_timeout_s, seg.length / self._datapath.limits.min_rate_bytes_per_s),
            )
        except (DataUnavailable, DataFailed) as exc:
            ctx.log.info("l3_direct_failed", peer=peer, segment=seg.digest[:16], error=str(exc))
            return None
        return "direct_tls" if offer.tls else "direct"

    async def _request_chunk(self, ctx: ActorContext, subject: str, request: Any) -> Msg | BaseException:
        try:
            return await ctx.bus.request_raw(subject, encode(request), timeout=self._chunk_timeout_s)
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
        chunk = chunk_bytes(ctx.bus.max_payload)
        offsets = iter(range(0, seg.length, chunk))

        def request(offset: int) -> SegmentRequest:
            return SegmentRequest(digest=seg.digest, offset=offset, length=min(chunk, seg.length - offset))

        try:
            async with asyncio.TaskGroup() as tg:
                pending: deque[tuple[int, asyncio.Task[Msg | BaseException]]] = deque()

                def ask(offset: int) -> None:
                    pending.append((offset, tg.create_task(self._request_chunk(ctx, subject, request(offset)))))

                for offset in itertools.islice(offsets, self._window):
                    ask(offset)
                while pending:
                    offset, task = pending.popleft()
                    data, _ = _chunk(subject, await task, offset, seg.length, seg.length)
                    if len(data) != min(chunk, seg.length - offset):
                        raise L3Unavailable(f"{subject}: short chunk at {offset}")
                    await self._keeper.blocking(receiver.write, data)
                    following = next(offsets, None)
                    if following is not None:
                        ask(following)
        except BaseExceptionGroup as group:
            raise _first(group) from None


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
