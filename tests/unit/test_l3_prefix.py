"""The prefix index finds the longest stored prefix of a query by hashing the query's own tokens, with a
bounded number of probes, per identity."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.l3.layout import entry_id
from actors.l3.prefix import PrefixIndex

A = "aa" * 32
B = "bb" * 32


def test_the_longest_recorded_prefix_of_the_query_is_found() -> None:
    index = PrefixIndex()
    short = index.add(A, [1, 2, 3])
    long = index.add(A, [1, 2, 3, 4, 5])
    hit = index.longest(A, [1, 2, 3, 4, 5, 6, 7])
    assert hit is not None and (hit.entry, hit.n_tokens, hit.probes) == (long, 5, 1)
    hit = index.longest(A, [1, 2, 3, 9, 9, 9])  # diverges after 3 tokens
    assert hit is not None and (hit.entry, hit.n_tokens, hit.probes) == (short, 3, 2)


def test_a_query_that_diverges_inside_every_recorded_prefix_misses() -> None:
    index = PrefixIndex()
    index.add(A, [1, 2, 3])
    assert index.longest(A, [1, 2, 4, 5]) is None
    assert index.longest(A, [1, 2]) is None  # shorter than anything recorded


def test_identities_never_share_entries() -> None:
    index = PrefixIndex()
    index.add(A, [1, 2, 3])
    assert index.longest(B, [1, 2, 3, 4]) is None


def test_max_tokens_keeps_at_least_one_token_to_evaluate() -> None:
    index = PrefixIndex()
    index.add(A, [1, 2])
    index.add(A, [1, 2, 3])
    hit = index.longest(A, [1, 2, 3], max_tokens=2)
    assert hit is not None and hit.n_tokens == 2


def test_probes_are_bounded_and_longest_first() -> None:
    index = PrefixIndex()
    query = list(range(200))
    index.add(A, query[:10])
    for n in range(100, 200):  # 100 longer lengths recorded, none a prefix of the query
        index.add(A, [*query[: n - 1], 999_999])
    assert index.longest(A, query, max_probes=50) is None  # the short match is beyond the probe bound
    hit = index.longest(A, query, max_probes=200)
    assert hit is not None and hit.n_tokens == 10 and hit.probes == 101
    with pytest.raises(ValueError):
        index.longest(A, query, max_probes=0)


def test_removing_the_last_entry_of_a_length_stops_probing_it() -> None:
    index = PrefixIndex()
    x = index.add(A, [1, 2, 3])
    y = index.add(A, [7, 8, 9])  # same length, another prefix
    index.remove(x)
    assert index.longest(A, [1, 2, 3]) is None
    hit = index.longest(A, [7, 8, 9, 10])
    assert hit is not None and hit.entry == y
    index.remove(y)
    index.remove(y)  # unknown now: ignored
    assert len(index) == 0 and index.longest(A, [7, 8, 9]) is None


@given(
    stored=st.lists(st.lists(st.integers(0, 3), max_size=8), max_size=8),
    query=st.lists(st.integers(0, 3), max_size=10),
)
def test_the_hit_is_the_longest_stored_prefix_exactly(stored: list[list[int]], query: list[int]) -> None:
    index = PrefixIndex()
    for tokens in stored:
        index.add(A, tokens)
    prefixes = [t for t in stored if query[: len(t)] == t]
    hit = index.longest(A, query, max_probes=100)
    if not prefixes:
        assert hit is None
    else:
        best = max(prefixes, key=len)
        assert hit is not None and hit.n_tokens == len(best) and hit.entry == entry_id(A, best)
