"""Durable-file primitives every store writes and reads through (the L3 store, model files from peers).

A directory is created durable in its parent (`make_dir`), a rename is made durable by fsyncing its directory
(`fsync_dir`); bytes are read with read(2), never mapped, so a bad sector or a file truncated under us is an
error, not a SIGBUS (`pread_full`, `read_small`, which checks a size read from disk against a ceiling before
allocating). Blocking: call from worker threads only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Final

__all__ = ["OPEN_READ", "fsync_dir", "make_dir", "pread_full", "read_range", "read_small", "unlink_quietly"]

OPEN_READ: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def make_dir(path: Path) -> None:
    """Creates `path` (and missing parents), each durable in its parent directory."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        return
    except FileNotFoundError:
        make_dir(path.parent)
        os.mkdir(path, 0o755)
    fsync_dir(path.parent)


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Reads into all of `view` from `offset`, fewer bytes only at end of file."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def read_range(path: Path, offset: int, length: int) -> tuple[bytes, int]:
    """Up to `length` bytes of the regular file at `path` from `offset`, and the file's size; the read is bounded
    by the caller's `length` (FileNotFoundError when it is not there, OSError when it is not a regular file)."""
    fd = os.open(path, OPEN_READ)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"{path.name} is not a regular file")
        os.set_blocking(fd, True)
        want = max(0, min(length, info.st_size - offset))
        buffer = bytearray(want)
        got = pread_full(fd, memoryview(buffer), offset)
        return (bytes(buffer) if got == want else bytes(buffer[:got])), info.st_size
    finally:
        os.close(fd)


def read_small(path: Path, ceiling: int) -> bytes:
    """The whole of a small regular file, refused (OSError) past `ceiling` bytes before anything is allocated."""
    fd = os.open(path, OPEN_READ)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > ceiling:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, more than {ceiling}")
        os.set_blocking(fd, True)
        buffer = bytearray(info.st_size)
        got = pread_full(fd, memoryview(buffer), 0)
        return bytes(buffer[:got])
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
