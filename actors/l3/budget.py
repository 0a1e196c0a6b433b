"""Which entries and segments one eviction pass removes to bring the store under its budget (pure).

Rules this module keeps:

* One pass: reference counts are built once from every entry's segment list, the evictable entries are
  sorted by last use once, and then walked once, oldest first, until the store fits. Cost is
  O(references + n log n), never a rescan per evicted entry.
* Never evicted: an entry that is pinned (being committed or restored) or quarantined. Both keep their
  segments referenced, so nothing they name is freed; a quarantined entry is evidence, not garbage.
* A segment is freed exactly when no kept entry references it: segments shared between entries are counted
  once per entry, and bytes are counted once per segment. Segments no entry references at all (orphans)
  are freed first.
* If even evicting every evictable entry leaves the store over budget, the pass evicts them all and says
  `fits=False`; the caller reports it (an event) rather than looping.
* `default_budget` caps a store that was given no budget: a fraction of the disk, and never eating into a
  minimum of free space.
* A quarantined manifest is evidence for a while, not for ever (`quarantine_due`): it is deleted once it has
  been kept `retention_s`, or `keep_s` while the store needs its room (an eviction pass that had to evict or
  could not fit, a capture refused for lack of room). Why it was quarantined stays in the journal
  (`l3_quarantined`), and so does its deletion (`l3_quarantine_cleared`); the segments only it named are
  orphans then, freed first by the next pass. An unreadable one blocks every eviction until it goes, so
  without this rule a store stopped caching until an operator ran `mesh-actor l3 gc --quarantine`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

__all__ = [
    "Eviction",
    "Quarantined",
    "StoredEntry",
    "default_budget",
    "next_quarantine_due",
    "plan_eviction",
    "quarantine_due",
]


class StoredEntry(msgspec.Struct, frozen=True, kw_only=True):
    entry: str  # entry id (manifest name)
    segments: tuple[str, ...]  # digests, repeats allowed
    last_use: float  # any monotone scale the caller keeps (seconds, a counter)
    pinned: bool = False
    quarantined: bool = False


class Eviction(msgspec.Struct, frozen=True, kw_only=True):
    evict: tuple[str, ...]  # entry ids, oldest first
    free: tuple[str, ...]  # segment digests no kept entry references
    bytes_before: int
    bytes_after: int
    fits: bool  # bytes_after <= budget


def plan_eviction(entries: Iterable[StoredEntry], segment_bytes: Mapping[str, int], budget: int) -> Eviction:
    """The least recently used unpinned, unquarantined entries to evict until the store's segments
    (`segment_bytes`: every stored segment and its size) fit in `budget` bytes."""
    if budget < 0:
        raise ValueError("a budget cannot be negative")
    listed = list(entries)
    refs: dict[str, int] = dict.fromkeys(segment_bytes, 0)
    seen: set[str] = set()
    for e in listed:
        if e.entry in seen:
            raise ValueError(f"entry {e.entry} listed twice")
        seen.add(e.entry)
        for digest in set(e.segments):
            refs[digest] = refs.get(digest, 0) + 1

    total = sum(segment_bytes.values())
    current = total
    freed: list[str] = []
    for digest, count in refs.items():  # orphans go first: they cost nothing to drop
        if count == 0:
            freed.append(digest)
            current -= segment_bytes.get(digest, 0)

    evicted: list[str] = []
    candidates = sorted((e for e in listed if not e.pinned and not e.quarantined), key=lambda e: (e.last_use, e.entry))
    for e in candidates:
        if current <= budget:
            break
        evicted.append(e.entry)
        for digest in set(e.segments):
            refs[digest] -= 1
            if refs[digest] == 0:
                freed.append(digest)
                current -= segment_bytes.get(digest, 0)  # a segment already missing frees nothing
    return Eviction(
        evict=tuple(evicted), free=tuple(freed), bytes_before=total, bytes_after=current, fits=current <= budget
    )


class Quarantined(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # its name in quarantine/
    since: float  # when it was quarantined, on the caller's clock


def _age_limit(retention_s: float, keep_s: float, pressed: bool) -> float:
    if min(retention_s, keep_s) < 0:
        raise ValueError("a quarantine is kept for no negative time")
    return min(retention_s, keep_s) if pressed else retention_s


def quarantine_due(
    held: Iterable[Quarantined], *, now: float, retention_s: float, keep_s: float, pressed: bool
) -> tuple[str, ...]:
    """The quarantined manifests to delete now, oldest first: each kept `retention_s`, and while the store
    needs its room (`pressed`) each kept `keep_s`."""
    limit = _age_limit(retention_s, keep_s, pressed)
    return tuple(q.name for q in sorted(held, key=lambda q: (q.since, q.name)) if now - q.since >= limit)


def next_quarantine_due(
    held: Iterable[Quarantined], *, retention_s: float, keep_s: float, pressed: bool
) -> float | None:
    """When `quarantine_due` next has something to delete (None: nothing is quarantined)."""
    limit = _age_limit(retention_s, keep_s, pressed)
    return min((q.since + limit for q in held), default=None)


def default_budget(
    disk_total: int, disk_free: int, store_bytes: int, fraction: float = 0.25, min_free: int = 10 << 30
) -> int:
    """A capped default: at most `fraction` of the disk, and no more than leaves `min_free` bytes free
    (the store's own bytes count as available to it)."""
    if not 0 < fraction <= 1:
        raise ValueError("fraction must be in (0, 1]")
    if min(disk_total, disk_free, store_bytes, min_free) < 0:
        raise ValueError("sizes cannot be negative")
    return max(0, min(int(disk_total * fraction), store_bytes + disk_free - min_free))
