"""What a hostile client sends to placement, through the real subjects: oversized or malformed fields are
`bad_request`s at decode, a hold over the node's maximum is refused by name, and a booking whose decision never
reaches its requester does not stay booked. The actor keeps serving throughout."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from actors.placement.actor import PlacementActor
from messages.placement import MAX_REQUEST_NODES
from runtime.bus import Bus
from tests.conftest import JournalReader, of_type, put_telemetry, supervised
from tests.integration.test_placement import GIB, SUBJECTS, ledger, report, wait_view
from tests.tiny_models import write_llama


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_llama(tmp_path / "dense.gguf", n_layer=4)


@pytest.fixture
async def placement(bus: Bus) -> AsyncIterator[PlacementActor]:
    actor = PlacementActor(max_hold_s=900.0)
    async with supervised(bus, [actor], node_id="p1"):
        await put_telemetry(bus, report("a", 8 * GIB))
        await wait_view(actor, "a")
        yield actor


async def answer(bus: Bus, body: dict[str, Any], *, fit: bool = False) -> dict[str, Any]:
    subject = SUBJECTS.placement_fit if fit else SUBJECTS.placement_request
    async with asyncio.timeout(10):
        while True:
            try:
                msg = await bus.nc.request(subject, json.dumps(body).encode(), timeout=10)
                break
            except nats.errors.NoRespondersError:  # the view can fill before the actor adds its endpoints
                await asyncio.sleep(0.02)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


async def booked(bus: Bus) -> list[str]:
    try:
        return [r.reservation_id for r in (await ledger(bus, "a")).reservations]
    except Exception:  # no ledger yet: nothing booked
        return []


async def test_oversized_and_malformed_fields_are_bad_requests_naming_the_field(
    bus: Bus, placement: PlacementActor, model: Path
) -> None:
    good = {"model": {"path": str(model)}, "ctx": 2048}
    hostile = {
        "registry climbs": ({**good, "model": {"registry": "../x"}}, "$.model.registry"),
        "registry NUL": ({**good, "model": {"registry": "dense\x00"}}, "$.model.registry"),
        "registry 300 chars": ({**good, "model": {"registry": "r" * 300}}, "$.model.registry"),
        "50,000 nodes": ({**good, "nodes": [f"n{i}" for i in range(50_000)]}, "$.nodes"),
        "one over the node limit": ({**good, "nodes": ["a"] * (MAX_REQUEST_NODES + 1)}, "$.nodes"),
        "a node id that is no subject token": ({**good, "nodes": ["a b"]}, "$.nodes[0]"),
        "a node id with a wildcard": ({**good, "nodes": [">"]}, "$.nodes[0]"),
        "512 KiB request id": ({**good, "request_id": "x" * (512 << 10)}, "$.request_id"),
    }
    for i, (case, (body, path)) in enumerate(hostile.items()):
        reply = await answer(bus, body, fit=bool(i % 2))
        assert reply.get("code") == "bad_request", (case, str(reply)[:300])
        assert reply["details"]["path"] == path, (case, reply)
    assert await booked(bus) == []

    ok = await answer(bus, {**good, "nodes": ["a"] * MAX_REQUEST_NODES, "request_id": "x" * 256})
    assert ok["admitted"] is True and ok["request_id"] == "x" * 256, ok


async def test_a_hold_over_the_nodes_maximum_is_refused_by_name_and_books_nothing(
    bus: Bus, placement: PlacementActor, model: Path
) -> None:
    # 19 requests holding a day each booked every byte of a node: a node bounds the hold it grants.
    for fit in (True, False):
        reply = await answer(bus, {"model": {"path": str(model)}, "ctx": 2048, "hold_s": 86400}, fit=fit)
        assert reply["admitted"] is False and reply["reason"] == "hold_too_long", reply
        assert "900s" in reply["message"]
    assert await booked(bus) == []
    within = await answer(bus, {"model": {"path": str(model)}, "ctx": 2048, "hold_s": 900})
    assert within["admitted"] is True
    assert await booked(bus) == [within["reservation_id"]]


async def test_a_decision_too_large_to_send_leaves_nothing_booked(
    bus: Bus, placement: PlacementActor, model: Path, journal_reader: JournalReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's max_payload as the actor sees it, lowered below the size of an admitted decision (a request
    # is much smaller): the booking is made, then the decision cannot be sent.
    monkeypatch.setattr(Bus, "max_payload", property(lambda self: 1500))
    reply = await answer(bus, {"model": {"path": str(model)}, "ctx": 2048})
    assert reply["code"] == "internal" and "nothing stays booked" in reply["message"], reply
    (released,) = await journal_reader.wait_for(of_type("reservation_released", reason="undelivered"))
    assert await booked(bus) == []
    assert released["node_id_released"] == "a"


async def test_a_booking_whose_request_deadline_passed_is_released(
    bus: Bus, model: Path, journal_reader: JournalReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    actor = PlacementActor()
    journaled = asyncio.Event()

    async def stuck_journal(*args: object, **kwargs: object) -> None:
        journaled.set()
        await asyncio.Event().wait()  # the decision is booked; answering it takes past the deadline

    monkeypatch.setattr(actor, "_journal", stuck_journal)
    async with supervised(bus, [actor], node_id="p1", request_deadline_s=1.0):
        await put_telemetry(bus, report("a", 8 * GIB))
        await wait_view(actor, "a")
        reply = await answer(bus, {"model": {"path": str(model)}, "ctx": 2048})
        assert reply["code"] == "timeout", reply
        assert journaled.is_set()
        (released,) = await journal_reader.wait_for(of_type("reservation_released", reason="undelivered"))
        assert await booked(bus) == []
        assert released["node_id_released"] == "a"
