"""Admission's pure core: nodes, requests and views built for it, the settings models ask for, a run of it."""

from __future__ import annotations

from typing import TypedDict

import msgspec
import pytest

from actors.placement.admission import ModelFacts, Outcome, ViewEntry
from actors.placement.fleet import decide
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.model import ModelGeometry
from messages.placement import NodeLedger, PlacementRequest
from messages.settings import ServingSettings, SettingsBounds
from messages.telemetry import HostInfo, LlamaServerInfo, NodeResources, SplitServing
from tests.tiny_models import write_llama, write_qwen35

NOW = 1_000_000.0


GIB = 1 << 30


class Quiet(TypedDict):
    """`ServingSettings` keywords for a server with no host extras: `ServingSettings(**QUIET)`."""

    cache_ram_mib: int
    ctx_checkpoints: int


QUIET: Quiet = {"cache_ram_mib": 0, "ctx_checkpoints": 0}  # no host extras: keeps the arithmetic readable


DEFAULT = ServingSettings(cache_ram_mib=0, ctx_checkpoints=0)


OPEN = SettingsBounds()  # everything llama-server accepts


def node(
    node_id: str,
    usable: int,
    *,
    total: int = 64 * GIB,
    settings: ServingSettings | None = DEFAULT,
    sent_at: float = NOW - 1,
    limit: int | None = None,
    bounds: SettingsBounds | None = None,
) -> NodeResources:
    return NodeResources(
        node_id=node_id,
        seq=1,
        sent_at=sent_at,
        started_at=NOW - 100,
        ttl_s=15,
        host=HostInfo(ram_total_bytes=total, ram_available_bytes=usable, usable_bytes=usable, cpu_count=8),
        memory_limit_bytes=limit,
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info="") if settings else None,
        llama_server_error=None if settings else "not installed",
        settings=settings,
        bounds=bounds,
        split=SplitServing(lend_host="127.0.0.1", lend_devices=("CPU",)),  # holds the cluster's certificates; lends
    )


def view(*nodes: NodeResources) -> dict[str, ViewEntry]:
    return {n.node_id: ViewEntry(resources=n, revision=i + 1) for i, n in enumerate(nodes)}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> ModelFacts:
    path = write_llama(tmp_path_factory.mktemp("m") / "llama.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512)
    return ModelFacts(geometry=geometry_from_header(read_header(path)), path=str(path))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> ModelFacts:
    path = write_qwen35(
        tmp_path_factory.mktemp("m") / "qwen35.gguf", n_layer=8, state_size=64, dt_rank=16, group_count=2
    )
    return ModelFacts(geometry=geometry_from_header(read_header(path)), path=str(path))


def request(ctx: int | None = 4096, **fields: object) -> PlacementRequest:
    return msgspec.convert({"model": {"path": "m.gguf"}, "ctx": ctx, **fields}, PlacementRequest)


def run(
    req: PlacementRequest,
    model: ModelFacts,
    nodes: dict[str, ViewEntry],
    ledgers: dict[str, NodeLedger] | None = None,
    dry_run: bool = False,
) -> Outcome:
    return decide(req, model, nodes, ledgers or {}, now=NOW, decision_id="d1", reservation_id="r1", dry_run=dry_run)


def need(model: ModelGeometry, settings: ServingSettings, ctx: int) -> int:
    return estimate(model, settings, ctx).total_bytes
