"""A split over nodes on a real nats-server: admitted only when no node holds the model alone, booked on every
member's ledger or on none, and reconciled as one (a member's part follows its head's part)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats.js.errors
import pytest

from actors.placement.actor import PlacementActor, ledger_key
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.replay import differences, recompute
from messages.events import PlacementDecided
from messages.memory import MemoryBreakdown
from messages.placement import NodeLedger, PlacementDecision, Reservation
from messages.runner import InstanceState, InstanceStatus, ObservedMemory
from runtime import buckets
from runtime.bus import Bus, RemoteError, decode, encode
from tests.conftest import JournalReader, of_type, put_telemetry, supervised
from tests.harness.placement import SUBJECTS, ask, ledger, need, place, report, wait_view
from tests.tiny_models import write_llama

OBSERVED = ObservedMemory(
    kv_bytes=1, recurrent_bytes=0, draft_kv_bytes=0, weights_bytes=1, compute_bytes=1, output_bytes=1,
    total_bytes=123_456,
)  # fmt: skip


PREDICTED = msgspec.convert(
    {
        "estimator_version": "test", "llama_cpp_version": "test", "architecture": "llama", "kv_bytes": 0,
        "kv_k_bytes": 0, "kv_v_bytes": 0, "kv_swa_bytes": 0, "recurrent_bytes": 0, "draft_kv_bytes": 0,
        "weights_bytes": 0, "compute_bytes": 0, "output_bytes": 0, "host_extra_bytes": 0, "total_bytes": 0,
        "devices": [], "compute_error_ratio": 0.0,
        "context": {"n_ctx": 0, "n_ctx_seq": 0, "n_seq_max": 0, "n_stream": 0, "n_rs_seq": 0, "n_ubatch": 0,
                    "swa_cells": 0},
    },
    MemoryBreakdown,
)  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("split") / "dense.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512)


class FlakyLedgers(PlacementActor):
    """A placement actor whose ledger writes fail on demand: `lose` makes the next write to a node lose its
    compare-and-set (another placement wrote first), `break_` makes it raise (its outcome unknown)."""

    lose: set[str]
    break_: set[str]

    async def _write_ledger(self, node: str, ledger: NodeLedger, revision: int) -> int | None:
        if node in self.lose:
            self.lose.discard(node)
            return None
        if node in self.break_:
            self.break_.discard(node)
            raise TimeoutError(f"writing the ledger of {node} timed out")
        return await super()._write_ledger(node, ledger, revision)


@pytest.fixture
async def placement(bus: Bus, model: Path) -> AsyncIterator[FlakyLedgers]:
    actor = FlakyLedgers(sweep_interval_s=0.1, claim_grace_s=30.0)
    actor.lose, actor.break_ = set(), set()
    async with supervised(bus, [actor], node_id="p1"):
        usable = int(need(model) * 0.7)  # two nodes hold it together, none alone
        for name in ("a", "b", "c"):
            await put_telemetry(bus, report(name, usable))
        await wait_view(actor, "a", "b", "c")
        yield actor


async def parts(bus: Bus, rid: str, nodes: tuple[str, ...] = ("a", "b", "c")) -> dict[str, Reservation]:
    kv = await buckets.reservations(bus, SUBJECTS)
    out: dict[str, Reservation] = {}
    for name in nodes:
        try:
            entry = await kv.get(ledger_key(name))
        except nats.js.errors.KeyNotFoundError:
            continue
        for r in decode(entry.value or b"", NodeLedger).reservations:
            if r.reservation_id == rid:
                out[name] = r
    return out


async def admitted_split(bus: Bus, model: Path) -> PlacementDecision:
    decision = await place(bus, ask(model, allow_multi_node=True))
    assert decision.admitted and decision.multi_node and decision.reservation_id, decision.message
    return decision


async def test_a_model_no_node_holds_is_split_and_booked_on_every_member(
    bus: Bus, placement: FlakyLedgers, model: Path, journal_reader: JournalReader
) -> None:
    refused = await place(bus, ask(model))
    assert not refused.admitted and refused.reason == "insufficient_memory"  # not allowed: not split
    decision = await admitted_split(bus, model)
    stamp = decision.stamp
    assert stamp is not None and len(stamp.rpc) == len(decision.placements) - 1 >= 1
    assert decision.reservation_id is not None
    booked = await parts(bus, decision.reservation_id)
    assert set(booked) == {p.node_id for p in decision.placements}
    for placement_ in decision.placements:
        part = booked[placement_.node_id]
        assert part.split is not None and part.split.head == decision.placements[0].node_id
        assert part.held == {"CPU": placement_.breakdown.total_bytes} and part.layers == placement_.layers
    (event,) = await journal_reader.wait_for(
        lambda e: of_type("placement_decided")(e) and e["decision"]["decision_id"] == decision.decision_id
    )
    assert event["decision"]["multi_node"] and event["decision"]["stamp"]["rpc"]
    recorded = msgspec.convert(event, PlacementDecided)
    geometry = geometry_from_header(read_header(model))
    assert differences(recorded.decision, recompute(recorded, geometry)) == []  # replay decides the same split


async def test_a_lost_compare_and_set_on_a_member_takes_the_head_back_and_decides_again(
    bus: Bus, placement: FlakyLedgers, model: Path
) -> None:
    dry = await place(bus, ask(model, allow_multi_node=True), fit=True)
    member = dry.placements[1].node_id
    placement.lose.add(member)  # another placement wins that ledger once
    decision = await admitted_split(bus, model)
    assert decision.reservation_id is not None
    booked = await parts(bus, decision.reservation_id)
    assert set(booked) == {p.node_id for p in decision.placements}
    # nothing of the first attempt stays behind: one part per node, in every ledger
    for name in ("a", "b", "c"):
        try:
            assert len((await ledger(bus, name)).reservations) == (1 if name in booked else 0)
        except nats.js.errors.KeyNotFoundError:
            assert name not in booked


async def test_a_failed_write_books_nothing_half_way(bus: Bus, placement: FlakyLedgers, model: Path) -> None:
    dry = await place(bus, ask(model, allow_multi_node=True), fit=True)
    placement.break_.add(dry.placements[1].node_id)
    with pytest.raises(RemoteError):
        await place(bus, ask(model, allow_multi_node=True))
    for name in ("a", "b", "c"):
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            assert (await ledger(bus, name)).reservations == ()  # the head's part was taken back


async def claim(bus: Bus, node: str, rid: str, instance_id: str) -> Reservation:
    """What the head's runner does before spawning: reserved -> starting, with compare-and-set."""
    kv = await buckets.reservations(bus, SUBJECTS)
    entry = await kv.get(ledger_key(node))
    book = decode(entry.value or b"", NodeLedger)
    current = next(r for r in book.reservations if r.reservation_id == rid)
    claimed = msgspec.structs.replace(current, state="starting", instance_id=instance_id)
    others = tuple(r for r in book.reservations if r.reservation_id != rid)
    await kv.update(
        ledger_key(node), encode(NodeLedger(node_id=node, reservations=(*others, claimed))), last=entry.revision
    )
    return claimed


async def put_record(bus: Bus, node: str, reservation: Reservation, instance_id: str, state: InstanceState) -> None:
    record = InstanceStatus(
        id=instance_id,
        node=node,
        reservation_id=reservation.reservation_id,
        state=state,
        port=None,
        model_path=reservation.model_path,
        settings=reservation.stamp,
        predicted_memory=PREDICTED,
        observed_memory=OBSERVED if state == "ready" else None,
        updated_at=time.time(),
    )
    await buckets.instances(bus, SUBJECTS)
    await bus.js.publish(
        f"$KV.{SUBJECTS.instances_bucket}.{SUBJECTS.instance_key(node, instance_id)}",
        encode(record),
        headers={"Nats-TTL": "60s"},
    )


async def test_members_parts_follow_the_heads_part_to_running_and_to_release(
    bus: Bus, placement: FlakyLedgers, model: Path, journal_reader: JournalReader
) -> None:
    decision = await admitted_split(bus, model)
    rid = decision.reservation_id
    assert rid is not None
    head = decision.placements[0].node_id
    members = [p.node_id for p in decision.placements[1:]]
    claimed = await claim(bus, head, rid, "i1")
    await put_record(bus, head, claimed, "i1", "ready")
    async with asyncio.timeout(10):
        while {p.state for p in (await parts(bus, rid)).values()} != {"running"}:
            await asyncio.sleep(0.05)
    booked = await parts(bus, rid)
    assert booked[head].held == claimed.held  # a split keeps its prediction
    assert all(booked[m].instance_id == "i1" and booked[m].running_since is not None for m in members)
    await put_record(bus, head, claimed, "i1", "stopped")
    for member in members:
        await journal_reader.wait_for(
            of_type("reservation_released", reservation_id=rid, node_id_released=member, reason="head_released")
        )
    assert await parts(bus, rid) == {}
