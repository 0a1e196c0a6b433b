"""Tiny GGUF writers of mixture-of-experts transformers: qwen3moe, gpt-oss, deepseek2 (MLA), glm4moe.

Built on `tests.tiny_models_engine`; shapes follow ggml order.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.tiny_models_engine import (
    _ATTENTION,
    _ATTENTION_BIASED,
    _EXPERTS,
    _FFN,
    _NEXTN,
    _QK_NORM,
    _QWEN3,
    _SHARED_EXPERT,
    _TIED,
    _attention_dims,
    _ffn_dims,
    _moe,
    _spec,
    _table,
    _transformer,
    _write,
)

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
