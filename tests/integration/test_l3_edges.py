"""The L3 actor at its edges, on a real nats-server: hostile peer inventories, an unreadable manifest under a
small budget, gc beside a fetch, a peer whose inventory lies about sizes, eviction beside a restore, and a
capture's outcome awaited (what a handoff into this node waits for)."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any, Literal

import pytest

from actors.handoff.actor import HandoffActor, HandoffFailed
from actors.handoff.restore import into_l3
from actors.l3 import layout
from actors.l3.actor import L3Actor
from actors.l3.api import L3Hit, L3Unavailable
from actors.l3.store import Store
from messages.errors import BUSY
from messages.l3 import GcReply, GcRequest, L3Inventory, L3Item
from messages.subjects import Subjects
from runtime import buckets
from runtime.bus import Bus, RemoteError, encode
from runtime.cli import l3 as l3_cli
from tests.conftest import JournalReader, of_type, supervised
from tests.harness.handoff import FAST as HANDOFF
from tests.harness.l3 import FAST, IDENTITY, KIND, SEG, _slot_file, _until, l3_node

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


def _stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "segments").rglob("*") if p.is_file())


@pytest.mark.timeout(60)
async def test_an_unreadable_manifest_stops_captures_at_the_budget_until_gc_quarantine(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    root = tmp_path / "a" / "l3"
    Store(root, segment_bytes=SEG).manifest_file("ee" * 32).write_bytes(b'{"version": 1, "identity": ')  # torn
    size = 2 * SEG
    budget = 3 * size + SEG  # three entries and the quarantined manifest
    async with l3_node(bus, tmp_path / "a", "node-a", budget_bytes=budget) as l3:
        [blocked] = await journal_reader.wait_for(of_type("l3_eviction_blocked", node="node-a"))
        assert blocked["unreadable"] == [layout.manifest_name("ee" * 32)]
        for i in range(8):
            source, _ = _slot_file(tmp_path / "slots", size, seed=10 + i)
            l3.capture(source, identity=IDENTITY, tokens=[i + 1] * (i + 1), payload_kind=KIND)
        settled = await journal_reader.wait_for(
            lambda e: e.get("type") in ("l3_captured", "l3_capture_dropped"), count=8
        )
        dropped = [e for e in settled if e["type"] == "l3_capture_dropped"]
        assert len(dropped) == 5 and all(e["reason"].startswith("eviction_blocked") for e in dropped)
        assert _stored_bytes(root) <= budget  # it grew to 4x its budget before, with 0 evictions
        assert l3.inventory().eviction_blocked and l3.inventory().bytes <= budget

        reply = await bus.request(S.l3("node-a", "gc"), GcRequest(quarantine=True), GcReply, timeout=10)
        assert reply.reclaimed_quarantine == 1 and not reply.gc_suspended
        assert not l3.inventory().eviction_blocked
        for i in range(8, 11):
            source, _ = _slot_file(tmp_path / "slots", size, seed=10 + i)
            l3.capture(source, identity=IDENTITY, tokens=[i + 1] * (i + 1), payload_kind=KIND)
        await journal_reader.wait_for(of_type("l3_captured", node="node-a"), count=6)
        await journal_reader.wait_for(of_type("l3_evicted", node="node-a"), count=3)
        assert _stored_bytes(root) <= budget and l3.inventory().entries == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("budget", [0, SEG])  # capture off; a state larger than the whole budget
async def test_a_handoff_into_a_node_whose_l3_drops_the_capture_fails_at_once(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path, budget: int
) -> None:
    l3 = L3Actor("node-b", tmp_path / "b", budget_bytes=budget, segment_bytes=SEG, limits=FAST)
    a = HandoffActor("node-a", tmp_path / "a", limits=HANDOFF)
    b = HandoffActor("node-b", tmp_path / "b", limits=HANDOFF, restore=into_l3(l3))
    source = tmp_path / "slot.bin"
    source.write_bytes(bytes(3 * SEG))
    async with supervised(bus, [a, b, l3]):
        await _until(lambda: a.running and b.running and l3.running)
        started = time.monotonic()
        with pytest.raises(HandoffFailed) as failed:
            await a.send("node-b", source, identity=IDENTITY, n_tokens=3, tokens=(1, 2, 3))
        elapsed = time.monotonic() - started
        # the receiver's abort or its answer to the commit, whichever the sender reads first: L3's reason in both
        assert failed.value.reason in ("commit_refused", "receiver_aborted")
        assert "restore_failed" in failed.value.detail
        assert ("disabled" if budget == 0 else "over_budget") in failed.value.detail
        assert elapsed < 5  # it held the decode side for the whole restore timeout (120 s) before
        await journal_reader.wait_for(of_type("l3_capture_dropped"))
        await _until(lambda: not any(b.staging.iterdir()))


@pytest.mark.timeout(60)
async def test_an_entry_evicted_a_moment_before_a_restore_is_gone_not_corrupt(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    size = 2 * SEG
    async with l3_node(bus, tmp_path / "a", "node-a", budget_bytes=2 * size) as l3:
        for i in range(2):
            source, _ = _slot_file(tmp_path / "slots", size, seed=30 + i)
            l3.capture(source, identity=IDENTITY, tokens=[i + 1], payload_kind=KIND)
        await journal_reader.wait_for(of_type("l3_captured", node="node-a"), count=2)
        oldest = await l3.lookup(IDENTITY, [1, 9], max_tokens=1)
        assert oldest is not None
        store = l3._keeper.require_store()
        release, deleting = threading.Event(), threading.Event()
        apply = store.apply_eviction

        def slow_apply(evict: Any, free: Any) -> None:  # the eviction's files go slowly (a busy disk)
            deleting.set()
            assert release.wait(20)
            apply(evict, free)

        store.apply_eviction = slow_apply  # type: ignore[method-assign]
        source, _ = _slot_file(tmp_path / "slots", size, seed=32)
        l3.capture(source, identity=IDENTITY, tokens=[3], payload_kind=KIND)  # evicts the oldest
        await asyncio.to_thread(deleting.wait, 20)
        # the eviction was decided and its files are going: a restore of the evicted entry now finds it gone
        assert await l3.lookup(IDENTITY, [1, 9], max_tokens=1) is None
        with pytest.raises(L3Unavailable, match="no longer stored"):
            await l3.materialize(oldest, tmp_path / "restore.bin", deadline_s=10)
        release.set()
        await journal_reader.wait_for(of_type("l3_evicted", node="node-a"))
        newest = await l3.lookup(IDENTITY, [3, 9], max_tokens=1)
        assert newest is not None
        await l3.materialize(newest, tmp_path / "restore.bin", deadline_s=10)
    assert not [e for e in journal_reader.events if e.get("type") == "l3_quarantined"]  # no false quarantine


class _WatchedLock(asyncio.Lock):
    """An `asyncio.Lock` that says when an acquire had to wait."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = asyncio.Event()

    async def acquire(self) -> Literal[True]:
        if self.locked():
            self.waited.set()
        return await super().acquire()


@pytest.mark.timeout(60)
async def test_gc_beside_a_fetch_leaves_the_fetch_whole(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = list(range(1, 41))
    async with l3_node(bus, tmp_path / "a", "node-a") as a, l3_node(bus, tmp_path / "b", "node-b") as b:
        source, data = _slot_file(tmp_path / "slots", 4 * SEG + 3, seed=40)
        a.capture(source, identity=IDENTITY, tokens=tokens, payload_kind=KIND)
        await journal_reader.wait_for(of_type("l3_captured", node="node-a"))

        async def from_a() -> L3Hit | None:
            found = await b.lookup(IDENTITY, [*tokens, 1], max_tokens=41)
            return found if found is not None and found.node == "node-a" else None

        hit = await _until(from_a)
        incoming = tmp_path / "b" / "l3" / layout.INCOMING_DIR
        lock = _WatchedLock()
        monkeypatch.setattr(b._keeper, "mutate", lock)  # the store's lock, telling when someone waits for it
        async with lock:  # a long ingest holds the store: gc waits for it, the fetch starts
            gc = asyncio.create_task(bus.request(S.l3("node-b", "gc"), GcRequest(), GcReply, timeout=20))
            async with asyncio.timeout(10):
                await lock.waited.wait()  # the gc request is in, waiting for the lock
            fill = asyncio.create_task(b.materialize(hit, tmp_path / "b.bin", deadline_s=20))

            def fetched_all() -> bool:
                parts = list(incoming.iterdir()) if incoming.exists() else []
                return len(parts) == 5 and sum(p.stat().st_size for p in parts) == len(data)

            await _until(fetched_all)  # every segment is in, waiting for the lock to commit
        try:
            await gc
        except RemoteError as exc:  # refused: a fetch runs (it may also run; it never touches incoming/)
            assert exc.code == BUSY
        await fill
        assert (tmp_path / "b.bin").read_bytes() == data
        assert list(incoming.iterdir()) == []


async def test_a_peer_fetch_holds_the_manifests_size_not_the_peers_claim(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    tokens = list(range(1, 31))
    async with (
        l3_node(bus, tmp_path / "a", "node-a") as a,
        l3_node(bus, tmp_path / "b", "node-b", budget_bytes=2 * SEG) as b,
    ):
        source, _ = _slot_file(tmp_path / "slots", 6 * SEG, seed=50)
        a.capture(source, identity=IDENTITY, tokens=tokens, payload_kind=KIND)
        [captured] = await journal_reader.wait_for(of_type("l3_captured", node="node-a"))
        lie = L3Hit(entry=captured["entry"], n_tokens=30, bytes=1, node="node-a", source="l3_peer")  # "1 byte"
        with pytest.raises(L3Unavailable, match="budget"):
            await b.materialize(lie, tmp_path / "b.bin", deadline_s=10)
        assert _stored_bytes(tmp_path / "b" / "l3") == 0  # no segment moved
        assert not [e for e in journal_reader.events if e.get("type") == "l3_fetched"]


async def test_cli_gc_quarantine_reclaims_an_unreadable_manifest_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = Store(tmp_path / "a" / "l3", segment_bytes=SEG)
    source, _ = _slot_file(tmp_path / "slots", 3 * SEG, seed=60)
    manifest = store.ingest(source, identity=IDENTITY, tokens=(1,), payload_kind=KIND)
    store.flush()
    store.manifest_file(layout.entry_id(IDENTITY, (1,))).write_bytes(b"{")  # torn
    parser = argparse.ArgumentParser(prog="mesh-actor")
    l3_cli.register(parser.add_subparsers(dest="command", required=True))

    async def gc(*flags: str) -> dict[str, Any]:
        args = parser.parse_args(["l3", "gc", "--offline", "--json", "--data-dir", str(tmp_path / "a"), *flags])
        assert int(await args.func(args)) == 0
        reply: dict[str, Any] = json.loads(capsys.readouterr().out)
        return reply

    plain = await gc()
    assert plain["gc_suspended"] and plain["removed_orphans"] == 0 and plain["reclaimed_quarantine"] == 0
    reclaimed = await gc("--quarantine")
    assert reclaimed["reclaimed_quarantine"] == 1 and not reclaimed["gc_suspended"]
    assert reclaimed["removed_orphans"] == len(manifest.segments) and reclaimed["bytes"] == 0
