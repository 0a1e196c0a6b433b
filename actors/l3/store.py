"""The L3 store on disk: ingest a saved slot file as segments plus a manifest, assemble and verify it back,
reconcile at startup, enforce the budget.

Blocking file I/O only: call every method from a worker thread (`asyncio.to_thread`), never on the event
loop. The decisions are the pure cores' (`layout`, `commit`, `budget`); this shell moves bytes and says what
it saw, through the durable-file primitives of `files`. The store's side of peer fetch (serving chunks,
committing an entry received from a peer) is `store_fetch`. One `Store` per directory, and `reconcile` and
`apply_eviction` only while nothing ingests or commits a fetch (the actor serialises them): they delete
segments no manifest names, which includes those of an ingest still running. What an eviction removes is
decided by the caller's entry index (`entry_index.EntryIndex.plan`), never by re-reading manifests here. While a
manifest that cannot be parsed sits in the store, `reconcile` deletes no segment.

On disk, under the store root::

    segments/<2 hex>/<blake3>     one file per distinct segment, named by the blake3 of its bytes
    manifests/<entry id>.json     one per entry; its existence is what makes the entry loadable
    quarantine/<entry id>.json    manifests that failed a check: kept, and so are the segments they name, until
                                  the actor's policy deletes them (`budget.quarantine_due`; the mtime of each is
                                  when it was quarantined) or an operator does (`mesh-actor l3 gc --quarantine`)
    pending/<entry id>.json       an entry loadable but not yet durable (see below)
    incoming/                     segments arriving from a peer, under temporary names (`store_fetch`); only
                                  the actor's start clears it, so `reconcile` (gc) never removes a live fetch's

Durability, in two steps. `ingest` makes an entry *loadable*: every file is written under a temporary name
and renamed into place, and the manifest is written last (fsynced, renamed, its directory fsynced), after
`commit.validate` has accepted what the store holds, so a manifest either does not exist or names a
complete, verified payload. A kill -9 at any point loses nothing written (the page cache outlives the
process); what it leaves is temporary files and unnamed segments, which `reconcile` removes. `flush` then
makes loadable entries *durable*: it fsyncs their segments and directories. Until it has, the entry has a
marker in `pending/`, made durable before its manifest is written, so a power cut that loses unwritten
segment bytes cannot leave an unverified entry: `reconcile` re-hashes every entry that still has a marker
before it counts as stored (a bad one is quarantined). The caller (the L3 actor) flushes after each capture,
off the reply path; the entry is servable meanwhile.

How bytes move (one hashing pass): each segment is copied from the slot file into a temporary file through
one 4 MiB buffer, and a helper thread hashes *the temporary file as stored* (read back) and renames it to
its digest, while the next segment is copied. So the commit check re-hashes what the store holds, not a
buffer that might differ from it, and nothing a caller claims. The slot file's size and mtime are checked
again at the end: one rewritten during ingest is refused. A segment already present is re-hashed before it
is reused (a damaged one is replaced). Every read-back (`assemble`, `verify`,
`reconcile(verify_content=True)`) re-hashes each segment, several segments at once, and recomputes the
payload digest from them; `assemble` writes out exactly the bytes it has just hashed. Files are read with
read(2), never mapped, so a bad sector or a file truncated under us is an error (the entry is quarantined),
not a SIGBUS. Memory: one 4 MiB buffer per thread (the caller's and `_HELPERS` helpers); `_AHEAD` segments
more may sit in the page cache waiting to be hashed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Final, NoReturn

import msgspec
import structlog

from actors.l3 import layout
from actors.l3.commit import ManifestRefusal, Rule, check_manifest, check_present, validate
from actors.l3.files import (
    COPY_BUFFER_BYTES,
    OPEN_CREATE,
    OPEN_CREATE_RW,
    OPEN_READ,
    ReadFailed,
    copy_range,
    fsync_dir,
    hash_fd,
    intact,
    make_dir,
    read_small,
    thread_buffer,
    unlink_quietly,
    write_atomic,
)
from actors.l3.layout import Manifest, SegmentRef
from runtime.model_files import ModelFileError, open_regular

__all__ = [
    "CommitRefused",
    "CorruptEntry",
    "Inventory",
    "InventoryEntry",
    "QuarantinedManifest",
    "Store",
    "StoreError",
    "UnknownEntry",
]

log = structlog.get_logger(__name__)

#: Called at each durable step of an ingest ("segment", index), ("segments_durable", n), ("manifest", 0):
#: lets a test stop a process at exact points, and the actor report progress.
Checkpoint = Callable[[str, int], None]

#: Segments copied but not yet hashed and durable, at most: the page cache holds them, not this process.
_AHEAD: Final = 6
#: Threads that hash and rename copied segments, and that fsync them in `flush` (fsyncs overlap: the journal
#: commits them together).
_HELPERS: Final = 4
#: Segments re-hashed at once by a read-back: one single-threaded hasher per segment keeps each core busy
#: with its own read(2) and hash (measured faster than one multi-threaded hasher fed by one reader).
_READERS: Final = max(1, min(8, os.cpu_count() or 1))
#: A pending marker: created if absent, reused if present (never O_EXCL: see `_mark_pending`).
OPEN_MARK: Final = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
_TRANSIENT_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN})


class StoreError(Exception):
    """An L3 operation failed; the message says why."""


class CommitRefused(StoreError):
    def __init__(self, refusal: ManifestRefusal) -> None:
        super().__init__(f"commit refused ({refusal.rule.value}): {refusal.detail}")
        self.refusal = refusal


class CorruptEntry(StoreError):
    """A stored entry's bytes do not match its manifest; it has been quarantined."""

    def __init__(self, entry: str, refusal: ManifestRefusal) -> None:
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
    segments: tuple[tuple[str, int], ...] = ()  # (digest, length) of each segment the manifest names


class QuarantinedManifest(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    reason: str
    readable: bool  # False: its segments are unknown, so no segment is collected while it is here
    segments: tuple[str, ...] = ()  # the digests it names (when readable)
    bytes: int = 0  # the manifest file's size
    since_ns: int = 0  # when it was quarantined (its mtime, set when it was moved there)


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    entries: tuple[InventoryEntry, ...]
    tokens: int
    bytes: int  # every stored segment, counted once
    segment_bytes: dict[str, int]  # every stored segment: digest -> size
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
        for name in (
            layout.SEGMENTS_DIR,
            layout.MANIFESTS_DIR,
            layout.QUARANTINE_DIR,
            layout.PENDING_DIR,
            layout.INCOMING_DIR,
        ):
            make_dir(root / name)

    # ---- paths: every name is a checked digest or a fixed word ----

    def _at(self, parts: tuple[str, ...]) -> Path:
        return self.root.joinpath(*parts)

    def segment_file(self, digest: str) -> Path:
        return self._at(layout.segment_path(digest))

    def manifest_file(self, entry: str) -> Path:
        return self._at(layout.manifest_path(entry))

    def pending_file(self, entry: str) -> Path:
        return self._at(layout.pending_path(entry))

    # ---- ingest ----

    def ingest(self, source: Path, *, identity: str, tokens: Iterable[int], payload_kind: str) -> Manifest:
        """Stores the file at `source` as an entry of `identity` holding `tokens`; returns its manifest. The
        entry is loadable when this returns, and durable after the next `flush`."""
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

                def settle(keep: int) -> None:  # in order, so "segment i" means segments 0..i are stored
                    while len(pending) > keep:
                        observed.append(pending.popleft().result())
                        self._step("segment", observed[-1].index)

                buffer = memoryview(bytearray(COPY_BUFFER_BYTES))
                for index, offset, length in plan:
                    tmp = self.root / layout.SEGMENTS_DIR / layout.temp_name(str(index), nonce)
                    out = os.open(tmp, OPEN_CREATE_RW, 0o644)
                    try:
                        copied = copy_range(fd, out, offset, length, 0, buffer)
                    except BaseException:
                        os.close(out)
                        unlink_quietly(tmp)
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
        self._step("segments_stored", len(observed))
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
        self._mark_pending(entry)
        self._step("pending", 0)
        write_atomic(self.manifest_file(entry), layout.encode_manifest(manifest))
        self._step("manifest", 0)
        log.debug("l3_ingested", entry=entry, n_tokens=len(token_ids), bytes=key.size, segments=len(named))
        return manifest

    def _step(self, name: str, n: int) -> None:
        if self._checkpoint is not None:
            self._checkpoint(name, n)

    def _settle_segment(self, fd: int, tmp: Path, seen: SegmentRef) -> SegmentRef:
        """(helper thread) Hashes the stored temporary file, then renames it to its digest, or drops it when
        an intact copy is there already. Closes `fd`."""
        try:
            digest, _ = hash_fd(fd, seen.length, thread_buffer())
            final = self.segment_file(digest)
            if intact(final, digest, seen.length):
                unlink_quietly(tmp)
            else:
                if not final.parent.is_dir():
                    make_dir(final.parent)
                os.replace(tmp, final)
        except BaseException:
            unlink_quietly(tmp)
            raise
        finally:
            os.close(fd)
        return SegmentRef(seen.index, seen.offset, seen.length, digest)

    # ---- durability ----

    def _mark_pending(self, entry: str) -> None:
        """A durable marker that `entry` is not yet durable: written before its manifest. A marker left by an
        earlier copy of the entry (its flush failed, then it was evicted) is reused: the same meaning, and an
        exclusive create made every later capture of that entry fail."""
        fd = os.open(self.pending_file(entry), OPEN_MARK, 0o644)
        os.close(fd)
        fsync_dir(self.root / layout.PENDING_DIR)

    def pending(self) -> list[str]:
        """Entries loadable but not yet durable (their markers)."""
        return sorted(
            item.name[: -len(layout.MANIFEST_SUFFIX)]
            for item in os.scandir(self.root / layout.PENDING_DIR)
            if layout.is_manifest_name(item.name)
        )

    def flush(self) -> int:
        """Makes every pending entry durable: fsyncs the segments each names and their directories, then
        drops its marker. An entry removed meanwhile just loses its marker. Returns how many were settled."""
        entries = self.pending()
        if not entries:
            return 0
        digests: set[str] = set()
        for entry in entries:
            try:
                digests.update(s.digest for s in self.load_manifest(entry).segments)
            except StoreError:  # gone (evicted), or unreadable: reconcile quarantines that one
                continue
        with ThreadPoolExecutor(max_workers=_HELPERS, thread_name_prefix="l3-flush") as helpers:
            list(helpers.map(self._fsync_segment, sorted(digests)))
        for d in sorted({self.segment_file(d).parent for d in digests} | {self.root / layout.SEGMENTS_DIR}):
            fsync_dir(d)
        for entry in entries:
            unlink_quietly(self.pending_file(entry))
        self._step("flushed", len(entries))
        return len(entries)

    def _fsync_segment(self, digest: str) -> None:
        try:
            fd = os.open(self.segment_file(digest), OPEN_READ)
        except FileNotFoundError:  # evicted meanwhile
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- read back ----

    def load_manifest(self, entry: str) -> Manifest:
        path = self.manifest_file(entry)
        try:
            manifest = layout.decode_manifest(read_small(path, layout.MAX_MANIFEST_BYTES))
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
        out = os.open(tmp, OPEN_CREATE, 0o600)
        try:
            try:
                refusal = self._read_back(manifest, out)
            finally:
                os.close(out)
            if refusal is not None:
                self._corrupt(manifest, refusal)
            os.replace(tmp, out_path)
        except BaseException:
            unlink_quietly(tmp)
            raise

    def verify(self, manifest: Manifest) -> None:
        """Re-hashes every segment and recomputes the payload digest; quarantines and raises `CorruptEntry`
        on a mismatch."""
        refusal = check_manifest(manifest) or self._read_back(manifest, None)
        if refusal is not None:
            self._corrupt(manifest, refusal)

    def _read_back(self, manifest: Manifest, out: int | None) -> ManifestRefusal | None:
        """Reads and hashes each stored segment (`_READERS` at once), writing the very bytes it hashed to `out`
        at their offset (when given), then checks the payload digest recomputed from what was hashed. A
        segment that cannot be read (missing, resized, a read error) is a refusal (the first in order); an
        error writing `out` is raised."""
        segments = manifest.segments
        if len(segments) <= 1 or _READERS == 1:
            results = [self._read_segment(seg, out) for seg in segments]
        else:
            with ThreadPoolExecutor(max_workers=min(_READERS, len(segments)), thread_name_prefix="l3-read") as pool:
                results = list(pool.map(lambda seg: self._read_segment(seg, out), segments))
        seen: list[SegmentRef] = []
        for result in results:
            if isinstance(result, ManifestRefusal):
                return result
            seen.append(result)
        if layout.payload_root(seen) != manifest.payload_digest:
            return ManifestRefusal(
                rule=Rule.PAYLOAD_DIGEST, detail="the payload digest recomputed from the segments differs"
            )
        return None

    def _read_segment(self, seg: SegmentRef, out: int | None) -> SegmentRef | ManifestRefusal:
        """Re-hashes one stored segment (copying it to `out` at its offset when given)."""
        try:
            fd = os.open(self.segment_file(seg.digest), OPEN_READ)
        except FileNotFoundError:
            return ManifestRefusal(rule=Rule.SEGMENT_MISSING, detail="segment is not stored", index=seg.index)
        except OSError as exc:
            return _unreadable(seg, exc)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != seg.length:
                detail = f"stored {info.st_size} bytes, expected {seg.length}"
                return ManifestRefusal(rule=Rule.SEGMENT_SIZE, detail=detail, index=seg.index)
            os.set_blocking(fd, True)
            try:
                digest, got = hash_fd(fd, seg.length, thread_buffer(), out, seg.offset)
            except ReadFailed as failed:
                return _unreadable(seg, failed.error)
        finally:
            os.close(fd)
        if got != seg.length:
            return ManifestRefusal(
                rule=Rule.SEGMENT_SIZE, detail=f"read {got} bytes, expected {seg.length}", index=seg.index
            )
        if digest != seg.digest:
            return ManifestRefusal(
                rule=Rule.SEGMENT_MISMATCH, detail="segment bytes do not hash to its name", index=seg.index
            )
        return SegmentRef(seg.index, seg.offset, seg.length, digest)

    def _corrupt(self, manifest: Manifest, refusal: ManifestRefusal) -> NoReturn:
        """Quarantines the stored entry if it is this manifest (not a newer one, nor a peer's), then raises."""
        entry = layout.entry_id(manifest.identity, manifest.tokens)
        try:
            stored = self.load_manifest(entry)
        except StoreError:  # absent, or unreadable (reconcile quarantines that one)
            stored = None
        if stored == manifest:
            self.quarantine(entry, refusal.rule.value)
        raise CorruptEntry(entry, refusal)

    # ---- quarantine, removal ----

    def quarantine(self, entry: str, reason: str) -> None:
        """Moves an entry's manifest to quarantine/: no longer loadable, its segments still kept."""
        self._quarantine_name(layout.manifest_name(entry), reason)

    def clear_quarantine(self) -> tuple[int, int]:
        """Deletes every quarantined manifest (an operator's `gc --quarantine`): the segments only they named
        become orphans for the next `reconcile`. Returns (files, bytes) removed."""
        files = removed = 0
        for item in os.scandir(self.root / layout.QUARANTINE_DIR):
            if not item.is_file(follow_symlinks=False):
                continue
            size = item.stat(follow_symlinks=False).st_size
            unlink_quietly(Path(item.path))
            files, removed = files + 1, removed + size
        fsync_dir(self.root / layout.QUARANTINE_DIR)
        log.warning("l3_quarantine_cleared", files=files, bytes=removed)
        return files, removed

    def remove_quarantined(self, names: Iterable[str]) -> int:
        """Deletes these quarantined manifests (the actor's policy; a name the store does not give is left
        alone): the segments only they named become orphans. Returns the bytes removed."""
        removed = 0
        for name in names:
            if not layout.is_quarantine_name(name):
                continue
            path = self.root / layout.QUARANTINE_DIR / name
            try:
                removed += path.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            unlink_quietly(path)
        fsync_dir(self.root / layout.QUARANTINE_DIR)
        return removed

    def clear_incoming(self) -> int:
        """Removes what fetches left in incoming/ (call it only while no fetch runs: at start)."""
        removed = 0
        for item in os.scandir(self.root / layout.INCOMING_DIR):
            if item.is_file(follow_symlinks=False):
                unlink_quietly(Path(item.path))
                removed += 1
        return removed

    def _quarantine_name(self, name: str, reason: str) -> str:
        """Moves manifests/<name> to quarantine/, never over an earlier one; returns the name it got there."""
        src = self._at((layout.MANIFESTS_DIR, name))
        copy = 0
        while self._at(layout.quarantine_path(name, copy)).exists():
            copy += 1
        target = layout.quarantine_path(name, copy)
        os.replace(src, self._at(target))
        os.utime(self._at(target))  # its mtime says since when it is quarantined (what the retention counts)
        fsync_dir(self.root / layout.QUARANTINE_DIR)
        fsync_dir(self.root / layout.MANIFESTS_DIR)
        log.warning("l3_quarantined", manifest=name, reason=reason)
        return target[-1]

    def remove_entries(self, entries: Iterable[str]) -> None:
        """Deletes manifests (an eviction's `evict`), and their pending markers; their segments stay until
        `remove_segments`."""
        for entry in entries:
            unlink_quietly(self.manifest_file(entry))
            unlink_quietly(self.pending_file(entry))
        fsync_dir(self.root / layout.MANIFESTS_DIR)

    def remove_segments(self, digests: Iterable[str]) -> None:
        """Deletes segments (an eviction's `free`, after `remove_entries`)."""
        for digest in digests:
            unlink_quietly(self.segment_file(digest))

    # ---- budget ----

    def touch(self, entry: str) -> None:
        """Records a use (a restore): the manifest's mtime is the last use the next start knows."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.manifest_file(entry))

    def apply_eviction(self, evict: Iterable[str], free: Iterable[str]) -> None:
        """Carries out an eviction pass the caller's entry index decided (`entry_index.EntryIndex.plan`): manifests
        first, then the segments no kept entry names."""
        evicted = tuple(evict)
        freed = tuple(free)
        self.remove_entries(evicted)
        self.remove_segments(freed)
        if evicted or freed:
            log.info("l3_evicted", entries=len(evicted), segments=len(freed))

    def segment_sizes(self) -> dict[str, int]:
        """Every stored segment and its size, from the directory listing (no segment is read)."""
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
        """Removes temporary files, checks every manifest (re-hashing the payload of each entry not known to be
        durable, and with `verify_content` of every entry), quarantines the bad, drops segments nothing names,
        makes the pending entries that passed durable, and returns the inventory."""
        removed_temp = 0
        pending = set(self.pending())
        unknown: list[str] = []
        sizes: dict[str, int] = {}
        seg_root = self.root / layout.SEGMENTS_DIR
        for sub in sorted(os.scandir(seg_root), key=lambda e: e.name):
            if layout.is_temp_name(sub.name) and sub.is_file(follow_symlinks=False):  # a segment being copied
                unlink_quietly(Path(sub.path))
                removed_temp += 1
                continue
            if not (sub.is_dir(follow_symlinks=False) and layout.is_fanout_name(sub.name)):
                unknown.append(f"{layout.SEGMENTS_DIR}/{sub.name}")
                continue
            for item in os.scandir(sub.path):
                if layout.is_temp_name(item.name):
                    unlink_quietly(Path(item.path))
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
                unlink_quietly(Path(item.path))
                removed_temp += 1
                continue
            if not layout.is_manifest_name(item.name):
                unknown.append(f"{layout.MANIFESTS_DIR}/{item.name}")
                continue
            unsure = item.name[: -len(layout.MANIFEST_SUFFIX)] in pending
            manifest, reason = self._check_stored(Path(item.path), item.name, sizes, verify_content or unsure)
            if manifest is not None:
                referenced.update(s.digest for s in manifest.segments)
            if reason is not None:
                size = item.stat(follow_symlinks=False).st_size
                name = self._quarantine_name(item.name, reason)
                since = self._at((layout.QUARANTINE_DIR, name)).stat(follow_symlinks=False).st_mtime_ns
                digests = tuple(s.digest for s in manifest.segments) if manifest is not None else ()
                quarantined.append(
                    QuarantinedManifest(
                        name=name,
                        reason=reason,
                        readable=manifest is not None,
                        segments=digests,
                        bytes=size,
                        since_ns=since,
                    )
                )
                continue
            assert manifest is not None
            entries.append(
                InventoryEntry(
                    entry=item.name[: -len(layout.MANIFEST_SUFFIX)],
                    identity=manifest.identity,
                    n_tokens=manifest.n_tokens,
                    bytes=manifest.total_bytes,
                    mtime_ns=item.stat(follow_symlinks=False).st_mtime_ns,
                    segments=tuple((s.digest, s.length) for s in manifest.segments),
                )
            )

        moved = {q.name for q in quarantined}  # their segments are in `referenced` already
        for item in sorted(os.scandir(self.root / layout.QUARANTINE_DIR), key=lambda e: e.name):
            if layout.is_temp_name(item.name):
                unlink_quietly(Path(item.path))
                removed_temp += 1
                continue
            if item.name in moved:
                continue
            named: tuple[str, ...] = ()
            try:
                held = layout.decode_manifest(read_small(Path(item.path), layout.MAX_MANIFEST_BYTES))
                named = tuple(s.digest for s in held.segments)
                referenced.update(named)
                readable = True
            except (OSError, msgspec.MsgspecError):
                readable = False
            info = item.stat(follow_symlinks=False)
            quarantined.append(
                QuarantinedManifest(
                    name=item.name,
                    reason="found in quarantine",
                    readable=readable,
                    segments=named,
                    bytes=info.st_size,
                    since_ns=info.st_mtime_ns,
                )
            )

        gc_suspended = any(not q.readable for q in quarantined)
        removed_orphans = 0
        if not gc_suspended:
            for digest in sorted(set(sizes) - referenced):
                unlink_quietly(self.segment_file(digest))
                del sizes[digest]
                removed_orphans += 1
        for item in os.scandir(self.root / layout.PENDING_DIR):
            if layout.is_temp_name(item.name) or not layout.is_manifest_name(item.name):
                unknown.append(f"{layout.PENDING_DIR}/{item.name}")
        for d in (seg_root, self.root / layout.MANIFESTS_DIR, self.root / layout.QUARANTINE_DIR):
            fsync_dir(d)
        self.flush()  # the pending entries left are verified now; the markers of the others just go
        inventory = Inventory(
            entries=tuple(entries),
            tokens=sum(e.n_tokens for e in entries),
            bytes=sum(sizes.values()),
            segment_bytes=dict(sizes),
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
            manifest = layout.decode_manifest(read_small(path, layout.MAX_MANIFEST_BYTES))
        except (OSError, msgspec.MsgspecError) as exc:
            return None, f"unreadable: {exc}"[:200]
        refusal = check_present(manifest, sizes)
        if refusal is None and layout.manifest_name(layout.entry_id(manifest.identity, manifest.tokens)) != name:
            refusal = ManifestRefusal(rule=Rule.IDENTITY, detail="the manifest is filed under another entry's name")
        if refusal is None and verify_content:
            refusal = self._read_back(manifest, None)
        if refusal is not None:
            return manifest, f"{refusal.rule.value}: {refusal.detail}"[:200]
        return manifest, None


def _unreadable(seg: SegmentRef, exc: OSError) -> ManifestRefusal:
    if exc.errno in _TRANSIENT_ERRNOS:  # not the segment's fault: let the caller retry
        raise exc
    return ManifestRefusal(
        rule=Rule.SEGMENT_UNREADABLE, detail=f"cannot read it: {exc.strerror or exc}", index=seg.index
    )
