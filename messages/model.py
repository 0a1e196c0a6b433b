"""Model geometry: every fact about a GGUF model that the memory model needs, taken from its header.

A `ModelGeometry` is pure data: it can be computed from the file (`actors.placement.geometry`), or carried by a
signed registry entry so that a node can be admitted without reading the file. Widths are in elements per
KV cell (K, V) or per recurrent cell (R, S), exactly as llama.cpp sizes its cache tensors; byte sizes of the
weights are the tensor bytes the header declares.

Fields added after the first release have defaults that mean "not known", and both structs omit fields
equal to their defaults when encoded: an entry signed before a field existed decodes, re-encodes to the
bytes that were signed (so its signature still verifies), and is sized as it was then.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]

#: How a sliding-window layer masks (llama.cpp `llama_swa_type`); the cache size does not depend on it.
SwaType = Literal["none", "standard", "chunked", "symmetric"]
#: How llama.cpp builds the model's memory: attention KV only, KV plus recurrent state, or recurrent only.
MemoryKind = Literal["kv", "hybrid", "recurrent"]
#: What a recurrent layer computes; it shapes the compute buffer, not the state size.
RecurrentKind = Literal["none", "mamba", "gated_delta", "rwkv", "shortconv"]
#: The pooling type a header declares (`{arch}.pooling_type`, llama.cpp's `llama_pooling_type`); "" when none.
HeaderPooling = Literal["", "none", "mean", "cls", "last", "rank"]


class RepackGroup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Weights of one ggml type that llama.cpp's CPU backend may copy out of the mapped file into one of its
    extra buffers, `CPU_REPACK` or `AMX` (see `actors.placement.weights`).

    The weights a matrix multiplication reads (2-D, or 3-D expert stacks), grouped by type, by `rows_multiple`,
    the greatest power of two up to 16 dividing their row count (`ne[1]`), which is what the repack kernels
    check, and by whether the AMX kernels take them. `bytes` is the sum of their sizes each rounded up to 32
    bytes, as a CPU buffer holds them; `amx_bytes` their sum in the AMX buffer (the AMX layout, each rounded up
    to 32 bytes) on a CPU with AMX, 0 when the AMX kernels do not take them (or for a geometry encoded before).
    """

    type: str  # ggml type name in lower case, e.g. "q4_k"
    rows_multiple: Annotated[int, msgspec.Meta(ge=1, le=16)]
    count: NonNegative
    bytes: NonNegative
    amx_bytes: NonNegative = 0


class MappedEdge(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One tensor at an end of the file's tensor data, before (or after) the first (last) tensor that the CPU
    backend always keeps in the mapped file: the mapped buffer spans from the first to the last tensor it keeps,
    so each of these leaves it when the CPU backend copies it elsewhere (`group` says when) or, for a `nextn`
    block's tensor, when the MTP layers are not loaded."""

    bytes: NonNegative
    nextn: bool = False
    group: RepackGroup | None = None  # the tensor as a group of one; None: a tensor never copied


class LayerGeometry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One block (`blk.<index>.*`) of the model.

    `k_width`/`v_width` are llama.cpp's `n_embd_k_gqa(il)`/`n_embd_v_gqa(il)` (head size times KV heads) even for
    a layer that gets no KV cache, because the non-flash-attention V cache is padded to the widest layer.
    `attention` says the layer holds KV cells in the target (serving) context; a `nextn` (MTP) block holds
    its KV in the MTP draft context instead. `recurrent` says it holds a recurrent state of
    `r_width + s_width` f32 elements per cell. A layer may have both (falcon-h1) or neither (an MLP-only
    layer of nemotron_h).

    `head_k`/`head_v` are llama.cpp's `n_embd_head_k(il)`/`n_embd_head_v(il)`, which it checks against a
    quantized cache's block size even where the layer caches no V (an MLA model's V head is its
    kv_lora_rank, a view of the K latent) or has no KV heads. `n_ff_exp` and `n_expert_used` describe a
    routed mixture-of-experts FFN: each of the `n_expert_used` experts a token is routed to is `n_ff_exp`
    wide. All four are 0 when unknown (a geometry encoded before they existed); `n_ff_exp` is also 0 for a
    dense FFN, which is `n_ff` wide. `repack` lists the quantized weights the CPU backend may repack
    (empty for a float model, and for a geometry encoded before it existed).
    """

    index: NonNegative
    attention: bool
    recurrent: bool
    swa: bool
    nextn: bool
    n_head: NonNegative
    n_head_kv: NonNegative
    k_width: NonNegative
    v_width: NonNegative  # 0 for MLA models: they cache K only
    r_width: NonNegative
    s_width: NonNegative
    n_ff: NonNegative
    tensor_bytes: NonNegative
    # The same tensors each rounded up to 32 bytes, as a buffer they are copied into holds them (an RPC device's;
    # the host maps them from the file instead); 0: unknown (a geometry encoded before it existed).
    padded_bytes: NonNegative = 0
    head_k: NonNegative = 0  # n_embd_head_k(il); 0: unknown
    head_v: NonNegative = 0  # n_embd_head_v(il), an MLA model's kv_lora_rank; 0: unknown
    n_ff_exp: NonNegative = 0  # width of each routed expert; 0: a dense FFN (or unknown)
    n_expert_used: NonNegative = 0  # experts each token is routed to in this layer; 0 with n_ff_exp 0
    repack: tuple[RepackGroup, ...] = ()  # quantized matmul weights the CPU backend may repack; () if none


class ModelGeometry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Everything the memory model needs from a GGUF header, for one architecture family."""

    architecture: str
    memory: MemoryKind
    n_layer: NonNegative  # block_count, nextn layers included
    n_layer_nextn: NonNegative
    n_embd: NonNegative
    n_vocab: NonNegative
    longest_token_bytes: NonNegative = 0  # the longest token's text (0: unknown): bounds the text a token covers
    n_ctx_train: NonNegative
    n_expert: NonNegative
    n_expert_used: NonNegative
    swa_type: SwaType
    n_swa: NonNegative  # sliding window in tokens; 0 when no layer slides
    mla: bool  # K-only cache (DeepSeek-style multi-head latent attention)
    rollback: bool  # the architecture keeps per-token recurrent snapshots for speculative rollback
    mtp_context: bool  # `--spec-type draft-mtp` creates a draft context over the nextn layers
    recurrent_kind: RecurrentKind
    ssm_d_inner: NonNegative  # SSM hyperparameters (0 when absent), used by the compute-buffer model
    ssm_d_state: NonNegative
    ssm_n_group: NonNegative
    ssm_dt_rank: NonNegative
    layers: tuple[LayerGeometry, ...]
    # Tensor bytes outside blk.N: input tensors (token embeddings) stay on the host; output tensors follow
    # the output layer's device. `tied_output` means the output matrix is the token embedding matrix, which
    # llama.cpp duplicates onto the output device when that is not the host.
    input_tensor_bytes: NonNegative
    output_tensor_bytes: NonNegative
    tied_output: bool
    token_embd_bytes: NonNegative
    file_size: NonNegative
    # The output tensors and token_embd with each tensor rounded up to 32 bytes, as an RPC device's buffer holds
    # them (0: unknown, a geometry encoded before they existed).
    output_padded_bytes: NonNegative = 0
    token_embd_padded_bytes: NonNegative = 0
    # quantized matmul weights of the output layer (output.weight, or the tied token embeddings that
    # llama.cpp duplicates as the output matrix) that the CPU backend may repack
    output_repack: tuple[RepackGroup, ...] = ()
    # The tensors at the start and at the end of the file's tensor data, in file order from each end, up to the
    # first one always kept in the mapped file (() : none, or a geometry encoded before they existed)
    mapped_head: tuple[MappedEdge, ...] = ()
    mapped_tail: tuple[MappedEdge, ...] = ()
    # An embedding or rerank model: the pooling type its header declares ("" when none), the width of its output
    # embeddings (`embedding_length_out`; 0: n_embd), and whether it has a classification head (`cls`,
    # `cls.output`), which rank pooling scores with (without one llama.cpp ranks by a raw hidden state).
    pooling: HeaderPooling = ""
    n_embd_out: NonNegative = 0
    rank_head: bool = False


#: The projector types the memory model sizes (`clip.projector_type`): LLaVA's two-layer MLP.
ProjectorType = Literal["mlp"]


class ProjectorGeometry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Everything the memory model needs from a multimodal projector's header (`--mmproj`, a `clip` GGUF).

    A LLaVA projector is a CLIP vision tower (`n_layer` transformer blocks `n_embd` wide, `n_ff` wide FFNs,
    over the patches of an `image_size` square image cut into `patch_size` squares, plus a class token
    when `class_embedding`) and a two-layer MLP (`mm_hidden` wide, then `n_mmproj_embd`, which must be the
    text model's n_embd). `tensor_bytes` is the sum of its tensors' sizes, what llama-server prints as its
    model size; `buffer_bytes` those sizes each rounded up to 32 bytes, the CPU buffer the loader reads
    them into (it does not map the file). `patch_kernel_type` is the patch embedding's ggml type (in
    lower case), which decides the type of the convolution's unrolled input.
    """

    projector_type: ProjectorType
    n_embd: Annotated[int, msgspec.Meta(ge=1)]
    n_head: Annotated[int, msgspec.Meta(ge=1)]
    n_ff: Annotated[int, msgspec.Meta(ge=1)]
    n_layer: Annotated[int, msgspec.Meta(ge=1)]
    image_size: Annotated[int, msgspec.Meta(ge=1, le=8192)]
    patch_size: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    mm_hidden: Annotated[int, msgspec.Meta(ge=1)]
    n_mmproj_embd: Annotated[int, msgspec.Meta(ge=1)]
    class_embedding: bool
    pre_norm: bool
    post_norm: bool
    patch_kernel_type: str
    tensor_bytes: NonNegative
    buffer_bytes: NonNegative
    n_tensors: NonNegative
    file_size: NonNegative
