"""A front door asks its own node's router (chaos run: a request the `mesh.generate` queue group handed to a frozen
peer's router waited there until its deadline), and any node's while its own is away."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from runtime.bus import Bus
from tests.harness.doors import SUBJECTS, Router, complete, doors, ready_instance

pytestmark = pytest.mark.timeout(60)


async def test_requests_go_to_the_doors_own_router_never_to_a_frozen_peers(bus: Bus, tmp_path: Path) -> None:
    model = await ready_instance(bus, tmp_path)
    swallowed: list[Msg] = []

    async def frozen(msg: Msg) -> None:  # a peer's router in the queue group that never answers (SIGSTOPped)
        swallowed.append(msg)

    peer = await bus.nc.subscribe(SUBJECTS.generate, queue="router", cb=frozen)
    async with Router(bus, subject=SUBJECTS.router_generate("door-a")) as own, doors(bus, model, count=1) as (port,):
        async with asyncio.timeout(20):  # each would wait 20 s (the model's timeout) if it reached the frozen one
            answers = await asyncio.gather(*(complete(port, "none") for _ in range(6)))
        assert all(a.usage is not None for a in answers) and own.answered == 6
        assert swallowed == []
    # Its own router away (restarting): any node's answers
    await peer.unsubscribe()
    async with Router(bus) as anyone, doors(bus, model, count=1) as (port,):
        async with asyncio.timeout(20):
            assert (await complete(port, "none")).usage is not None
        assert anyone.answered == 1
