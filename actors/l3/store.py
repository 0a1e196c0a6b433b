"""The L3 store on disk: ingest a saved slot file as segments plus a manifest, assemble it back, reconcile.

Blocking file I/O only: call every method from a worker thread (`asyncio.to_thread`), never on the event
loop. The decisions are the pure cores' (`layout`, `commit`, `budget`); this shell moves bytes and says what
it saw. One `Store` per directory, and `reconcile` and `enforce_budget` only while nothing ingests (the
actor serialises them): they delete segments no manifest names, which includes those of an ingest still
running. While a manifest that cannot be parsed sits in the store, neither deletes any segment.

On disk, under the store root::

    segments/<2 hex>/<blake3>     one file per distinct segment, named by the blake3 of its bytes
    manifests/<entry id>.json     one per entry; its existence is what makes the entry loadable
    quarantine/<entry id>.json    manifests that failed a check: kept, and so are the segments they name

Durability (what a kill -9 or a power cut at any point leaves): every file is written under a temporary
name, fsynced, renamed into place, and its directory fsynced. The manifest is written last, after every
segment it names is durable and `commit.validate` has accepted it, so a manifest either does not exist or
names a complete, verified payload. What a crash leaves behind is temporary files and unnamed segments;
`reconcile` removes both.

How bytes move (one hashing pass): each segment is copied from the slot file into a temporary file through
one 4 MiB buffer, and a helper thread hashes *the temporary file as stored* (read back), then fsyncs it
and renames it to its digest, while the next segment is copied. So the commit check re-hashes what the
store holds, not a buffer that might differ from it, and nothing a caller claims. The slot file's size and
mtime are checked again at the end: one rewritten during ingest is refused. A segment already present is
re-hashed before it is reused (a damaged one is replaced). Every read-back (`assemble`, `verify`,
`reconcile(verify_content=True)`) re-hashes each segment and recomputes the payload digest from them;
`assemble` writes out exactly the bytes it has just hashed. Files are read with read(2), never mapped, so a
bad sector or a file truncated under us is an error (the entry is quarantined), not a SIGBUS. Memory: one
4 MiB buffer per thread (the caller's and `_HELPERS` helpers); `_AHEAD` segments more may sit in the page
cache waiting for their fsync.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Final, NoReturn

import blake3
import msgspec
import structlog

from actors.l3 import layout
from actors.l3.budget import Eviction, StoredEntry, plan_eviction
from actors.l3.commit import Refusal, Rule, check_manifest, check_present, validate
from actors.l3.layout import Manifest, SegmentRef
from runtime.model_files import ModelFileError, open_regular

__all__ = [
    "CommitRefused",
    "CorruptEntry",
    "Inventory",
    "InventoryEntry",
    "QuarantinedManifest",
    "SegmentReceiver",
    "Store",
    "StoreError",
    "UnknownEntry",
]

log = structlog.get_logger(__name__)

#: Called at each durable step of an ingest ("segment", index), ("segments_durable", n), ("manifest", 0):
#: lets a test stop a process at exact points, and the actor report progress.
Checkpoint = Callable[[str, int], None]

_OPEN_READ: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_OPEN_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_OPEN_CREATE_RW: Final = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
#: Segments copied but not yet hashed and durable, at most: the page cache holds them, not this process.
_AHEAD: Final = 6
#: Threads that hash, fsync and rename copied segments (fsyncs overlap: the journal commits them together).
_HELPERS: Final = 4
#: Bytes move through one buffer of this size. Large writes also leave the page cache in large folios, which
#: hash back ~1.4x faster than pages written by copy_file_range (benchmarks/RESULTS.md, L3 store).
_COPY_BUFFER_BYTES: Final = 4 * 1024 * 1024
_TRANSIENT_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN})
_buffers = threading.local()


class StoreError(Exception):
    """An L3 operation failed; the message says why."""


class CommitRefused(StoreError):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(f"commit refused ({refusal.rule.value}): {refusal.detail}")
        self.refusal = refusal


class CorruptEntry(StoreError):
    """A stored entry's bytes do not match its manifest; it has been quarantined."""

    def __init__(self, entry: str, refusal: Refusal) -> None:
        super().__init__(f"entry {entry[:16]}… is corrupt ({refusal.rule.value}): {refusal.detail}")
        self.entry = entry
        self.refusal = refusal


class UnknownEntry(StoreError):
    pass


class InventoryEntry(msgspec.Struct, frozen=True, kw_only=True):
    entry: str
    identity: str
    n_tokens: int
    bytes: int
    mtime_ns: int  # when the manifest was committed: the last use a fresh start knows


class QuarantinedManifest(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    reason: str
    readable: bool  # False: its segments are unknown, so no segment is collected while it is here


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    entries: tuple[InventoryEntry, ...]
    tokens: int
    bytes: int  # every stored segment, counted once
    quarantined: tuple[QuarantinedManifest, ...]  # found there, or moved there by this pass
    removed_temp: int
    removed_orphans: int
    gc_suspended: bool  # an unreadable manifest is in quarantine: orphans were kept
    unknown_files: tuple[str, ...]  # names the store did not write; left alone


class Store:
    def __init__(
        self, root: Path, *, segment_bytes: int = layout.DEFAULT_SEGMENT_BYTES, checkpoint: Checkpoint | None = None
    ) -> None:
        self.root = root
        self.segment_bytes = layout.check_segment_bytes(segment_bytes)
        self._checkpoint = checkpoint
        for name in (layout.SEGMENTS_DIR, layout.MANIFESTS_DIR, layout.QUARANTINE_DIR):
            self._make_dir(root / name)

    # ---- paths: every name is a checked digest or a fixed word ----

    def _at(self, parts: tuple[str, ...]) -> Path:
        return self.root.joinpath(*parts)

    def segment_file(self, digest: str) -> Path:
        return self._at(layout.segment_path(digest))

    def manifest_file(self, entry: str) -> Path:
        return self._at(layout.manifest_path(entry))

    # ---- ingest ----

    def ingest(self, source: Path, *, identity: str, tokens: Iterable[int], payload_kind: str) -> Manifest:
        """Stores the file at `source` as an entry of `identity` holding `tokens`; returns its manifest."""
        token_ids = tuple(tokens)
        entry = layout.entry_id(identity, token_ids)
        if not layout.is_payload_kind(payload_kind):
            raise StoreError("payload kind must be 1-32 of [a-z0-9_]")
        try:
            fd, key = open_regular(source)
        except ModelFileError as exc:
            raise StoreError(str(exc)) from exc
        plan = layout.plan_segments(key.size, self.segment_bytes)
        nonce = secrets.token_hex(8)
        observed: list[SegmentRef] = []
        try:
            with ThreadPoolExecutor(max_workers=_HELPERS, thread_name_prefix="l3-segment") as helpers:
                pending: deque[Future[SegmentRef]] = deque()

                def settle(keep: int) -> None:  # in order, so "segment i" means segments 0..i are durable
                    while len(pending) > keep:
                        observed.append(pending.popleft().result())
                        self._step("segment", observed[-1].index)

                buffer = memoryview(bytearray(_COPY_BUFFER_BYTES))
                for index, offset, length in plan:
                    tmp = self.root / layout.SEGMENTS_DIR / layout.temp_name(str(index), nonce)
                    out = os.open(tmp, _OPEN_CREATE_RW, 0o644)
                    try:
                        copied = _copy_range(fd, out, offset, length, 0, buffer)
                    except BaseException:
                        os.close(out)
                        _unlink_quietly(tmp)
                        raise
                    pending.append(
                        helpers.submit(self._settle_segment, out, tmp, SegmentRef(index, offset, copied, ""))
                    )
                    if copied < length:  # the file shrank under us: validate refuses below
                        break
                    settle(_AHEAD)
                settle(0)
            after = os.fstat(fd)
            grew = len(os.pread(fd, 1, key.size)) > 0
        finally:
            os.close(fd)
        if len(observed) == len(plan) and (grew or after.st_size != key.size or after.st_mtime_ns != key.mtime_ns):
            # rewritten while we read it: what follows is observed as one more segment, so validate refuses
            observed.append(SegmentRef(len(plan), key.size, max(after.st_size - key.size, 1), ""))
        dirs = {self.root / layout.SEGMENTS_DIR} | {self.segment_file(r.digest).parent for r in observed if r.digest}
        for d in sorted(dirs):  # deduplicated segments' too: an earlier rename may not be durable yet
            _fsync_dir(d)
        self._step("segments_durable", len(observed))
        named = tuple(SegmentRef(r.index, r.offset, plan[r.index][2], r.digest) for r in observed[: len(plan)])
        manifest = Manifest(
            identity=identity,
            tokens=token_ids,
            n_tokens=len(token_ids),
            payload_kind=payload_kind,
            total_bytes=key.size,
            payload_digest=layout.payload_root(named),
            segments=named,
        )
        refusal = validate(manifest, observed, layout.payload_root(observed))
        if refusal is not None:
            raise CommitRefused(refusal)
        self._write_atomic(self.manifest_file(entry), layout.encode_manifest(manifest))
        self._step("manifest", 0)
        log.debug("l3_ingested", entry=entry, n_tokens=len(token_ids), bytes=key.size, segments=len(named))
        return manifest

    def _step(self, name: str, n: int) -> None:
        if self._checkpoint is not None:
            self._checkpoint(name, n)

    def _settle_segment(self, fd: int, tmp: Path, seen: SegmentRef) -> SegmentRef:
        """(helper thread) Hashes the stored temporary file, then makes it durable under its digest, or
        drops it when an intact copy is there already. Closes `fd`."""
        try:
            digest, _ = _hash_fd(fd, seen.length, _thread_buffer())
            final = self.segment_file(digest)
            if _intact(final, digest, seen.length):
                _unlink_quietly(tmp)
            else:
                os.fsync(fd)
                if not final.parent.is_dir():
                    self._make_dir(final.parent)
                os.replace(tmp, final)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        finally:
            os.close(fd)
        return SegmentRef(seen.index, seen.offset, seen.length, digest)

    # ---- read back ----

    def load_manifest(self, entry: str) -> Manifest:
        path = self.manifest_file(entry)
        try:
            manifest = layout.decode_manifest(_read_small(path, layout.MAX_MANIFEST_BYTES))
        except FileNotFoundError as exc:
            raise UnknownEntry(f"no entry {entry}") from exc
        except (OSError, msgspec.MsgspecError) as exc:
            raise StoreError(f"manifest {entry[:16]}… is unreadable: {exc}") from exc
        return manifest

    def assemble(self, manifest: Manifest, out_path: Path) -> None:
        """Writes the payload to `out_path` (atomically: complete or absent), re-hashing every segment as it
        is copied and then the payload digest. A mismatch quarantines the entry and raises `CorruptEntry`."""
        refusal = check_manifest(manifest)
        if refusal is not None:
            raise CommitRefused(refusal)
        tmp = out_path.with_name(layout.temp_name(out_path.name, secrets.token_hex(8)))
        out = os.open(tmp, _OPEN_CREATE, 0o600)
        try:
            try:
                refusal = self._read_back(manifest, out)
            finally:
                os.close(out)
            if refusal is not None:
                self._corrupt(manifest, refusal)
            os.replace(tmp, out_path)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def verify(self, manifest: Manifest) -> None:
        """Re-hashes every segment and recomputes the payload digest; quarantines and raises `CorruptEntry`
        on a mismatch."""
        refusal = check_manifest(manifest) or self._read_back(manifest, None)
        if refusal is not None:
            self._corrupt(manifest, refusal)

    def _read_back(self, manifest: Manifest, out: int | None) -> Refusal | None:
        """Reads and hashes each stored segment, writing the very bytes it hashed to `out` at their offset
        (when given), then checks the payload digest recomputed from what was hashed. A segment that cannot be
        read (missing, resized, a read error) is a refusal; an error writing `out` is raised."""
        seen: list[SegmentRef] = []
        buffer = _thread_buffer()
        for seg in manifest.segments:
            try:
                fd = os.open(self.segment_file(seg.digest), _OPEN_READ)
            except FileNotFoundError:
                return Refusal(rule=Rule.SEGMENT_MISSING, detail="segment is not stored", index=seg.index)
            except OSError as exc:
                return _unreadable(seg, exc)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_size != seg.length:
                    detail = f"stored {info.st_size} bytes, expected {seg.length}"
                    return Refusal(rule=Rule.SEGMENT_SIZE, detail=detail, index=seg.index)
                os.set_blocking(fd, True)
                try:
                    digest, got = _hash_fd(fd, seg.length, buffer, out, seg.offset)
                except _ReadFailed as failed:
                    return _unreadable(seg, failed.error)
            finally:
                os.close(fd)
            if got != seg.length:
                return Refusal(
                    rule=Rule.SEGMENT_SIZE, detail=f"read {got} bytes, expected {seg.length}", index=seg.index
                )
            if digest != seg.digest:
                return Refusal(
                    rule=Rule.SEGMENT_MISMATCH, detail="segment bytes do not hash to its name", index=seg.index
                )
            seen.append(SegmentRef(seg.index, seg.offset, seg.length, digest))
        if layout.payload_root(seen) != manifest.payload_digest:
            return Refusal(rule=Rule.PAYLOAD_DIGEST, detail="the payload digest recomputed from the segments differs")
        return None

    def _corrupt(self, manifest: Manifest, refusal: Refusal) -> NoReturn:
        """Quarantines the stored entry if it is this manifest (not a newer one, nor a peer's), then raises."""
        entry = layout.entry_id(manifest.identity, manifest.tokens)
        try:
            stored = self.load_manifest(entry)
        except StoreError:  # absent, or unreadable (reconcile quarantines that one)
            stored = None
        if stored == manifest:
            self.quarantine(entry, refusal.rule.value)
        raise CorruptEntry(entry, refusal)

    # ---- peer fetch: serving chunks, receiving segments, committing a fetched entry ----

    def manifest_bytes(self, entry: str) -> bytes:
        """The stored manifest of `entry` as it is on disk (what a peer fetches and checks itself)."""
        try:
            return _read_small(self.manifest_file(entry), layout.MAX_MANIFEST_BYTES)
        except FileNotFoundError as exc:
            raise UnknownEntry(f"no entry {entry}") from exc

    def read_chunk(self, digest: str, offset: int, length: int) -> tuple[bytes, int]:
        """Up to `length` bytes of the stored segment `digest` from `offset`, and the segment's size.
        `UnknownEntry` when it is not stored; the read is bounded by the caller's `length`."""
        if offset < 0 or length < 0:
            raise StoreError("offset and length must not be negative")
        try:
            fd = os.open(self.segment_file(digest), _OPEN_READ)
        except FileNotFoundError as exc:
            raise UnknownEntry(f"no segment {digest}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise StoreError(f"segment {digest[:16]}… is not a regular file")
            os.set_blocking(fd, True)
            want = max(0, min(length, info.st_size - offset))
            buffer = bytearray(want)
            got = _pread_full(fd, memoryview(buffer), offset)
            return (bytes(buffer) if got == want else bytes(buffer[:got])), info.st_size
        finally:
            os.close(fd)

    def has_segment(self, digest: str, length: int) -> bool:
        """Whether a segment of that name and size is stored (its content is re-hashed at commit and restore)."""
        try:
            info = os.stat(self.segment_file(digest), follow_symlinks=False)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(info.st_mode) and info.st_size == length

    def receive_segment(self, digest: str, length: int) -> SegmentReceiver:
        """A temporary file in `segments/` for one segment arriving from a peer (see `SegmentReceiver`)."""
        return SegmentReceiver(self, layout.check_digest(digest, "segment digest"), length)

    def commit_fetched(self, manifest: Manifest, received: Mapping[str, SegmentReceiver]) -> None:
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
            elif _intact(self.segment_file(seg.digest), seg.digest, seg.length):
                observed.append(seg)
            else:
                raise CommitRefused(Refusal(rule=Rule.SEGMENT_MISSING, detail="not stored here", index=seg.index))
        refusal = validate(manifest, observed, layout.payload_root(observed))
        if refusal is not None:
            raise CommitRefused(refusal)
        dirs = {self.root / layout.SEGMENTS_DIR}
        for digest, receiver in received.items():
            final = self.segment_file(digest)
            if not final.parent.is_dir():
                self._make_dir(final.parent)
            os.replace(receiver.path, final)
            receiver.landed = True
            dirs.add(final.parent)
        for d in sorted(dirs):
            _fsync_dir(d)
        entry = layout.entry_id(manifest.identity, manifest.tokens)
        self._write_atomic(self.manifest_file(entry), layout.encode_manifest(manifest))
        log.debug("l3_fetched_committed", entry=entry, received=len(received), segments=len(manifest.segments))

    # ---- quarantine, removal ----

    def quarantine(self, entry: str, reason: str) -> None:
        """Moves an entry's manifest to quarantine/: no longer loadable, its segments still kept."""
        self._quarantine_name(layout.manifest_name(entry), reason)

    def _quarantine_name(self, name: str, reason: str) -> str:
        """Moves manifests/<name> to quarantine/, never over an earlier one; returns the name it got there."""
        src = self._at((layout.MANIFESTS_DIR, name))
        copy = 0
        while self._at(layout.quarantine_path(name, copy)).exists():
            copy += 1
        target = layout.quarantine_path(name, copy)
        os.replace(src, self._at(target))
        _fsync_dir(self.root / layout.QUARANTINE_DIR)
        _fsync_dir(self.root / layout.MANIFESTS_DIR)
        log.warning("l3_quarantined", manifest=name, reason=reason)
        return target[-1]

    def remove_entries(self, entries: Iterable[str]) -> None:
        """Deletes manifests (an eviction's `evict`); their segments stay until `remove_segments`."""
        for entry in entries:
            _unlink_quietly(self.manifest_file(entry))
        _fsync_dir(self.root / layout.MANIFESTS_DIR)

    def remove_segments(self, digests: Iterable[str]) -> None:
        """Deletes segments (an eviction's `free`, after `remove_entries`)."""
        for digest in digests:
            _unlink_quietly(self.segment_file(digest))

    # ---- budget ----

    def touch(self, entry: str) -> None:
        """Records a use (a restore): the manifest's mtime is the last use the next start knows."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.manifest_file(entry))

    def enforce_budget(
        self, budget: int, *, pinned: Collection[str] = (), last_use: Mapping[str, float] | None = None
    ) -> Eviction:
        """One eviction pass (`budget.plan_eviction`) over what is stored, applied: manifests first, then the
        segments no kept entry names. `pinned`: entries being committed or restored; `last_use`: the caller's
        clock for entries it has seen used (the manifest's mtime otherwise). Quarantined manifests keep their
        segments. While any manifest cannot be parsed, its segments are unknown, so nothing is evicted at all
        (the pass says so: `fits` is then only true if the store fits already)."""
        uses = last_use or {}
        pins = set(pinned)
        sizes = self._segment_sizes()
        stored: list[StoredEntry] = []
        unparseable: list[str] = []
        for folder in (layout.MANIFESTS_DIR, layout.QUARANTINE_DIR):
            for item in os.scandir(self.root / folder):
                if layout.is_temp_name(item.name) or (
                    folder == layout.MANIFESTS_DIR and not layout.is_manifest_name(item.name)
                ):
                    continue
                try:
                    manifest = layout.decode_manifest(_read_small(Path(item.path), layout.MAX_MANIFEST_BYTES))
                except (OSError, msgspec.MsgspecError):
                    unparseable.append(f"{folder}/{item.name}")
                    continue
                digests = tuple(seg.digest for seg in manifest.segments)
                if folder == layout.QUARANTINE_DIR:
                    stored.append(
                        StoredEntry(entry=f"{folder}/{item.name}", segments=digests, last_use=0, quarantined=True)
                    )
                    continue
                entry = item.name[: -len(layout.MANIFEST_SUFFIX)]
                seen = uses.get(entry, item.stat(follow_symlinks=False).st_mtime_ns / 1e9)
                stored.append(StoredEntry(entry=entry, segments=digests, last_use=seen, pinned=entry in pins))
        if unparseable:
            total = sum(sizes.values())
            log.warning("l3_eviction_blocked", unparseable=unparseable[:10], bytes=total, budget=budget)
            return Eviction(evict=(), free=(), bytes_before=total, bytes_after=total, fits=total <= budget)
        plan = plan_eviction(stored, sizes, budget)
        self.remove_entries(plan.evict)
        self.remove_segments(plan.free)
        if plan.evict or plan.free:
            log.info("l3_evicted", entries=len(plan.evict), segments=len(plan.free), bytes_after=plan.bytes_after)
        if not plan.fits:
            log.warning("l3_over_budget", budget=budget, bytes=plan.bytes_after, pinned=len(pins))
        return plan

    def _segment_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for sub in os.scandir(self.root / layout.SEGMENTS_DIR):
            if not (layout.is_fanout_name(sub.name) and sub.is_dir(follow_symlinks=False)):
                continue
            for item in os.scandir(sub.path):
                if layout.is_digest(item.name) and item.name[:2] == sub.name and item.is_file(follow_symlinks=False):
                    sizes[item.name] = item.stat(follow_symlinks=False).st_size
        return sizes

    # ---- startup ----

    def reconcile(self, *, verify_content: bool = False) -> Inventory:
        """Removes temporary files, checks every manifest (and with `verify_content`, re-hashes every
        payload), quarantines the bad, drops segments nothing names, and returns the inventory."""
        removed_temp = 0
        unknown: list[str] = []
        sizes: dict[str, int] = {}
        seg_root = self.root / layout.SEGMENTS_DIR
        for sub in sorted(os.scandir(seg_root), key=lambda e: e.name):
            if layout.is_temp_name(sub.name) and sub.is_file(follow_symlinks=False):  # a segment being copied
                _unlink_quietly(Path(sub.path))
                removed_temp += 1
                continue
            if not (sub.is_dir(follow_symlinks=False) and layout.is_fanout_name(sub.name)):
                unknown.append(f"{layout.SEGMENTS_DIR}/{sub.name}")
                continue
            for item in os.scandir(sub.path):
                if layout.is_temp_name(item.name):
                    _unlink_quietly(Path(item.path))
                    removed_temp += 1
                elif layout.is_digest(item.name) and item.name[:2] == sub.name and item.is_file(follow_symlinks=False):
                    sizes[item.name] = item.stat(follow_symlinks=False).st_size
                else:
                    unknown.append(f"{layout.SEGMENTS_DIR}/{sub.name}/{item.name}")

        referenced: set[str] = set()
        quarantined: list[QuarantinedManifest] = []
        entries: list[InventoryEntry] = []
        for item in sorted(os.scandir(self.root / layout.MANIFESTS_DIR), key=lambda e: e.name):
            if layout.is_temp_name(item.name):
                _unlink_quietly(Path(item.path))
                removed_temp += 1
                continue
            if not layout.is_manifest_name(item.name):
                unknown.append(f"{layout.MANIFESTS_DIR}/{item.name}")
                continue
            manifest, reason = self._check_stored(Path(item.path), item.name, sizes, verify_content)
            if manifest is not None:
                referenced.update(s.digest for s in manifest.segments)
            if reason is not None:
                name = self._quarantine_name(item.name, reason)
                quarantined.append(QuarantinedManifest(name=name, reason=reason, readable=manifest is not None))
                continue
            assert manifest is not None
            entries.append(
                InventoryEntry(
                    entry=item.name[: -len(layout.MANIFEST_SUFFIX)],
                    identity=manifest.identity,
                    n_tokens=manifest.n_tokens,
                    bytes=manifest.total_bytes,
                    mtime_ns=item.stat(follow_symlinks=False).st_mtime_ns,
                )
            )

        moved = {q.name for q in quarantined}  # their segments are in `referenced` already
        for item in sorted(os.scandir(self.root / layout.QUARANTINE_DIR), key=lambda e: e.name):
            if layout.is_temp_name(item.name):
                _unlink_quietly(Path(item.path))
                removed_temp += 1
                continue
            if item.name in moved:
                continue
            try:
                held = layout.decode_manifest(_read_small(Path(item.path), layout.MAX_MANIFEST_BYTES))
                referenced.update(s.digest for s in held.segments)
                readable = True
            except (OSError, msgspec.MsgspecError):
                readable = False
            quarantined.append(QuarantinedManifest(name=item.name, reason="found in quarantine", readable=readable))

        gc_suspended = any(not q.readable for q in quarantined)
        removed_orphans = 0
        if not gc_suspended:
            for digest in sorted(set(sizes) - referenced):
                _unlink_quietly(self.segment_file(digest))
                del sizes[digest]
                removed_orphans += 1
        for d in (seg_root, self.root / layout.MANIFESTS_DIR, self.root / layout.QUARANTINE_DIR):
            _fsync_dir(d)
        inventory = Inventory(
            entries=tuple(entries),
            tokens=sum(e.n_tokens for e in entries),
            bytes=sum(sizes.values()),
            quarantined=tuple(quarantined),
            removed_temp=removed_temp,
            removed_orphans=removed_orphans,
            gc_suspended=gc_suspended,
            unknown_files=tuple(unknown),
        )
        log.info(
            "l3_reconciled",
            entries=len(entries),
            tokens=inventory.tokens,
            bytes=inventory.bytes,
            quarantined=len(quarantined),
            removed_temp=removed_temp,
            removed_orphans=removed_orphans,
            gc_suspended=gc_suspended,
        )
        return inventory

    def _check_stored(
        self, path: Path, name: str, sizes: dict[str, int], verify_content: bool
    ) -> tuple[Manifest | None, str | None]:
        """(the manifest if it parses, why it must be quarantined or None)."""
        try:
            manifest = layout.decode_manifest(_read_small(path, layout.MAX_MANIFEST_BYTES))
        except (OSError, msgspec.MsgspecError) as exc:
            return None, f"unreadable: {exc}"[:200]
        refusal = check_present(manifest, sizes)
        if refusal is None and layout.manifest_name(layout.entry_id(manifest.identity, manifest.tokens)) != name:
            refusal = Refusal(rule=Rule.IDENTITY, detail="the manifest is filed under another entry's name")
        if refusal is None and verify_content:
            refusal = self._read_back(manifest, None)
        if refusal is not None:
            return manifest, f"{refusal.rule.value}: {refusal.detail}"[:200]
        return manifest, None

    # ---- files ----

    def _write_atomic(self, final: Path, data: bytes | memoryview, *, fsync_dir: bool = True) -> None:
        tmp = final.with_name(layout.temp_name(final.name, secrets.token_hex(8)))
        fd = os.open(tmp, _OPEN_CREATE, 0o644)
        try:
            _write_all(lambda b: os.write(fd, b), memoryview(data))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        os.replace(tmp, final)
        if fsync_dir:
            _fsync_dir(final.parent)

    def _make_dir(self, path: Path) -> None:
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            return
        except FileNotFoundError:
            self._make_dir(path.parent)
            os.mkdir(path, 0o755)
        _fsync_dir(path.parent)


def _copy_range(src: int, dst: int, src_offset: int, length: int, dst_offset: int, buffer: memoryview) -> int:
    """Copies `length` bytes between open files through `buffer`; fewer only at the source's end of file."""
    done = 0
    while done < length:
        got = os.preadv(src, [buffer[: min(len(buffer), length - done)]], src_offset + done)
        if got == 0:
            break
        written = 0
        while written < got:
            written += os.pwritev(dst, [buffer[written:got]], dst_offset + done + written)
        done += got
    return done


class _ReadFailed(Exception):
    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _thread_buffer() -> memoryview:
    """This thread's copy/hash buffer (helper threads each have one; they live as long as one ingest)."""
    buffer: memoryview | None = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = memoryview(bytearray(_COPY_BUFFER_BYTES))
    return buffer


def _hash_fd(fd: int, length: int, buffer: memoryview, out: int | None = None, out_offset: int = 0) -> tuple[str, int]:
    """blake3 of the first `length` bytes of an open file and how many there were, read through `buffer`
    (read(2), not a mapping: a bad sector or a truncated file is an error here, never a SIGBUS), each chunk
    written to `out` after it is hashed when given. Read errors raise `_ReadFailed`; write errors OSError."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    done = 0
    while done < length:
        try:
            got = os.preadv(fd, [buffer[: min(len(buffer), length - done)]], done)
        except OSError as exc:
            raise _ReadFailed(exc) from exc
        if got == 0:
            break
        chunk = buffer[:got]
        hasher.update(chunk)
        if out is not None:
            written = 0
            while written < got:
                written += os.pwritev(out, [chunk[written:]], out_offset + done + written)
        done += got
    return str(hasher.hexdigest()), done


def _unreadable(seg: SegmentRef, exc: OSError) -> Refusal:
    if exc.errno in _TRANSIENT_ERRNOS:  # not the segment's fault: let the caller retry
        raise exc
    return Refusal(rule=Rule.SEGMENT_UNREADABLE, detail=f"cannot read it: {exc.strerror or exc}", index=seg.index)


def _intact(path: Path, digest: str, length: int) -> bool:
    """Whether `path` is a regular file of `length` bytes that hashes to `digest`."""
    try:
        fd = os.open(path, _OPEN_READ)
    except FileNotFoundError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != length:
            return False
        if _hash_fd(fd, length, _thread_buffer())[0] == digest:
            return True
    finally:
        os.close(fd)
    log.warning("l3_segment_damaged_replaced", digest=digest)
    return False


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Reads into all of `view` from `offset`, fewer bytes only at end of file."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _write_all(write: Callable[[memoryview], int], data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += write(data[done:])


def _read_small(path: Path, ceiling: int) -> bytes:
    fd = os.open(path, _OPEN_READ)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > ceiling:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, more than {ceiling}")
        os.set_blocking(fd, True)
        buffer = bytearray(info.st_size)
        got = _pread_full(fd, memoryview(buffer), 0)
        return bytes(buffer[:got])
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SegmentReceiver:
    """One segment arriving from a peer, in order: each chunk is hashed and written to a temporary file in
    `segments/` (which `reconcile` removes if we die), `finish` fsyncs it and checks its blake3 against the
    name it was asked for. It lands under its digest only in `Store.commit_fetched`, with the manifest, so
    nothing fetched is loadable or even named before every byte was verified. Blocking: worker threads."""

    def __init__(self, store: Store, digest: str, length: int) -> None:
        if not 0 < length <= layout.MAX_SEGMENT_BYTES:
            raise StoreError(f"segment length {length} is outside (0, {layout.MAX_SEGMENT_BYTES}]")
        self.digest = digest
        self.length = length
        self.path = store.root / layout.SEGMENTS_DIR / layout.temp_name(f"fetch-{digest[:16]}", secrets.token_hex(8))
        self.received = 0
        self.observed = ""
        self.landed = False
        self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self._fd: int | None = os.open(self.path, _OPEN_CREATE, 0o644)

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
            _unlink_quietly(self.path)
