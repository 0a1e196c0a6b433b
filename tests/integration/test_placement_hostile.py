"""What a hostile client sends to placement, through the real subjects: oversized or malformed fields are
`bad_request`s at decode, a hold over the node's maximum is refused by name, and a booking whose decision never
reaches its requester does not stay booked. The actor keeps serving throughout. What one client holds booked at
once is its share of each node."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest

from actors.placement.actor import PlacementActor
from messages.placement import MAX_REQUEST_NODES
from runtime.bus import Bus
from runtime.embedded import EmbeddedNats
from runtime.roles import Role
from tests.conftest import JournalReader, of_type, put_telemetry, supervised
from tests.harness.nats_roles import admin_bus, bus_when_loaded, issued
from tests.harness.placement import GIB, SUBJECTS, ledger, report, wait_view
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


# --- what one client may hold: its share, through the accounts of a real embedded server ----------------------


@pytest.fixture
async def accounts_server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path / "node", preferred_port=0, node_id="n1")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _as(bus: Bus, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    msg = await bus.nc.request(SUBJECTS.placement_request, json.dumps(body).encode(), timeout=10, headers=headers)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


async def test_one_client_holds_at_most_its_share_of_a_node_and_cannot_speak_for_another(
    accounts_server: EmbeddedNats, model: Path
) -> None:
    # Issue 17: 19 requests of one client booked every byte of a node for a day. Each client (its own NATS user)
    # now holds at most its share of each node booked at once; the mesh's own requests are not counted.
    admin = await admin_bus(accounts_server)
    body = {"model": {"path": str(model)}, "ctx": 2048}
    try:
        actor = PlacementActor(client_share=0.5, clients_share=1.0)
        async with supervised(admin, [actor], node_id="p1"):
            await put_telemetry(admin, report("sizer", 8 * GIB))
            await wait_view(actor, "sizer")
            need = (await answer(admin, {**body, "nodes": ["sizer"]}, fit=True))["placements"][0]["breakdown"]
            total = int(need["total_bytes"])
            # A node of three bookings' size: each client's half holds one and a half.
            room = 3 * total
            await put_telemetry(admin, msgspec.structs.replace(report("a", room), memory_limit_bytes=room))
            await wait_view(actor, "a")
            user_one, user_two = issued(accounts_server, Role("client")), issued(accounts_server, Role("client"))
            one, two = await bus_when_loaded(user_one, "one"), await bus_when_loaded(user_two, "two")
            try:
                first = await _as(one, {**body, "nodes": ["a"]})
                assert first["admitted"] is True, first
                (held,) = [r for r in (await ledger(admin, "a")).reservations]
                assert held.requester == user_one.user and held.reservation_id == first["reservation_id"]
                # Its second booking would take it past half the node; claiming to be another client changes
                # nothing (nats-server writes who asked).
                forged = json.dumps({"acc": "CLIENTS", "user": user_two.user})
                again = await _as(one, {**body, "nodes": ["a"]}, headers={"Nats-Request-Info": forged})
                assert again["admitted"] is False and again["reason"] == "over_client_share", again
                (refused,) = again["rejections"]
                assert refused["node_id"] == "a" and refused["shortfalls"][0]["have_bytes"] == room // 2
                # Another client has a share of its own, and the mesh's own requests are not counted at all.
                assert (await _as(two, {**body, "nodes": ["a"]}))["admitted"] is True
                assert (await answer(admin, {**body, "nodes": ["a"]}))["admitted"] is True
                requesters = sorted(str(r.requester) for r in (await ledger(admin, "a")).reservations)
                assert requesters == sorted([user_one.user, user_two.user, "None"])
            finally:
                await one.close()
                await two.close()
    finally:
        await admin.close()


async def test_every_client_together_holds_at_most_the_clients_share_however_many_users(
    accounts_server: EmbeddedNats, model: Path
) -> None:
    # Issue 30, F8: two client users, each within its own share, held every byte of a node for an hour. What
    # every client holds together is bounded too; the mesh's own requests are not counted.
    admin = await admin_bus(accounts_server)
    body = {"model": {"path": str(model)}, "ctx": 2048}
    try:
        actor = PlacementActor(client_share=0.5, clients_share=0.5)
        async with supervised(admin, [actor], node_id="p1"):
            await put_telemetry(admin, report("sizer", 8 * GIB))
            await wait_view(actor, "sizer")
            need = (await answer(admin, {**body, "nodes": ["sizer"]}, fit=True))["placements"][0]["breakdown"]
            room = 4 * int(need["total_bytes"])  # four bookings' size: the clients' half holds two
            await put_telemetry(admin, msgspec.structs.replace(report("a", room), memory_limit_bytes=room))
            await wait_view(actor, "a")
            users = [issued(accounts_server, Role("client")) for _ in range(3)]
            buses = [await bus_when_loaded(user, f"c{i}") for i, user in enumerate(users)]
            try:
                assert (await _as(buses[0], {**body, "nodes": ["a"]}))["admitted"] is True
                assert (await _as(buses[1], {**body, "nodes": ["a"]}))["admitted"] is True
                third = await _as(buses[2], {**body, "nodes": ["a"]})  # a fresh user, within its own share
                assert third["admitted"] is False and third["reason"] == "over_client_share", third
                (refused,) = third["rejections"]
                assert refused["node_id"] == "a" and "clients together" in refused["message"], refused
                assert refused["shortfalls"][0]["have_bytes"] == room // 2
                assert (await answer(admin, {**body, "nodes": ["a"]}))["admitted"] is True  # the mesh's own
            finally:
                for bus in buses:
                    await bus.close()
    finally:
        await admin.close()
