"""`mesh-actor run --no-direct-path`: the node neither offers nor dials the direct data path (docs/datapath.md), as
if firewalled: a segment asked of its L3 store is refused on `.offer` with the reason, so the asking node fetches
it over NATS. A node run as by default offers the stream (here: it looks for the segment, and holds none)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from messages.datapath import DirectOffer
from messages.errors import NOT_FOUND, UNAVAILABLE
from messages.l3 import SegmentOfferRequest
from messages.subjects import Subjects
from runtime.bus import Bus, NoResponders, RemoteError
from tests.harness.generate import client
from tests.harness.nodes import joined_node, node

ASK = SegmentOfferRequest(digest="0" * 64, length=4096, chunk=4096, receiver="taker")


async def _offer_refused(bus: Bus, node_id: str) -> RemoteError:
    """The refusal of `node_id`'s L3 actor, once it answers (it subscribes shortly after the node starts)."""
    async with asyncio.timeout(30):
        while True:
            try:
                await bus.request(Subjects().l3(node_id, "offer"), ASK, DirectOffer, timeout=5)
            except NoResponders:
                await asyncio.sleep(0.2)
                continue
            except RemoteError as refused:
                return refused
            raise AssertionError(f"node {node_id} offered a segment it does not hold")


async def test_a_node_run_with_no_direct_path_offers_no_stream_and_a_default_node_does(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    async with node(a, "a"), joined_node(a, b, "b", "--no-direct-path"), client(a) as bus:
        default = await _offer_refused(bus, "a")
        assert default.code == NOT_FOUND and "holds no segment" in default.reply.message
        off = await _offer_refused(bus, "b")
        assert off.code == UNAVAILABLE and "no direct data path" in off.reply.message
