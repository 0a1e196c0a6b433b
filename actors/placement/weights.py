"""Where llama-server puts the weights, per device, and what the CPU backend copies (placement core).

This module owns the weights side of the memory model:

* the device of every block and of the output layer (`layer_devices`): the layer-granular split
  `llama_model::load_tensors` makes for `-ngl` and a tensor split;
* the tensor bytes per device (`weights_per_device`): blocks where their layer lives, token embeddings on
  the host, nextn blocks only for MTP, tied output embeddings duplicated onto a GPU output device;
* the CPU backend's copies (`host_copies`): with no GPU, llama.cpp's CPU backend keeps some weights a matrix
  multiplication reads in a layout of its own, copied out of the mapped file into anonymous RAM. Its extra
  buffer types are tried in order: first `AMX`, on a CPU with AMX (`AMX_INT8` and `AVX512_VNNI`), for the
  2-D weights of the types and shapes its kernels take (`ggml-cpu/amx/amx.cpp`, sized by
  `ggml_backend_amx_get_alloc_size`); then `CPU_REPACK`, for a weight whose type has an interleaved kernel for
  the CPU's features (`ggml_repack_get_optimal_repack_type` in ggml-cpu/repack.cpp) and whose row count suits
  that kernel. Each copied tensor is rounded up to 32 bytes. The mapped buffer spans the file from the first
  to the last tensor left in it, so copied tensors at either end of the file leave the span (`unmapped`); those
  in between stay mapped beside their copies. The table below is `ggml_repack_get_optimal_repack_type`'s, for
  the CPU backend of the build named in `LLAMA_CPP_VERSION` (features as its `system_info` line names them).
  With a GPU in the device list the host-side weights go to the GPU's host buffer type instead, which mmap
  replaces by the plain CPU buffer, so nothing is copied there.

Pure core: no I/O.
"""

from __future__ import annotations

import bisect
import functools
import math
from array import array
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

from actors.placement.context import MemoryModelError, pad
from messages.model import MappedEdge, ModelGeometry, RepackGroup

__all__ = [
    "AMX",
    "ANY_CPU",
    "REPACK_RULES",
    "HostCopies",
    "copied",
    "host_copies",
    "layer_devices",
    "repacked",
    "weights_per_device",
]

CPU_ALIGNMENT = 32  # TENSOR_ALIGNMENT of the CPU (and CPU_REPACK) buffer types

#: Weight type -> the (CPU features all required, row-count multiple) pairs under which the CPU backend
#: repacks it; a weight is repacked when any pair holds. From `ggml_repack_get_optimal_repack_type`
#: (x86 AVX2/AVX512, Arm NEON with dot product or int8 matmul, s390x VXE; RISC-V needs the zvfh extension
#: and a 256-bit vector length, which telemetry cannot see, so it is not listed). Q5_K, Q6_K and Q8_0 have
#: Arm kernels only.
REPACK_RULES: dict[str, tuple[tuple[frozenset[str], int], ...]] = {
    "q4_0": (
        (frozenset({"AVX2"}), 8),
        (frozenset({"NEON", "MATMUL_INT8"}), 4),
        (frozenset({"NEON", "DOTPROD"}), 4),
        (frozenset({"VXE"}), 4),
    ),
    "q4_k": (
        (frozenset({"AVX2"}), 8),
        (frozenset({"NEON", "MATMUL_INT8"}), 8),
        (frozenset({"NEON", "DOTPROD"}), 8),
    ),
    "q2_k": ((frozenset({"AVX512"}), 8),),
    "q5_k": ((frozenset({"NEON", "MATMUL_INT8"}), 8), (frozenset({"NEON", "DOTPROD"}), 8)),
    "q6_k": ((frozenset({"NEON", "MATMUL_INT8"}), 8), (frozenset({"NEON", "DOTPROD"}), 8)),
    "iq4_nl": ((frozenset({"AVX2"}), 8), (frozenset({"NEON", "DOTPROD"}), 4)),
    "mxfp4": ((frozenset({"AVX2"}), 8), (frozenset({"NEON", "DOTPROD"}), 4)),
    "q8_0": ((frozenset({"NEON", "MATMUL_INT8"}), 4), (frozenset({"NEON", "DOTPROD"}), 4)),
    "q1_0": ((frozenset({"NEON", "MATMUL_INT8"}), 4), (frozenset({"NEON", "DOTPROD"}), 4)),
}
#: The CPU features under which the CPU backend has its AMX buffer type (a build with `__AMX_INT8__` and
#: `__AVX512VNNI__`; the kernel grants the tile data at start, as Linux does from 5.16).
AMX = frozenset({"AMX_INT8", "AVX512_VNNI"})
#: Stands for "the node's CPU features are not known": every repack rule is taken to hold (see `host_copies`).
ANY_CPU = frozenset().union(*(features for rules in REPACK_RULES.values() for features, _ in rules))


def repacked(group: RepackGroup, cpu_features: frozenset[str]) -> bool:
    """Whether the CPU backend with `cpu_features` has a repack kernel for the weights of `group`."""
    for features, rows in REPACK_RULES.get(group.type, ()):
        if features <= cpu_features and group.rows_multiple % rows == 0:
            return True
    return False


def copied(group: RepackGroup, cpu_features: frozenset[str]) -> tuple[str, int] | None:
    """Where the CPU backend with `cpu_features` copies the weights of `group`, and their bytes there:
    ("amx", n), its first extra buffer type, or ("repack", n); None: they stay in the mapped file."""
    if group.amx_bytes and cpu_features >= AMX:
        return "amx", group.amx_bytes
    if repacked(group, cpu_features):
        return "repack", group.bytes
    return None


@dataclass(frozen=True, slots=True)
class HostCopies:
    """The CPU backend's copies of the host's weights: the `CPU_REPACK` and `AMX` buffers, and the bytes of
    copied tensors at the file's ends that the mapped buffer's span leaves out."""

    repack: int = 0
    amx: int = 0
    unmapped: int = 0


def host_copies(
    geometry: ModelGeometry,
    cpu_features: Iterable[str] | None,
    *,
    load_nextn: bool,
    output_on_host: bool,
    host_layers: Container[int] | None = None,
) -> HostCopies:
    """The copies for the blocks on the host (`host_layers`; None: all of them) and, when `output_on_host`,
    the output layer. The span is narrowed only when the whole model is on the host.

    `cpu_features` are the llama.cpp CPU backend's features; None means unknown, sized as the largest any CPU
    could need: each group's larger copy, all counted as repacked, and the span whole. A build made without
    the repack buffer (`GGML_CPU_REPACK=OFF`) allocates less. A split over RPC devices (which have no host
    buffer type) copies the host's own blocks, as a host alone does.
    """
    groups: list[RepackGroup] = []
    for layer in geometry.layers:
        if (layer.nextn and not load_nextn) or (host_layers is not None and layer.index not in host_layers):
            continue
        groups.extend(layer.repack)
    if output_on_host:
        groups.extend(geometry.output_repack)
    if cpu_features is None:
        return HostCopies(repack=sum(max(g.amx_bytes, g.bytes if repacked(g, ANY_CPU) else 0) for g in groups))
    features = frozenset(cpu_features)
    by_buffer = {"repack": 0, "amx": 0}
    for group in groups:
        copy = copied(group, features)
        if copy is not None:
            by_buffer[copy[0]] += copy[1]
    unmapped = 0
    if host_layers is None and output_on_host:
        unmapped = _unmapped(geometry.mapped_head, features, load_nextn)
        unmapped += _unmapped(geometry.mapped_tail, features, load_nextn)
    return HostCopies(repack=by_buffer["repack"], amx=by_buffer["amx"], unmapped=unmapped)


def _unmapped(edge: Sequence[MappedEdge], features: frozenset[str], load_nextn: bool) -> int:
    """The bytes of copied tensors at one end of the file, before the first tensor the mapped buffer keeps
    (a nextn block's tensor is not loaded without MTP, and counted in no buffer)."""
    total = 0
    for tensor in edge:
        if tensor.nextn and not load_nextn:
            continue
        if tensor.group is None or copied(tensor.group, features) is None:
            break
        total += tensor.bytes
    return total


def layer_devices(geometry: ModelGeometry, n_gpu_layers: int, gpu_split: Sequence[float]) -> list[int]:
    """Device per block and, last, for the output layer: -1 is the host, i >= 0 is GPU i.

    Mirrors `load_tensors`: the last `n_gpu_layers` of the n_layer+1 "layers" (blocks, then the output
    layer) are offloaded, split over the GPUs in proportion to `gpu_split` with float32 cumulative fractions.
    """
    return list(_layer_devices(geometry.n_layer, n_gpu_layers, tuple(gpu_split)))


@functools.lru_cache(maxsize=4096)
def _layer_devices(n_all: int, n_gpu_layers: int, gpu_split: tuple[float, ...]) -> tuple[int, ...]:
    """`layer_devices` by value (a node's layout and its memory estimate ask the same one in turn). The float32
    arithmetic of llama.cpp in Python floats: each sum and quotient of two float32 values computed in double
    precision, then rounded to float32 (`array("f")`), is the float32 operation's result (double rounding is
    harmless for +, -, *, / from 53 to 24 bits); numpy's own float32 computation is the tests' oracle."""
    if not gpu_split:
        return (-1,) * (n_all + 1)
    ngl = n_gpu_layers if n_gpu_layers >= 0 else n_all + 1
    start = max(n_all + 1 - ngl, 0)
    act = min(ngl, n_all + 1)
    weights = array("f", gpu_split)  # each weight as float32 (one too large for it: inf, refused here)
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(w > 0 for w in weights):
        raise MemoryModelError("the GPU split needs finite, non-negative weights with a positive sum")
    if act == 0:
        return (-1,) * (n_all + 1)
    cumulative = array("f")
    for w in weights:
        cumulative.append((cumulative[-1] if cumulative else 0.0) + w)
    total = cumulative[-1]
    splits = array("f", [c / total for c in cumulative]).tolist()
    positions = array("f", [i / act for i in range(act)]).tolist()
    offloaded = [bisect.bisect_right(splits, x) for x in positions]  # numpy's searchsorted, side="right"
    return (-1,) * start + tuple(offloaded) + (-1,) * (n_all + 1 - start - act)


def weights_per_device(
    geometry: ModelGeometry, devices: Sequence[int], *, load_nextn: bool, copied: Container[int] = ()
) -> dict[int, int]:
    """Tensor bytes per device: blocks where their layer lives, embeddings on the host, output tensors on
    the output layer's device (plus a copy of tied embeddings there when that is a GPU or an RPC device).

    Devices in `copied` hold their tensors in a buffer allocated for them (an RPC server's), where each tensor
    takes its bytes rounded up to the buffer's 32-byte alignment; the host maps its tensors from the file."""

    def size(dev: int, exact: int, padded: int) -> int:
        return padded if dev in copied and padded else exact

    out: dict[int, int] = {-1: geometry.input_tensor_bytes}
    for layer in geometry.layers:
        if layer.nextn and not load_nextn:
            continue  # llama.cpp skips the MTP tensors unless an MTP context is requested
        dev = devices[layer.index]
        out[dev] = out.get(dev, 0) + size(dev, layer.tensor_bytes, layer.padded_bytes)
    out_dev = devices[geometry.n_layer]
    out[out_dev] = out.get(out_dev, 0) + size(out_dev, geometry.output_tensor_bytes, geometry.output_padded_bytes)
    if geometry.tied_output and out_dev >= 0:
        out[out_dev] += size(out_dev, geometry.token_embd_bytes, geometry.token_embd_padded_bytes)
    return out


def padded(n_bytes: int) -> int:
    """A tensor's size in a CPU buffer."""
    return pad(n_bytes, CPU_ALIGNMENT)
