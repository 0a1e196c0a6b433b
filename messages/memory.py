"""Memory breakdown: what a llama-server instance allocates, per device and in total (`mesh.placement.fit`).

Produced by the memory model (`actors.placement.memory`) and printed by `mesh-actor fit --json`. Every size
is an integer count of bytes. `kv_bytes`, `recurrent_bytes` and `draft_kv_bytes` are exact (the sums of
llama.cpp's cache tensor sizes), and so are `repack_bytes` and `amx_bytes` (the CPU backend's copies of
weights) for a node whose CPU features are known; `compute_bytes` is a model of llama.cpp's graph
reservation, and `compute_margin_bytes` is the measured bound of that model's error
(`compute_error_ratio` times `compute_bytes`, per device), counted in every total that admission compares.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class DeviceMemory(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one device holds. The host is the device named "CPU"; GPUs are "GPU0", "GPU1", ….

    `kv_bytes`/`recurrent_bytes`/`draft_kv_bytes` here are buffer sizes (tensor sizes rounded up to the
    device's alignment), so they may exceed the exact tensor sums by a few bytes per tensor.
    """

    device: str
    weights_bytes: NonNegative
    kv_bytes: NonNegative
    recurrent_bytes: NonNegative
    draft_kv_bytes: NonNegative
    compute_bytes: NonNegative
    output_bytes: NonNegative  # logits/embeddings output buffer (host)
    repack_bytes: NonNegative = 0  # CPU_REPACK model buffer (host): repacked copies of quantized weights
    amx_bytes: NonNegative = 0  # AMX model buffer (host, a CPU with AMX): the AMX kernels' copies of weights
    compute_margin_bytes: NonNegative = 0  # the measured compute error bound: ceil(ratio x compute_bytes)
    draft_weights_bytes: NonNegative = 0  # the draft model's tensors placed here (`--model-draft`)
    projector_weights_bytes: NonNegative = 0  # the multimodal projector's tensors (`--mmproj`)
    host_extra_bytes: NonNegative  # context checkpoints and prompt cache (host)
    total_bytes: NonNegative
    layers: tuple[int, int] | None = None  # [first, last) block indices placed here
    budget_bytes: NonNegative | None = None
    fits: bool | None = None


class ContextShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The context llama.cpp derives from the settings (after its own padding and rounding)."""

    n_ctx: NonNegative  # total cells of the non-SWA cache over all streams (llama.cpp's n_ctx)
    n_ctx_seq: NonNegative  # cells one slot can use
    n_seq_max: NonNegative  # slots
    n_stream: NonNegative  # KV streams: 1 when unified, else one per slot
    n_rs_seq: NonNegative  # speculative rollback rows per recurrent cell
    n_ubatch: NonNegative
    swa_cells: NonNegative  # cells per stream of the sliding-window cache (0 when the model has none)


class MemoryBreakdown(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The estimate for one model under one set of serving settings."""

    estimator_version: str
    llama_cpp_version: str
    architecture: str
    context: ContextShape
    kv_bytes: NonNegative  # target context KV cache (K + V), exact
    kv_k_bytes: NonNegative
    kv_v_bytes: NonNegative
    kv_swa_bytes: NonNegative  # part of kv_bytes held by sliding-window layers
    recurrent_bytes: NonNegative  # recurrent state (R + S), exact
    draft_kv_bytes: NonNegative  # MTP / draft context KV, exact; 0 without one
    # tensor bytes as the file declares them (mapped, not copied, on the host, where the mapped span leaves out
    # the weights at either end of the file that the CPU backend copies into its repack or AMX buffer)
    weights_bytes: NonNegative
    compute_bytes: NonNegative  # modelled, see compute_error_ratio
    output_bytes: NonNegative
    host_extra_bytes: NonNegative
    total_bytes: NonNegative
    devices: tuple[DeviceMemory, ...]
    compute_error_ratio: float  # largest relative error of the compute model seen in validation
    repack_bytes: NonNegative = 0  # CPU_REPACK buffer, see DeviceMemory
    amx_bytes: NonNegative = 0  # AMX buffer, see DeviceMemory
    compute_margin_bytes: NonNegative = 0  # sum of the devices' compute margins, included in total_bytes
    # A draft model (`--model-draft`): its tensor bytes as its file declares them, exact; the parts of
    # repack_bytes, amx_bytes and output_bytes that are its own (its copied weights; its context's logits, also an
    # MTP context's). Its context's KV is draft_kv_bytes.
    draft_weights_bytes: NonNegative = 0
    draft_repack_bytes: NonNegative = 0
    draft_amx_bytes: NonNegative = 0
    draft_output_bytes: NonNegative = 0
    # A multimodal projector (`--mmproj`): its tensor bytes, exact, and the part of compute_bytes that is its
    # graph (modelled; llama-server allocates it at the first image when it starts without a warm-up).
    projector_weights_bytes: NonNegative = 0
    projector_compute_bytes: NonNegative = 0
    fits: bool | None = None
    max_context: NonNegative | None = None
