"""What llama-server accepts and the context it builds from the serving settings (placement core).

This module owns the settings side of the memory model: the cache element types and their row sizes, the
speculative types and their draft lengths, the refusals llama-server would make (`validate`), and the
context shape `llama_context` derives (`resolve_context`): n_ctx padded to 256, per-slot streams or one
unified stream, the sliding-window cache size, rollback rows and the effective micro-batch (an embedding or
rerank server's holds a whole input: `actors.placement.pooled`). Pure core.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from actors.placement import pooled
from messages.memory import ContextShape
from messages.model import LayerGeometry, ModelGeometry
from messages.settings import ServingSettings

__all__ = [
    "CACHE_TYPES",
    "CELL_PAD",
    "DRAFT_MODEL_SPEC_TYPES",
    "LLAMA_MAX_SEQ",
    "NGRAM_SPEC_N_MAX",
    "ROLLBACK_SPEC_TYPES",
    "SPEC_TYPES",
    "SPEC_VOCAB_MAX_SIZE_DIFFERENCE",
    "MemoryModelError",
    "cache_row_bytes",
    "draft_model_settings",
    "draft_settings",
    "resolve_context",
    "spec_n_max",
    "spec_types",
    "validate",
]

CELL_PAD = 256  # llama.cpp pads n_ctx, n_ctx_seq and the SWA cache to 256 cells
LLAMA_MAX_SEQ = 256

#: KV cache element types llama-server accepts: (elements per block, bytes per block).
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "iq4_nl": (32, 18),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
}

#: Speculative types that make llama.cpp keep per-token recurrent snapshots (`need_n_rs_seq`).
ROLLBACK_SPEC_TYPES = frozenset({"draft-mtp", "draft-eagle3", "draft-dflash", "draft-dspark"})
#: Speculative types that need a separate draft model file. The memory model sizes "draft-simple" with a
#: draft model given (`DRAFT_SIMPLE`); the others read special draft heads it does not size.
DRAFT_MODEL_SPEC_TYPES = frozenset({"draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark"})
DRAFT_SIMPLE = "draft-simple"
#: How far a draft model's vocabulary size may be from the model's (`common_speculative_are_compatible`).
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
#: Draft lengths (`common_speculative_n_max`) of the n-gram speculators at llama-server's defaults.
NGRAM_SPEC_N_MAX = {"ngram-simple": 48, "ngram-map-k": 48, "ngram-map-k4v": 48, "ngram-mod": 64, "ngram-cache": 8}
SPEC_TYPES = frozenset({"none", "draft-mtp"} | DRAFT_MODEL_SPEC_TYPES | set(NGRAM_SPEC_N_MAX))


class MemoryModelError(ValueError):
    """The settings are ones llama-server would refuse for this model, or that this model cannot size."""


def cache_row_bytes(cache_type: str, width: int) -> int:
    """`ggml_row_size(type, width)`: bytes of one cache row of `width` elements."""
    try:
        block, size = CACHE_TYPES[cache_type]
    except KeyError:
        raise MemoryModelError(f"unknown cache type {cache_type!r} (accepted: {', '.join(CACHE_TYPES)})") from None
    if width % block:
        raise MemoryModelError(f"a row of {width} elements is not a multiple of {cache_type}'s block of {block}")
    return width // block * size


def pad(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def spec_types(settings: ServingSettings) -> tuple[str, ...]:
    """The speculative types in effect ("none" removed), refusing unknown ones."""
    types = tuple(t.strip() for t in settings.spec_type.split(",") if t.strip())
    for t in types:
        if t not in SPEC_TYPES:
            raise MemoryModelError(f"unknown speculative type {t!r} (accepted: {', '.join(sorted(SPEC_TYPES))})")
    return tuple(t for t in types if t != "none")


def spec_n_max(settings: ServingSettings, types: Sequence[str]) -> int:
    """The longest draft any of the speculators proposes (what the output buffer must hold per slot)."""
    n = 0
    for t in types:
        n = max(n, settings.spec_draft_n_max if t.startswith("draft-") else NGRAM_SPEC_N_MAX[t])
    return n


def resolve_context(geometry: ModelGeometry, settings: ServingSettings, n_ctx: int) -> ContextShape:
    """The context llama.cpp builds from `-c n_ctx` and the settings (`llama_context` constructor)."""
    if n_ctx <= 0:
        raise MemoryModelError("the context size must be positive (llama-server's -c 0 means the trained size)")
    n_seq = settings.slots
    if n_seq > LLAMA_MAX_SEQ:
        raise MemoryModelError(f"llama.cpp supports at most {LLAMA_MAX_SEQ} slots, got {n_seq}")
    # causal models cap the batch at the requested context before it is padded
    n_batch = min(n_ctx, settings.batch)
    n_ubatch = min(n_batch, settings.ubatch)
    padded = pad(n_ctx, CELL_PAD)
    if settings.kv_unified:
        n_ctx_seq = padded
        n_stream = 1
    else:
        n_ctx_seq = pad(padded // n_seq, CELL_PAD)
        if n_ctx_seq == 0:
            raise MemoryModelError("n_ctx_seq == 0")
        padded = n_ctx_seq * n_seq
        n_stream = n_seq
    refused = pooled.refusal(geometry, settings)
    if refused is not None:
        raise MemoryModelError(refused)
    if settings.kind in pooled.POOLED_KINDS:
        # an embedding or rerank server's batch holds a whole input: the per-slot context, within -c
        n_ubatch = min(n_ctx, n_ctx_seq)
    types = spec_types(settings)
    rollback = any(t in ROLLBACK_SPEC_TYPES for t in types) and geometry.rollback
    n_rs_seq = settings.spec_draft_n_max if rollback else 0
    if not any(layer.recurrent for layer in geometry.layers):
        n_rs_seq = 0  # an empty recurrent memory disables its rollback rows
    swa_cells = 0
    if geometry.swa_type != "none":
        swa_cells = _swa_cells(geometry, settings, n_ctx_seq, n_seq, n_ubatch)
    return ContextShape(
        n_ctx=padded,
        n_ctx_seq=n_ctx_seq,
        n_seq_max=n_seq,
        n_stream=n_stream,
        n_rs_seq=n_rs_seq,
        n_ubatch=n_ubatch,
        swa_cells=swa_cells,
    )


def _swa_cells(geometry: ModelGeometry, settings: ServingSettings, n_ctx_seq: int, n_seq: int, n_ubatch: int) -> int:
    """`llama_kv_cache_iswa`: the window (times the slots when unified) plus a micro-batch, padded to 256."""
    if settings.swa_full:
        return n_ctx_seq
    window = geometry.n_swa * (n_seq if settings.kv_unified else 1) + n_ubatch
    return pad(min(n_ctx_seq, window), CELL_PAD)


def draft_settings(settings: ServingSettings) -> ServingSettings:
    """The MTP draft context's settings: the target's slots and cells, no speculation of its own."""
    return msgspec.structs.replace(settings, spec_type="none")


def draft_model_settings(settings: ServingSettings) -> ServingSettings:
    """A draft model's context (`common_base_params_to_speculative`): the target's slots, unified setting,
    batch sizes and flash attention, the draft cache types (-ctkd/-ctvd), no speculation of its own."""
    return msgspec.structs.replace(
        settings, spec_type="none", cache_type_k=settings.spec_draft_type_k, cache_type_v=settings.spec_draft_type_v
    )


def validate(geometry: ModelGeometry, settings: ServingSettings, draft: ModelGeometry | None = None) -> bool:
    """Refuses what llama-server would refuse; returns whether an MTP draft context is created. `draft` is
    the draft model's geometry (`--model-draft`), which only "draft-simple" speculation uses."""
    flash_attn = settings.flash_attn == "on"
    for name in ("cache_type_k", "cache_type_v", "spec_draft_type_k", "spec_draft_type_v"):
        if getattr(settings, name) not in CACHE_TYPES:
            raise MemoryModelError(f"unknown cache type {getattr(settings, name)!r} for {name}")
    if not flash_attn and CACHE_TYPES[settings.cache_type_v][0] > 1:
        raise MemoryModelError("a quantized V cache requires flash attention (llama-server refuses it)")
    types = spec_types(settings)
    unsized = sorted(t for t in types if t in DRAFT_MODEL_SPEC_TYPES and t != DRAFT_SIMPLE)
    if unsized:
        raise MemoryModelError(
            f"speculative type {unsized[0]!r} needs a special draft head, which this estimate does not size"
        )
    if DRAFT_SIMPLE in types and draft is None:
        raise MemoryModelError(f"speculative type {DRAFT_SIMPLE!r} needs a draft model (model.draft)")
    if draft is not None:
        _validate_draft(geometry, settings, draft, types)
    mtp = "draft-mtp" in types
    if mtp and not geometry.mtp_context:
        raise MemoryModelError(
            f"--spec-type draft-mtp needs MTP (nextn) layers; this {geometry.architecture} model has "
            f"{geometry.n_layer_nextn} (llama-server exits at start)"
        )
    if mtp and not flash_attn and CACHE_TYPES[settings.spec_draft_type_v][0] > 1:
        raise MemoryModelError("a quantized draft V cache requires flash attention")
    _validate_cache_types(geometry, settings.cache_type_k, settings.cache_type_v, flash_attn=flash_attn)
    if mtp:  # the MTP context is created by the same llama_init_from_model, with the draft types
        _validate_cache_types(geometry, settings.spec_draft_type_k, settings.spec_draft_type_v, flash_attn=flash_attn)
    return mtp


def _validate_draft(
    geometry: ModelGeometry, settings: ServingSettings, draft: ModelGeometry, types: Sequence[str]
) -> None:
    """What llama-server refuses or drops of a draft model: one it would not use (without "draft-simple", or
    beside an MTP context), draft cache types its heads cannot hold (the server exits), and a vocabulary it
    finds incompatible (the sizes may differ by at most 128 tokens; the tokens themselves are compared at
    start): then it frees the draft and serves without speculation, which is not what was admitted (the
    runner's check of `/slots` catches the token comparison). A draft with recurrent layers is refused too:
    its state is not sized here."""
    if DRAFT_SIMPLE not in types:
        raise MemoryModelError(f"a draft model is used only with spec_type {DRAFT_SIMPLE!r}")
    if "draft-mtp" in types:
        raise MemoryModelError("a draft model and draft-mtp cannot be combined (both want the draft context)")
    if draft.memory != "kv":
        raise MemoryModelError(
            f"the draft model is a {draft.memory} {draft.architecture} model: only attention-only drafts are sized"
        )
    difference = abs(geometry.n_vocab - draft.n_vocab)
    if difference > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        raise MemoryModelError(
            f"the draft model's vocabulary ({draft.n_vocab} tokens) is not the model's ({geometry.n_vocab}): "
            f"over {SPEC_VOCAB_MAX_SIZE_DIFFERENCE} apart, llama-server drops the draft and does not speculate"
        )
    flash_attn = settings.flash_attn == "on"
    if not flash_attn and CACHE_TYPES[settings.spec_draft_type_v][0] > 1:
        raise MemoryModelError("a quantized draft V cache requires flash attention")
    _validate_cache_types(draft, settings.spec_draft_type_k, settings.spec_draft_type_v, flash_attn=flash_attn)


def _validate_cache_types(geometry: ModelGeometry, type_k: str, type_v: str, *, flash_attn: bool) -> None:
    """`llama_init_from_model`'s checks of a context's cache types against the model's heads.

    An MLA model stores V as a view of K, so both must have one type. With flash attention, a quantized
    type's block must divide every trunk layer's K and V head size (the attention reads whole blocks per
    head), not just its row; an MLA model's V head size is its kv_lora_rank although it caches no V. A
    geometry encoded before head sizes were recorded gives them only for layers with KV heads (as widths
    over heads) and none for an MLA V head.
    """
    if geometry.mla and type_k != type_v:
        raise MemoryModelError(
            f"this {geometry.architecture} model caches MLA latents: K and V cache types must be equal "
            f"(got {type_k} and {type_v}; llama-server refuses them)"
        )
    if not flash_attn:
        return
    trunk = [layer for layer in geometry.layers if not layer.nextn]
    heads = (("K", type_k, {_head_k(layer) for layer in trunk}), ("V", type_v, {_head_v(layer) for layer in trunk}))
    for name, cache_type, sizes in heads:
        block = CACHE_TYPES[cache_type][0]
        for size in sorted(sizes):
            if size % block:
                raise MemoryModelError(
                    f"the {name} head size {size} is not a multiple of {cache_type}'s block of {block} "
                    f"(llama-server refuses a quantized {name} cache with flash attention)"
                )


def _head_k(layer: LayerGeometry) -> int:
    """llama.cpp's `n_embd_head_k(il)`, or 0 when the geometry does not say (nothing to check)."""
    if layer.head_k or not layer.n_head_kv:
        return layer.head_k
    return layer.k_width // layer.n_head_kv


def _head_v(layer: LayerGeometry) -> int:
    if layer.head_v or not layer.n_head_kv:
        return layer.head_v
    return layer.v_width // layer.n_head_kv
