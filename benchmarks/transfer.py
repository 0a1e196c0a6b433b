"""What the transfer benchmarks share (`handoff_throughput`, `handoff_predict`, `l3_peer_fetch`): a payload
of random bytes, the loopback TCP baseline, and an actor running under a supervisor until it serves."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

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


def tcp_copy(source: Path, dest: Path) -> float:
    """Seconds to send `source` over loopback TCP (`sendfile`) into `dest`, fsynced."""
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
