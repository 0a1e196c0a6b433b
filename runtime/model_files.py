"""Model files named by clients and ledgers: which file a name means, whether it is safe to read, its digest.

A model path arrives from outside (a placement request, a ledger written by a peer), so it is hostile input:
it may hold a NUL byte, be 200 KB long, name a FIFO (whose `open` blocks forever), a device, a directory, or
climb out of the models dir with `../`. Everything here turns those into `ModelFileError` with a message a
person can act on; nothing else escapes. Placement and the runner resolve names the same way:

- an absolute path is that file; where the caller gives the node's model directories (`roots`: placement,
  which answers clients), it must be inside one of them, or it is refused before any system call touches it,
  with the same message whether it exists or not (`placement.fit` named `/etc/shadow` and learned its first
  bytes and whether files exist);
- a relative path is a file inside the node's models dir, and may not leave it (no `..` that escapes, no
  symlink that points outside).

Every function here does blocking file work: call them from a worker thread (`asyncio.to_thread`), never on
the event loop. `FileDigests` hashes a file once per (device, inode, size, mtime) with blake3.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3

#: Longest model path accepted (Linux's PATH_MAX); longer ones are refused before any system call.
MAX_PATH_BYTES = 4096


class ModelFileError(Exception):
    """The named model file cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class FileKey:
    """Identifies one version of a file: a rewritten, replaced or touched file gets a new key."""

    device: int
    inode: int
    size: int
    mtime_ns: int


def check_name(path: str) -> None:
    """Refuses names no file system call should ever see."""
    if not path:
        raise ModelFileError("the model path is empty")
    if "\x00" in path:
        raise ModelFileError("the model path contains a NUL byte")
    if len(path.encode("utf-8", errors="surrogateescape")) > MAX_PATH_BYTES:
        raise ModelFileError(f"the model path is longer than {MAX_PATH_BYTES} bytes")


def resolve(path: str, models_dir: Path, *, roots: Sequence[Path] | None = None) -> Path:
    """The file `path` names on this node: absolute as given, relative inside `models_dir` (never outside).

    `roots`: the only directories a model file may be in (symlinks followed); None: an absolute name may be
    anywhere (for callers that read names written by the node's peers, not by clients)."""
    check_name(path)
    given = Path(path)
    if given.is_absolute():
        if roots is None:
            return given
        target = Path(os.path.realpath(given))  # no error whether it exists or not: nothing is told
        if not any(_inside(target, root) for root in roots):
            raise ModelFileError(f"{path!r} is not in this node's model directories")
        return target
    root = Path(os.path.realpath(models_dir))
    target = Path(os.path.realpath(root / given))
    if not _inside(target, root):
        raise ModelFileError(f"{path!r} leaves the models dir {models_dir}")
    return target


def _inside(target: Path, root: Path) -> bool:
    real = Path(os.path.realpath(root))
    return target == real or real in target.parents


def file_key(path: Path) -> FileKey:
    """The key of a regular file; refuses anything else without opening it (a FIFO would block)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ModelFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # e.g. an embedded NUL that slipped past check_name
        raise ModelFileError(f"cannot read {path}: {exc}") from exc
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise ModelFileError(f"{path} is {kind}")
    return FileKey(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def open_regular(path: Path) -> tuple[int, FileKey]:
    """Opens `path` for reading without blocking on a FIFO and checks, on the open descriptor, that it is
    the regular file `file_key` saw. Returns the descriptor (the caller closes it) and its key."""
    file_key(path)  # refuses a FIFO, device or directory before open could block on it
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ModelFileError(f"cannot open {path}: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped for something else between stat and open
            raise ModelFileError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return fd, FileKey(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    except BaseException:
        os.close(fd)
        raise


class FileDigests:
    """blake3 of model files, each version hashed once (keyed by device, inode, size and mtime).

    Thread-safe: hashing runs in worker threads. The cache is bounded (oldest keys dropped)."""

    def __init__(self, max_entries: int = 1024) -> None:
        self._digests: dict[FileKey, str] = {}
        self._max = max_entries
        self._lock = threading.Lock()

    def remember(self, path: Path, digest: str) -> None:
        """`digest` is the blake3 of the file now at `path` (its whole content was just verified against it)."""
        key = file_key(path)
        with self._lock:
            self._digests[key] = digest
            while len(self._digests) > self._max:
                del self._digests[next(iter(self._digests))]

    def known(self, key: FileKey) -> str | None:
        """The digest of that version if it was hashed already (nothing is read)."""
        with self._lock:
            return self._digests.get(key)

    def digest(self, path: Path) -> str:
        fd, key = open_regular(path)
        try:
            return self.digest_open(fd, key, path)
        finally:
            os.close(fd)

    def digest_open(self, fd: int, key: FileKey, path: Path) -> str:
        """The digest of the file open on `fd` (its key from `open_regular`; `path` names it in errors): a
        reader that goes on reading `fd` reads the very version the digest is of."""
        with self._lock:
            known = self._digests.get(key)
        if known is not None:
            return known
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        try:
            with os.fdopen(os.dup(fd), "rb") as handle:
                if key.size:
                    hasher.update_mmap(f"/proc/self/fd/{handle.fileno()}")
        except OSError as exc:
            raise ModelFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
        value: str = hasher.hexdigest()
        with self._lock:
            self._digests[key] = value
            while len(self._digests) > self._max:
                del self._digests[next(iter(self._digests))]
        return value
