"""Admission core: node eligibility, sizing against ledgers, node choice, layer split, context ceiling."""

from __future__ import annotations

import msgspec

from actors.placement.admission import ModelFacts, ViewEntry, natural_key
from actors.placement.ledger import available, with_reservation
from actors.placement.memory import estimate
from messages.placement import ModelRef, NodeLedger, PlacementRequest, PreferredSettings, Reservation, Stamp
from messages.settings import ServingSettings, SettingsBounds
from tests.harness.admission import DEFAULT, GIB, NOW, OPEN, QUIET, dense, hybrid, need, node, request, run, view

__all__ = ["dense", "hybrid"]  # the fixtures (tests.harness.admission), taken by name


def test_single_node_admitted_with_stamp_from_its_advertisement(dense: ModelFacts) -> None:
    settings = ServingSettings(slots=3, cache_type_k="q8_0", **QUIET)
    outcome = run(request(ctx=3000, settings={"slots": 3}), dense, view(node("a", 8 * GIB, settings=settings)))
    decision = outcome.decision
    assert decision.admitted and decision.reservation_id == "r1" and not decision.multi_node
    assert decision.stamp is not None and decision.stamp.settings == settings and decision.stamp.ctx == 3000
    assert decision.stamp.n_gpu_layers == 0  # a node without GPUs
    (placement,) = decision.placements
    assert placement.node_id == "a" and placement.layers == (0, 8) and placement.telemetry_revision == 1
    device = placement.breakdown.devices[0]
    assert device.device == "CPU" and device.fits and device.budget_bytes == 8 * GIB
    (reservation,) = outcome.reservations
    assert reservation.held == {"CPU": device.total_bytes}
    assert reservation.expires_at == NOW + 600 and reservation.state == "reserved"


def test_refused_with_need_and_have_per_device(dense: ModelFacts) -> None:
    total = need(dense.geometry, ServingSettings(**QUIET), 4096)
    outcome = run(request(), dense, view(node("a", total - 1)))
    decision = outcome.decision
    assert not decision.admitted and decision.reason == "insufficient_memory" and not outcome.reservations
    (rejection,) = decision.rejections
    assert rejection.shortfalls[0].device == "CPU"
    assert rejection.shortfalls[0].need_bytes == total and rejection.shortfalls[0].have_bytes == total - 1


def test_hybrid_refused_at_64_slots_and_admitted_at_16_under_the_same_limit(hybrid: ModelFacts) -> None:
    at = {n: ServingSettings(slots=n, kv_unified=True, spec_type="draft-mtp", **QUIET) for n in (16, 64)}
    need16, need64 = (need(hybrid.geometry, at[n], 4096) for n in (16, 64))
    assert need64 > need16
    limit = (need16 + need64) // 2
    for slots, admitted in ((64, False), (16, True)):
        # telemetry already caps usable memory at the node's limit
        nodes = view(node("a", limit, limit=limit, settings=at[slots]))
        decision = run(request(), hybrid, nodes).decision
        assert decision.admitted is admitted, decision.message
        if not admitted:
            assert decision.rejections[0].shortfalls[0].need_bytes == need64


def test_node_without_advertised_settings_is_refused_settings_unknown(hybrid: ModelFacts) -> None:
    decision = run(request(), hybrid, view(node("a", 32 * GIB, settings=None))).decision
    assert not decision.admitted and decision.reason == "settings_unknown"
    assert "not installed" in decision.rejections[0].message


def test_stale_node_is_excluded_and_a_fresh_one_chosen(dense: ModelFacts) -> None:
    nodes = view(node("old", 32 * GIB, sent_at=NOW - 60), node("new", 4 * GIB))
    decision = run(request(explain=True), dense, nodes).decision
    assert decision.admitted and [p.node_id for p in decision.placements] == ["new"]
    assert [(r.node_id, r.reason) for r in decision.rejections] == [("old", "telemetry_stale")]


def test_a_node_without_bounds_accepts_only_its_own_settings(dense: ModelFacts) -> None:
    req = request(settings=msgspec.to_builtins(PreferredSettings(slots=8, cache_type_k="q8_0")))
    decision = run(req, dense, view(node("a", 32 * GIB))).decision
    assert not decision.admitted and decision.reason == "settings_mismatch"
    assert decision.rejections[0].fields == ("slots", "cache_type_k")
    assert "the node advertises no bounds" in decision.rejections[0].message


def test_a_models_own_settings_within_the_bounds_are_sized_stamped_and_booked_exactly(dense: ModelFacts) -> None:
    wanted = PreferredSettings(slots=2, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on")
    outcome = run(request(settings=msgspec.to_builtins(wanted)), dense, view(node("a", 32 * GIB, bounds=OPEN)))
    decision = outcome.decision
    assert decision.admitted and decision.stamp is not None
    ran = decision.stamp.settings
    assert (ran.slots, ran.cache_type_k, ran.cache_type_v) == (2, "q8_0", "q8_0")
    assert ran.batch == DEFAULT.batch and ran.cache_ram_mib == 0  # the node's own settings stay its own
    expected = estimate(dense.geometry, ran, 4096)
    assert decision.placements[0].breakdown.devices[0].kv_bytes == expected.devices[0].kv_bytes
    assert outcome.reservations[0].held["CPU"] == expected.devices[0].total_bytes
    # the same request without settings runs with the node's defaults: 4 slots, f16 caches, more KV
    plain = run(request(), dense, view(node("a", 32 * GIB, bounds=OPEN))).decision
    assert plain.stamp is not None and plain.stamp.settings == DEFAULT
    assert plain.placements[0].breakdown.devices[0].kv_bytes > expected.devices[0].kv_bytes


def test_settings_outside_the_bounds_are_refused_naming_the_bound(dense: ModelFacts) -> None:
    tight = SettingsBounds(max_slots=4, cache_types=("f16", "q8_0"), spec_types=("ngram-simple",))
    cases = (
        (PreferredSettings(slots=6), ("slots",), "max_slots 4"),
        (PreferredSettings(cache_type_v="q4_0"), ("cache_type_v",), "cache_types (f16, q8_0)"),
        (PreferredSettings(spec_type="draft-mtp"), ("spec_type",), "spec_types (ngram-simple)"),
    )
    for wanted, fields, bound in cases:
        decision = run(request(settings=msgspec.to_builtins(wanted)), dense, view(node("a", 32 * GIB, bounds=tight)))
        assert not decision.decision.admitted and decision.decision.reason == "settings_mismatch", wanted
        (refusal,) = decision.decision.rejections
        assert refusal.fields == fields and bound in refusal.message, refusal
    # what llama-server itself refuses is refused whatever the bounds
    quantized_v = PreferredSettings(cache_type_v="q8_0", flash_attn="off")
    refused = run(request(settings=msgspec.to_builtins(quantized_v)), dense, view(node("a", 32 * GIB, bounds=OPEN)))
    assert refused.decision.reason == "unsupported_settings" and "flash_attn" in refused.decision.message


def test_unknown_requested_node_is_not_found(dense: ModelFacts) -> None:
    decision = run(request(nodes=["ghost"]), dense, view(node("a", 32 * GIB))).decision
    assert not decision.admitted and decision.reason == "not_found"


def test_most_headroom_wins(dense: ModelFacts) -> None:
    decision = run(request(), dense, view(node("small", 2 * GIB), node("big", 6 * GIB))).decision
    assert decision.placements[0].node_id == "big"
    assert [r.node_id for r in decision.rejections] == []


def test_a_model_no_single_node_holds_is_refused_not_split(dense: ModelFacts) -> None:
    total = need(dense.geometry, ServingSettings(**QUIET), 4096)
    nodes = view(node("a", int(total * 0.7)), node("b", int(total * 0.7)), node("c", int(total * 0.7)))
    outcome = run(request(), dense, nodes)
    assert not outcome.decision.admitted and outcome.decision.reason == "insufficient_memory"
    assert not outcome.decision.multi_node and not outcome.reservations


def test_multi_node_is_not_allowed_by_default() -> None:
    """A split is admitted only when asked for (`tests/unit/test_admission_split.py`)."""
    assert PlacementRequest(model=ModelRef(path="m.gguf")).allow_multi_node is False


def test_ties_go_to_the_node_first_in_natural_order(dense: ModelFacts) -> None:
    names = ("gpu-10", "gpu-2", "gpu-1")
    decision = run(request(), dense, view(*(node(n, 8 * GIB) for n in names))).decision
    assert decision.placements[0].node_id == "gpu-1"
    assert sorted(["gpu-10", "gpu-2", "gpu-1", "a7", "a10"], key=natural_key) == [
        "a7",
        "a10",
        "gpu-1",
        "gpu-2",
        "gpu-10",
    ]
    rejected = run(request(), dense, view(*(node(n, 1) for n in names))).decision
    assert [r.node_id for r in rejected.rejections] == ["gpu-1", "gpu-2", "gpu-10"]


def test_largest_context_is_buildable_fits_and_is_capped_at_training_context(dense: ModelFacts) -> None:
    settings = ServingSettings(slots=3, **QUIET)
    budget = need(dense.geometry, settings, 3 * 256 * 20) + 1000
    decision = run(request(ctx=None), dense, view(node("a", budget, settings=settings))).decision
    assert decision.admitted and decision.ctx is not None
    assert decision.ctx % (3 * 256) == 0 and decision.ctx == decision.context_ceiling
    assert need(dense.geometry, settings, decision.ctx) <= budget < need(dense.geometry, settings, decision.ctx + 768)
    roomy = run(request(ctx=None), dense, view(node("a", 60 * GIB, settings=settings))).decision
    assert roomy.ctx is not None and roomy.ctx <= dense.geometry.n_ctx_train
    assert roomy.context_ceiling is not None and roomy.context_ceiling > roomy.ctx


def test_reserved_memory_is_not_offered_twice(dense: ModelFacts) -> None:
    total = need(dense.geometry, ServingSettings(**QUIET), 4096)
    nodes = view(node("a", int(total * 1.5)))
    first = run(request(), dense, nodes)
    assert first.decision.admitted
    ledgers = {"a": with_reservation(None, "a", first.reservations[0])}
    second = run(request(), dense, nodes, ledgers)
    assert not second.decision.admitted and second.decision.reason == "insufficient_memory"
    # A dry run reserves nothing.
    assert not run(request(), dense, nodes, dry_run=True).reservations


def test_every_reservation_in_the_ledger_holds_until_removed_whatever_its_expires_at_says(dense: ModelFacts) -> None:
    # expires_at is the booking actor's wall clock: comparing it with ours would let skew free memory
    # that a runner may be using. Expiry is the placement actor's decision; the ledger is the truth.
    total = need(dense.geometry, ServingSettings(**QUIET), 4096)
    nodes = view(node("a", int(total * 1.5)))
    reservation = msgspec.structs.replace(run(request(), dense, nodes).reservations[0], expires_at=NOW - 3600)
    ledger = NodeLedger(node_id="a", reservations=(reservation,))
    held = reservation.held["CPU"]
    assert available(nodes["a"].resources, ledger, NOW) == {"CPU": int(total * 1.5) - held}
    assert available(nodes["a"].resources, ledger) == available(nodes["a"].resources, ledger, NOW + 10**6)


def test_staleness_is_the_age_of_the_report_on_our_clock_never_the_senders_time(dense: ModelFacts) -> None:
    for skew in (30.0, -30.0):  # the node's clock 30 s ahead of ours, then 30 s behind
        skewed = node("a", 8 * GIB, sent_at=NOW + skew)
        arrived_now = {"a": ViewEntry(resources=skewed, revision=1, age_s=0.5)}
        assert run(request(), dense, arrived_now).decision.admitted, skew
        silent = {"a": ViewEntry(resources=skewed, revision=1, age_s=16.0)}  # ttl 15 s: no report since
        decision = run(request(), dense, silent).decision
        assert not decision.admitted and decision.reason == "telemetry_stale", skew


def test_a_reservation_records_its_hold_as_a_duration(dense: ModelFacts) -> None:
    (reservation,) = run(request(hold_s=42.0), dense, view(node("a", 8 * GIB))).reservations
    assert reservation.hold_s == 42.0 and reservation.state == "reserved" and reservation.instance_id is None


def test_running_instance_seen_by_telemetry_is_not_counted_twice_but_capacity_still_is() -> None:
    n = node("a", 10 * GIB, total=16 * GIB)
    base = NodeLedger(node_id="a", reservations=())

    r = Reservation(
        reservation_id="r",
        decision_id="d",
        node_id="a",
        state="running",
        model_path="m",
        stamp=Stamp(settings=ServingSettings(), ctx=256, n_gpu_layers=0),
        layers=(0, 1),
        devices=(),
        held={"CPU": 4 * GIB},
        created_at=NOW - 50,
        running_since=NOW - 30,  # before the report (sent NOW - 1): the report already shows its memory
    )
    assert available(n, msgspec.structs.replace(base, reservations=(r,)), NOW) == {"CPU": 10 * GIB}
    fresh = msgspec.structs.replace(r, running_since=NOW - 0.5)  # after the report: not visible yet
    assert available(n, msgspec.structs.replace(base, reservations=(fresh,)), NOW) == {"CPU": 6 * GIB}
    big = msgspec.structs.replace(r, held={"CPU": 14 * GIB})  # capacity term: 16 - 14
    assert available(n, msgspec.structs.replace(base, reservations=(big,)), NOW) == {"CPU": 2 * GIB}
