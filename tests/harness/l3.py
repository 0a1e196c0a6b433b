"""The L3 store actor under test: a node with its store, slot files, quick timings."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from actors.l3 import layout
from actors.l3.actor import L3Actor, L3Limits
from runtime.bus import Bus
from tests.conftest import supervised

SEG = layout.MIN_SEGMENT_BYTES  # 64 KiB segments: many segments from small files


IDENTITY = "1d" * 32


KIND = "llama_slot"


FAST = L3Limits(inventory_refresh_s=1.0, inventory_debounce_s=0.05, chunk_timeout_s=1.0, capture_queue=64)


def _slot_file(directory: Path, size: int, seed: int) -> tuple[Path, bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    data = random.Random(seed).randbytes(size)
    path = directory / f"slot-{seed}-{time.monotonic_ns()}.bin"
    path.write_bytes(data)
    return path, data


async def _until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Polls `check` (sync or async) until it returns something truthy, within `timeout`."""
    async with asyncio.timeout(timeout):
        while True:
            value = check()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def l3_node(bus: Bus, data_dir: Path, node_id: str, **kwargs: Any) -> AsyncIterator[L3Actor]:
    kwargs.setdefault("limits", FAST)
    kwargs.setdefault("budget_bytes", 64 << 20)
    actor = L3Actor(node_id, data_dir, segment_bytes=SEG, **kwargs)
    async with supervised(bus, [actor], node_id=node_id):
        await _until(lambda: actor.running)
        yield actor
