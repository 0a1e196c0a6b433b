"""Which weights of a GGUF file llama.cpp multiplies as matrices, grouped for the CPU repack rules (core).

With no GPU, llama.cpp's CPU backend copies quantized matmul weights whose type has a kernel for the CPU's
features into a `CPU_REPACK` buffer (`actors/placement/weights.py` holds those rules). Which tensors are
matmul weights is a fact of the model file: the names llama.cpp's tensor table marks MUL_MAT (or MUL_MAT_ID
for experts) applied to `.weight`, their type and their row count. This module reads those from the header
and groups them per block (type, multiple of rows, count, padded bytes); the geometry carries the groups.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from actors.placement.gguf_header import GGUFHeader, TensorInfo
from messages.model import RepackGroup

__all__ = ["repack_groups"]


#: Block tensors llama.cpp multiplies as matrices (`llm_tensor_info` op MUL_MAT, applied to `.weight`),
#: by the name after `blk.N.`, for the version named in `LLAMA_CPP_VERSION`.
_MATMUL_BLOCK_TENSORS = frozenset(
    [
        "altup_correct_coef",
        "altup_predict_coef",
        "altup_router",
        "attn_compressor_gate",
        "attn_compressor_kv",
        "attn_conv_proj",
        "attn_gate",
        "attn_k",
        "attn_k_b",
        "attn_kv",
        "attn_kv_a_mqa",
        "attn_kv_b",
        "attn_output",
        "attn_output_a",
        "attn_output_b",
        "attn_q",
        "attn_q_a",
        "attn_q_b",
        "attn_qkv",
        "attn_v",
        "attn_v_b",
        "channel_mix_key",
        "channel_mix_receptance",
        "channel_mix_value",
        "ffn_conv_proj",
        "ffn_down",
        "ffn_down_shexp",
        "ffn_gate",
        "ffn_gate_inp",
        "ffn_gate_inp_shexp",
        "ffn_gate_shexp",
        "ffn_latent_down",
        "ffn_latent_up",
        "ffn_routed_down",
        "ffn_routed_up",
        "ffn_up",
        "ffn_up_shexp",
        "hc_attn_down",
        "hc_attn_fn",
        "hc_attn_inject",
        "hc_attn_up",
        "hc_ffn_down",
        "hc_ffn_fn",
        "hc_ffn_inject",
        "hc_ffn_up",
        "indexer.attn_k",
        "indexer.attn_q_b",
        "indexer.k_proj",
        "indexer.proj",
        "indexer.q_proj",
        "indexer_compressor_gate",
        "indexer_compressor_kv",
        "inp_gate",
        "laurel_l",
        "laurel_r",
        "nextn.eh_proj",
        "nextn.hc_head_down",
        "nextn.hc_head_up",
        "nextn.shared_head_head",
        "ple_key",
        "ple_value",
        "proj",
        "shortconv.in_proj",
        "shortconv.out_proj",
        "ssm_alpha",
        "ssm_ba",
        "ssm_beta",
        "ssm_dt",
        "ssm_f_a",
        "ssm_f_b",
        "ssm_g",
        "ssm_g_a",
        "ssm_g_b",
        "ssm_in",
        "ssm_out",
        "ssm_x",
        "time_mix_a1",
        "time_mix_a2",
        "time_mix_decay_w1",
        "time_mix_decay_w2",
        "time_mix_g1",
        "time_mix_g2",
        "time_mix_gate",
        "time_mix_key",
        "time_mix_output",
        "time_mix_receptance",
        "time_mix_v1",
        "time_mix_v2",
        "time_mix_value",
        "time_mix_w1",
        "time_mix_w2",
    ]
)
#: Expert stacks (op MUL_MAT_ID).
_MATMUL_ID_BLOCK_TENSORS = frozenset(
    [
        "ffn_down_chexps",
        "ffn_down_exps",
        "ffn_gate_chexps",
        "ffn_gate_exps",
        "ffn_gate_up_exps",
        "ffn_up_chexps",
        "ffn_up_exps",
    ]
)
_FLOAT_TYPES = frozenset({"f32", "f16", "bf16", "f64", "i8", "i16", "i32", "i64"})
_BLOCK_WEIGHT = re.compile(r"^blk\.([0-9]+)\.(.+)\.weight$")
_REPACK_ALIGNMENT = 32  # the CPU buffer types' tensor alignment


def _n_dims(shape: Sequence[int]) -> int:
    """`ggml_n_dims`: the number of dimensions up to the last one larger than 1 (at least 1)."""
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1:
            return i + 1
    return 1


def _repack_candidate(t: TensorInfo, *, expert: bool) -> tuple[str, int] | None:
    """(type, rows multiple) of a quantized matmul weight llama.cpp's CPU backend may repack."""
    kind = t.type_name.lower()
    if kind in _FLOAT_TYPES or len(t.shape) < 2 or _n_dims(t.shape) != (3 if expert else 2):
        return None
    rows = t.shape[1]
    multiple = 16
    while multiple > 1 and rows % multiple:
        multiple //= 2
    return kind, multiple


def _group(found: dict[tuple[str, int], list[int]]) -> tuple[RepackGroup, ...]:
    return tuple(
        RepackGroup(
            type=kind,
            rows_multiple=multiple,
            count=len(sizes),
            bytes=sum((n + _REPACK_ALIGNMENT - 1) // _REPACK_ALIGNMENT * _REPACK_ALIGNMENT for n in sizes),
        )
        for (kind, multiple), sizes in sorted(found.items())
    )


def repack_groups(
    header: GGUFHeader, n_layer_all: int
) -> tuple[dict[int, tuple[RepackGroup, ...]], tuple[RepackGroup, ...]]:
    """The quantized matmul weights per block, and those of the output layer (`output.weight`, or the tied
    token embeddings llama.cpp duplicates as the output matrix)."""
    per_layer: dict[int, dict[tuple[str, int], list[int]]] = {}
    output: dict[tuple[str, int], list[int]] = {}
    names = {t.name for t in header.tensors}
    for t in header.tensors:
        m = _BLOCK_WEIGHT.match(t.name)
        if m is not None:
            il, base = int(m.group(1)), m.group(2)
            if il >= n_layer_all or (base not in _MATMUL_BLOCK_TENSORS and base not in _MATMUL_ID_BLOCK_TENSORS):
                continue
            found = _repack_candidate(t, expert=base in _MATMUL_ID_BLOCK_TENSORS)
            if found is not None:
                per_layer.setdefault(il, {}).setdefault(found, []).append(t.n_bytes)
        elif t.name == "output.weight" or (t.name == "token_embd.weight" and "output.weight" not in names):
            found = _repack_candidate(t, expert=False)
            if found is not None:
                output.setdefault(found, []).append(t.n_bytes)
    return {il: _group(found) for il, found in per_layer.items()}, _group(output)
