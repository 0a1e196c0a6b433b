"""What the transfer benchmarks share (`handoff_throughput`, `handoff_predict`, `l3_peer_fetch`,
`file_transfer`): a payload of random bytes, the loopback TCP baseline, an actor running under a supervisor
until it serves, and the options and result lines of the file-copy benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

import structlog

from benchmarks.bus_roundtrip import supervised
from runtime.actor import Actor
from runtime.bus import Bus

MIB = 1024 * 1024
A = TypeVar("A", bound=Actor)


def write_random(path: Path, size: int) -> None:
    """`size` random bytes (seeded: the same file every run; nothing deduplicates or compresses)."""
    rng = random.Random(1)
    with path.open("wb") as f:
        left = size
        while left:
            n = min(left, 8 * MIB)
            f.write(rng.randbytes(n))
            left -= n


def tcp_copy(source: Path, dest: Path, *, fsync: bool = True) -> float:
    """Seconds to send `source` over loopback TCP (`sendfile`) into `dest`, fsynced (unless `fsync` is False)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, source.open("rb") as f:
            conn.sendfile(f)

    started = time.perf_counter()
    sender = threading.Thread(target=serve)
    sender.start()
    buffer = memoryview(bytearray(4 * MIB))
    with socket.create_connection(("127.0.0.1", port)) as conn, dest.open("wb") as out:
        while True:
            n = conn.recv_into(buffer)
            if n == 0:
                break
            out.write(buffer[:n])
        out.flush()
        if fsync:
            os.fsync(out.fileno())
    sender.join()
    listener.close()
    return time.perf_counter() - started


@contextlib.asynccontextmanager
async def running(bus: Bus, actor: A, node_id: str, serving: Callable[[], bool]) -> AsyncIterator[A]:
    """`actor` under a supervisor with a journal (`bus_roundtrip.supervised`), once `serving()` says it is
    up (within 60 s: the actors have no "started" event of their own)."""
    async with supervised(bus, [actor], node_id):
        async with asyncio.timeout(60):
            while True:  # polled: there is no event to wait on
                if serving():
                    break
                await asyncio.sleep(0.02)
        yield actor


def transfer_arguments(doc: str | None, *, size_mib: int = 1024, rounds: int = 1) -> argparse.ArgumentParser:
    """The options every file-copy benchmark takes: the payload's size, the rounds, where the files go."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--size-mib", type=int, default=size_mib)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--dir", help="where the temporary files go (default: the system temp dir)")
    return parser


def quiet_logs() -> None:
    """Only warnings from the actors: their per-request logs would cost more than what is measured."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rate(size: int, seconds: float) -> str:
    return f"{size / MIB / seconds:8.0f} MiB/s"


def result_line(label: str, size: int, seconds: float, width: int = 36) -> str:
    """`  label   1.234 s   567 MiB/s`, as the results blocks print a timed copy."""
    return f"  {label:<{width}} {seconds:7.3f} s  {rate(size, seconds)}"
