"""The placement actor on a live bus: nodes' reports, placing models, asking, the ledger and the fleet view."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec

from actors.placement.actor import PlacementActor, ledger_key
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.placement import NodeLedger, PlacementDecision, PlacementRequest
from messages.settings import ServingSettings
from messages.subjects import Subjects
from messages.telemetry import HostInfo, LlamaServerInfo, NodeResources, SplitServing
from runtime import buckets
from runtime.bus import Bus, NoResponders, decode

GIB = 1 << 30


SUBJECTS = Subjects()


QUIET = ServingSettings(cache_ram_mib=0, ctx_checkpoints=0)


def report(
    node_id: str,
    usable: int,
    *,
    settings: ServingSettings | None = QUIET,
    sent_at: float | None = None,
    ttl_s: float = 600,
    seq: int = 1,
    started_at: float | None = None,
) -> NodeResources:
    now = time.time()
    if started_at is None:
        started_at = now if sent_at is None else sent_at - 60
    return NodeResources(
        node_id=node_id,
        seq=seq,
        sent_at=now if sent_at is None else sent_at,
        started_at=started_at,
        ttl_s=ttl_s,
        host=HostInfo(ram_total_bytes=64 * GIB, ram_available_bytes=usable, usable_bytes=usable, cpu_count=2),
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info="") if settings else None,
        llama_server_error=None if settings else "llama-server not found",
        settings=settings,
        split=SplitServing(lend_host="127.0.0.1", lend_devices=("CPU",)),  # holds the cluster's certificates; lends
    )


def need(path: Path, ctx: int = 4096, settings: ServingSettings = QUIET) -> int:
    return estimate(geometry_from_header(read_header(path)), settings, ctx).total_bytes


def ask(path: Path | None = None, **fields: Any) -> PlacementRequest:
    model = {"path": str(path)} if path else {}
    return msgspec.convert({"model": model, "ctx": 4096, **fields}, PlacementRequest)


async def place(
    bus: Bus, request: PlacementRequest, *, fit: bool = False, timeout_s: float = 10.0
) -> PlacementDecision:
    subject = SUBJECTS.placement_fit if fit else SUBJECTS.placement_request
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                return await bus.request(subject, request, PlacementDecision, timeout=timeout_s)
            except NoResponders:  # the actor is still registering
                await asyncio.sleep(0.02)


async def wait_view(actor: PlacementActor, *nodes: str) -> None:
    async with asyncio.timeout(10):
        while not all(n in actor._view for n in nodes):
            await asyncio.sleep(0.02)


async def ledger(bus: Bus, node: str) -> NodeLedger:
    kv = await buckets.reservations(bus, SUBJECTS)
    return decode((await kv.get(ledger_key(node))).value or b"", NodeLedger)
