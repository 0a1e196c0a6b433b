"""The store's side of peer fetch: serving a stored entry to a peer and committing one fetched from a peer.

Blocking file I/O, like `store`: call from worker threads. Serving reads what is stored (`manifest_bytes`,
`read_chunk`, bounded by the caller's length) and decides nothing. Receiving keeps the store's rule that
only a manifest makes an entry loadable: each segment arriving from a peer is hashed and written to a
temporary file in `incoming/` (`SegmentReceiver`; the actor's next start clears what a crash left, while
`reconcile`, which gc runs beside fetches, never touches it), and lands under its digest only in
`commit_fetched`, together with the manifest, after the same commit check as an ingest. So
nothing fetched is loadable, or even named, before every byte was verified, and a segment already stored
here is not fetched again (`has_segment`).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping

import blake3
import structlog

from actors.l3 import layout
from actors.l3.commit import ManifestRefusal, Rule, check_manifest, validate
from actors.l3.files import (
    OPEN_CREATE,
    fsync_dir,
    intact,
    make_dir,
    read_small,
    unlink_quietly,
    write_atomic,
)
from actors.l3.layout import Manifest, SegmentRef
from actors.l3.store import CommitRefused, Store, StoreError, UnknownEntry
from runtime.durable import read_range

__all__ = ["SegmentReceiver", "commit_fetched", "has_segment", "manifest_bytes", "read_chunk", "receive_segment"]

log = structlog.get_logger(__name__)


def manifest_bytes(store: Store, entry: str) -> bytes:
    """The stored manifest of `entry` as it is on disk (what a peer fetches and checks itself)."""
    try:
        return read_small(store.manifest_file(entry), layout.MAX_MANIFEST_BYTES)
    except FileNotFoundError as exc:
        raise UnknownEntry(f"no entry {entry}") from exc


def read_chunk(store: Store, digest: str, offset: int, length: int) -> tuple[bytes, int]:
    """Up to `length` bytes of the stored segment `digest` from `offset`, and the segment's size.
    `UnknownEntry` when it is not stored; the read is bounded by the caller's `length`."""
    if offset < 0 or length < 0:
        raise StoreError("offset and length must not be negative")
    try:
        return read_range(store.segment_file(digest), offset, length)
    except FileNotFoundError as exc:
        raise UnknownEntry(f"no segment {digest}") from exc
    except OSError as exc:
        raise StoreError(f"segment {digest[:16]}… cannot be read: {exc.strerror or exc}") from exc


def has_segment(store: Store, digest: str, length: int) -> bool:
    """Whether a segment of that name and size is stored (its content is re-hashed at commit and restore)."""
    try:
        info = os.stat(store.segment_file(digest), follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == length


def receive_segment(store: Store, digest: str, length: int) -> SegmentReceiver:
    """A temporary file in `segments/` for one segment arriving from a peer (see `SegmentReceiver`)."""
    return SegmentReceiver(store, layout.check_digest(digest, "segment digest"), length)


def commit_fetched(store: Store, manifest: Manifest, received: Mapping[str, SegmentReceiver]) -> None:
    """Makes a fetched entry loadable: `received` (digest -> a finished receiver) holds the segments that
    came from the peer, hashed as they arrived; every other segment the manifest names must be stored here
    and is re-hashed now. Then the same commit check as an ingest (`commit.validate`), and the manifest is
    written last. Call it where ingest is called (never beside `reconcile` or `enforce_budget`).
    `CommitRefused` leaves nothing loadable (the received temporary files are the caller's to abort)."""
    refusal = check_manifest(manifest)
    if refusal is not None:
        raise CommitRefused(refusal)
    observed: list[SegmentRef] = []
    for seg in manifest.segments:
        got = received.get(seg.digest)
        if got is not None:
            observed.append(SegmentRef(seg.index, seg.offset, got.received, got.observed))
        elif intact(store.segment_file(seg.digest), seg.digest, seg.length):
            observed.append(seg)
        else:
            raise CommitRefused(ManifestRefusal(rule=Rule.SEGMENT_MISSING, detail="not stored here", index=seg.index))
    refusal = validate(manifest, observed, layout.payload_root(observed))
    if refusal is not None:
        raise CommitRefused(refusal)
    dirs = {store.root / layout.SEGMENTS_DIR}
    for digest, receiver in received.items():
        final = store.segment_file(digest)
        if not final.parent.is_dir():
            make_dir(final.parent)
        os.replace(receiver.path, final)
        receiver.landed = True
        dirs.add(final.parent)
    for d in sorted(dirs):
        fsync_dir(d)
    entry = layout.entry_id(manifest.identity, manifest.tokens)
    write_atomic(store.manifest_file(entry), layout.encode_manifest(manifest))
    log.debug("l3_fetched_committed", entry=entry, received=len(received), segments=len(manifest.segments))


class SegmentReceiver:
    """One segment arriving from a peer, in order: each chunk is hashed and written to a temporary file in
    `incoming/` (cleared at the actor's next start if we die), `finish` fsyncs it and checks its blake3 against the
    name it was asked for. It lands under its digest only in `commit_fetched`, with the manifest, so
    nothing fetched is loadable or even named before every byte was verified. Blocking: worker threads."""

    def __init__(self, store: Store, digest: str, length: int) -> None:
        if not 0 < length <= layout.MAX_SEGMENT_BYTES:
            raise StoreError(f"segment length {length} is outside (0, {layout.MAX_SEGMENT_BYTES}]")
        self.digest = digest
        self.length = length
        self.path = store.root / layout.INCOMING_DIR / layout.temp_name(f"fetch-{digest[:16]}", secrets.token_hex(8))
        self.received = 0
        self.observed = ""
        self.landed = False
        self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self._fd: int | None = os.open(self.path, OPEN_CREATE, 0o644)

    def write(self, data: bytes | memoryview) -> None:
        """The next chunk, in order; more bytes than the segment holds is an error (nothing is written)."""
        if self._fd is None:
            raise StoreError("the segment receiver is closed")
        if self.received + len(data) > self.length:
            raise StoreError(f"segment {self.digest[:16]}… is {self.length} bytes; the peer sent more")
        self._hasher.update(data)
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], self.received + done)
        self.received += len(view)

    def finish(self) -> None:
        """fsyncs and closes; `StoreError` when the bytes received are not the segment asked for."""
        if self._fd is None:
            raise StoreError("the segment receiver is closed")
        self.observed = str(self._hasher.hexdigest())
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        if self.received != self.length or self.observed != self.digest:
            raise StoreError(f"segment {self.digest[:16]}… from the peer does not hash to its name")

    def abort(self) -> None:
        """Closes and removes the temporary file unless it landed."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self.landed:
            unlink_quietly(self.path)
