"""Tiny GGUF models for the mixture and RWKV-6 families `tests/tiny_models.py` does not write.

qwen2moe, granitemoe, lfm2moe, rwkv6 and rwkv6qwen2, built with the same data-driven engine (`_spec`, `_write`,
the attention, FFN and expert tables of `tests.tiny_models`), with exactly the tensors llama.cpp's
`load_arch_tensors` creates for each (`src/models/<arch>.cpp` of the pinned build). `sparse=True` leaves the
data region a file hole, so released widths cost no disk.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tests.tiny_models_engine import (
    _ATTENTION,
    _ATTENTION_BIASED,
    _EXPERTS,
    _FFN,
    _GATED_SHARED_EXPERT,
    _GLOBALS,
    _LFM2_GLOBALS,
    _QK_NORM,
    _RWKV7_GLOBALS,
    _SHARED_EXPERT,
    _SHORTCONV,
    _TIED,
    _attention_dims,
    _ffn_dims,
    _moe,
    _recurrent,
    _spec,
    _table,
    _transformer,
    _write,
)

__all__ = ["write_granitemoe", "write_lfm2moe", "write_qwen2moe", "write_rwkv6", "write_rwkv6qwen2"]


def write_qwen2moe(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 3,
    n_embd: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 256,
    n_vocab: int = 259,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
    n_ff_shexp: int = 256,
    dtype: str = "f32",
    sparse: bool = False,
) -> Path:
    """A qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B) model: qwen2's biased GQA, every FFN a routed mixture plus a
    sigmoid-gated shared expert `n_ff_shexp` wide; matrices of weight type `dtype`."""
    header = _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff)
    spec = _spec("qwen2moe", n_vocab, header, _moe(n_expert, n_expert_used, n_ff_exp, shared_ff=n_ff_shexp))
    dims = _attention_dims(n_embd, n_head, n_head_kv)
    dims |= _ffn_dims(n_ff, expert=n_expert, ff_exp=n_ff_exp, ff_shexp=n_ff_shexp)
    layer = _table(
        "attn_norm.weight embd",
        _ATTENTION_BIASED,
        "ffn_norm.weight embd",
        _EXPERTS,
        _GATED_SHARED_EXPERT,
    )
    return _write(path, spec, dims, [layer] * n_layer, globals_=_GLOBALS, dtype=dtype, sparse=sparse)


def write_granitemoe(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 3,
    n_embd: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 64,
    n_vocab: int = 259,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_shexp: int = 0,
    sparse: bool = False,
) -> Path:
    """A granitemoe (Granite-3.x MoE) model: every expert is `feed_forward_length` wide (no expert width
    key), tied output embeddings; `n_ff_shexp` > 0 adds Granite MoE Shared's ungated-router shared expert."""
    keys = {
        "rope.dimension_count": n_embd // n_head,
        **_moe(n_expert, n_expert_used, shared_ff=n_ff_shexp or None),
        "logit_scale": 6.0,
        "residual_scale": 0.22,
        "embedding_scale": 12.0,
        "attention.scale": 0.015625,
    }
    spec = _spec("granitemoe", n_vocab, _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv) | _ffn_dims(
        n_ff, expert=n_expert, ff_exp=n_ff, ff_shexp=n_ff_shexp
    )
    layer = _table(
        "attn_norm.weight embd", _ATTENTION, "ffn_norm.weight embd", _EXPERTS, _SHARED_EXPERT if n_ff_shexp else ()
    )
    return _write(path, spec, dims, [layer] * n_layer, globals_=_TIED, sparse=sparse)


def write_lfm2moe(
    path: str | os.PathLike[str],
    *,
    attention_layers: Sequence[int] = (2, 5),
    n_layer: int = 6,
    n_dense_lead: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 384,
    n_vocab: int = 259,
    l_cache: int = 3,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
    n_swa: int | None = None,
    sparse: bool = False,
) -> Path:
    """An LFM2-MoE (LFM2-8B-A1B) model: LFM2's short-convolution and attention blocks, dense SwiGLU FFNs in
    the first `n_dense_lead` blocks, then routed experts with a sigmoid router and its bias. `n_swa` writes
    a sliding window key, which llama.cpp's lfm2moe loader (unlike lfm2's) does not read."""
    kv_heads = [n_head_kv if il in attention_layers else 0 for il in range(n_layer)]
    keys = {
        "shortconv.l_cache": l_cache,
        "leading_dense_block_count": n_dense_lead,
        **_moe(n_expert, n_expert_used, n_ff_exp),
        "expert_gating_func": 2,  # sigmoid
        "attention.sliding_window": n_swa,
    }
    spec = _spec("lfm2moe", n_vocab, _transformer(n_layer, n_embd, n_head, kv_heads, n_ff), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv) | _ffn_dims(n_ff, expert=n_expert, ff_exp=n_ff_exp)
    dims |= {"l_cache": l_cache}
    moe = _table(_EXPERTS, "exp_probs_b.bias expert")
    layers = [
        _table(
            "ffn_norm.weight embd",
            moe if il >= n_dense_lead else _FFN,
            "attn_norm.weight embd",
            _table(_QK_NORM, _ATTENTION) if kv_heads[il] else _SHORTCONV,
        )
        for il in range(n_layer)
    ]
    return _write(path, spec, dims, layers, globals_=_LFM2_GLOBALS, sparse=sparse)


# the RWKV-6 time mix up to its key projection: the data-dependent lerp LoRA (five mixes, fused), the bonus
# ("first") per head, which only rwkv6 has (without it llama.cpp runs QRWKV's gated linear attention), and
# the decay with its own LoRA
_RWKV6_LERP = _table("""
    time_mix_w1.weight          embd 5*mix_lora
    time_mix_w2.weight          mix_lora embd 5
    time_mix_lerp_x.weight      embd 1 1
    time_mix_lerp_fused.weight  embd 1 1 5
""")
_RWKV6_DECAY = _table("""
    time_mix_decay.weight       embd
    time_mix_decay_w1.weight    embd decay_lora
    time_mix_decay_w2.weight    decay_lora embd
""")


def _rwkv6_keys(head_size: int, mix_lora: int, decay_lora: int) -> dict[str, object]:
    return {"wkv.head_size": head_size, "time_mix_extra_dim": mix_lora, "time_decay_extra_dim": decay_lora}


def _rwkv6_dims(n_embd: int, n_ff: int, head_size: int, mix_lora: int, decay_lora: int) -> dict[str, int]:
    return {
        "embd": n_embd,
        "ff": n_ff,
        "head_size": head_size,
        "heads": n_embd // head_size,
        "mix_lora": mix_lora,
        "decay_lora": decay_lora,
    }


def write_rwkv6(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 3,
    n_embd: int = 128,
    head_size: int = 64,
    n_ff: int = 448,
    n_vocab: int = 259,
    mix_lora: int = 32,
    decay_lora: int = 64,
    token_shift_count: int | None = None,
    sparse: bool = False,
) -> Path:
    """A pure-recurrent RWKV-6 (Finch) model: two token-shift rows (time mix and channel mix) and a wkv
    state (n_embd x head size) per layer; a layer-norm after the embeddings."""
    header = _recurrent(n_layer, n_embd, n_ff, "layer_norm_epsilon", 1e-5)
    header |= _rwkv6_keys(head_size, mix_lora, decay_lora) | {"rescale_every_n_layers": 6}
    header |= {"token_shift_count": token_shift_count}  # None: left out, llama.cpp's default of 2
    dims = _rwkv6_dims(n_embd, n_ff, head_size, mix_lora, decay_lora)
    layer = _table(
        """
        attn_norm.weight    embd
        attn_norm.bias      embd
        attn_norm_2.weight  embd
        attn_norm_2.bias    embd
        """,
        _RWKV6_LERP,
        "time_mix_first.weight head_size heads",
        _RWKV6_DECAY,
        """
        time_mix_key.weight         embd embd
        time_mix_value.weight       embd embd
        time_mix_receptance.weight  embd embd
        time_mix_gate.weight        embd embd
        time_mix_ln.weight          embd
        time_mix_ln.bias            embd
        time_mix_output.weight      embd embd
        channel_mix_lerp_k.weight   embd 1 1
        channel_mix_lerp_r.weight   embd 1 1
        channel_mix_key.weight         embd ff
        channel_mix_value.weight       ff embd
        channel_mix_receptance.weight  embd embd
        """,
    )
    return _write(
        path, _spec("rwkv6", n_vocab, header), dims, [layer] * n_layer, globals_=_RWKV7_GLOBALS, sparse=sparse
    )


def write_rwkv6qwen2(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 3,
    n_embd: int = 128,
    head_size: int = 32,
    n_head_kv: int = 2,
    n_ff: int = 384,
    n_vocab: int = 259,
    mix_lora: int = 32,
    decay_lora: int = 64,
    token_shift_count: int = 1,
    sparse: bool = False,
) -> Path:
    """An RWKV6-Qwen2 (QRWKV6) model: an RWKV-6 time mix with gated linear attention (no bonus, no group
    norm) over Qwen2's grouped K/V widths (`n_head_kv` heads, with biases) before Qwen2's SwiGLU FFN; its
    converter writes one token-shift row (the graph asserts n_embd_r == n_embd)."""
    header = _recurrent(n_layer, n_embd, n_ff, "layer_norm_rms_epsilon", 1e-6, n_head=n_embd // head_size)
    header |= {"attention.head_count_kv": n_head_kv, "token_shift_count": token_shift_count}
    header |= _rwkv6_keys(head_size, mix_lora, decay_lora)
    dims = _rwkv6_dims(n_embd, n_ff, head_size, mix_lora, decay_lora) | {"kv": n_head_kv * head_size}
    layer = _table(
        "attn_norm.weight embd",
        _RWKV6_LERP,
        _RWKV6_DECAY,
        """
        time_mix_key.weight         embd kv
        time_mix_value.weight       embd kv
        time_mix_receptance.weight  embd embd
        time_mix_gate.weight        embd embd
        time_mix_key.bias           kv
        time_mix_value.bias         kv
        time_mix_receptance.bias    embd
        time_mix_output.weight      embd embd
        ffn_norm.weight             embd
        """,
        _FFN,
    )
    return _write(path, _spec("rwkv6qwen2", n_vocab, header), dims, [layer] * n_layer, globals_=_GLOBALS, sparse=sparse)
