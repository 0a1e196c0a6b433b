"""What one client may hold booked on a node (actors/placement/shares.py): its share of each device, counted
over its own reservations only, whatever their state."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.placement.shares import EVERY_CLIENT, booked_for, breach, exhausted, held_by, limits
from messages.placement import NodeLedger, Reservation
from messages.telemetry import GpuInfo, HostInfo, NodeResources
from tests.harness.reservations import reservation

GIB = 1 << 30


def node(node_id: str = "a", *, ram: int = 64 * GIB, limit: int | None = None, gpu: int | None = None) -> NodeResources:
    gpus = (
        ()
        if gpu is None
        else (GpuInfo(index=0, name="g", uuid="u", total_bytes=gpu, free_bytes=gpu, used_bytes=0, usable_bytes=gpu),)
    )
    return NodeResources(
        node_id=node_id, seq=1, sent_at=0.0, started_at=0.0, ttl_s=15.0,
        host=HostInfo(ram_total_bytes=ram, ram_available_bytes=ram, usable_bytes=ram, cpu_count=2),
        gpus=gpus, memory_limit_bytes=limit,
    )  # fmt: skip


def held(rid: str, n_bytes: int, requester: str | None, **fields: object) -> Reservation:
    return msgspec.structs.replace(reservation(rid), held={"CPU": n_bytes}, requester=requester, **fields)


def test_a_client_holds_what_its_own_reservations_hold_in_any_state() -> None:
    ledger = NodeLedger(
        node_id="a",
        reservations=(
            held("r1", 10 * GIB, "client-x"),
            held("r2", 5 * GIB, "client-x", state="running"),
            held("r3", 7 * GIB, "client-y"),
            held("r4", 9 * GIB, None),  # the mesh's own (the front door's)
        ),
    )
    assert held_by(ledger, "client-x") == {"CPU": 15 * GIB}
    assert held_by(ledger, "client-z") == {} and held_by(None, "client-x") == {}


def test_the_share_is_of_each_devices_size_capped_by_the_memory_limit() -> None:
    assert limits(node(ram=64 * GIB), 0.5) == {"CPU": 32 * GIB}
    assert limits(node(ram=64 * GIB, limit=8 * GIB, gpu=24 * GIB), 0.25) == {"CPU": 2 * GIB, "GPU0": 2 * GIB}
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError):
            limits(node(), bad)


def test_a_booking_past_the_share_is_refused_by_name_and_one_within_it_is_not() -> None:
    ledger = NodeLedger(node_id="a", reservations=(held("r1", 20 * GIB, "client-x"), held("r2", 30 * GIB, None)))
    # 20 + 12 = 32 GiB: exactly its half of 64 GiB (others' bookings do not count against it)
    assert breach(node(), ledger, "client-x", 0.5, {"CPU": 12 * GIB}) is None
    refused = breach(node(), ledger, "client-x", 0.5, {"CPU": 12 * GIB + 1})
    assert refused is not None and refused.reason == "over_client_share" and refused.node_id == "a"
    (short,) = refused.shortfalls
    assert (short.device, short.need_bytes, short.have_bytes) == ("CPU", 32 * GIB + 1, 32 * GIB)
    assert "client-x" in refused.message and "0.5" in refused.message
    assert breach(node(), ledger, "client-y", 0.5, {"CPU": 32 * GIB}) is None  # another client's share is its own


def test_a_node_where_the_client_holds_its_share_is_exhausted() -> None:
    full = NodeLedger(node_id="a", reservations=(held("r1", 32 * GIB, "client-x"),))
    part = NodeLedger(node_id="b", reservations=(held("r2", 31 * GIB, "client-x"),))
    found = exhausted([node("a"), node("b"), node("c")], {"a": full, "b": part}, "client-x", 0.5)
    assert set(found) == {"a"} and found["a"].reason == "over_client_share"
    assert exhausted([node("a")], {"a": full}, "client-y", 0.5) == {}


def test_a_decisions_reservations_name_the_client_they_hold_memory_for() -> None:
    (booked,) = booked_for((held("r1", GIB, None),), "client-x")
    assert booked.requester == "client-x"
    # a ledger written before requesters were kept decodes: its reservations are the mesh's own
    old = msgspec.json.encode(NodeLedger(node_id="a", reservations=(held("r1", GIB, None),)))
    assert b"requester" in old
    legacy = old.replace(b',"requester":null', b"")
    assert msgspec.json.decode(legacy, type=NodeLedger).reservations[0].requester is None


@given(
    own=st.lists(st.integers(0, 8 * GIB), max_size=6),
    others=st.lists(st.integers(0, 8 * GIB), max_size=6),
    adding=st.integers(0, 64 * GIB),
    share=st.floats(0.01, 1.0),
)
def test_within_the_share_exactly_when_what_it_would_hold_fits(
    own: list[int], others: list[int], adding: int, share: float
) -> None:
    reservations = [held(f"o{i}", n, "client-x") for i, n in enumerate(own)]
    reservations += [held(f"t{i}", n, "client-y") for i, n in enumerate(others)]
    ledger = NodeLedger(node_id="a", reservations=tuple(reservations))
    within = breach(node(), ledger, "client-x", share, {"CPU": adding}) is None
    assert within == (adding == 0 or sum(own) + adding <= int(64 * GIB * share))


def test_every_client_together_is_held_to_the_clients_share() -> None:
    # Issue 30, F8: each user within its own share, two users held a whole node
    ledger = NodeLedger(
        node_id="a",
        reservations=(held("r1", 20 * GIB, "client-x"), held("r2", 10 * GIB, "client-y"), held("r3", 30 * GIB, None)),
    )
    assert held_by(ledger, EVERY_CLIENT) == {"CPU": 30 * GIB}  # the mesh's own bookings are not the clients'
    assert breach(node(), ledger, EVERY_CLIENT, 0.5, {"CPU": 2 * GIB}) is None
    refused = breach(node(), ledger, EVERY_CLIENT, 0.5, {"CPU": 2 * GIB + 1})
    assert refused is not None and "the clients together" in refused.message
    full = NodeLedger(node_id="a", reservations=(held("r1", 16 * GIB, "client-x"), held("r2", 16 * GIB, "client-y")))
    assert set(exhausted([node("a")], {"a": full}, EVERY_CLIENT, 0.5)) == {"a"}
    assert exhausted([node("a")], {"a": full}, "client-z", 0.5) == {}  # a fresh user alone would still fit
