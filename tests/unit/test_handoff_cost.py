"""The phase placement cost model: break-even at an exact integer crossover, no break-even, equal nodes, the
recurrent floor of hybrid models, each side priced by what it holds, and the smoothing of measured rates
(hypothesis)."""

from __future__ import annotations

import math

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from actors.handoff.cost import (
    Estimate,
    Link,
    Rates,
    StateSize,
    breakeven,
    decide,
    fit_link,
    local_seconds,
    observe,
    remote_seconds,
    remote_wins,
)
from actors.router.links import REST_S, LinkBook
from messages.memory import ContextShape, MemoryBreakdown

rates_st = st.floats(min_value=1.0, max_value=1e6, allow_nan=False, allow_infinity=False)
link_st = st.floats(min_value=1e3, max_value=1e11, allow_nan=False, allow_infinity=False)
bytes_st = st.floats(min_value=0.0, max_value=1e7, allow_nan=False, allow_infinity=False)


@given(
    n0=st.integers(min_value=1, max_value=1_000_000),
    i=st.integers(min_value=0, max_value=10),
    gap=st.integers(min_value=1, max_value=10),
    k=st.integers(min_value=0, max_value=30),
)
def test_an_exact_integer_crossover_breaks_even_one_token_later(n0: int, i: int, gap: int, k: int) -> None:
    # dyadic rates, so the crossover n0 is exact in binary floating point: slope = 2^-i - 2^-(i+gap)
    local, remote, link = 2.0**i, 2.0 ** (i + gap), 2.0**k
    slope = 2.0**-i - 2.0 ** -(i + gap)
    size = StateSize(bytes_per_token=0.0, floor_bytes=n0 * slope * link)
    rates = Rates(local_tokens_per_s=local, remote_tokens_per_s=remote, link_bytes_per_s=link)
    assert breakeven(size, rates) == n0 + 1
    assert not remote_wins(n0, size, rates)  # a tie is not a win
    assert remote_wins(n0 + 1, size, rates)


@given(local=rates_st, remote=rates_st, link=link_st, per_token=bytes_st, floor=bytes_st, overlap=st.floats(0, 1))
def test_breakeven_is_the_first_strict_win_or_none_when_there_is_none(
    local: float, remote: float, link: float, per_token: float, floor: float, overlap: float
) -> None:
    size = StateSize(bytes_per_token=per_token, floor_bytes=floor)
    rates = Rates(local_tokens_per_s=local, remote_tokens_per_s=remote, link_bytes_per_s=link, overlap=overlap)
    first = breakeven(size, rates)
    if first is None:
        assert not any(remote_wins(n, size, rates) for n in (1, 2, 1000, 10**6, 10**12))
    else:
        assert remote_wins(first, size, rates) and remote_wins(first * 2 + 7, size, rates)
        assert first == 1 or not remote_wins(first - 1, size, rates)
        assert decide(first, size, rates).path == "disaggregated"


@given(
    rate=rates_st, link=link_st, per_token=bytes_st, floor=bytes_st, overlap=st.floats(0, 1), n=st.integers(1, 10**7)
)
def test_equal_nodes_never_disaggregate(
    rate: float, link: float, per_token: float, floor: float, overlap: float, n: int
) -> None:
    size = StateSize(bytes_per_token=per_token, floor_bytes=floor)
    rates = Rates(local_tokens_per_s=rate, remote_tokens_per_s=rate, link_bytes_per_s=link, overlap=overlap)
    assert breakeven(size, rates) is None
    assert decide(n, size, rates).path == "local"


@given(local=rates_st, speedup=st.floats(1.01, 100), link=link_st, per_token=bytes_st, floor=st.floats(1.0, 1e10))
def test_the_recurrent_floor_of_hybrid_models_only_moves_break_even_later(
    local: float, speedup: float, link: float, per_token: float, floor: float
) -> None:
    rates = Rates(local_tokens_per_s=local, remote_tokens_per_s=local * speedup, link_bytes_per_s=link)
    dense = breakeven(StateSize(bytes_per_token=per_token), rates)
    hybrid = breakeven(StateSize(bytes_per_token=per_token, floor_bytes=floor), rates)
    assert (dense is None) == (hybrid is None)
    if dense is not None and hybrid is not None:
        assert hybrid >= dense
    # a pure recurrent model moves only its floor: break-even just past floor/link over the time saved per token
    recurrent = breakeven(StateSize(bytes_per_token=0.0, floor_bytes=floor), rates)
    saved = 1 / rates.local_tokens_per_s - 1 / rates.remote_tokens_per_s
    crossover = floor / link / saved  # in floats: an exact integer crossover may come out a hair below it
    slack = 1e-6 * crossover + 1e-9
    assert recurrent is not None and crossover - slack < recurrent <= crossover + 1 + slack


def test_no_breakeven_when_the_link_is_slower_than_what_a_token_saves() -> None:
    size = StateSize(bytes_per_token=32768.0, floor_bytes=52_690_944.0)
    rates = Rates(local_tokens_per_s=1000, remote_tokens_per_s=2000, link_bytes_per_s=1e6)
    assert breakeven(size, rates) is None and decide(10**6, size, rates).path == "local"
    fast = Rates(local_tokens_per_s=1000, remote_tokens_per_s=2000, link_bytes_per_s=1e9, overlap=0.5)
    first = breakeven(size, fast)
    assert first is not None and decide(first - 1, size, fast).path == "local"


def test_the_prefix_held_where_it_decodes_saves_nothing_on_the_remote_path() -> None:
    # Issue 17: the decoding instance held 30,000 of a 32,001-token prompt; a node twice as fast held nothing.
    # Priced with the local holding, the remote side looked like 2,000 tokens (10 s); it computes 32,000 (160 s)
    # and moves the whole state.
    size = StateSize(bytes_per_token=100_000.0)
    rates = Rates(local_tokens_per_s=100, remote_tokens_per_s=200, link_bytes_per_s=1e9, fixed_s=0.05)
    verdict = decide(32_000, size, rates, local_held=30_000)
    assert verdict.path == "local"
    assert (verdict.local_tokens, verdict.remote_tokens) == (2_000, 32_000)
    assert verdict.local_s == 20.0 and verdict.remote_s == 160.0 + 3.2 + 0.05
    # what the remote side itself holds it does not compute, but the whole state still crosses the link
    held_there = decide(32_000, size, rates, local_held=30_000, remote_held=31_000)
    assert held_there.path == "disaggregated" and held_there.remote_tokens == 1_000
    assert held_there.remote_s == 5.0 + 3.2 + 0.05


@given(
    local=rates_st,
    remote=rates_st,
    link=link_st,
    per_token=bytes_st,
    floor=bytes_st,
    n=st.integers(1, 10**7),
    local_held=st.integers(0, 10**7),
    remote_held=st.integers(0, 10**7),
)
def test_each_side_is_priced_by_what_it_holds_itself(
    local: float, remote: float, link: float, per_token: float, floor: float, n: int, local_held: int, remote_held: int
) -> None:
    size = StateSize(bytes_per_token=per_token, floor_bytes=floor)
    rates = Rates(local_tokens_per_s=local, remote_tokens_per_s=remote, link_bytes_per_s=link)
    verdict = decide(n, size, rates, local_held=local_held, remote_held=remote_held)
    # the local holding never changes the remote side's price, nor the remote holding the local side's
    assert (
        verdict.remote_s
        == remote_seconds(n, size, rates, held=remote_held)
        == decide(n, size, rates, remote_held=remote_held).remote_s
    )
    assert verdict.local_s == local_seconds(n, rates, held=local_held)
    # the remote side always moves the whole state and computes what it does not hold
    moved = size.at(n) / link
    assert verdict.remote_s >= (n - min(n, remote_held)) / remote * (1 - 1e-9) + moved * (1 - 1e-9)
    assert verdict.local_tokens == n - min(n, local_held) and verdict.remote_tokens == n - min(n, remote_held)


@given(
    local=rates_st,
    remote=rates_st,
    link=link_st,
    per_token=bytes_st,
    floor=bytes_st,
    local_held=st.integers(0, 10**6),
    remote_held=st.integers(0, 10**6),
)
def test_breakeven_with_holdings_is_where_the_remote_path_wins_from_then_on(
    local: float, remote: float, link: float, per_token: float, floor: float, local_held: int, remote_held: int
) -> None:
    size = StateSize(bytes_per_token=per_token, floor_bytes=floor)
    rates = Rates(local_tokens_per_s=local, remote_tokens_per_s=remote, link_bytes_per_s=link)
    held = {"local_held": local_held, "remote_held": remote_held}
    first = breakeven(size, rates, **held)
    longer = max(1, local_held, remote_held)
    if first is None:  # the remote path loses at some length, however far (exact arithmetic: a tiny slope
        # lets the remote side's holding win for astronomically many tokens)
        assert not remote_wins(10**400, size, rates, **held)  # past any crossing these floats allow
    else:
        assert first >= longer
        assert remote_wins(first, size, rates, **held) and remote_wins(first * 2 + 7, size, rates, **held)
        assert first == longer or not remote_wins(first - 1, size, rates, **held)


@given(samples=st.lists(st.floats(1e-3, 1e9), min_size=1, max_size=50), alpha=st.floats(0.01, 1.0))
def test_smoothed_rates_stay_within_what_was_observed(samples: list[float], alpha: float) -> None:
    estimate: Estimate | None = None
    for sample in samples:
        estimate = observe(estimate, sample, alpha=alpha)
        estimate = observe(estimate, math.nan, alpha=alpha)  # ignored
        estimate = observe(estimate, 0.0, alpha=alpha)  # ignored
    assert estimate is not None and estimate.samples == len(samples)
    assert min(samples) * (1 - 1e-9) <= estimate.value <= max(samples) * (1 + 1e-9)
    assert observe(None, 5.0).value == 5.0


def test_state_size_of_a_slot_from_the_memory_model() -> None:
    # Qwen3.5-9B geometry (shared/REFERENCE.md): 8 attention layers x 4 KV heads x 256 at f16 = 32,768 B per
    # token per stream; recurrent 52,690,944 B per slot; here 4 slots, unified, draft depth 3 (4 rows per cell)
    shape = ContextShape(n_ctx=8192, n_ctx_seq=8192, n_seq_max=4, n_stream=1, n_rs_seq=3, n_ubatch=512, swa_cells=0)
    breakdown = msgspec.convert(
        {
            "estimator_version": "x",
            "llama_cpp_version": "x",
            "architecture": "qwen35",
            "context": msgspec.to_builtins(shape),
            "kv_bytes": 32768 * 8192,
            "kv_k_bytes": 16384 * 8192,
            "kv_v_bytes": 16384 * 8192,
            "kv_swa_bytes": 0,
            "recurrent_bytes": 52_690_944 * 4 * 4,
            "draft_kv_bytes": 0,
            "weights_bytes": 0,
            "compute_bytes": 0,
            "output_bytes": 0,
            "host_extra_bytes": 0,
            "total_bytes": 0,
            "devices": [],
            "compute_error_ratio": 0.0,
        },
        MemoryBreakdown,
    )
    size = StateSize.of_slot(breakdown)
    assert (size.bytes_per_token, size.floor_bytes) == (32768.0, 52_690_944.0)
    assert size.at(1000) == 52_690_944 + 32_768_000


@given(
    rate=st.floats(min_value=1e6, max_value=1e10),
    fixed=st.floats(min_value=0.0, max_value=1.0),
    sizes=st.lists(st.integers(min_value=1, max_value=1 << 32), min_size=2, max_size=8, unique=True),
)
def test_a_link_fit_recovers_the_line_its_samples_lie_on(rate: float, fixed: float, sizes: list[int]) -> None:
    link = fit_link([(b, fixed + b / rate) for b in sizes])
    assert link is not None
    for b in sizes:
        assert math.isclose(link.seconds(b), fixed + b / rate, rel_tol=1e-6, abs_tol=1e-9)


def test_a_link_fit_keeps_a_positive_rate_and_a_fixed_cost_that_is_not_negative() -> None:
    assert fit_link([]) is None and fit_link([(0, 1.0), (10, 0.0), (5, math.nan)]) is None
    one_size = fit_link([(100, 1.0), (100, 3.0)])
    assert one_size == Link(bytes_per_s=50.0)  # the mean rate, nothing fixed
    falling = fit_link([(100, 2.0), (200, 1.0)])  # noise: bigger was faster
    assert falling is not None and falling.fixed_s == 0 and falling.bytes_per_s == 100.0
    below_origin = fit_link([(100, 0.5), (200, 1.5)])  # the line crosses zero time above zero bytes
    assert below_origin is not None and below_origin.fixed_s == 0 and below_origin.bytes_per_s > 0


def test_a_router_weighs_what_generations_reported_over_what_a_probe_measured() -> None:
    book = LinkBook(keep=3)
    book.observe_probe("a>b", [(1 << 20, 0.011), (64 << 20, 0.65)])
    probed = book.links(0.0)["a>b"]
    assert math.isclose(probed.fixed_s, 0.011 - (1 << 20) / probed.bytes_per_s)
    book.observe_result("a>b", 10 << 20, 0.5)
    assert book.links(0.0)["a>b"] == Link(bytes_per_s=(10 << 20) / 0.5)  # one result: its own rate
    for i in range(5):
        book.observe_result("a>b", (i + 1) << 20, 0.1 * (i + 1))  # only the last 3 kept
    assert math.isclose(book.links(0.0)["a>b"].bytes_per_s, (1 << 20) / 0.1)
    book.observe_result("a>b", 0, 1.0)  # unusable samples are ignored
    book.observe_probe("b>a", [(0, 1.0)])
    assert set(book.links(0.0)) == {"a>b"}


def test_a_link_whose_prefill_failed_rests_then_is_chosen_again() -> None:
    book = LinkBook()
    book.observe_result("a>b", 10 << 20, 0.5)
    book.observe_result("c>b", 10 << 20, 0.5)
    book.failed("a>b", now=100.0)
    assert set(book.links(100.0)) == {"c>b"}
    assert set(book.links(100.0 + REST_S - 0.1)) == {"c>b"}
    assert set(book.links(100.0 + REST_S)) == {"a>b", "c>b"}  # rested: its measurements stand
