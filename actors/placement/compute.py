"""Compute-buffer model (placement core).

llama.cpp reserves its compute buffers by allocating a worst-case graph (`sched_reserve`): the buffer is the
peak of live intermediate tensors under ggml-alloc's reuse (`ggml-alloc.c`: best fit among free blocks, in
place where an op allows, every tensor freed after its last consumer). This module models it from the terms
that dominate that peak, each derived from the graph llama.cpp builds, with coefficients calibrated on
llama-server's own reports (`sched_reserve: … compute buffer size`); where the peak depends on which freed
block a tensor reuses (a dense Qwen3.5 trunk and its MTP draft), it places that graph as ggml-alloc does
(`qwen35_graph`, on `graph_alloc._graph_peak`) instead:

* the attention masks, live for the whole graph: f16 (flash attention) or f32 `n_kv x n_ubatch` per KV
  cache (a sliding-window model has a second, window-sized mask);
* the peak of one layer, whichever stage is larger:
  - the activation stage, `4 · n_ubatch · (rows + 5 · n_embd)` bytes: the FFN's rows live with the residual
    stream (6 · n_embd for cohere2's parallel attention and FFN). A dense SwiGLU FFN has `3 · n_ff` (gate,
    up and their product); nemotron_h's ungated MLP 2, starcoder2's GELU MLP 1. A routed mixture of
    experts (`build_moe_ffn`) has those for each of the `U` experts a token uses, `3 · U · n_ff_exp`, plus
    the experts' n_embd-wide outputs, `U · n_embd`, unless ggml-alloc puts them where gate and up were (when
    `U · n_embd <= 2 · U · n_ff_exp`); expert rows no wider than n_embd in all sit in blocks the attention
    freed (qwen3moe and gpt-oss); nemotron's ungated experts have one row each;
  - the recurrent stage, which `sched_reserve` reaches with one sequence per slot: each slot's state gathered
    and written back (two copies per slot, plus `n_rs_seq` more snapshots of the S state with rollback rows:
    `ggml_gated_delta_net`'s K, Mamba's scan likewise) beside per-token rows: `4 · (d_inner + n_group ·
    d_state) + 6 · n_embd` for a Mamba-2 scan, `5 · n_embd + 2.4 · (d_inner + 2 · n_group · d_state)` for a
    gated delta net; also a Mamba layer's `3.5 ·` input projection width plus one state copy;
  - RWKV: `max(20 · n_embd, 2 · n_ff)` per token (time mix or channel mix; RWKV-6's time mix 15 · n_embd),
    ARWKV-7's SwiGLU FFN `max(3 · n_ff + 12 · n_embd, 4.7 · n_ff)`, plus two state copies per slot; QRWKV6
    (rwkv6qwen2) the larger of its time mix with two state copies per slot and its SwiGLU FFN stage
    (`3 · n_ff + 5 · n_embd`) with one;
  - without flash attention, the attention-score stage: the f32 `n_kv x n_ubatch x n_head` score matrix
    plus `4 · n_ubatch · (7 · n_embd + 2 · n_kv_width)`;
  - the output stage: logits for the reserved outputs plus two embedding-sized rows per token;
* an MTP draft context: Qwen3.5's dense `graph_mtp` with flash attention placed node by node (the target's
  hidden state input, the eh_proj concat, Q with its gate, the SwiGLU FFN, the head); another draft is sized
  as one trunk layer over its nextn blocks.

History and measured error (CPU build). compute-1..3: 608 llama-server runs of tiny llama, gemma3, qwen35,
granitehybrid and mamba2 shapes (n_embd 64-1024, 1 and 4 slots, flash attention on and off): mean 1-10% per
family, worst -19% (n_ff < n_embd); RWKV and jamba terms fitted on the families of
`tests/e2e/test_memory_exact_more.py`. compute-4: the routed-expert rows, 450 runs of eight MoE families.
compute-5: the recurrent stage with one sequence per slot (Qwen3.5-9B and Mamba2-2.7B widths, 1-32 slots).
compute-6: the MTP draft graph (9B and 27B exact to 0.01 MiB, were +36% / +23%), rollback snapshots (the
27B MTP target was -10.4%), the Mamba-2 stage by d_inner (Falcon-H1-1.5B was +10.3%), the delta-net stage
by its channels (Qwen3.5-35B-A3B and Qwen3-Next at 16 slots were -14.5%), cohere2's parallel block (-5.6%)
ARWKV-7's SwiGLU (-27%) and StarCoder2's one-row GELU MLP (+81%). On the 149 cases of
`benchmarks/compute_shapes.py` (released widths of 36 sparse shapes in 30 families; 1/4/16 slots unified,
per-slot streams, MTP) every case is within 10%: fit set 34/34 (-3.9%..+5.3%), hold-out 115/115
(-5.2%..+9.6%; worst under: Mamba-2.8B v1 and PLaMo-2, -5%; worst over: the GLM-4.5-Air MTP draft sized
as a trunk layer, +9.6%). `MEASURED_ERROR_RATIO` stays 0.25: the
tiny-shape sweep keeps outliers to -19%.
compute-7: command-r's parallel block keeps no extra n_embd row (Command-R 35B widths were +7.3%, now -0.0%;
cohere2 keeps it), RWKV-6's time mix is 15 rows (Finch was over by 27-36%) and QRWKV6's peak is the larger
of that mix and its SwiGLU stage (tiny QRWKV6 was +29%); those families are checked by
`tests/e2e/test_memory_exact_dense.py` and `tests/e2e/test_memory_exact_moe_rwkv6.py` at released widths
(every case within 10%), the other rows of the 149-case run are unchanged by it.
compute-8: embedding and rerank graphs (`--embeddings`), whose every token is an output: their end is the
logits of the whole micro-batch above the normed hidden states (`POOLED_OUTPUT_EMBD_ROWS`); generation graphs
are unchanged.
compute-9: a split over RPC devices (`split_compute_buffers`): the host holds every mask beside its blocks' stage,
a member its blocks' stage with three fewer n_embd-wide rows and its own mask copy, one dense block the larger of
mask plus attention rows and the FFN rows (measured against the members' exact allocations on dense, SWA and
hybrid tiny models, 1-3 members: within 0.2% on most devices, worst -14.5%); unsplit graphs are unchanged.
compute-10 (issue 27): a Mamba-2 layer (`build_mamba2_layer`: mamba2, granitehybrid, falcon-h1, nemotron_h and
nemotron_h_moe) is sized around its scan as ggml-alloc places it (`_mamba2_scan_stage`: the input projection,
the convolution's output, its input's freed block and what of the scan's output and the other slots' gathered
states fits there) instead of 3.5 input widths, which was +12-15.5% at Nemotron-H widths whose d_inner is five
n_embd (and -4.4% at 16 slots); a dense Qwen3.5 trunk, alone or one device's part of a split, is placed node by
node (`qwen35_graph.trunk_peak`: the first period of delta nets and gated attention, then one more delta net,
the masks among the inputs) instead of the gated-delta rows, which were +8-16.5% at n_embd 2048 with 1-4 slots,
-4-6% with MTP rollback snapshots and +28% on a split's member. Both were read from the reserve graph's nodes
(`GGML_SCHED_DEBUG=2`) and checked on one-layer probes first, then on the issue's shapes and the families they
touch (`benchmarks/compute_shapes.py`, `tests/e2e/test_compute_hybrid_shapes.py`).
Warm-up routes every expert; the runner disables it (`--no-warmup`), so it is not modelled.
GPU compute buffers (per-device graph splits, the host-side buffer) are not validated: no GPU build was
available.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from actors.placement import qwen35_graph
from messages.memory import ContextShape
from messages.model import LayerGeometry, ModelGeometry

__all__ = ["CALIBRATION_VERSION", "MEASURED_ERROR_RATIO", "ComputeEstimate", "compute_buffers", "split_compute_buffers"]

CALIBRATION_VERSION = "compute-10"
#: Largest relative error of the model against llama-server's reported compute buffers in calibration.
MEASURED_ERROR_RATIO = 0.25

FFN_FACTOR = 3  # gate, up and their product, n_ff wide, live at once
EMBD_FACTOR = 5  # residual stream, FFN input, norm output and two more n_embd-wide rows
MAMBA_IN_FACTOR = 3.5  # input projection, conv window and scan output of a Mamba layer, per input width
#: Architectures whose recurrent blocks are `build_mamba2_layer`'s, sized around the scan as ggml-alloc places
#: them (`_mamba2_scan_stage`, compute-10) instead of by `MAMBA_IN_FACTOR`.
MAMBA2_SCAN_LAYER = frozenset({"mamba2", "granitehybrid", "falcon-h1", "nemotron_h", "nemotron_h_moe"})
#: Mixture-of-experts FFNs without a gate (a squared-ReLU up projection, computed in place): one row per
#: routed expert instead of gate, up and their product.
UNGATED_EXPERTS = frozenset({"nemotron_h", "nemotron_h_moe"})
#: Attention-only MoE models whose expert rows, when no wider than n_embd, fit into the blocks the attention
#: stage freed (measured); elsewhere such rows were found on top of the arena, as wider rows always are.
NARROW_ROWS_IN_ATTENTION_BLOCKS = frozenset({"qwen3moe", "gpt-oss"})
#: For a geometry encoded before expert widths existed (every `n_ff_exp` 0): the architectures whose
#: experts are `feed_forward_length` wide; the dense n_ff stands in for the others, as it did then.
EXPERTS_AS_WIDE_AS_N_FF = frozenset({"jamba"})
#: The recurrent stage llama.cpp reserves with one sequence per slot (`sched_reserve` builds its worst-case
#: graph with n_seqs = slots): every slot's state is gathered from the cache and written back by the scan,
#: two state copies per slot live at once, beside n_embd-wide rows per token (fitted per recurrent kind on
#: Qwen3.5-9B and Mamba2-2.7B widths at 8-32 slots; compute-5).
RECURRENT_STATE_COPIES = 2
MAMBA_STAGE_INNER = 4  # d_inner + n_group·d_state wide rows per token at a Mamba-2 scan (compute-6)
MAMBA_STAGE_EMBD = 6  # n_embd-wide rows beside them (compute-6; compute-5 had 14.6 n_embd in all)
#: A gated delta net's stage: n_embd-wide rows and rows as wide as its convolved q/k/v channels
#: (`d_inner + 2·n_group·d_state`), per token (compute-6; compute-5 had 9.8 n_embd in all, which held only
#: where those channels are 2 n_embd wide).
GATED_DELTA_STAGE_EMBD = 5
GATED_DELTA_STAGE_CONV = 2.4
#: Ungated FFNs (`LLM_FFN_SEQ`) whose bias and activation run in place over the up projection: one n_ff-wide
#: row (starcoder2's GELU MLP; measured at StarCoder2-7B widths, where 3 rows over-reserved by 81%).
SEQUENTIAL_FFN_ROWS = {"starcoder2": 1}
#: Blocks whose attention and FFN read the same normed input (`cohere2.cpp`): the attention output stays
#: live beside the FFN rows, one more n_embd-wide row. Not command-r, whose graph is the same parallel block
#: but whose reservation has no such row (measured exact without it at n_embd 128, 4096 and 8192, GQA and
#: not; with it, +6-7% at Command-R 35B/32B widths).
PARALLEL_BLOCK = frozenset({"cohere2"})
#: nemotron_h's MLP blocks are ungated (squared ReLU): up and its activation, no gate.
UNGATED_FFN_FACTOR = 2
RWKV_EMBD_FACTOR = 20  # n_embd-wide rows live at the peak of an RWKV-7 time mix, per token
#: RWKV-6's time mix (`build_rwkv6_time_mix`) keeps fewer: the five lerped inputs, r/k/v/g, the decay, the
#: shifted and normed inputs and the wkv output (measured at Finch 1.6B and n_embd 256, where 20 rows
#: over-reserved by 27-36%); QRWKV6's is the same graph without the bonus and the group norm.
RWKV_TIME_MIX_ROWS = {"rwkv6": 15, "rwkv6qwen2": 15}
#: QRWKV6 (rwkv6qwen2): RWKV-6's time mix before Qwen2's SwiGLU FFN, whose stage holds one state copy per slot
#: where the time mix holds two (measured at QRWKV6-7B widths, 1-16 slots; the 20-row RWKV-7 rule was +29%
#: at n_embd 256).
QRWKV_SWIGLU_FFN = frozenset({"rwkv6qwen2"})
RWKV_FFN_FACTOR = 2  # an RWKV channel mix keeps two n_ff-wide rows (no gate)
RWKV_STATE_COPIES = 2  # the wkv state read and written per sequence
#: ARWKV-7 (an RWKV-7 time mix before a SwiGLU FFN): the FFN stage is `max(3·n_ff + 12·n_embd, 4.7·n_ff)`
#: rows per token (fitted on n_embd 1792-4096 at n_ff 18944 and 22016, compute-6; compute-5 had the
#: channel mix's 2·n_ff and was under by 27% at ARWKV-7-7B widths).
RWKV_SWIGLU_FFN = frozenset({"arwkv7"})
RWKV_SWIGLU_EMBD = 12
RWKV_SWIGLU_FFN_ALONE = 4.7
SCORE_EMBD_FACTOR = 7
SCORE_KV_FACTOR = 2
HOST_EMBD_FACTOR = 2  # with GPUs: token embeddings looked up on the host, and their copy for upload
#: A split over RPC devices (compute-9): a member's graph starts from the residual stream the previous device
#: sent, so it holds three n_embd-wide rows fewer than the host's, which looks the token embeddings up
#: (fitted on llama widths 128-512 wide, n_ff 256-1024: exact to 0.01 MiB on every member with two blocks or more).
REMOTE_FEWER_EMBD_ROWS = 3
#: A member holding one dense block frees its mask copy after the attention (its last reader), so its peak is
#: the larger of the mask with the attention's rows and the FFN's rows without the mask (fitted as above).
SINGLE_BLOCK_ATTENTION_ROWS = 4
SINGLE_BLOCK_FFN_ROWS = 2
#: An embedding or rerank graph (`--embeddings`) outputs every token of the micro-batch: the final norm's output
#: (an output tensor, kept to the end for the pooling) and, above it, the logits of every token (llama.cpp
#: computes them for a pooled model too), where a generation graph has only a few outputs. The norm's output
#: lies where the last layer's residual stream was: with flash attention above four more n_embd-wide rows the
#: last layer left (with all tokens as outputs, its two output-row gathers are full-size copies), without it
#: above six (the attention stage's rows). Measured on llama and qwen3 shapes, n_embd 64-1024 and n_vocab
#: 259-32000, micro-batches of 512-2048, mean/cls/last/rank pooling (compute-8; `benchmarks/pooled_compute.py`).
POOLED_OUTPUT_EMBD_ROWS = {True: 5, False: 7}


@dataclass(frozen=True)
class ComputeEstimate:
    """Compute buffer bytes: `device` for each device holding layers (the host when there is no GPU),
    `host` for the host-side buffer llama.cpp adds when layers are offloaded, `draft` for an MTP context."""

    device: int
    host: int
    draft: int


def _ffn_rows(geometry: ModelGeometry, layer: LayerGeometry) -> int:
    """Elements per token of a layer's FFN stage beyond the n_embd-wide rows (`EMBD_FACTOR`).

    A routed layer (`build_moe_ffn`) computes gate and up for each of the `U` experts a token uses, `F`
    wide each, then their product, then each expert's n_embd-wide output. ggml-alloc puts those outputs
    where gate and up were if they fit (`U·n_embd <= 2·U·F`), else on top of the FFN rows, which are
    still live.
    """
    if not layer.n_ff_exp:
        return (UNGATED_FFN_FACTOR if geometry.architecture in UNGATED_EXPERTS else FFN_FACTOR) * layer.n_ff
    routed = max(1, layer.n_expert_used or geometry.n_expert_used) * layer.n_ff_exp
    outputs = max(1, layer.n_expert_used or geometry.n_expert_used) * geometry.n_embd
    if geometry.architecture in UNGATED_EXPERTS:
        return routed + outputs
    if outputs <= 2 * routed:
        return FFN_FACTOR * routed
    if geometry.architecture in NARROW_ROWS_IN_ATTENTION_BLOCKS and routed <= geometry.n_embd:
        return max(FFN_FACTOR * routed, outputs)
    return FFN_FACTOR * routed + outputs


def _legacy_n_ff(geometry: ModelGeometry, layers: list[LayerGeometry]) -> int:
    """The FFN width of a geometry without expert widths: the dense n_ff (times the experts used for an
    architecture whose experts are n_ff wide)."""
    n_ff = max((layer.n_ff for layer in layers), default=0)
    if geometry.architecture in EXPERTS_AS_WIDE_AS_N_FF and geometry.n_expert:
        n_ff *= max(1, geometry.n_expert_used)
    return n_ff


def _recurrent_stage_rows(geometry: ModelGeometry) -> float | None:
    """Elements per token live beside the state copies at the recurrent stage, or None for a kind without one.

    A Mamba-2 scan (`build_mamba2_layer`) keeps the input projection (z, x, B, C and dt: two d_inner-wide and
    two n_group·d_state-wide rows), the convolved x/B/C rows and the scan output (d_inner) live, beside
    n_embd-wide rows (the residual, the normed input, falcon-h1's attention branch): `4·(d_inner +
    n_group·d_state) + 6·n_embd` (fitted on Mamba2-2.7B and Falcon-H1-1.5B, whose d_inner is 2 and 1.5
    n_embd). A gated delta net: 9.8 n_embd."""
    if geometry.recurrent_kind == "mamba":
        inner = geometry.ssm_d_inner + geometry.ssm_n_group * geometry.ssm_d_state
        return MAMBA_STAGE_INNER * inner + MAMBA_STAGE_EMBD * geometry.n_embd
    if geometry.recurrent_kind == "gated_delta":
        conv = geometry.ssm_d_inner + 2 * geometry.ssm_n_group * geometry.ssm_d_state
        return GATED_DELTA_STAGE_EMBD * geometry.n_embd + GATED_DELTA_STAGE_CONV * conv
    return None


def _mamba2_scan_stage(geometry: ModelGeometry, layer: LayerGeometry, shape: ContextShape, embd_rows: int) -> int:
    """The peak of a Mamba-2 layer (`build_mamba2_layer`) around its scan, placed as ggml-alloc places it
    (compute-10, read from the reserve graph's nodes and checked node by node against the server's buffer).

    Live at once: the n_embd-wide rows beside every stage (`embd_rows`), the input projection `zxBCdt`
    (`2·d_inner + 2·n_group·d_state + n_head` per token, alive until z is copied out after the scan), the
    convolution's output (`xBC`, `d_inner + 2·n_group·d_state`), and the block its input had (the conv states
    concatenated before the micro-batch: `xBC` rows plus `d_conv - 1` per slot), freed before the scan. The scan
    writes y (d_inner per token) and every slot's final state in one tensor, then the states of the other
    slots are gathered (`states_extra`, one state each beside the first). The first of those two that fits
    goes into the freed conv-input block; what does not fit goes on top. When the scan fits there, z's copy
    (d_inner per token) is the next tensor on top.
    """
    t, slots = shape.n_ubatch, max(1, shape.n_seq_max)
    groups = geometry.ssm_n_group * geometry.ssm_d_state
    xbc = geometry.ssm_d_inner + 2 * groups
    in_proj = 4 * t * (2 * geometry.ssm_d_inner + 2 * groups + geometry.ssm_dt_rank)
    conv_in = 4 * (t * xbc + slots * layer.r_width)
    scan = 4 * t * geometry.ssm_d_inner + 4 * slots * layer.s_width
    extra = 4 * (slots - 1) * layer.s_width
    if scan <= conv_in:
        on_top = max(extra, 4 * t * geometry.ssm_d_inner)
    elif extra <= conv_in:
        on_top = scan
    else:
        on_top = scan + extra
    return 4 * t * embd_rows * geometry.n_embd + in_proj + 4 * t * xbc + conv_in + on_top


def _layer_peak(
    geometry: ModelGeometry,
    layers: list[LayerGeometry],
    shape: ContextShape,
    *,
    flash_attn: bool,
    n_outputs: int,
    pooled: bool = False,
    fewer_embd_rows: int = 0,
    with_output: bool = True,
) -> int:
    """The largest per-layer stage over `layers`. `fewer_embd_rows`: n_embd-wide rows a split's member does
    not hold (`REMOTE_FEWER_EMBD_ROWS`); `with_output`: whether the output stage is in this graph."""
    t = shape.n_ubatch
    n_embd = geometry.n_embd
    attention = [layer for layer in layers if layer.attention or layer.nextn]
    if any(layer.n_ff_exp for layer in geometry.layers):
        ffn_rows = max((_ffn_rows(geometry, layer) for layer in layers), default=0)
    else:
        # a dense nemotron_h MLP is ungated; a MoE geometry without expert widths is sized as it was before
        ungated = geometry.architecture in UNGATED_EXPERTS and not geometry.n_expert
        factor = SEQUENTIAL_FFN_ROWS.get(geometry.architecture, UNGATED_FFN_FACTOR if ungated else FFN_FACTOR)
        ffn_rows = factor * _legacy_n_ff(geometry, layers)
    embd_rows = EMBD_FACTOR + (1 if geometry.architecture in PARALLEL_BLOCK else 0) - fewer_embd_rows
    activation = 4 * t * (ffn_rows + embd_rows * n_embd)
    if geometry.recurrent_kind == "mamba" and any(layer.recurrent for layer in layers):
        recurrent = [layer for layer in layers if layer.recurrent]
        if geometry.architecture in MAMBA2_SCAN_LAYER:
            mamba = max(_mamba2_scan_stage(geometry, layer, shape, embd_rows) for layer in recurrent)
        else:
            width = 2 * geometry.ssm_d_inner + 2 * geometry.ssm_n_group * geometry.ssm_d_state + geometry.ssm_dt_rank
            state = max(layer.r_width + layer.s_width for layer in recurrent)
            mamba = int(4 * t * MAMBA_IN_FACTOR * width) + 4 * shape.n_seq_max * state
        activation = max(activation, mamba)
    stage_rows = _recurrent_stage_rows(geometry)
    placed = None
    if flash_attn and not pooled:
        # a dense Qwen3.5 trunk, or a split device's part, placed node by node (compute-10): the head (or an
        # unsplit graph) creates every mask, a member holds copies of its own blocks' masks
        head = not fewer_embd_rows
        mask_layers = [layer for layer in geometry.layers if layer.attention and not layer.nextn] if head else attention
        masks = _masks(mask_layers, shape, flash_attn=flash_attn)
        placed = qwen35_graph.trunk_peak(geometry, layers, shape, n_outputs, masks, head=head, with_output=with_output)
    if placed is not None:
        activation = max(activation, placed)
    elif stage_rows is not None and any(layer.recurrent for layer in layers):
        state = max(layer.r_width + layer.s_width for layer in layers if layer.recurrent)
        # with rollback rows the scan writes n_rs_seq + 1 snapshots of each slot's S state, not one
        snapshots = shape.n_rs_seq * max(layer.s_width for layer in layers if layer.recurrent)
        copies = RECURRENT_STATE_COPIES * state + snapshots
        stage = int(4 * t * stage_rows) + 4 * shape.n_seq_max * copies
        activation = max(activation, stage)
    if geometry.recurrent_kind == "rwkv" and any(layer.recurrent for layer in layers):
        # the time mix (six lerped inputs, r/w/k/v/a/g and their LoRA paths) or the channel mix (key and its
        # squared ReLU, n_ff wide), whichever is larger, plus the wkv state read and written per sequence
        state = max(layer.r_width + layer.s_width for layer in layers if layer.recurrent)
        n_ff = max(layer.n_ff for layer in layers)
        if geometry.architecture in RWKV_SWIGLU_FFN:
            # a SwiGLU FFN after the time mix: gate, up and their product, placed among the blocks the time
            # mix left, which the rows n_ff wide fit only partly (fitted, compute-6)
            ffn = max(FFN_FACTOR * n_ff + RWKV_SWIGLU_EMBD * n_embd, RWKV_SWIGLU_FFN_ALONE * n_ff)
            mix = max(RWKV_EMBD_FACTOR * n_embd, ffn)
        else:
            time_mix = RWKV_TIME_MIX_ROWS.get(geometry.architecture, RWKV_EMBD_FACTOR)
            mix = max(time_mix * n_embd, RWKV_FFN_FACTOR * n_ff)
        per_slot = 4 * shape.n_seq_max * state
        activation = int(4 * t * mix) + RWKV_STATE_COPIES * per_slot
        if geometry.architecture in QRWKV_SWIGLU_FFN:
            # QRWKV6: Qwen2's SwiGLU FFN (gate, up and their product beside the n_embd-wide rows, as a dense
            # block) beside one state copy per slot, where its channel mix would have two n_ff-wide rows
            time_mix = RWKV_TIME_MIX_ROWS[geometry.architecture]
            swiglu = int(4 * t * (FFN_FACTOR * n_ff + EMBD_FACTOR * n_embd)) + per_slot
            activation = max(int(4 * t * time_mix * n_embd) + RWKV_STATE_COPIES * per_slot, swiglu)
    scores = 0
    if attention and not flash_attn:
        n_head = max(layer.n_head for layer in attention)
        kv_width = max(layer.k_width for layer in attention)
        n_kv = max(shape.swa_cells if layer.swa else shape.n_ctx_seq for layer in attention)
        score_rows = SCORE_EMBD_FACTOR - fewer_embd_rows
        scores = 4 * n_kv * t * n_head + 4 * t * (score_rows * n_embd + SCORE_KV_FACTOR * kv_width)
    if not with_output:
        output = 0
    elif pooled:
        output = _pooled_output_stage(geometry, t, flash_attn=flash_attn)
    else:
        output = _output_stage(geometry, t, n_outputs)
    return max(activation, scores, output)


def _output_stage(geometry: ModelGeometry, n_ubatch: int, n_outputs: int) -> int:
    """The logits of the reserved outputs plus two embedding-sized rows per token."""
    return 4 * geometry.n_vocab * n_outputs + 4 * n_ubatch * 2 * geometry.n_embd


def _pooled_output_stage(geometry: ModelGeometry, n_ubatch: int, *, flash_attn: bool) -> int:
    """An embedding or rerank graph's end: every token's logits above its normed hidden state and the rows
    the last layer left (`POOLED_OUTPUT_EMBD_ROWS`). The pooled vectors themselves are one per sequence."""
    return 4 * n_ubatch * (geometry.n_vocab + POOLED_OUTPUT_EMBD_ROWS[flash_attn] * geometry.n_embd)


def _masks(layers: list[LayerGeometry], shape: ContextShape, *, flash_attn: bool) -> int:
    element = 2 if flash_attn else 4
    total = 0
    if any(not layer.swa for layer in layers):
        total += element * shape.n_ctx_seq * shape.n_ubatch
    if any(layer.swa for layer in layers):
        total += element * shape.swa_cells * shape.n_ubatch
    return total


def split_compute_buffers(
    geometry: ModelGeometry,
    shape: ContextShape,
    devices: Sequence[int],
    *,
    flash_attn: bool,
    n_outputs: int,
) -> dict[int, int]:
    """The modelled compute buffer of each device of a split over RPC devices (compute-9), by device index of
    `devices` (a block's device, then the output layer's, as `weights.layer_devices` gives them; -1 the host).

    `ggml_backend_sched` gives each device the part of the graph whose weights it holds, and copies into it the
    inputs that part reads. The host creates every graph input, so its buffer holds every mask, beside the
    stage of its own blocks (the token embedding rows with them). A member holds its blocks' stage without
    the host's input rows (`REMOTE_FEWER_EMBD_ROWS`) and a copy of the masks its attention layers read; with a
    single dense block, its mask is freed after the attention, before the FFN rows are placed
    (`SINGLE_BLOCK_*`). The output stage is on the output layer's device. Measured on dense, SWA and hybrid
    tiny models, 1-3 members, 1-4 slots, flash attention on and off (`tests/e2e/test_memory_exact_rpc.py`).
    """
    t = shape.n_ubatch
    loaded = [layer for layer in geometry.layers if not layer.nextn]
    out_dev = devices[geometry.n_layer]
    result: dict[int, int] = {}
    for dev in sorted(set(devices)):
        blocks = [layer for layer in loaded if devices[layer.index] == dev]
        has_output = dev == out_dev
        if dev < 0:
            attention = [layer for layer in loaded if layer.attention]
            masks = _masks(attention, shape, flash_attn=flash_attn)
            if not blocks:
                result[dev] = masks + 4 * t * HOST_EMBD_FACTOR * 2 * geometry.n_embd
                continue
            result[dev] = masks + _layer_peak(
                geometry, blocks, shape, flash_attn=flash_attn, n_outputs=n_outputs, with_output=has_output
            )
            continue
        if not blocks:
            if has_output:
                result[dev] = _output_stage(geometry, t, n_outputs)
            continue
        masks = _masks([layer for layer in blocks if layer.attention], shape, flash_attn=flash_attn)
        first = blocks[0]
        if len(blocks) == 1 and flash_attn and first.attention and not first.recurrent and not first.n_ff_exp:
            attention_stage = masks + 4 * t * SINGLE_BLOCK_ATTENTION_ROWS * geometry.n_embd
            ffn_stage = 4 * t * (SINGLE_BLOCK_FFN_ROWS * first.n_ff + SINGLE_BLOCK_ATTENTION_ROWS * geometry.n_embd)
            output = _output_stage(geometry, t, n_outputs) if has_output else 0
            result[dev] = max(attention_stage, ffn_stage, output)
            continue
        result[dev] = masks + _layer_peak(
            geometry, blocks, shape, flash_attn=flash_attn, n_outputs=n_outputs,
            fewer_embd_rows=REMOTE_FEWER_EMBD_ROWS, with_output=has_output,
        )  # fmt: skip
    return result


def compute_buffers(
    geometry: ModelGeometry,
    shape: ContextShape,
    *,
    flash_attn: bool,
    n_outputs: int,
    draft_shape: ContextShape | None = None,
    offloaded: bool = False,
    pooled: bool = False,
) -> ComputeEstimate:
    """The modelled compute buffers of the target context (and of the MTP context, if `draft_shape`).
    `pooled`: an embedding or rerank server's graph, every token an output."""
    trunk = [layer for layer in geometry.layers if not layer.nextn]
    attention = [layer for layer in trunk if layer.attention]
    target = _masks(attention, shape, flash_attn=flash_attn) + _layer_peak(
        geometry, trunk, shape, flash_attn=flash_attn, n_outputs=n_outputs, pooled=pooled
    )
    draft = 0
    if draft_shape is not None:
        nextn = [layer for layer in geometry.layers if layer.nextn]
        gated = qwen35_graph.gated_mtp_draft(geometry, nextn, draft_shape) if flash_attn else None
        draft = (
            gated
            if gated is not None
            else _masks(nextn, draft_shape, flash_attn=flash_attn)
            + _layer_peak(geometry, nextn, draft_shape, flash_attn=flash_attn, n_outputs=draft_shape.n_seq_max)
        )
    host = 4 * shape.n_ubatch * HOST_EMBD_FACTOR * geometry.n_embd if offloaded else 0
    return ComputeEstimate(device=target, host=host, draft=draft)
