"""Worker-side admission core: the runner's checks before a start and the claim it writes; no bus, no clock."""

from __future__ import annotations

import time

import msgspec
import pytest

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from actors.runner.start_checks import StartRefused, check_memory, check_reservation, claim, find
from messages.memory import MemoryBreakdown
from messages.placement import NodeLedger, Reservation, RpcMember, SplitPart, Stamp
from messages.runner import FieldDrift
from messages.settings import ServingSettings
from messages.telemetry import HostInfo, NodeResources
from tests.tiny_models import write_llama

SETTINGS = msgspec.convert({"cache_ram_mib": 0, "slots": 1}, ServingSettings)
DRIFT = (FieldDrift(field="slots", stamped="1", current="2"),)


@pytest.fixture(scope="module")
def predicted(tmp_path_factory: pytest.TempPathFactory) -> MemoryBreakdown:
    model = write_llama(tmp_path_factory.mktemp("core") / "llama.gguf", n_layer=2)
    return estimate(geometry_from_header(read_header(model)), SETTINGS, 512, n_gpu_layers=0)


def reservation(rid: str, predicted: MemoryBreakdown, **fields: object) -> Reservation:
    base = Reservation(
        reservation_id=rid,
        decision_id=f"d-{rid}",
        node_id="n",
        state="reserved",
        model_path="/m.gguf",
        stamp=Stamp(settings=SETTINGS, ctx=512, n_gpu_layers=0),
        layers=(0, 2),
        devices=predicted.devices,
        held={d.device: d.total_bytes for d in predicted.devices},
        created_at=0.0,
        expires_at=600.0,
    )
    return msgspec.structs.replace(base, **fields)


def node(usable: int) -> NodeResources:
    host = HostInfo(ram_total_bytes=usable, ram_available_bytes=usable, usable_bytes=usable, cpu_count=2)
    return NodeResources(node_id="n", seq=1, sent_at=time.time(), started_at=0.0, ttl_s=15, host=host)


def refusal(excinfo: pytest.ExceptionInfo[StartRefused]) -> tuple[str, bool]:
    return excinfo.value.code, excinfo.value.releases


def check(
    checked: Reservation,
    *,
    has_engine: bool = True,
    running: int = 0,
    drift: tuple[FieldDrift, ...] = (),
    can_head_split: bool = True,
) -> None:
    check_reservation(
        checked, node_id="n", has_engine=has_engine, running=running, max_instances=4, drift=drift,
        can_head_split=can_head_split,
    )  # fmt: skip


def test_a_split_is_started_by_its_head_only_and_only_where_the_cluster_certificates_are(
    predicted: MemoryBreakdown,
) -> None:
    stamp = Stamp(
        settings=SETTINGS, ctx=512, n_gpu_layers=2, gpu_split=(1.0,), rpc=(RpcMember(node_id="m", layers=(1, 2)),)
    )
    head = reservation("r", predicted, multi_node=True, stamp=stamp, split=SplitPart(head="n", members=("m",)))
    check(head)  # the head's part, on a node that reaches its members
    with pytest.raises(StartRefused) as uncertified:
        check(head, can_head_split=False)
    assert refusal(uncertified) == ("unsupported", True)  # it never will here: released
    member = msgspec.structs.replace(head, split=SplitPart(head="h", members=("n",)))
    with pytest.raises(StartRefused) as lent:
        check(member)  # a part this node lends: its head starts the instance, the part stays booked
    assert refusal(lent) == ("unsupported", False)
    assert "headed by h" in str(lent.value)


def test_checks_refuse_in_order_and_say_whether_the_reservation_is_released(predicted: MemoryBreakdown) -> None:
    with pytest.raises(StartRefused) as multi:  # a part of a split with no head named: not this node's to start
        check(reservation("r", predicted, multi_node=True, state="starting"))
    assert refusal(multi) == ("unsupported", False)
    with pytest.raises(StartRefused) as taken:
        check(reservation("r", predicted, state="starting"), has_engine=False)
    assert refusal(taken) == ("reservation_state", False)
    with pytest.raises(StartRefused) as engine:
        check(reservation("r", predicted), has_engine=False, drift=DRIFT)
    assert refusal(engine) == ("engine_unavailable", True)
    with pytest.raises(StartRefused) as full:
        check(reservation("r", predicted), running=4, drift=DRIFT)
    assert refusal(full) == ("too_many_instances", False)
    with pytest.raises(StartRefused) as drift:
        check(reservation("r", predicted), drift=DRIFT)
    assert refusal(drift) == ("settings_drift", True) and drift.value.drift == DRIFT
    assert "slots: stamped 1, now 2" in drift.value.message
    check(reservation("r", predicted))


def test_a_reservation_past_its_expiry_is_neither_refused_nor_free_memory(predicted: MemoryBreakdown) -> None:
    """`expires_at` is placement's clock: the runner never compares it with its own. The expired one still
    holds its memory in the runner's check (placement's sweep is the one that removes it)."""
    mine = reservation("r", predicted, expires_at=1.0)
    old = reservation("r-old", predicted, expires_at=1.0, state="starting", instance_id="x")
    check(mine)
    need = mine.held["CPU"]
    ledger = NodeLedger(node_id="n", reservations=(mine, old))
    check_memory(mine, predicted, node(2 * need), ledger)
    with pytest.raises(StartRefused) as short:
        check_memory(mine, predicted, node(2 * need - 1), ledger)
    assert refusal(short) == ("insufficient_memory", True)
    assert short.value.need_bytes == {"CPU": need} and short.value.have_bytes == {"CPU": need - 1}


def test_no_telemetry_is_a_releasing_refusal_naming_what_is_needed(predicted: MemoryBreakdown) -> None:
    mine = reservation("r", predicted)
    with pytest.raises(StartRefused) as stale:
        check_memory(mine, predicted, None, NodeLedger(node_id="n", reservations=(mine,)))
    assert refusal(stale) == ("telemetry_stale", True) and stale.value.need_bytes == mine.held


def test_the_claim_moves_only_this_reservation_to_starting_with_the_instance_id(predicted: MemoryBreakdown) -> None:
    mine, other = reservation("r", predicted), reservation("r-other", predicted)
    ledger = NodeLedger(node_id="n", reservations=(other, mine))
    claimed = claim(ledger, "r", "n", "i-1")
    assert claimed.reservations[0] == other
    assert claimed.reservations[1] == msgspec.structs.replace(mine, state="starting", instance_id="i-1")
    with pytest.raises(StartRefused) as twice:
        claim(claimed, "r", "n", "i-2")
    assert refusal(twice) == ("reservation_state", False)
    with pytest.raises(StartRefused) as gone:
        claim(ledger, "r-gone", "n", "i-3")
    assert refusal(gone) == ("not_found", False)
    with pytest.raises(StartRefused):
        find(None, "r", "n")


def test_a_claimed_reservation_holds_the_same_memory(predicted: MemoryBreakdown) -> None:
    """Claiming changes the state, never what is held: placement's accounting is unchanged by it."""
    mine = reservation("r", predicted)
    claimed = find(claim(NodeLedger(node_id="n", reservations=(mine,)), "r", "n", "i"), "r", "n")
    assert (claimed.held, claimed.devices) == (mine.held, mine.devices)
