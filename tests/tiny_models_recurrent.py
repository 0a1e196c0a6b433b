"""Tiny GGUF writers of purely recurrent models: mamba, mamba2, rwkv7, arwkv7.

Built on `tests.tiny_models_engine`; shapes follow ggml order.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.tiny_models_engine import (
    _FFN,
    _MAMBA1,
    _MAMBA2,
    _RWKV7_GLOBALS,
    _TIED,
    _recurrent,
    _spec,
    _ssm,
    _ssm_dims,
    _table,
    _write,
)


def _lora_ranks(rank: int) -> dict[str, object]:
    return {f"attention.{lora}_lora_rank": rank for lora in ("decay", "iclr", "value_residual_mix", "gate")}


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
