"""Compute-buffer model (placement core).

llama.cpp reserves its compute buffers by allocating a worst-case graph (`sched_reserve`): the buffer is the
peak of live intermediate tensors under ggml-alloc's reuse, which has no closed form. This module models it
from the terms that dominate that peak, each derived from the graph llama.cpp builds, with coefficients
calibrated on llama-server's own reports (`sched_reserve: … compute buffer size`):

* the attention masks, live for the whole graph: f16 (flash attention) or f32 `n_kv x n_ubatch` per KV
  cache (a sliding-window model has a second, window-sized mask);
* the peak of one layer, whichever stage is larger:
  - the activation stage, `4 · n_ubatch · (rows + 5 · n_embd)` bytes: the FFN's rows live with the residual
    stream. A dense SwiGLU FFN has `3 · n_ff` (gate, up and their product). A routed mixture of experts
    (`build_moe_ffn`) has those for each of the `U` experts a token uses, `3 · U · n_ff_exp`, plus the
    experts' n_embd-wide outputs, `U · n_embd`, unless ggml-alloc puts them where gate and up were (when
    `U · n_embd <= 2 · U · n_ff_exp`); expert rows no wider than n_embd in all sit in blocks the attention
    freed (measured on qwen3moe and gpt-oss only); nemotron's ungated experts have one row each. For
    Mamba-style layers the stage is `3.5 ·` their input projection width, plus one state copy per
    sequence; for RWKV `max(20 · n_embd, 2 · n_ff)` per token plus two state copies per sequence;
  - without flash attention, the attention-score stage: the f32 `n_kv x n_ubatch x n_head` score matrix
    plus `4 · n_ubatch · (7 · n_embd + 2 · n_kv_width)`;
  - the output stage: logits for the reserved outputs plus two embedding-sized rows per token.

Calibration: 608 llama-server runs of llama, gemma3, qwen35 (with and without MTP), granitehybrid and mamba2
shapes (n_embd 64-1024, n_ff 128-3072, contexts 1024/4096, micro-batches 128/512, 1 and 4 slots, unified
and per-slot KV, flash attention on and off). Measured error (CPU build): mean 1-10% per family, worst
+24% (a tiny MTP draft context, overestimated) and -19% (tiny shapes with n_ff < n_embd); on the sparse
realistic shapes of `benchmarks/accuracy.py` (Llama-8B at 16k context and 2 slots: 132 MiB with flash
attention, 580 MiB without; Qwen3.5-9B with MTP) it is within -0.0%..+15.4%. `MEASURED_ERROR_RATIO`
bounds all of it. The families of `tests/e2e/test_memory_exact_more.py` (qwen2/3, qwen3moe, gemma2, cohere2,
gpt-oss, nemotron_h, lfm2, falcon-h1, jamba, qwen3next, mamba, rwkv7, deepseek2) were checked afterwards at
n_ff of about 3 · n_embd: within ±10%; the RWKV and jamba terms were fitted then (rwkv7 n_embd 128-512,
n_ff 256-2048, 1-16 slots: within +3%; jamba within -6%).

The routed-expert rows (compute-4) were fitted on 450 runs of qwen3moe, gpt-oss, qwen35moe, qwen3next,
glm4moe, deepseek2, nemotron_h_moe and jamba (n_embd 512-2880, n_ff_exp n_embd/8 to n_embd, 2/4/8 experts
used, one slot, 1024 cells, sparse weights): within -7%..+6% except the two hybrids at n_embd 512, where
their gated-delta-net stage (not modelled) sets the peak (down to -41%, qwen3next with 2 experts of 64).
On the widths of released models (Qwen3-30B-A3B, gpt-oss-20b, Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B,
GLM-4.5-Air, DeepSeek-V2-Lite, Nemotron-3-Nano, Jamba-mini; 8 experts, a few blocks, 8192 cells) it is
exact to 0.1% except Nemotron-3-Nano with 4 slots (-7.6%); the dense n_ff used before was off by -8% to
-63% there (gpt-oss-20b -48%). `MEASURED_ERROR_RATIO` bounds those and the e2e cases; the hybrid outliers
above are shapes where a stage the model lacks makes the peak. A geometry encoded before expert widths
existed is sized as before.
compute-5 adds the recurrent stage `sched_reserve` reaches with one sequence per slot: each slot's state
gathered and written back (two copies per slot) beside n_embd-wide rows per token (14.6 for Mamba-style,
9.8 for gated delta nets), and nemotron_h's ungated MLP (2 rows). Fitted on Qwen3.5-9B and Mamba2-2.7B
widths at 1-32 slots; on the hold-out realistic shapes of `benchmarks/compute_shapes.py` (Qwen3.5-27B,
Falcon-H1-1.5B, Nemotron-H-9B, Gemma3-12B, Qwen3-8B) within -3.6%..+10.3%; the MTP draft context of
Qwen3.5-9B is over by 15.4%.
Warm-up routes every expert; the runner disables it (`--no-warmup`), so it is not modelled.
GPU compute buffers (per-device graph splits, the host-side buffer) are not validated: no GPU build was
available.
"""

from __future__ import annotations

from dataclasses import dataclass

from messages.memory import ContextShape
from messages.model import LayerGeometry, ModelGeometry

__all__ = ["CALIBRATION_VERSION", "MEASURED_ERROR_RATIO", "ComputeEstimate", "compute_buffers"]

CALIBRATION_VERSION = "compute-5"
#: Largest relative error of the model against llama-server's reported compute buffers in calibration.
MEASURED_ERROR_RATIO = 0.25

FFN_FACTOR = 3  # gate, up and their product, n_ff wide, live at once
EMBD_FACTOR = 5  # residual stream, FFN input, norm output and two more n_embd-wide rows
MAMBA_IN_FACTOR = 3.5  # input projection, conv window and scan output of a Mamba layer, per input width
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
RECURRENT_STAGE_EMBD = {"mamba": 14.6, "gated_delta": 9.8}
#: nemotron_h's MLP blocks are ungated (squared ReLU): up and its activation, no gate.
UNGATED_FFN_FACTOR = 2
RWKV_EMBD_FACTOR = 20  # n_embd-wide rows live at the peak of an RWKV-7 time mix, per token
RWKV_FFN_FACTOR = 2  # an RWKV channel mix keeps two n_ff-wide rows (no gate)
RWKV_STATE_COPIES = 2  # the wkv state read and written per sequence
SCORE_EMBD_FACTOR = 7
SCORE_KV_FACTOR = 2
HOST_EMBD_FACTOR = 2  # with GPUs: token embeddings looked up on the host, and their copy for upload


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


def _layer_peak(
    geometry: ModelGeometry,
    layers: list[LayerGeometry],
    shape: ContextShape,
    *,
    flash_attn: bool,
    n_outputs: int,
) -> int:
    t = shape.n_ubatch
    n_embd = geometry.n_embd
    attention = [layer for layer in layers if layer.attention or layer.nextn]
    if any(layer.n_ff_exp for layer in geometry.layers):
        ffn_rows = max((_ffn_rows(geometry, layer) for layer in layers), default=0)
    else:
        # a dense nemotron_h MLP is ungated; a MoE geometry without expert widths is sized as it was before
        ungated = geometry.architecture in UNGATED_EXPERTS and not geometry.n_expert
        ffn_rows = (UNGATED_FFN_FACTOR if ungated else FFN_FACTOR) * _legacy_n_ff(geometry, layers)
    activation = 4 * t * (ffn_rows + EMBD_FACTOR * n_embd)
    if geometry.recurrent_kind == "mamba" and any(layer.recurrent for layer in layers):
        width = 2 * geometry.ssm_d_inner + 2 * geometry.ssm_n_group * geometry.ssm_d_state + geometry.ssm_dt_rank
        state = max(layer.r_width + layer.s_width for layer in layers if layer.recurrent)
        mamba = int(4 * t * MAMBA_IN_FACTOR * width) + 4 * shape.n_seq_max * state
        activation = max(activation, mamba)
    stage_embd = RECURRENT_STAGE_EMBD.get(geometry.recurrent_kind)
    if stage_embd is not None and any(layer.recurrent for layer in layers):
        state = max(layer.r_width + layer.s_width for layer in layers if layer.recurrent)
        stage = int(4 * t * stage_embd * n_embd) + RECURRENT_STATE_COPIES * 4 * shape.n_seq_max * state
        activation = max(activation, stage)
    if geometry.recurrent_kind == "rwkv" and any(layer.recurrent for layer in layers):
        # the time mix (six lerped inputs, r/w/k/v/a/g and their LoRA paths) or the channel mix (key and its
        # squared ReLU, n_ff wide), whichever is larger, plus the wkv state read and written per sequence
        state = max(layer.r_width + layer.s_width for layer in layers if layer.recurrent)
        n_ff = max(layer.n_ff for layer in layers)
        mix = max(RWKV_EMBD_FACTOR * n_embd, RWKV_FFN_FACTOR * n_ff)
        activation = 4 * t * mix + RWKV_STATE_COPIES * 4 * shape.n_seq_max * state
    scores = 0
    if attention and not flash_attn:
        n_head = max(layer.n_head for layer in attention)
        kv_width = max(layer.k_width for layer in attention)
        n_kv = max(shape.swa_cells if layer.swa else shape.n_ctx_seq for layer in attention)
        scores = 4 * n_kv * t * n_head + 4 * t * (SCORE_EMBD_FACTOR * n_embd + SCORE_KV_FACTOR * kv_width)
    output = 4 * geometry.n_vocab * n_outputs + 4 * t * 2 * n_embd
    return max(activation, scores, output)


def _masks(layers: list[LayerGeometry], shape: ContextShape, *, flash_attn: bool) -> int:
    element = 2 if flash_attn else 4
    total = 0
    if any(not layer.swa for layer in layers):
        total += element * shape.n_ctx_seq * shape.n_ubatch
    if any(layer.swa for layer in layers):
        total += element * shape.swa_cells * shape.n_ubatch
    return total


def compute_buffers(
    geometry: ModelGeometry,
    shape: ContextShape,
    *,
    flash_attn: bool,
    n_outputs: int,
    draft_shape: ContextShape | None = None,
    offloaded: bool = False,
) -> ComputeEstimate:
    """The modelled compute buffers of the target context (and of the MTP context, if `draft_shape`)."""
    trunk = [layer for layer in geometry.layers if not layer.nextn]
    attention = [layer for layer in trunk if layer.attention]
    target = _masks(attention, shape, flash_attn=flash_attn) + _layer_peak(
        geometry, trunk, shape, flash_attn=flash_attn, n_outputs=n_outputs
    )
    draft = 0
    if draft_shape is not None:
        nextn = [layer for layer in geometry.layers if layer.nextn]
        draft = _masks(nextn, draft_shape, flash_attn=flash_attn) + _layer_peak(
            geometry, nextn, draft_shape, flash_attn=flash_attn, n_outputs=draft_shape.n_seq_max
        )
    host = 4 * shape.n_ubatch * HOST_EMBD_FACTOR * geometry.n_embd if offloaded else 0
    return ComputeEstimate(device=target, host=host, draft=draft)
