"""Which front door scales (issue 21): the live one with the lowest node id, known from the front doors' records
as they are written and expire (a watch, not a read every second)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import cast

from actors.frontdoor.replicas import ReplicaScaler
from messages.subjects import Subjects
from runtime import buckets
from runtime.actor import ActorContext
from runtime.bus import Bus

S = Subjects()


async def never(*_: object) -> None:  # pragma: no cover (no replica is added or stopped here)
    raise AssertionError("not called")


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


async def test_the_lowest_live_front_door_leads_and_the_next_takes_over_when_its_record_goes(bus: Bus) -> None:
    doors = await buckets.frontdoors(bus, S)
    await doors.put("node-b", b"{}")
    await doors.put("node-c", b"{}")
    ctx = cast(ActorContext, SimpleNamespace(node_id="node-b"))
    scaler = ReplicaScaler(ctx, {}, lambda _: [], never, never)  # type: ignore[arg-type]
    assert not scaler.leading()  # nothing read yet: nobody leads from here
    watching = asyncio.get_running_loop().create_task(scaler.watch_doors(doors))
    try:
        await until(scaler.leading)  # b, c: b is the lowest
        await doors.put("node-a", b"{}")  # a door with a lower id starts
        await until(lambda: not scaler.leading())
        await doors.delete("node-a")  # its record goes (as it expires when the door stops writing it)
        await until(scaler.leading)
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
