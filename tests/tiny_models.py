"""Tiny GGUF models that llama-server really loads, one writer per architecture family.

Each `write_<arch>` writes a random-weight (or, with `sparse=True`, all-zero) model with exactly the tensors
llama.cpp's loader creates for that architecture, a byte-fallback SPM vocabulary, and the metadata the
architecture requires. With `sparse=True` the tensor data region is left as a file hole (the header is
written, then the file is truncated to its full size), so realistic 9B-30B shapes cost almost no disk and
load as zeros. Used by the end-to-end tests and by `python -m benchmarks.accuracy`.

Each family is data: its header keys (dicts relative to the architecture; None leaves a key out), its named
sizes, and a tensor table per block kind (`_table`: one tensor a line, its name and its ggml dimensions as size
expressions such as `embd 2*q` or `kernel inner+2*groups*state`). One engine (`_spec`, `_write`) writes the
keys in file order, resolves every block's sizes (a per-block list for variable GQA and hybrids) and adds the
tensors; matrices take the model's weight type, norms, biases, vectors and conv kernels stay f32, and every
`ssm_a` is negative. Adding an architecture is a table and a writer of a few lines.

Shapes follow ggml order ({ne0, ne1, …}); numpy arrays are the reverse.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
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
    values: dict[str, np.ndarray] = field(default_factory=dict)  # tensors with fixed f32 values (rope factors)
    std: float = 0.02  # of the random weights; larger makes attention sharp, so positions change the output

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


_ALL_SPARSE = False


@contextlib.contextmanager
def sparse_files() -> Iterator[None]:
    """Inside this block every writer writes sparse files (the data region a hole that loads as zeros), also
    those without a `sparse` argument: realistic shapes for benchmarks cost no disk."""
    global _ALL_SPARSE
    before, _ALL_SPARSE = _ALL_SPARSE, True
    try:
        yield
    finally:
        _ALL_SPARSE = before


def write_model(spec: ModelSpec, path: str | os.PathLike[str], *, sparse: bool = False, seed: int = 0) -> Path:
    """Writes `spec` as a GGUF file; with `sparse`, the data region is a hole (loads as zeros)."""
    sparse = sparse or _ALL_SPARSE
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
            if name in spec.values:
                data = np.asarray(spec.values[name], dtype=np.float32)
                if dtype != "f32" or data.size != int(np.prod(shape)):
                    raise ValueError(f"fixed values of {name} must be {int(np.prod(shape))} f32 numbers")
                fout.write(data.tobytes())
            elif dtype == "f32":
                data = rng.normal(0.0, spec.std, size=int(np.prod(shape))).astype(np.float32)
                if name in spec.negative:
                    data = (-np.abs(data) - np.float32(0.5)).astype(np.float32)
                fout.write(data.tobytes())
            elif dtype == "f16":
                fout.write(rng.normal(0.0, spec.std, size=int(np.prod(shape))).astype(np.float16).tobytes())
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


# --- the engine: a family is header keys, sizes and a tensor table per block ------------------------------------

#: Metadata keys relative to the architecture ("block_count" is written "<arch>.block_count"); a None value
#: leaves the key out, so an optional key keeps its place in the table.
_Keys = Mapping[str, object]
#: Named sizes the tables refer to; a sequence gives one size per block (variable GQA, hybrid head counts).
_Dims = Mapping[str, int | Sequence[int]]
#: A tensor's name (under "blk.N." in a block table) and its ggml shape, one size expression per dimension.
_Row = tuple[str, tuple[str, ...]]
_Table = tuple[_Row, ...]

_SIZE = re.compile(r"\w+(?:[*+]\w+)*")


def _table(*parts: str | _Table) -> _Table:
    """A tensor table from text (one tensor a line: its name, then its ggml dimensions; `#` starts a comment)
    and other tables, in file order. A dimension is a sum of products of named sizes and whole numbers
    ("inner+conv+dt", "2*embd", "heads*k_mla")."""
    rows: list[_Row] = []
    for part in parts:
        if not isinstance(part, str):
            rows.extend(part)
            continue
        for line in part.splitlines():
            name, *shape = line.split("#", 1)[0].split() or [""]
            if not name:
                continue
            if not shape or not all(_SIZE.fullmatch(size) for size in shape):
                raise ValueError(f"bad tensor row {line.strip()!r}: expected a name and size expressions")
            rows.append((name, tuple(shape)))
    return tuple(rows)


def _without(table: _Table, *names: str) -> _Table:
    """`table` less the named tensors (a variant that lacks a gate or an output projection)."""
    missing = set(names) - {name for name, _ in table}
    if missing:
        raise ValueError(f"no tensor {sorted(missing)} in the table")
    return tuple(row for row in table if row[0] not in names)


def _size(expr: str, sizes: Mapping[str, int]) -> int:
    total = 0
    for term in expr.split("+"):
        product = 1
        for factor in term.split("*"):
            if factor.isdigit():
                product *= int(factor)
            elif factor in sizes:
                product *= sizes[factor]
            else:
                raise ValueError(f"no size named {factor!r} for {expr!r} (known: {', '.join(sorted(sizes))})")
        total += product
    return total


def _weight_type(name: str, shape: tuple[int, ...], dtype: str) -> str:
    """Matrices take the model's weight type; vectors, norms, biases and convolution kernels stay f32, as a
    converter writes them."""
    stem = name.removesuffix(".weight")
    if len(shape) >= 2 and stem != name and "norm" not in stem and not stem.endswith(("conv", "conv1d")):
        return dtype
    return "f32"


def _spec(arch: str, n_vocab: int, header: _Keys, keys: _Keys | None = None, *, name: str | None = None) -> ModelSpec:
    """The metadata in file order: the name, the family's common header, the vocabulary, the family's own keys."""
    spec = ModelSpec(arch=arch, kv={"general.name": name or f"tiny-{arch}"})
    for key, value in header.items():
        if value is not None:
            spec.kv[f"{arch}.{key}"] = value
    _vocab(spec, n_vocab)
    for key, value in (keys or {}).items():
        if value is not None:
            spec.kv[f"{arch}.{key}"] = value
    return spec


def _write(
    path: str | os.PathLike[str],
    spec: ModelSpec,
    dims: _Dims,
    layers: Sequence[_Table],
    *,
    globals_: _Table | None = None,
    dtype: str = "f32",
    sparse: bool = False,
) -> Path:
    """Adds the global tensors (default: `_GLOBALS`), then block `il`'s table as "blk.{il}.…" with the sizes
    of that block, and writes the file. `vocab` is the vocabulary's size; every `ssm_a` is made negative."""
    n_vocab = len(spec.kv["tokenizer.ggml.tokens"])
    blocks: list[tuple[str, _Table, int | None]] = [("", _GLOBALS if globals_ is None else globals_, None)]
    blocks += [(f"blk.{il}.", table, il) for il, table in enumerate(layers)]
    for prefix, table, il in blocks:
        sizes = {"vocab": n_vocab}
        for key, value in dims.items():
            if isinstance(value, int):
                sizes[key] = value
            elif il is not None:
                sizes[key] = value[il]
        for name, exprs in table:
            shape = tuple(_size(expr, sizes) for expr in exprs)
            spec.add(prefix + name, shape, _weight_type(name, shape, dtype))
            if name == "ssm_a":  # A = -exp(A_log): llama.cpp's SSM kernels assume a decay
                spec.negative.add(prefix + name)
    return write_model(spec, path, sparse=sparse)


def _transformer(
    n_layer: int,
    n_embd: int,
    n_head: int | list[int],
    n_head_kv: int | list[int],
    n_ff: int | list[int],
    *,
    head_dim: int | None = None,
    n_ctx_train: int = 32768,
) -> dict[str, object]:
    """The header keys every attention family starts with."""
    return {
        "block_count": n_layer,
        "context_length": n_ctx_train,
        "embedding_length": n_embd,
        "feed_forward_length": n_ff,
        "attention.head_count": n_head,
        "attention.head_count_kv": n_head_kv,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 10000.0,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
    }


def _recurrent(
    n_layer: int, n_embd: int, n_ff: int, norm: str, eps: float, n_head: int | None = None
) -> dict[str, object]:
    """The header keys a pure-recurrent family starts with: no trained context limit, `norm` names the
    norm's epsilon key (layer_norm_epsilon or layer_norm_rms_epsilon)."""
    return {
        "block_count": n_layer,
        "context_length": 1 << 20,
        "embedding_length": n_embd,
        "feed_forward_length": n_ff,
        "attention.head_count": n_head,
        f"attention.{norm}": eps,
    }


def _ssm(kernel: int, inner: int, state: int, dt_rank: int, groups: int | None) -> dict[str, object]:
    """The SSM keys; `groups=None` leaves group_count out (Mamba 1 has none)."""
    return {
        "ssm.conv_kernel": kernel,
        "ssm.inner_size": inner,
        "ssm.state_size": state,
        "ssm.time_step_rank": dt_rank,
        "ssm.group_count": groups,
    }


def _moe(
    n_expert: int, n_used: int, n_ff: int | None = None, *, shared_ff: int | None = None, n_shared: int | None = None
) -> dict[str, object]:
    """The routed-expert keys: the expert width, the shared expert's width or count, where given."""
    return {
        "expert_count": n_expert,
        "expert_used_count": n_used,
        "expert_feed_forward_length": n_ff,
        "expert_shared_feed_forward_length": shared_ff,
        "expert_shared_count": n_shared,
    }


def _lora_ranks(rank: int) -> dict[str, object]:
    return {f"attention.{lora}_lora_rank": rank for lora in ("decay", "iclr", "value_residual_mix", "gate")}


def _attention_dims(
    n_embd: int, n_head: int, n_head_kv: int | Sequence[int], head_dim: int | None = None
) -> dict[str, int | Sequence[int]]:
    """embd, heads, head (size), q and kv (projection widths; kv per block when `n_head_kv` is a list). Without
    an explicit head size, Q is n_embd wide and a head n_embd / n_head."""
    head = n_embd // n_head if head_dim is None else head_dim
    q = n_embd if head_dim is None else n_head * head_dim
    kv = n_head_kv * head if isinstance(n_head_kv, int) else [heads * head for heads in n_head_kv]
    return {"embd": n_embd, "heads": n_head, "head": head, "q": q, "kv": kv}


def _ssm_dims(kernel: int, inner: int, state: int, dt_rank: int, groups: int = 0) -> dict[str, int]:
    """The SSM sizes: key (B/C width of a gated delta net), conv (channels a Mamba2 convolution sees: x, B and
    C), group_width (of a Mamba2 grouped norm)."""
    return {
        "kernel": kernel,
        "inner": inner,
        "state": state,
        "dt": dt_rank,
        "groups": groups,
        "key": groups * state,
        "conv": inner + 2 * groups * state,
        "group_width": inner // groups if groups else 0,
    }


def _ffn_dims(ff: int = 0, *, expert: int = 0, ff_exp: int = 0, ff_shexp: int = 0) -> dict[str, int]:
    """The FFN sizes: the dense width, the expert count, a routed expert's and the shared expert's width."""
    return {"ff": ff, "expert": expert, "ff_exp": ff_exp, "ff_shexp": ff_shexp}


# --- the tables: blocks as llama.cpp's `load_tensors` creates them ----------------------------------------------

# Global tensors first, blocks after: the nextn blocks then end the file, so a model loaded without them maps
# one contiguous range, as converted models do.
_GLOBALS = _table("""
    token_embd.weight   embd vocab
    output_norm.weight  embd
    output.weight       embd vocab
""")
_TIED = _without(_GLOBALS, "output.weight")  # the output projection reuses token_embd

_ATTENTION = _table("""
    attn_q.weight       embd q
    attn_k.weight       embd kv
    attn_v.weight       embd kv
    attn_output.weight  q embd
""")
_ATTENTION_BIASED = _table("""
    attn_q.weight       embd q
    attn_k.weight       embd kv
    attn_v.weight       embd kv
    attn_q.bias         q
    attn_k.bias         kv
    attn_v.bias         kv
    attn_output.weight  q embd
""")
_QK_NORM = _table("attn_q_norm.weight head", "attn_k_norm.weight head")
_GATED_ATTENTION = _table("""
    attn_q.weight       embd 2*q  # Q and its output gate in one projection (qwen35, qwen3next)
    attn_k.weight       embd kv
    attn_v.weight       embd kv
    attn_output.weight  q embd
    attn_q_norm.weight  head
    attn_k_norm.weight  head
""")

_FFN = _table("""
    ffn_gate.weight  embd ff
    ffn_up.weight    embd ff
    ffn_down.weight  ff embd
""")
_FFN_UP_DOWN = _without(_FFN, "ffn_gate.weight")
# a routed MoE FFN: the router and the stacked expert matrices (3-d tensors)
_EXPERTS = _table("""
    ffn_gate_inp.weight   embd expert
    ffn_gate_exps.weight  embd ff_exp expert
    ffn_up_exps.weight    embd ff_exp expert
    ffn_down_exps.weight  ff_exp embd expert
""")
_EXPERTS_UP_DOWN = _without(_EXPERTS, "ffn_gate_exps.weight")
_GATED_SHARED_EXPERT = _table("""
    ffn_gate_inp_shexp.weight  embd
    ffn_gate_shexp.weight      embd ff_shexp
    ffn_up_shexp.weight        embd ff_shexp
    ffn_down_shexp.weight      ff_shexp embd
""")
_SHARED_EXPERT = _without(_GATED_SHARED_EXPERT, "ffn_gate_inp_shexp.weight")
# what makes a block an MTP (nextn) head: input fusion and its two norms
_NEXTN = _table("""
    nextn.eh_proj.weight  2*embd embd
    nextn.enorm.weight    embd
    nextn.hnorm.weight    embd
""")

# a Mamba2 mixer (ssm_in packs z, x, B, C and dt), as mamba2, granitehybrid, nemotron_h and falcon-h1 load it
_MAMBA2 = _table("""
    ssm_in.weight      embd inner+conv+dt
    ssm_conv1d.weight  kernel conv
    ssm_conv1d.bias    conv
    ssm_dt.bias        dt
    ssm_a              1 dt
    ssm_d              1 dt
    ssm_norm.weight    group_width groups
    ssm_out.weight     inner embd
""")
# a Mamba (v1) mixer; llama.cpp only supports an expansion factor of 2 (inner = 2 n_embd)
_MAMBA1 = _table("""
    ssm_in.weight      embd 2*inner
    ssm_conv1d.weight  kernel inner
    ssm_conv1d.bias    inner
    ssm_x.weight       inner dt+2*state
    ssm_dt.weight      dt inner
    ssm_dt.bias        inner
    ssm_a              state inner
    ssm_d              inner
    ssm_out.weight     inner embd
""")
# a gated delta net (qwen35, qwen3next): fused QKV and gate, conv, decay; beta and alpha come between
_DELTA_NET_IN = _table("""
    attn_qkv.weight    embd 2*key+inner
    attn_gate.weight   embd inner
    ssm_conv1d.weight  kernel 2*key+inner
    ssm_dt.bias        dt
    ssm_a              dt
""")
_DELTA_NET_OUT = _table("ssm_norm.weight state", "ssm_out.weight inner embd")
# the RWKV-7 time mix shared by rwkv7 and arwkv7 (LoRA paths, fused lerp, projections)
_RWKV7_TIME_MIX = _table("""
    time_mix_w0.weight  embd
    time_mix_w1.weight  embd lora
    time_mix_w2.weight  lora embd
    time_mix_a0.weight  embd
    time_mix_a1.weight  embd lora
    time_mix_a2.weight  lora embd
    time_mix_v0.weight  embd
    time_mix_v1.weight  embd lora
    time_mix_v2.weight  lora embd
    time_mix_g1.weight  embd lora
    time_mix_g2.weight  lora embd
    time_mix_lerp_fused.weight  embd 1 1 6
    time_mix_k_k.weight  embd
    time_mix_k_a.weight  embd
    time_mix_r_k.weight  embd
    time_mix_key.weight         embd embd
    time_mix_value.weight       embd embd
    time_mix_receptance.weight  embd embd
    time_mix_output.weight      embd embd
    time_mix_ln.weight  embd
    time_mix_ln.bias    embd
""")

# whole blocks of the families that have one kind of block
_DENSE = _table("attn_norm.weight embd", _ATTENTION, "ffn_norm.weight embd", _FFN)
_QWEN2 = _table("attn_norm.weight embd", _ATTENTION_BIASED, "ffn_norm.weight embd", _FFN)
_GEMMA2 = _table(
    "attn_norm.weight embd",
    _ATTENTION,
    "post_attention_norm.weight embd",
    "ffn_norm.weight embd",
    _FFN,
    "post_ffw_norm.weight embd",
)
_GEMMA3 = _table(
    "attn_norm.weight embd",
    _ATTENTION,
    "post_attention_norm.weight embd",
    "attn_k_norm.weight head",
    "attn_q_norm.weight head",
    "ffn_norm.weight embd",
    _FFN,
    "post_ffw_norm.weight embd",
)
_COHERE2 = _table("attn_norm.weight embd", _ATTENTION, _FFN)
_PHI3 = _table("""
    attn_norm.weight    embd
    attn_qkv.weight     embd q+2*kv
    attn_output.weight  q embd
    ffn_norm.weight     embd
    ffn_up.weight       embd 2*ff
    ffn_down.weight     ff embd
""")
_GPT_OSS = _table(
    "attn_norm.weight embd",
    "post_attention_norm.weight embd",
    _ATTENTION,
    "attn_output.bias embd",
    "attn_sinks.weight heads",
    _EXPERTS,
    """
    ffn_gate_inp.bias   expert
    ffn_gate_exps.bias  ff_exp expert
    ffn_up_exps.bias    ff_exp expert
    ffn_down_exps.bias  embd expert
    """,
)
_FALCON_H1 = _table(
    _MAMBA2,
    _ATTENTION,
    "attn_norm.weight embd",
    "ffn_norm embd",  # falcon-h1 loads this norm without a ".weight" suffix
    _FFN,
)


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
    dims = _attention_dims(n_embd, n_head, n_head_kv)
    header = _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff)
    spec = _spec("llama", n_vocab, header, {"rope.dimension_count": dims["head"]})
    globals_ = _TIED if tied else _GLOBALS
    return _write(path, spec, dims | _ffn_dims(n_ff), [_DENSE] * n_layer, globals_=globals_, dtype=dtype, sparse=sparse)


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
    keys = {
        "attention.sliding_window": n_swa,
        "attention.sliding_window_pattern": swa_pattern,
        "rope.freq_base_swa": 10000.0,
    }
    spec = _spec("gemma3", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ffn_dims(n_ff)
    return _write(path, spec, dims, [_GEMMA3] * n_layer, globals_=_TIED, sparse=sparse)


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
    ssm = (conv_kernel, state_size, group_count, dt_rank)
    sizes = (n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab)
    return _write_qwen35_family(path, "qwen35", n_layer, n_nextn, interval, sizes, ssm, dtype, n_ctx_train, sparse)


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
    ssm = (conv_kernel, state_size, group_count, dt_rank)
    sizes = (n_embd, n_head, n_head_kv, head_dim, n_ff_exp, n_vocab)
    return _write_qwen35_family(
        path, "qwen35moe", n_layer, n_nextn, interval, sizes, ssm, experts=(n_expert, n_expert_used)
    )


def _write_qwen35_family(
    path: str | os.PathLike[str],
    arch: str,
    n_layer: int,
    n_nextn: int,
    interval: int,
    sizes: tuple[int, int, int, int, int, int],
    ssm: tuple[int, int, int, int],
    dtype: str = "f32",
    n_ctx_train: int = 32768,
    sparse: bool = False,
    *,
    experts: tuple[int, int] = (0, 0),
) -> Path:
    """qwen35 and qwen35moe: `sizes` are (n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab), `ssm` (conv_kernel,
    state_size, group_count, dt_rank); with experts, n_ff is the width of every expert and of the shared one."""
    n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab = sizes
    conv_kernel, state_size, group_count, dt_rank = ssm
    n_expert, n_expert_used = experts
    inner = state_size * dt_rank
    header = _transformer(
        n_layer + n_nextn, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim, n_ctx_train=n_ctx_train
    )
    keys = {
        "rope.dimension_count": head_dim,
        "rope.dimension_sections": [head_dim // 4, head_dim // 8, head_dim // 8, 0],
        **_ssm(conv_kernel, inner, state_size, dt_rank, group_count),
        "full_attention_interval": interval,
        "nextn_predict_layers": n_nextn or None,
        **(_moe(n_expert, n_expert_used, n_ff, shared_ff=n_ff) if n_expert else {}),
    }
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ssm_dims(
        conv_kernel, inner, state_size, dt_rank, group_count
    )
    dims |= _ffn_dims(n_ff, expert=n_expert, ff_exp=n_ff, ff_shexp=n_ff)
    ffn = _table(_EXPERTS, _GATED_SHARED_EXPERT) if n_expert else _FFN
    layers = _qwen_hybrid_layers(n_layer, n_nextn, interval, _QWEN35_DELTA_NET, ffn)
    return _write(path, _spec(arch, n_vocab, header, keys), dims, layers, dtype=dtype, sparse=sparse)


_QWEN35_DELTA_NET = _table(_DELTA_NET_IN, "ssm_beta.weight embd dt", "ssm_alpha.weight embd dt", _DELTA_NET_OUT)
_QWEN3NEXT_DELTA_NET = _table(_DELTA_NET_IN, "ssm_ba.weight embd 2*dt", _DELTA_NET_OUT)


def _qwen_hybrid_layers(n_layer: int, n_nextn: int, interval: int, delta_net: _Table, ffn: _Table) -> list[_Table]:
    """qwen35 and qwen3next blocks: full attention every `interval`-th trunk block and in the MTP blocks,
    the gated delta net elsewhere."""
    return [
        _table(
            "attn_norm.weight embd",
            "post_attention_norm.weight embd",
            _GATED_ATTENTION if il >= n_layer or (il + 1) % interval == 0 else delta_net,
            ffn,
            _NEXTN if il >= n_layer else (),
        )
        for il in range(n_layer + n_nextn)
    ]


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
    per_attention = [n_head_kv] * len(attention_layers) if isinstance(n_head_kv, int) else list(n_head_kv)
    heads = dict(zip(attention_layers, per_attention, strict=True))
    kv_heads = [heads.get(il, 0) for il in range(n_layer)]
    keys = {"rope.dimension_count": n_embd // n_head, **_ssm(conv_kernel, inner, state_size, dt_rank, group_count)}
    spec = _spec("granitehybrid", n_vocab, _transformer(n_layer, n_embd, n_head, kv_heads, n_ff), keys)
    dims = (
        _attention_dims(n_embd, n_head, kv_heads)
        | _ssm_dims(conv_kernel, inner, state_size, dt_rank, group_count)
        | _ffn_dims(n_ff)
    )
    layers = [
        _table("attn_norm.weight embd", _ATTENTION if kv else _MAMBA2, "ffn_norm.weight embd", _FFN) for kv in kv_heads
    ]
    return _write(path, spec, dims, layers)


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
    header = _recurrent(n_layer, n_embd, 0, "layer_norm_rms_epsilon", 1e-6, n_head=0)
    header |= _ssm(conv_kernel, inner, state_size, dt_rank, group_count)
    dims = {"embd": n_embd} | _ssm_dims(conv_kernel, inner, state_size, dt_rank, group_count)
    return _write(path, _spec("mamba2", n_vocab, header), dims, [_table("attn_norm.weight embd", _MAMBA2)] * n_layer)


def write_qwen35_9b(path: str | os.PathLike[str], *, n_layer: int = 32) -> Path:
    """The Qwen3.5-9B geometry (32 layers + 1 nextn: 8 attention, 24 recurrent; 4 KV heads x 256; conv 4,
    inner 4096, state 128, groups 16) as a sparse file: the header is real, the weights read as zeros.
    `n_layer` keeps fewer blocks of the same widths (buffers that depend on one block stay the same)."""
    return write_qwen35(
        path,
        n_layer=n_layer,
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
    spec = _spec("qwen2", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff))
    return _write(path, spec, _attention_dims(n_embd, n_head, n_head_kv) | _ffn_dims(n_ff), [_QWEN2] * n_layer)


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
    spec = _spec("qwen3", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim))
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ffn_dims(n_ff)
    return _write(path, spec, dims, [_table(_QWEN3, _FFN)] * n_layer, globals_=_TIED)


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
    header = _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim)
    spec = _spec("qwen3moe", n_vocab, header, _moe(n_expert, n_expert_used, n_ff_exp) if n_expert else {})
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ffn_dims(n_ff, expert=n_expert, ff_exp=n_ff_exp)
    layer = _table(_QWEN3, _EXPERTS if n_expert else _FFN)
    return _write(path, spec, dims, [layer] * n_layer, globals_=_TIED)


_QWEN3 = _table("attn_norm.weight embd", _ATTENTION, _QK_NORM, "ffn_norm.weight embd")  # then the FFN


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
    keys = {
        "attention.sliding_window": n_swa,
        "attention.sliding_window_pattern": swa_pattern,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    spec = _spec("gemma2", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ffn_dims(n_ff)
    return _write(path, spec, dims, [_GEMMA2] * n_layer, globals_=_TIED)


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
    keys = {
        "attention.sliding_window": n_swa,
        "attention.sliding_window_pattern": swa_pattern,
        "logit_scale": 0.25,
        "attention.layer_norm_epsilon": 1e-5,
    }
    spec = _spec("cohere2", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv) | _ffn_dims(n_ff)
    return _write(path, spec, dims, [_COHERE2] * n_layer, globals_=_TIED)


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
    keys = {
        "rope.dimension_count": head_dim,
        "attention.sliding_window": n_swa,
        **_moe(n_expert, n_expert_used, n_ff_exp),
    }
    spec = _spec("gpt-oss", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ffn_dims(expert=n_expert, ff_exp=n_ff_exp)
    return _write(path, spec, dims, [_GPT_OSS] * n_layer)


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
    ssm = (conv_kernel, inner, state_size, group_count, dt_rank)
    return _write_nemotron(path, "nemotron_h", layers, 0, (n_embd, n_head, n_head_kv, n_ff, n_vocab), ssm)


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
    ssm = (conv_kernel, inner, state_size, group_count, dt_rank)
    sizes = (n_embd, n_head, n_head_kv, n_ff_exp, n_vocab)
    return _write_nemotron(path, "nemotron_h_moe", layers, n_nextn, sizes, ssm, (n_expert, n_expert_used))


def _write_nemotron(
    path: str | os.PathLike[str],
    arch: str,
    layers: str,
    n_nextn: int,
    sizes: tuple[int, int, int, int, int],
    ssm: tuple[int, int, int, int, int],
    experts: tuple[int, int] = (0, 0),
) -> Path:
    """nemotron_h and nemotron_h_moe: `sizes` are (n_embd, n_head, n_head_kv, n_ff, n_vocab), `ssm`
    (conv_kernel, inner, state_size, group_count, dt_rank); with experts, n_ff is every expert's width."""
    n_embd, n_head, n_head_kv, n_ff, n_vocab = sizes
    conv_kernel, inner, state_size, group_count, dt_rank = ssm
    n_expert, n_expert_used = experts
    kinds = layers + "N" * n_nextn  # an MTP block has both attention heads and an FFN length
    kv_heads = [n_head_kv if kind in "*N" else 0 for kind in kinds]
    ff = [n_ff if kind in "-EN" else 0 for kind in kinds]
    keys = {
        "attention.layer_norm_epsilon": 1e-5,
        **_ssm(conv_kernel, inner, state_size, dt_rank, group_count or None),
        **(_moe(n_expert, n_expert_used, n_ff, shared_ff=n_ff) if n_expert else {}),
        "nextn_predict_layers": n_nextn or None,
    }
    spec = _spec(arch, n_vocab, _transformer(len(kinds), n_embd, n_head, kv_heads, ff), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv) | _ssm_dims(conv_kernel, inner, state_size, dt_rank, group_count)
    dims |= _ffn_dims(n_ff, expert=n_expert, ff_exp=n_ff, ff_shexp=n_ff)
    blocks = dict(_NEMOTRON_BLOCKS)
    if n_expert:
        blocks["E"] = _NEMOTRON_MOE
    unknown = [kind for kind in kinds if kind not in blocks]
    if unknown:
        raise ValueError(f"unknown {arch} block kind {unknown[0]!r} (expected M, * or -, or E with experts)")
    return _write(path, spec, dims, [_table("attn_norm.weight embd", blocks[kind]) for kind in kinds])


_NEMOTRON_MOE = _table(_EXPERTS_UP_DOWN, "exp_probs_b.bias expert", _without(_SHARED_EXPERT, "ffn_gate_shexp.weight"))
#: Nemotron-H's block kinds by the letter its pattern spells them with; `N` is an MTP block.
_NEMOTRON_BLOCKS = {
    "M": _MAMBA2,
    "*": _ATTENTION,
    "-": _FFN_UP_DOWN,
    "N": _table(
        _NEXTN, "nextn.shared_head_norm.weight embd", _ATTENTION, "post_attention_norm.weight embd", _NEMOTRON_MOE
    ),
}


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
    keys = {"shortconv.l_cache": l_cache, "attention.sliding_window": n_swa}
    spec = _spec("lfm2", n_vocab, _transformer(n_layer, n_embd, n_head, kv_heads, n_ff), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv) | _ffn_dims(n_ff) | {"l_cache": l_cache}
    layers = [
        _table(
            "ffn_norm.weight embd", _FFN, "attn_norm.weight embd", _table(_QK_NORM, _ATTENTION) if kv else _SHORTCONV
        )
        for kv in kv_heads
    ]
    return _write(path, spec, dims, layers, globals_=_LFM2_GLOBALS)


_LFM2_GLOBALS = _table("""
    token_embd.weight       embd vocab
    token_embd_norm.weight  embd  # LFM2's output norm carries this name
""")
_SHORTCONV = _table("""
    shortconv.conv.weight      l_cache embd
    shortconv.in_proj.weight   embd 3*embd
    shortconv.out_proj.weight  embd embd
""")


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
    keys = _ssm(conv_kernel, inner, state_size, dt_rank, group_count or None)
    spec = _spec("falcon-h1", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim), keys)
    dims = (
        _attention_dims(n_embd, n_head, n_head_kv, head_dim)
        | _ssm_dims(conv_kernel, inner, state_size, dt_rank, group_count)
        | _ffn_dims(n_ff)
    )
    return _write(path, spec, dims, [_FALCON_H1] * n_layer)


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
    keys = {
        **_ssm(conv_kernel, 2 * n_embd, state_size, dt_rank, None),
        **(_moe(n_expert, n_expert_used) if moe_layers else {}),
    }
    spec = _spec("jamba", n_vocab, _transformer(n_layer, n_embd, n_head, kv_heads, n_ff), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv) | _ssm_dims(conv_kernel, 2 * n_embd, state_size, dt_rank)
    dims |= _ffn_dims(n_ff, expert=n_expert, ff_exp=n_ff)
    layers = [
        _table(
            "attn_norm.weight embd",
            _ATTENTION if kv_heads[il] else _JAMBA_MAMBA,
            "ffn_norm.weight embd",
            _EXPERTS if il in moe_layers else _FFN,
        )
        for il in range(n_layer)
    ]
    return _write(path, spec, dims, layers)


_JAMBA_MAMBA = _table(_MAMBA1, "ssm_dt_norm.weight dt", "ssm_b_norm.weight state", "ssm_c_norm.weight state")


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
    header = _recurrent(n_layer, n_embd, 0, "layer_norm_rms_epsilon", 1e-5, n_head=0)
    header |= _ssm(conv_kernel, 2 * n_embd, state_size, dt_rank, None)
    dims = {"embd": n_embd} | _ssm_dims(conv_kernel, 2 * n_embd, state_size, dt_rank)
    layers = [_table("attn_norm.weight embd", _MAMBA1)] * n_layer
    return _write(path, _spec("mamba", n_vocab, header), dims, layers, globals_=_TIED)


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
    header = _recurrent(n_layer, n_embd, n_ff, "layer_norm_epsilon", 1e-5)
    header |= {"wkv.head_size": head_size, **_lora_ranks(lora_rank)}
    dims = {"embd": n_embd, "ff": n_ff, "lora": lora_rank}
    return _write(path, _spec("rwkv7", n_vocab, header), dims, [_RWKV7] * n_layer, globals_=_RWKV7_GLOBALS)


_RWKV7_GLOBALS = _table("""
    token_embd.weight       embd vocab
    token_embd_norm.weight  embd
    token_embd_norm.bias    embd
    output_norm.weight      embd
    output_norm.bias        embd
    output.weight           embd vocab
""")
_RWKV7 = _table(
    "attn_norm.weight embd",
    "attn_norm.bias embd",
    "attn_norm_2.weight embd",
    "attn_norm_2.bias embd",
    _RWKV7_TIME_MIX,
    "channel_mix_lerp_k.weight embd 1 1",
    "channel_mix_key.weight embd ff",
    "channel_mix_value.weight ff embd",
)


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
    n_all = n_layer + n_nextn
    keys = {
        "attention.key_length": kv_lora_rank + rope_dim,
        "attention.value_length": kv_lora_rank,
        "attention.key_length_mla": qk_nope_dim + rope_dim,
        "attention.value_length_mla": v_head_dim,
        "attention.q_lora_rank": q_lora_rank,
        "attention.kv_lora_rank": kv_lora_rank,
        "rope.dimension_count": rope_dim,
        "leading_dense_block_count": n_dense_lead,
        **_moe(n_expert, n_expert_used, n_ff_exp, n_shared=n_expert_shared),
        "nextn_predict_layers": n_nextn or None,
    }
    spec = _spec("deepseek2", n_vocab, _transformer(n_all, n_embd, n_head, 1, n_ff), keys)
    mla = {"q_lora": q_lora_rank, "kv_lora": kv_lora_rank, "rope": rope_dim, "nope": qk_nope_dim, "v_head": v_head_dim}
    dims = {"embd": n_embd, "heads": n_head, "k_mla": qk_nope_dim + rope_dim} | mla
    dims |= _ffn_dims(n_ff, expert=n_expert, ff_exp=n_ff_exp, ff_shexp=n_ff_exp * n_expert_shared)
    q = _MLA_Q_LORA if q_lora_rank else _table("attn_q.weight embd heads*k_mla")
    layers = [
        _table(
            "attn_norm.weight embd",
            "attn_kv_a_norm.weight kv_lora",
            q,
            _MLA_KV,
            "ffn_norm.weight embd",
            _FFN if il < n_dense_lead else _table(_EXPERTS, _SHARED_EXPERT),
            _NEXTN if il >= n_layer else (),
        )
        for il in range(n_all)
    ]
    return _write(path, spec, dims, layers)


# deepseek2's MLA: a low-rank Q, one latent KV "head" with split k_b/v_b up-projections
_MLA_Q_LORA = _table("""
    attn_q_a_norm.weight  q_lora
    attn_q_a.weight       embd q_lora
    attn_q_b.weight       q_lora heads*k_mla
""")
_MLA_KV = _table("""
    attn_kv_a_mqa.weight  embd kv_lora+rope
    attn_k_b.weight       nope kv_lora heads
    attn_v_b.weight       kv_lora v_head heads
    attn_output.weight    heads*v_head embd
""")


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
    keys = {
        **_ssm(conv_kernel, inner, state_size, dt_rank, group_count or None),
        "full_attention_interval": interval,
        **_moe(n_expert, n_expert_used, n_ff_exp, shared_ff=n_ff_exp),
        "nextn_predict_layers": n_nextn or None,
    }
    header = _transformer(n_layer + n_nextn, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim)
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ssm_dims(
        conv_kernel, inner, state_size, dt_rank, group_count
    )
    dims |= _ffn_dims(expert=n_expert, ff_exp=n_ff_exp, ff_shexp=n_ff_exp)
    ffn = _table(_EXPERTS, _GATED_SHARED_EXPERT)
    layers = _qwen_hybrid_layers(n_layer, n_nextn, interval, _QWEN3NEXT_DELTA_NET, ffn)
    return _write(path, _spec("qwen3next", n_vocab, header, keys), dims, layers)


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
    heads = [0 if m else n_head for m in mamba]
    heads_kv = [0 if m else n_head_kv for m in mamba]
    header = _transformer(n_layer, n_embd, heads, heads_kv, n_ff, head_dim=head_dim)
    spec = _spec("plamo2", n_vocab, header, _ssm(conv_kernel, inner, state_size, dt_rank, 0))
    dims = (
        _attention_dims(n_embd, n_head, n_head_kv, head_dim)
        | _ssm_dims(conv_kernel, inner, state_size, dt_rank)
        | _ffn_dims(n_ff)
    )
    dims |= {"heads_kv": n_head_kv, "dt_dim": max(64, n_embd // 16)}
    layers = [_table("attn_norm.weight embd", _PLAMO2_MAMBA if m else _PLAMO2_ATTENTION, _PLAMO2_FFN) for m in mamba]
    return _write(path, spec, dims, layers, globals_=_TIED)


_PLAMO2_MAMBA = _table("""
    ssm_in.weight      embd 2*inner
    ssm_conv1d.weight  kernel inner
    ssm_x.weight       inner dt_dim+2*state
    ssm_dt.weight      dt_dim dt
    ssm_dt.bias        dt
    ssm_a              dt
    ssm_d              dt
    ssm_out.weight     inner embd
    ssm_dt_norm        dt_dim  # these three norms have no ".weight" suffix
    ssm_b_norm         state
    ssm_c_norm         state
""")
_PLAMO2_ATTENTION = _table("""
    attn_qkv.weight     embd q+2*kv
    attn_q_norm.weight  head heads
    attn_k_norm.weight  head heads_kv
    attn_output.weight  q embd
""")
_PLAMO2_FFN = _table("""
    post_attention_norm  embd
    ffn_norm.weight      embd
    ffn_down.weight      ff embd
    ffn_up.weight        embd 2*ff
    post_ffw_norm        embd
""")


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
    original_context: int | None = None,
    std: float = 0.02,
) -> Path:
    """A phi3 model with a fused gate/up projection; its header may name a sliding window (as converted
    Phi-3 models do), which llama.cpp ignores.

    With `original_context`, the model carries LongRoPE factors as Phi-3 128k models do: llama.cpp rotates
    with the short factors (here all 1) while a slot's context is at most `original_context`, with the long
    ones (here 1 rising to 16 over the rotated dimensions) above it. `std` is the random weights' spread:
    a large one (0.5) makes attention sharp enough that the rotation of the keys changes the text."""
    # a name containing "phi3" makes the vocabulary loader look up Phi-3's own special tokens
    header = _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff)
    keys = {"attention.sliding_window": n_swa, "rope.scaling.original_context_length": original_context}
    spec = _spec("phi3", n_vocab, header, keys, name="tiny-phi-three")
    spec.std = std
    dims = _attention_dims(n_embd, n_head, n_head_kv) | _ffn_dims(n_ff)
    globals_ = _GLOBALS
    if original_context is not None:
        half = n_embd // n_head // 2  # one factor per rotated pair of a head
        globals_ = _table(_GLOBALS, f"rope_factors_long.weight {half}", f"rope_factors_short.weight {half}")
        spec.values["rope_factors_long.weight"] = np.geomspace(1.0, 16.0, half)
        spec.values["rope_factors_short.weight"] = np.ones(half)
    return _write(path, spec, dims, [_PHI3] * n_layer, globals_=globals_)


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
    header = _recurrent(n_layer, n_embd, n_ff, "layer_norm_rms_epsilon", 1e-5)
    header |= {"wkv.head_size": head_size, "token_shift_count": token_shift_count, **_lora_ranks(lora_rank)}
    dims = {"embd": n_embd, "ff": n_ff, "lora": lora_rank}
    layer = _table("attn_norm.weight embd", _RWKV7_TIME_MIX, "ffn_norm.weight embd", _FFN)
    return _write(path, _spec("arwkv7", n_vocab, header), dims, [layer] * n_layer)


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
    keys = {
        "leading_dense_block_count": n_dense_lead,
        **_moe(n_expert, n_expert_used, n_ff_exp, n_shared=1),
        "nextn_predict_layers": n_nextn or None,
    }
    spec = _spec("glm4moe", n_vocab, _transformer(n_all, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ffn_dims(
        n_ff, expert=n_expert, ff_exp=n_ff_exp, ff_shexp=n_ff_exp
    )
    layers = [
        _table(
            "attn_norm.weight embd",
            _ATTENTION_BIASED,
            _QK_NORM,
            "post_attention_norm.weight embd",
            _GLM4MOE_MOE if il >= n_dense_lead else _FFN,
            _NEXTN if il >= n_layer else (),
        )
        for il in range(n_all)
    ]
    return _write(path, spec, dims, layers)


_GLM4MOE_MOE = _table(
    _EXPERTS,
    """
    exp_probs_b.bias       expert
    ffn_gate_shexp.weight  embd ff_shexp
    ffn_down_shexp.weight  ff_shexp embd
    ffn_up_shexp.weight    embd ff_shexp
    """,
)
