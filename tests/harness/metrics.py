"""Metrics and telemetry records built for pure tests: envelopes, scrapes, reservations, predictions."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics import exposition as openmetrics_exposition
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from actors.metrics.fold import NodeMetrics
from messages.memory import ContextShape, DeviceMemory, MemoryBreakdown
from messages.placement import Reservation, Stamp
from messages.runner import InstanceState, InstanceStatus, ObservedMemory
from messages.settings import ServingSettings
from messages.telemetry import GpuInfo, HostInfo, NodeResources

NODE = "n1"


def _device(
    name: str,
    *,
    weights_bytes: int = 0,
    kv_bytes: int = 0,
    compute_bytes: int = 0,
    output_bytes: int = 0,
    host_extra_bytes: int = 0,
) -> DeviceMemory:
    return DeviceMemory(
        device=name, weights_bytes=weights_bytes, kv_bytes=kv_bytes, recurrent_bytes=0, draft_kv_bytes=0,
        compute_bytes=compute_bytes, output_bytes=output_bytes, host_extra_bytes=host_extra_bytes,
        total_bytes=weights_bytes + kv_bytes + compute_bytes + output_bytes + host_extra_bytes,
    )  # fmt: skip


PREDICTED = MemoryBreakdown(
    estimator_version="t", llama_cpp_version="t", architecture="llama",
    context=ContextShape(n_ctx=4096, n_ctx_seq=2048, n_seq_max=2, n_stream=2, n_rs_seq=0, n_ubatch=512, swa_cells=0),
    kv_bytes=1000, kv_k_bytes=500, kv_v_bytes=500, kv_swa_bytes=0, recurrent_bytes=0, draft_kv_bytes=0,
    weights_bytes=5000, compute_bytes=300, output_bytes=40, host_extra_bytes=7, total_bytes=6422,
    devices=(_device("CPU", weights_bytes=1000, kv_bytes=200, compute_bytes=100, output_bytes=40, host_extra_bytes=7),
             _device("GPU0", weights_bytes=4000, kv_bytes=800, compute_bytes=200)),
    compute_error_ratio=0.25, compute_margin_bytes=75,
)  # fmt: skip


OBSERVED = ObservedMemory(
    kv_bytes=1000, recurrent_bytes=0, draft_kv_bytes=0, weights_bytes=5000, compute_bytes=290, output_bytes=40,
    total_bytes=6330, devices={"CPU": 1330, "CUDA0": 5000},
)  # fmt: skip


def record(
    instance: str = "i1",
    state: InstanceState = "ready",
    *,
    node: str = NODE,
    port: int | None = 8100,
    model: str = "/models/qwen3-0.6b.gguf",
    observed: ObservedMemory | None = OBSERVED,
) -> InstanceStatus:
    return InstanceStatus(
        id=instance, node=node, reservation_id=f"r-{instance}", state=state, port=port, model_path=model,
        settings=Stamp(settings=ServingSettings(slots=2), ctx=4096, n_gpu_layers=99), predicted_memory=PREDICTED,
        observed_memory=observed,
    )  # fmt: skip


def envelope(node: str = NODE) -> dict[str, Any]:
    return {"id": "e", "time": 0.0, "node": node, "actor": "runner"}


def telemetry(**fields: Any) -> NodeResources:
    host = HostInfo(ram_total_bytes=64 << 30, ram_available_bytes=40 << 30, usable_bytes=40 << 30, cpu_count=16)
    gpu = GpuInfo(index=0, name="H200", uuid="u", total_bytes=140 << 30, free_bytes=100 << 30, used_bytes=40 << 30,
                  usable_bytes=100 << 30)  # fmt: skip
    base = NodeResources(node_id=NODE, seq=1, sent_at=1000.0, started_at=900.0, ttl_s=15.0, host=host, gpus=(gpu,))
    return msgspec.structs.replace(base, **fields)


def reservation(rid: str, state: Any, held: dict[str, int]) -> Reservation:
    return Reservation(
        reservation_id=rid, decision_id="d", node_id=NODE, state=state, model_path="m.gguf",
        stamp=Stamp(settings=ServingSettings(), ctx=4096, n_gpu_layers=0), layers=(0, 4), devices=(), held=held,
        created_at=0.0, running_since=500.0 if state == "running" else None,
    )  # fmt: skip


class _Families(Collector):
    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Sequence[Metric]:
        return self._families


def scrape(metrics: NodeMetrics, now: float = 0.0, engines: Mapping[str, Sequence[Metric] | None] | None = None) -> str:
    return generate_latest(_Families(metrics.families(now, engines))).decode()


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def value(text: str, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels` (summed when several match)."""
    found = [v for n, ls, v in samples(text) if n == name and labels.items() <= ls.items()]
    assert found, f"no sample {name} {labels}"
    return sum(found)


def absent(text: str, name: str, **labels: str) -> bool:
    return not [v for n, ls, v in samples(text) if n == name and labels.items() <= ls.items()]


def parse_openmetrics(text: str) -> Iterable[Metric]:
    """prometheus_client's OpenMetrics parser, typed: the function itself is not annotated."""
    parse: Callable[[str], Iterable[Metric]] = openmetrics_parser.text_string_to_metric_families
    return parse(text)


def generate_openmetrics(registry: Collector) -> bytes:
    """prometheus_client's OpenMetrics exposition, typed: the function itself is not annotated."""
    generate: Callable[[Collector], bytes] = openmetrics_exposition.generate_latest
    return generate(registry)
