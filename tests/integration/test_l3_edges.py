"""The L3 actor at its edges, on a real nats-server: hostile peer inventories, an unreadable manifest under a
small budget, gc beside a fetch, a peer whose inventory lies about sizes, eviction beside a restore, and a
capture's outcome awaited (what a handoff into this node waits for)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from actors.l3 import layout
from messages.l3 import L3Inventory, L3Item
from messages.subjects import Subjects
from runtime import buckets
from runtime.bus import Bus, encode
from tests.conftest import JournalReader, of_type
from tests.integration.test_l3_actor import IDENTITY, KIND, SEG, _slot_file, _until, l3_node

S = Subjects()


def _inventory_json(node: str, items: list[dict[str, object]]) -> bytes:
    """An inventory as raw JSON: a hostile peer writes whatever it likes, no constructor checks it."""
    return json.dumps(
        {
            "node_id": node,
            "entries": len(items),
            "tokens": 0,
            "bytes": 0,
            "budget_bytes": 1 << 30,
            "items": [[i["identity"], i["n_tokens"], i["entry"], i["bytes"]] for i in items],
        }
    ).encode()


async def test_a_hostile_peer_inventory_is_skipped_and_the_actor_keeps_serving(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    kv = await buckets.l3(bus, S)
    good_tokens = list(range(1, 51))
    good = layout.entry_id(IDENTITY, good_tokens)
    async with l3_node(bus, tmp_path / "a", "node-a") as l3:
        # what made every node's L3 actor crash until it gave up: a negative token count, and other lies
        for node, item in (
            ("evil-1", {"identity": IDENTITY, "n_tokens": -5, "entry": "ab" * 32, "bytes": 10}),
            ("evil-2", {"identity": "../x", "n_tokens": 3, "entry": "ab" * 32, "bytes": 10}),
            ("evil-3", {"identity": IDENTITY, "n_tokens": 3, "entry": "AB" * 32, "bytes": -1}),
            ("evil-4", {"identity": IDENTITY, "n_tokens": 1 << 40, "entry": "cd" * 32, "bytes": 1}),
        ):
            await kv.put(node, _inventory_json(node, [item]))
        await kv.put(
            "node-b",
            encode(
                L3Inventory(
                    node_id="node-b",
                    entries=1,
                    tokens=50,
                    bytes=SEG,
                    budget_bytes=1 << 30,
                    items=(L3Item(identity=IDENTITY, n_tokens=50, entry=good, bytes=SEG),),
                )
            ),
        )

        async def from_b() -> bool:
            hit = await l3.lookup(IDENTITY, [*good_tokens, 7], max_tokens=51)
            return hit is not None and hit.node == "node-b"

        await _until(from_b)  # the watch went past every hostile value
        assert l3.running
        source, _ = _slot_file(tmp_path / "slots", SEG, seed=1)
        l3.capture(source, identity=IDENTITY, tokens=[1, 2, 3], payload_kind=KIND)
        await journal_reader.wait_for(of_type("l3_captured", node="node-a"))
        await asyncio.sleep(0)
    assert not [e for e in journal_reader.events if e.get("type") in ("actor_crashed", "actor_gave_up")]
