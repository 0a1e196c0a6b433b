"""Tiny GGUF writers of attention-only transformers: llama, gemma3, gemma2, qwen2, qwen3, cohere2, phi3.

Built on `tests.tiny_models_engine`; shapes follow ggml order.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tests.tiny_models_engine import (
    _ATTENTION,
    _ATTENTION_BIASED,
    _DENSE,
    _FFN,
    _GLOBALS,
    _QWEN3,
    _TIED,
    _attention_dims,
    _ffn_dims,
    _spec,
    _table,
    _transformer,
    _write,
)

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
