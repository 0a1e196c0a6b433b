"""The prefix index: which stored entry holds the longest prefix of a prompt, per identity (pure).

Rules this module keeps:

* An entry holding tokens t[0:n] under identity I is found by its entry id, blake3(I, t[0:n])
  (`layout.entry_id`), so a lookup never trusts a stored token list: it hashes the query's *own* leading
  tokens at each length some entry of I was recorded at, longest first, and a hit is an exact match of
  identity and every token of that prefix.
* A lookup makes at most `max_probes` probes (one hash each), so its cost is bounded whatever the index
  holds; with more recorded lengths than that, the shorter ones are not tried.
* Lengths are reference-counted per identity: removing the last entry of a length stops probing it.
* No clock, no I/O: the store's inventory fills it at startup, the actor keeps it current.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Final

import msgspec

from actors.l3.layout import entry_id

__all__ = ["DEFAULT_MAX_PROBES", "Hit", "PrefixIndex"]

DEFAULT_MAX_PROBES: Final = 64


class Hit(msgspec.Struct, frozen=True, kw_only=True):
    entry: str
    n_tokens: int  # the stored prefix's length: the query's first n_tokens tokens are restored
    probes: int  # hashes computed to find it


class PrefixIndex:
    def __init__(self) -> None:
        self._lengths: dict[str, list[int]] = {}  # identity -> recorded lengths, ascending, unique
        self._counts: dict[tuple[str, int], int] = {}  # (identity, length) -> entries recorded there
        self._entries: dict[str, tuple[str, int]] = {}  # entry id -> (identity, length)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry: object) -> bool:
        return entry in self._entries

    def add(self, identity: str, tokens: Sequence[int]) -> str:
        """Records an entry; returns its id. Adding the same entry twice changes nothing."""
        return self.add_entry(identity, len(tokens), entry_id(identity, list(tokens)))

    def add_entry(self, identity: str, n_tokens: int, entry: str) -> str:
        """Records an entry whose id is known (a reconciled manifest's name, or a peer's inventory item: the
        id is what a lookup probes for, so a wrong one is simply never found)."""
        if entry in self._entries:
            return entry
        if n_tokens < 0:
            raise ValueError("n_tokens must not be negative")
        key = (identity, n_tokens)
        self._entries[entry] = key
        self._counts[key] = self._counts.get(key, 0) + 1
        if self._counts[key] == 1:
            bisect.insort(self._lengths.setdefault(identity, []), n_tokens)
        return entry

    def remove(self, entry: str) -> None:
        """Forgets an entry (evicted, quarantined); an unknown id is ignored."""
        key = self._entries.pop(entry, None)
        if key is None:
            return
        self._counts[key] -= 1
        if self._counts[key] == 0:
            del self._counts[key]
            identity, length = key
            lengths = self._lengths[identity]
            del lengths[bisect.bisect_left(lengths, length)]
            if not lengths:
                del self._lengths[identity]

    def longest(
        self,
        identity: str,
        query: Sequence[int],
        *,
        max_tokens: int | None = None,
        max_probes: int = DEFAULT_MAX_PROBES,
    ) -> Hit | None:
        """The entry holding the longest prefix of `query` (at most `max_tokens` long: a caller that must
        evaluate at least one token passes len(query) - 1), or None."""
        if max_probes < 1:
            raise ValueError("max_probes must be at least 1")
        limit = len(query) if max_tokens is None else min(max_tokens, len(query))
        lengths = self._lengths.get(identity, [])
        start = bisect.bisect_right(lengths, limit)
        tokens = list(query[:limit])
        candidates = lengths[max(start - max_probes, 0) : start]  # the longest `max_probes` lengths that fit
        for probes, n in enumerate(reversed(candidates), start=1):
            entry = entry_id(identity, tokens[:n])
            if entry in self._entries:
                return Hit(entry=entry, n_tokens=n, probes=probes)
        return None
