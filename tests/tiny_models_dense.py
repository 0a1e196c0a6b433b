"""Tiny GGUF writers for the dense families the memory model serves by the rules of proven ones: mistral3,
gemma, granite, command-r and starcoder2.

Built on the engine and tables of `tests.tiny_models` (`_spec`, `_write`, `_table`, the attention and FFN
tables): each writer gives the family's header keys and one block's tensor table, exactly as this build's
loader creates them (`src/models/<arch>.cpp`, `load_arch_tensors`); a missing or an extra tensor makes
llama-server refuse the file. Shapes follow ggml order.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.tiny_models_engine import (
    _ATTENTION,
    _ATTENTION_BIASED,
    _DENSE,
    _FFN,
    _GLOBALS,
    _TIED,
    _attention_dims,
    _ffn_dims,
    _spec,
    _table,
    _transformer,
    _write,
)

__all__ = ["write_command_r", "write_gemma", "write_granite", "write_mistral3", "write_starcoder2"]

#: command-r: attention and FFN read the same normed input, so a block has one norm and no ffn_norm
_COMMAND_R = _table("attn_norm.weight embd", _ATTENTION, _FFN)
#: command-r with 64 blocks or more (Command R+) norms Q and K per head
_COMMAND_R_QK_NORM = _table(
    "attn_norm.weight embd",
    "attn_q_norm.weight head heads",
    "attn_k_norm.weight head heads_kv",
    _ATTENTION,
    _FFN,
)
#: starcoder2: layer norms with biases, biased Q/K/V and output, a plain (ungated) GELU FFN with biases
_STARCODER2 = _table(
    "attn_norm.weight embd",
    "attn_norm.bias embd",
    _ATTENTION_BIASED,
    "attn_output.bias embd",
    """
    ffn_norm.weight  embd
    ffn_norm.bias    embd
    ffn_down.weight  ff embd
    ffn_up.weight    embd ff
    ffn_down.bias    embd
    ffn_up.bias      ff
    """,
)
_STARCODER2_GLOBALS = _table("""
    token_embd.weight   embd vocab
    output_norm.weight  embd
    output_norm.bias    embd
""")


def write_mistral3(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    dtype: str = "f32",
    yarn: bool = False,
    sparse: bool = False,
) -> Path:
    """A mistral3 (Mistral Small 3.x, Ministral 3) model: llama's block with an explicit head size, so Q may
    be narrower or wider than n_embd; an untied output projection. With `yarn`, Ministral 3's YaRN scaling
    and attention temperature (its graph then scales Q by a per-token factor)."""
    header = _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim)
    keys: dict[str, object] = {"rope.dimension_count": head_dim}
    if yarn:
        keys |= {
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 16.0,
            "rope.scaling.original_context_length": 16384,
            "rope.scaling.yarn_beta_fast": 32.0,
            "rope.scaling.yarn_beta_slow": 1.0,
            "rope.scaling.yarn_log_multiplier": 1.0,
            "attention.temperature_scale": 0.1,
        }
    spec = _spec("mistral3", n_vocab, header, keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ffn_dims(n_ff)
    return _write(path, spec, dims, [_DENSE] * n_layer, globals_=_GLOBALS, dtype=dtype, sparse=sparse)


def write_gemma(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    n_vocab: int = 259,
    dtype: str = "f32",
    sparse: bool = False,
) -> Path:
    """A gemma (Gemma 1) model: llama's block, an explicit head size (256 in the released models, wider
    than n_embd / n_head), the output projection tied to the embeddings."""
    header = _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim)
    spec = _spec("gemma", n_vocab, header)
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ffn_dims(n_ff)
    return _write(path, spec, dims, [_DENSE] * n_layer, globals_=_TIED, dtype=dtype, sparse=sparse)


def write_granite(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
    dtype: str = "f32",
    tied: bool = True,
    sparse: bool = False,
) -> Path:
    """A granite (Granite 3.x dense) model: llama's block with the scales granite requires (logit scale) or
    reads (residual, embedding and attention scales); released files tie the output projection."""
    keys = {"logit_scale": 8.0, "residual_scale": 0.22, "embedding_scale": 12.0, "attention.scale": 0.0078125}
    spec = _spec("granite", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv) | _ffn_dims(n_ff)
    globals_ = _TIED if tied else _GLOBALS
    return _write(path, spec, dims, [_DENSE] * n_layer, globals_=globals_, dtype=dtype, sparse=sparse)


def write_command_r(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
    dtype: str = "f32",
    sparse: bool = False,
) -> Path:
    """A command-r (Command R) model: the parallel block (one norm; attention and FFN on the same input),
    heads n_embd / n_head wide, a tied output; from 64 blocks on, per-head Q and K norms."""
    keys = {"logit_scale": 0.0625, "attention.layer_norm_epsilon": 1e-5}
    spec = _spec("command-r", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv) | _ffn_dims(n_ff) | {"heads_kv": n_head_kv}
    block = _COMMAND_R_QK_NORM if n_layer >= 64 else _COMMAND_R
    return _write(path, spec, dims, [block] * n_layer, globals_=_TIED, dtype=dtype, sparse=sparse)


def write_starcoder2(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 256,
    n_vocab: int = 259,
    dtype: str = "f32",
    sparse: bool = False,
) -> Path:
    """A starcoder2 model: layer norms with biases, biased attention, an ungated GELU FFN (up and down, with
    biases), a tied output."""
    keys = {"attention.layer_norm_epsilon": 1e-5}
    spec = _spec("starcoder2", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv) | _ffn_dims(n_ff)
    return _write(path, spec, dims, [_STARCODER2] * n_layer, globals_=_STARCODER2_GLOBALS, dtype=dtype, sparse=sparse)
