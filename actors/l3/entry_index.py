"""What the node's L3 actor knows between passes over the disk: its own entries and the peers' (pure).

Rules this module keeps:

* `EntryIndex` mirrors the store's committed entries (filled from `Store.reconcile`, kept current by the actor
  after every ingest, fetch, eviction and quarantine) with each entry's last use on the caller's clock, and
  the entries pinned right now (being committed or restored: a count per entry, so two restores of one
  entry pin it until both end). Pinned entries are what an eviction pass must keep.
* It also holds what an eviction pass needs, so that a pass never reads a manifest: each entry's segment
  list, the size of every stored segment, the segments each quarantined manifest names, and the names of
  quarantined manifests that cannot be parsed. `plan` is one pass (`budget.plan_eviction`), decided from
  this state alone; `apply` takes the evicted entries and freed segments out at once, in the same step as
  the decision, so no restore can pin an entry between the decision and the deletion of its files (an entry
  pinned before stays, one asked for after is no longer listed).
* What is counted against the budget (`stored_bytes`): every stored segment once, and the quarantined
  manifest files. Quarantined manifests keep the segments they name. While a quarantined manifest cannot be
  parsed its segments are unknown, so nothing may be freed at all: `eviction_blocked`, and `plan` evicts
  nothing (the caller stops captures that do not fit instead). Each quarantined manifest also has the time
  it was quarantined (`quarantine_held`, what `budget.quarantine_due` judges); `unquarantine` takes out
  those deleted, and the segments only they named are orphans for the next `plan`.
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

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import msgspec

from actors.l3.budget import Eviction, Quarantined, StoredEntry, plan_eviction
from actors.l3.layout import MAX_TOKENS, is_digest, is_quarantine_name
from actors.l3.prefix import DEFAULT_MAX_PROBES, Hit, PrefixIndex
from messages.l3 import MAX_BYTES, L3Inventory, L3Item

__all__ = ["ITEM_BYTES", "EntryIndex", "IndexedEntry", "PeerHit", "PeerView", "items_within"]

#: An upper bound on one encoded `L3Item` (two digests, two integers, array framing).
ITEM_BYTES: Final = 170


def items_within(payload_bytes: int, *, share: float = 0.25) -> int:
    """How many items an inventory may list so that it takes at most `share` of `payload_bytes`."""
    return max(1, int(payload_bytes * share) // ITEM_BYTES)


class IndexedEntry(msgspec.Struct, frozen=True, kw_only=True):
    entry: str
    identity: str
    n_tokens: int
    bytes: int
    last_use: float
    segments: tuple[str, ...] = ()  # the digests the manifest names, in order (repeats allowed)


class EntryIndex:
    def __init__(self) -> None:
        self._entries: dict[str, IndexedEntry] = {}
        self._index = PrefixIndex()
        self._pins: dict[str, int] = {}
        self._sizes: dict[str, int] = {}  # every stored segment: digest -> bytes
        self._segment_total = 0
        self._quarantined: dict[str, tuple[str, ...]] = {}  # quarantined manifest name -> segments it names
        self._unreadable: set[str] = set()  # quarantined manifests that cannot be parsed
        self.quarantine_bytes = 0  # the quarantined manifest files themselves
        self._quarantine_since: dict[str, float] = {}  # quarantined manifest name -> when it was quarantined
        self._quarantine_sizes: dict[str, int] = {}  # quarantined manifest name -> its file's bytes (when known)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry: object) -> bool:
        return entry in self._entries

    @property
    def stored_bytes(self) -> int:
        """What counts against the budget: every stored segment once, and the quarantined manifests."""
        return self._segment_total + self.quarantine_bytes

    @property
    def quarantined(self) -> int:
        return len(self._quarantined) + len(self._unreadable)

    @property
    def eviction_blocked(self) -> tuple[str, ...]:
        """The quarantined manifests that cannot be parsed (while any is there, no segment may be freed)."""
        return tuple(sorted(self._unreadable))

    def get(self, entry: str) -> IndexedEntry | None:
        return self._entries.get(entry)

    def entries(self) -> list[IndexedEntry]:
        """Most recently used first."""
        return sorted(self._entries.values(), key=lambda e: (-e.last_use, e.entry))

    def add(
        self,
        entry: str,
        *,
        identity: str,
        n_tokens: int,
        bytes: int,
        last_use: float,
        segments: Sequence[tuple[str, int]] = (),
    ) -> None:
        """Records a committed entry and the segments it names ((digest, length) each, as in its manifest)."""
        self._entries[entry] = IndexedEntry(
            entry=entry,
            identity=identity,
            n_tokens=n_tokens,
            bytes=bytes,
            last_use=last_use,
            segments=tuple(d for d, _ in segments),
        )
        self._index.add_entry(identity, n_tokens, entry)
        for digest, length in segments:
            self._add_segment(digest, length)

    def _add_segment(self, digest: str, length: int) -> None:
        if digest not in self._sizes:
            self._sizes[digest] = length
            self._segment_total += length

    def remove(self, entries: Iterable[str]) -> None:
        """Entries gone from the store; their segments stay counted until a plan frees them (as orphans)."""
        for entry in entries:
            self._entries.pop(entry, None)
            self._index.remove(entry)

    def quarantine(self, entry: str, name: str, manifest_bytes: int = 0, *, at: float = 0.0) -> None:
        """`entry`'s manifest was moved to quarantine as `name` at `at`: no longer held, its segments kept."""
        held = self._entries.get(entry)
        self.remove([entry])
        key, copy = name, 0
        while key in self._quarantined:  # an earlier copy of the entry is in quarantine too: keep both
            copy += 1
            key = f"{name}.{copy}"
        self._quarantined[key] = held.segments if held is not None else ()
        self._quarantine_since[key] = at
        self._quarantine_sizes[key] = manifest_bytes
        self.quarantine_bytes += manifest_bytes

    def set_quarantine(
        self,
        readable: Mapping[str, Sequence[str]],
        unreadable: Iterable[str],
        nbytes: int,
        *,
        since: Mapping[str, float] | None = None,
        sizes: Mapping[str, int] | None = None,
    ) -> None:
        """What quarantine holds, as a reconcile pass found it (`since`: when each was quarantined, `sizes`: its
        file's bytes; a name left out counts as quarantined at time 0, of unknown size)."""
        self._quarantined = {name: tuple(digests) for name, digests in readable.items()}
        self._unreadable = set(unreadable)
        self.quarantine_bytes = nbytes
        names = self._quarantined.keys() | self._unreadable
        self._quarantine_since = {name: (since or {}).get(name, 0.0) for name in names}
        self._quarantine_sizes = {name: (sizes or {}).get(name, 0) for name in names}

    def quarantine_held(self) -> list[Quarantined]:
        """The quarantined manifests a policy may delete (the names the store gives them: any other file there
        is not the store's) and when each was quarantined."""
        held = sorted(self._quarantine_since.items())
        return [Quarantined(name=name, since=since) for name, since in held if is_quarantine_name(name)]

    def unquarantine(self, names: Iterable[str]) -> None:
        """Quarantined manifests deleted: the segments only they named are orphans for the next `plan`."""
        for name in names:
            self._quarantined.pop(name, None)
            self._unreadable.discard(name)
            self._quarantine_since.pop(name, None)
            self.quarantine_bytes = max(0, self.quarantine_bytes - self._quarantine_sizes.pop(name, 0))

    def set_segments(self, sizes: Mapping[str, int]) -> None:
        """Every stored segment as the disk has it (a reconcile pass, or a rescan after a failed ingest)."""
        self._sizes = dict(sizes)
        self._segment_total = sum(self._sizes.values())

    def segment_sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    def plan(self, budget: int) -> Eviction:
        """One eviction pass over what the entry index holds: the least recently used unpinned entries until the
        store fits `budget`. Nothing at all while `eviction_blocked`."""
        total = self.stored_bytes
        if self._unreadable:
            return Eviction(evict=(), free=(), bytes_before=total, bytes_after=total, fits=total <= budget)
        pins = self._pins
        stored = [
            StoredEntry(entry=e.entry, segments=e.segments, last_use=e.last_use, pinned=e.entry in pins)
            for e in self._entries.values()
        ]
        stored += [
            StoredEntry(entry=f"quarantine/{name}", segments=digests, last_use=0.0, quarantined=True)
            for name, digests in self._quarantined.items()
        ]
        plan = plan_eviction(stored, self._sizes, max(0, budget - self.quarantine_bytes))
        extra = self.quarantine_bytes
        return Eviction(
            evict=plan.evict,
            free=plan.free,
            bytes_before=plan.bytes_before + extra,
            bytes_after=plan.bytes_after + extra,
            fits=plan.bytes_after + extra <= budget,
        )

    def apply(self, plan: Eviction) -> None:
        """Takes a plan's evicted entries and freed segments out (call it in the same step as `plan`)."""
        self.remove(plan.evict)
        for digest in plan.free:
            self._segment_total -= self._sizes.pop(digest, 0)

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

    def pins(self) -> dict[str, int]:
        """The pin counts (a entry index rebuilt by a reconcile pass keeps them: the restores still run)."""
        return dict(self._pins)

    def keep_pins(self, pins: Mapping[str, int]) -> None:
        self._pins = dict(pins)

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
            eviction_blocked=bool(self._unreadable),
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

    def hottest(self, identity: str, *, max_entries: int, max_bytes: int) -> list[PeerHit]:
        """The entries of `identity` peers used most recently (each inventory lists its most recent first: taken
        in turns, rank by rank, ties by node id), distinct, at most `max_entries` and `max_bytes` in all."""
        ranked = sorted(
            (rank, node, item)
            for node, items in self._by_node.items()
            for rank, item in enumerate(i for i in items if i.identity == identity)
        )
        chosen: list[PeerHit] = []
        seen: set[str] = set()
        total = 0
        for _, node, item in ranked:
            if len(chosen) >= max_entries:
                break
            if item.entry in seen or total + item.bytes > max_bytes:
                continue
            seen.add(item.entry)
            total += item.bytes
            chosen.append(PeerHit(node=node, entry=item.entry, n_tokens=item.n_tokens, bytes=item.bytes, probes=0))
        return chosen


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
