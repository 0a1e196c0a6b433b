"""The tiny-model writers: every family reads back as GGUF with the shapes its tables give, weight types
follow the converter's rule, `sparse` leaves zeros, and a wrong table or block pattern is a clear error."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests import tiny_models, tiny_models_engine

WRITERS: dict[str, Callable[..., Path]] = {
    name: writer
    for name, writer in vars(tiny_models).items()
    if name.startswith("write_") and name not in ("write_model", "write_hybrid_set", "write_qwen35_9b")
}


def _tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}


def _field(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_every_family_reads_back_with_one_table_per_block(name: str, tmp_path: Path) -> None:
    path = WRITERS[name](tmp_path / f"{name}.gguf")
    reader = gguf.GGUFReader(path)
    arch = str(_field(reader, "general.architecture"))
    blocks = {int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    assert blocks == set(range(int(str(_field(reader, f"{arch}.block_count")))))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert isinstance(tokens, list) and len(tokens) == 259
    assert "token_embd.weight" in {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        if tensor.name.endswith("ssm_a"):  # A = -exp(A_log): the SSM kernels assume a decay
            assert (np.asarray(tensor.data) < 0).all(), tensor.name


def test_per_block_sizes_follow_each_block(tmp_path: Path) -> None:
    tensors = _tensors(tiny_models.write_llama(tmp_path / "m.gguf", n_head_kv=[1, 2, 4, 2]))
    head = 64 // 4
    assert [int(tensors[f"blk.{il}.attn_k.weight"].shape[1]) for il in range(4)] == [h * head for h in (1, 2, 4, 2)]
    granite = _tensors(tiny_models.write_granitehybrid(tmp_path / "g.gguf", n_layer=5, attention_layers=(1, 3, 4),
                                                        n_head_kv=(1, 4, 2)))  # fmt: skip
    assert [int(granite[f"blk.{il}.attn_v.weight"].shape[1]) for il in (1, 3, 4)] == [16, 64, 32]
    assert "blk.0.ssm_in.weight" in granite and "blk.0.attn_q.weight" not in granite


def test_matrices_take_the_weight_type_but_norms_and_conv_kernels_stay_f32(tmp_path: Path) -> None:
    f32, f16, q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0
    llama = _tensors(tiny_models.write_llama(tmp_path / "l.gguf", dtype="q8_0"))
    assert llama["token_embd.weight"].tensor_type == llama["blk.0.ffn_down.weight"].tensor_type == q8
    assert llama["blk.0.attn_norm.weight"].tensor_type == llama["output_norm.weight"].tensor_type == f32
    qwen35 = _tensors(tiny_models.write_qwen35(tmp_path / "q.gguf", dtype="f16"))
    assert qwen35["blk.0.attn_qkv.weight"].tensor_type == qwen35["blk.4.nextn.eh_proj.weight"].tensor_type == f16
    assert qwen35["blk.0.ssm_conv1d.weight"].tensor_type == qwen35["blk.3.attn_q_norm.weight"].tensor_type == f32


@pytest.mark.parametrize("name", ["write_llama", "write_gemma3", "write_qwen35"])
def test_sparse_models_load_as_zeros(name: str, tmp_path: Path) -> None:
    path = WRITERS[name](tmp_path / "sparse.gguf", sparse=True)
    dense = WRITERS[name](tmp_path / "dense.gguf")
    assert path.stat().st_size == dense.stat().st_size
    for tensor in gguf.GGUFReader(path).tensors:
        assert not np.asarray(tensor.data).any(), f"{name}: {tensor.name} holds data"


def test_an_unknown_nemotron_block_kind_is_refused_by_its_letter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown nemotron_h block kind 'X'"):
        tiny_models.write_nemotron_h(tmp_path / "n.gguf", layers="M*X-")
    with pytest.raises(ValueError, match="unknown nemotron_h block kind 'E'"):
        tiny_models.write_nemotron_h(tmp_path / "n.gguf", layers="ME")  # no experts in a dense nemotron_h
    assert not (tmp_path / "n.gguf").exists()


def test_a_table_naming_an_unknown_size_is_a_clear_error(tmp_path: Path) -> None:
    spec = tiny_models_engine._spec("llama", 259, {"block_count": 1})
    table = tiny_models_engine._table("attn_q.weight embd q_width")
    with pytest.raises(ValueError, match="no size named 'q_width' for 'q_width'"):
        tiny_models_engine._write(tmp_path / "m.gguf", spec, {"embd": 64}, [table])


@pytest.mark.parametrize("row", ["attn_q.weight", "attn_q.weight embd 2q+", "attn_q.weight embd (q)"])
def test_a_malformed_table_row_is_refused_when_the_table_is_built(row: str) -> None:
    with pytest.raises(ValueError, match="bad tensor row"):
        tiny_models_engine._table(row)


def test_dropping_a_tensor_a_table_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="no tensor"):
        tiny_models_engine._without(tiny_models_engine._FFN, "ffn_gate_exps.weight")
