"""Which weights of a GGUF file llama.cpp multiplies as matrices, grouped for the CPU backend's extra buffers
(core).

With no GPU, llama.cpp's CPU backend copies some matmul weights out of the mapped file: into an `AMX` buffer
when the CPU has AMX and the AMX kernels take the weight's type and shape, else into a `CPU_REPACK` buffer when
its type has an interleaved kernel for the CPU's features (`actors/placement/weights.py` holds those rules).
Which tensors are matmul weights is a fact of the model file: the names llama.cpp's tensor table marks MUL_MAT
(or MUL_MAT_ID for experts) applied to `.weight`, their type and their shape. This module reads those from the
header and groups them per block (type, multiple of rows, count, padded bytes, bytes in the AMX layout); the
geometry carries the groups, and the tensors at either end of the file (`mapped_edges`), which leave the mapped
buffer's span when they are copied.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from actors.placement.context import pad
from actors.placement.gguf_header import GGUFHeader, TensorInfo
from messages.model import MappedEdge, RepackGroup

__all__ = ["mapped_edges", "repack_groups"]


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
_BLOCK = re.compile(r"^blk\.([0-9]+)\.")  # any tensor of a block
_REPACK_ALIGNMENT = 32  # the CPU buffer types' tensor alignment


def _n_dims(shape: Sequence[int]) -> int:
    """`ggml_n_dims`: the number of dimensions up to the last one larger than 1 (at least 1)."""
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1:
            return i + 1
    return 1


#: Type -> (K alignment, block elements, block bytes, extra bytes per block) of the CPU backend's AMX kernels
#: (ggml-cpu/amx: `supports_op`, `qtype_has_amx_kernels`, `get_row_size`: Q8_0 keeps an int32 compensation per
#: block, Q4_K and Q5_K 4 bytes of scales, IQ4_XS 2). F16 is taken with K a multiple of 16 and copied unpacked.
_AMX_LAYOUT = {
    "q4_0": (32, 32, 18, 0),
    "q4_1": (32, 32, 20, 0),
    "q8_0": (32, 32, 34, 4),
    "q4_k": (256, 256, 144, 4),
    "q5_k": (256, 256, 176, 4),
    "q6_k": (256, 256, 210, 0),
    "iq4_xs": (256, 256, 136, 2),
}
_AMX_F16_ALIGNMENT = 16
_AMX_ROWS = 32  # TILE_N * 2: the result's rows (the weight's ne[1]) must be a multiple of it
_MAX_EDGE = 64  # tensors kept per end of the file: beyond, the mapped span is taken whole (an upper bound)

_Key = tuple[str, int, bool]  # (type, rows multiple, taken by the AMX kernels)


def _amx_size(t: TensorInfo, kind: str) -> int:
    """The weight's bytes in the AMX buffer (unpadded), 0 when the AMX kernels do not take it (a MUL_MAT weight
    only). As `ggml_backend_amx_get_alloc_size` has it: a quantized weight takes ne[1] rows in the AMX layout,
    whatever its ne[2]; an F16 one its whole bytes."""
    n_cols, n_rows = t.shape[0], t.shape[1]
    if n_rows % _AMX_ROWS:
        return 0
    if kind == "f16":
        return t.n_bytes if n_cols % _AMX_F16_ALIGNMENT == 0 else 0
    layout = _AMX_LAYOUT.get(kind)
    if layout is None or n_cols % layout[0]:
        return 0
    _, block, block_bytes, extra = layout
    return n_rows * (n_cols // block) * (block_bytes + extra)


def _candidate(t: TensorInfo, *, expert: bool) -> tuple[_Key, int] | None:
    """A matmul weight the CPU backend may copy: its group key and its AMX size (0: not taken by AMX). Float
    weights are only ever copied by AMX (F16); quantized ones by AMX or the repack kernels. The repack kernels
    take 2-D weights (3-D for experts); the AMX kernels any MUL_MAT weight, so also a 3-D one (an MLA model's
    `attn_k_b`), which no repack kernel takes: its rows multiple is then 1, which no repack rule accepts."""
    kind = t.type_name.lower()
    dims = _n_dims(t.shape)
    if len(t.shape) < 2 or dims not in ((3,) if expert else (2, 3)):
        return None
    amx = 0 if expert else _amx_size(t, kind)
    repackable = expert or dims == 2
    if (kind in _FLOAT_TYPES or not repackable) and not amx:
        return None
    rows = t.shape[1]
    multiple = 16 if repackable else 1
    while multiple > 1 and rows % multiple:
        multiple //= 2
    return (kind, multiple, amx > 0), amx


def _group(found: dict[_Key, list[tuple[int, int]]]) -> tuple[RepackGroup, ...]:
    return tuple(
        RepackGroup(
            type=kind,
            rows_multiple=multiple,
            count=len(sizes),
            bytes=sum(pad(n, _REPACK_ALIGNMENT) for n, _ in sizes),
            amx_bytes=sum(pad(amx, _REPACK_ALIGNMENT) for _, amx in sizes) if amx_taken else 0,
        )
        for (kind, multiple, amx_taken), sizes in sorted(found.items())
    )


def _matmul(t: TensorInfo, names: set[str], n_layer_all: int) -> tuple[int | None, tuple[_Key, int] | None]:
    """(block index or None for the output layer, candidate) for a matmul weight the CPU backend may copy;
    (None, None) for any other tensor."""
    m = _BLOCK_WEIGHT.match(t.name)
    if m is not None:
        il, base = int(m.group(1)), m.group(2)
        if il >= n_layer_all or (base not in _MATMUL_BLOCK_TENSORS and base not in _MATMUL_ID_BLOCK_TENSORS):
            return None, None
        return il, _candidate(t, expert=base in _MATMUL_ID_BLOCK_TENSORS)
    if t.name == "output.weight" or (t.name == "token_embd.weight" and "output.weight" not in names):
        return None, _candidate(t, expert=False)
    return None, None


def repack_groups(
    header: GGUFHeader, n_layer_all: int
) -> tuple[dict[int, tuple[RepackGroup, ...]], tuple[RepackGroup, ...]]:
    """The matmul weights the CPU backend may copy, per block, and those of the output layer (`output.weight`,
    or the tied token embeddings llama.cpp duplicates as the output matrix)."""
    per_layer: dict[int, dict[_Key, list[tuple[int, int]]]] = {}
    output: dict[_Key, list[tuple[int, int]]] = {}
    names = {t.name for t in header.tensors}
    for t in header.tensors:
        il, found = _matmul(t, names, n_layer_all)
        if found is None:
            continue
        key, amx = found
        (output if il is None else per_layer.setdefault(il, {})).setdefault(key, []).append((t.n_bytes, amx))
    return {il: _group(found) for il, found in per_layer.items()}, _group(output)


def mapped_edges(
    header: GGUFHeader, n_layer_all: int, first_nextn: int
) -> tuple[tuple[MappedEdge, ...], tuple[MappedEdge, ...]]:
    """The tensors at the start and at the end of the tensor data, in file order from each end, up to the first
    that the CPU backend keeps mapped whatever its features (not a matmul weight it may copy, nor a nextn
    block's, from block `first_nextn` on, which are loaded only for MTP). The token embeddings are read by row
    (GET_ROWS) and always mapped, even when tied: the output matrix is then a duplicate with no range of its own.
    """
    names = {t.name for t in header.tensors}

    def edge(t: TensorInfo) -> MappedEdge | None:
        found = None if t.name == "token_embd.weight" else _matmul(t, names, n_layer_all)[1]
        group = None
        if found is not None:  # the tensor as a group of one
            key, amx = found
            (group,) = _group({key: [(t.n_bytes, amx)]})
        m = _BLOCK.match(t.name)
        nextn = m is not None and first_nextn <= int(m.group(1)) < n_layer_all
        if group is None and not nextn:
            return None
        return MappedEdge(bytes=t.n_bytes, nextn=nextn, group=group)

    def run(tensors: Sequence[TensorInfo]) -> tuple[MappedEdge, ...]:
        out: list[MappedEdge] = []
        for t in tensors[:_MAX_EDGE]:
            e = edge(t)
            if e is None:
                return tuple(out)
            out.append(e)
        return ()  # no tensor always kept within reach: the span is taken whole

    ordered = sorted(header.tensors, key=lambda t: t.offset)
    return run(ordered), run(ordered[::-1])
