"""The engine of the tiny GGUF models (`tests.tiny_models`): a model's spec and file, and the tables families share.

Each `write_<arch>` writes a random-weight (or, with `sparse=True`, all-zero) model with exactly the tensors
llama.cpp's loader creates for that architecture, a byte-fallback SPM vocabulary, and the metadata the
architecture requires. With `sparse=True` the tensor data region is left as a file hole (the header is
written, then the file is truncated to its full size), so realistic 9B-30B shapes cost almost no disk and
load as zeros. The writers live in a module per kind of family
(`tiny_models_attention`, `_moe`, `_hybrid`, `_recurrent`, `_dense`, `_moe_rwkv6`); `tests.tiny_models` names them all.

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


_FFN = _table("""
    ffn_gate.weight  embd ff
    ffn_up.weight    embd ff
    ffn_down.weight  ff embd
""")


# a routed MoE FFN: the router and the stacked expert matrices (3-d tensors)
_EXPERTS = _table("""
    ffn_gate_inp.weight   embd expert
    ffn_gate_exps.weight  embd ff_exp expert
    ffn_up_exps.weight    embd ff_exp expert
    ffn_down_exps.weight  ff_exp embd expert
""")


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


# whole blocks of the families that have one kind of block
_DENSE = _table("attn_norm.weight embd", _ATTENTION, "ffn_norm.weight embd", _FFN)


_QWEN3 = _table("attn_norm.weight embd", _ATTENTION, _QK_NORM, "ffn_norm.weight embd")  # then the FFN


_LFM2_GLOBALS = _table("""
    token_embd.weight       embd vocab
    token_embd_norm.weight  embd  # LFM2's output norm carries this name
""")


_SHORTCONV = _table("""
    shortconv.conv.weight      l_cache embd
    shortconv.in_proj.weight   embd 3*embd
    shortconv.out_proj.weight  embd embd
""")


_RWKV7_GLOBALS = _table("""
    token_embd.weight       embd vocab
    token_embd_norm.weight  embd
    token_embd_norm.bias    embd
    output_norm.weight      embd
    output_norm.bias        embd
    output.weight           embd vocab
""")
