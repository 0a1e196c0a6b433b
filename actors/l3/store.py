"""The L3 store on disk: ingest a saved slot file as segments plus a manifest, assemble it back, reconcile.

Blocking file I/O only: call every method from a worker thread (`asyncio.to_thread`), never on the event
loop. The decisions are the pure cores' (`layout`, `commit`, `budget`); this shell moves bytes and says what
it saw. One `Store` per directory, and `reconcile` only while nothing ingests (at startup): it deletes the
segments no manifest names, which includes those of an ingest still running.

On disk, under the store root::

    segments/<2 hex>/<blake3>     one file per distinct segment, named by the blake3 of its bytes
    manifests/<entry id>.json     one per entry; its existence is what makes the entry loadable
    quarantine/<entry id>.json    manifests that failed a check: kept, and so are the segments they name

Durability (what a kill -9 or a power cut at any point leaves): every file is written under a temporary
name, fsynced, renamed into place, and its directory fsynced. The manifest is written last, after every
segment it names is durable and `commit.validate` has accepted it, so a manifest either does not exist or
names a complete, verified payload. What a crash leaves behind is temporary files and unnamed segments;
`reconcile` removes both.

The commit check uses the digests computed while writing (not a re-read), which is as safe here: each
digest is computed from the very buffer that is then written to the segment file, in this process, so the
only thing a re-read could add is a check of the page cache against itself (it would not reach the disk,
and it cannot see later bit rot). What could differ from the payload is caught anyway: the source is read
by offset and its size checked again at the end (a slot file rewritten during ingest is refused), a segment
already present is re-hashed before it is reused (a damaged one is replaced by the good bytes), and every
read-back (`assemble`, `verify`, `reconcile(verify_content=True)`) re-hashes each segment and the payload.
`ingest(..., reread=True)` re-reads the stored segments for the check instead, for those who want it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final, NoReturn

import blake3
import msgspec
import structlog

from actors.l3 import layout
from actors.l3.commit import Refusal, Rule, check_manifest, check_present, validate
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

_OPEN_READ: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_OPEN_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


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

    def ingest(
        self, source: Path, *, identity: str, tokens: Iterable[int], payload_kind: str, reread: bool = False
    ) -> Manifest:
        """Stores the file at `source` as an entry of `identity` holding `tokens`; returns its manifest.

        Memory: one segment buffer (two while a segment already present is re-checked)."""
        token_ids = tuple(tokens)
        entry = layout.entry_id(identity, token_ids)
        try:
            fd, key = open_regular(source)
        except ModelFileError as exc:
            raise StoreError(str(exc)) from exc
        try:
            plan = layout.plan_segments(key.size, self.segment_bytes)
            buffer = bytearray(min(self.segment_bytes, max(key.size, 1)))
            view = memoryview(buffer)
            payload = blake3.blake3(max_threads=blake3.blake3.AUTO)
            named: list[SegmentRef] = []
            observed: list[SegmentRef] = []
            dirs: set[Path] = set()
            for index, offset, length in plan:
                got = _pread_full(fd, view[:length], offset)
                data = view[:got]
                digest = str(blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest())
                payload.update(data)
                named.append(SegmentRef(index, offset, length, digest))
                observed.append(SegmentRef(index, offset, got, digest))
                if got < length:  # the file shrank under us: validate refuses below
                    break
                dirs |= self._store_segment(digest, data)
                self._step("segment", index)
            after = os.fstat(fd)
            grew = _pread_full(fd, view[:1], key.size) > 0
            changed = after.st_size != key.size or after.st_mtime_ns != key.mtime_ns
            if len(observed) == len(plan) and (grew or changed):
                # rewritten while we read it: what follows is observed as one more segment, so validate refuses
                observed.append(SegmentRef(len(plan), key.size, max(after.st_size - key.size, 1), ""))
        finally:
            os.close(fd)
        for d in sorted(dirs):
            _fsync_dir(d)
        self._step("segments_durable", len(named))
        manifest = Manifest(
            identity=identity,
            tokens=token_ids,
            n_tokens=len(token_ids),
            payload_kind=payload_kind,
            total_bytes=key.size,
            payload_digest=str(payload.hexdigest()),
            segments=tuple(named),
        )
        payload_digest = manifest.payload_digest
        if reread and len(observed) == len(named):
            observed, payload_digest = self._reread(manifest)
        refusal = validate(manifest, observed, payload_digest)
        if refusal is not None:
            raise CommitRefused(refusal)
        self._write_atomic(self.manifest_file(entry), layout.encode_manifest(manifest))
        self._step("manifest", 0)
        log.debug("l3_ingested", entry=entry, n_tokens=len(token_ids), bytes=key.size, segments=len(named))
        return manifest

    def _step(self, name: str, n: int) -> None:
        if self._checkpoint is not None:
            self._checkpoint(name, n)

    def _store_segment(self, digest: str, data: memoryview) -> set[Path]:
        """Writes one segment unless an intact copy is there; returns the directories to fsync."""
        final = self.segment_file(digest)
        try:
            info = os.lstat(final)
        except FileNotFoundError:
            info = None
        if info is not None and stat.S_ISREG(info.st_mode) and info.st_size == len(data):
            if _hash_file(final) == digest:
                return set()
            log.warning("l3_segment_damaged_replaced", digest=digest)
        if not final.parent.is_dir():
            self._make_dir(final.parent)
        self._write_atomic(final, data, fsync_dir=False)
        return {final.parent}

    def _reread(self, manifest: Manifest) -> tuple[list[SegmentRef], str]:
        payload = blake3.blake3(max_threads=blake3.blake3.AUTO)
        observed: list[SegmentRef] = []
        for seg in manifest.segments:
            data = _read_segment(self.segment_file(seg.digest), seg.length)
            payload.update(data)
            observed.append(SegmentRef(seg.index, seg.offset, len(data), str(blake3.blake3(data).hexdigest())))
        return observed, str(payload.hexdigest())

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
        """Writes the payload to `out_path` (atomically: complete or absent), verifying every segment and the
        payload digest on the way. A mismatch quarantines the entry and raises `CorruptEntry`."""
        refusal = check_manifest(manifest)
        if refusal is not None:
            raise CommitRefused(refusal)
        tmp = out_path.with_name(layout.temp_name(out_path.name, secrets.token_hex(8)))
        out = os.open(tmp, _OPEN_CREATE, 0o600)
        try:
            try:
                refusal = self._stream(manifest, lambda b: os.write(out, b))
            finally:
                os.close(out)
            if refusal is not None:
                self._corrupt(manifest, refusal)
            os.replace(tmp, out_path)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def verify(self, manifest: Manifest) -> None:
        """Re-hashes every segment and the payload; quarantines and raises `CorruptEntry` on a mismatch."""
        refusal = check_manifest(manifest)
        if refusal is not None:
            raise CommitRefused(refusal)
        refusal = self._stream(manifest, None)
        if refusal is not None:
            self._corrupt(manifest, refusal)

    def _stream(self, manifest: Manifest, sink: Callable[[memoryview], int] | None) -> Refusal | None:
        """Reads the payload segment by segment (one buffer), checking each and then the whole."""
        payload = blake3.blake3(max_threads=blake3.blake3.AUTO)
        buffer = bytearray(max((s.length for s in manifest.segments), default=0))
        view = memoryview(buffer)
        for seg in manifest.segments:
            refusal = self._read_into(seg, view)
            if refusal is not None:
                return refusal
            data = view[: seg.length]
            payload.update(data)
            if sink is not None:
                _write_all(sink, data)
        if str(payload.hexdigest()) != manifest.payload_digest:
            return Refusal(rule=Rule.PAYLOAD_DIGEST, detail="re-hashed payload differs")
        return None

    def _read_into(self, seg: SegmentRef, view: memoryview) -> Refusal | None:
        try:
            fd = os.open(self.segment_file(seg.digest), _OPEN_READ)
        except FileNotFoundError:
            return Refusal(rule=Rule.SEGMENT_MISSING, detail="segment is not stored", index=seg.index)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != seg.length:
                return Refusal(
                    rule=Rule.SEGMENT_SIZE,
                    detail=f"stored {info.st_size} bytes, expected {seg.length}",
                    index=seg.index,
                )
            os.set_blocking(fd, True)
            got = _pread_full(fd, view[: seg.length], 0)
        finally:
            os.close(fd)
        if got != seg.length:
            return Refusal(rule=Rule.SEGMENT_SIZE, detail=f"read {got} bytes, expected {seg.length}", index=seg.index)
        if blake3.blake3(view[: seg.length], max_threads=blake3.blake3.AUTO).hexdigest() != seg.digest:
            return Refusal(rule=Rule.SEGMENT_MISMATCH, detail="segment bytes do not hash to its name", index=seg.index)
        return None

    def _corrupt(self, manifest: Manifest, refusal: Refusal) -> NoReturn:
        entry = layout.entry_id(manifest.identity, manifest.tokens)
        if self.manifest_file(entry).exists():
            self.quarantine(entry, refusal.rule.value)
        raise CorruptEntry(entry, refusal)

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

    # ---- startup ----

    def reconcile(self, *, verify_content: bool = False) -> Inventory:
        """Removes temporary files, checks every manifest (and with `verify_content`, re-hashes every
        payload), quarantines the bad, drops segments nothing names, and returns the inventory."""
        removed_temp = 0
        unknown: list[str] = []
        sizes: dict[str, int] = {}
        seg_root = self.root / layout.SEGMENTS_DIR
        for sub in sorted(os.scandir(seg_root), key=lambda e: e.name):
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
            refusal = self._stream(manifest, None)
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


def _read_segment(path: Path, length: int) -> bytes:
    data = _read_small(path, length)
    if len(data) != length:
        raise StoreError(f"segment {path.name[:16]}… holds {len(data)} bytes, expected {length}")
    return data


def _hash_file(path: Path) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(str(path))
    return str(hasher.hexdigest())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
