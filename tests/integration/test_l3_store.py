"""The L3 store on a real file system: round trips, corruption, quarantine, hostile names, and kill -9 of an
ingesting process at many points (nothing partial is ever loadable; reconcile cleans up)."""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import blake3
import pytest

from actors.l3 import layout, store_fetch
from actors.l3.budget import Eviction, StoredEntry, plan_eviction
from actors.l3.commit import Rule
from actors.l3.entry_index import EntryIndex
from actors.l3.files import COPY_BUFFER_BYTES as _COPY_BUFFER_BYTES
from actors.l3.layout import DigestError, Manifest, SegmentRef
from actors.l3.store import (
    _HELPERS,
    CommitRefused,
    CorruptEntry,
    Inventory,
    Store,
    StoreError,
    UnknownEntry,
)

ROOT = Path(__file__).resolve().parents[2]
SEG = layout.MIN_SEGMENT_BYTES  # 64 KiB: many segments from small files
IDENTITY = "1d" * 32
KIND = "llama_slot"


def _payload(path: Path, size: int, seed: int = 0) -> bytes:
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _ingest(store: Store, source: Path, tokens: tuple[int, ...] = (1, 2, 3), *, flush: bool = True) -> Manifest:
    manifest = store.ingest(source, identity=IDENTITY, tokens=tokens, payload_kind=KIND)
    if flush:
        store.flush()
    return manifest


def _entry(m: Manifest) -> str:
    return layout.entry_id(m.identity, m.tokens)


# ---- round trip ----


@pytest.mark.parametrize("size", [0, 1, SEG - 1, SEG, 5 * SEG + 123])
def test_ingest_then_assemble_gives_the_same_bytes(tmp_path: Path, size: int) -> None:
    data = _payload(tmp_path / "slot.bin", size)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin")
    assert (m.total_bytes, len(m.segments), m.n_tokens) == (size, -(-size // SEG), 3)
    assert store.load_manifest(_entry(m)) == m
    store.assemble(m, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data
    inventory = store.reconcile()
    assert [e.entry for e in inventory.entries] == [_entry(m)]
    assert (inventory.tokens, inventory.removed_orphans, inventory.quarantined) == (3, 0, ())


def test_identical_segments_are_stored_once_and_survive_until_no_entry_names_them(tmp_path: Path) -> None:
    a = _payload(tmp_path / "a.bin", 4 * SEG)
    (tmp_path / "b.bin").write_bytes(a[: 2 * SEG] + random.Random(9).randbytes(2 * SEG))  # shares 2 segments
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    ma, mb = _ingest(store, tmp_path / "a.bin", (1,)), _ingest(store, tmp_path / "b.bin", (2,))
    assert len(_files(tmp_path / "l3" / "segments")) == 6
    store.remove_entries([_entry(ma)])
    inventory = store.reconcile()
    assert inventory.removed_orphans == 2 and inventory.bytes == 4 * SEG
    store.assemble(mb, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


def test_ingest_and_assemble_hold_a_bounded_buffer_not_the_payload(tmp_path: Path) -> None:
    seg = 1024 * 1024
    _payload(tmp_path / "slot.bin", 96 * seg)  # 96 MiB
    store = Store(tmp_path / "l3", segment_bytes=seg)
    bound = (1 + _HELPERS) * _COPY_BUFFER_BYTES + seg  # one buffer per thread, and change
    tracemalloc.start()
    try:
        m = _ingest(store, tmp_path / "slot.bin")
        _, ingest_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        store.assemble(m, tmp_path / "out.bin")
        _, assemble_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ingest_peak < bound, ingest_peak
    assert assemble_peak < bound, assemble_peak


def test_the_payload_digest_is_the_root_over_the_segments_as_stored(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", 3 * SEG + 5)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin")
    assert m.payload_digest == layout.payload_root(m.segments)
    for seg in m.segments:  # each segment is named by the blake3 of its stored bytes
        assert blake3.blake3(store.segment_file(seg.digest).read_bytes()).hexdigest() == seg.digest


def test_a_slot_file_rewritten_during_ingest_is_refused_and_nothing_is_loadable(tmp_path: Path) -> None:
    source = tmp_path / "slot.bin"
    _payload(source, 3 * SEG)

    def grow(step: str, n: int) -> None:
        if (step, n) == ("segment", 0):
            with source.open("ab") as f:
                f.write(b"more")

    store = Store(tmp_path / "l3", segment_bytes=SEG, checkpoint=grow)
    with pytest.raises(CommitRefused) as refused:
        _ingest(store, source)
    assert refused.value.refusal.rule is Rule.SEGMENT_COUNT
    assert list((tmp_path / "l3" / "manifests").iterdir()) == []
    assert store.reconcile().removed_orphans == 3


def test_a_source_that_is_not_a_regular_file_is_a_clear_error(tmp_path: Path) -> None:
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(StoreError, match="not a regular file"):
        _ingest(store, tmp_path / "fifo")
    with pytest.raises(StoreError, match="directory"):
        _ingest(store, tmp_path)


def test_repeated_segments_inside_one_payload_are_one_file(tmp_path: Path) -> None:
    # Zero-filled regions repeat; helper threads that settle the same digest at once must not collide.
    data = bytes(8 * SEG) + b"tail"
    (tmp_path / "slot.bin").write_bytes(data)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin")
    assert len({s.digest for s in m.segments}) == 2
    assert len(_files(tmp_path / "l3" / "segments")) == 2
    store.assemble(m, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data
    assert store.reconcile().removed_temp == 0


def test_a_payload_kind_that_is_not_a_short_word_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    with pytest.raises(StoreError, match="payload kind"):
        store.ingest(tmp_path / "slot.bin", identity=IDENTITY, tokens=(1,), payload_kind="../x")
    assert _files(tmp_path / "l3") == []


# ---- corruption and quarantine ----


def _corrupt_one_segment(store: Store, m: Manifest, index: int = 1) -> Path:
    path = store.segment_file(m.segments[index].digest)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    return path


def test_a_corrupted_segment_is_detected_at_assemble_and_the_entry_is_quarantined(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", 3 * SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin")
    _corrupt_one_segment(store, m)
    with pytest.raises(CorruptEntry) as corrupt:
        store.assemble(m, tmp_path / "out.bin")
    assert corrupt.value.refusal.rule is Rule.SEGMENT_MISMATCH and corrupt.value.refusal.index == 1
    assert not (tmp_path / "out.bin").exists()  # never a partial output
    assert [p.name for p in (tmp_path / "l3").rglob(".tmp-*")] == []
    with pytest.raises(UnknownEntry):
        store.load_manifest(_entry(m))
    inventory = store.reconcile()
    assert inventory.entries == () and [q.readable for q in inventory.quarantined] == [True]
    assert all(store.segment_file(s.digest).exists() for s in m.segments)  # quarantine keeps its segments


def test_a_failing_stale_manifest_does_not_quarantine_the_entry_stored_now(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", 2 * SEG, seed=1)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    old = _ingest(store, tmp_path / "slot.bin")
    data = _payload(tmp_path / "slot.bin", 2 * SEG, seed=2)  # the same tokens saved again: new bytes
    new = _ingest(store, tmp_path / "slot.bin")
    store.remove_segments([old.segments[0].digest])
    with pytest.raises(CorruptEntry):
        store.assemble(old, tmp_path / "out.bin")
    assert store.load_manifest(_entry(new)) == new  # still loadable
    store.assemble(new, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data


def test_a_corrupted_segment_is_quarantined_by_a_verifying_reconcile(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", 3 * SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin")
    _corrupt_one_segment(store, m, index=2)
    assert len(store.reconcile().entries) == 1  # same size: only re-hashing sees it
    inventory = store.reconcile(verify_content=True)
    assert inventory.entries == ()
    assert [(q.reason.split(":")[0], q.readable) for q in inventory.quarantined] == [("segment_mismatch", True)]
    assert inventory.removed_orphans == 0
    assert all(store.segment_file(s.digest).exists() for s in m.segments)


def test_an_entry_not_yet_flushed_is_loadable_and_re_hashed_by_the_next_reconcile(tmp_path: Path) -> None:
    # A power cut before the flush may lose segment bytes the manifest names: the pending marker, durable before
    # the manifest, makes the next start re-hash that entry (and only the unflushed ones) before counting it.
    _payload(tmp_path / "slot.bin", 3 * SEG)
    (tmp_path / "slot2.bin").write_bytes(random.Random(5).randbytes(2 * SEG))
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    durable = _ingest(store, tmp_path / "slot.bin", (1,))
    fresh = _ingest(store, tmp_path / "slot2.bin", (2,), flush=False)
    assert store.pending() == [_entry(fresh)]
    store.assemble(fresh, tmp_path / "out.bin")  # loadable before it is durable
    _corrupt_one_segment(store, fresh, index=1)  # what an unwritten page reads back as after the cut
    _corrupt_one_segment(store, durable, index=0)  # a flushed entry is trusted (only a verifying pass sees it)
    inventory = Store(tmp_path / "l3", segment_bytes=SEG).reconcile()
    assert [e.entry for e in inventory.entries] == [_entry(durable)]
    assert [q.reason.split(":")[0] for q in inventory.quarantined] == ["segment_mismatch"]
    assert store.pending() == []
    # A pending entry that verifies is kept and made durable.
    _ingest(store, tmp_path / "slot.bin", (3,), flush=False)
    assert store.pending() != []
    inventory = store.reconcile()
    assert sorted(e.n_tokens for e in inventory.entries) == [1, 1] and store.pending() == []


def test_flush_drops_the_marker_of_an_entry_evicted_before_it(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", 3 * SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin", flush=False)
    store.remove_entries([_entry(m)])  # an eviction takes the marker with the manifest
    store.remove_segments(s.digest for s in m.segments)
    assert store.pending() == [] and store.flush() == 0


def test_a_capture_after_a_failed_flush_reuses_the_marker_left_behind(tmp_path: Path) -> None:
    """The marker of an entry whose flush failed stays; when the manifest then goes another way than an eviction
    (an operator, a reconcile of a missing segment) the next capture of the same state found the marker there
    and an exclusive create refused it: every later capture of that state was dropped."""
    _payload(tmp_path / "slot.bin", 3 * SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin", flush=False)  # as if its flush had failed
    store.manifest_file(_entry(m)).unlink()
    assert store.pending() == [_entry(m)]
    again = _ingest(store, tmp_path / "slot.bin", flush=False)
    assert again == m and store.pending() == [_entry(m)]
    assert store.flush() == 1 and store.pending() == []
    store.assemble(m, tmp_path / "out.bin")


def test_a_truncated_or_missing_segment_is_quarantined_at_reconcile(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", 3 * SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m1 = _ingest(store, tmp_path / "slot.bin", (1,))
    (tmp_path / "slot2.bin").write_bytes(random.Random(5).randbytes(2 * SEG))
    m2 = _ingest(store, tmp_path / "slot2.bin", (2,))
    with store.segment_file(m1.segments[0].digest).open("r+b") as f:
        f.truncate(10)
    store.segment_file(m2.segments[1].digest).unlink()
    inventory = store.reconcile()
    assert inventory.entries == ()
    assert sorted(q.reason.split(":")[0] for q in inventory.quarantined) == ["segment_missing", "segment_size"]


def test_re_ingesting_replaces_a_damaged_segment_with_the_good_bytes(tmp_path: Path) -> None:
    data = _payload(tmp_path / "slot.bin", 3 * SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin")
    _corrupt_one_segment(store, m)
    again = _ingest(store, tmp_path / "slot.bin")
    assert again == m
    store.assemble(m, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data


def test_an_unreadable_manifest_is_quarantined_and_its_segments_are_kept(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", 3 * SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin")
    store.manifest_file(_entry(m)).write_bytes(b'{"version": 1, "identity": "trunc')
    segments_before = _files(tmp_path / "l3" / "segments")
    inventory = store.reconcile()
    assert inventory.entries == ()
    assert [(q.name, q.readable) for q in inventory.quarantined] == [(layout.manifest_name(_entry(m)), False)]
    assert inventory.gc_suspended and inventory.removed_orphans == 0
    assert _files(tmp_path / "l3" / "segments") == segments_before
    again = store.reconcile()  # still there on the next start: still kept
    assert again.gc_suspended and _files(tmp_path / "l3" / "segments") == segments_before


def test_a_quarantined_entry_keeps_its_segments_across_restarts(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", 3 * SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin")
    store.quarantine(_entry(m), "operator")
    for _ in range(2):  # each start finds it in quarantine, readable: its segments are referenced, not orphans
        inventory = store.reconcile()
        assert inventory.entries == () and not inventory.gc_suspended and inventory.removed_orphans == 0
        assert [(q.reason, q.readable) for q in inventory.quarantined] == [("found in quarantine", True)]
    assert all(store.segment_file(s.digest).exists() for s in m.segments)


def test_a_manifest_filed_under_another_entrys_name_is_quarantined(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin", (1,))
    store.manifest_file(_entry(m)).rename(store.manifest_file("ee" * 32))
    inventory = store.reconcile()
    assert inventory.entries == () and inventory.quarantined[0].reason.startswith("identity")


def test_quarantining_twice_keeps_both_copies(tmp_path: Path) -> None:
    _payload(tmp_path / "slot.bin", SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin")
    store.quarantine(_entry(m), "test")
    _ingest(store, tmp_path / "slot.bin")
    store.quarantine(_entry(m), "test")
    assert len(list((tmp_path / "l3" / "quarantine").iterdir())) == 2


def test_an_eviction_plan_applied_to_the_store_frees_exactly_its_segments(tmp_path: Path) -> None:
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    manifests = []
    for i in range(3):
        (tmp_path / f"s{i}.bin").write_bytes(random.Random(i).randbytes(2 * SEG))
        manifests.append(_ingest(store, tmp_path / f"s{i}.bin", (i,)))
    sizes = {s.digest: s.length for m in manifests for s in m.segments}
    entries = [
        StoredEntry(entry=_entry(m), segments=tuple(s.digest for s in m.segments), last_use=i)
        for i, m in enumerate(manifests)
    ]
    plan = plan_eviction(entries, sizes, budget=4 * SEG)
    store.remove_entries(plan.evict)
    store.remove_segments(plan.free)
    assert plan.evict == (_entry(manifests[0]),)
    inventory = store.reconcile()
    assert inventory.bytes == plan.bytes_after and inventory.removed_orphans == 0
    assert len(inventory.entries) == 2


def _entry_index(store: Store, *, last_use: dict[str, float] | None = None) -> EntryIndex:
    """The entry index the L3 actor keeps, as a reconcile pass fills it (`keeper.refill`)."""
    inventory = store.reconcile()
    entry_index = EntryIndex()
    for e in inventory.entries:
        seen = (last_use or {}).get(e.entry, e.mtime_ns / 1e9)
        entry_index.add(
            e.entry, identity=e.identity, n_tokens=e.n_tokens, bytes=e.bytes, last_use=seen, segments=e.segments
        )
    entry_index.set_segments(inventory.segment_bytes)
    entry_index.set_quarantine(
        {q.name: q.segments for q in inventory.quarantined if q.readable},
        (q.name for q in inventory.quarantined if not q.readable),
        sum(q.bytes for q in inventory.quarantined),
    )
    return entry_index


def _evict(store: Store, entry_index: EntryIndex, budget: int) -> Eviction:
    """One pass as the actor runs it: decided and applied to the entry index, then the files go."""
    plan = entry_index.plan(budget)
    entry_index.apply(plan)
    store.apply_eviction(plan.evict, plan.free)
    return plan


def test_the_budget_holds_under_a_burst_of_captures_and_evicts_least_recently_used(tmp_path: Path) -> None:
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    entry_index = EntryIndex()
    budget = 7 * SEG  # room for three 2-segment entries, not four
    manifests = []
    for i in range(10):
        (tmp_path / "slot.bin").write_bytes(random.Random(100 + i).randbytes(2 * SEG))
        m = _ingest(store, tmp_path / "slot.bin", (i,))
        manifests.append(m)
        segments = [(seg.digest, seg.length) for seg in m.segments]
        entry_index.add(
            _entry(m), identity=IDENTITY, n_tokens=1, bytes=m.total_bytes, last_use=float(i), segments=segments
        )
        entry_index.touch(_entry(manifests[0]), 100.0 + i)  # the first entry keeps being restored: most recently used
        entry_index.pin(_entry(m))
        plan = _evict(store, entry_index, budget)
        entry_index.unpin(_entry(m))
        assert plan.fits and plan.bytes_after <= budget and entry_index.stored_bytes == plan.bytes_after
        assert store.reconcile().bytes == plan.bytes_after  # the entry index's count is the disk's
    kept = {e.entry for e in store.reconcile().entries}
    assert (
        kept
        == {_entry(manifests[0]), _entry(manifests[8]), _entry(manifests[9])}
        == {e.entry for e in entry_index.entries()}
    )
    for m in manifests:
        if _entry(m) in kept:
            store.assemble(m, tmp_path / "out.bin")


def test_a_restore_recorded_with_touch_survives_eviction_across_restarts(tmp_path: Path) -> None:
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    ms = []
    for i in range(3):
        (tmp_path / "slot.bin").write_bytes(random.Random(300 + i).randbytes(SEG))
        ms.append(_ingest(store, tmp_path / "slot.bin", (i,)))
        os.utime(store.manifest_file(_entry(ms[-1])), ns=(i * 10**9, i * 10**9))  # committed at t = 0, 1, 2 s
    store.touch(_entry(ms[0]))  # restored now: the most recent use, kept in the manifest's mtime
    fresh = Store(tmp_path / "l3", segment_bytes=SEG)  # a fresh start, no clock passed
    plan = _evict(fresh, _entry_index(fresh), 2 * SEG)
    assert plan.evict == (_entry(ms[1]),)


def test_eviction_never_frees_what_a_pinned_quarantined_or_unreadable_manifest_names(tmp_path: Path) -> None:
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    ms = []
    for i in range(4):
        (tmp_path / "slot.bin").write_bytes(random.Random(200 + i).randbytes(2 * SEG))
        ms.append(_ingest(store, tmp_path / "slot.bin", (i,)))
    store.quarantine(_entry(ms[3]), "test")
    truncated = layout.encode_manifest(ms[1])[:-40]
    store.manifest_file(_entry(ms[1])).write_bytes(truncated)  # reconcile quarantines it, unreadable
    entry_index = _entry_index(store)
    assert entry_index.eviction_blocked == (layout.manifest_name(_entry(ms[1])),)
    entry_index.pin(_entry(ms[2]))
    blocked = _evict(store, entry_index, 0)
    assert blocked.evict == () and blocked.free == () and not blocked.fits  # its segments are unknown
    assert all(store.segment_file(s.digest).exists() for m in ms for s in m.segments)
    quarantined_bytes = entry_index.quarantine_bytes
    assert quarantined_bytes > 0 and entry_index.stored_bytes == 8 * SEG + quarantined_bytes  # quarantine counts
    # repaired by hand: the readable manifest in quarantine keeps its segments, and nothing blocks
    (store.root / layout.QUARANTINE_DIR / layout.manifest_name(_entry(ms[1]))).write_bytes(
        layout.encode_manifest(ms[1])
    )
    entry_index = _entry_index(store)
    entry_index.pin(_entry(ms[2]))
    plan = _evict(store, entry_index, 0)
    assert set(plan.evict) == {_entry(ms[0])} and not plan.fits
    for m in ms[1:]:  # quarantined, pinned, quarantined: kept
        assert all(store.segment_file(s.digest).exists() for s in m.segments)
    assert not any(store.segment_file(s.digest).exists() for s in ms[0].segments)


def test_gc_quarantine_reclaims_what_only_quarantine_named(tmp_path: Path) -> None:
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    (tmp_path / "slot.bin").write_bytes(random.Random(400).randbytes(2 * SEG))
    m = _ingest(store, tmp_path / "slot.bin", (1,))
    store.manifest_file(_entry(m)).write_bytes(b'{"version": 1, "identity": ')  # torn
    first = store.reconcile()
    assert first.gc_suspended and first.bytes == 2 * SEG  # evidence kept: its segments may be anyone's
    assert store.clear_quarantine() == (1, len(b'{"version": 1, "identity": '))
    after = store.reconcile()
    assert not after.gc_suspended and after.removed_orphans == 2 and after.bytes == 0


def test_a_fetch_in_incoming_survives_a_reconcile(tmp_path: Path) -> None:
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    receiver = store_fetch.receive_segment(store, "ab" * 32, SEG)
    receiver.write(b"x" * 100)
    assert receiver.path.parent == store.root / layout.INCOMING_DIR
    inventory = store.reconcile()  # what `mesh-actor l3 gc` runs, maybe beside a fetch
    assert inventory.removed_temp == 0 and receiver.path.exists()
    receiver.abort()
    assert not receiver.path.exists() and store.clear_incoming() == 0


# ---- hostile names ----


@pytest.mark.parametrize("bad", ["../" * 21 + "a", "A" * 64, "a" * 63, "a" * 65, "a" * 63 + "\n", "..", ""])
def test_non_hex_wrong_length_or_traversing_digests_are_refused(tmp_path: Path, bad: str) -> None:
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    with pytest.raises(DigestError):
        store.segment_file(bad)
    with pytest.raises(DigestError):
        store.manifest_file(bad)
    with pytest.raises(DigestError):
        store.load_manifest(bad)
    with pytest.raises(DigestError):
        store.remove_segments([bad])
    with pytest.raises(DigestError):
        store.ingest(tmp_path, identity=bad, tokens=(), payload_kind=KIND)


def test_a_foreign_manifest_naming_a_traversing_segment_is_refused_before_any_file_is_opened(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 10)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    hostile = Manifest(
        identity=IDENTITY,
        tokens=(),
        n_tokens=0,
        payload_kind=KIND,
        total_bytes=10,
        payload_digest="00" * 32,
        segments=(SegmentRef(0, 0, 10, "../../secret"),),
    )
    with pytest.raises(CommitRefused) as refused:
        store.assemble(hostile, tmp_path / "out.bin")
    assert refused.value.refusal.rule is Rule.DIGEST_SYNTAX
    assert not (tmp_path / "out.bin").exists()


def test_a_segment_replaced_by_a_symlink_is_never_followed(tmp_path: Path) -> None:
    data = _payload(tmp_path / "slot.bin", 2 * SEG)
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    m = _ingest(store, tmp_path / "slot.bin")
    outside = tmp_path / "outside"
    outside.write_bytes(data[:SEG])  # the right bytes, but outside the store
    path = store.segment_file(m.segments[0].digest)
    path.unlink()
    path.symlink_to(outside)
    with pytest.raises(CorruptEntry) as corrupt:
        store.verify(m)
    assert corrupt.value.refusal.rule is Rule.SEGMENT_UNREADABLE
    assert store.reconcile().unknown_files == (f"segments/{path.parent.name}/{path.name}",)


def test_files_the_store_did_not_write_are_reported_and_left_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "l3", segment_bytes=SEG)
    (tmp_path / "l3" / "segments" / "zz").mkdir()
    (tmp_path / "l3" / "manifests" / "notes.txt").write_text("hi")
    (tmp_path / "l3" / "segments" / "ab").mkdir()
    (tmp_path / "l3" / "segments" / "ab" / ("cd" * 32)).write_bytes(b"misfiled")
    inventory = store.reconcile()
    assert sorted(inventory.unknown_files) == ["manifests/notes.txt", f"segments/ab/{'cd' * 32}", "segments/zz"]
    assert (tmp_path / "l3" / "manifests" / "notes.txt").exists()


# ---- kill -9 at many points ----

CHILD = textwrap.dedent(
    """
    import logging, os, signal, sys, time
    from pathlib import Path
    import structlog
    from actors.l3.store import Store
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    root, source, kill_step, kill_n, seg = sys.argv[1:]
    def checkpoint(step, n):
        if step == kill_step and n == int(kill_n):
            os.kill(os.getpid(), signal.SIGKILL)
    store = Store(Path(root), segment_bytes=int(seg), checkpoint=checkpoint)
    print("ready", flush=True)
    started = time.perf_counter()
    store.ingest(Path(source), identity="1d" * 32, tokens=range(50), payload_kind="llama_slot")
    store.flush()
    print("done", time.perf_counter() - started, flush=True)
    """
)
N_SEGMENTS = 24


def _spawn(root: Path, source: Path, kill_step: str = "never", kill_n: int = -1) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), str(source), kill_step, str(kill_n), str(SEG)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        bufsize=0,  # unbuffered: readline takes one line, never the next one into a buffer select cannot see
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _read_line(proc: subprocess.Popen[bytes], deadline_s: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=deadline_s):
            proc.kill()
            raise AssertionError("the ingesting child said nothing before its deadline")
    return proc.stdout.readline().decode()


def _said_something(proc: subprocess.Popen[bytes], within_s: float) -> bool:
    """Waits on the child's stdout (its "done" line or its exit), at most `within_s`: a precise kill time."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        return bool(sel.select(timeout=within_s))


def _check_after_crash(root: Path, source_bytes: bytes, out: Path, *, reuse: bool) -> Inventory:
    store = Store(root, segment_bytes=SEG)
    # Before any cleanup: whatever manifest exists names a complete, verified payload.
    for path in (root / "manifests").iterdir():
        if layout.is_temp_name(path.name):
            continue
        m = store.load_manifest(path.name.removesuffix(".json"))
        store.assemble(m, out)
        assert out.read_bytes() == source_bytes
    inventory = store.reconcile()
    assert inventory.quarantined == () and not inventory.gc_suspended
    assert [p for p in root.rglob(".tmp-*")] == []
    assert store.pending() == []  # verified, then made durable (or its marker dropped with its entry)
    referenced = {s.digest for e in inventory.entries for s in store.load_manifest(e.entry).segments}
    assert {p.name for p in (root / "segments").rglob("*") if p.is_file()} == referenced  # no orphans left
    if not reuse:
        return inventory
    # The store is usable afterwards: the same payload ingests and loads.
    m = store.ingest(out.with_name("source.bin"), identity=IDENTITY, tokens=range(50), payload_kind=KIND)
    store.assemble(m, out)
    assert out.read_bytes() == source_bytes
    return inventory


@pytest.mark.timeout(180)
def test_kill_9_of_an_ingesting_process_never_leaves_a_loadable_partial_entry(tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source_bytes = _payload(source, N_SEGMENTS * SEG - 1000)
    out = tmp_path / "out.bin"
    rng = random.Random(20261201)

    # How long one ingest takes here (the fastest of three: the first is slow, cold), so timed kills land in it.
    durations = []
    for probe in range(3):
        proc = _spawn(tmp_path / f"probe{probe}", source)
        assert _read_line(proc, 30) == "ready\n"
        durations.append(float(_read_line(proc, 30).split()[1]))
        assert proc.wait(timeout=30) == 0
        if proc.stdout is not None:
            proc.stdout.close()
    duration = min(durations)

    # Exact points: after any segment's rename, after the last, after the pending marker, after the manifest, after
    # the flush. Then kills at random times, anywhere (mid-write included), until 40 of them have landed while the
    # child was still ingesting.
    # A run that finishes first says how long it took, and later delays are drawn inside the fastest run seen, so
    # the count is reached on a slow machine and on a fast one alike (at most 160 timed runs).
    steps = [("segment", i) for i in range(N_SEGMENTS)]
    steps += [("segments_stored", N_SEGMENTS), ("pending", 0), ("manifest", 0), ("flushed", 1)]
    runs: list[tuple[str, int]] = list(steps) + [("never", -1)] * 160
    outcomes = {"killed": 0, "timed kills": 0, "completed": 0, "left temp files": 0, "left orphans": 0, "committed": 0}
    for i, (step, n) in enumerate(runs):
        if step == "never" and outcomes["timed kills"] >= 40:
            break
        root = tmp_path / f"run{i}"
        proc = _spawn(root, source, step, n)
        try:
            assert _read_line(proc, 30) == "ready\n"
            if step == "never":
                if _said_something(proc, rng.uniform(0, 0.9 * duration)):
                    done = _read_line(proc, 30)
                    duration = min(duration, float(done.split()[1]))
                else:  # still ingesting after the delay
                    proc.send_signal(signal.SIGKILL)
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
        outcomes["killed" if code == -signal.SIGKILL else "completed"] += 1
        outcomes["timed kills"] += step == "never" and code == -signal.SIGKILL
        assert code in (0, -signal.SIGKILL), (step, n, code)
        if step != "never":
            assert code == -signal.SIGKILL
        inventory = _check_after_crash(root, source_bytes, out, reuse=i % 4 == 0)
        outcomes["left temp files"] += inventory.removed_temp > 0
        outcomes["left orphans"] += inventory.removed_orphans > 0
        outcomes["committed"] += len(inventory.entries)
    print(f"kill -9 runs: {outcomes}")
    assert outcomes["timed kills"] >= 40 and outcomes["killed"] >= len(steps) + 40, outcomes
