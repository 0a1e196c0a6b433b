"""The caches llama-server allocates, byte for byte, and the host RAM they may grow into (placement core).

This module owns the KV cache of the target context and of the draft context (an MTP context over the model's
nextn blocks, or a draft model's own context) and the recurrent state:
exact sums of llama.cpp's cache tensor sizes, computed from the `ModelGeometry` the way `llama_kv_cache`,
`llama_kv_cache_iswa` and `llama_memory_recurrent` size their tensors, both per layer (for placing them on
devices) and per logged cache line (`cache_allocations`, which the runner compares with the server's log).
It also owns the host extras llama.cpp does not count: context checkpoints and the prompt cache. Pure core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from actors.placement import pooled
from actors.placement.context import cache_row_bytes, draft_model_settings, draft_settings, resolve_context, validate
from messages.memory import ContextShape
from messages.model import LayerGeometry, ModelGeometry
from messages.settings import ServingSettings

__all__ = [
    "CacheAllocation",
    "Caches",
    "cache_allocations",
    "draft_caches",
    "draft_model_caches",
    "host_extras",
    "kv_layers",
    "recurrent_layers",
    "target_caches",
]

MIB = 1 << 20


@dataclass
class Caches:
    """Exact cache tensor sizes, per layer, for one context."""

    k: dict[int, int] = field(default_factory=dict)
    v: dict[int, int] = field(default_factory=dict)
    swa_layers: set[int] = field(default_factory=set)
    recurrent_r: dict[int, int] = field(default_factory=dict)
    recurrent_s: dict[int, int] = field(default_factory=dict)

    def recurrent_total(self) -> int:
        return sum(self.recurrent_r.values()) + sum(self.recurrent_s.values())

    def kv_total(self) -> int:
        return sum(self.k.values()) + sum(self.v.values())


def kv_layers(
    geometry: ModelGeometry,
    layers: Sequence[LayerGeometry],
    shape: ContextShape,
    *,
    type_k: str,
    type_v: str,
    flash_attn: bool,
) -> Caches:
    """K and V tensor bytes per layer: row size x cells x streams, the V row padded to the widest layer
    of the whole model when V is stored transposed (no flash attention)."""
    caches = Caches()
    v_width_max = max((layer.v_width for layer in geometry.layers), default=0)
    for layer in layers:
        cells = shape.swa_cells if layer.swa else shape.n_ctx_seq
        caches.k[layer.index] = cache_row_bytes(type_k, layer.k_width) * cells * shape.n_stream
        if not geometry.mla:
            v_width = layer.v_width if flash_attn else v_width_max
            caches.v[layer.index] = cache_row_bytes(type_v, v_width) * cells * shape.n_stream
        if layer.swa:
            caches.swa_layers.add(layer.index)
    return caches


def recurrent_layers(caches: Caches, layers: Sequence[LayerGeometry], shape: ContextShape) -> None:
    """`llama_memory_recurrent`: f32 R and S rows, max(1, slots) cells, each with 1 + n_rs_seq rows."""
    rows = max(1, shape.n_seq_max) * (1 + shape.n_rs_seq)
    for layer in layers:
        if layer.recurrent:
            caches.recurrent_r[layer.index] = 4 * layer.r_width * rows
            caches.recurrent_s[layer.index] = 4 * layer.s_width * rows


@dataclass(frozen=True)
class CacheAllocation:
    """One cache llama.cpp creates and logs on one line (`llama_kv_cache: size = …` or
    `llama_memory_recurrent: size = …`), with the exact bytes of its tensors.

    `kind` is "kv" (a plain KV cache), "kv_base"/"kv_swa" (the two halves of an interleaved-SWA cache) or
    "recurrent" (then `a_bytes`/`b_bytes` are R and S, and `layers` is the model's trunk layer count, as
    llama.cpp prints it); for KV caches `a_bytes`/`b_bytes` are K and V.
    """

    context: str  # "target" or "draft"
    kind: str
    cells: int
    layers: int
    seqs: int
    streams: int
    rs_seq: int
    type_a: str
    type_b: str
    a_bytes: int
    b_bytes: int


def target_caches(geometry: ModelGeometry, settings: ServingSettings, shape: ContextShape) -> Caches:
    """The target context's caches: KV of its attention layers (never the nextn blocks) and recurrent state."""
    caches = kv_layers(
        geometry,
        [layer for layer in geometry.layers if layer.attention],
        shape,
        type_k=settings.cache_type_k,
        type_v=settings.cache_type_v,
        flash_attn=settings.flash_attn == "on",
    )
    recurrent_layers(caches, geometry.layers, shape)
    return caches


def draft_caches(
    geometry: ModelGeometry, settings: ServingSettings, shape: ContextShape
) -> tuple[Caches, ContextShape]:
    """The MTP context's KV caches and shape: the target's slots and n_ctx, no rollback rows, only the nextn
    blocks, with the draft cache types."""
    draft_shape = resolve_context(geometry, draft_settings(settings), shape.n_ctx)
    caches = kv_layers(
        geometry,
        [layer for layer in geometry.layers if layer.nextn],
        draft_shape,
        type_k=settings.spec_draft_type_k,
        type_v=settings.spec_draft_type_v,
        flash_attn=settings.flash_attn == "on",
    )
    return caches, draft_shape


def draft_model_caches(
    draft: ModelGeometry, settings: ServingSettings, shape: ContextShape
) -> tuple[Caches, ContextShape]:
    """A draft model's context (`--model-draft`): built like a target context over the draft model's own
    layers, with the target's n_ctx, slots and unified setting, the draft cache types and no rollback rows."""
    own = draft_model_settings(settings)
    draft_shape = resolve_context(draft, own, shape.n_ctx)
    return target_caches(draft, own, draft_shape), draft_shape


def cache_allocations(
    geometry: ModelGeometry, settings: ServingSettings, n_ctx: int, draft: ModelGeometry | None = None
) -> tuple[CacheAllocation, ...]:
    """Every cache the server allocates, in the order it logs them (target context first); `draft` is a
    draft model's geometry (`--model-draft`), whose context comes second."""
    mtp = validate(geometry, settings, draft)
    shape = resolve_context(geometry, settings, n_ctx)
    out: list[CacheAllocation] = []
    caches = target_caches(geometry, settings, shape)
    if geometry.memory != "recurrent":
        out.extend(_kv_lines("target", geometry, caches, shape, settings.cache_type_k, settings.cache_type_v))
    if geometry.memory != "kv":
        out.append(
            CacheAllocation(
                context="target",
                kind="recurrent",
                cells=max(1, shape.n_seq_max),
                layers=geometry.n_layer - geometry.n_layer_nextn,
                seqs=shape.n_seq_max,
                streams=1,
                rs_seq=shape.n_rs_seq,
                type_a="f32",
                type_b="f32",
                a_bytes=sum(caches.recurrent_r.values()),
                b_bytes=sum(caches.recurrent_s.values()),
            )
        )
    if mtp:
        mtp_caches, mtp_shape = draft_caches(geometry, settings, shape)
        # the qwen/nemotron MTP context is a plain cache; a dense model's follows its SWA split
        mtp_geometry = (
            geometry if geometry.recurrent_kind == "none" else msgspec.structs.replace(geometry, swa_type="none")
        )
        types = (settings.spec_draft_type_k, settings.spec_draft_type_v)
        out.extend(_kv_lines("draft", mtp_geometry, mtp_caches, mtp_shape, *types))
    if draft is not None:
        model_caches, model_shape = draft_model_caches(draft, settings, shape)
        types = (settings.spec_draft_type_k, settings.spec_draft_type_v)
        out.extend(_kv_lines("draft", draft, model_caches, model_shape, *types))
    return tuple(out)


def _kv_lines(
    context: str, geometry: ModelGeometry, caches: Caches, shape: ContextShape, type_k: str, type_v: str
) -> list[CacheAllocation]:
    def line(kind: str, layers: list[int], cells: int) -> CacheAllocation:
        return CacheAllocation(
            context=context,
            kind=kind,
            cells=cells,
            layers=len(layers),
            seqs=shape.n_seq_max,
            streams=shape.n_stream,
            rs_seq=0,
            type_a=type_k,
            type_b=type_v,
            a_bytes=sum(caches.k[il] for il in layers),
            b_bytes=sum(caches.v.get(il, 0) for il in layers),
        )

    base = [il for il in caches.k if il not in caches.swa_layers]
    swa = [il for il in caches.k if il in caches.swa_layers]
    if geometry.swa_type == "none":
        return [line("kv", base, shape.n_ctx_seq)]
    return [line("kv_base", base, shape.n_ctx_seq), line("kv_swa", swa, shape.swa_cells)]


def host_extras(geometry: ModelGeometry, settings: ServingSettings, shape: ContextShape, target: Caches) -> int:
    """Context checkpoints, the prompt cache and a pooled server's output rows, as upper bounds (host RAM the
    server may fill at run time).

    A checkpoint holds one sequence's part of the memory that cannot be rolled back: its recurrent state
    (one cell per recurrent layer) and its sliding-window KV cells. The server makes them only for hybrid,
    recurrent and (non-full) SWA models, up to `ctx_checkpoints` per slot. The prompt cache is bounded by
    `--cache-ram` MiB; unlimited (-1) is bounded by its token limit, the context size. An embedding or rerank
    server's output buffer grows from a row per slot to a row per token of its largest batch
    (`pooled.output_growth_bytes`).
    """
    per_seq_recurrent = sum(
        4 * (layer.r_width + layer.s_width) for layer in geometry.layers if layer.recurrent and not layer.nextn
    )
    swa_per_cell = 0
    if target.swa_layers and not settings.swa_full:
        per_stream_cells = shape.swa_cells * shape.n_stream
        swa_bytes = sum(target.k[il] + target.v.get(il, 0) for il in target.swa_layers)
        swa_per_cell = swa_bytes // per_stream_cells if per_stream_cells else 0
    checkpoints = 0
    if per_seq_recurrent or swa_per_cell:
        seq_cells = min(shape.swa_cells, shape.n_ctx_seq) if swa_per_cell else 0
        checkpoint = per_seq_recurrent + swa_per_cell * seq_cells
        checkpoints = settings.ctx_checkpoints * settings.slots * checkpoint
    if settings.cache_ram_mib > 0:
        prompt_cache = settings.cache_ram_mib * MIB
    elif settings.cache_ram_mib == 0:
        prompt_cache = 0
    else:
        per_token = target.kv_total() // max(1, shape.n_ctx_seq * shape.n_stream)
        prompt_cache = per_token * shape.n_ctx + per_seq_recurrent * shape.n_seq_max
    return checkpoints + prompt_cache + pooled.output_growth_bytes(geometry, settings, shape)
