"""A placement actor over a few hundred simulated nodes answers what admission's full scan answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from actors.placement.actor import PlacementActor, ledger_key
from actors.placement.admission import ModelFacts, ViewEntry
from actors.placement.fleet import decide
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from messages.placement import ModelRef, NodeLedger, PlacementDecision, PlacementRequest
from messages.settings import ServingSettings
from messages.subjects import Subjects
from messages.telemetry import GpuInfo, HostInfo, LlamaServerInfo, NodeResources
from runtime import buckets
from runtime.bus import Bus, NoResponders, decode, encode
from tests.conftest import supervised
from tests.tiny_models import write_llama

MIB = 1 << 20
NODES = 300
SUBJECTS = Subjects()
PROFILES = (
    ServingSettings(cache_ram_mib=0, ctx_checkpoints=0),
    ServingSettings(slots=1, cache_ram_mib=0, ctx_checkpoints=0),
    ServingSettings(slots=8, kv_unified=True, cache_type_k="q8_0", cache_ram_mib=0, ctx_checkpoints=0),
)


def report(i: int) -> NodeResources:
    now = time.time()
    n_gpus = i % 3
    free = [(10 + (i * 7 + g * 13) % 80) * MIB for g in range(n_gpus)]
    gpus = tuple(
        GpuInfo(
            index=g, name="sim", uuid=f"GPU-{i}-{g}", total_bytes=96 * MIB, free_bytes=f, used_bytes=0, usable_bytes=f
        )
        for g, f in enumerate(free)
    )  # fmt: skip
    host = (16 + (i * 11) % 200) * MIB
    return NodeResources(
        node_id=f"sim-{i}",
        seq=1,
        sent_at=now,
        started_at=now,
        ttl_s=600,
        host=HostInfo(ram_total_bytes=1024 * MIB, ram_available_bytes=host, usable_bytes=host, cpu_count=8),
        gpus=gpus,
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info=""),
        settings=PROFILES[i % len(PROFILES)],
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("models") / "dense.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512)


@pytest.fixture
async def placement(bus: Bus) -> AsyncIterator[PlacementActor]:
    actor = PlacementActor(sweep_interval_s=0.5)
    async with supervised(bus, [actor], node_id="p1"):
        yield actor


def expected(
    actor: PlacementActor, request: PlacementRequest, facts: ModelFacts, ledgers: dict[str, NodeLedger]
) -> PlacementDecision:
    """The full scan over the actor's view (every report fresh: ages do not show in the decision)."""
    view = {name: ViewEntry(resources=e.resources, revision=e.revision, age_s=0.0) for name, e in actor._view.items()}
    outcome = decide(request, facts, view, ledgers, now=0.0, decision_id="", reservation_id="", dry_run=True)
    return outcome.decision


def comparable(decision: PlacementDecision) -> PlacementDecision:
    return msgspec.structs.replace(decision, decision_id="", decided_at=0.0, reservation_id=None, dry_run=True)


async def test_a_placement_actor_over_300_simulated_nodes_answers_as_the_full_scan(
    bus: Bus, placement: PlacementActor, model: Path
) -> None:
    nodes = await buckets.nodes(bus, SUBJECTS)
    async with asyncio.timeout(30):
        await asyncio.gather(*(nodes.put(f"sim-{i}", encode(report(i))) for i in range(NODES)))
        while len(placement._view) < NODES:
            await asyncio.sleep(0.05)
    facts = ModelFacts(geometry=geometry_from_header(read_header(model)), path=str(model))
    request = PlacementRequest(model=ModelRef(path=str(model)), ctx=4096, explain=True)
    async with asyncio.timeout(30):  # the view fills from the bucket before the actor adds its endpoints
        while True:
            try:
                fit = await bus.request(SUBJECTS.placement_fit, request, PlacementDecision, timeout=10)
                break
            except NoResponders:
                await asyncio.sleep(0.05)
    assert fit.admitted and len(fit.view) == NODES
    assert comparable(fit) == comparable(expected(placement, request, facts, {}))
    assert {r.reason for r in fit.rejections} == {"insufficient_memory"}  # some nodes are too small
    # Without `explain`, the answer names the chosen node only, read off the index's standing answer.
    brief = msgspec.structs.replace(request, explain=False)
    short = await bus.request(SUBJECTS.placement_fit, brief, PlacementDecision, timeout=10)
    assert comparable(short) == comparable(expected(placement, brief, facts, {}))
    assert short.rejections == () and short.view == {fit.placements[0].node_id: fit.view[fit.placements[0].node_id]}
    assert short.placements == fit.placements

    # A booking lands on the chosen node; the next answer counts it, as the full scan does.
    booked = await bus.request(SUBJECTS.placement_request, request, PlacementDecision, timeout=10)
    assert booked.admitted and booked.placements[0].node_id == fit.placements[0].node_id
    chosen = booked.placements[0].node_id
    ledgers = await buckets.reservations(bus, SUBJECTS)
    held = decode((await ledgers.get(ledger_key(chosen))).value or b"", NodeLedger)
    async with asyncio.timeout(10):
        while placement._ledger_cache.get(chosen, (None, 0))[0] != held:
            await asyncio.sleep(0.02)
    again = await bus.request(SUBJECTS.placement_fit, request, PlacementDecision, timeout=10)
    assert comparable(again) == comparable(expected(placement, request, facts, {chosen: held}))
    assert again.placements[0].node_id != chosen or again.placements[0].breakdown != fit.placements[0].breakdown
