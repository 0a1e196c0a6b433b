"""What the node's L3 actor knows between passes over the disk: its own entries and the peers' (pure).

Rules this module keeps:

* `Catalog` mirrors the store's committed entries (filled from `Store.reconcile`, kept current by the actor
  after every ingest, fetch, eviction and quarantine) with each entry's last use on the caller's clock, and
  the entries pinned right now (being committed or restored: a count per entry, so two restores of one
  entry pin it until both end). Pinned entries are what an eviction pass must keep.
* A lookup never reads the disk: it probes the prefix index (`prefix.PrefixIndex`: the query's own tokens,
  longest first, bounded probes).
* The inventory a node publishes lists its entries most recently used first, at most `max_items` of them
  (`truncated` says there are more), so the value stays far under the bus's `max_payload`.
* `PeerView` is the other nodes' published inventories: which node holds which entry. A peer's inventory
  replaces what that peer published before; a node whose key expired is forgotten. A peer hit is offered only
  when it is longer than what this node holds and fits its budget. An item no store could hold (a negative
  or oversized count, an id that is not a digest) is skipped, not trusted: a peer's inventory is hostile
  input, already bounded by its schema where it is decoded, and checked again here so that no caller can
  hand this core something that makes it raise.
* No clock, no I/O: times are passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

from actors.l3.layout import MAX_TOKENS, is_digest
from actors.l3.prefix import DEFAULT_MAX_PROBES, Hit, PrefixIndex
from messages.l3 import MAX_BYTES, L3Inventory, L3Item

__all__ = ["ITEM_BYTES", "Catalog", "CatalogEntry", "PeerHit", "PeerView", "items_within"]

#: An upper bound on one encoded `L3Item` (two digests, two integers, array framing).
ITEM_BYTES: Final = 170


def items_within(payload_bytes: int, *, share: float = 0.25) -> int:
    """How many items an inventory may list so that it takes at most `share` of `payload_bytes`."""
    return max(1, int(payload_bytes * share) // ITEM_BYTES)


class CatalogEntry(msgspec.Struct, frozen=True, kw_only=True):
    entry: str
    identity: str
    n_tokens: int
    bytes: int
    last_use: float


class Catalog:
    def __init__(self) -> None:
        self._entries: dict[str, CatalogEntry] = {}
        self._index = PrefixIndex()
        self._pins: dict[str, int] = {}
        self.stored_bytes = 0  # every stored segment once, as the store last counted it
        self.quarantined = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry: object) -> bool:
        return entry in self._entries

    def get(self, entry: str) -> CatalogEntry | None:
        return self._entries.get(entry)

    def entries(self) -> list[CatalogEntry]:
        """Most recently used first."""
        return sorted(self._entries.values(), key=lambda e: (-e.last_use, e.entry))

    def add(self, entry: str, *, identity: str, n_tokens: int, bytes: int, last_use: float) -> None:
        self._entries[entry] = CatalogEntry(
            entry=entry, identity=identity, n_tokens=n_tokens, bytes=bytes, last_use=last_use
        )
        self._index.add_entry(identity, n_tokens, entry)

    def remove(self, entries: Iterable[str]) -> None:
        for entry in entries:
            self._entries.pop(entry, None)
            self._index.remove(entry)

    def touch(self, entry: str, now: float) -> None:
        found = self._entries.get(entry)
        if found is not None and now > found.last_use:
            self._entries[entry] = msgspec.structs.replace(found, last_use=now)

    def pin(self, entry: str) -> None:
        self._pins[entry] = self._pins.get(entry, 0) + 1

    def unpin(self, entry: str) -> None:
        left = self._pins.get(entry, 0) - 1
        if left > 0:
            self._pins[entry] = left
        else:
            self._pins.pop(entry, None)

    def pinned(self) -> frozenset[str]:
        return frozenset(self._pins)

    def last_use(self) -> dict[str, float]:
        return {e.entry: e.last_use for e in self._entries.values()}

    def lookup(
        self, identity: str, tokens: Sequence[int], *, max_tokens: int, max_probes: int = DEFAULT_MAX_PROBES
    ) -> Hit | None:
        return self._index.longest(identity, tokens, max_tokens=max_tokens, max_probes=max_probes)

    def inventory(self, node_id: str, *, budget_bytes: int, max_items: int, sent_at: float) -> L3Inventory:
        listed = self.entries()
        items = tuple(
            L3Item(identity=e.identity, n_tokens=e.n_tokens, entry=e.entry, bytes=e.bytes) for e in listed[:max_items]
        )
        return L3Inventory(
            node_id=node_id,
            entries=len(listed),
            tokens=sum(e.n_tokens for e in listed),
            bytes=self.stored_bytes,
            budget_bytes=budget_bytes,
            quarantined=self.quarantined,
            items=items,
            truncated=len(listed) > max_items,
            sent_at=sent_at,
        )


class PeerHit(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    entry: str
    n_tokens: int
    bytes: int
    probes: int


class PeerView:
    def __init__(self) -> None:
        self._index = PrefixIndex()
        self._by_node: dict[str, tuple[L3Item, ...]] = {}
        self._holders: dict[str, dict[str, int]] = {}  # entry -> {node: bytes}

    def nodes(self) -> list[str]:
        return sorted(self._by_node)

    def update(self, inventory: L3Inventory) -> None:
        """`inventory` replaces what its node published before."""
        self.drop(inventory.node_id)
        items = tuple(item for item in inventory.items if _plausible(item))
        self._by_node[inventory.node_id] = items
        for item in items:
            self._holders.setdefault(item.entry, {})[inventory.node_id] = item.bytes
            self._index.add_entry(item.identity, item.n_tokens, item.entry)

    def drop(self, node: str) -> None:
        for item in self._by_node.pop(node, ()):
            holders = self._holders.get(item.entry)
            if holders is None:
                continue
            holders.pop(node, None)
            if not holders:
                del self._holders[item.entry]
                self._index.remove(item.entry)

    def lookup(
        self,
        identity: str,
        tokens: Sequence[int],
        *,
        max_tokens: int,
        longer_than: int,
        max_bytes: int,
        max_probes: int = DEFAULT_MAX_PROBES,
    ) -> PeerHit | None:
        """The longest prefix a peer holds, if longer than `longer_than` tokens and at most `max_bytes`
        (what this node's budget can take in); among several holders, the first by node id."""
        hit = self._index.longest(identity, tokens, max_tokens=max_tokens, max_probes=max_probes)
        if hit is None or hit.n_tokens <= longer_than:
            return None
        holders = self._holders.get(hit.entry, {})
        for node in sorted(holders):
            if holders[node] <= max_bytes:
                return PeerHit(
                    node=node, entry=hit.entry, n_tokens=hit.n_tokens, bytes=holders[node], probes=hit.probes
                )
        return None


def _plausible(item: L3Item) -> bool:
    """What a store could hold: digests for ids, counts within their bounds."""
    return (
        is_digest(item.entry)
        and is_digest(item.identity)
        and isinstance(item.n_tokens, int)
        and 0 <= item.n_tokens <= MAX_TOKENS
        and isinstance(item.bytes, int)
        and 0 <= item.bytes <= MAX_BYTES
    )
