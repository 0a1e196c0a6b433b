"""Reservations converge on a real nats-server: ledgers and instance records are written directly, as a
runner would write them, with no runner events at all (lost), and the ledger follows the records."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from actors.placement.actor import PlacementActor, ledger_key
from messages.events import InstanceReady, InstanceStopped
from messages.memory import MemoryBreakdown
from messages.placement import NodeLedger, Reservation
from messages.runner import InstanceState, InstanceStatus, ObservedMemory
from runtime import buckets
from runtime.bus import Bus, decode, encode
from runtime.journal import Journal
from tests.conftest import JournalReader, of_type, put_telemetry, supervised
from tests.harness.placement import GIB, SUBJECTS, ask, ledger, place, report, wait_view
from tests.tiny_models import write_llama

OBSERVED = ObservedMemory(
    kv_bytes=1, recurrent_bytes=0, draft_kv_bytes=0, weights_bytes=1, compute_bytes=1, output_bytes=1,
    total_bytes=123_456,
)  # fmt: skip


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_llama(tmp_path / "dense.gguf", n_layer=4)


@pytest.fixture
async def placement(bus: Bus) -> AsyncIterator[PlacementActor]:
    actor = PlacementActor(sweep_interval_s=0.1, claim_grace_s=30.0)
    async with supervised(bus, [actor], node_id="p1"):
        await put_telemetry(bus, report("a", 8 * GIB))
        await wait_view(actor, "a")
        yield actor


async def claim(bus: Bus, rid: str, instance_id: str) -> Reservation:
    """What the node's runner does before spawning: reserved -> starting, with compare-and-set."""
    kv = await buckets.reservations(bus, SUBJECTS)
    entry = await kv.get(ledger_key("a"))
    book = decode(entry.value or b"", NodeLedger)
    current = next(r for r in book.reservations if r.reservation_id == rid)
    assert current.state == "reserved"
    claimed = msgspec.structs.replace(current, state="starting", instance_id=instance_id)
    others = tuple(r for r in book.reservations if r.reservation_id != rid)
    await kv.update(
        ledger_key("a"), encode(NodeLedger(node_id="a", reservations=(*others, claimed))), last=entry.revision
    )
    return claimed


async def put_record(
    bus: Bus, reservation: Reservation, instance_id: str, state: InstanceState, *, ttl_s: int = 30
) -> None:
    """The runner's record of one instance, with its per-message TTL (as `actors/runner` writes it)."""
    record = InstanceStatus(
        id=instance_id,
        node="a",
        reservation_id=reservation.reservation_id,
        state=state,
        port=None,
        model_path=reservation.model_path,
        settings=reservation.stamp,
        predicted_memory=PREDICTED[reservation.reservation_id],
        observed_memory=OBSERVED if state == "ready" else None,
        updated_at=time.time() + 30,  # the node's clock (30 s ahead of ours): only compared with its reports
    )
    await buckets.instances(bus, SUBJECTS)
    await bus.js.publish(
        f"$KV.{SUBJECTS.instances_bucket}.{SUBJECTS.instance_key('a', instance_id)}",
        encode(record),
        headers={"Nats-TTL": f"{ttl_s}s"},
    )


PREDICTED: dict[str, MemoryBreakdown] = {}


async def admit(bus: Bus, model: Path, hold_s: float) -> str:
    decision = await place(bus, ask(model, ctx=2048, hold_s=hold_s))
    assert decision.admitted and decision.reservation_id, decision.message
    PREDICTED[decision.reservation_id] = decision.placements[0].breakdown
    return decision.reservation_id


async def held(bus: Bus) -> dict[str, Reservation]:
    return {r.reservation_id: r for r in (await ledger(bus, "a")).reservations}


async def test_a_claimed_reservation_outlives_its_hold_then_follows_its_record_to_running_and_stopped(
    bus: Bus, placement: PlacementActor, model: Path, journal_reader: JournalReader
) -> None:
    rid = await admit(bus, model, hold_s=2.0)
    claimed = await claim(bus, rid, "i1")
    await put_record(bus, claimed, "i1", "starting")
    canary = await admit(bus, model, hold_s=2.0)  # booked after: its expiry proves rid's hold has passed too
    await journal_reader.wait_for(of_type("reservation_released", reservation_id=canary, reason="expired"))
    assert (await held(bus))[rid].state == "starting"  # a slow load keeps its memory

    await put_record(bus, claimed, "i1", "restarting")  # a crash before the first ready: still held
    await put_record(bus, claimed, "i1", "ready")  # its instance_ready was lost: the record says it
    (observed,) = await journal_reader.wait_for(of_type("reservation_observed", reservation_id=rid))
    running = (await held(bus))[rid]
    assert running.state == "running" and running.instance_id == "i1" and running.expires_at is None
    assert running.held == observed["held"] == {"CPU": OBSERVED.total_bytes}

    await put_record(bus, claimed, "i1", "stopped", ttl_s=600)  # its instance_stopped was lost too
    (released,) = await journal_reader.wait_for(of_type("reservation_released", reservation_id=rid))
    assert released["reason"] == "stopped"
    assert rid not in await held(bus)


@pytest.fixture
async def quick_placement(bus: Bus) -> AsyncIterator[PlacementActor]:
    """A placement actor whose claims wait 1 s for a missing record."""
    actor = PlacementActor(sweep_interval_s=0.1, claim_grace_s=1.0)
    async with supervised(bus, [actor], node_id="p1"):
        await put_telemetry(bus, report("a", 8 * GIB))
        await wait_view(actor, "a")
        yield actor


async def test_a_claimed_reservation_whose_record_expires_is_released(
    bus: Bus, quick_placement: PlacementActor, model: Path, journal_reader: JournalReader
) -> None:
    rid = await admit(bus, model, hold_s=600.0)
    claimed = await claim(bus, rid, "i2")
    await put_record(bus, claimed, "i2", "ready", ttl_s=1)  # its runner dies: nobody refreshes the record
    # released once its node has reported for the claim grace without the record
    (released,) = await journal_reader.wait_for(of_type("reservation_released", reservation_id=rid), timeout=20)
    assert released["reason"] == "instance_gone"
    assert rid not in await held(bus)


async def test_a_node_that_is_away_keeps_its_claims_until_it_reports_again(
    bus: Bus, quick_placement: PlacementActor, model: Path, journal_reader: JournalReader
) -> None:
    # Cut off, a node's telemetry expires (15 s) before its runner's records (30 s): nothing can be booked on it
    # while it is away, and its servers may still run, so their memory stays booked (issue 30).
    rid = await admit(bus, model, hold_s=600.0)
    canary = await admit(bus, model, hold_s=4.0)  # its expiry proves passes ran well past the grace meanwhile
    claimed = await claim(bus, rid, "i3")
    await put_record(bus, claimed, "i3", "ready")
    reconciler = quick_placement._reconciler
    await journal_reader.wait_for(of_type("reservation_observed", reservation_id=rid))  # running, on this node
    started_at = quick_placement._view["a"].resources.started_at
    nodes = await buckets.nodes(bus, SUBJECTS)
    await nodes.delete("a")  # what its TTL does when the node stops reporting
    async with asyncio.timeout(10):
        while "a" in quick_placement._view:
            await asyncio.sleep(0.02)
    kv = await buckets.instances(bus, SUBJECTS)
    await kv.purge(SUBJECTS.instance_key("a", "i3"))  # and then its record's
    async with asyncio.timeout(10):
        while reconciler.record("i3") is not None:
            await asyncio.sleep(0.02)
    await journal_reader.wait_for(of_type("reservation_released", reservation_id=canary, reason="expired"))
    assert (await held(bus))[rid].instance_id == "i3"  # kept while the node is away
    # the same node process reports again (a restart is another case: node_restarted), and no record comes back
    await put_telemetry(bus, report("a", 8 * GIB, seq=2, started_at=started_at))
    (released,) = await journal_reader.wait_for(of_type("reservation_released", reservation_id=rid), timeout=20)
    assert released["reason"] == "instance_gone"


async def test_a_late_instance_ready_does_not_revive_a_released_reservation(
    bus: Bus, placement: PlacementActor, model: Path, journal_reader: JournalReader
) -> None:
    rid = await admit(bus, model, hold_s=0.3)
    await journal_reader.wait_for(of_type("reservation_released", reservation_id=rid, reason="expired"))
    marker = await admit(bus, model, hold_s=600.0)
    runner = Journal(bus, SUBJECTS, "a")
    task = asyncio.create_task(runner.run())
    try:
        breakdown = PREDICTED[rid]
        runner.emit(InstanceReady, "runner", instance_id="late", reservation_id=rid, port=1, predicted=breakdown,
                    observed=OBSERVED)  # fmt: skip
        # Applied in order after the late ready: once the marker is released, the ready has been handled.
        runner.emit(InstanceStopped, "runner", instance_id="m", reservation_id=marker, reason="stop requested")
        await journal_reader.wait_for(of_type("reservation_released", reservation_id=marker))
    finally:
        await runner.flush(5)
        task.cancel()
    assert rid not in await held(bus)
    assert not [e for e in journal_reader.events if e.get("type") == "reservation_observed"]
