"""The L3 actor on a real nats-server: capture, inventory, lookup, materialize, restart, budget, quarantine,
peer fetch (with a stalled peer), hostile requests, and `mesh-actor l3 ls --json` through the real CLI."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from actors.l3 import layout
from actors.l3.api import L3Hit, L3Unavailable
from actors.l3.store import Store
from messages.errors import BAD_REQUEST, NOT_FOUND
from messages.l3 import L3Inventory, L3Item, ManifestList, ManifestsRequest
from messages.subjects import Subjects
from runtime import buckets
from runtime.bus import Bus, RemoteError, encode
from runtime.cli import l3 as l3_cli
from tests.conftest import JournalReader, NatsServer, mesh_actor_command, of_type
from tests.harness.l3 import FAST, IDENTITY, KIND, SEG, _slot_file, _until, l3_node

S = Subjects()


async def _inventory(bus: Bus, node: str) -> L3Inventory | None:
    found, _ = await buckets.read_all(bus, S.l3_bucket, L3Inventory)
    return next((inv for key, inv in found if key == node), None)


async def test_capture_is_published_found_and_materialized_byte_for_byte(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    tokens = list(range(1, 101))
    async with l3_node(bus, tmp_path / "a", "node-a") as l3:
        source, data = _slot_file(tmp_path / "slots", 5 * SEG + 17, seed=1)
        l3.capture(source, identity=IDENTITY, tokens=tokens, payload_kind=KIND)
        [captured] = await journal_reader.wait_for(of_type("l3_captured", node="node-a"))
        assert (captured["n_tokens"], captured["bytes"], captured["new_bytes"]) == (100, len(data), len(data))
        async with asyncio.timeout(5):  # the L3 side owns and deletes the slot file (once the capture is settled)
            while source.exists():
                await asyncio.sleep(0.01)

        async def published() -> L3Inventory | None:
            inv = await _inventory(bus, "node-a")
            return inv if inv is not None and inv.entries == 1 else None

        inventory = await _until(published)
        assert (inventory.tokens, inventory.items[0].n_tokens, inventory.items[0].identity) == (100, 100, IDENTITY)

        hit = await l3.lookup(IDENTITY, [*tokens, 7, 8, 9], max_tokens=102)
        assert hit is not None and (hit.source, hit.n_tokens, hit.node) == ("l3_local", 100, "node-a")
        assert await l3.lookup(IDENTITY, tokens[:99], max_tokens=99) is None
        assert await l3.lookup("2e" * 32, tokens, max_tokens=100) is None

        dest = tmp_path / "restore" / "slot.bin"
        dest.parent.mkdir()
        # two callers at once: one fill, both get the exact bytes
        other = tmp_path / "restore" / "other.bin"
        await asyncio.gather(l3.materialize(hit, dest, deadline_s=10), l3.materialize(hit, other, deadline_s=10))
        assert dest.read_bytes() == data and other.read_bytes() == data
        assert sorted(p.name for p in dest.parent.iterdir()) == ["other.bin", "slot.bin"]  # no temp left
        assert list((tmp_path / "a" / "l3" / "staging").iterdir()) == []

        again, _ = _slot_file(tmp_path / "slots", 5 * SEG + 17, seed=1)
        l3.capture(again, identity=IDENTITY, tokens=tokens, payload_kind=KIND)  # the same state: a touch
        await _until(lambda: not again.exists())
    assert len([e for e in journal_reader.events if e.get("type") == "l3_captured"]) == 1


async def test_restart_reconciles_and_keeps_entries(bus: Bus, journal_reader: JournalReader, tmp_path: Path) -> None:
    async with l3_node(bus, tmp_path / "a", "node-a") as l3:
        source, data = _slot_file(tmp_path / "slots", 3 * SEG, seed=2)
        l3.capture(source, identity=IDENTITY, tokens=[5, 6, 7], payload_kind=KIND)
        await journal_reader.wait_for(of_type("l3_captured"))
    assert await l3.lookup(IDENTITY, [5, 6, 7, 8], max_tokens=3) is None  # not running: nothing found
    with pytest.raises(L3Unavailable):
        await l3.materialize(
            L3Hit(entry="ab" * 32, n_tokens=3, bytes=1, node="node-a", source="l3_local"), tmp_path / "x", deadline_s=1
        )
    stray = tmp_path / "a" / "l3" / "segments" / layout.temp_name("0", "deadbeef")
    stray.write_bytes(b"half a segment")  # what a crash mid-ingest leaves
    async with l3_node(bus, tmp_path / "a", "node-a") as restarted:
        hit = await restarted.lookup(IDENTITY, [5, 6, 7, 8], max_tokens=3)
        assert hit is not None and hit.n_tokens == 3
        await restarted.materialize(hit, tmp_path / "out.bin", deadline_s=10)
        assert (tmp_path / "out.bin").read_bytes() == data
        assert not stray.exists()


async def test_budget_holds_under_a_burst_of_captures(bus: Bus, journal_reader: JournalReader, tmp_path: Path) -> None:
    size = 4 * SEG
    budget = 3 * size + SEG  # room for three entries
    async with l3_node(bus, tmp_path / "a", "node-a", budget_bytes=budget) as l3:
        for i in range(30):
            source, _ = _slot_file(tmp_path / "slots", size, seed=100 + i)
            l3.capture(source, identity=IDENTITY, tokens=[i + 1] * (i + 1), payload_kind=KIND)
        await journal_reader.wait_for(lambda e: e.get("type") in ("l3_captured", "l3_capture_dropped"), count=30)
        evictions = await journal_reader.wait_for(of_type("l3_evicted"), count=27, timeout=20)
        stored = sum(p.stat().st_size for p in (tmp_path / "a" / "l3" / "segments").rglob("*") if p.is_file())
        assert stored <= budget
        assert all(e["stored_bytes"] <= budget for e in evictions)
        assert l3.inventory().entries == 3
        # the three most recent survive, the oldest were evicted first
        assert await l3.lookup(IDENTITY, [30] * 30, max_tokens=30) is not None
        assert await l3.lookup(IDENTITY, [1], max_tokens=1) is None
        assert list((tmp_path / "slots").iterdir()) == []  # every slot file deleted


async def test_zero_budget_disables_capture(bus: Bus, journal_reader: JournalReader, tmp_path: Path) -> None:
    async with l3_node(bus, tmp_path / "a", "node-a", budget_bytes=0) as l3:
        source, _ = _slot_file(tmp_path / "slots", SEG, seed=3)
        l3.capture(source, identity=IDENTITY, tokens=[1], payload_kind=KIND)
        [dropped] = await journal_reader.wait_for(of_type("l3_capture_dropped"))
        assert dropped["reason"] == "disabled" and not source.exists()


async def test_unreadable_manifest_is_quarantined_and_its_segments_kept(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    store = Store(tmp_path / "a" / "l3", segment_bytes=SEG)
    source, _ = _slot_file(tmp_path / "slots", 3 * SEG, seed=4)
    manifest = store.ingest(source, identity=IDENTITY, tokens=(1, 2), payload_kind=KIND)
    entry = layout.entry_id(IDENTITY, (1, 2))
    store.manifest_file(entry).write_bytes(b'{"version": 1, "identity": ')  # torn: unreadable
    segments = [store.segment_file(s.digest) for s in manifest.segments]
    async with l3_node(bus, tmp_path / "a", "node-a") as l3:
        [event] = await journal_reader.wait_for(of_type("l3_quarantined", entry=entry))
        assert event["reason"].startswith("unreadable")
        assert all(p.exists() for p in segments)  # evidence, never garbage
        assert await l3.lookup(IDENTITY, [1, 2, 3], max_tokens=3) is None
        assert l3.inventory().quarantined == 1


async def test_corrupt_segment_is_detected_on_materialize_and_quarantined(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    async with l3_node(bus, tmp_path / "a", "node-a") as l3:
        source, _ = _slot_file(tmp_path / "slots", 3 * SEG, seed=5)
        l3.capture(source, identity=IDENTITY, tokens=[9, 9], payload_kind=KIND)
        await journal_reader.wait_for(of_type("l3_captured"))
        hit = await l3.lookup(IDENTITY, [9, 9, 1], max_tokens=2)
        assert hit is not None
        store = Store(tmp_path / "a" / "l3", segment_bytes=SEG)
        victim = store.segment_file(store.load_manifest(hit.entry).segments[1].digest)
        with victim.open("r+b") as f:
            f.seek(100)
            f.write(b"\xff\x00\xff")
        dest = tmp_path / "restore.bin"
        with pytest.raises(L3Unavailable, match="corrupt"):
            await l3.materialize(hit, dest, deadline_s=10)
        assert not dest.exists()
        await journal_reader.wait_for(of_type("l3_quarantined", entry=hit.entry))
        assert await l3.lookup(IDENTITY, [9, 9, 1], max_tokens=2) is None
        assert (tmp_path / "a" / "l3" / "quarantine" / layout.manifest_name(hit.entry)).exists()


@pytest.mark.timeout(90)
async def test_peer_fetch_completes_beside_a_stalled_peer_and_refetch_moves_nothing(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    # A "stalled" node c: it advertises an entry and subscribes to its fetch subjects, but never answers.
    stalled = await bus.nc.subscribe(S.l3("node-c", ">"))
    kv = await buckets.l3(bus, S)
    phantom_tokens = list(range(1, 301))
    phantom = layout.entry_id(IDENTITY, phantom_tokens)
    await kv.put(
        "node-c",
        encode(
            L3Inventory(
                node_id="node-c",
                entries=1,
                tokens=300,
                bytes=SEG,
                budget_bytes=1 << 30,
                items=(L3Item(identity=IDENTITY, n_tokens=300, entry=phantom, bytes=SEG),),
            )
        ),
    )
    tokens = list(range(1, 201))
    async with l3_node(bus, tmp_path / "a", "node-a") as a, l3_node(bus, tmp_path / "b", "node-b") as b:
        source, data = _slot_file(tmp_path / "slots", 9 * SEG + 5, seed=6)
        a.capture(source, identity=IDENTITY, tokens=tokens, payload_kind=KIND)
        twin, _ = _slot_file(tmp_path / "slots", 9 * SEG + 5, seed=6)  # the same bytes under other tokens
        a.capture(twin, identity=IDENTITY, tokens=tokens[:150], payload_kind=KIND)
        await journal_reader.wait_for(of_type("l3_captured", node="node-a"), count=2)

        async def from_a() -> L3Hit | None:
            found = await b.lookup(IDENTITY, [*tokens, 1], max_tokens=201)
            return found if found is not None and found.node == "node-a" else None

        hit = await _until(from_a)
        assert (hit.source, hit.n_tokens) == ("l3_peer", 200)
        stalled_hit = await b.lookup(IDENTITY, [*phantom_tokens, 1], max_tokens=301)
        assert stalled_hit is not None and stalled_hit.node == "node-c"

        started = time.monotonic()
        results = await asyncio.gather(
            b.materialize(stalled_hit, tmp_path / "c.bin", deadline_s=20),
            b.materialize(hit, tmp_path / "b.bin", deadline_s=20),
            return_exceptions=True,
        )
        elapsed = time.monotonic() - started
        assert isinstance(results[0], L3Unavailable) and results[1] is None
        assert elapsed < FAST.chunk_timeout_s + 5  # the stalled peer was given up at its chunk deadline
        assert (tmp_path / "b.bin").read_bytes() == data and not (tmp_path / "c.bin").exists()
        [fetched] = await journal_reader.wait_for(of_type("l3_fetched", node="node-b"))
        assert (fetched["peer"], fetched["bytes"], fetched["moved_bytes"]) == ("node-a", len(data), len(data))

        local = await b.lookup(IDENTITY, [*tokens, 1], max_tokens=201)  # now held: restored locally
        assert local is not None and local.source == "l3_local"
        shorter = await b.lookup(IDENTITY, [*tokens[:150], 1], max_tokens=151)
        assert shorter is not None and (shorter.source, shorter.node) == ("l3_peer", "node-a")
        await b.materialize(shorter, tmp_path / "b2.bin", deadline_s=20)
        fetches = await journal_reader.wait_for(of_type("l3_fetched", node="node-b"), count=2)
        assert fetches[1]["moved_bytes"] == 0  # every segment was held already
        assert (tmp_path / "b2.bin").read_bytes() == data
        leftovers = [p for p in (tmp_path / "b" / "l3").rglob("*") if layout.is_temp_name(p.name)]
        assert leftovers == []
    await stalled.unsubscribe()


async def test_hostile_and_malformed_requests_get_structured_errors(bus: Bus, tmp_path: Path) -> None:
    async with l3_node(bus, tmp_path / "a", "node-a"):
        segment = S.l3("node-a", "segment")
        for body in (
            b'{"digest": "../../../etc/passwd", "length": 10}',
            b'{"digest": "' + b"AB" * 32 + b'", "length": 10}',
            b'{"digest": "' + b"a" * 63 + b'", "length": 10}',
            b"not json",
            b'{"digest": "' + b"ab" * 32 + b'", "length": -1}',
        ):
            msg = await bus.request_raw(segment, body, timeout=5)
            error = json.loads(msg.data)
            assert error["code"] == BAD_REQUEST, body
            assert msg.headers and msg.headers.get("Mesh-Error") == BAD_REQUEST
        msg = await bus.request_raw(S.l3("node-a", "manifest"), b'{"entry": "..%2f..%2fx"}', timeout=5)
        assert json.loads(msg.data)["details"]["path"] == "$.entry"
        msg = await bus.request_raw(segment, b'{"digest": "' + b"ab" * 32 + b'", "length": 10}', timeout=5)
        assert json.loads(msg.data)["code"] == NOT_FOUND
        with pytest.raises(RemoteError) as raised:
            await bus.request(S.l3("node-a", "evict"), {"all": False}, ManifestList, timeout=5)
        assert raised.value.code == BAD_REQUEST
        # still serving
        listing = await bus.request(S.l3("node-a", "manifests"), ManifestsRequest(), ManifestList, timeout=5)
        assert listing.node_id == "node-a" and listing.items == ()


async def test_cli_l3_ls_json_lists_entries_of_every_node(
    bus: Bus, journal_reader: JournalReader, nats_server: NatsServer, tmp_path: Path
) -> None:
    async with l3_node(bus, tmp_path / "a", "node-a") as l3:
        source, data = _slot_file(tmp_path / "slots", 2 * SEG, seed=7)
        l3.capture(source, identity=IDENTITY, tokens=[3, 4, 5], payload_kind=KIND)
        await journal_reader.wait_for(of_type("l3_captured"))
        await _until(lambda: _inventory(bus, "node-a"))

        async def listed() -> list[dict[str, Any]]:
            options = nats_server.options
            assert options.user and options.password
            env = {**os.environ, "MESH_ACTOR_NATS": nats_server.url, "MESH_ACTOR_NATS_USER": options.user}
            env["MESH_ACTOR_NATS_PASSWORD"] = options.password
            proc = await asyncio.create_subprocess_exec(
                *mesh_actor_command(), "l3", "ls", "--json", "--data-dir", str(tmp_path / "cli"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0, err.decode()
            rows: list[dict[str, Any]] = json.loads(out)
            return rows if rows and rows[0]["tokens"] == 3 else []

        rows = await _until(listed, timeout=30)
        assert rows == [
            {
                "node": "node-a",
                "entry": layout.entry_id(IDENTITY, (3, 4, 5)),
                "identity": IDENTITY,
                "tokens": 3,
                "bytes": len(data),
            }
        ]


async def test_cli_stat_verify_and_evict_go_to_the_node(
    bus: Bus, journal_reader: JournalReader, nats_server: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = nats_server.options
    assert options.user and options.password
    secret = tmp_path / "password"
    secret.write_text(options.password + "\n")
    flags = ["--nats", nats_server.url, "--nats-user", options.user, "--nats-password-file", str(secret)]
    parser = argparse.ArgumentParser(prog="mesh-actor")
    l3_cli.register(parser.add_subparsers(dest="command", required=True))

    async def cli(*argv: str) -> tuple[int, Any]:
        args = parser.parse_args([*argv, "--json", *flags])
        code = int(await args.func(args))
        return code, json.loads(capsys.readouterr().out)

    async with l3_node(bus, tmp_path / "a", "node-a") as l3:
        source, data = _slot_file(tmp_path / "slots", 2 * SEG, seed=8)
        l3.capture(source, identity=IDENTITY, tokens=[1, 2], payload_kind=KIND)
        await journal_reader.wait_for(of_type("l3_captured"))
        await _until(lambda: _inventory(bus, "node-a"))
        entry = layout.entry_id(IDENTITY, (1, 2))
        code, stat = await cli("l3", "stat", entry, "--data-dir", str(tmp_path / "cli"))
        assert code == 0 and (stat["n_tokens"], stat["bytes"], stat["segments"]) == (2, len(data), 2)
        code, verified = await cli("l3", "verify", "--data-dir", str(tmp_path / "cli"))
        assert code == 0 and verified == [{"node_id": "node-a", "entry": entry, "ok": True, "detail": ""}]
        code, evicted = await cli("l3", "evict", "--node", "node-a", entry, "--data-dir", str(tmp_path / "cli"))
        assert code == 0 and evicted["evicted"] == [entry] and evicted["freed_bytes"] == len(data)
        await journal_reader.wait_for(of_type("l3_evicted"))
        assert await l3.lookup(IDENTITY, [1, 2, 3], max_tokens=2) is None
        assert not [p for p in (tmp_path / "a" / "l3" / "segments").rglob("*") if p.is_file()]
    # no node runs on the data dir now: --offline works on the store itself, under the data dir's lock
    code, gc = await cli("l3", "gc", "--offline", "--data-dir", str(tmp_path / "a"))
    assert code == 0 and gc["entries"] == 0
