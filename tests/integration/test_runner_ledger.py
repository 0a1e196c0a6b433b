"""A runner's node ledger as a hostile peer may leave it, on a real nats-server (issue 30, F9).

Placement books on every node, so any node may write, delete or purge any ledger. A deleted or purged ledger
is a marker whose revision the next compare-and-set must name: the runner books what runs again. A ledger that
does not decode is logged as an error and replaced by what runs (nothing, on an idle node), instead of leaving
the runner unable to book what it runs and the node out of placement.

The "engine" is a Python script that sleeps (`test_runner_upkeep.runner`): what is tested is the runner's own
reading and writing of the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import msgspec
import nats.js.errors
import pytest

from messages.placement import NodeLedger
from runtime import buckets
from runtime.bus import Bus, decode
from tests import tiny_models
from tests.conftest import JournalReader, of_type
from tests.harness.runner import NODE, SUBJECTS, _put_ledger, _put_telemetry, _reservation, _start
from tests.harness.upkeep import SETTINGS, ledger, runner


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.write_llama(tmp_path_factory.mktemp("ledger") / "llama.gguf", n_layer=2, n_vocab=300)


@pytest.mark.parametrize("remove", ["delete", "purge"])
async def test_an_instance_whose_ledger_was_deleted_is_booked_again(
    bus: Bus, journal_reader: JournalReader, model: Path, tmp_path: Path, remove: str
) -> None:
    # Any node may write (so delete) any ledger. What is left is a marker, whose revision the next write names:
    # a compare-and-set on "no key" (0) fails for ever, and the instance ran unbooked.
    await _put_ledger(bus, _reservation("r-1", model, SETTINGS, 512))
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data"):
        ack = await _start(bus, "r-1")
        kv = await buckets.reservations(bus, SUBJECTS)
        await (kv.delete if remove == "delete" else kv.purge)(f"node.{NODE}")
        (rebooked,) = await journal_reader.wait_for(of_type("reservation_rebooked", reservation_id="r-1"))
        assert rebooked["outcome"] == "rebooked" and rebooked["instance_id"] == ack.instance_id
        (back,) = (await ledger(bus)).reservations
        assert (back.reservation_id, back.state, back.instance_id) == ("r-1", "starting", ack.instance_id)


async def test_a_ledger_that_does_not_decode_is_replaced_by_what_runs(
    bus: Bus, journal_reader: JournalReader, model: Path, tmp_path: Path
) -> None:
    # Any node may write any ledger: garbage there must not stop the runner from booking what it runs.
    await _put_ledger(bus, _reservation("r-1", model, SETTINGS, 512))
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data"):
        ack = await _start(bus, "r-1")
        kv = await buckets.reservations(bus, SUBJECTS)
        await kv.put(f"node.{NODE}", b'{"node_id": 7, "reservations": "none of them"}')
        (rebooked,) = await journal_reader.wait_for(of_type("reservation_rebooked", reservation_id="r-1"))
        assert rebooked["outcome"] == "rebooked" and "did not decode" in rebooked["reason"], rebooked
        (back,) = (await ledger(bus)).reservations
        assert (back.reservation_id, back.instance_id) == ("r-1", ack.instance_id)


async def decoded_ledger(bus: Bus) -> NodeLedger:
    """The node's ledger once it decodes again (the runner replaced what did not)."""
    kv = await buckets.reservations(bus, SUBJECTS)
    async with asyncio.timeout(10):
        while True:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError, msgspec.DecodeError):
                entry = await kv.get(f"node.{NODE}")
                return decode(entry.value or b"", NodeLedger)
            await asyncio.sleep(0.05)


async def test_an_idle_runner_replaces_a_ledger_that_does_not_decode_and_serves_again(
    bus: Bus, model: Path, tmp_path: Path
) -> None:
    # Placement books nothing on a node whose ledger does not decode, so an idle node with garbage for a ledger
    # would stay out of the mesh: its runner writes what runs there (nothing) in its place.
    kv = await buckets.reservations(bus, SUBJECTS)
    await kv.put(f"node.{NODE}", b"\xff not a ledger")
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data"):
        assert await decoded_ledger(bus) == NodeLedger(node_id=NODE)  # when the runner started
        await kv.put(f"node.{NODE}", b"[1, 2")
        assert await decoded_ledger(bus) == NodeLedger(node_id=NODE)  # while it is idle
        await _put_ledger(bus, _reservation("r-1", model, SETTINGS, 512))
        ack = await _start(bus, "r-1")  # and the node serves again
        assert ack.state == "starting"
