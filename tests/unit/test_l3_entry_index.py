"""The L3 entry_index and peer view (pure): pins, last use, inventory order and cap, peer hits."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from actors.l3.entry_index import ITEM_BYTES, EntryIndex, PeerView, items_within
from actors.l3.layout import entry_id
from messages.l3 import L3Inventory, L3Item
from runtime.bus import encode
from runtime.config import ConfigError, load_config

ID = "1d" * 32


def _entry_index(*lengths: int) -> EntryIndex:
    entry_index = EntryIndex()
    for n in lengths:
        tokens = list(range(1, n + 1))
        entry_index.add(entry_id(ID, tokens), identity=ID, n_tokens=n, bytes=n * 10, last_use=float(n))
    return entry_index


def test_lookup_finds_the_longest_stored_prefix_and_forgets_removed_entries() -> None:
    entry_index = _entry_index(10, 20, 30)
    query = list(range(1, 41))
    hit = entry_index.lookup(ID, query, max_tokens=40)
    assert hit is not None and hit.n_tokens == 30
    assert entry_index.lookup(ID, query, max_tokens=25) is not None
    entry_index.remove([hit.entry])
    again = entry_index.lookup(ID, query, max_tokens=40)
    assert again is not None and again.n_tokens == 20


def test_pins_are_counted_per_entry() -> None:
    entry_index = _entry_index(5)
    entry = entry_id(ID, [1, 2, 3, 4, 5])
    entry_index.pin(entry)
    entry_index.pin(entry)
    entry_index.unpin(entry)
    assert entry_index.pinned() == {entry}
    entry_index.unpin(entry)
    assert entry_index.pinned() == frozenset()


def test_inventory_lists_most_recent_first_and_says_when_truncated() -> None:
    entry_index = _entry_index(1, 2, 3, 4)
    entry_index.touch(entry_id(ID, [1]), now=100.0)
    inventory = entry_index.inventory("n", budget_bytes=1000, max_items=2, sent_at=5.0)
    assert [i.n_tokens for i in inventory.items] == [1, 4]
    assert (inventory.entries, inventory.tokens, inventory.truncated) == (4, 10, True)


def test_an_inventory_of_the_allowed_size_fits_its_share_of_max_payload() -> None:
    max_payload = 1 << 20
    n = items_within(max_payload)
    items = tuple(L3Item(identity=ID, n_tokens=1 << 24, entry="ff" * 32, bytes=1 << 40) for _ in range(n))
    inventory = L3Inventory(node_id="n" * 64, entries=n, tokens=n, bytes=1 << 40, budget_bytes=1 << 40, items=items)
    assert len(encode(items[0])) <= ITEM_BYTES
    assert len(encode(inventory)) <= max_payload // 4 + 1024


def test_peer_view_offers_only_longer_prefixes_that_fit_and_forgets_a_node() -> None:
    peers = PeerView()
    long = list(range(1, 51))
    peers.update(
        L3Inventory(
            node_id="b",
            entries=1,
            tokens=50,
            bytes=500,
            budget_bytes=0,
            items=(L3Item(identity=ID, n_tokens=50, entry=entry_id(ID, long), bytes=500),),
        )
    )
    query = [*long, 7]
    hit = peers.lookup(ID, query, max_tokens=51, longer_than=10, max_bytes=1000)
    assert hit is not None and (hit.node, hit.n_tokens) == ("b", 50)
    assert peers.lookup(ID, query, max_tokens=51, longer_than=50, max_bytes=1000) is None
    assert peers.lookup(ID, query, max_tokens=51, longer_than=0, max_bytes=499) is None
    assert peers.lookup(ID, query, max_tokens=49, longer_than=0, max_bytes=1000) is None
    peers.update(L3Inventory(node_id="b", entries=0, tokens=0, bytes=0, budget_bytes=0))  # replaces
    assert peers.lookup(ID, query, max_tokens=51, longer_than=0, max_bytes=1000) is None
    peers.update(
        L3Inventory(
            node_id="c",
            entries=1,
            tokens=50,
            bytes=500,
            budget_bytes=0,
            items=(L3Item(identity=ID, n_tokens=50, entry=entry_id(ID, long), bytes=500),),
        )
    )
    peers.drop("c")
    assert peers.nodes() == ["b"] and peers.lookup(ID, query, max_tokens=51, longer_than=0, max_bytes=1000) is None


def test_l3_budget_comes_from_flag_env_or_file_and_zero_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('l3_budget = "2GiB"\n')
    assert load_config({"data_dir": str(tmp_path)}, {}).l3_budget_bytes == 2 << 30
    env = {"MESH_ACTOR_L3_BUDGET": "512MiB"}
    assert load_config({"data_dir": str(tmp_path)}, env).l3_budget_bytes == 512 << 20
    assert load_config({"data_dir": str(tmp_path), "l3_budget": "0"}, env).l3_budget_bytes == 0
    assert load_config({"data_dir": str(tmp_path / "none")}, {}).l3_budget_bytes is None
    with pytest.raises(ConfigError, match="--l3-budget"):
        load_config({"data_dir": str(tmp_path), "l3_budget": "lots"}, {})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_tokens", -5),
        ("n_tokens", 1 << 40),
        ("identity", "../x"),
        ("entry", "AB" * 32),
        ("bytes", -1),
    ],
)
def test_a_hostile_inventory_item_is_refused_where_it_is_decoded(field: str, value: object) -> None:
    item = {"identity": ID, "n_tokens": 3, "entry": "ab" * 32, "bytes": 10, field: value}
    raw = msgspec.json.encode(
        {
            "node_id": "evil",
            "entries": 1,
            "tokens": 3,
            "bytes": 10,
            "budget_bytes": 100,
            "items": [[item["identity"], item["n_tokens"], item["entry"], item["bytes"]]],
        }
    )
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(raw, type=L3Inventory)


def test_the_peer_view_skips_items_no_store_could_hold_instead_of_raising() -> None:
    good = entry_id(ID, [1, 2, 3])
    hostile = (
        L3Item(identity=ID, n_tokens=-5, entry="ab" * 32, bytes=10),  # what crashed every node's L3 actor
        L3Item(identity="../x", n_tokens=3, entry="cd" * 32, bytes=10),
        L3Item(identity=ID, n_tokens=3, entry="ef" * 32, bytes=-1),
        L3Item(identity=ID, n_tokens=3, entry=good, bytes=10),
    )
    view = PeerView()
    view.update(L3Inventory(node_id="evil", entries=4, tokens=0, bytes=0, budget_bytes=0, items=hostile))
    hit = view.lookup(ID, [1, 2, 3, 4], max_tokens=4, longer_than=0, max_bytes=100)
    assert hit is not None and (hit.entry, hit.node) == (good, "evil")
    view.drop("evil")
    assert view.nodes() == []


def _seg(n: int) -> tuple[str, int]:
    return (f"{n:064x}", 100)


def _stored(entry_index: EntryIndex, name: str, use: float, *segs: int) -> str:
    entry = entry_id(ID, [use_token(name)])
    entry_index.add(
        entry, identity=ID, n_tokens=1, bytes=100 * len(segs), last_use=use, segments=[_seg(s) for s in segs]
    )
    return entry


def use_token(name: str) -> int:
    return sum(name.encode())


def test_a_pass_is_decided_from_the_catalog_and_applied_to_it_in_the_same_step() -> None:
    entry_index = EntryIndex()
    old = _stored(entry_index, "old", 1.0, 1, 2)
    mid = _stored(entry_index, "mid", 2.0, 2, 3)  # shares segment 2 with `old`
    new = _stored(entry_index, "new", 3.0, 4)
    assert entry_index.stored_bytes == 400
    plan = entry_index.plan(300)
    assert plan.evict == (old,) and plan.free == (f"{1:064x}",) and plan.fits  # segment 2 is still mid's
    entry_index.apply(plan)
    assert old not in entry_index and entry_index.stored_bytes == 300
    assert entry_index.lookup(ID, [use_token("old")], max_tokens=1) is None  # a restore asking now finds it gone
    entry_index.pin(mid)  # a restore pinned it before the next pass: kept, the pass says it cannot fit
    plan = entry_index.plan(100)
    assert plan.evict == (new,) and not plan.fits
    entry_index.apply(plan)
    assert mid in entry_index and entry_index.stored_bytes == 200


def test_quarantine_keeps_its_segments_and_counts_against_the_budget() -> None:
    entry_index = EntryIndex()
    bad = _stored(entry_index, "bad", 1.0, 1)
    good = _stored(entry_index, "good", 2.0, 2)
    entry_index.quarantine(bad, "x.json", manifest_bytes=50)
    assert entry_index.quarantined == 1 and entry_index.stored_bytes == 250
    plan = entry_index.plan(120)
    assert plan.evict == (good,) and plan.free == (f"{2:064x}",) and not plan.fits  # evidence is kept
    assert plan.bytes_after == 150
    entry_index.quarantine(good, "x.json")  # a second copy under the same name: both kept
    assert entry_index.quarantined == 2


def test_an_unreadable_quarantined_manifest_blocks_every_eviction() -> None:
    entry_index = EntryIndex()
    _stored(entry_index, "a", 1.0, 1)
    entry_index.set_quarantine({}, ["torn.json"], 30)
    assert entry_index.eviction_blocked == ("torn.json",)
    plan = entry_index.plan(0)
    assert plan.evict == () and plan.free == () and plan.bytes_after == 130 and not plan.fits
    inventory = entry_index.inventory("n", budget_bytes=0, max_items=10, sent_at=0)
    assert inventory.eviction_blocked and inventory.quarantined == 1 and inventory.bytes == 130
    entry_index.set_quarantine({}, [], 0)  # `gc --quarantine` deleted it
    assert entry_index.plan(0).evict != ()


def test_orphan_segments_are_freed_first_and_a_rescan_replaces_the_sizes() -> None:
    entry_index = EntryIndex()
    kept = _stored(entry_index, "kept", 1.0, 1)
    entry_index.set_segments({f"{1:064x}": 100, f"{9:064x}": 500})  # an ingest refused after its segment landed
    plan = entry_index.plan(1000)
    assert plan.evict == () and plan.free == (f"{9:064x}",)
    entry_index.apply(plan)
    assert entry_index.stored_bytes == 100 and kept in entry_index


def test_the_hottest_entries_of_an_identity_are_the_peers_most_recent_in_turns_within_the_bounds() -> None:
    ident, other = "1" * 64, "2" * 64

    def item(n: int, identity: str = ident, size: int = 100) -> L3Item:
        return L3Item(identity=identity, n_tokens=10 * n, entry=f"{n:064x}", bytes=size)

    peers = PeerView()
    # each inventory lists its most recently used first; entry 3 is held by both nodes
    peers.update(L3Inventory(node_id="a", entries=3, tokens=0, bytes=0, budget_bytes=0,
                             items=(item(1), item(9, other), item(3), item(4))))  # fmt: skip
    peers.update(L3Inventory(node_id="b", entries=2, tokens=0, bytes=0, budget_bytes=0, items=(item(3), item(5))))
    chosen = peers.hottest(ident, max_entries=10, max_bytes=10_000)
    assert [(h.node, int(h.entry, 16)) for h in chosen] == [("a", 1), ("b", 3), ("b", 5), ("a", 4)]
    assert [int(h.entry, 16) for h in peers.hottest(ident, max_entries=2, max_bytes=10_000)] == [1, 3]
    assert [int(h.entry, 16) for h in peers.hottest(ident, max_entries=10, max_bytes=250)] == [1, 3]
    assert peers.hottest("3" * 64, max_entries=10, max_bytes=10_000) == []
