"""A model file arriving from a peer: the temporary file beside its destination and the journal of its chunks.

Blocking file I/O (worker threads). The part file is `transfer.part_name` in the destination's directory (so the
final rename stays on one file system), opened without following symlinks; its journal holds the blake3 of each
chunk written, appended after the chunk's bytes. `open_part` keeps what a previous fetch of the same file left,
up to the last whole chunk whose bytes, re-hashed from disk, equal the journal's record (`transfer`), and feeds
those bytes to the whole-file hasher; the rest is cut off. `land` renames a verified file into place and fsyncs
its directory; `discard` leaves nothing behind. The durable-file primitives are `runtime.durable`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import blake3

from actors.files import transfer
from runtime.durable import fsync_dir, pread_full, read_small, unlink_quietly

__all__ = ["PartFile", "free_bytes", "open_part"]

_OPEN_PART = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


class PartFile:
    """One file being fetched: write chunks in order, then `finish` (the whole-file digest) and `land`."""

    def __init__(self, directory: Path, file_name: str, digest: str, size: int, chunk: int) -> None:
        self.path = directory / transfer.part_name(file_name, digest)
        self.journal_path = directory / transfer.journal_name(file_name, digest)
        self.digest = digest
        self.size = size
        self.chunk = chunk
        self.received = 0  # bytes in the part, each verified (kept from before, or written now)
        self.resumed_from = 0
        self._hasher = blake3.blake3()
        self._fd: int | None = None
        self._journal: int | None = None

    def _open(self) -> None:
        self._fd = os.open(self.path, _OPEN_PART, 0o644)
        info = os.fstat(self._fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{self.path} is not a regular file")
        recorded = self._recorded()
        observed: list[str] = []
        buffer = memoryview(bytearray(self.chunk)) if recorded else memoryview(b"")
        for index, want in enumerate(recorded):
            length = min(self.chunk, self.size - index * self.chunk)
            got = pread_full(self._fd, buffer[:length], index * self.chunk)
            digest = str(blake3.blake3(buffer[:got]).hexdigest()) if got == length else ""
            if digest != want:
                break
            observed.append(digest)
            self._hasher.update(buffer[:got])
        kept = transfer.verified_chunks(recorded, observed)
        self.received = self.resumed_from = min(self.size, kept * self.chunk)
        os.ftruncate(self._fd, self.received)
        # The journal again, from the kept chunks only (a stale tail would be trusted by the next resume).
        header = transfer.journal_header(self.digest, self.size, self.chunk)
        lines = "".join(f"{h}\n" for h in observed[:kept])
        tmp = self.journal_path.with_name(self.journal_path.name + ".new")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, (header + lines).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.journal_path)
        self._journal = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        os.fsync(self._fd)
        fsync_dir(self.path.parent)

    def _recorded(self) -> list[str]:
        """The chunk hashes the journal of a previous fetch recorded (none: start over)."""
        try:
            text = read_small(self.journal_path, transfer.MAX_JOURNAL_BYTES).decode("ascii", errors="replace")
        except OSError:
            return []
        parsed = transfer.parse_journal(text, self.digest, self.size)
        if parsed is None or parsed[0] != self.chunk:
            return []
        return parsed[1]

    def write(self, offset: int, data: bytes | memoryview, chunk_digest: str) -> None:
        """The next chunk (already checked against its stated hash), at `offset` == what was received."""
        if self._fd is None or self._journal is None:
            raise OSError("the part file is closed")
        if offset != self.received or self.received + len(data) > self.size:
            raise OSError(f"a chunk at {offset} of {len(data)} bytes does not follow {self.received}")
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        self._hasher.update(data)
        self.received += len(data)
        # No fsync here: a resume re-hashes every kept chunk from disk, so a journal line whose bytes were lost
        # in a crash only cuts the kept prefix there (an fsync every few MiB stalled the in-order writer).
        os.write(self._journal, f"{chunk_digest}\n".encode())

    def sync(self) -> None:
        """Makes what was written durable: the bytes first, then the journal that vouches for them."""
        if self._fd is not None and self._journal is not None:
            os.fsync(self._fd)
            os.fsync(self._journal)

    def finish(self) -> str:
        """fsyncs the part and returns the blake3 of everything received."""
        self.sync()
        return str(self._hasher.hexdigest())

    def land(self, dest: Path) -> None:
        """Renames the verified part to `dest` (never replacing a file there) and removes the journal."""
        self.close()
        os.link(self.path, dest)  # fails if something appeared at dest meanwhile: nothing is overwritten
        unlink_quietly(self.path)
        unlink_quietly(self.journal_path)
        fsync_dir(dest.parent)

    def close(self) -> None:
        """Closes the files, keeping them (a later fetch of the same file resumes from them)."""
        self.sync()
        for fd in (self._fd, self._journal):
            if fd is not None:
                os.close(fd)
        self._fd = self._journal = None

    def discard(self) -> None:
        """Closes and removes the part and its journal: nothing of this fetch is left."""
        for fd in (self._fd, self._journal):
            if fd is not None:
                os.close(fd)
        self._fd = self._journal = None
        unlink_quietly(self.path)
        unlink_quietly(self.journal_path)
        unlink_quietly(self.journal_path.with_name(self.journal_path.name + ".new"))


def open_part(directory: Path, file_name: str, digest: str, size: int, chunk: int) -> PartFile:
    """The part file of this file version in `directory`, kept up to its verified length (see `PartFile`)."""
    part = PartFile(directory, file_name, digest, size, chunk)
    try:
        part._open()
    except BaseException:
        part.discard()
        raise
    return part


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on `directory`'s file system."""
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize
