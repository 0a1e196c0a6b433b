"""Admission of a split over nodes (llama.cpp RPC): only when allowed and no node fits alone; layers as the loader
assigns them; a breakdown and a reservation per node, the head first."""

from __future__ import annotations

import dataclasses

import msgspec

from actors.placement.admission import ModelFacts
from actors.placement.memory import estimate
from actors.placement.split import Lender, plan_split
from actors.placement.weights import layer_devices
from messages.settings import ServingSettings
from messages.telemetry import GpuInfo
from tests.harness.admission import QUIET, dense, hybrid, need, node, request, run, view

__all__ = ["dense", "hybrid"]  # fixtures

SETTINGS = ServingSettings(**QUIET)


def _total(model: ModelFacts) -> int:
    return need(model.geometry, SETTINGS, 4096)


def test_a_model_one_node_holds_is_never_split(dense: ModelFacts) -> None:
    nodes = view(node("a", 2 * _total(dense)), node("b", 2 * _total(dense)))
    outcome = run(request(allow_multi_node=True), dense, nodes)
    assert outcome.decision.admitted and not outcome.decision.multi_node
    assert len(outcome.reservations) == 1 and outcome.reservations[0].split is None
    assert outcome.decision.stamp is not None and outcome.decision.stamp.rpc == ()


def test_a_model_no_node_holds_is_split_when_allowed(dense: ModelFacts) -> None:
    usable = int(_total(dense) * 0.7)
    nodes = view(node("a", usable), node("b", usable), node("c", usable))
    assert not run(request(), dense, nodes).decision.admitted  # without allow_multi_node: refused as before
    outcome = run(request(allow_multi_node=True), dense, nodes)
    decision = outcome.decision
    assert decision.admitted and decision.multi_node and decision.reservation_id == "r1"
    stamp = decision.stamp
    assert stamp is not None and len(stamp.rpc) == 1  # two nodes hold it: the fewest members
    head, member = decision.placements
    assert stamp.rpc[0].node_id == member.node_id and stamp.rpc[0].layers == member.layers
    # the loader's assignment: the head's blocks first, the member's after, the output with the last block
    n_layer = dense.geometry.n_layer
    assert head.layers[0] == 0 and head.layers[1] == member.layers[0] and member.layers[1] == n_layer
    devices = layer_devices(dense.geometry, stamp.n_gpu_layers, stamp.gpu_split)
    assert devices == [-1] * head.layers[1] + [0] * (n_layer + 1 - head.layers[1])
    assert 0 < stamp.n_gpu_layers <= n_layer  # the head keeps its first block: no pipeline parallelism
    # one reservation per node, same id, each holding that node's part within what it has
    assert [r.node_id for r in outcome.reservations] == [head.node_id, member.node_id]
    for reservation, placement in zip(outcome.reservations, decision.placements, strict=True):
        assert reservation.reservation_id == "r1" and reservation.multi_node and reservation.split is not None
        assert reservation.split.head == head.node_id and reservation.split.members == (member.node_id,)
        assert reservation.held == {"CPU": placement.breakdown.total_bytes} and reservation.stamp == stamp
        assert placement.breakdown.total_bytes <= usable and placement.breakdown.fits
    # the split's parts add up to the split's own estimate
    whole = estimate(
        dense.geometry, SETTINGS, 4096, n_gpu_layers=stamp.n_gpu_layers, gpu_split=stamp.gpu_split, rpc_devices=1
    )
    assert sum(r.held["CPU"] for r in outcome.reservations) == whole.total_bytes
    assert "split over" in decision.message


def test_a_split_takes_more_members_when_two_nodes_do_not_hold_it(dense: ModelFacts) -> None:
    usable = int(_total(dense) * 0.45)
    nodes = view(*(node(name, usable) for name in "abcde"))
    decision = run(request(allow_multi_node=True), dense, nodes).decision
    assert decision.admitted and decision.stamp is not None and 2 <= len(decision.stamp.rpc) < 4
    assert len(decision.placements) == 1 + len(decision.stamp.rpc)
    bounds = [p.layers for p in decision.placements]
    assert [b[0] for b in bounds[1:]] == [b[1] for b in bounds[:-1]]  # contiguous, in --rpc order


def test_no_split_that_fits_is_a_refusal_that_says_so(dense: ModelFacts) -> None:
    usable = int(_total(dense) * 0.2)
    outcome = run(request(allow_multi_node=True), dense, view(node("a", usable), node("b", usable)))
    decision = outcome.decision
    assert not decision.admitted and decision.reason == "insufficient_memory" and not outcome.reservations
    assert "no split" in decision.message


def test_a_dry_run_books_nothing(dense: ModelFacts) -> None:
    usable = int(_total(dense) * 0.7)
    outcome = run(request(allow_multi_node=True), dense, view(node("a", usable), node("b", usable)), dry_run=True)
    assert outcome.decision.admitted and outcome.decision.multi_node and not outcome.reservations
    assert outcome.decision.reservation_id is None


def test_a_node_with_gpus_lends_its_host_but_does_not_head(dense: ModelFacts) -> None:
    usable = int(_total(dense) * 0.7)
    gpu = msgspec.structs.replace(
        node("g", 2 * usable),
        gpus=(
            GpuInfo(
                index=0,
                name="gpu",
                uuid="u",
                total_bytes=1 << 20,
                free_bytes=1 << 20,
                used_bytes=0,
                usable_bytes=1 << 20,
            ),
        ),
    )
    decision = run(request(allow_multi_node=True), dense, view(gpu, node("a", usable))).decision
    assert decision.admitted and decision.multi_node
    assert [p.node_id for p in decision.placements] == ["a", "g"]


def test_the_largest_context_a_split_holds(dense: ModelFacts) -> None:
    usable = int(_total(dense) * 0.7)
    nodes = view(node("a", usable), node("b", usable))
    decision = run(request(ctx=None, allow_multi_node=True), dense, nodes).decision
    assert decision.admitted and decision.ctx is not None and decision.ctx >= 256
    head, member = (Lender(e.resources, {"CPU": usable}) for e in nodes.values())
    larger = plan_split(dense.geometry, SETTINGS, head, [member], ctx=decision.ctx + 256, max_ctx=False)
    capped = decision.ctx == (dense.geometry.n_ctx_train // 256) * 256
    assert capped or larger is None


def test_a_hybrid_model_is_split_with_its_recurrent_state_where_each_layer_lives(hybrid: ModelFacts) -> None:
    usable = int(_total(hybrid) * 0.75)
    outcome = run(request(allow_multi_node=True), hybrid, view(node("a", usable), node("b", usable)))
    decision = outcome.decision
    assert decision.admitted and decision.multi_node
    recurrent = [p.breakdown.recurrent_bytes for p in decision.placements]
    assert all(r > 0 for r in recurrent)


def test_a_model_with_a_draft_is_not_split(dense: ModelFacts) -> None:
    facts = dataclasses.replace(dense, draft=dense.geometry)
    usable = int(_total(dense) * 0.7)
    settings = {"spec_type": "draft-simple"}
    nodes = view(node("a", usable), node("b", usable))
    decision = run(request(allow_multi_node=True, settings=settings), facts, nodes).decision
    assert not decision.admitted and "not sized with a draft model or a projector" in decision.message
