"""Property tests: a mutated GGUF header parses or raises GGUFFormatError, quickly and in bounded memory.

The base file is small but exercises every path of the reader: scalars, materialized and skipped arrays of
numbers and strings (tight materialize limits make the skip paths cheap to reach), custom alignment and
tensors under and outside ``blk.N.``. Mutations target what a hostile or damaged file changes: its length,
arbitrary bytes, count and length fields, type fields, and the bytes of strings.
"""

from __future__ import annotations

import io
import struct
import tracemalloc
from datetime import timedelta

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.placement.gguf_header import (
    GGUFFormatError,
    GGUFHeader,
    GGUFValueType,
    HeaderLimits,
    SkippedArray,
    parse_header,
)
from tests.harness.gguf import Built, HeaderBuilder

T = GGUFValueType
Q = gguf.GGMLQuantizationType

LIMITS = HeaderLimits(materialize_string_max=2, materialize_numeric_max=3)

# Generous for a sub-millisecond parse: the machine running the suite may be busy.
FUZZ = settings(
    max_examples=150,
    deadline=timedelta(milliseconds=500),
    suppress_health_check=[HealthCheck.too_slow],
)


def base() -> Built:
    return (
        HeaderBuilder()
        .kv("general.alignment", T.UINT32, 64)
        .kv("llama.block_count", T.UINT32, 2)
        .kv("llama.rope.freq_base", T.FLOAT32, 10000.0)
        .kv("general.name", T.STRING, "tiny ✓")
        .kv("flag", T.BOOL, True)
        .kv("i64", T.INT64, -5)
        .kv("tokenizer.ggml.tokens", T.ARRAY, ["<s>", "</s>", "a", "bc", "déf"], etype=T.STRING)
        .kv("tokenizer.ggml.merges", T.ARRAY, ["a b", "c"], etype=T.STRING)
        .kv("tokenizer.ggml.scores", T.ARRAY, [0.0, -1.0, -2.0, -3.0, -4.0], etype=T.FLOAT32)
        .kv("head_count_kv", T.ARRAY, [2, 0, 2], etype=T.INT32)
        .kv("after", T.UINT16, 7)
        .tensor("token_embd.weight", (32, 4), Q.F16)
        .tensor("blk.0.attn_q.weight", (64, 2), Q.Q8_0)
        .tensor("blk.1.attn_q.weight", (32, 2), Q.F32)
        .tensor("output_norm.weight", (32,), Q.F32)
        .build()
    )


BASE = base()
HEADER_END = BASE.header_end


def check(data: bytes | bytearray) -> GGUFHeader | GGUFFormatError:
    """Parse; anything but success or GGUFFormatError fails the test (pytest shows the traceback)."""
    try:
        h = parse_header(io.BytesIO(bytes(data)), len(data), limits=LIMITS)
    except GGUFFormatError as e:
        assert 0 <= e.offset <= len(data), e
        assert str(e).startswith(f"gguf: offset {e.offset}: ")
        return e
    # What was accepted is consistent with the file it came from.
    for t in h.tensors:
        assert h.data_offset + t.offset + t.n_bytes <= len(data)
        assert t.offset % h.alignment == 0
    assert h.total_tensor_bytes == sum(t.n_bytes for t in h.tensors)
    return h


def test_base_file_parses() -> None:
    h = check(BASE.data)
    assert isinstance(h, GGUFHeader)
    assert h.alignment == 64
    assert h.get("after") == 7
    assert h.get("head_count_kv") == (2, 0, 2)
    assert len(h.tensors) == 4


def test_every_truncation_inside_the_header_is_refused() -> None:
    for cut in range(HEADER_END):
        assert isinstance(check(BASE.data[:cut]), GGUFFormatError), cut


def test_every_truncation_of_the_data_section_parses_or_is_refused() -> None:
    for cut in range(HEADER_END, len(BASE.data) + 1):
        check(BASE.data[:cut])


@FUZZ
@given(st.lists(st.tuples(st.integers(0, HEADER_END - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_random_byte_flips_in_the_header(flips: list[tuple[int, int]]) -> None:
    data = bytearray(BASE.data)
    for at, byte in flips:
        data[at] = byte
    check(data)


HUGE = st.one_of(
    st.sampled_from([2**60, 2**63 - 1, 2**63, 2**64 - 1, 2**32, 2**31, 2**28, 2**28 + 1, 1 << 27, 0, 1]),
    st.integers(0, 2**64 - 1),
)


@FUZZ
@given(st.sampled_from(BASE.counts), HUGE)
def test_huge_values_in_count_and_length_fields(at: int, value: int) -> None:
    data = bytearray(BASE.data)
    struct.pack_into("<Q", data, at, value)
    check(data)


@FUZZ
@given(st.sampled_from(BASE.types), st.one_of(st.integers(0, 16), st.integers(0, 2**32 - 1)))
def test_wrong_values_in_type_fields(at: int, value: int) -> None:
    data = bytearray(BASE.data)
    struct.pack_into("<I", data, at, value)
    check(data)


BAD_UTF8 = st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\x80", b"\xf4\x90\x80\x80"])


@FUZZ
@given(st.sampled_from([s for s in BASE.strings if s[1] > 0]), st.data())
def test_bad_utf8_in_strings(span: tuple[int, int], draw: st.DataObject) -> None:
    at, length = span
    bad = draw.draw(BAD_UTF8)[:length]
    pos = draw.draw(st.integers(at, at + length - len(bad)))
    data = bytearray(BASE.data)
    data[pos : pos + len(bad)] = bad
    result = check(data)
    try:
        bytes(data[at : at + length]).decode("utf-8")
        return  # the splice happened to complete a valid sequence (e.g. into the "✓")
    except UnicodeDecodeError:
        pass
    # Strings of a skipped array (the tokens, under LIMITS) are not decoded; every other one is checked.
    if isinstance(result, GGUFHeader):
        tokens_at = BASE.at["kv:tokenizer.ggml.tokens:0"]
        after_at = BASE.at["kv:tokenizer.ggml.merges:key"]
        assert tokens_at <= pos < after_at, pos
        skipped = result.get("tokenizer.ggml.tokens")
        assert isinstance(skipped, SkippedArray) and (skipped.element_type, skipped.count) == (T.STRING, 5)


@FUZZ
@given(
    st.integers(0, HEADER_END),
    st.binary(min_size=1, max_size=16),
)
def test_inserted_garbage_shifts_every_later_field(at: int, junk: bytes) -> None:
    check(BASE.data[:at] + junk + BASE.data[at:])


LYING_FIELDS = [
    "n_tensors",
    "n_kv",
    "kv:general.name:key",
    "kv:general.name:value",
    "kv:tokenizer.ggml.tokens:count",
    "kv:tokenizer.ggml.tokens:3",
    "kv:tokenizer.ggml.scores:count",
    "kv:head_count_kv:count",
    "t:blk.0.attn_q.weight:name",
    "t:blk.0.attn_q.weight:dim0",
    "t:blk.0.attn_q.weight:offset",
]


@pytest.mark.parametrize("field", LYING_FIELDS)
@pytest.mark.parametrize("value", [2**60, 2**28, 2**20])
def test_lying_count_is_refused_in_bounded_memory(field: str, value: int) -> None:
    lying = bytearray(BASE.data)
    struct.pack_into("<Q", lying, BASE.at[field], value)
    data = bytes(lying)
    result: GGUFHeader | GGUFFormatError
    tracemalloc.start()
    try:
        result = parse_header(io.BytesIO(data), len(data), limits=LIMITS)
    except GGUFFormatError as e:
        result = e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert isinstance(result, GGUFFormatError), field
    assert peak < 1 << 20, f"{field}={value}: peak {peak} bytes"


def test_lying_file_size_is_refused_in_bounded_memory() -> None:
    # The caller claims an enormous file; the reader still only asks for bounded windows.
    data = bytearray(BASE.data)
    struct.pack_into("<Q", data, BASE.at["kv:tokenizer.ggml.tokens:count"], 2**27)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFFormatError):
            parse_header(io.BytesIO(bytes(data)), 1 << 40, limits=LIMITS)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 2 << 20
