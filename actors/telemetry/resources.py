"""Telemetry core: turns probe readings into the node's `NodeResources` report (pure).

It also decides when a report is worth sending before the regular interval (usable memory moved a lot)
and when a change is material enough to journal (first report, settings, devices, engine, limit):
free memory that wobbles every few seconds is telemetry, not an event.
"""

from __future__ import annotations

from dataclasses import dataclass

from messages.settings import ServingSettings
from messages.telemetry import GpuInfo, HostInfo, LlamaServerInfo, NodeResources


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
    )


def material_change(previous: NodeResources | None, current: NodeResources) -> str | None:
    """Why `current` is worth a journal event compared with `previous`, or None."""
    if previous is None:
        return "first report"
    if previous.settings != current.settings:
        return "serving settings changed"
    if [(g.index, g.uuid, g.total_bytes) for g in previous.gpus] != [
        (g.index, g.uuid, g.total_bytes) for g in current.gpus
    ]:
        return "devices changed"
    if previous.llama_server != current.llama_server:
        return "llama-server changed"
    if previous.memory_limit_bytes != current.memory_limit_bytes:
        return "memory limit changed"
    return None


def usable_moved(previous: NodeResources, current: NodeResources, *, threshold_bytes: int = 256 << 20) -> bool:
    """True when some device's usable memory moved by more than `threshold_bytes` (report it now)."""
    pairs = [(previous.host.usable_bytes, current.host.usable_bytes)]
    pairs += [(a.usable_bytes, b.usable_bytes) for a, b in zip(previous.gpus, current.gpus, strict=False)]
    return any(abs(a - b) > threshold_bytes for a, b in pairs) or len(previous.gpus) != len(current.gpus)
