"""A member's side of split serving, its pure decisions: whether to lend a part (its own ledger is the truth, the
head's request only names it), which lent parts lost their booking, and the RPC server's command line."""

from __future__ import annotations

import pytest

from actors.runner.command import LOOPBACK
from actors.runner.parts import lend_refusal, rpc_server_command, unbooked
from messages.placement import NodeLedger, Reservation, SplitPart, Stamp
from messages.runner import LendRequest
from messages.settings import ServingSettings

NODE = "m2"  # this node: a member
HEAD = "h1"


def _part(rid: str, split: SplitPart | None, node: str = NODE) -> Reservation:
    return Reservation(
        reservation_id=rid,
        decision_id=f"d-{rid}",
        node_id=node,
        state="reserved",
        model_path="/models/m.gguf",
        stamp=Stamp(settings=ServingSettings(), ctx=4096, n_gpu_layers=0),
        layers=(8, 16),
        devices=(),
        held={"CPU": 1 << 30},
        multi_node=split is not None,
        created_at=0.0,
        split=split,
    )


def _ledger(*parts: Reservation) -> NodeLedger:
    return NodeLedger(node_id=NODE, reservations=parts)


LENT = _part("r1", SplitPart(head=HEAD, members=("m3", NODE)))  # this node is the second member
ASK = LendRequest(reservation_id="r1", head=HEAD)


# --- lend_refusal -------------------------------------------------------------------------------------------


def test_a_part_the_ledger_books_for_that_head_is_lent() -> None:
    assert lend_refusal(_ledger(_part("other", None), LENT), ASK, NODE) is None


def test_without_a_ledger_nothing_is_lent() -> None:
    """A node whose ledger is not known yet (or was deleted) books nothing: the request alone proves nothing."""
    assert lend_refusal(None, ASK, NODE) == f"node {NODE} holds no reservation 'r1'"


def test_a_reservation_absent_from_the_ledger_is_not_lent() -> None:
    why = lend_refusal(_ledger(_part("r9", SplitPart(head=HEAD, members=(NODE,)))), ASK, NODE)
    assert why == f"node {NODE} holds no reservation 'r1'"


def test_a_reservation_that_is_not_split_is_not_lent() -> None:
    """This node runs that instance itself: lending its memory would count it twice."""
    why = lend_refusal(_ledger(_part("r1", None)), ASK, NODE)
    assert why == f"reservation 'r1' does not make node {NODE} a member of a split"


def test_a_split_this_node_is_no_member_of_is_not_lent() -> None:
    for split in (SplitPart(head=HEAD, members=("m3", "m4")), SplitPart(head=NODE, members=("m3",))):
        why = lend_refusal(_ledger(_part("r1", split)), ASK, NODE)
        assert why == f"reservation 'r1' does not make node {NODE} a member of a split", split


def test_a_part_booked_for_another_head_is_not_lent() -> None:
    why = lend_refusal(_ledger(LENT), LendRequest(reservation_id="r1", head="intruder"), NODE)
    assert why == f"reservation 'r1' is lent to {HEAD}, not to intruder"


# --- unbooked -----------------------------------------------------------------------------------------------


def test_parts_whose_booking_left_the_ledger_are_unbooked() -> None:
    still = _part("r2", SplitPart(head="h2", members=(NODE,)))
    assert unbooked({"r1", "r2", "gone"}, _ledger(LENT, still), NODE) == {"gone"}
    assert unbooked({"r1", "r2"}, _ledger(still), NODE) == {"r1"}


def test_every_part_is_unbooked_without_a_ledger_and_none_is_when_nothing_is_lent() -> None:
    assert unbooked({"r1", "r2"}, None, NODE) == {"r1", "r2"}
    assert unbooked(set(), _ledger(), NODE) == set()
    assert unbooked(set(), None, NODE) == set()


def test_a_booking_that_no_longer_makes_this_node_a_member_unbooks_its_part() -> None:
    """The same reservation id, but this node now heads it (or it runs unsplit here): not a part it lends."""
    headed = _part("r1", SplitPart(head=NODE, members=("m3",)))
    assert unbooked({"r1"}, _ledger(headed), NODE) == {"r1"}
    assert unbooked({"r1"}, _ledger(_part("r1", None)), NODE) == {"r1"}


def test_a_booking_in_the_ledger_that_names_this_node_a_member_keeps_its_part() -> None:
    assert unbooked({"r1"}, _ledger(LENT), NODE) == set()
    assert unbooked({"r1"}, _ledger(LENT), "m3") == set()  # any member of the split, in any position
    assert unbooked({"r1"}, _ledger(LENT), "m4") == {"r1"}


# --- rpc_server_command -------------------------------------------------------------------------------------


def _value(argv: tuple[str, ...], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times"
    return argv[argv.index(flag) + 1]


def test_the_rpc_server_listens_on_loopback_only_and_allocates_in_host_memory() -> None:
    """llama.cpp's RPC has no authentication: only the tunnel exit on this host may reach it."""
    argv = rpc_server_command("/opt/llama/ggml-rpc-server", 50123, None)
    assert argv[0] == "/opt/llama/ggml-rpc-server"
    assert _value(argv, "-H") == LOOPBACK == "127.0.0.1"
    assert _value(argv, "-p") == "50123"
    assert _value(argv, "-d") == "CPU"
    assert "-t" not in argv  # ggml-rpc-server's own default (one thread)
    assert len(argv) == 7
    assert all(isinstance(arg, str) for arg in argv)


@pytest.mark.parametrize("threads", [None, 0])
def test_the_rpc_server_gets_no_thread_count_unless_one_is_configured(threads: int | None) -> None:
    assert "-t" not in rpc_server_command("ggml-rpc-server", 1, threads)


def test_a_configured_thread_count_is_passed() -> None:
    argv = rpc_server_command("ggml-rpc-server", 1, 6)
    assert _value(argv, "-t") == "6"
    assert _value(argv, "-H") == "127.0.0.1" and _value(argv, "-d") == "CPU"
