"""One eviction pass: least recently used first, never pinned or quarantined entries, frees exactly the
segments no kept entry references, and fits the budget whenever evicting everything evictable would."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.l3.budget import StoredEntry, default_budget, plan_eviction


def _e(name: str, segments: str, last_use: float, *, pinned: bool = False, quarantined: bool = False) -> StoredEntry:
    return StoredEntry(entry=name, segments=tuple(segments), last_use=last_use, pinned=pinned, quarantined=quarantined)


SIZES = {"a": 10, "b": 10, "c": 10, "d": 10, "e": 10}


def test_evicts_least_recently_used_first_and_stops_once_under_budget() -> None:
    entries = [_e("new", "a", 3), _e("old", "b", 1), _e("mid", "c", 2)]
    plan = plan_eviction(entries, {"a": 10, "b": 10, "c": 10}, budget=20)
    assert plan.evict == ("old",)
    assert plan.free == ("b",)
    assert (plan.bytes_before, plan.bytes_after, plan.fits) == (30, 20, True)


def test_nothing_is_evicted_when_the_store_fits() -> None:
    plan = plan_eviction([_e("x", "ab", 1)], {"a": 10, "b": 10}, budget=20)
    assert plan.evict == () and plan.free == () and plan.fits


def test_a_shared_segment_is_freed_only_with_its_last_referencing_entry() -> None:
    entries = [_e("old", "ab", 1), _e("new", "bc", 2)]
    plan = plan_eviction(entries, {"a": 10, "b": 10, "c": 10}, budget=20)
    assert plan.evict == ("old",)
    assert plan.free == ("a",)  # b is still referenced by "new"
    assert plan.bytes_after == 20


def test_pinned_and_quarantined_entries_are_never_evicted_and_keep_their_segments() -> None:
    entries = [
        _e("committing", "a", 0, pinned=True),
        _e("bad", "b", 0, quarantined=True),
        _e("shares_with_bad", "bc", 1),
        _e("last", "d", 2),
    ]
    plan = plan_eviction(entries, {"a": 10, "b": 10, "c": 10, "d": 10}, budget=0)
    assert set(plan.evict) == {"shares_with_bad", "last"}
    assert set(plan.free) == {"c", "d"}
    assert plan.bytes_after == 20 and not plan.fits


def test_orphan_segments_are_freed_first() -> None:
    plan = plan_eviction([_e("x", "a", 1)], {"a": 10, "orphan": 50}, budget=10)
    assert plan.evict == () and plan.free == ("orphan",) and plan.fits


def test_a_segment_repeated_inside_one_entry_counts_once() -> None:
    plan = plan_eviction([_e("zeros", "aaaa", 1), _e("keep", "b", 2)], {"a": 10, "b": 10}, budget=10)
    assert plan.evict == ("zeros",) and plan.free == ("a",) and plan.bytes_after == 10


def test_an_entry_listed_twice_or_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        plan_eviction([_e("x", "a", 1), _e("x", "b", 2)], SIZES, budget=0)
    with pytest.raises(ValueError):
        plan_eviction([], SIZES, budget=-1)


def test_the_pass_is_linear_in_references_not_quadratic() -> None:
    # 20,000 entries over one shared segment each: one pass, no rescans (a quadratic pass takes minutes).
    n = 20_000
    entries = [StoredEntry(entry=f"e{i}", segments=(f"s{i}", "shared"), last_use=float(i)) for i in range(n)]
    sizes = {f"s{i}": 1 for i in range(n)} | {"shared": 1}
    plan = plan_eviction(entries, sizes, budget=n // 2)
    assert plan.evict == tuple(f"e{i}" for i in range(n // 2 + 1))
    assert plan.fits


def test_default_budget_is_a_fraction_of_the_disk_and_keeps_free_space() -> None:
    gib = 1 << 30
    assert default_budget(1000 * gib, 900 * gib, 0) == 250 * gib
    assert default_budget(1000 * gib, 20 * gib, 5 * gib, min_free=10 * gib) == 15 * gib
    assert default_budget(100 * gib, 1 * gib, 0, min_free=10 * gib) == 0
    with pytest.raises(ValueError):
        default_budget(1, 1, 1, fraction=0)


@st.composite
def stores(draw: st.DrawFn) -> tuple[list[StoredEntry], dict[str, int], int]:
    digests = [f"s{i}" for i in range(draw(st.integers(1, 12)))]
    sizes = {d: draw(st.integers(0, 100)) for d in digests}
    n = draw(st.integers(0, 10))
    entries = [
        StoredEntry(
            entry=f"e{i}",
            segments=tuple(draw(st.lists(st.sampled_from(digests), max_size=5))),
            last_use=draw(st.floats(0, 100)),
            pinned=draw(st.booleans()),
            quarantined=draw(st.booleans()),
        )
        for i in range(n)
    ]
    return entries, sizes, draw(st.integers(0, 600))


@given(stores())
def test_eviction_properties_hold_for_any_store(store: tuple[list[StoredEntry], dict[str, int], int]) -> None:
    entries, sizes, budget = store
    plan = plan_eviction(entries, sizes, budget)
    evicted = set(plan.evict)
    kept = [e for e in entries if e.entry not in evicted]

    # never evicts pinned or quarantined
    assert not any(e.pinned or e.quarantined for e in entries if e.entry in evicted)
    # frees exactly the segments no kept entry references
    referenced = {d for e in kept for d in e.segments}
    assert set(plan.free) == set(sizes) - referenced
    assert len(plan.free) == len(set(plan.free))
    # the byte count is what remains
    assert plan.bytes_after == sum(size for d, size in sizes.items() if d in referenced)
    assert plan.fits == (plan.bytes_after <= budget)
    # under budget whenever evicting every evictable entry would get there
    protected = {d for e in entries if e.pinned or e.quarantined for d in e.segments}
    floor = sum(size for d, size in sizes.items() if d in protected)
    assert plan.fits == (floor <= budget)
    # least recently used first, and no more than needed: the last one evicted was needed to fit
    evictable = sorted((e for e in entries if not (e.pinned or e.quarantined)), key=lambda e: (e.last_use, e.entry))
    assert list(plan.evict) == [e.entry for e in evictable[: len(plan.evict)]]
    if plan.evict:
        without_last = [e for e in entries if e.entry not in evicted or e.entry == plan.evict[-1]]
        still = {d for e in without_last for d in e.segments}
        assert sum(size for d, size in sizes.items() if d in still) > budget
