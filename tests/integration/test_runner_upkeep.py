"""A runner keeps its node's records and bookings true to what it runs, on a real nats-server.

- A runner that starts (after a kill -9, or a connection that died before it could clean up) removes its
  predecessor's instance records at once, so nobody lists dead instances until their TTL, and releases the
  reservations those instances claimed.
- A runner whose reservation was released while it could not refresh its records (placement's `instance_gone`)
  books it again, or stops the instance when its memory was given to an instance now running.

The "engine" is a Python script that sleeps (the `rewrite_command` seam): what is tested is the runner's own
reading and writing of the buckets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import cast

import msgspec
import nats.js.errors
import pytest
from nats.js.kv import KeyValue

from actors.placement.actor import PlacementActor
from actors.runner.actor import RunnerActor
from messages.events import ActorStopped
from messages.placement import NodeLedger, Reservation
from messages.runner import InstanceState, InstanceStatus
from runtime import buckets
from runtime.bus import Bus, decode, encode
from runtime.journal import Journal
from tests import tiny_models
from tests.conftest import JournalReader, of_type, put_telemetry, supervised
from tests.harness.placement import ask, place, report
from tests.harness.runner import (
    GIB,
    NODE,
    QUICK,
    SLEEPER,
    SUBJECTS,
    _predict,
    _put_ledger,
    _put_telemetry,
    _reservation,
    _start,
)
from tests.harness.upkeep import SETTINGS, ledger, runner


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.write_llama(tmp_path_factory.mktemp("upkeep") / "llama.gguf", n_layer=2, n_vocab=300)


async def record_keys(bus: Bus) -> set[str]:
    kv = await buckets.instances(bus, SUBJECTS)
    try:
        keys = await kv.keys()
    except nats.js.errors.NoKeysError:
        return set()
    live = set()
    for key in keys:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            if (await kv.get(key)).value:
                live.add(key)
    return live


async def put_record(
    bus: Bus, reservation: Reservation, instance_id: str, *, node: str = NODE, state: InstanceState = "ready"
) -> None:
    """A record as a runner writes it (a long TTL: it outlives the test unless someone removes it)."""
    record = InstanceStatus(
        id=instance_id, node=node, reservation_id=reservation.reservation_id, state=state, port=1,
        model_path=reservation.model_path, settings=reservation.stamp,
        predicted_memory=_predict(Path(reservation.model_path), reservation.stamp.settings, reservation.stamp.ctx),
        updated_at=time.time(),
    )  # fmt: skip
    await buckets.instances(bus, SUBJECTS)
    await bus.js.publish(
        f"$KV.{SUBJECTS.instances_bucket}.{SUBJECTS.instance_key(node, instance_id)}",
        encode(record),
        headers={"Nats-TTL": "600s"},
    )


async def wait_for_records(bus: Bus, expected: set[str]) -> None:
    async with asyncio.timeout(10):
        while await record_keys(bus) != expected:
            await asyncio.sleep(0.05)


async def test_a_starting_runner_removes_its_predecessors_records_and_releases_their_claims(
    bus: Bus, journal_reader: JournalReader, model: Path, tmp_path: Path
) -> None:
    # What a node killed with -9 leaves: records of instances that died with it, and their claims.
    starting = msgspec.structs.replace(
        _reservation("r-old-1", model, SETTINGS, 512), state="starting", instance_id="old-1"
    )
    running = msgspec.structs.replace(
        _reservation("r-old-2", model, SETTINGS, 512), state="running", instance_id="old-2"
    )
    unclaimed = _reservation("r-new", model, SETTINGS, 512)  # just booked by a placement: a start may follow
    await _put_ledger(bus, starting, running, unclaimed)
    await _put_telemetry(bus)
    await put_record(bus, starting, "old-1")
    await put_record(bus, running, "old-2")
    elsewhere = _reservation("r-b", model, SETTINGS, 512, node="node-b")
    await put_record(bus, elsewhere, "b-1", node="node-b")  # another node's: not this runner's to touch
    assert await record_keys(bus) == {f"{NODE}.old-1", f"{NODE}.old-2", "node-b.b-1"}

    async with runner(bus, tmp_path / "data"):
        await wait_for_records(bus, {"node-b.b-1"})
        released = await journal_reader.wait_for(of_type("reservation_released"), count=2)
        assert {(e["reservation_id"], e["reason"]) for e in released} == {
            ("r-old-1", "instance_gone"),
            ("r-old-2", "instance_gone"),
        }
        assert [r.reservation_id for r in (await ledger(bus)).reservations] == ["r-new"]
        ack = await _start(bus, "r-new")  # and the node serves as before
        assert ack.state == "starting"


async def test_an_instance_whose_reservation_was_released_while_cut_off_is_booked_again(
    bus: Bus, journal_reader: JournalReader, model: Path, tmp_path: Path
) -> None:
    await _put_ledger(bus, _reservation("r-1", model, SETTINGS, 512))
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data"):
        ack = await _start(bus, "r-1")
        claimed = (await ledger(bus)).reservations[0]
        assert (claimed.state, claimed.instance_id) == ("starting", ack.instance_id)
        # Placement released it (`instance_gone`): the runner could not refresh its record for its TTL.
        await _put_ledger(bus)
        (rebooked,) = await journal_reader.wait_for(of_type("reservation_rebooked", reservation_id="r-1"))
        assert rebooked["outcome"] == "rebooked" and rebooked["instance_id"] == ack.instance_id
        (back,) = (await ledger(bus)).reservations
        assert (back.reservation_id, back.state, back.instance_id) == ("r-1", "starting", ack.instance_id)
        assert back.held == claimed.held


async def test_a_record_of_this_node_saying_live_an_instance_it_does_not_run_is_removed(
    bus: Bus, model: Path, tmp_path: Path
) -> None:
    # A NATS server killed with -9 brought back records purged before its crash, with their old values and
    # TTLs no longer running (benchmarks/chaos.py): a ready instance that does not exist, listed for ever.
    await _put_ledger(bus, _reservation("r-1", model, SETTINGS, 512))
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data"):
        ack = await _start(bus, "r-1")
        await wait_for_records(bus, {f"{NODE}.{ack.instance_id}"})
        gone = _reservation("r-gone", model, SETTINGS, 512)
        await put_record(bus, gone, "phantom")  # says ready; nothing runs it
        await put_record(bus, gone, "ended", state="stopped")  # how an instance ended: kept for its TTL
        await put_record(bus, _reservation("r-b", model, SETTINGS, 512, node="node-b"), "b-1", node="node-b")
        await wait_for_records(bus, {f"{NODE}.{ack.instance_id}", f"{NODE}.ended", "node-b.b-1"})


async def test_an_instance_whose_memory_went_to_a_running_instance_is_stopped(
    bus: Bus, journal_reader: JournalReader, model: Path, tmp_path: Path
) -> None:
    await _put_ledger(bus, _reservation("r-1", model, SETTINGS, 512))
    await _put_telemetry(bus, usable=64 * GIB)
    async with runner(bus, tmp_path / "data"):
        ack = await _start(bus, "r-1")
        # Released while the runner was cut off, and the memory booked by an instance that now runs.
        newcomer = msgspec.structs.replace(
            _reservation("r-2", model, SETTINGS, 512), state="running", instance_id="i-2", held={"CPU": 64 * GIB}
        )
        await _put_ledger(bus, newcomer)
        (event,) = await journal_reader.wait_for(of_type("reservation_rebooked", reservation_id="r-1"))
        assert event["outcome"] == "stopping" and "CPU" in event["reason"]
        (stopped,) = await journal_reader.wait_for(of_type("instance_stopped", instance_id=ack.instance_id))
        assert "released while this runner was cut off" in stopped["reason"]
        # Its memory stayed booked until its server was gone (then placement releases it on that event).
        assert {r.reservation_id for r in (await ledger(bus)).reservations} == {"r-1", "r-2"}


async def test_after_an_outage_a_live_servers_reservation_is_never_released(
    bus: Bus, journal_reader: JournalReader, model: Path, tmp_path: Path
) -> None:
    # The runner could not refresh its instance's record for its TTL: the record expired. Placement released the
    # reservation of a server that still ran (`instance_gone`) and the runner booked it again, but in between
    # its memory looked free and could be booked twice (issue 30). Now placement keeps it: the runner back from
    # the outage rewrites the record within the claim grace, and the reservation never leaves the ledger.
    placement = PlacementActor(sweep_interval_s=0.1, claim_grace_s=30.0)
    limits = dataclasses.replace(QUICK, status_ttl_s=9.0)  # the record is refreshed every 3 s
    actor = RunnerActor(
        NODE, tmp_path / "data", Path(sys.executable), lambda: SETTINGS, limits=limits, engine_version="test",
        rewrite_command=lambda argv: SLEEPER, booking_check_s=0.2,
    )  # fmt: skip
    await put_telemetry(bus, report(NODE, 64 * GIB, settings=SETTINGS))  # settings advertised: placement admits
    async with supervised(bus, [placement, actor], node_id=NODE):
        async with asyncio.timeout(10):
            while NODE not in placement._view:
                await asyncio.sleep(0.02)
        decision = await place(bus, ask(model, ctx=512, nodes=(NODE,)))
        assert decision.admitted and decision.reservation_id, decision.message
        rid = decision.reservation_id
        ack = await _start(bus, rid)
        reconciler = placement._reconciler
        async with asyncio.timeout(10):
            while reconciler.record(ack.instance_id) is None:
                await asyncio.sleep(0.02)

        kv = await buckets.instances(bus, SUBJECTS)
        key = SUBJECTS.instance_key(NODE, ack.instance_id)
        books = await buckets.reservations(bus, SUBJECTS)
        records = cast(AsyncGenerator[KeyValue.Entry, None], buckets.watch(kv, None, key=key))
        ledgers = cast(AsyncGenerator[KeyValue.Entry, None], buckets.watch(books, None, key=f"node.{NODE}"))
        try:
            async with asyncio.timeout(10):
                book = await anext(ledgers)  # the ledger as it is: the watch runs from here on
                await anext(records)  # the record as it is
                await anext(records)  # its next refresh: the one after is 3 s away
            await kv.purge(key)  # what its TTL does when nobody refreshes it
            async with asyncio.timeout(10):  # placement sees the record gone, then back with the next refresh
                while reconciler.record(ack.instance_id) is not None:
                    await asyncio.sleep(0.02)
                while reconciler.record(ack.instance_id) is None:
                    await asyncio.sleep(0.02)
            # Every revision of the ledger written meanwhile (a release, a re-booking) holds the reservation.
            latest = (await books.get(f"node.{NODE}")).revision or 0
            seen = [decode(book.value or b"", NodeLedger)]
            async with asyncio.timeout(10):
                while (book.revision or 0) < latest:
                    book = await anext(ledgers)
                    seen.append(decode(book.value or b"", NodeLedger))
            assert all(rid in {r.reservation_id for r in revision.reservations} for revision in seen), seen
        finally:
            await records.aclose()
            await ledgers.aclose()
        (held,) = [r for r in (await ledger(bus)).reservations if r.reservation_id == rid]
        assert held.instance_id == ack.instance_id
        # Everything journaled until now, read up to a marker: no release, and so no re-booking.
        marker = Journal(bus, SUBJECTS, "test")
        task = asyncio.create_task(marker.run())
        try:
            marker.emit(ActorStopped, "upkeep-test-marker")
            await journal_reader.wait_for(of_type("actor_stopped", actor="upkeep-test-marker"))
        finally:
            await marker.flush(5)
            task.cancel()
        kinds = [e["type"] for e in journal_reader.events if e.get("reservation_id") == rid]
        assert "reservation_released" not in kinds and "reservation_rebooked" not in kinds, kinds
