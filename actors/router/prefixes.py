"""How much of a prompt each instance holds, resident in a slot or in an L3 store (router core, pure).

Rules this module keeps:

* A holding is never trusted by its token list: a runner publishes, for each slot, entry ids
  (`layout.entry_id(identity, tokens[:n])`) at the lengths `marks(len(tokens))` gives, and an L3 inventory lists
  entry ids; the router hashes the *query's own* leading tokens at those lengths. A credit is an exact match of
  identity and every token of that prefix.
* `marks(n)` is every power of two from 16 up to n, and n itself: a slot holding n tokens is credited with the
  longest mark that the query shares (a lower bound of the real shared prefix, never more).
* The work per query is bounded: at most `max_probes` hashes, longest lengths first.
* Resident beats L3 at equal length; the node's own L3 beats a peer's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from actors.l3.layout import entry_id
from messages.generate import HeldPrefix
from messages.l3 import L3Item, PrefixSource

__all__ = ["MIN_MARK", "Credit", "Holdings", "marks", "resident_prefixes"]

MIN_MARK: Final = 16
DEFAULT_MAX_PROBES: Final = 64


def marks(n: int) -> list[int]:
    """The lengths at which a holding of `n` tokens is published: powers of two from 16, and `n`."""
    out = []
    m = MIN_MARK
    while m < n:
        out.append(m)
        m *= 2
    if n > 0:
        out.append(n)
    return out


def resident_prefixes(identity: str, holdings: Iterable[Sequence[int]]) -> tuple[HeldPrefix, ...]:
    """What a runner publishes for its slots' `holdings` (duplicates across slots listed once)."""
    seen: dict[str, int] = {}
    for tokens in holdings:
        held = list(tokens)
        for n in marks(len(held)):
            seen.setdefault(entry_id(identity, held[:n]), n)
    return tuple(HeldPrefix(n, e) for e, n in sorted(seen.items(), key=lambda kv: (kv[1], kv[0])))


class Credit:
    """The prefix an instance is credited with, and where it is."""

    __slots__ = ("n_tokens", "node", "source")

    def __init__(self, n_tokens: int, source: PrefixSource, node: str | None = None) -> None:
        self.n_tokens = n_tokens
        self.source: PrefixSource = source
        self.node = node  # the store holding it (l3 sources)


class Holdings:
    """Every published holding, by identity and length: the resident prefixes of each instance and the entries
    of each node's store."""

    def __init__(self) -> None:
        self._lengths: dict[str, set[int]] = {}  # identity -> lengths held anywhere
        self._resident: dict[str, dict[str, int]] = {}  # instance -> entry -> length
        self._stored: dict[str, set[str]] = {}  # entry -> nodes whose store holds it

    def add_resident(self, instance: str, identity: str, held: Iterable[HeldPrefix]) -> None:
        entries = self._resident.setdefault(instance, {})
        for h in held:
            entries[h.entry] = h.n_tokens
            self._lengths.setdefault(identity, set()).add(h.n_tokens)

    def add_stored(self, node: str, items: Iterable[L3Item]) -> None:
        for item in items:
            self._stored.setdefault(item.entry, set()).add(node)
            self._lengths.setdefault(item.identity, set()).add(item.n_tokens)

    def credit(
        self,
        instance: str,
        node: str,
        identity: str | None,
        query: Sequence[int],
        *,
        max_tokens: int,
        max_probes: int = DEFAULT_MAX_PROBES,
        cache: dict[tuple[str, int], str] | None = None,
    ) -> Credit:
        """The longest prefix of `query` (at most `max_tokens`) that `instance` on `node` has or can restore.
        `cache` shares the hashes between candidates of one query."""
        if identity is None:
            return Credit(0, "cold")
        limit = min(max_tokens, len(query))
        lengths = sorted((n for n in self._lengths.get(identity, ()) if 0 < n <= limit), reverse=True)
        resident = self._resident.get(instance, {})
        cache = {} if cache is None else cache
        for n in lengths[:max_probes]:
            key = (identity, n)
            if key not in cache:
                cache[key] = entry_id(identity, list(query[:n]))
            entry = cache[key]
            if resident.get(entry) == n:
                return Credit(n, "resident")
            nodes = self._stored.get(entry)
            if nodes:
                if node in nodes:
                    return Credit(n, "l3_local", node)
                return Credit(n, "l3_peer", min(nodes))
        return Credit(0, "cold")


def stored_by_node(inventories: Mapping[str, Iterable[L3Item]]) -> Holdings:
    holdings = Holdings()
    for node, items in inventories.items():
        holdings.add_stored(node, items)
    return holdings
