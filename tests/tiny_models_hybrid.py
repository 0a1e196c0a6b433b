"""Tiny GGUF writers of hybrids (attention with recurrent or convolution blocks): the qwen35 family and
qwen3next, granitehybrid, nemotron-h, lfm2, falcon-h1, jamba, plamo2; and the set the exactness tests start most.

Built on `tests.tiny_models_engine`; shapes follow ggml order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tests.tiny_models_attention import write_llama
from tests.tiny_models_engine import (
    _ATTENTION,
    _EXPERTS,
    _FFN,
    _GATED_SHARED_EXPERT,
    _LFM2_GLOBALS,
    _MAMBA1,
    _MAMBA2,
    _NEXTN,
    _QK_NORM,
    _SHARED_EXPERT,
    _SHORTCONV,
    _TIED,
    _attention_dims,
    _ffn_dims,
    _moe,
    _spec,
    _ssm,
    _ssm_dims,
    _Table,
    _table,
    _transformer,
    _without,
    _write,
)

_GATED_ATTENTION = _table("""
    attn_q.weight       embd 2*q  # Q and its output gate in one projection (qwen35, qwen3next)
    attn_k.weight       embd kv
    attn_v.weight       embd kv
    attn_output.weight  q embd
    attn_q_norm.weight  head
    attn_k_norm.weight  head
""")


_FFN_UP_DOWN = _without(_FFN, "ffn_gate.weight")


_EXPERTS_UP_DOWN = _without(_EXPERTS, "ffn_gate_exps.weight")


# a gated delta net (qwen35, qwen3next): fused QKV and gate, conv, decay; beta and alpha come between
_DELTA_NET_IN = _table("""
    attn_qkv.weight    embd 2*key+inner
    attn_gate.weight   embd inner
    ssm_conv1d.weight  kernel 2*key+inner
    ssm_dt.bias        dt
    ssm_a              dt
""")


_DELTA_NET_OUT = _table("ssm_norm.weight state", "ssm_out.weight inner embd")


_FALCON_H1 = _table(
    _MAMBA2,
    _ATTENTION,
    "attn_norm.weight embd",
    "ffn_norm embd",  # falcon-h1 loads this norm without a ".weight" suffix
    _FFN,
)


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
    rope_sections: Sequence[int] | None = None,
) -> Path:
    """A qwen35 hybrid: `n_layer` trunk layers (every `interval`-th full attention) + `n_nextn` MTP blocks.

    `inner_size = state_size · dt_rank` (the value dimension of the gated delta net). `rope_sections`: the
    M-RoPE sections (released models rotate 64 of 256 dimensions: [11, 11, 10, 0]), whose sum times two is
    the rope dimension count; default a quarter, then eighths of the head.
    """
    ssm = (conv_kernel, state_size, group_count, dt_rank)
    sizes = (n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab)
    return _write_qwen35_family(
        path, "qwen35", n_layer, n_nextn, interval, sizes, ssm, dtype, n_ctx_train, sparse, rope_sections=rope_sections
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
    rope_sections: Sequence[int] | None = None,
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
    sections = [head_dim // 4, head_dim // 8, head_dim // 8, 0] if rope_sections is None else list(rope_sections)
    keys = {
        "rope.dimension_count": head_dim if rope_sections is None else 2 * sum(sections),
        "rope.dimension_sections": sections,
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
    head_dim: int | None = None,
) -> Path:
    """A nemotron_h model; `layers` spells the blocks as Nemotron-H's pattern does: `M` a Mamba2 mixer,
    `*` attention, `-` an MLP. Only attention blocks have KV heads and only MLP blocks an FFN length, so
    an MLP block has neither KV nor recurrent state. `head_dim`: a head size other than n_embd / n_head."""
    ssm = (conv_kernel, inner, state_size, group_count, dt_rank)
    sizes = (n_embd, n_head, n_head_kv, n_ff, n_vocab)
    return _write_nemotron(path, "nemotron_h", layers, 0, sizes, ssm, head_dim=head_dim)


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
    *,
    head_dim: int | None = None,
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
    spec = _spec(arch, n_vocab, _transformer(len(kinds), n_embd, n_head, kv_heads, ff, head_dim=head_dim), keys)
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim)
    dims |= _ssm_dims(conv_kernel, inner, state_size, dt_rank, group_count)
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
