"""Durable files for the L3 store: the blocking primitives every store module writes and reads through.

Rules these keep (the store's durability and read-back guarantees rest on them): a file is written under a
temporary name, fsynced, renamed into place, and its directory fsynced (`write_atomic`, `make_dir`); bytes are
read with read(2), never mapped, so a bad sector or a file truncated under us is an error, not a SIGBUS
(`hash_fd`, `read_small`, `pread_full`); a size read from disk has a ceiling checked before allocating
(`read_small`). Bytes move through one buffer per thread (`thread_buffer`, `COPY_BUFFER_BYTES`). Blocking:
call from worker threads only. The primitives the files actor shares live in `runtime.durable` and are
re-exported here.
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final

import blake3
import structlog

from actors.l3 import layout
from runtime.durable import OPEN_READ, fsync_dir, make_dir, pread_full, read_small, unlink_quietly

__all__ = [
    "COPY_BUFFER_BYTES",
    "OPEN_CREATE",
    "OPEN_CREATE_RW",
    "OPEN_READ",
    "ReadFailed",
    "copy_range",
    "fsync_dir",
    "hash_fd",
    "intact",
    "make_dir",
    "pread_full",
    "read_small",
    "thread_buffer",
    "unlink_quietly",
    "write_atomic",
]

log = structlog.get_logger(__name__)

OPEN_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
OPEN_CREATE_RW: Final = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
#: Bytes move through one buffer of this size. Large writes also leave the page cache in large folios, which
#: hash back ~1.4x faster than pages written by copy_file_range (benchmarks/RESULTS.md, L3 store).
COPY_BUFFER_BYTES: Final = 4 * 1024 * 1024
_buffers = threading.local()


def write_atomic(final: Path, data: bytes | memoryview) -> None:
    """`final` holds `data`, durably, complete or not at all (its directory is fsynced too)."""
    tmp = final.with_name(layout.temp_name(final.name, secrets.token_hex(8)))
    fd = os.open(tmp, OPEN_CREATE, 0o644)
    try:
        _write_all(lambda b: os.write(fd, b), memoryview(data))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(tmp)
        raise
    os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def copy_range(src: int, dst: int, src_offset: int, length: int, dst_offset: int, buffer: memoryview) -> int:
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


class ReadFailed(Exception):
    """A read of a stored file failed (a write error stays an OSError): the segment's fault, not the caller's."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def thread_buffer() -> memoryview:
    """This thread's copy/hash buffer (helper threads each have one; they live as long as one ingest)."""
    buffer: memoryview | None = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = memoryview(bytearray(COPY_BUFFER_BYTES))
    return buffer


def hash_fd(fd: int, length: int, buffer: memoryview, out: int | None = None, out_offset: int = 0) -> tuple[str, int]:
    """blake3 of the first `length` bytes of an open file and how many there were, read through `buffer`
    (read(2), not a mapping: a bad sector or a truncated file is an error here, never a SIGBUS), each chunk
    written to `out` after it is hashed when given. Read errors raise `ReadFailed`; write errors OSError."""
    hasher = blake3.blake3()  # one thread: callers hash several files at once
    done = 0
    while done < length:
        try:
            got = os.preadv(fd, [buffer[: min(len(buffer), length - done)]], done)
        except OSError as exc:
            raise ReadFailed(exc) from exc
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


def intact(path: Path, digest: str, length: int) -> bool:
    """Whether `path` is a regular file of `length` bytes that hashes to `digest`."""
    try:
        fd = os.open(path, OPEN_READ)
    except FileNotFoundError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != length:
            return False
        if hash_fd(fd, length, thread_buffer())[0] == digest:
            return True
    finally:
        os.close(fd)
    log.warning("l3_segment_damaged_replaced", digest=digest)
    return False


def _write_all(write: Callable[[memoryview], int], data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += write(data[done:])
