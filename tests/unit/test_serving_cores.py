"""The serving path's pure cores: the slot table, prefix credit and routing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.l3.layout import entry_id
from actors.router.prefixes import Holdings, marks, resident_prefixes
from actors.router.routing import choose
from actors.runner import serving_rules as rules
from actors.runner.slots import PromptLimit, SlotTable, common_prefix, oversize
from messages.errors import BAD_REQUEST, TIMEOUT, UNAVAILABLE
from messages.generate import Candidate, RouteWeights
from messages.l3 import L3Item

IDENTITY = "ab" * 32


# ---- slots ----


def test_the_free_slot_holding_the_longest_prefix_wins_and_ties_go_to_the_least_recently_used() -> None:
    table = SlotTable(3)
    grants = [table.acquire([1, 2, 3]) for _ in range(3)]
    assert [g.slot for g in grants if g] == [0, 1, 2]
    assert table.acquire([1]) is None  # all busy
    table.release(1, [1, 2, 3, 4])
    table.release(0, [9, 9])
    table.release(2, [1, 2])
    grant = table.acquire([1, 2, 3, 4, 5])
    assert grant is not None and (grant.slot, grant.resident) == (1, 4)
    grant = table.acquire([7])  # nothing shared: the least recently released (slot 0)
    assert grant is not None and (grant.slot, grant.resident) == (0, 0)


def test_waiters_are_served_in_arrival_order_and_a_withdrawn_one_loses_its_turn() -> None:
    table = SlotTable(1)
    assert table.acquire([1]) is not None
    first, second = object(), object()
    table.wait(first)
    table.wait(second)
    assert table.queued == 2 and not table.my_turn(first)
    table.release(0, [1])
    assert table.my_turn(first) and not table.my_turn(second)
    assert table.acquire([5]) is None  # a newcomer does not overtake the queue
    table.withdraw(first)
    grant = table.acquire([1, 2], second)
    assert grant is not None and grant.resident == 1 and table.queued == 0


def test_a_finishing_slot_holding_much_more_of_the_prompt_is_waited_for_and_a_small_gain_is_not() -> None:
    table = SlotTable(2, wait_gain=100)
    turn = list(range(1, 501))
    grant = table.acquire(turn)
    assert grant is not None
    table.finishing(grant.slot, turn)  # answered; its state is being captured
    next_turn = [*turn, 7, 8, 9]
    assert table.acquire(next_turn) is None  # 500 tokens held there against 0 free: worth the wait
    other = table.acquire(turn[:50] + [0] * 10)  # 50 in common only: not worth waiting, the free slot serves
    assert other is not None and other.slot != grant.slot
    table.release(other.slot, None)
    table.release(grant.slot, turn)
    again = table.acquire(next_turn)
    assert again is not None and (again.slot, again.resident) == (grant.slot, 500)
    with pytest.raises(ValueError):
        table.finishing(1 - grant.slot, turn)  # only a busy slot finishes


def test_a_prompt_its_slot_can_never_hold_is_refused_before_any_work() -> None:
    limit = PromptLimit(n_ctx_seq=1024, longest_token_bytes=16)
    assert oversize(limit, tokens=1024) is None and oversize(limit, text="x" * 16384) is None
    over_tokens = oversize(limit, tokens=1025)
    assert over_tokens is not None and over_tokens[1] == {"n_prompt_tokens": 1025, "n_ctx": 1024}
    over_text = oversize(limit, text="é" * 8193)  # 16,386 bytes: more than 1,024 tokens of at most 16 bytes
    assert over_text is not None and "16386 bytes" in over_text[0]
    assert oversize(PromptLimit(), text="x" * (1 << 20), tokens=1 << 20) is None  # unknown: nothing refused
    assert oversize(PromptLimit(n_ctx_seq=1024), text="x" * (1 << 20)) is None  # no vocabulary listed


def test_release_of_a_slot_not_acquired_is_refused_and_a_restart_forgets_what_slots_held() -> None:
    table = SlotTable(2)
    with pytest.raises(ValueError):
        table.release(0, None)
    grant = table.acquire([1, 2])
    assert grant is not None
    table.release(grant.slot, [1, 2])
    table.forget()
    again = table.acquire([1, 2])
    assert again is not None and again.resident == 0


@given(st.lists(st.integers(0, 3), max_size=20), st.lists(st.integers(0, 3), max_size=20))
def test_common_prefix_is_the_length_of_the_shared_start(a: list[int], b: list[int]) -> None:
    n = common_prefix(a, b)
    assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])


# ---- prefix credit ----


def test_marks_are_powers_of_two_from_16_and_the_full_length() -> None:
    assert marks(0) == [] and marks(5) == [5] and marks(16) == [16] and marks(40) == [16, 32, 40]


def test_an_instance_is_credited_with_the_longest_mark_it_shares_and_never_more() -> None:
    held = list(range(100))
    holdings = Holdings()
    holdings.add_resident("i1", IDENTITY, resident_prefixes(IDENTITY, [held]))
    query = held[:70] + [999] * 10
    credit = holdings.credit("i1", "n1", IDENTITY, query, max_tokens=len(query))
    assert (credit.n_tokens, credit.source) == (64, "resident")
    assert holdings.credit("i2", "n1", IDENTITY, query, max_tokens=80).source == "cold"  # another instance
    assert holdings.credit("i1", "n1", "cd" * 32, query, max_tokens=80).n_tokens == 0  # another identity
    assert holdings.credit("i1", "n1", IDENTITY, [5, *held[1:]], max_tokens=100).n_tokens == 0  # first token differs


def test_stored_prefixes_credit_the_own_node_before_a_peer_and_resident_before_both() -> None:
    tokens = list(range(300))
    item = L3Item(identity=IDENTITY, n_tokens=299, entry=entry_id(IDENTITY, tokens[:299]), bytes=1000)
    holdings = Holdings()
    holdings.add_stored("n2", [item])
    peer = holdings.credit("i1", "n1", IDENTITY, tokens, max_tokens=299)
    assert (peer.n_tokens, peer.source, peer.node) == (299, "l3_peer", "n2")
    own = holdings.credit("i2", "n2", IDENTITY, tokens, max_tokens=299)
    assert (own.n_tokens, own.source) == (299, "l3_local")
    assert holdings.credit("i1", "n1", IDENTITY, tokens, max_tokens=298).n_tokens == 0  # one short is the limit
    holdings.add_resident("i2", IDENTITY, resident_prefixes(IDENTITY, [tokens[:299]]))
    assert holdings.credit("i2", "n2", IDENTITY, tokens, max_tokens=299).source == "resident"


# ---- routing ----


def _c(iid: str, **fields: object) -> Candidate:
    return Candidate(**{"instance_id": iid, "node": "n", "slots": 2, "busy": 0, "queued": 0, **fields})  # type: ignore[arg-type]


def test_no_candidate_is_no_choice_and_one_is_the_only_choice() -> None:
    assert choose(10, []).chosen is None
    assert choose(10, [_c("a")]).reason == "the only ready instance"


def test_the_instance_holding_the_prefix_wins_until_its_load_costs_more_than_the_prefix_saves() -> None:
    w = RouteWeights()
    holder = _c("b", held_tokens=1000, source="resident")
    assert choose(1100, [_c("a"), holder], w).chosen == "b"
    busy_holder = _c("b", held_tokens=1000, source="resident", busy=2, queued=1)  # full: waits behind two
    assert choose(1100, [_c("a"), busy_holder], w).chosen == "a"
    assert choose(1100, [_c("a"), _c("b", held_tokens=60, source="resident", busy=1)], w).chosen == "a"


def test_ties_go_to_the_larger_holding_then_to_the_natural_order_of_ids() -> None:
    assert choose(10, [_c("i10"), _c("i9"), _c("i2")]).chosen == "i2"
    assert choose(0, [_c("a"), _c("b")]).chosen == "a"
    peer = _c("a", held_tokens=100, source="l3_peer")
    local = _c("b", held_tokens=100, source="l3_local")
    assert choose(200, [peer, local]).chosen == "b"  # a local restore is cheaper than a fetch


def test_inflight_requests_count_as_load_before_the_runner_reports_them() -> None:
    assert choose(10, [_c("a", inflight=3), _c("b")]).chosen == "b"


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 500)), min_size=1, max_size=6))
def test_the_choice_is_the_cheapest_and_the_same_for_the_same_inputs_in_any_order(
    rows: list[tuple[int, int, int]],
) -> None:
    cands = [
        _c(f"i{k}", busy=b, queued=q, held_tokens=h, source="resident" if h else "cold")
        for k, (b, q, h) in enumerate(rows)
    ]
    one = choose(500, cands)
    two = choose(500, list(reversed(cands)))
    assert one.chosen == two.chosen
    assert one.scores[0].cost == min(s.cost for s in one.scores)


def test_without_rollback_a_slot_holding_more_than_the_request_is_worth_nothing() -> None:
    table = SlotTable(2, rollback=False)
    a, b = table.acquire([0]), table.acquire([0])
    assert a is not None and b is not None
    table.release(a.slot, [1, 2, 3, 4])  # more than the next request: cannot be rewound
    table.release(b.slot, [1, 2])  # a prefix of it: extends
    grant = table.acquire([1, 2, 3])
    assert grant is not None and (grant.slot, grant.resident) == (b.slot, 2)
    other = table.acquire([1, 2, 3])
    assert other is not None and other.resident == 0


# ---- phase placement (prefill here or elsewhere) ----

ID = "ef" * 32


def _measured(iid: str, node: str, rate: float, **fields: object) -> Candidate:
    base: dict[str, object] = {
        "instance_id": iid, "node": node, "slots": 2, "busy": 0, "queued": 0, "identity": ID,
        "prefill_tokens_per_s": rate, "state_bytes_per_token": 100_000.0, "state_floor_bytes": 0.0,
    }  # fmt: skip
    return Candidate(**{**base, **fields})  # type: ignore[arg-type]


def test_a_faster_prefill_node_with_a_measured_link_takes_the_long_prompt_and_never_the_short_one() -> None:
    from actors.router.routing import link_key, route

    here, fast = _measured("a", "n1", 100.0), _measured("b", "n2", 1000.0, busy=2, queued=1)
    links = {link_key("n2", "n1"): 1e9}  # 1 GB/s
    long = route(4000, [here, fast], links=links)
    assert long.chosen == "a" and long.prefill_node == "n2" and "break-even" in long.prefill_reason
    short = route(3, [here, fast], links=links)
    assert short.chosen == "a" and short.prefill_node is None  # the handoff's fixed cost is not worth it


def test_a_links_measured_fixed_cost_moves_the_break_even() -> None:
    from actors.router.routing import HANDOFF_FIXED_S, link_key, route

    here, fast = _measured("a", "n1", 100.0), _measured("b", "n2", 1000.0, busy=2, queued=1)
    key = link_key("n2", "n1")
    links = {key: 1e9}
    # 9 ms saved per token, 0.1 ms of transfer per token: 50 ms fixed breaks even at 6 tokens, 2 s at 225.
    assert route(40, [here, fast], links=links).prefill_node == "n2"
    assert route(40, [here, fast], links=links, link_fixed_s={key: HANDOFF_FIXED_S}).prefill_node == "n2"
    slow_start = route(200, [here, fast], links=links, link_fixed_s={key: 2.0})
    assert slow_start.prefill_node is None
    assert route(300, [here, fast], links=links, link_fixed_s={key: 2.0}).prefill_node == "n2"


def test_a_prefill_elsewhere_is_priced_with_what_that_instance_holds_not_with_what_the_decoder_holds() -> None:
    from actors.router.routing import ROUTER_VERSION, link_key, route

    # Issue 17: the decoder held 30,000 of 32,001 tokens (2,000 left: 20 s here); a node twice as fast held
    # nothing. Priced with the decoder's holding, its prefill looked like 10 s; it computes 32,000 tokens (160 s).
    here = _measured("a", "n1", 100.0, held_tokens=30_000, source="resident")
    fast = _measured("b", "n2", 200.0)
    links = {link_key("n2", "n1"): 1e9}
    decision = route(32_001, [here, fast], links=links)
    assert decision.chosen == "a" and decision.prefill_node is None
    assert ROUTER_VERSION == "route-3"  # decisions changed: replay names both versions
    # What the prefill node holds resident it reuses (its slot's cache); the whole state still crosses.
    warm = _measured("b", "n2", 200.0, held_tokens=31_000, source="resident", busy=2, queued=40)  # decodes no more
    moved = route(32_001, [here, warm], links=links)
    assert moved.chosen == "a" and moved.prefill_node == "n2"
    assert moved.prefill_reason.startswith("prefill 1000 tokens on n2: 8.250s with the handoff vs 20.000s for the 2000")
    # A prefix the prefill node holds only in L3 is not restored there for a prefill: nothing is credited.
    stored = _measured("b", "n2", 200.0, held_tokens=31_000, source="l3_local")
    assert route(32_001, [here, stored], links=links).prefill_node is None


def test_a_cold_prompt_is_priced_and_worded_as_before() -> None:
    from actors.router.routing import link_key, route

    here, fast = _measured("a", "n1", 100.0), _measured("b", "n2", 1000.0, busy=2, queued=1)
    decision = route(4001, [here, fast], links={link_key("n2", "n1"): 1e9})
    assert decision.prefill_node == "n2"
    assert decision.prefill_reason == (
        "prefill 4000 tokens on n2: 4.450s with the handoff vs 40.000s here (break-even 6 tokens)"
    )


def test_unmeasured_equal_or_unlinked_candidates_never_disaggregate() -> None:
    from actors.router.routing import link_key, route

    here = _measured("a", "n1", 100.0)
    links = {link_key("n2", "n1"): 1e9}
    assert route(4000, [here, _measured("b", "n2", 100.0, busy=2, queued=1)], links=links).prefill_node is None
    assert route(4000, [here, _measured("b", "n2", 0.0, busy=2, queued=1)], links=links).prefill_node is None
    assert route(4000, [here, _measured("b", "n2", 1000.0, busy=2, queued=1)], links={}).prefill_node is None
    other = _measured("b", "n2", 1000.0, busy=2, queued=1, identity="12" * 32)
    assert route(4000, [here, other], links=links).prefill_node is None  # another model's states


def test_a_full_cache_is_the_requests_failure_not_evidence_against_the_server() -> None:
    full = rules.server_failure(500, "llama-server answered 500: Context size has been exceeded.")
    assert full == rules.Failure(counts=False, code=UNAVAILABLE)
    assert rules.server_failure(500, "llama-server answered 500: Compute error.").counts


def test_a_server_failure_counts_against_its_health_when_it_gave_no_answer_or_a_5xx() -> None:
    # one rule for both ways of serving (the mesh's generate, a client's body passed through)
    assert rules.server_failure(None, "connection refused") == rules.Failure(counts=True, code=UNAVAILABLE)
    assert rules.server_failure(0, "connection reset") == rules.Failure(counts=True, code=UNAVAILABLE)
    assert rules.server_failure(400, "bad grammar") == rules.Failure(counts=False, code=BAD_REQUEST)
    assert rules.server_failure(200, "the stream broke off") == rules.Failure(counts=False, code=UNAVAILABLE)
    assert rules.server_failure(503, "loading model").counts


def test_the_prompt_is_prefilled_where_the_router_said_unless_here_held_or_scoped() -> None:
    route = rules.prefill_route("n2", "n1", resident=0, n_tokens=100, cache_scope="")
    assert route == rules.PrefillRoute("n2")
    assert rules.prefill_route(None, "n1", resident=0, n_tokens=100, cache_scope="") == rules.PrefillRoute(None)
    assert rules.prefill_route("n1", "n1", resident=0, n_tokens=100, cache_scope="").node is None  # here
    assert rules.prefill_route("n2", "n1", resident=99, n_tokens=100, cache_scope="").node is None  # all but one held
    scoped = rules.prefill_route("n2", "n1", resident=0, n_tokens=100, cache_scope="tenant:a")
    assert scoped.node is None and "scoped" in scoped.skipped
    assert rules.prefill_fallback("n2", UNAVAILABLE) == "prefill on n2 failed (unavailable): computed here"
    assert rules.prefill_fallback("n2", TIMEOUT) is None  # the request's own time is spent


def test_a_generation_stops_for_its_requester_or_the_servers_stop_type() -> None:
    assert rules.stop_reason("eos", cancelled=False) == "eos"
    assert rules.stop_reason("word", cancelled=False) == "stop_word"
    assert rules.stop_reason("limit", cancelled=False) == "limit"
    assert rules.stop_reason(None, cancelled=False) == "limit"
    assert rules.stop_reason("eos", cancelled=True) == "cancelled"


def test_a_slot_holding_another_cache_scopes_state_counts_nothing_and_is_granted_foreign() -> None:
    # issue 30, F6: one tenant's right guess of another's prompt showed 283 cached tokens against 58
    table = SlotTable(1)
    grant = table.acquire([1, 2, 3, 4], scope="tenant:a")
    assert grant is not None and grant.resident == 0 and not grant.foreign  # a fresh server holds nothing
    table.release(grant.slot, (1, 2, 3, 4))
    other = table.acquire([1, 2, 3, 9], scope="tenant:b")
    assert other is not None and other.resident == 0 and other.foreign  # cleared before b's request uses it
    table.release(other.slot, None)  # unknown tokens: still b's state, whatever it is
    again = table.acquire([1, 2, 3, 9], scope="tenant:a")
    assert again is not None and again.foreign
    table.release(again.slot, (1, 2, 3, 9))
    same = table.acquire([1, 2, 3, 9, 10], scope="tenant:a")
    assert same is not None and same.resident == 4 and not same.foreign  # its own scope's: reused
    table.release(same.slot, (1, 2))
    table.forget()  # the server restarted: it holds nothing of anyone's
    fresh = table.acquire([1, 2], scope="tenant:b")
    assert fresh is not None and not fresh.foreign


def test_among_free_slots_a_request_takes_its_own_scopes_longest_prefix() -> None:
    table = SlotTable(2)
    a = table.acquire([5, 6, 7], scope="tenant:a")
    b = table.acquire([5, 6, 7, 8], scope="tenant:b")
    assert a is not None and b is not None
    table.release(a.slot, (5, 6, 7))
    table.release(b.slot, (5, 6, 7, 8))
    grant = table.acquire([5, 6, 7, 8, 9], scope="tenant:a")
    assert grant is not None and grant.slot == a.slot and grant.resident == 3  # not b's longer one


def test_a_shared_prompt_cache_allows_reuse_only_while_one_scope_was_served() -> None:
    # issue 30, F6: llama-server loads a slot from its host-memory prompt cache with anyone's best match
    table = SlotTable(2, prompt_cache=True)
    first = table.acquire([1, 2, 3, 4], scope="tenant:a")
    assert first is not None and first.reuse
    table.release(first.slot, (1, 2, 3, 4))
    again = table.acquire([1, 2, 3, 4, 5], scope="tenant:a")
    assert again is not None and again.reuse and again.resident == 4  # one scope so far: its own is reused
    table.release(again.slot, (1, 2, 3, 4, 5))
    other = table.acquire([1, 2, 3, 4], scope="tenant:b")
    assert other is not None and not other.reuse and other.resident == 0
    table.release(other.slot, (1, 2, 3, 4))
    for scope in ("tenant:a", "tenant:b", ""):  # two scopes met: the cache may hold either's prompts
        grant = table.acquire([1, 2, 3, 4, 5], scope=scope)
        assert grant is not None and not grant.reuse and grant.resident == 0, scope
        assert table.reusable(grant.slot, [1, 2, 3], scope) == 0
        table.release(grant.slot, (1, 2, 3, 4, 5))
    table.forget()  # the server restarted: its cache is empty
    fresh = table.acquire([1, 2], scope="tenant:b")
    assert fresh is not None and fresh.reuse


def test_without_a_shared_prompt_cache_every_scope_reuses_its_own_slots() -> None:
    table = SlotTable(2)
    for scope in ("tenant:a", "tenant:b", "tenant:a"):
        grant = table.acquire([7, 8], scope=scope)
        assert grant is not None and grant.reuse
        table.release(grant.slot, (7, 8))
