"""GGUF header reader: round trips against gguf.GGUFWriter / GGUFReader, and one test per validation rule.

Corrupted files are produced by ``HeaderBuilder``, a small GGUF encoder that records where every field
lands so a test can name the exact offset the reader must report; ``test_builder_matches_gguf_writer_bytes``
keeps it honest against the reference writer. The fuzz tests import it too.
"""

from __future__ import annotations

import io
import pickle
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from actors.placement.gguf_header import (
    DEFAULT_LIMITS,
    GGUFFormatError,
    GGUFHeader,
    HeaderLimits,
    SkippedArray,
    parse_header,
    read_header,
)
from tests.harness.gguf import HeaderBuilder, Q, T


def parse(data: bytes, *, limits: HeaderLimits = DEFAULT_LIMITS, file_size: int | None = None) -> GGUFHeader:
    return parse_header(io.BytesIO(data), len(data) if file_size is None else file_size, limits=limits)


def refused(data: bytes, *, limits: HeaderLimits = DEFAULT_LIMITS, file_size: int | None = None) -> GGUFFormatError:
    with pytest.raises(GGUFFormatError) as info:
        parse(data, limits=limits, file_size=file_size)
    return info.value


def two_tensor_builder() -> HeaderBuilder:
    return (
        HeaderBuilder()
        .kv("llama.block_count", T.UINT32, 1)
        .tensor("blk.0.attn_q.weight", (64, 2), Q.F32)
        .tensor("output.weight", (64, 3), Q.Q8_0)
    )


# --- round trips against the reference writer and reader -------------------------------------------------


def write_with_gguf_writer(path: Path, fill: Any) -> None:
    w = gguf.GGUFWriter(path, "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_scalars_of_every_type_round_trip_from_gguf_writer(tmp_path: Path) -> None:
    path = tmp_path / "scalars.gguf"

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_uint8("s.u8", 255)
        w.add_int8("s.i8", -128)
        w.add_uint16("s.u16", 65535)
        w.add_int16("s.i16", -32768)
        w.add_uint32("s.u32", 2**32 - 1)
        w.add_int32("s.i32", -(2**31))
        w.add_float32("s.f32", 1.5)
        w.add_bool("s.bool_true", True)
        w.add_bool("s.bool_false", False)
        w.add_string("s.str", "héllo ✓")
        w.add_uint64("s.u64", 2**64 - 1)
        w.add_int64("s.i64", -(2**63))
        w.add_float64("s.f64", -2.25e300)

    write_with_gguf_writer(path, fill)
    h = read_header(path)
    assert h.version == 3
    assert h.architecture == "llama"
    expected = {
        "s.u8": 255,
        "s.i8": -128,
        "s.u16": 65535,
        "s.i16": -32768,
        "s.u32": 2**32 - 1,
        "s.i32": -(2**31),
        "s.f32": 1.5,
        "s.bool_true": True,
        "s.bool_false": False,
        "s.str": "héllo ✓",
        "s.u64": 2**64 - 1,
        "s.i64": -(2**63),
        "s.f64": -2.25e300,
    }
    for key, value in expected.items():
        assert h.get(key) == value, key
        assert type(h.get(key)) is type(value), key
    assert h.tensors == ()
    assert h.total_tensor_bytes == 0
    assert h.file_size == path.stat().st_size


def test_small_arrays_are_materialized_as_tuples(tmp_path: Path) -> None:
    path = tmp_path / "arrays.gguf"

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_array("a.ints", [1, -2, 3])
        w.add_array("a.floats", [0.5, 1.25])
        w.add_array("a.bools", [True, False, True])
        w.add_array("a.strs", ["x", "yz", ""])
        w.add_key_value("a.u8", [1, 2, 255], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
        w.add_key_value("a.i64", [-(2**63), 2**63 - 1], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT64)
        w.add_key_value("a.f64", [1e-300], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT64)

    write_with_gguf_writer(path, fill)
    h = read_header(path)
    assert h.get("a.ints") == (1, -2, 3)
    assert h.get("a.floats") == (0.5, 1.25)
    assert h.get("a.bools") == (True, False, True)
    assert h.get("a.strs") == ("x", "yz", "")
    assert h.get("a.u8") == (1, 2, 255)
    assert h.get("a.i64") == (-(2**63), 2**63 - 1)
    assert h.get("a.f64") == (1e-300,)


def test_empty_string_and_empty_array_round_trip() -> None:
    # GGUFWriter drops both, so the builder writes them.
    b = HeaderBuilder().kv("s", T.STRING, "").kv("a.none", T.ARRAY, [], etype=T.STRING).kv("after", T.UINT8, 7)
    h = parse(b.build().data)
    assert h.get("s") == ""
    assert h.get("a.none") == ()
    assert h.get("after") == 7


def test_tokenizer_arrays_over_the_limit_are_skipped_with_their_count(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.gguf"
    n_vocab = 20_000  # over both materialize limits (256 strings, 16384 numbers)

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"tok{i}" * (i % 5) for i in range(n_vocab)])
        w.add_token_merges([f"a{i} b{i}" for i in range(n_vocab - 1)])
        w.add_token_scores([float(i) for i in range(n_vocab)])
        w.add_token_types([1] * n_vocab)
        w.add_uint32("after.tokenizer", 42)  # read correctly only if the skips landed exactly

    write_with_gguf_writer(path, fill)
    h = read_header(path)
    assert h.get("tokenizer.ggml.model") == "gpt2"
    longest = max(len(f"tok{i}" * (i % 5)) for i in range(n_vocab))  # read with the lengths it skipped
    assert h.get("tokenizer.ggml.tokens") == SkippedArray(T.STRING, n_vocab, longest)
    last = n_vocab - 2
    assert h.get("tokenizer.ggml.merges") == SkippedArray(T.STRING, n_vocab - 1, len(f"a{last} b{last}"))
    assert h.get("tokenizer.ggml.scores") == SkippedArray(T.FLOAT32, n_vocab)
    assert h.get("tokenizer.ggml.token_type") == SkippedArray(T.INT32, n_vocab)
    assert h.get("after.tokenizer") == 42
    assert h.data_offset == gguf.GGUFReader(path).data_offset


def test_materialize_limits_decide_what_is_skipped() -> None:
    b = HeaderBuilder().kv("s", T.ARRAY, ["a", "b", "c"], etype=T.STRING).kv("n", T.ARRAY, [1, 2], etype=T.INT32)
    data = b.build().data
    assert parse(data).get("s") == ("a", "b", "c")
    tight = HeaderLimits(materialize_string_max=2, materialize_numeric_max=1)
    h = parse(data, limits=tight)
    assert h.get("s") == SkippedArray(T.STRING, 3, 1)
    assert h.get("n") == SkippedArray(T.INT32, 2)


def test_layer_tensor_bytes_match_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "tensors.gguf"
    quantized = [(Q.Q8_0, 34), (Q.Q4_K, 144), (Q.Q6_K, 210), (Q.Q4_0, 18)]

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_block_count(3)
        w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float16))
        for layer in range(3):
            w.add_tensor(f"blk.{layer}.attn_norm.weight", np.zeros(32, dtype=np.float32))
            qtype, block_bytes = quantized[layer]
            w.add_tensor(f"blk.{layer}.ffn_up.weight", np.zeros((3, 2 * block_bytes), dtype=np.uint8), raw_dtype=qtype)
        w.add_tensor("blk.10.ffn_down.weight", np.zeros((2, 18), dtype=np.uint8), raw_dtype=Q.Q4_0)
        w.add_tensor("output_norm.weight", np.zeros(32, dtype=np.float32))
        w.add_tensor("rope_freqs", np.zeros(4, dtype=np.int32))

    write_with_gguf_writer(path, fill)
    h = read_header(path)
    ref = gguf.GGUFReader(path)

    assert h.data_offset == ref.data_offset
    assert len(h.tensors) == len(ref.tensors)
    per_layer: dict[int, int] = {}
    other = 0
    for ours, theirs in zip(h.tensors, ref.tensors, strict=True):
        assert ours.name == theirs.name
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.ggml_type == int(theirs.tensor_type)
        assert ours.type_name == theirs.tensor_type.name
        assert ours.n_bytes == int(theirs.n_bytes)
        assert h.data_offset + ours.offset == int(theirs.data_offset)
        if ours.name.startswith("blk."):
            layer = int(ours.name.split(".")[1])
            per_layer[layer] = per_layer.get(layer, 0) + int(theirs.n_bytes)
        else:
            other += int(theirs.n_bytes)
    assert dict(h.layer_tensor_bytes) == per_layer
    assert list(h.layer_tensor_bytes) == [0, 1, 2, 10]
    assert h.other_tensor_bytes == other
    assert h.total_tensor_bytes == sum(int(t.n_bytes) for t in ref.tensors)
    assert h.tensors[2].type_name == "Q8_0"
    assert h.tensors[2].shape == (64, 3)  # ggml order: ne0 (row) first


def test_custom_alignment_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_custom_alignment(64)
        w.add_tensor("a", np.zeros(3, dtype=np.float32))
        w.add_tensor("b", np.zeros(5, dtype=np.float32))

    write_with_gguf_writer(path, fill)
    h = read_header(path)
    assert h.alignment == 64
    assert h.data_offset % 64 == 0
    assert [t.offset for t in h.tensors] == [0, 64]
    assert h.data_offset == gguf.GGUFReader(path).data_offset


def test_builder_matches_gguf_writer_bytes(tmp_path: Path) -> None:
    path = tmp_path / "same.gguf"

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_uint32("llama.block_count", 1)
        w.add_array("tokenizer.ggml.tokens", ["<s>", "a"])
        w.add_tensor("blk.0.attn_q.weight", np.zeros((2, 64), dtype=np.float32))
        w.add_tensor("output.weight", np.zeros((3, 68), dtype=np.uint8), raw_dtype=Q.Q8_0)

    write_with_gguf_writer(path, fill)
    b = (
        HeaderBuilder()
        .kv("llama.block_count", T.UINT32, 1)
        .kv("tokenizer.ggml.tokens", T.ARRAY, ["<s>", "a"], etype=T.STRING)
        .tensor("blk.0.attn_q.weight", (64, 2), Q.F32)
        .tensor("output.weight", (64, 3), Q.Q8_0)
    )
    assert b.build().data == path.read_bytes()


class CountingFile(io.BytesIO):
    """Records how many bytes were read and the furthest offset reached."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.bytes_read = 0
        self.furthest = 0

    def read(self, size: int | None = -1, /) -> bytes:
        chunk = super().read(size)
        self.bytes_read += len(chunk)
        self.furthest = max(self.furthest, self.tell())
        return chunk


def test_reads_stay_near_the_header_and_never_reread_it() -> None:
    tokens = [f"token-{i}" * (1 + i % 7) for i in range(50_000)]
    b = HeaderBuilder().kv("tokenizer.ggml.tokens", T.ARRAY, tokens, etype=T.STRING)
    built = b.tensor("blk.0.w", (1 << 20,)).tensor("blk.1.w", (1 << 20,)).build()  # 8 MiB of tensor data
    f = CountingFile(built.data)
    h = parse_header(f, len(built.data))
    assert h.get("tokenizer.ggml.tokens") == SkippedArray(T.STRING, 50_000, max(len(t) for t in tokens))
    # One bounded read-ahead window past the header at most, and each header byte read about once.
    window = 1 << 20
    assert f.furthest <= built.header_end + window
    assert f.bytes_read <= built.header_end + window
    assert len(built.data) - built.data_offset >= 8 << 20


def test_version_2_is_accepted() -> None:
    h = parse(HeaderBuilder(version=2).kv("k", T.UINT8, 1).build().data)
    assert h.version == 2
    assert h.get("k") == 1


def test_sparse_file_with_a_hole_for_tensor_data_is_fine(tmp_path: Path) -> None:
    built = two_tensor_builder().build(data_size=0)
    path = tmp_path / "sparse.gguf"
    with path.open("wb") as f:
        f.write(built.data)
        f.truncate(built.data_offset + (1 << 30))  # a 1 GiB hole: nothing is written or read there
    h = read_header(path)
    assert h.file_size == built.data_offset + (1 << 30)
    assert [t.name for t in h.tensors] == ["blk.0.attn_q.weight", "output.weight"]


def test_header_without_tensors_may_end_at_end_of_file() -> None:
    built = HeaderBuilder().kv("k", T.STRING, "abc").build()
    assert len(built.data) == built.header_end
    h = parse(built.data)
    assert h.data_offset >= built.header_end
    assert h.tensors == ()


def test_get_and_arch_key() -> None:
    h = parse(HeaderBuilder(arch="qwen35").kv("qwen35.block_count", T.UINT32, 24).build().data)
    assert h.architecture == "qwen35"
    assert h.arch_key("block_count") == 24
    assert h.arch_key("context_length") is None
    assert h.arch_key("context_length", 4096) == 4096
    assert h.get("missing", "dflt") == "dflt"


def test_missing_architecture_raises_format_error() -> None:
    h = parse(HeaderBuilder(arch=None).kv("k", T.UINT8, 1).build().data)
    with pytest.raises(GGUFFormatError, match=r"missing general\.architecture") as info:
        _ = h.architecture
    assert info.value.offset == 0


def test_header_is_immutable() -> None:
    h = parse(two_tensor_builder().build().data)
    with pytest.raises(TypeError):
        h.kv["x"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        h.layer_tensor_bytes[0] = 1  # type: ignore[index]


def test_error_names_source_offset_and_problem_and_pickles() -> None:
    err = GGUFFormatError(12, "bad thing", "model.gguf")
    assert str(err) == "model.gguf: offset 12: bad thing"
    assert isinstance(err, ValueError)
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.offset, copy.problem, str(copy)) == (12, "bad thing", "model.gguf: offset 12: bad thing")
    assert str(GGUFFormatError(3, "x")) == "gguf: offset 3: x"


def test_read_header_names_the_file_in_errors(tmp_path: Path) -> None:
    path = tmp_path / "not-a-model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(GGUFFormatError) as info:
        read_header(str(path))
    assert str(info.value).startswith(f"{path}: offset 0: bad magic")


# --- validation: one test per rule -------------------------------------------------------------------------


def test_bad_magic_is_refused_at_offset_0() -> None:
    err = refused(HeaderBuilder(magic=b"GGUG").build().data)
    assert err.offset == 0
    assert "bad magic" in err.problem


def test_file_too_short_for_magic_is_refused() -> None:
    assert refused(b"GG").offset == 0
    assert refused(b"").offset == 0


def test_version_1_is_refused() -> None:
    err = refused(HeaderBuilder(version=1).build().data)
    assert err.offset == 4
    assert "unsupported version 1" in err.problem


def test_unknown_version_is_refused() -> None:
    err = refused(HeaderBuilder(version=4).build().data)
    assert (err.offset, "unsupported version 4" in err.problem) == (4, True)


def test_big_endian_file_is_refused_with_a_hint() -> None:
    err = refused(HeaderBuilder(version=3 << 24).build().data)
    assert err.offset == 4
    assert "big-endian" in err.problem


def test_truncation_inside_a_value_is_refused_with_offset() -> None:
    built = HeaderBuilder().kv("k", T.UINT64, 5).build()
    value_at = built.at["kv:k:value"]
    err = refused(built.data[: value_at + 3])
    assert err.offset == value_at
    assert "end of the file" in err.problem


def test_truncation_inside_tensor_infos_is_refused_with_offset() -> None:
    built = two_tensor_builder().build()
    dim_at = built.at["t:output.weight:dim1"]
    err = refused(built.data[: dim_at + 5])
    assert err.offset == dim_at
    assert "dimension 1" in err.problem


def test_file_shorter_than_its_stated_size_is_refused() -> None:
    built = HeaderBuilder().kv("k", T.STRING, "abcdef").build()
    err = refused(built.data[:-3], file_size=len(built.data))
    assert err.offset == len(built.data) - 3
    assert "shorter than its stated size" in err.problem


def test_tensor_count_over_limit_is_refused() -> None:
    built = two_tensor_builder().build()
    err = refused(built.data, limits=HeaderLimits(max_tensors=1))
    assert err.offset == 8
    assert "tensor count 2 exceeds the limit of 1" in err.problem


def test_kv_count_over_limit_is_refused() -> None:
    err = refused(HeaderBuilder().build(n_kv=100_000).data)
    assert err.offset == 16
    assert "exceeds the limit of 65536" in err.problem


def test_tensor_count_that_cannot_fit_in_the_file_is_refused() -> None:
    err = refused(two_tensor_builder().build(n_tensors=500_000).data)
    assert err.offset == 8
    assert "500000 tensor infos" in err.problem


def test_kv_count_that_cannot_fit_in_the_file_is_refused() -> None:
    err = refused(HeaderBuilder().kv("k", T.UINT8, 1).build(n_kv=60_000).data)
    assert err.offset == 16
    assert "60000 key/values" in err.problem


def test_array_count_over_limit_is_refused() -> None:
    built = HeaderBuilder().kv("a", T.ARRAY, [1, 2, 3], etype=T.UINT8).build()
    err = refused(built.data, limits=HeaderLimits(max_array_len=2))
    assert err.offset == built.at["kv:a:count"]
    assert "exceeds the limit of 2" in err.problem


def test_array_count_larger_than_the_bytes_left_is_refused_before_reading() -> None:
    built = HeaderBuilder().kv("a", T.ARRAY, [1, 2], etype=T.UINT64).build()
    data = bytearray(built.data)
    struct.pack_into("<Q", data, built.at["kv:a:count"], 1 << 27)  # under max_array_len, far past EOF
    err = refused(bytes(data))
    assert err.offset == built.at["kv:a:count"]
    assert "end of the file" in err.problem


def test_string_length_over_limit_is_refused() -> None:
    built = HeaderBuilder().kv("s", T.STRING, "x" * 100).build()
    err = refused(built.data, limits=HeaderLimits(max_string_bytes=99))
    assert err.offset == built.at["kv:s:value"]
    assert "length 100 exceeds the limit of 99" in err.problem


def test_string_length_past_end_of_file_is_refused_with_offset() -> None:
    built = HeaderBuilder().kv("s", T.STRING, "abc").build()
    data = bytearray(built.data)
    struct.pack_into("<Q", data, built.at["kv:s:value"], 1000)
    err = refused(bytes(data))
    assert err.offset == built.at["kv:s:value"]
    assert "length 1000" in err.problem
    assert "end of the file" in err.problem


def test_skipped_string_array_element_past_end_of_file_is_refused() -> None:
    built = HeaderBuilder().kv("toks", T.ARRAY, ["a", "bb", "ccc"], etype=T.STRING).build()
    data = bytearray(built.data)
    struct.pack_into("<Q", data, built.at["kv:toks:2"], 10_000)
    err = refused(bytes(data), limits=HeaderLimits(materialize_string_max=0))
    assert err.offset == built.at["kv:toks:2"]
    assert "element 2 of length 10000" in err.problem


def test_skipped_string_array_element_over_the_string_limit_is_refused() -> None:
    built = HeaderBuilder().kv("toks", T.ARRAY, ["a", "b" * 50], etype=T.STRING).build()
    err = refused(built.data, limits=HeaderLimits(materialize_string_max=0, max_string_bytes=49))
    assert err.offset == built.at["kv:toks:1"]
    assert "element 1 length 50 exceeds the limit of 49" in err.problem


def test_key_length_over_limit_is_refused() -> None:
    built = HeaderBuilder().kv("k" * 40, T.UINT8, 1).build()
    err = refused(built.data, limits=HeaderLimits(max_key_bytes=32))
    assert err.offset == built.at[f"kv:{'k' * 40}:key"]
    assert "exceeds the limit of 32" in err.problem


def test_invalid_utf8_in_key_is_refused_at_the_bad_byte() -> None:
    built = HeaderBuilder().kv(b"ok.\xff", T.UINT8, 1).build()
    err = refused(built.data)
    assert err.offset == built.at["kv:ok.\xff:key"] + 8 + 3
    assert "invalid UTF-8" in err.problem


def test_invalid_utf8_in_string_value_is_refused() -> None:
    built = HeaderBuilder().kv("s", T.STRING, b"\xed\xa0\x80").build()  # an encoded surrogate
    err = refused(built.data)
    assert err.offset == built.at["kv:s:value"] + 8
    assert "invalid UTF-8" in err.problem


def test_invalid_utf8_in_tensor_name_is_refused() -> None:
    built = HeaderBuilder().tensor(b"blk.0.\xc0\x80", (32,)).build()
    err = refused(built.data)
    assert err.offset == built.at["t:blk.0.\xc0\x80:name"] + 8 + 6
    assert "invalid UTF-8" in err.problem


def test_unknown_value_type_is_refused() -> None:
    built = HeaderBuilder().kv_raw("k", struct.pack("<I", 13) + bytes(8)).build()
    err = refused(built.data)
    assert err.offset == built.at["kv:k:type"]
    assert "unknown value type 13" in err.problem


def test_unknown_array_element_type_is_refused() -> None:
    built = HeaderBuilder().kv_raw("k", struct.pack("<IIQ", T.ARRAY, 99, 0)).build()
    err = refused(built.data)
    assert err.offset == built.at["kv:k:type"] + 4
    assert "unknown element type 99" in err.problem


def test_nested_array_is_refused() -> None:
    built = HeaderBuilder().kv_raw("k", struct.pack("<IIQ", T.ARRAY, T.ARRAY, 0)).build()
    err = refused(built.data)
    assert err.offset == built.at["kv:k:type"] + 4
    assert "nested arrays are not supported" in err.problem


def test_duplicate_key_is_refused() -> None:
    b = HeaderBuilder().kv("k", T.UINT8, 1).kv("k", T.UINT8, 2)
    built = b.build()
    err = refused(built.data)
    assert err.offset == built.at["kv:k:key"]  # the second occurrence (recorded last)
    assert "duplicate key 'k'" in err.problem


def test_duplicate_tensor_name_is_refused() -> None:
    built = HeaderBuilder().tensor("a", (32,)).tensor("a", (32,)).build()
    err = refused(built.data)
    assert err.offset == built.at["t:a:name"]
    assert "duplicate tensor name 'a'" in err.problem


def test_zero_dims_is_refused() -> None:
    built = HeaderBuilder().tensor("a", (), n_dims=0).build()
    err = refused(built.data)
    assert err.offset == built.at["t:a:n_dims"]
    assert "n_dims 0" in err.problem


def test_more_dims_than_ggml_max_is_refused() -> None:
    built = HeaderBuilder().tensor("a", (32, 1, 1, 1, 1)).build()
    err = refused(built.data)
    assert err.offset == built.at["t:a:n_dims"]
    assert "n_dims 5 is not in 1..4" in err.problem


def test_zero_dimension_is_refused() -> None:
    built = HeaderBuilder().tensor("a", (32, 0)).build()
    err = refused(built.data)
    assert err.offset == built.at["t:a:dim1"]
    assert "dimension 1 is 0" in err.problem


def test_dimension_product_overflowing_int64_is_refused() -> None:
    built = HeaderBuilder().tensor("a", (1 << 32, 1 << 31)).build(data_size=0)
    err = refused(built.data)
    assert err.offset == built.at["t:a:dim1"]
    assert "overflows int64" in err.problem


def test_single_dimension_over_int64_is_refused() -> None:
    built = HeaderBuilder().tensor("a", (1 << 63,)).build(data_size=0)
    err = refused(built.data)
    assert err.offset == built.at["t:a:dim0"]


def test_unknown_ggml_type_is_refused() -> None:
    built = HeaderBuilder().tensor("a", (32,), ggml_type=4).build(data_size=128)  # Q4_2, long removed
    err = refused(built.data)
    assert err.offset == built.at["t:a:type"]
    assert "unknown ggml type 4" in err.problem


def test_element_count_not_divisible_by_block_size_is_refused() -> None:
    built = HeaderBuilder().tensor("a", (48,), ggml_type=Q.Q8_0).build(data_size=64)
    err = refused(built.data)
    assert err.offset == built.at["t:a:dim0"]
    assert "not a multiple of the Q8_0 block size 32" in err.problem


def test_row_not_divisible_by_block_size_is_refused_even_if_total_is() -> None:
    # 16 x 2 = 32 elements is one Q8_0 block in total, but ggml quantizes rows: llama.cpp refuses it too.
    built = HeaderBuilder().tensor("a", (16, 2), ggml_type=Q.Q8_0).build(data_size=64)
    err = refused(built.data)
    assert err.offset == built.at["t:a:dim0"]


def test_unaligned_tensor_offset_is_refused() -> None:
    built = HeaderBuilder().tensor("a", (32,)).tensor("b", (8,), offset=136).build()
    err = refused(built.data)
    assert err.offset == built.at["t:b:offset"]
    assert "data offset 136 is not aligned to 32" in err.problem


def test_unaligned_tensor_offset_respects_custom_alignment() -> None:
    b = HeaderBuilder().kv("general.alignment", T.UINT32, 64).tensor("a", (8,)).tensor("b", (8,), offset=32)
    err = refused(b.build().data)
    assert "not aligned to 64" in err.problem


def test_tensor_data_past_end_of_file_is_refused() -> None:
    built = two_tensor_builder().build()
    last = parse(built.data).tensors[-1]
    data_end = built.data_offset + last.offset + last.n_bytes
    parse(built.data[:data_end])  # the trailing alignment padding is not required
    err = refused(built.data[: data_end - 1])
    assert err.offset == built.at["t:output.weight:offset"]
    assert "runs past the end of the file" in err.problem


def test_overlapping_tensor_data_is_refused() -> None:
    built = HeaderBuilder().tensor("a", (64,)).tensor("b", (8,), offset=224).tensor("c", (8,), offset=128).build()
    err = refused(built.data)
    # sorted by offset: a [0, 256), c [128, 160), b [224, 256); c is the first to overlap.
    assert err.offset == built.at["t:c:offset"]
    assert "overlaps tensor 'a'" in err.problem


def test_alignment_not_a_power_of_two_is_refused() -> None:
    built = HeaderBuilder().kv("general.alignment", T.UINT32, 48).build()
    err = refused(built.data)
    assert err.offset == built.at["kv:general.alignment:value"]
    assert "48 is not a positive power of two" in err.problem


def test_alignment_zero_is_refused() -> None:
    built = HeaderBuilder().kv("general.alignment", T.UINT32, 0).build()
    assert "0 is not a positive power of two" in refused(built.data).problem


def test_alignment_of_the_wrong_type_is_refused() -> None:
    built = HeaderBuilder().kv("general.alignment", T.UINT64, 32).build()
    err = refused(built.data)
    assert err.offset == built.at["kv:general.alignment:type"]
    assert "must be uint32, got uint64" in err.problem


def test_header_past_the_header_size_limit_is_refused() -> None:
    built = HeaderBuilder().kv("s", T.STRING, "x" * 200).build()
    err = refused(built.data, limits=HeaderLimits(max_header_bytes=128))
    assert err.offset == built.at["kv:s:value"]
    assert "header size limit (128 bytes)" in err.problem


def test_invalid_limits_are_a_programming_error() -> None:
    with pytest.raises(ValueError, match="max_kv"):
        HeaderLimits(max_kv=-1)


def test_count_past_the_header_limit_but_inside_the_file_names_the_limit() -> None:
    built = HeaderBuilder().kv("a", T.ARRAY, list(range(100)), etype=T.UINT32).build()
    limit = built.at["kv:a:count"] + 8 + 200  # the file holds all 400 bytes; the limit cuts them off
    err = refused(built.data, limits=HeaderLimits(max_header_bytes=limit))
    assert err.offset == built.at["kv:a:count"]
    assert f"header size limit ({limit} bytes)" in err.problem
