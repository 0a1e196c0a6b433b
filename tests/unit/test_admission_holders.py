"""Admission prefers the nodes that hold a model's file, then the ones a request prefers (issue 21)."""

from __future__ import annotations

import msgspec
import pytest

from actors.placement.admission import ModelFacts, fetch_bytes
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from messages.telemetry import ModelFiles, NodeResources
from tests.harness.admission import GIB, node, request, run, view
from tests.tiny_models import write_llama

MIB = 1 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelFacts:
    path = write_llama(tmp_path_factory.mktemp("m") / "llama.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512)
    return ModelFacts(geometry=geometry_from_header(read_header(path)), path="org/llama.gguf")


def holding(n: NodeResources, *files: tuple[str, int] | tuple[str, int, str]) -> NodeResources:
    held = tuple((f[0], f[1], f[2] if len(f) == 3 else "") for f in files)  # digest "": not hashed there yet
    return msgspec.structs.replace(n, model_files=ModelFiles(held=held))


def test_a_node_holding_the_file_wins_over_more_headroom_and_fetches_nothing(model: ModelFacts) -> None:
    nodes = view(holding(node("small", 2 * GIB), ("org/llama.gguf", 700 * MIB)), node("big", 6 * GIB))
    decision = run(request(), model, nodes).decision
    (placement,) = decision.placements
    assert placement.node_id == "small" and placement.fetch_bytes == 0
    assert "fetches" not in decision.message


def test_a_node_without_the_file_fetches_what_a_holder_reports_and_the_decision_says_so(model: ModelFacts) -> None:
    nodes = view(holding(node("holder", 1), ("org/llama.gguf", 700 * MIB)), node("empty", 6 * GIB))
    decision = run(request(), model, nodes).decision  # the holder has no room: the other fetches the file
    (placement,) = decision.placements
    assert placement.node_id == "empty" and placement.fetch_bytes == 700 * MIB
    assert decision.message.endswith("(it fetches the model file, 700.0 MiB, from a peer first)")
    assert placement.fetch_s is None  # it never pulled: no rate to count the time by
    measured = msgspec.structs.replace(node("empty", 6 * GIB), model_files=ModelFiles(pull_bytes_per_s=100 * MIB))
    nodes = view(holding(node("holder", 1), ("org/llama.gguf", 700 * MIB)), measured)
    decision = run(request(), model, nodes).decision
    assert decision.placements[0].fetch_s == 7.0
    assert decision.message.endswith("from a peer first: about 7s at its last pull's rate)")


def test_another_file_held_is_no_reason_and_nobody_holding_it_leaves_the_fetch_unknown(model: ModelFacts) -> None:
    nodes = view(holding(node("small", 2 * GIB), ("other.gguf", 1)), node("big", 6 * GIB))
    (placement,) = run(request(), model, nodes).decision.placements
    assert placement.node_id == "big" and placement.fetch_bytes is None
    other = ModelFacts(geometry=model.geometry, path="other.gguf")
    assert fetch_bytes(nodes["small"].resources, other, nodes) == 0


def test_a_node_holding_another_version_under_the_name_is_no_holder(model: ModelFacts) -> None:
    """The runner refuses a file whose digest is not the stamped one: such a node must fetch the right one."""
    signed = ModelFacts(geometry=model.geometry, path=model.path, digest="a" * 64)
    nodes = view(
        holding(node("stale", 6 * GIB), ("org/llama.gguf", 500 * MIB, "b" * 64)),
        holding(node("right", 2 * GIB), ("org/llama.gguf", 700 * MIB, "a" * 64)),
    )
    (placement,) = run(request(), signed, nodes).decision.placements
    assert (placement.node_id, placement.fetch_bytes) == ("right", 0)
    (placement,) = run(request(nodes=["stale"]), signed, nodes).decision.placements
    assert (placement.node_id, placement.fetch_bytes) == ("stale", 700 * MIB)  # the right version's size
    unhashed = view(holding(node("small", 2 * GIB), ("org/llama.gguf", 1)), node("big", 6 * GIB))
    assert run(request(), signed, unhashed).decision.placements[0].node_id == "small"  # not known: taken as it


def test_prefer_orders_nodes_that_hold_the_file_alike_but_never_beats_holding_it(model: ModelFacts) -> None:
    nodes = view(node("a", 2 * GIB), node("b", 4 * GIB), node("c", 6 * GIB))
    assert run(request(prefer=["b", "a"]), model, nodes).decision.placements[0].node_id == "b"
    assert run(request(prefer=["ghost", "a"]), model, nodes).decision.placements[0].node_id == "a"
    held = view(node("a", 2 * GIB), node("b", 4 * GIB), holding(node("c", 6 * GIB), ("org/llama.gguf", 9)))
    assert run(request(prefer=["b", "a"]), model, held).decision.placements[0].node_id == "c"
    # a preferred node the model does not fit is passed over
    tight = view(node("a", 1), node("b", 4 * GIB))
    assert run(request(prefer=["a"]), model, tight).decision.placements[0].node_id == "b"


def test_a_report_cannot_list_more_files_than_the_bound_or_a_negative_size() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"held": [["a.gguf", -1]]}', type=ModelFiles)
    too_many = msgspec.json.encode({"held": [[f"{i}.gguf", 1] for i in range(257)]})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(too_many, type=ModelFiles)
