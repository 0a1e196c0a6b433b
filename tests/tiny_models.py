"""Tiny GGUF models that llama-server really loads, one writer per architecture family.

Each `write_<arch>` writes a random-weight (or, with `sparse=True`, all-zero) model with exactly the tensors
llama.cpp's loader creates for that architecture, a byte-fallback SPM vocabulary, and the metadata the
architecture requires. With `sparse=True` the tensor data region is left as a file hole (the header is
written, then the file is truncated to its full size), so realistic 9B-30B shapes cost almost no disk and
load as zeros. Used by the end-to-end tests and by `python -m benchmarks.accuracy`.

Shapes follow ggml order ({ne0, ne1, …}); numpy arrays are the reverse.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

__all__ = [
    "ModelSpec",
    "write_gemma3",
    "write_granitehybrid",
    "write_llama",
    "write_mamba2",
    "write_model",
    "write_qwen35",
]

_TYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}


@dataclass
class ModelSpec:
    """Metadata and tensor list of a model to write. `tensors` holds (name, ggml shape, type name)."""

    arch: str
    kv: dict[str, Any]
    tensors: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)
    negative: set[str] = field(default_factory=set)  # tensors whose values must be negative (ssm_a)

    def add(self, name: str, shape: Sequence[int], dtype: str = "f32") -> None:
        self.tensors.append((name, tuple(int(d) for d in shape), dtype))


def _n_bytes(shape: tuple[int, ...], dtype: str) -> int:
    block, size = gguf.GGML_QUANT_SIZES[_TYPES[dtype]]
    n = int(np.prod(shape))
    if shape[0] % block:
        raise ValueError(f"row of {shape[0]} is not a multiple of {dtype}'s block of {block}")
    return n // block * size


def _vocab(spec: ModelSpec, n_vocab: int) -> None:
    """Byte-fallback SPM: <unk>, <s>, </s>, 256 byte tokens, then plain filler tokens up to n_vocab."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab must be at least {len(tokens)}")
    tokens += [f"t{i}" for i in range(n_vocab - len(tokens))]
    types += [1] * (n_vocab - len(types))
    spec.kv["tokenizer.ggml.model"] = "llama"
    spec.kv["tokenizer.ggml.tokens"] = tokens
    spec.kv["tokenizer.ggml.scores"] = [0.0] * n_vocab
    spec.kv["tokenizer.ggml.token_type"] = types
    spec.kv["tokenizer.ggml.bos_token_id"] = 1
    spec.kv["tokenizer.ggml.eos_token_id"] = 2
    spec.kv["tokenizer.ggml.unknown_token_id"] = 0


def write_model(spec: ModelSpec, path: str | os.PathLike[str], *, sparse: bool = False, seed: int = 0) -> Path:
    """Writes `spec` as a GGUF file; with `sparse`, the data region is a hole (loads as zeros)."""
    out = Path(path)
    writer = gguf.GGUFWriter(str(out), spec.arch)
    for key, value in spec.kv.items():
        if key == "general.architecture":
            continue
        _add_kv(writer, key, value)
    for name, shape, dtype in spec.tensors:
        np_dtype = np.float32 if dtype == "f32" else np.float16 if dtype == "f16" else np.uint8
        n_bytes = _n_bytes(shape, dtype)
        raw = None if dtype in ("f32", "f16") else _TYPES[dtype]
        np_shape: tuple[int, ...] = tuple(reversed(shape))
        if raw is not None:
            # quantized/bf16 tensors are described by their byte shape, as gguf's writer expects
            block, size = gguf.GGML_QUANT_SIZES[raw]
            np_shape = (*np_shape[:-1], shape[0] // block * size)
        writer.add_tensor_info(name, np_shape, np.dtype(np_dtype), n_bytes, raw_dtype=raw)
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    start = fout.tell()
    alignment = writer.data_alignment
    total = sum(gguf.GGUFWriter.ggml_pad(_n_bytes(s, d), alignment) for _, s, d in spec.tensors)
    if sparse:
        fout.truncate(start + total)
    else:
        rng = np.random.default_rng(seed)
        for name, shape, dtype in spec.tensors:
            n_bytes = _n_bytes(shape, dtype)
            if dtype == "f32":
                data = rng.normal(0.0, 0.02, size=int(np.prod(shape))).astype(np.float32)
                if name in spec.negative:
                    data = (-np.abs(data) - np.float32(0.5)).astype(np.float32)
                fout.write(data.tobytes())
            elif dtype == "f16":
                fout.write(rng.normal(0.0, 0.02, size=int(np.prod(shape))).astype(np.float16).tobytes())
            else:
                fout.write(bytes(n_bytes))
            writer.write_padding(fout, n_bytes)
    writer.close()
    return out


def _add_kv(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list | tuple):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"unsupported metadata value for {key}: {value!r}")


def _base(
    arch: str,
    *,
    n_layer: int,
    n_embd: int,
    n_head: int | list[int],
    n_head_kv: int | list[int],
    n_ff: int | list[int],
    n_vocab: int,
    n_ctx_train: int = 32768,
    head_dim: int | None = None,
) -> ModelSpec:
    spec = ModelSpec(arch=arch, kv={})
    spec.kv["general.name"] = f"tiny-{arch}"
    spec.kv[f"{arch}.block_count"] = n_layer
    spec.kv[f"{arch}.context_length"] = n_ctx_train
    spec.kv[f"{arch}.embedding_length"] = n_embd
    spec.kv[f"{arch}.feed_forward_length"] = n_ff
    spec.kv[f"{arch}.attention.head_count"] = n_head
    spec.kv[f"{arch}.attention.head_count_kv"] = n_head_kv
    spec.kv[f"{arch}.attention.layer_norm_rms_epsilon"] = 1e-6
    spec.kv[f"{arch}.rope.freq_base"] = 10000.0
    if head_dim is not None:
        spec.kv[f"{arch}.attention.key_length"] = head_dim
        spec.kv[f"{arch}.attention.value_length"] = head_dim
    _vocab(spec, n_vocab)
    return spec


def _globals(spec: ModelSpec, n_embd: int, n_vocab: int, dtype: str, *, tied: bool = False) -> None:
    # Global tensors first, blocks after: the nextn blocks then end the file, so a model loaded without
    # them maps one contiguous range, as converted models do.
    spec.add("token_embd.weight", (n_embd, n_vocab), dtype)
    spec.add("output_norm.weight", (n_embd,))
    if not tied:
        spec.add("output.weight", (n_embd, n_vocab), dtype)


def _per_layer(value: int | list[int], il: int) -> int:
    return value[il] if isinstance(value, list) else value


def write_llama(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int | list[int] = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
    dtype: str = "f32",
    tied: bool = False,
    sparse: bool = False,
) -> Path:
    """A llama model; `n_head_kv` may be a per-layer list (variable GQA)."""
    head_dim = n_embd // n_head
    spec = _base(
        "llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab
    )
    spec.kv["llama.rope.dimension_count"] = head_dim
    _globals(spec, n_embd, n_vocab, dtype, tied=tied)
    for il in range(n_layer):
        kv = _per_layer(n_head_kv, il) * head_dim
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        spec.add(p + "attn_q.weight", (n_embd, n_embd), dtype)
        spec.add(p + "attn_k.weight", (n_embd, kv), dtype)
        spec.add(p + "attn_v.weight", (n_embd, kv), dtype)
        spec.add(p + "attn_output.weight", (n_embd, n_embd), dtype)
        spec.add(p + "ffn_norm.weight", (n_embd,))
        spec.add(p + "ffn_gate.weight", (n_embd, n_ff), dtype)
        spec.add(p + "ffn_up.weight", (n_embd, n_ff), dtype)
        spec.add(p + "ffn_down.weight", (n_ff, n_embd), dtype)
    return write_model(spec, path, sparse=sparse)


def write_gemma3(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 6,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    n_swa: int = 128,
    swa_pattern: int | list[bool] | None = 3,
    sparse: bool = False,
) -> Path:
    """A gemma3 model with sliding-window layers (pattern: every `swa_pattern`-th layer is global)."""
    spec = _base(
        "gemma3",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        head_dim=head_dim,
    )
    spec.kv["gemma3.attention.sliding_window"] = n_swa
    if swa_pattern is not None:
        spec.kv["gemma3.attention.sliding_window_pattern"] = swa_pattern
    spec.kv["gemma3.rope.freq_base_swa"] = 10000.0
    _globals(spec, n_embd, n_vocab, "f32", tied=True)
    q = n_head * head_dim
    kv = n_head_kv * head_dim
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        spec.add(p + "attn_q.weight", (n_embd, q))
        spec.add(p + "attn_k.weight", (n_embd, kv))
        spec.add(p + "attn_v.weight", (n_embd, kv))
        spec.add(p + "attn_output.weight", (q, n_embd))
        spec.add(p + "post_attention_norm.weight", (n_embd,))
        spec.add(p + "attn_k_norm.weight", (head_dim,))
        spec.add(p + "attn_q_norm.weight", (head_dim,))
        spec.add(p + "ffn_norm.weight", (n_embd,))
        spec.add(p + "ffn_gate.weight", (n_embd, n_ff))
        spec.add(p + "ffn_up.weight", (n_embd, n_ff))
        spec.add(p + "ffn_down.weight", (n_ff, n_embd))
        spec.add(p + "post_ffw_norm.weight", (n_embd,))
    return write_model(spec, path)


def write_qwen35(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_nextn: int = 1,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    interval: int = 4,
    conv_kernel: int = 4,
    state_size: int = 16,
    group_count: int = 2,
    dt_rank: int = 4,
    dtype: str = "f32",
    n_ctx_train: int = 32768,
    sparse: bool = False,
) -> Path:
    """A qwen35 hybrid: `n_layer` trunk layers (every `interval`-th full attention) + `n_nextn` MTP blocks.

    `inner_size = state_size · dt_rank` (the value dimension of the gated delta net).
    """
    return _write_qwen35_family(
        path,
        "qwen35",
        n_layer=n_layer,
        n_nextn=n_nextn,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        n_vocab=n_vocab,
        interval=interval,
        ssm=(conv_kernel, state_size, group_count, dt_rank),
        dtype=dtype,
        n_ctx_train=n_ctx_train,
        sparse=sparse,
    )


def write_qwen35moe(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_nextn: int = 1,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_vocab: int = 259,
    interval: int = 4,
    conv_kernel: int = 4,
    state_size: int = 16,
    group_count: int = 2,
    dt_rank: int = 4,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
) -> Path:
    """A qwen35moe hybrid: qwen35's blocks with every FFN a routed MoE plus a gated shared expert."""
    return _write_qwen35_family(
        path,
        "qwen35moe",
        n_layer=n_layer,
        n_nextn=n_nextn,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff_exp,
        n_vocab=n_vocab,
        interval=interval,
        ssm=(conv_kernel, state_size, group_count, dt_rank),
        experts=(n_expert, n_expert_used),
    )


def _write_qwen35_family(
    path: str | os.PathLike[str],
    arch: str,
    *,
    n_layer: int,
    n_nextn: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_ff: int,
    n_vocab: int,
    interval: int,
    ssm: tuple[int, int, int, int],
    experts: tuple[int, int] = (0, 0),
    dtype: str = "f32",
    n_ctx_train: int = 32768,
    sparse: bool = False,
) -> Path:
    conv_kernel, state_size, group_count, dt_rank = ssm
    n_expert, n_expert_used = experts
    n_all = n_layer + n_nextn
    inner = state_size * dt_rank
    spec = _base(
        arch,
        n_layer=n_all,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        head_dim=head_dim,
    )
    spec.kv[f"{arch}.rope.dimension_count"] = head_dim
    spec.kv[f"{arch}.rope.dimension_sections"] = [head_dim // 4, head_dim // 8, head_dim // 8, 0]
    spec.kv[f"{arch}.ssm.conv_kernel"] = conv_kernel
    spec.kv[f"{arch}.ssm.inner_size"] = inner
    spec.kv[f"{arch}.ssm.state_size"] = state_size
    spec.kv[f"{arch}.ssm.time_step_rank"] = dt_rank
    spec.kv[f"{arch}.ssm.group_count"] = group_count
    spec.kv[f"{arch}.full_attention_interval"] = interval
    if n_nextn:
        spec.kv[f"{arch}.nextn_predict_layers"] = n_nextn
    if n_expert:
        spec.kv[f"{arch}.expert_count"] = n_expert
        spec.kv[f"{arch}.expert_used_count"] = n_expert_used
        spec.kv[f"{arch}.expert_feed_forward_length"] = n_ff
        spec.kv[f"{arch}.expert_shared_feed_forward_length"] = n_ff
    _globals(spec, n_embd, n_vocab, dtype)
    key_dim = state_size * group_count
    q = n_head * head_dim
    kv = n_head_kv * head_dim

    def attention_block(p: str) -> None:
        spec.add(p + "attn_q.weight", (n_embd, q * 2), dtype)
        spec.add(p + "attn_k.weight", (n_embd, kv), dtype)
        spec.add(p + "attn_v.weight", (n_embd, kv), dtype)
        spec.add(p + "attn_output.weight", (q, n_embd), dtype)
        spec.add(p + "attn_q_norm.weight", (head_dim,))
        spec.add(p + "attn_k_norm.weight", (head_dim,))

    for il in range(n_all):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        spec.add(p + "post_attention_norm.weight", (n_embd,))
        if il >= n_layer or (il + 1) % interval == 0:
            attention_block(p)
        else:
            spec.add(p + "attn_qkv.weight", (n_embd, 2 * key_dim + inner), dtype)
            spec.add(p + "attn_gate.weight", (n_embd, inner), dtype)
            spec.add(p + "ssm_conv1d.weight", (conv_kernel, 2 * key_dim + inner))
            spec.add(p + "ssm_dt.bias", (dt_rank,))
            spec.add(p + "ssm_a", (dt_rank,))
            spec.negative.add(p + "ssm_a")
            spec.add(p + "ssm_beta.weight", (n_embd, dt_rank), dtype)
            spec.add(p + "ssm_alpha.weight", (n_embd, dt_rank), dtype)
            spec.add(p + "ssm_norm.weight", (state_size,))
            spec.add(p + "ssm_out.weight", (inner, n_embd), dtype)
        if n_expert:
            _experts(spec, p, n_embd, n_ff, n_expert)
            spec.add(p + "ffn_gate_inp_shexp.weight", (n_embd,))
            spec.add(p + "ffn_gate_shexp.weight", (n_embd, n_ff))
            spec.add(p + "ffn_up_shexp.weight", (n_embd, n_ff))
            spec.add(p + "ffn_down_shexp.weight", (n_ff, n_embd))
        else:
            spec.add(p + "ffn_gate.weight", (n_embd, n_ff), dtype)
            spec.add(p + "ffn_up.weight", (n_embd, n_ff), dtype)
            spec.add(p + "ffn_down.weight", (n_ff, n_embd), dtype)
        if il >= n_layer:
            spec.add(p + "nextn.eh_proj.weight", (2 * n_embd, n_embd), dtype)
            spec.add(p + "nextn.enorm.weight", (n_embd,))
            spec.add(p + "nextn.hnorm.weight", (n_embd,))
    return write_model(spec, path, sparse=sparse)


def write_granitehybrid(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    attention_layers: Sequence[int] = (1, 3),
    n_head_kv: int | Sequence[int] = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
    conv_kernel: int = 4,
    state_size: int = 16,
    group_count: int = 1,
    dt_rank: int = 8,
) -> Path:
    """A granitehybrid (Granite-4.0-H) model: Mamba2 layers, attention where head_count_kv > 0.

    `n_head_kv` may give one count per attention layer (in `attention_layers` order): granitehybrid sizes
    each attention layer's K/V projections by its own head count.
    """
    inner = 2 * n_embd  # llama.cpp asserts an expansion factor of 2
    head_dim = n_embd // n_head
    per_attention = [n_head_kv] * len(attention_layers) if isinstance(n_head_kv, int) else list(n_head_kv)
    heads = dict(zip(attention_layers, per_attention, strict=True))
    kv_heads = [heads.get(il, 0) for il in range(n_layer)]
    spec = _base(
        "granitehybrid",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=kv_heads,
        n_ff=n_ff,
        n_vocab=n_vocab,
    )
    spec.kv["granitehybrid.rope.dimension_count"] = head_dim
    spec.kv["granitehybrid.ssm.conv_kernel"] = conv_kernel
    spec.kv["granitehybrid.ssm.inner_size"] = inner
    spec.kv["granitehybrid.ssm.state_size"] = state_size
    spec.kv["granitehybrid.ssm.time_step_rank"] = dt_rank
    spec.kv["granitehybrid.ssm.group_count"] = group_count
    _globals(spec, n_embd, n_vocab, "f32")
    conv_dim = inner + 2 * group_count * state_size
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        if kv_heads[il] == 0:
            spec.add(p + "ssm_in.weight", (n_embd, 2 * inner + 2 * group_count * state_size + dt_rank))
            spec.add(p + "ssm_conv1d.weight", (conv_kernel, conv_dim))
            spec.add(p + "ssm_conv1d.bias", (conv_dim,))
            spec.add(p + "ssm_dt.bias", (dt_rank,))
            spec.add(p + "ssm_a", (1, dt_rank))
            spec.negative.add(p + "ssm_a")
            spec.add(p + "ssm_d", (1, dt_rank))
            spec.add(p + "ssm_norm.weight", (inner // group_count, group_count))
            spec.add(p + "ssm_out.weight", (inner, n_embd))
        else:
            kv = kv_heads[il] * head_dim
            spec.add(p + "attn_q.weight", (n_embd, n_embd))
            spec.add(p + "attn_k.weight", (n_embd, kv))
            spec.add(p + "attn_v.weight", (n_embd, kv))
            spec.add(p + "attn_output.weight", (n_embd, n_embd))
        spec.add(p + "ffn_norm.weight", (n_embd,))
        spec.add(p + "ffn_gate.weight", (n_embd, n_ff))
        spec.add(p + "ffn_up.weight", (n_embd, n_ff))
        spec.add(p + "ffn_down.weight", (n_ff, n_embd))
    return write_model(spec, path)


def write_mamba2(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    inner: int = 128,
    conv_kernel: int = 4,
    state_size: int = 16,
    group_count: int = 2,
    dt_rank: int = 8,
    n_vocab: int = 259,
) -> Path:
    """A pure-recurrent Mamba2 model (no attention, no KV cache)."""
    spec = ModelSpec(arch="mamba2", kv={})
    spec.kv["general.name"] = "tiny-mamba2"
    spec.kv["mamba2.block_count"] = n_layer
    spec.kv["mamba2.context_length"] = 1 << 20
    spec.kv["mamba2.embedding_length"] = n_embd
    spec.kv["mamba2.feed_forward_length"] = 0
    spec.kv["mamba2.attention.head_count"] = 0
    spec.kv["mamba2.attention.layer_norm_rms_epsilon"] = 1e-6
    spec.kv["mamba2.ssm.conv_kernel"] = conv_kernel
    spec.kv["mamba2.ssm.inner_size"] = inner
    spec.kv["mamba2.ssm.state_size"] = state_size
    spec.kv["mamba2.ssm.time_step_rank"] = dt_rank
    spec.kv["mamba2.ssm.group_count"] = group_count
    _vocab(spec, n_vocab)
    _globals(spec, n_embd, n_vocab, "f32")
    conv_dim = inner + 2 * group_count * state_size
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        spec.add(p + "ssm_in.weight", (n_embd, inner + conv_dim + dt_rank))
        spec.add(p + "ssm_conv1d.weight", (conv_kernel, conv_dim))
        spec.add(p + "ssm_conv1d.bias", (conv_dim,))
        spec.add(p + "ssm_dt.bias", (dt_rank,))
        spec.add(p + "ssm_a", (1, dt_rank))
        spec.negative.add(p + "ssm_a")
        spec.add(p + "ssm_d", (1, dt_rank))
        spec.add(p + "ssm_norm.weight", (inner // group_count, group_count))
        spec.add(p + "ssm_out.weight", (inner, n_embd))
    return write_model(spec, path)


def write_qwen35_9b(path: str | os.PathLike[str]) -> Path:
    """The Qwen3.5-9B geometry (32 layers + 1 nextn: 8 attention, 24 recurrent; 4 KV heads x 256; conv 4,
    inner 4096, state 128, groups 16) as a sparse file: the header is real, the weights read as zeros."""
    return write_qwen35(
        path,
        n_layer=32,
        n_nextn=1,
        n_embd=4096,
        n_head=16,
        n_head_kv=4,
        head_dim=256,
        n_ff=12288,
        n_vocab=248320,
        state_size=128,
        group_count=16,
        dt_rank=32,
        dtype="f16",
        n_ctx_train=262144,
        sparse=True,
    )


def write_hybrid_set(directory: Path, *, n_vocab: int, llama_layers: int) -> dict[str, Path]:
    """The three models the exactness tests start most: a dense llama, a qwen35 with an MTP block (gated
    delta net + attention every 4th layer) and a granitehybrid with per-layer KV heads (1, 4 and 2)."""
    return {
        "llama": write_llama(
            directory / "llama.gguf", n_layer=llama_layers, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=n_vocab
        ),
        "qwen35": write_qwen35(
            directory / "qwen35.gguf",
            n_layer=4,
            n_nextn=1,
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            head_dim=64,
            n_ff=256,
            n_vocab=n_vocab,
            state_size=32,
            group_count=2,
            dt_rank=8,
        ),
        "granitehybrid": write_granitehybrid(
            directory / "granitehybrid.gguf",
            n_layer=5,
            n_embd=64,
            attention_layers=(1, 3, 4),
            n_head_kv=(1, 4, 2),
            n_vocab=n_vocab,
            state_size=32,
            group_count=2,
        ),
    }


# --- more architectures, one writer each; tensor lists follow each family's `load_arch_tensors` -------------


def _attention(
    spec: ModelSpec, p: str, n_embd: int, q: int, k: int, v: int, *, out: int | None = None, bias: bool = False
) -> None:
    """Separate Q/K/V projections (optionally with biases) and the output projection from `out` (default q)."""
    spec.add(p + "attn_q.weight", (n_embd, q))
    spec.add(p + "attn_k.weight", (n_embd, k))
    spec.add(p + "attn_v.weight", (n_embd, v))
    if bias:
        spec.add(p + "attn_q.bias", (q,))
        spec.add(p + "attn_k.bias", (k,))
        spec.add(p + "attn_v.bias", (v,))
    spec.add(p + "attn_output.weight", (q if out is None else out, n_embd))


def _ffn(spec: ModelSpec, p: str, n_embd: int, n_ff: int, *, gate: bool = True) -> None:
    if gate:
        spec.add(p + "ffn_gate.weight", (n_embd, n_ff))
    spec.add(p + "ffn_up.weight", (n_embd, n_ff))
    spec.add(p + "ffn_down.weight", (n_ff, n_embd))


def _experts(spec: ModelSpec, p: str, n_embd: int, n_ff_exp: int, n_expert: int, *, gate: bool = True) -> None:
    """A routed MoE FFN: the router and the stacked expert matrices (3-d tensors)."""
    spec.add(p + "ffn_gate_inp.weight", (n_embd, n_expert))
    if gate:
        spec.add(p + "ffn_gate_exps.weight", (n_embd, n_ff_exp, n_expert))
    spec.add(p + "ffn_up_exps.weight", (n_embd, n_ff_exp, n_expert))
    spec.add(p + "ffn_down_exps.weight", (n_ff_exp, n_embd, n_expert))


def _mamba2_mixer(
    spec: ModelSpec,
    p: str,
    n_embd: int,
    *,
    inner: int,
    conv_kernel: int,
    state_size: int,
    group_count: int,
    dt_rank: int,
    norm: bool = True,
) -> None:
    """A Mamba2 mixer as nemotron_h and falcon-h1 load it (ssm_in packs z, x, B, C and dt)."""
    conv_dim = inner + 2 * group_count * state_size
    spec.add(p + "ssm_in.weight", (n_embd, inner + conv_dim + dt_rank))
    spec.add(p + "ssm_conv1d.weight", (conv_kernel, conv_dim))
    spec.add(p + "ssm_conv1d.bias", (conv_dim,))
    spec.add(p + "ssm_dt.bias", (dt_rank,))
    spec.add(p + "ssm_a", (1, dt_rank))
    spec.negative.add(p + "ssm_a")
    spec.add(p + "ssm_d", (1, dt_rank))
    if norm:
        spec.add(p + "ssm_norm.weight", (inner // group_count, group_count))
    spec.add(p + "ssm_out.weight", (inner, n_embd))


def _mamba1_mixer(spec: ModelSpec, p: str, n_embd: int, *, conv_kernel: int, state_size: int, dt_rank: int) -> None:
    """A Mamba (v1) mixer; llama.cpp only supports an expansion factor of 2 (inner = 2 n_embd)."""
    inner = 2 * n_embd
    spec.add(p + "ssm_in.weight", (n_embd, 2 * inner))
    spec.add(p + "ssm_conv1d.weight", (conv_kernel, inner))
    spec.add(p + "ssm_conv1d.bias", (inner,))
    spec.add(p + "ssm_x.weight", (inner, dt_rank + 2 * state_size))
    spec.add(p + "ssm_dt.weight", (dt_rank, inner))
    spec.add(p + "ssm_dt.bias", (inner,))
    spec.add(p + "ssm_a", (state_size, inner))
    spec.negative.add(p + "ssm_a")
    spec.add(p + "ssm_d", (inner,))
    spec.add(p + "ssm_out.weight", (inner, n_embd))


def _nextn(spec: ModelSpec, p: str, n_embd: int) -> None:
    """The tensors that make a block an MTP (nextn) head: input fusion and its two norms."""
    spec.add(p + "nextn.eh_proj.weight", (2 * n_embd, n_embd))
    spec.add(p + "nextn.enorm.weight", (n_embd,))
    spec.add(p + "nextn.hnorm.weight", (n_embd,))


def _ssm_keys(spec: ModelSpec, *, conv_kernel: int, inner: int, state_size: int, dt_rank: int, groups: int) -> None:
    a = spec.arch
    spec.kv[f"{a}.ssm.conv_kernel"] = conv_kernel
    spec.kv[f"{a}.ssm.inner_size"] = inner
    spec.kv[f"{a}.ssm.state_size"] = state_size
    spec.kv[f"{a}.ssm.time_step_rank"] = dt_rank
    if groups:
        spec.kv[f"{a}.ssm.group_count"] = groups


def write_qwen2(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
) -> Path:
    """A qwen2 model: GQA with Q/K/V biases, head size n_embd / n_head, separate output matrix."""
    spec = _base(
        "qwen2", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab
    )
    _globals(spec, n_embd, n_vocab, "f32")
    kv = n_head_kv * (n_embd // n_head)
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        _attention(spec, p, n_embd, n_embd, kv, kv, bias=True)
        spec.add(p + "ffn_norm.weight", (n_embd,))
        _ffn(spec, p, n_embd, n_ff)
    return write_model(spec, path)


def _write_qwen3_family(
    path: str | os.PathLike[str],
    arch: str,
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_ff: int,
    n_vocab: int,
    n_expert: int = 0,
    n_expert_used: int = 0,
    n_ff_exp: int = 0,
) -> Path:
    spec = _base(
        arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        head_dim=head_dim,
    )
    if n_expert:
        spec.kv[f"{arch}.expert_count"] = n_expert
        spec.kv[f"{arch}.expert_used_count"] = n_expert_used
        spec.kv[f"{arch}.expert_feed_forward_length"] = n_ff_exp
    _globals(spec, n_embd, n_vocab, "f32", tied=True)
    q = n_head * head_dim
    kv = n_head_kv * head_dim
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        _attention(spec, p, n_embd, q, kv, kv)
        spec.add(p + "attn_q_norm.weight", (head_dim,))
        spec.add(p + "attn_k_norm.weight", (head_dim,))
        spec.add(p + "ffn_norm.weight", (n_embd,))
        if n_expert:
            _experts(spec, p, n_embd, n_ff_exp, n_expert)
        else:
            _ffn(spec, p, n_embd, n_ff)
    return write_model(spec, path)


def write_qwen3(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
) -> Path:
    """A qwen3 model: GQA with an explicit head size (q/k norms), tied output embeddings."""
    return _write_qwen3_family(
        path,
        "qwen3",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        n_vocab=n_vocab,
    )


def write_qwen3moe(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
) -> Path:
    """A qwen3moe model: qwen3 attention, every FFN a routed mixture of `n_expert` experts."""
    return _write_qwen3_family(
        path,
        "qwen3moe",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        n_vocab=n_vocab,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=n_ff_exp,
    )


def write_gemma2(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    n_swa: int | None = 128,
    swa_pattern: int | list[bool] | None = None,
) -> Path:
    """A gemma2 model: sliding window on every other layer unless `swa_pattern` says otherwise; without
    `n_swa` the window is gemma 2's default of 4096."""
    spec = _base(
        "gemma2",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        head_dim=head_dim,
    )
    if n_swa is not None:
        spec.kv["gemma2.attention.sliding_window"] = n_swa
    if swa_pattern is not None:
        spec.kv["gemma2.attention.sliding_window_pattern"] = swa_pattern
    spec.kv["gemma2.attn_logit_softcapping"] = 50.0
    spec.kv["gemma2.final_logit_softcapping"] = 30.0
    _globals(spec, n_embd, n_vocab, "f32", tied=True)
    q = n_head * head_dim
    kv = n_head_kv * head_dim
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        _attention(spec, p, n_embd, q, kv, kv)
        spec.add(p + "post_attention_norm.weight", (n_embd,))
        spec.add(p + "ffn_norm.weight", (n_embd,))
        _ffn(spec, p, n_embd, n_ff)
        spec.add(p + "post_ffw_norm.weight", (n_embd,))
    return write_model(spec, path)


def write_cohere2(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
    n_swa: int = 128,
    swa_pattern: int | None = None,
) -> Path:
    """A cohere2 (Command R7B) model: three sliding-window layers then one global (pattern 4 by default)."""
    spec = _base(
        "cohere2", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab
    )
    spec.kv["cohere2.attention.sliding_window"] = n_swa
    if swa_pattern is not None:
        spec.kv["cohere2.attention.sliding_window_pattern"] = swa_pattern
    spec.kv["cohere2.logit_scale"] = 0.25
    spec.kv["cohere2.attention.layer_norm_epsilon"] = 1e-5
    _globals(spec, n_embd, n_vocab, "f32", tied=True)
    kv = n_head_kv * (n_embd // n_head)
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        _attention(spec, p, n_embd, n_embd, kv, kv)
        _ffn(spec, p, n_embd, n_ff)
    return write_model(spec, path)


def write_gpt_oss(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_vocab: int = 259,
    n_swa: int = 128,
    n_expert: int = 4,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
    n_ff: int = 0,
) -> Path:
    """A gpt-oss model: attention sinks, sliding window on every other layer, MoE FFNs with biases.
    `n_ff` is only the header's feed_forward_length (released files repeat the expert width there)."""
    spec = _base(
        "gpt-oss",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        head_dim=head_dim,
    )
    spec.kv["gpt-oss.rope.dimension_count"] = head_dim
    spec.kv["gpt-oss.attention.sliding_window"] = n_swa
    spec.kv["gpt-oss.expert_count"] = n_expert
    spec.kv["gpt-oss.expert_used_count"] = n_expert_used
    spec.kv["gpt-oss.expert_feed_forward_length"] = n_ff_exp
    _globals(spec, n_embd, n_vocab, "f32")
    q = n_head * head_dim
    kv = n_head_kv * head_dim
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        spec.add(p + "post_attention_norm.weight", (n_embd,))
        _attention(spec, p, n_embd, q, kv, kv)
        spec.add(p + "attn_output.bias", (n_embd,))
        spec.add(p + "attn_sinks.weight", (n_head,))
        _experts(spec, p, n_embd, n_ff_exp, n_expert)
        spec.add(p + "ffn_gate_inp.bias", (n_expert,))
        spec.add(p + "ffn_gate_exps.bias", (n_ff_exp, n_expert))
        spec.add(p + "ffn_up_exps.bias", (n_ff_exp, n_expert))
        spec.add(p + "ffn_down_exps.bias", (n_embd, n_expert))
    return write_model(spec, path)


def write_nemotron_h(
    path: str | os.PathLike[str],
    *,
    layers: str = "M*M-M-",
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
    conv_kernel: int = 4,
    inner: int = 128,
    state_size: int = 16,
    group_count: int = 2,
    dt_rank: int = 8,
) -> Path:
    """A nemotron_h model; `layers` spells the blocks as Nemotron-H's pattern does: `M` a Mamba2 mixer,
    `*` attention, `-` an MLP. Only attention blocks have KV heads and only MLP blocks an FFN length, so
    an MLP block has neither KV nor recurrent state."""
    return _write_nemotron(
        path,
        "nemotron_h",
        layers=layers,
        n_nextn=0,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        ssm=(conv_kernel, inner, state_size, group_count, dt_rank),
    )


def write_nemotron_h_moe(
    path: str | os.PathLike[str],
    *,
    layers: str = "ME*ME",
    n_nextn: int = 1,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_vocab: int = 259,
    conv_kernel: int = 4,
    inner: int = 128,
    state_size: int = 16,
    group_count: int = 2,
    dt_rank: int = 8,
    n_expert: int = 4,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
) -> Path:
    """A nemotron_h_moe model: as `write_nemotron_h`, with `E` for a routed-MoE block (plus a shared
    expert), and `n_nextn` MTP blocks (attention and MoE in one block, as the converter writes them)."""
    return _write_nemotron(
        path,
        "nemotron_h_moe",
        layers=layers,
        n_nextn=n_nextn,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff_exp,
        n_vocab=n_vocab,
        ssm=(conv_kernel, inner, state_size, group_count, dt_rank),
        experts=(n_expert, n_expert_used),
    )


def _write_nemotron(
    path: str | os.PathLike[str],
    arch: str,
    *,
    layers: str,
    n_nextn: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    n_vocab: int,
    ssm: tuple[int, int, int, int, int],
    experts: tuple[int, int] = (0, 0),
) -> Path:
    conv_kernel, inner, state_size, group_count, dt_rank = ssm
    n_expert, n_expert_used = experts
    kinds = layers + "N" * n_nextn  # an MTP block has both attention heads and an FFN length
    kv_heads = [n_head_kv if kind in "*N" else 0 for kind in kinds]
    ff = [n_ff if kind in "-EN" else 0 for kind in kinds]
    spec = _base(arch, n_layer=len(kinds), n_embd=n_embd, n_head=n_head, n_head_kv=kv_heads, n_ff=ff, n_vocab=n_vocab)
    spec.kv[f"{arch}.attention.layer_norm_epsilon"] = 1e-5
    _ssm_keys(spec, conv_kernel=conv_kernel, inner=inner, state_size=state_size, dt_rank=dt_rank, groups=group_count)
    if n_expert:
        spec.kv[f"{arch}.expert_count"] = n_expert
        spec.kv[f"{arch}.expert_used_count"] = n_expert_used
        spec.kv[f"{arch}.expert_feed_forward_length"] = n_ff
        spec.kv[f"{arch}.expert_shared_feed_forward_length"] = n_ff
    if n_nextn:
        spec.kv[f"{arch}.nextn_predict_layers"] = n_nextn
    _globals(spec, n_embd, n_vocab, "f32")
    kv = n_head_kv * (n_embd // n_head)

    def moe(p: str) -> None:
        _experts(spec, p, n_embd, n_ff, n_expert, gate=False)
        spec.add(p + "exp_probs_b.bias", (n_expert,))
        spec.add(p + "ffn_up_shexp.weight", (n_embd, n_ff))
        spec.add(p + "ffn_down_shexp.weight", (n_ff, n_embd))

    for il, kind in enumerate(kinds):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        if kind == "M":
            _mamba2_mixer(
                spec,
                p,
                n_embd,
                inner=inner,
                conv_kernel=conv_kernel,
                state_size=state_size,
                group_count=group_count,
                dt_rank=dt_rank,
            )
        elif kind == "*":
            _attention(spec, p, n_embd, n_embd, kv, kv)
        elif kind == "-":
            _ffn(spec, p, n_embd, n_ff, gate=False)
        elif kind == "E" and n_expert:
            moe(p)
        elif kind == "N":
            _nextn(spec, p, n_embd)
            spec.add(p + "nextn.shared_head_norm.weight", (n_embd,))
            _attention(spec, p, n_embd, n_embd, kv, kv)
            spec.add(p + "post_attention_norm.weight", (n_embd,))
            moe(p)
        else:
            raise ValueError(f"unknown {arch} block kind {kind!r} (expected M, * or -, or E with experts)")
    return write_model(spec, path)


def write_lfm2(
    path: str | os.PathLike[str],
    *,
    attention_layers: Sequence[int] = (2, 5),
    n_layer: int = 6,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
    l_cache: int = 3,
    n_swa: int | None = None,
) -> Path:
    """An LFM2 model: short-convolution blocks, attention (with q/k norms) where head_count_kv > 0; with
    `n_swa` the attention blocks slide."""
    kv_heads = [n_head_kv if il in attention_layers else 0 for il in range(n_layer)]
    spec = _base("lfm2", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=kv_heads, n_ff=n_ff, n_vocab=n_vocab)
    spec.kv["lfm2.shortconv.l_cache"] = l_cache
    if n_swa is not None:
        spec.kv["lfm2.attention.sliding_window"] = n_swa
    spec.add("token_embd.weight", (n_embd, n_vocab))
    spec.add("token_embd_norm.weight", (n_embd,))  # LFM2's output norm carries this name
    head_dim = n_embd // n_head
    kv = n_head_kv * head_dim
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "ffn_norm.weight", (n_embd,))
        _ffn(spec, p, n_embd, n_ff)
        spec.add(p + "attn_norm.weight", (n_embd,))
        if kv_heads[il]:
            spec.add(p + "attn_q_norm.weight", (head_dim,))
            spec.add(p + "attn_k_norm.weight", (head_dim,))
            _attention(spec, p, n_embd, n_embd, kv, kv)
        else:
            spec.add(p + "shortconv.conv.weight", (l_cache, n_embd))
            spec.add(p + "shortconv.in_proj.weight", (n_embd, 3 * n_embd))
            spec.add(p + "shortconv.out_proj.weight", (n_embd, n_embd))
    return write_model(spec, path)


def write_falcon_h1(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 3,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    conv_kernel: int = 4,
    inner: int = 128,
    state_size: int = 16,
    group_count: int = 1,
    dt_rank: int = 8,
) -> Path:
    """A falcon-h1 model: every block runs attention and a Mamba2 mixer in parallel (KV and state)."""
    spec = _base(
        "falcon-h1",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        head_dim=head_dim,
    )
    _ssm_keys(spec, conv_kernel=conv_kernel, inner=inner, state_size=state_size, dt_rank=dt_rank, groups=group_count)
    _globals(spec, n_embd, n_vocab, "f32")
    q = n_head * head_dim
    kv = n_head_kv * head_dim
    for il in range(n_layer):
        p = f"blk.{il}."
        _mamba2_mixer(
            spec,
            p,
            n_embd,
            inner=inner,
            conv_kernel=conv_kernel,
            state_size=state_size,
            group_count=group_count,
            dt_rank=dt_rank,
        )
        _attention(spec, p, n_embd, q, kv, kv)
        spec.add(p + "attn_norm.weight", (n_embd,))
        spec.add(p + "ffn_norm", (n_embd,))  # falcon-h1 loads this norm without a ".weight" suffix
        _ffn(spec, p, n_embd, n_ff)
    return write_model(spec, path)


def write_jamba(
    path: str | os.PathLike[str],
    *,
    attention_layers: Sequence[int] = (2,),
    moe_layers: Sequence[int] = (1, 3),
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
    conv_kernel: int = 4,
    state_size: int = 16,
    dt_rank: int = 8,
    n_expert: int = 4,
    n_expert_used: int = 2,
) -> Path:
    """A jamba model: Mamba (v1) mixers, attention where head_count_kv > 0, MoE FFNs on `moe_layers`."""
    kv_heads = [n_head_kv if il in attention_layers else 0 for il in range(n_layer)]
    spec = _base("jamba", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=kv_heads, n_ff=n_ff, n_vocab=n_vocab)
    _ssm_keys(spec, conv_kernel=conv_kernel, inner=2 * n_embd, state_size=state_size, dt_rank=dt_rank, groups=0)
    if moe_layers:
        spec.kv["jamba.expert_count"] = n_expert
        spec.kv["jamba.expert_used_count"] = n_expert_used
    _globals(spec, n_embd, n_vocab, "f32")
    kv = n_head_kv * (n_embd // n_head)
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        if kv_heads[il]:
            _attention(spec, p, n_embd, n_embd, kv, kv)
        else:
            _mamba1_mixer(spec, p, n_embd, conv_kernel=conv_kernel, state_size=state_size, dt_rank=dt_rank)
            spec.add(p + "ssm_dt_norm.weight", (dt_rank,))
            spec.add(p + "ssm_b_norm.weight", (state_size,))
            spec.add(p + "ssm_c_norm.weight", (state_size,))
        spec.add(p + "ffn_norm.weight", (n_embd,))
        if il in moe_layers:
            _experts(spec, p, n_embd, n_ff, n_expert)
        else:
            _ffn(spec, p, n_embd, n_ff)
    return write_model(spec, path)


def write_mamba(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 3,
    n_embd: int = 64,
    conv_kernel: int = 4,
    state_size: int = 16,
    dt_rank: int = 4,
    n_vocab: int = 259,
) -> Path:
    """A pure-recurrent Mamba (v1) model with tied output embeddings."""
    spec = ModelSpec(arch="mamba", kv={})
    spec.kv["general.name"] = "tiny-mamba"
    spec.kv["mamba.block_count"] = n_layer
    spec.kv["mamba.context_length"] = 1 << 20
    spec.kv["mamba.embedding_length"] = n_embd
    spec.kv["mamba.feed_forward_length"] = 0
    spec.kv["mamba.attention.head_count"] = 0
    spec.kv["mamba.attention.layer_norm_rms_epsilon"] = 1e-5
    _ssm_keys(spec, conv_kernel=conv_kernel, inner=2 * n_embd, state_size=state_size, dt_rank=dt_rank, groups=0)
    _vocab(spec, n_vocab)
    _globals(spec, n_embd, n_vocab, "f32", tied=True)
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        _mamba1_mixer(spec, p, n_embd, conv_kernel=conv_kernel, state_size=state_size, dt_rank=dt_rank)
    return write_model(spec, path)


def write_rwkv7(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 3,
    n_embd: int = 128,
    head_size: int = 64,
    n_ff: int = 256,
    n_vocab: int = 259,
    lora_rank: int = 16,
) -> Path:
    """A pure-recurrent RWKV-7 model: token-shift rows and one wkv state (n_embd x head size) per layer."""
    spec = ModelSpec(arch="rwkv7", kv={})
    spec.kv["general.name"] = "tiny-rwkv7"
    spec.kv["rwkv7.block_count"] = n_layer
    spec.kv["rwkv7.context_length"] = 1 << 20
    spec.kv["rwkv7.embedding_length"] = n_embd
    spec.kv["rwkv7.feed_forward_length"] = n_ff
    spec.kv["rwkv7.attention.layer_norm_epsilon"] = 1e-5
    spec.kv["rwkv7.wkv.head_size"] = head_size
    for rank in ("decay", "iclr", "value_residual_mix", "gate"):
        spec.kv[f"rwkv7.attention.{rank}_lora_rank"] = lora_rank
    _vocab(spec, n_vocab)
    spec.add("token_embd.weight", (n_embd, n_vocab))
    spec.add("token_embd_norm.weight", (n_embd,))
    spec.add("token_embd_norm.bias", (n_embd,))
    spec.add("output_norm.weight", (n_embd,))
    spec.add("output_norm.bias", (n_embd,))
    spec.add("output.weight", (n_embd, n_vocab))
    for il in range(n_layer):
        p = f"blk.{il}."
        for norm in ("attn_norm", "attn_norm_2"):
            spec.add(p + norm + ".weight", (n_embd,))
            spec.add(p + norm + ".bias", (n_embd,))
        _rwkv7_time_mix(spec, p, n_embd, lora_rank)
        spec.add(p + "channel_mix_lerp_k.weight", (n_embd, 1, 1))
        spec.add(p + "channel_mix_key.weight", (n_embd, n_ff))
        spec.add(p + "channel_mix_value.weight", (n_ff, n_embd))
    return write_model(spec, path)


def write_deepseek2(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 3,
    n_dense_lead: int = 1,
    n_embd: int = 64,
    n_head: int = 4,
    q_lora_rank: int = 32,
    kv_lora_rank: int = 64,
    rope_dim: int = 16,
    qk_nope_dim: int = 32,
    v_head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    n_expert: int = 4,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
    n_expert_shared: int = 1,
    n_nextn: int = 0,
) -> Path:
    """A deepseek2 model in the MLA layout llama.cpp converts to: a low-rank Q (or a plain one with
    `q_lora_rank=0`), one latent KV "head" of kv_lora_rank + rope dims (cached as K only) with split k_b/v_b
    up-projections, MoE after
    `n_dense_lead` dense blocks, and `n_nextn` MTP blocks after the `n_layer` trunk blocks."""
    k_mla = qk_nope_dim + rope_dim
    n_all = n_layer + n_nextn
    spec = _base("deepseek2", n_layer=n_all, n_embd=n_embd, n_head=n_head, n_head_kv=1, n_ff=n_ff, n_vocab=n_vocab)
    a = "deepseek2"
    spec.kv[f"{a}.attention.key_length"] = kv_lora_rank + rope_dim
    spec.kv[f"{a}.attention.value_length"] = kv_lora_rank
    spec.kv[f"{a}.attention.key_length_mla"] = k_mla
    spec.kv[f"{a}.attention.value_length_mla"] = v_head_dim
    spec.kv[f"{a}.attention.q_lora_rank"] = q_lora_rank
    spec.kv[f"{a}.attention.kv_lora_rank"] = kv_lora_rank
    spec.kv[f"{a}.rope.dimension_count"] = rope_dim
    spec.kv[f"{a}.leading_dense_block_count"] = n_dense_lead
    spec.kv[f"{a}.expert_count"] = n_expert
    spec.kv[f"{a}.expert_used_count"] = n_expert_used
    spec.kv[f"{a}.expert_feed_forward_length"] = n_ff_exp
    spec.kv[f"{a}.expert_shared_count"] = n_expert_shared
    if n_nextn:
        spec.kv[f"{a}.nextn_predict_layers"] = n_nextn
    _globals(spec, n_embd, n_vocab, "f32")
    for il in range(n_all):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        spec.add(p + "attn_kv_a_norm.weight", (kv_lora_rank,))
        if q_lora_rank:
            spec.add(p + "attn_q_a_norm.weight", (q_lora_rank,))
            spec.add(p + "attn_q_a.weight", (n_embd, q_lora_rank))
            spec.add(p + "attn_q_b.weight", (q_lora_rank, n_head * k_mla))
        else:
            spec.add(p + "attn_q.weight", (n_embd, n_head * k_mla))
        spec.add(p + "attn_kv_a_mqa.weight", (n_embd, kv_lora_rank + rope_dim))
        spec.add(p + "attn_k_b.weight", (qk_nope_dim, kv_lora_rank, n_head))
        spec.add(p + "attn_v_b.weight", (kv_lora_rank, v_head_dim, n_head))
        spec.add(p + "attn_output.weight", (n_head * v_head_dim, n_embd))
        spec.add(p + "ffn_norm.weight", (n_embd,))
        if il < n_dense_lead:
            _ffn(spec, p, n_embd, n_ff)
        else:
            _experts(spec, p, n_embd, n_ff_exp, n_expert)
            shared = n_ff_exp * n_expert_shared
            spec.add(p + "ffn_gate_shexp.weight", (n_embd, shared))
            spec.add(p + "ffn_up_shexp.weight", (n_embd, shared))
            spec.add(p + "ffn_down_shexp.weight", (shared, n_embd))
        if il >= n_layer:
            _nextn(spec, p, n_embd)
    return write_model(spec, path)


def write_qwen3next(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    interval: int = 4,
    conv_kernel: int = 4,
    state_size: int = 16,
    group_count: int = 2,
    dt_rank: int = 4,
    n_expert: int = 4,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
    n_nextn: int = 0,
) -> Path:
    """A qwen3next model: gated delta net blocks with full attention every `interval`-th block, every FFN
    a routed MoE plus a gated shared expert; `n_nextn` MTP blocks (attention) follow the trunk."""
    inner = state_size * dt_rank
    n_all = n_layer + n_nextn
    spec = _base(
        "qwen3next",
        n_layer=n_all,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        head_dim=head_dim,
    )
    _ssm_keys(spec, conv_kernel=conv_kernel, inner=inner, state_size=state_size, dt_rank=dt_rank, groups=group_count)
    spec.kv["qwen3next.full_attention_interval"] = interval
    spec.kv["qwen3next.expert_count"] = n_expert
    spec.kv["qwen3next.expert_used_count"] = n_expert_used
    spec.kv["qwen3next.expert_feed_forward_length"] = n_ff_exp
    spec.kv["qwen3next.expert_shared_feed_forward_length"] = n_ff_exp
    if n_nextn:
        spec.kv["qwen3next.nextn_predict_layers"] = n_nextn
    _globals(spec, n_embd, n_vocab, "f32")
    key_dim = state_size * group_count
    q = n_head * head_dim
    kv = n_head_kv * head_dim
    for il in range(n_all):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        spec.add(p + "post_attention_norm.weight", (n_embd,))
        if il >= n_layer or (il + 1) % interval == 0:
            _attention(spec, p, n_embd, 2 * q, kv, kv, out=q)
            spec.add(p + "attn_q_norm.weight", (head_dim,))
            spec.add(p + "attn_k_norm.weight", (head_dim,))
        else:
            spec.add(p + "attn_qkv.weight", (n_embd, 2 * key_dim + inner))
            spec.add(p + "attn_gate.weight", (n_embd, inner))
            spec.add(p + "ssm_conv1d.weight", (conv_kernel, 2 * key_dim + inner))
            spec.add(p + "ssm_dt.bias", (dt_rank,))
            spec.add(p + "ssm_a", (dt_rank,))
            spec.negative.add(p + "ssm_a")
            spec.add(p + "ssm_ba.weight", (n_embd, 2 * dt_rank))
            spec.add(p + "ssm_norm.weight", (state_size,))
            spec.add(p + "ssm_out.weight", (inner, n_embd))
        _experts(spec, p, n_embd, n_ff_exp, n_expert)
        spec.add(p + "ffn_gate_inp_shexp.weight", (n_embd,))
        spec.add(p + "ffn_gate_shexp.weight", (n_embd, n_ff_exp))
        spec.add(p + "ffn_up_shexp.weight", (n_embd, n_ff_exp))
        spec.add(p + "ffn_down_shexp.weight", (n_ff_exp, n_embd))
        if il >= n_layer:
            _nextn(spec, p, n_embd)
    return write_model(spec, path)


def write_plamo2(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    mamba_step: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    conv_kernel: int = 4,
    state_size: int = 16,
    dt_rank: int = 4,
) -> Path:
    """A PLaMo 2 model as its converter writes it: Mamba blocks except every `mamba_step`-th (from the
    middle of the step), head counts that are 0 on Mamba blocks (layer 0 included), an explicit head size,
    no SSM groups, inner size = Mamba heads x head size."""
    mamba = [il % mamba_step != mamba_step // 2 for il in range(n_layer)]
    inner = dt_rank * head_dim
    spec = _base(
        "plamo2",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=[0 if m else n_head for m in mamba],
        n_head_kv=[0 if m else n_head_kv for m in mamba],
        n_ff=n_ff,
        n_vocab=n_vocab,
        head_dim=head_dim,
    )
    _ssm_keys(spec, conv_kernel=conv_kernel, inner=inner, state_size=state_size, dt_rank=dt_rank, groups=0)
    spec.kv["plamo2.ssm.group_count"] = 0
    _globals(spec, n_embd, n_vocab, "f32", tied=True)
    dt_dim = max(64, n_embd // 16)
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        if mamba[il]:
            spec.add(p + "ssm_in.weight", (n_embd, 2 * inner))
            spec.add(p + "ssm_conv1d.weight", (conv_kernel, inner))
            spec.add(p + "ssm_x.weight", (inner, dt_dim + 2 * state_size))
            spec.add(p + "ssm_dt.weight", (dt_dim, dt_rank))
            spec.add(p + "ssm_dt.bias", (dt_rank,))
            spec.add(p + "ssm_a", (dt_rank,))
            spec.negative.add(p + "ssm_a")
            spec.add(p + "ssm_d", (dt_rank,))
            spec.add(p + "ssm_out.weight", (inner, n_embd))
            spec.add(p + "ssm_dt_norm", (dt_dim,))  # these three norms have no ".weight" suffix
            spec.add(p + "ssm_b_norm", (state_size,))
            spec.add(p + "ssm_c_norm", (state_size,))
        else:
            q = n_head * head_dim
            kv = n_head_kv * head_dim
            spec.add(p + "attn_qkv.weight", (n_embd, q + 2 * kv))
            spec.add(p + "attn_q_norm.weight", (head_dim, n_head))
            spec.add(p + "attn_k_norm.weight", (head_dim, n_head_kv))
            spec.add(p + "attn_output.weight", (q, n_embd))
        spec.add(p + "post_attention_norm", (n_embd,))
        spec.add(p + "ffn_norm.weight", (n_embd,))
        spec.add(p + "ffn_down.weight", (n_ff, n_embd))
        spec.add(p + "ffn_up.weight", (n_embd, 2 * n_ff))
        spec.add(p + "post_ffw_norm", (n_embd,))
    return write_model(spec, path)


def write_phi3(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
    n_swa: int | None = 128,
) -> Path:
    """A phi3 model with a fused gate/up projection; its header may name a sliding window (as converted
    Phi-3 models do), which llama.cpp ignores."""
    spec = _base("phi3", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab)
    # a name containing "phi3" makes the vocabulary loader look up Phi-3's own special tokens
    spec.kv["general.name"] = "tiny-phi-three"
    if n_swa is not None:
        spec.kv["phi3.attention.sliding_window"] = n_swa
    _globals(spec, n_embd, n_vocab, "f32")
    kv = n_head_kv * (n_embd // n_head)
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        spec.add(p + "attn_qkv.weight", (n_embd, n_embd + 2 * kv))
        spec.add(p + "attn_output.weight", (n_embd, n_embd))
        spec.add(p + "ffn_norm.weight", (n_embd,))
        spec.add(p + "ffn_up.weight", (n_embd, 2 * n_ff))
        spec.add(p + "ffn_down.weight", (n_ff, n_embd))
    return write_model(spec, path)


def write_arwkv7(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 3,
    n_embd: int = 128,
    head_size: int = 64,
    n_ff: int = 256,
    n_vocab: int = 259,
    lora_rank: int = 16,
    token_shift_count: int = 1,
) -> Path:
    """An ARWKV-7 model (RWKV-7 time mix, a SwiGLU FFN): its converter writes one token-shift row."""
    spec = ModelSpec(arch="arwkv7", kv={})
    spec.kv["general.name"] = "tiny-arwkv7"
    spec.kv["arwkv7.block_count"] = n_layer
    spec.kv["arwkv7.context_length"] = 1 << 20
    spec.kv["arwkv7.embedding_length"] = n_embd
    spec.kv["arwkv7.feed_forward_length"] = n_ff
    spec.kv["arwkv7.attention.layer_norm_rms_epsilon"] = 1e-5
    spec.kv["arwkv7.wkv.head_size"] = head_size
    spec.kv["arwkv7.token_shift_count"] = token_shift_count
    for rank in ("decay", "iclr", "value_residual_mix", "gate"):
        spec.kv[f"arwkv7.attention.{rank}_lora_rank"] = lora_rank
    _vocab(spec, n_vocab)
    _globals(spec, n_embd, n_vocab, "f32")
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        _rwkv7_time_mix(spec, p, n_embd, lora_rank)
        spec.add(p + "ffn_norm.weight", (n_embd,))
        _ffn(spec, p, n_embd, n_ff)
    return write_model(spec, path)


def _rwkv7_time_mix(spec: ModelSpec, p: str, n_embd: int, lora_rank: int) -> None:
    """The RWKV-7 time-mix tensors shared by rwkv7 and arwkv7 (LoRA paths, fused lerp, projections)."""
    for lora in ("w", "a", "v", "g"):
        if lora != "g":
            spec.add(p + f"time_mix_{lora}0.weight", (n_embd,))
        spec.add(p + f"time_mix_{lora}1.weight", (n_embd, lora_rank))
        spec.add(p + f"time_mix_{lora}2.weight", (lora_rank, n_embd))
    spec.add(p + "time_mix_lerp_fused.weight", (n_embd, 1, 1, 6))
    for vec in ("k_k", "k_a", "r_k"):
        spec.add(p + f"time_mix_{vec}.weight", (n_embd,))
    for proj in ("key", "value", "receptance", "output"):
        spec.add(p + f"time_mix_{proj}.weight", (n_embd, n_embd))
    spec.add(p + "time_mix_ln.weight", (n_embd,))
    spec.add(p + "time_mix_ln.bias", (n_embd,))


def write_glm4moe(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 3,
    n_dense_lead: int = 1,
    n_nextn: int = 1,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    n_expert: int = 4,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
) -> Path:
    """A GLM-4.5-style glm4moe: dense leading blocks, then routed MoE with a shared expert, and `n_nextn`
    MTP blocks after the trunk (a dense model's MTP head, with a V cache unlike deepseek2's)."""
    n_all = n_layer + n_nextn
    spec = _base(
        "glm4moe",
        n_layer=n_all,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        head_dim=head_dim,
    )
    spec.kv["glm4moe.leading_dense_block_count"] = n_dense_lead
    spec.kv["glm4moe.expert_count"] = n_expert
    spec.kv["glm4moe.expert_used_count"] = n_expert_used
    spec.kv["glm4moe.expert_feed_forward_length"] = n_ff_exp
    spec.kv["glm4moe.expert_shared_count"] = 1
    if n_nextn:
        spec.kv["glm4moe.nextn_predict_layers"] = n_nextn
    _globals(spec, n_embd, n_vocab, "f32")
    q = n_head * head_dim
    kv = n_head_kv * head_dim
    for il in range(n_all):
        p = f"blk.{il}."
        spec.add(p + "attn_norm.weight", (n_embd,))
        _attention(spec, p, n_embd, q, kv, kv, bias=True)
        spec.add(p + "attn_q_norm.weight", (head_dim,))
        spec.add(p + "attn_k_norm.weight", (head_dim,))
        spec.add(p + "post_attention_norm.weight", (n_embd,))
        if il >= n_dense_lead:
            _experts(spec, p, n_embd, n_ff_exp, n_expert)
            spec.add(p + "exp_probs_b.bias", (n_expert,))
            spec.add(p + "ffn_gate_shexp.weight", (n_embd, n_ff_exp))
            spec.add(p + "ffn_down_shexp.weight", (n_ff_exp, n_embd))
            spec.add(p + "ffn_up_shexp.weight", (n_embd, n_ff_exp))
        else:
            _ffn(spec, p, n_embd, n_ff)
        if il >= n_layer:
            _nextn(spec, p, n_embd)
    return write_model(spec, path)
