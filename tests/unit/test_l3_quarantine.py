"""The quarantine policy (issue 30): a quarantined manifest is kept for its retention, or for its minimum once
the store needs its room, then deleted with the segments only it named; an unreadable one no longer blocks
eviction until an operator runs `mesh-actor l3 gc --quarantine`."""

from __future__ import annotations

import pytest

from actors.l3 import layout
from actors.l3.budget import Quarantined, next_quarantine_due, quarantine_due
from actors.l3.entry_index import EntryIndex
from actors.l3.layout import entry_id

ID = "1d" * 32
DAY = 86_400.0


def _name(n: int) -> str:
    return layout.manifest_name(f"{n:064x}")


def _held(*ages: float, now: float = 10_000.0) -> list[Quarantined]:
    return [Quarantined(name=_name(i), since=now - age) for i, age in enumerate(ages)]


def test_a_quarantined_manifest_is_kept_its_retention_then_deleted() -> None:
    held = _held(10.0, DAY - 1, DAY)
    assert quarantine_due(held, now=10_000.0, retention_s=DAY, keep_s=600, pressed=False) == (_name(2),)
    assert next_quarantine_due(held[:2], retention_s=DAY, keep_s=600, pressed=False) == pytest.approx(10_001.0)
    assert next_quarantine_due([], retention_s=DAY, keep_s=600, pressed=False) is None


def test_once_the_store_needs_room_a_quarantined_manifest_is_kept_only_its_minimum_oldest_first() -> None:
    held = _held(599.0, 700.0, 600.0)
    due = quarantine_due(held, now=10_000.0, retention_s=DAY, keep_s=600, pressed=True)
    assert due == (_name(1), _name(2))  # the oldest first; the youngest is evidence a while longer
    assert next_quarantine_due(held[:1], retention_s=DAY, keep_s=600, pressed=True) == pytest.approx(10_001.0)
    with pytest.raises(ValueError, match="negative"):
        quarantine_due(held, now=0.0, retention_s=-1, keep_s=0, pressed=False)


def test_only_the_names_the_store_gives_are_the_policys() -> None:
    name = _name(7)
    assert layout.is_quarantine_name(name) and layout.is_quarantine_name(f"{name}.1")
    assert layout.is_quarantine_name(f"{name}.12")
    for foreign in (f"{name}.0", f"{name}.01", f"{name}.x", "notes.txt", f"{name}.1.2", "x.json", f"{name}.-1"):
        assert not layout.is_quarantine_name(foreign), foreign


def _seg(n: int) -> tuple[str, int]:
    return f"{n:064x}", 100


def test_a_deleted_quarantine_frees_the_segments_only_it_named_at_the_next_pass() -> None:
    entry_index = EntryIndex()
    bad = entry_id(ID, [1])
    kept = entry_id(ID, [2])
    entry_index.add(bad, identity=ID, n_tokens=1, bytes=200, last_use=1.0, segments=[_seg(1), _seg(2)])
    entry_index.add(kept, identity=ID, n_tokens=1, bytes=100, last_use=2.0, segments=[_seg(2)])
    entry_index.quarantine(bad, layout.manifest_name(bad), manifest_bytes=40, at=50.0)
    assert entry_index.quarantine_held() == [Quarantined(name=layout.manifest_name(bad), since=50.0)]
    assert entry_index.plan(1 << 20).free == ()  # evidence: its segments are kept
    entry_index.unquarantine([layout.manifest_name(bad)])
    assert entry_index.quarantined == 0 and entry_index.quarantine_bytes == 0 and entry_index.quarantine_held() == []
    plan = entry_index.plan(1 << 20)
    assert plan.free == (f"{1:064x}",) and plan.evict == ()  # the segment the kept entry names stays


def test_deleting_an_unreadable_quarantine_unblocks_eviction_and_a_foreign_file_is_never_the_policys() -> None:
    entry_index = EntryIndex()
    entry_index.add(entry_id(ID, [1]), identity=ID, n_tokens=1, bytes=100, last_use=1.0, segments=[_seg(1)])
    torn = _name(9)
    entry_index.set_quarantine({}, [torn, "notes.txt"], 70, since={torn: 5.0, "notes.txt": 1.0}, sizes={torn: 30})
    assert list(entry_index.eviction_blocked) == [torn, "notes.txt"]
    assert [q.name for q in entry_index.quarantine_held()] == [torn]  # an operator's file is left to the operator
    entry_index.unquarantine([torn])
    assert list(entry_index.eviction_blocked) == ["notes.txt"] and entry_index.quarantine_bytes == 40
    entry_index.unquarantine(["notes.txt"])  # `gc --quarantine` deletes every file there
    assert not entry_index.eviction_blocked and entry_index.plan(0).evict != ()
