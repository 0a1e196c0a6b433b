"""Quarantined L3 manifests go by the store's policy, on a real nats-server (issue 30): an unreadable one no
longer stops captures at the budget until an operator runs `mesh-actor l3 gc --quarantine`, and a corrupt
entry's evidence is deleted with its segments once its retention has passed; each deletion is journaled."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from actors.l3 import layout
from actors.l3.store import Store
from messages.l3 import EntryRequest, VerifyReply
from messages.subjects import Subjects
from runtime.bus import Bus
from tests.conftest import JournalReader, of_type
from tests.harness.l3 import FAST, IDENTITY, KIND, SEG, _slot_file, l3_node

S = Subjects()


def _files(root: Path, directory: str) -> list[Path]:
    return [p for p in (root / directory).rglob("*") if p.is_file()]


@pytest.mark.timeout(60)
async def test_an_unreadable_manifest_is_deleted_once_the_store_needs_room_and_captures_resume(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    root = tmp_path / "a" / "l3"
    torn = layout.manifest_name("ee" * 32)
    Store(root, segment_bytes=SEG).manifest_file("ee" * 32).write_bytes(b'{"version": 1, "identity": ')
    size = 2 * SEG
    budget = 3 * size + SEG  # three entries and the quarantined manifest
    limits = dataclasses.replace(FAST, quarantine_keep_s=1.0)
    async with l3_node(bus, tmp_path / "a", "node-a", budget_bytes=budget, limits=limits) as l3:
        [blocked] = await journal_reader.wait_for(of_type("l3_eviction_blocked", node="node-a"))
        for i in range(5):  # more than fit: the store needs its room
            source, _ = _slot_file(tmp_path / "slots", size, seed=10 + i)
            l3.capture(source, identity=IDENTITY, tokens=[i + 1] * (i + 1), payload_kind=KIND)
        # No operator: the unreadable manifest goes once it has been kept its minimum (1 s here).
        [cleared] = await journal_reader.wait_for(of_type("l3_quarantine_cleared", node="node-a"))
        assert cleared["reason"] == "space" and cleared["manifests"] == [torn] and cleared["count"] == 1
        assert cleared["time"] - blocked["time"] >= 0.9  # journaled a moment after the manifest was moved
        assert _files(root, layout.QUARANTINE_DIR) == [] and not l3.inventory().eviction_blocked
        for i in range(5, 9):  # and the store evicts again instead of refusing captures
            source, _ = _slot_file(tmp_path / "slots", size, seed=10 + i)
            l3.capture(source, identity=IDENTITY, tokens=[i + 1] * (i + 1), payload_kind=KIND)
        settled = await journal_reader.wait_for(
            lambda e: e.get("type") in ("l3_captured", "l3_capture_dropped") and e.get("node") == "node-a", count=9
        )
        assert all(e["type"] == "l3_captured" for e in settled[-4:])
        await journal_reader.wait_for(of_type("l3_evicted", node="node-a"))
        assert l3.inventory().bytes <= budget and l3.inventory().entries == 3


@pytest.mark.timeout(60)
async def test_a_corrupt_entrys_quarantine_is_deleted_after_its_retention_and_its_segments_freed(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    root = tmp_path / "a" / "l3"
    limits = dataclasses.replace(FAST, quarantine_retention_s=1.0)
    async with l3_node(bus, tmp_path / "a", "node-a", limits=limits) as l3:
        source, _ = _slot_file(tmp_path / "slots", 3 * SEG, seed=1)
        l3.capture(source, identity=IDENTITY, tokens=[1, 2, 3], payload_kind=KIND)
        [captured] = await journal_reader.wait_for(of_type("l3_captured", node="node-a"))
        entry = captured["entry"]
        segment = _files(root, layout.SEGMENTS_DIR)[0]
        segment.write_bytes(os.urandom(segment.stat().st_size))  # a bad sector
        reply = await bus.request(S.l3("node-a", "verify"), EntryRequest(entry=entry), VerifyReply, timeout=10)
        assert not reply.ok
        [quarantined] = await journal_reader.wait_for(of_type("l3_quarantined", node="node-a"))
        assert quarantined["entry"] == entry and _files(root, layout.QUARANTINE_DIR) != []
        [cleared] = await journal_reader.wait_for(of_type("l3_quarantine_cleared", node="node-a"))
        assert cleared["reason"] == "retention" and cleared["manifests"] == [layout.manifest_name(entry)]
        assert cleared["time"] - quarantined["time"] >= 0.9
        assert cleared["freed_bytes"] >= 3 * SEG and cleared["stored_bytes"] == 0
        assert _files(root, layout.QUARANTINE_DIR) == [] and _files(root, layout.SEGMENTS_DIR) == []
        assert l3.inventory().quarantined == 0 and l3.inventory().bytes == 0


def test_a_quarantined_manifest_says_since_when_and_only_the_stores_names_are_deleted(tmp_path: Path) -> None:
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    source, _ = _slot_file(tmp_path / "slots", SEG, seed=3)
    manifest = store.ingest(source, identity=IDENTITY, tokens=[4, 5], payload_kind=KIND)
    entry = layout.entry_id(manifest.identity, manifest.tokens)
    os.utime(store.manifest_file(entry), (1.0, 1.0))  # committed long ago
    store.quarantine(entry, "test")
    foreign = tmp_path / "l3" / layout.QUARANTINE_DIR / "notes.txt"
    foreign.write_text("an operator's post-mortem")
    inventory = store.reconcile()
    by_name = {q.name: q for q in inventory.quarantined}
    assert by_name[layout.manifest_name(entry)].since_ns > 1_000_000_000  # when quarantined, not committed
    assert store.remove_quarantined([layout.manifest_name(entry), "notes.txt"]) > 0
    assert [p.name for p in _files(tmp_path / "l3", layout.QUARANTINE_DIR)] == ["notes.txt"]
    assert store.reconcile().removed_orphans == 0  # the foreign file is unreadable: nothing is collected yet
    foreign.unlink()
    assert store.reconcile().removed_orphans == 1  # the segment only the deleted manifest named
