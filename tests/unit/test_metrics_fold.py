"""The metrics cores: events, records and serving reports folded into Prometheus families (`actors/metrics/fold.py`),
llama-server's own families relabelled (`engine.py`), every name documented, labels bounded. Every check reads the
families back through prometheus-client's own exposition and parser, as a scraper would."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from actors.metrics.engine import relabel
from actors.metrics.families import (
    E2E_BUCKETS,
    FAMILIES,
    INTER_TOKEN_BUCKETS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    exported_name,
)
from actors.metrics.fold import EVENT_TYPES, BoundedLabel, NodeMetrics, model_name
from actors.placement.ledger import available
from actors.runner.passthrough import answer_stop
from messages import events as ev
from messages.frontdoor import FrontDoorModel, FrontDoorReport
from messages.generate import InstanceLoad, RouteDecision, RouteWeights, ServingReport
from messages.l3 import L3Inventory
from messages.placement import ModelRef, NodeLedger, PlacementDecision, PlacementRequest, RejectReason
from messages.runner import InstanceStatus
from runtime.config import ConfigError, load_config
from tests.harness.metrics import (
    NODE,
    _Families,
    absent,
    envelope,
    generate_openmetrics,
    parse_openmetrics,
    record,
    reservation,
    samples,
    scrape,
    telemetry,
    value,
)

ROOT = Path(__file__).resolve().parents[2]

#: What llama-server 11434 answers on /metrics (`--metrics`), after one completion.
ENGINE_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 9
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 4
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 12
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP process_open_fds not the engine's own
# TYPE process_open_fds gauge
process_open_fds 9
"""


# --- building inputs -----------------------------------------------------------------------------------------


def completed(
    instance: str = "i1",
    *,
    prompt: int = 20,
    generated: int = 8,
    ttft_ms: float = 100.0,
    total_ms: float = 450.0,
    node: str = NODE,
    **fields: Any,
) -> ev.GenerateCompleted:
    values: dict[str, Any] = {
        "request_id": "q", "decision_id": "d", "instance_id": instance, "endpoint": "chat", "status": 200,
        "stop_reason": "limit", "source": "cold", "prompt_tokens": prompt, "tokens_cached": 0, "tokens_restored": 0,
        "tokens_evaluated": prompt, "tokens_generated": generated, "ttft_ms": ttft_ms, "total_ms": total_ms,
    }  # fmt: skip
    return ev.GenerateCompleted(**envelope(node), **(values | fields))


# --- reading them back as a scraper does -------------------------------------------------------------------------


def bucket_bounds(text: str, name: str) -> list[float]:
    return sorted({float(ls["le"]) for n, ls, _ in samples(text) if n == f"{name}_bucket"})


def served(*instances: InstanceStatus) -> NodeMetrics:
    metrics = NodeMetrics(NODE)
    for status in instances:
        metrics.instance_record(status)
    return metrics


# --- requests ----------------------------------------------------------------------------------------------------


def test_answered_requests_move_vllms_counters_and_fill_histograms_with_vllms_buckets() -> None:
    metrics = served(record())
    metrics.event(completed(prompt=20, generated=8, ttft_ms=100.0, total_ms=450.0))
    metrics.event(completed(prompt=30, generated=6, ttft_ms=40.0, total_ms=140.0, endpoint="", stop_reason="eos",
                            tokens_cached=12, source="l3_local", tokens_restored=12))  # fmt: skip
    text = scrape(metrics)
    instance = {"node": NODE, "model": "qwen3-0.6b", "instance": "i1"}
    assert value(text, "mesh_prompt_tokens_total", **instance) == 50
    assert value(text, "mesh_generation_tokens_total", **instance) == 14
    assert value(text, "mesh_prefix_cache_queries_total", **instance) == 50
    assert value(text, "mesh_prefix_cache_hits_total", **instance) == 12
    assert value(text, "mesh_requests_total", endpoint="chat", status="200") == 1
    assert value(text, "mesh_requests_total", endpoint="completion", status="200") == 1
    assert value(text, "mesh_routed_requests_total", source="cold") == 1
    assert value(text, "mesh_routed_requests_total", source="l3_local") == 1
    assert value(text, "mesh_restored_tokens_total", source="l3_local") == 12
    assert value(text, "mesh_request_success_total", finished_reason="length") == 1
    assert value(text, "mesh_request_success_total", finished_reason="stop") == 1
    model = {"node": NODE, "model": "qwen3-0.6b"}
    assert value(text, "mesh_time_to_first_token_seconds_count", **model) == 2
    assert value(text, "mesh_time_to_first_token_seconds_sum", **model) == pytest.approx(0.14)
    assert value(text, "mesh_time_to_first_token_seconds_bucket", le="0.04") == 1  # 40 ms, cumulative
    assert value(text, "mesh_time_to_first_token_seconds_bucket", le="0.1") == 2
    assert value(text, "mesh_time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert bucket_bounds(text, "mesh_time_to_first_token_seconds") == [*TTFT_BUCKETS, math.inf]
    assert bucket_bounds(text, "mesh_inter_token_latency_seconds") == [*INTER_TOKEN_BUCKETS, math.inf]
    assert bucket_bounds(text, "mesh_e2e_request_latency_seconds") == [*E2E_BUCKETS, math.inf]
    assert bucket_bounds(text, "mesh_request_prompt_tokens") == [*TOKEN_BUCKETS, math.inf]
    assert value(text, "mesh_e2e_request_latency_seconds_sum") == pytest.approx(0.59)
    assert value(text, "mesh_request_generation_tokens_sum") == 14


def test_inter_token_latency_counts_one_observation_per_gap_between_tokens() -> None:
    metrics = served(record())
    metrics.event(completed(generated=11, ttft_ms=100.0, total_ms=600.0))  # 10 gaps of 50 ms
    metrics.event(completed(generated=1, ttft_ms=30.0, total_ms=30.0))  # one token: no gap
    text = scrape(metrics)
    assert value(text, "mesh_inter_token_latency_seconds_count") == 10
    assert value(text, "mesh_inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert value(text, "mesh_inter_token_latency_seconds_bucket", le="0.025") == 0
    assert value(text, "mesh_inter_token_latency_seconds_bucket", le="0.05") == 10


def test_refusals_and_pooled_endpoints_count_as_requests_but_not_as_generations() -> None:
    metrics = served(record())
    metrics.event(completed(status=400, generated=0, prompt=0))
    metrics.event(completed(endpoint="embeddings", generated=0, prompt=9, total_ms=12.0, ttft_ms=12.0))
    text = scrape(metrics)
    assert value(text, "mesh_requests_total", status="400") == 1
    assert value(text, "mesh_requests_total", endpoint="embeddings") == 1
    assert value(text, "mesh_e2e_request_latency_seconds_count") == 1  # the embeddings answer
    assert absent(text, "mesh_time_to_first_token_seconds_count")
    assert absent(text, "mesh_request_prompt_tokens_count")  # a generation's figure


def test_a_model_name_a_client_invents_creates_no_series() -> None:
    metrics = served(record())
    invented = "made-up-model-0123"
    decision = RouteDecision(chosen=None, reason="no instance")
    routed = ev.GenerateRouted(**envelope(), request_id="q", model=invented, n_prompt=0, candidates=(),
                               weights=RouteWeights(), decision=decision, router_version="1")  # fmt: skip
    for _ in range(3):
        metrics.event(routed)
    text = scrape(metrics)
    assert value(text, "mesh_routing_refusals_total", node=NODE) == 3
    assert invented not in text
    assert all(invented not in v for _, labels, _ in samples(text) for v in labels.values())


def test_an_event_about_an_instance_without_a_record_makes_no_instance_series() -> None:
    metrics = served()
    metrics.event(completed("ghost"))
    metrics.event(ev.InstanceRestarted(**envelope(), instance_id="ghost", reservation_id="r", attempt=2))
    text = scrape(metrics)
    assert "ghost" not in text
    assert value(text, "mesh_time_to_first_token_seconds_count", model="unknown") == 1


def test_an_instances_series_go_with_its_record() -> None:
    metrics = served(record("i1"), record("i2"))
    for instance in ("i1", "i2"):
        metrics.event(completed(instance))
        metrics.event(ev.InstanceRestarted(**envelope(), instance_id=instance, reservation_id="r", attempt=2))
        metrics.event(ev.HealthCheckFailed(**envelope(), instance_id=instance, reservation_id="r", check="probe",
                                           consecutive=1, reason="HTTP 503"))  # fmt: skip
    metrics.event(ev.InstanceCrashed(**envelope(), instance_id="i1", reservation_id="r", exit_code=-9,
                                     restart_in_s=1.0, log_tail="", out_of_memory=True))  # fmt: skip
    text = scrape(metrics)
    assert value(text, "mesh_instance_restarts_total", instance="i1") == 1
    assert value(text, "mesh_health_check_failures_total", instance="i2", check="probe") == 1
    assert value(text, "mesh_instance_crashes_total", instance="i1", out_of_memory="true") == 1
    metrics.instance_removed("i1")
    text = scrape(metrics)
    assert '"i1"' not in text
    assert value(text, "mesh_instance_restarts_total", instance="i2") == 1
    assert value(text, "mesh_time_to_first_token_seconds_count") == 2  # per model: kept


def test_the_event_types_the_shell_decodes_are_journal_types_and_the_others_change_nothing() -> None:
    tags = {str(t.__struct_config__.tag) for t in typing.get_args(ev.AnyEvent)}
    assert {"generate_completed", "health_check_failed", "placement_decided", "l3_captured"} <= EVENT_TYPES <= tags
    metrics = served(record())
    before = scrape(metrics)
    metrics.event(ev.InstanceStarting(**envelope(), instance_id="i1", reservation_id="r", command=("x",), port=1))
    assert "instance_starting" not in EVENT_TYPES and scrape(metrics) == before


def test_records_that_went_while_nobody_watched_take_their_series_with_them() -> None:
    metrics = served(record("kept"), record("gone"))
    for instance in ("kept", "gone"):
        metrics.event(ev.InstanceRestarted(**envelope(), instance_id=instance, reservation_id="r", attempt=2))
    metrics.keep_instances(["kept"])  # a restarted watch's first values name only this one
    text = scrape(metrics)
    assert value(text, "mesh_instance_restarts_total", instance="kept") == 1
    assert '"gone"' not in text


def test_events_recorded_by_another_node_are_left_to_that_nodes_metrics() -> None:
    metrics = served(record())
    metrics.event(completed(node="n2"))
    metrics.event(ev.L3Captured(**envelope("n2"), entry="e", identity="i", n_tokens=5, bytes=10, new_bytes=10,
                                ingest_ms=1.0))  # fmt: skip
    text = scrape(metrics)
    assert absent(text, "mesh_generation_tokens_total") and absent(text, "mesh_l3_captures_total")


# --- memory ------------------------------------------------------------------------------------------------------


def test_memory_gauges_are_the_records_predicted_and_observed_figures() -> None:
    metrics = served(record("i1"), record("old", "stopped"))
    text = scrape(metrics)
    i1 = {"instance": "i1", "model": "qwen3-0.6b"}
    for kind, expected in (("weights", 5000), ("kv", 1000), ("compute", 300), ("compute_margin", 75),
                           ("total", 6422)):  # fmt: skip
        assert value(text, "mesh_memory_predicted_bytes", **i1, kind=kind) == expected
    assert value(text, "mesh_memory_predicted_device_bytes", **i1, device="GPU0", kind="kv") == 800
    assert value(text, "mesh_memory_predicted_device_bytes", **i1, device="CPU", kind="total") == 1347
    assert value(text, "mesh_memory_observed_bytes", **i1, kind="compute") == 290
    assert value(text, "mesh_memory_observed_bytes", **i1, kind="total") == 6330
    assert value(text, "mesh_memory_observed_buffer_bytes", **i1, buffer="CUDA0") == 5000
    assert value(text, "mesh_instance_state", instance="old", state="stopped") == 1
    assert value(text, "mesh_instance_state", instance="old", state="ready") == 0
    assert absent(text, "mesh_memory_predicted_bytes", instance="old")  # its server is gone: holds nothing
    assert value(text, "mesh_instance_context_tokens", instance="i1") == 4096


def test_node_memory_is_the_ledgers_reservations_and_what_placement_would_offer() -> None:
    metrics = NodeMetrics(NODE)
    node = telemetry()
    book = NodeLedger(node_id=NODE, reservations=(
        reservation("a", "running", {"CPU": 1 << 30, "GPU0": 10 << 30}),
        reservation("b", "reserved", {"GPU0": 20 << 30}),
    ))  # fmt: skip
    metrics.telemetry(node)
    metrics.ledger(book)
    text = scrape(metrics)
    assert value(text, "mesh_node_memory_reserved_bytes", device="GPU0", state="running") == 10 << 30
    assert value(text, "mesh_node_memory_reserved_bytes", device="GPU0", state="reserved") == 20 << 30
    assert value(text, "mesh_node_memory_reserved_bytes", device="CPU", state="starting") == 0
    assert value(text, "mesh_node_memory_size_bytes", device="GPU0") == 140 << 30
    assert value(text, "mesh_node_memory_usable_bytes", device="CPU") == 40 << 30
    for device, free in available(node, book).items():
        assert value(text, "mesh_node_memory_available_bytes", device=device) == free
    metrics.ledger(None)
    metrics.telemetry(None)
    assert absent(scrape(metrics), "mesh_node_memory_reserved_bytes")


# --- serving reports, L3, the front door ----------------------------------------------------------------------


def test_running_waiting_and_kv_usage_come_from_the_current_serving_report() -> None:
    metrics = served(record())
    load = InstanceLoad(instance_id="i1", slots=2, busy=2, queued=3, identity=None, kv_tokens=1024)
    metrics.serving(ServingReport(node_id=NODE, seq=1, ttl_s=10.0, instances=(load,)), now=100.0)
    text = scrape(metrics, now=105.0)
    assert value(text, "mesh_num_requests_running", instance="i1") == 2
    assert value(text, "mesh_num_requests_waiting", instance="i1") == 3
    assert value(text, "mesh_kv_cache_usage_perc", instance="i1") == 0.25  # 1024 of 4096 cells
    assert absent(scrape(metrics, now=110.5), "mesh_num_requests_running")  # the report is too old to say


def test_store_and_front_door_gauges_and_their_events() -> None:
    metrics = NodeMetrics(NODE)
    metrics.l3(L3Inventory(node_id=NODE, entries=3, tokens=900, bytes=12345, budget_bytes=1 << 30, quarantined=1))
    model = FrontDoorModel(name="alpha", path="alpha.gguf", state="starting", instances=(), held_bytes=0, queued=4,
                           active=1, pinned=False, priority=0, idle_ttl_s=None)  # fmt: skip
    metrics.frontdoor(FrontDoorReport(node_id=NODE, address="http://x", auth=True, models=(model,), sent_at=0.0))
    for e in (
        ev.L3Captured(**envelope(), entry="e", identity="i", n_tokens=5, bytes=100, new_bytes=60, ingest_ms=1.0),
        ev.L3Evicted(**envelope(), entries=("a", "b"), freed_bytes=70, budget_bytes=1, stored_bytes=1),
        ev.L3CaptureDropped(**envelope(), identity="i", n_tokens=5, reason="io_error: [Errno 28] No space left"),
        ev.L3Fetched(**envelope(), entry="e", peer="n2", bytes=100, moved_bytes=40, fetch_ms=3.0),
        ev.HandoffCommitted(**envelope(), session="s", sender_node="n2", identity="i", n_tokens=5, bytes=500,
                            segments=1, payload_digest="d", restored=None, transfer_ms=250.0, restore_ms=1.0),
        ev.ModelLoaded(**envelope(), model="alpha", instance_id="i9", instance_node=NODE, load_ms=3200.0),
        ev.RoomMade(**envelope(), model="alpha", stopped_on=NODE, stopped=("i0",), frees={}),
        ev.ModelRefused(**envelope(), model="alpha", reason="never_fits"),
        ev.ModelRefused(**envelope(), model="alpha", reason="insufficient_memory: needs 9 GiB on GPU0"),
    ):  # fmt: skip
        metrics.event(e)
    text = scrape(metrics)
    assert value(text, "mesh_l3_stored_bytes") == 12345 and value(text, "mesh_l3_quarantined_entries") == 1
    assert value(text, "mesh_l3_captured_bytes_total") == 100 and value(text, "mesh_l3_written_bytes_total") == 60
    assert value(text, "mesh_l3_evictions_total") == 2 and value(text, "mesh_l3_evicted_bytes_total") == 70
    assert value(text, "mesh_l3_capture_drops_total", reason="io_error") == 1
    assert value(text, "mesh_l3_peer_fetched_bytes_total", peer="n2") == 40
    assert value(text, "mesh_handoff_bytes_total", peer="n2") == 500
    assert value(text, "mesh_handoff_seconds_bucket", peer="n2", le="0.25") == 1
    assert value(text, "mesh_frontdoor_queued_requests", model="alpha") == 4
    assert value(text, "mesh_frontdoor_inflight_requests", model="alpha") == 1
    assert value(text, "mesh_frontdoor_model_state", model="alpha", state="starting") == 1
    assert value(text, "mesh_frontdoor_model_loads_total", model="alpha") == 1
    assert value(text, "mesh_frontdoor_model_load_seconds_sum", model="alpha") == pytest.approx(3.2)
    assert value(text, "mesh_frontdoor_swaps_total", model="alpha") == 1
    assert value(text, "mesh_frontdoor_refusals_total", reason="never_fits") == 1
    assert value(text, "mesh_frontdoor_refusals_total", reason="insufficient_memory") == 1


def test_placement_decisions_count_by_outcome_and_reason() -> None:
    metrics = NodeMetrics(NODE)
    request = PlacementRequest(model=ModelRef(path="/m.gguf"), ctx=4096)
    outcomes: tuple[tuple[bool, RejectReason | None], ...] = (
        (True, None), (False, "insufficient_memory"), (False, "insufficient_memory"),
    )  # fmt: skip
    for admitted, reason in outcomes:
        decision = PlacementDecision(decision_id="d", admitted=admitted, dry_run=False, model=request.model,
                                     reason=reason)  # fmt: skip
        metrics.event(ev.PlacementDecided(**envelope(), request=request, decision=decision))
    text = scrape(metrics)
    assert value(text, "mesh_placement_decisions_total", outcome="admitted", reason="none") == 1
    assert value(text, "mesh_placement_decisions_total", outcome="rejected", reason="insufficient_memory") == 2


def test_free_text_labels_are_cut_to_a_token_and_capped_in_number() -> None:
    bounded = BoundedLabel(limit=4)
    assert bounded("f", "refused: the tiling has a gap at 4096") == "refused"
    assert bounded("f", "  Queue Full ") == "queue_full"
    assert bounded("peer", "node-7", node_id=True) == "node-7"
    assert bounded("peer", "not a node id!", node_id=True) == "other"
    values = {bounded("g", f"reason{i}: detail") for i in range(100)}
    assert values == {"reason0", "reason1", "reason2", "reason3", "other"}


def test_model_label_is_the_file_name_without_gguf() -> None:
    assert model_name("/models/Qwen3-0.6B-Q8_0.gguf") == "Qwen3-0.6B-Q8_0"
    assert model_name("tiny") == "tiny"


def test_a_pass_through_answer_says_why_it_stopped_in_its_own_apis_words() -> None:
    # the runner's stop_reason of a pass-through (what finished_reason counts), read from the answer it relayed
    assert answer_stop([{"choices": [{"finish_reason": "length"}], "usage": {}}]) == "limit"
    assert answer_stop([{"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": {}}, {"usage": {}}]) == "eos"
    assert answer_stop([{"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {}}]) == "limit"
    assert answer_stop([{"stop_reason": "stop_sequence", "usage": {}}]) == "stop_word"
    incomplete = {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}, "usage": {}}
    assert answer_stop([{"type": "response.completed", "response": incomplete}]) == "limit"
    assert answer_stop([{"content": "x", "stop_type": "word"}]) == "stop_word"
    assert answer_stop([None, {"choices": "not a list of choices"}, {}]) == "eos"  # says nothing: eos


# --- llama-server's own metrics ----------------------------------------------------------------------------------


def test_llama_servers_families_are_relabelled_merged_and_kept_to_its_own() -> None:
    metrics = served(record("i1", port=8100), record("i2", port=8101, model="/m/other.gguf"), record("i3", port=None))
    targets = metrics.engine_targets()
    assert [(t.instance_id, t.port) for t in targets] == [("i1", 8100), ("i2", 8101)]  # ready, with a port
    engines: dict[str, list[Metric] | None] = {t.instance_id: relabel(ENGINE_TEXT, t.labels) for t in targets}
    engines["i2"] = None  # its /metrics did not answer
    text = scrape(metrics, engines=engines)
    assert value(text, "llamacpp:tokens_predicted_total", node=NODE, model="qwen3-0.6b", instance="i1") == 4
    assert value(text, "llamacpp:n_tokens_max", instance="i1") == 12  # a counter without _total: a gauge
    assert value(text, "mesh_engine_metrics_up", instance="i1") == 1
    assert value(text, "mesh_engine_metrics_up", instance="i2") == 0
    assert "process_open_fds" not in text  # not the engine's own
    both = {"i1": relabel(ENGINE_TEXT, targets[0].labels), "i2": relabel(ENGINE_TEXT, targets[1].labels)}
    families = [f for f in text_string_to_metric_families(scrape(metrics, engines=both))]
    (predicted,) = [f for f in families if f.name == "llamacpp:tokens_predicted"]
    assert {s.labels["instance"] for s in predicted.samples} == {"i1", "i2"}  # one family, a series each


def test_an_engine_answer_that_is_not_prometheus_text_is_refused_whole() -> None:
    with pytest.raises(ValueError):
        relabel("llamacpp:tokens_predicted_total {{{ 4\n", {"instance": "i1"})


@given(st.text(max_size=400))
def test_relabel_takes_any_text_without_failing_other_than_by_refusing_it(text: str) -> None:
    try:
        families = relabel(text, {"node": NODE, "model": "m", "instance": "i1"})
    except ValueError:
        return
    assert all(f.name.startswith("llamacpp:") for f in families)
    assert all(s.labels["instance"] == "i1" for f in families for s in f.samples)


# --- the exposition and the docs ---------------------------------------------------------------------------------


def test_both_exposition_formats_parse_with_every_family_named() -> None:
    metrics = served(record())
    metrics.event(completed())
    families = metrics.families(0.0, {"i1": relabel(ENGINE_TEXT, metrics.engine_targets()[0].labels)})
    prometheus = {f.name for f in text_string_to_metric_families(generate_latest(_Families(families)).decode())}
    openmetrics = {f.name for f in parse_openmetrics(generate_openmetrics(_Families(families)).decode())}
    ours = {spec.name for spec in FAMILIES}
    assert ours <= prometheus and ours <= openmetrics
    assert "llamacpp:tokens_predicted" in prometheus and "llamacpp:tokens_predicted" in openmetrics


def test_every_family_is_documented_in_operations() -> None:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    missing = [exported_name(spec) for spec in FAMILIES if f"`{exported_name(spec)}`" not in text]
    assert not missing, f"docs/operations.md does not list {missing}"
    assert len({spec.name for spec in FAMILIES}) == len(FAMILIES)
    assert all(re.fullmatch(r"mesh_[a-z0-9_]+", spec.name) for spec in FAMILIES)


def test_a_metrics_listener_beyond_loopback_needs_the_api_key(tmp_path: Path) -> None:
    flags = {"data_dir": str(tmp_path), "node_id": "n"}
    assert load_config({**flags, "metrics": "9100"}, {}).metrics == ("127.0.0.1", 9100)
    with pytest.raises(ConfigError, match=re.escape("metrics listener listens on 0.0.0.0")):
        load_config({**flags, "metrics": "0.0.0.0:9100"}, {})
    keyed = load_config({**flags, "metrics": "0.0.0.0:9100"}, {"MESH_ACTOR_API_KEY": "k"})
    assert keyed.metrics == ("0.0.0.0", 9100) and keyed.api_key == "k"
