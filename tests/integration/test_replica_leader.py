"""Which front door scales (issue 21): the live one with the lowest node id, known from the front doors' records
as they are written and expire (a watch, not a read every second)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import cast

from actors.frontdoor.replicas import ReplicaScaler
from messages.frontdoor import FrontDoorReport
from messages.subjects import Subjects
from runtime import buckets
from runtime.actor import ActorContext
from runtime.bus import Bus, encode

S = Subjects()


async def never(*_: object) -> None:  # pragma: no cover (no replica is added or stopped here)
    raise AssertionError("not called")


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


async def test_the_lowest_live_front_door_leads_and_the_next_takes_over_when_its_record_goes(bus: Bus) -> None:
    doors = await buckets.frontdoors(bus, S)

    def record(node: str) -> bytes:
        return encode(FrontDoorReport(node_id=node, address="http://127.0.0.1:1", auth=False, models=(), sent_at=0.0))

    await doors.put("node-b", record("node-b"))
    await doors.put("node-c", record("node-c"))
    await doors.put("node-0", b"not a report")  # no live door: it does not decode
    await doors.put("node-1", record("node-9"))  # nor one that names another node than its key
    ctx = cast(ActorContext, SimpleNamespace(node_id="node-b"))
    scaler = ReplicaScaler(ctx, {}, lambda _: [], never, never)  # type: ignore[arg-type]
    assert not scaler.leading()  # nothing read yet: nobody leads from here
    watching = asyncio.get_running_loop().create_task(scaler.watch_doors(doors))
    try:
        await until(scaler.leading)  # b, c: b is the lowest
        await doors.put("node-a", record("node-a"))  # a door with a lower id starts
        await until(lambda: not scaler.leading())
        await doors.delete("node-a")  # its record goes (as it expires when the door stops writing it)
        await until(scaler.leading)
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
