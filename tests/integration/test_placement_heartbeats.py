"""Telemetry through a real nats-server's nodes bucket into the placement actor (issue 28): a report that repeats
the node's last is its heartbeat (liveness refreshed, the index not told), any other is taken in whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from actors.placement.actor import PlacementActor
from messages.placement import ModelRef, PlacementDecision, PlacementRequest
from messages.settings import ServingSettings
from messages.subjects import Subjects
from messages.telemetry import HostInfo, LlamaServerInfo, NodeResources
from runtime import buckets
from runtime.bus import Bus, NoResponders, encode
from tests.conftest import supervised
from tests.tiny_models import write_llama

MIB = 1 << 20
SUBJECTS = Subjects()
TTL_S = 15.0


class Clock:
    """The placement actor's monotonic clock, moved by the test: staleness without waiting for it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def report(node: str, *, seq: int, usable_mib: int, started_at: float = 500.0) -> NodeResources:
    return NodeResources(
        node_id=node, seq=seq, sent_at=600.0 + seq, started_at=started_at, ttl_s=TTL_S,
        host=HostInfo(ram_total_bytes=4096 * MIB, ram_available_bytes=usable_mib * MIB,
                      usable_bytes=usable_mib * MIB, cpu_count=8),
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info=""),
        settings=ServingSettings(cache_ram_mib=0, ctx_checkpoints=0),
    )  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("models") / "dense.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def placement(bus: Bus, clock: Clock) -> AsyncIterator[PlacementActor]:
    actor = PlacementActor(sweep_interval_s=0.5, monotonic=clock)
    async with supervised(bus, [actor], node_id="p1"):
        yield actor


async def put(bus: Bus, node: NodeResources, placement: PlacementActor) -> int:
    """Writes `node`'s report as the telemetry actor does and waits until the actor's view holds that revision."""
    nodes = await buckets.nodes(bus, SUBJECTS)
    revision = int(await nodes.put(node.node_id, encode(node)))
    async with asyncio.timeout(10):
        while (entry := placement._view.get(node.node_id)) is None or entry.revision < revision:
            await asyncio.sleep(0.01)
    return revision


async def fit(bus: Bus, request: PlacementRequest) -> PlacementDecision:
    async with asyncio.timeout(30):  # the actor adds its endpoints once its view has filled
        while True:
            try:
                return await bus.request(SUBJECTS.placement_fit, request, PlacementDecision, timeout=10)
            except NoResponders:
                await asyncio.sleep(0.05)


async def test_an_unchanged_report_refreshes_liveness_without_a_re_index_and_a_changed_one_is_seen(
    bus: Bus, placement: PlacementActor, clock: Clock, model: Path
) -> None:
    request = PlacementRequest(model=ModelRef(path=str(model)), ctx=4096)
    await put(bus, report("a", seq=1, usable_mib=2048), placement)
    await put(bus, report("b", seq=1, usable_mib=1024), placement)
    first = await fit(bus, request)
    assert first.admitted and first.placements[0].node_id == "a"  # the most headroom
    before = placement.stats()

    # Heartbeats of both, 10 s later: taken in without a full decode, the index not told.
    clock.now += 10
    revision = await put(bus, report("a", seq=2, usable_mib=2048), placement)
    await put(bus, report("b", seq=2, usable_mib=1024), placement)
    after = placement.stats()
    assert after.heartbeats == before.heartbeats + 2
    assert after.index.touches == before.index.touches
    assert placement._view["a"].resources == report("a", seq=2, usable_mib=2048)  # what a full decode gives

    # 20 s after the first reports (older than their 15 s TTL), 10 s after the heartbeats: both still live, and
    # the decision names the heartbeat's report (its revision), as one decided after a full decode would.
    clock.now += 10
    decided = await fit(bus, msgspec.structs.replace(request, explain=True))
    assert decided.admitted and decided.placements[0].node_id == "a"
    assert decided.placements[0].telemetry_revision == revision
    assert {r.node_id: r.reason for r in decided.rejections} == {}

    # A changed report (b's memory freed) is decoded whole and re-indexed: b now has the most headroom.
    await put(bus, report("b", seq=3, usable_mib=3072), placement)
    changed = placement.stats()
    assert changed.heartbeats == after.heartbeats and changed.index.touches == after.index.touches + 1
    assert (await fit(bus, request)).placements[0].node_id == "b"

    # A restart (a new start time, all else equal) is a new report too; a heartbeat's stale report is refused.
    await put(bus, report("a", seq=1, usable_mib=2048, started_at=700.0), placement)
    assert placement.stats().heartbeats == changed.heartbeats
    assert placement._view["a"].resources.started_at == 700.0
    clock.now += TTL_S + 1
    await put(bus, report("b", seq=4, usable_mib=3072), placement)  # b's heartbeat keeps b alone live
    stale = await fit(bus, msgspec.structs.replace(request, explain=True))
    assert stale.placements[0].node_id == "b"
    assert {r.node_id: r.reason for r in stale.rejections} == {"a": "telemetry_stale"}


async def test_a_forged_or_malformed_report_after_heartbeats_is_refused_as_before(
    bus: Bus, placement: PlacementActor, model: Path
) -> None:
    await put(bus, report("a", seq=1, usable_mib=2048), placement)
    await put(bus, report("a", seq=2, usable_mib=2048), placement)
    assert placement.stats().heartbeats == 1
    nodes = await buckets.nodes(bus, SUBJECTS)
    good = encode(report("a", seq=3, usable_mib=2048))
    # The same content, but a negative free memory in it (one byte changed), and then another node's report
    # copied under a's key: each decoded whole, refused, and a leaves the view (it no longer says what it said).
    for bad in (good.replace(b'"cpu_count":8', b'"cpu_count":-8'), encode(report("b", seq=3, usable_mib=2048))):
        await nodes.put("a", bad)
        async with asyncio.timeout(10):
            while "a" in placement._view:
                await asyncio.sleep(0.01)
        await put(bus, report("a", seq=4, usable_mib=2048), placement)  # decoded whole again: a is back
    assert placement.stats().heartbeats == 1
    await put(bus, report("a", seq=5, usable_mib=2048), placement)
    assert placement.stats().heartbeats == 2
    assert (await fit(bus, PlacementRequest(model=ModelRef(path=str(model)), ctx=4096))).placements[0].node_id == "a"
