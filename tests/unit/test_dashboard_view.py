"""The dashboard's cores: the fleet folded from records and events (`view`), a decision explained and re-decided
(`explain`), and the session cookie (`access`)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.dashboard.access import session_token, session_valid
from actors.dashboard.explain import explain
from actors.dashboard.view import FleetView, device_of, merge
from actors.placement.ledger import available
from actors.router.routing import route
from messages import events as ev
from messages.frontdoor import FrontDoorModel, FrontDoorReport
from messages.generate import Candidate, RouteWeights
from messages.l3 import L3Inventory
from messages.placement import ModelRef, NodeLedger, PlacementDecision, PlacementRequest
from messages.runner import InstanceStatus
from tests.harness.metrics import NODE, PREDICTED, envelope, record, reservation, telemetry


def stored(event: ev.Event) -> bytes:
    return msgspec.json.encode(event)


def event_bytes(event_id: str, kind: str = "actor_started", **fields: Any) -> bytes:
    return json.dumps({"type": kind, "id": event_id, "time": 1.0, "node": NODE, "actor": "a", **fields}).encode()


def door(*models: FrontDoorModel) -> FrontDoorReport:
    return FrontDoorReport(node_id=NODE, address="http://127.0.0.1:1", auth=True, models=models, sent_at=0.0)


def catalog_model(name: str, **fields: Any) -> FrontDoorModel:
    values: dict[str, Any] = {"path": f"{name}.gguf", "state": "stopped", "instances": (), "held_bytes": 0,
                              "queued": 0, "active": 0, "pinned": False, "priority": 0, "idle_ttl_s": None}  # fmt: skip
    return FrontDoorModel(name=name, **(values | fields))


# --- the view ------------------------------------------------------------------------------------------------


def test_a_device_bar_adds_the_predicted_kinds_of_live_instances_and_the_ledgers_holdings() -> None:
    view = FleetView()
    report = telemetry()
    ledger = NodeLedger(node_id=NODE, reservations=(reservation("r1", "running", {"CPU": 1500, "GPU0": 5200}),))
    view.node(NODE, report)
    view.ledger(NODE, ledger)
    view.instance("i1", record("i1"))
    view.instance("i2", record("i2", "stopped"))  # ended: holds nothing
    node = view.snapshot()["nodes"][NODE]
    devices = {d["device"]: d for d in node["devices"]}
    gpu = devices["GPU0"]
    assert gpu["predicted"] == {"weights": 4000, "kv": 800, "recurrent": 0, "compute": 200, "other": 0}
    assert devices["CPU"]["predicted"] == {"weights": 1000, "kv": 200, "recurrent": 0, "compute": 100, "other": 47}
    assert gpu["size_bytes"] == 140 << 30 and gpu["usable_bytes"] == 100 << 30 and gpu["name"] == "H200"
    assert gpu["reserved_bytes"] == 5200 and devices["CPU"]["reserved_bytes"] == 1500
    assert {d: devices[d]["available_bytes"] for d in devices} == available(report, ledger)
    assert devices["CPU"]["size_bytes"] == 64 << 30
    assert (devices["CPU"]["observed_bytes"], gpu["observed_bytes"]) == (1330, 5000)  # OBSERVED's buffers, i1 only


def test_llama_cpps_buffers_are_named_by_the_meshs_devices() -> None:
    named = {b: device_of(b) for b in ("CPU", "CPU_Mapped", "CPU_REPACK", "CUDA_Host", "CUDA0", "CUDA1", "Vulkan2",
                                       "RPC[10.0.0.2:50052]", "Metal")}  # fmt: skip
    assert named == {"CPU": "CPU", "CPU_Mapped": "CPU", "CPU_REPACK": "CPU", "CUDA_Host": "CPU", "CUDA0": "GPU0",
                     "CUDA1": "GPU1", "Vulkan2": "GPU2", "RPC[10.0.0.2:50052]": None, "Metal": None}  # fmt: skip


def test_an_instance_record_changes_its_node_and_goes_with_its_key() -> None:
    view = FleetView()
    view.node(NODE, telemetry())
    deltas = view.instance("i1", record("i1"))
    assert [(d["op"], d["id"]) for d in deltas] == [("instance", "i1"), ("node", NODE)]
    shown = deltas[0]["value"]
    assert shown["state"] == "ready" and shown["model"] == "qwen3-0.6b" and shown["settings"]["slots"] == 2
    assert shown["predicted"]["kv"] == PREDICTED.kv_bytes and shown["observed"]["total"] == 6330
    gone = view.instance("i1", None)
    assert gone[0] == {"op": "instance", "id": "i1", "value": None}
    assert view.snapshot()["instances"] == {}
    cpu = next(d for d in gone[1]["value"]["devices"] if d["device"] == "CPU")
    assert sum(cpu["predicted"].values()) == 0


def test_a_node_whose_telemetry_expired_leaves_the_view() -> None:
    view = FleetView()
    view.node(NODE, telemetry())
    view.l3(NODE, L3Inventory(node_id=NODE, entries=2, tokens=40, bytes=100, budget_bytes=1000))
    assert view.snapshot()["nodes"][NODE]["l3"]["entries"] == 2
    assert view.node(NODE, None) == [{"op": "node", "id": NODE, "value": None}]
    assert view.snapshot()["nodes"] == {}


def test_catalog_models_come_and_go_with_their_front_doors_report() -> None:
    view = FleetView()
    deltas = view.frontdoor(NODE, door(catalog_model("alpha", state="ready", instances=("i1",), queued=3)))
    assert [(d["id"], d["value"]["queued"]) for d in deltas] == [(f"{NODE}/alpha", 3)]
    deltas = view.frontdoor(NODE, door(catalog_model("beta")))
    assert {d["id"]: d["value"] for d in deltas}[f"{NODE}/alpha"] is None
    assert list(view.snapshot()["models"]) == [f"{NODE}/beta"]
    assert view.frontdoor(NODE, None) == [{"op": "model", "id": f"{NODE}/beta", "value": None}]


def test_the_journal_tail_is_bounded_and_an_event_read_twice_shows_once() -> None:
    view = FleetView(journal_limit=5)
    for i in range(12):
        view.event(i + 1, "mesh.events.a.actor_started.n1", event_bytes(f"e{i}", attempt=i))
    assert [e["id"] for e in view.journal] == [f"e{i}" for i in range(7, 12)]
    assert view.event(None, "s", event_bytes("e11")) == []  # heard live and read from the stream: once
    assert view.event(None, "s", event_bytes("e0"))[0]["value"]["id"] == "e0"  # fell out of the tail: new again
    assert len(view.journal) == 5


def test_an_events_trace_is_kept_beside_its_summary() -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    (delta,) = FleetView().event(1, "s", event_bytes("e1", trace=traceparent, attempt=2))
    assert delta["value"]["trace"] == traceparent and delta["value"]["summary"] == "attempt=2"


def test_an_unreadable_event_shows_as_such() -> None:
    (delta,) = FleetView().event(3, "mesh.events.x.y.n9", b"\xff not json")
    assert delta["value"]["type"] == "unreadable" and delta["value"]["node"] == "n9"


def test_only_the_latest_decisions_are_kept_whole_within_their_bytes() -> None:
    view = FleetView(decision_limit=3, decision_bytes=10_000)
    for i in range(6):
        view.event(i, "s", event_bytes(f"d{i}", "generate_routed", decision={"chosen": "i1", "reason": "r"}))
    assert view.kept_decisions[0] == 3
    assert view.decision("d0") is None and view.decision("d5") is not None
    big = event_bytes("huge", "placement_decided", pad="x" * 20_000)
    view.event(9, "s", big)
    assert view.decision("huge") is None  # over the whole budget: its summary only
    small = FleetView(decision_limit=100, decision_bytes=1000)
    for i in range(50):
        small.event(i, "s", event_bytes(f"d{i}", "generate_routed", decision={}))
    assert small.kept_decisions[1] <= 1000
    view.event(10, "s", event_bytes("plain"))
    assert view.decision("plain") is None  # not a decision: nothing kept beyond its line


@given(st.lists(st.binary(max_size=300) | st.text(max_size=200).map(str.encode), max_size=60))
def test_any_stream_of_bytes_keeps_the_tail_bounded(payloads: list[bytes]) -> None:
    view = FleetView(journal_limit=10, decision_limit=4, decision_bytes=2000)
    for i, data in enumerate(payloads):
        view.event(i, "mesh.events.a.b.n", data)
        view.event(i, "mesh.events.a.b.n", event_bytes(f"x{i}", "generate_routed", decision={"chosen": None}))
    assert len(view.journal) <= 10
    count, size = view.kept_decisions
    assert count <= 4 and size <= 2000
    json.dumps(view.snapshot())  # always JSON


def test_a_peers_huge_event_fields_and_records_leave_the_snapshot_small() -> None:
    """A peer writes its own events and records: 200 KB ids, names, traces and fields (the hostile probe's were
    900 KB, and took the snapshot from 188 KB to 138 MB) show cut to a bound, and two long ids stay two."""
    huge = "x" * 200_000
    view = FleetView(journal_limit=40)
    for i in range(40):
        fields = {"id": f"{huge}{i}", "node": huge, "actor": huge, "trace": huge, "time": 10**4000 if i else 1.0,
                  "reason": huge, huge: 1}  # fmt: skip
        kind = "generate_routed" if i % 2 else huge
        decision = {"chosen": huge, "reason": huge, "prefill_node": huge}
        view.event(i, "mesh.events.a.b.n", json.dumps({"type": kind, "decision": decision, **fields}).encode())
    view.node(huge, telemetry(node_id=huge))
    view.instance(
        huge, msgspec.structs.replace(record(huge, node=huge, model=huge), message=huge, members=(huge,) * 500)
    )
    view.frontdoor(huge, door(catalog_model(huge, path=huge, instances=(huge,) * 500)))
    snapshot = view.snapshot()
    assert len(json.dumps(snapshot)) < 200_000, len(json.dumps(snapshot))
    assert len(view.journal) == 40 and len({e["id"] for e in view.journal}) == 40  # cut, but still distinct
    assert all(len(e["summary"]) <= 240 and len(e["trace"]) <= 64 for e in view.journal)
    (instance,) = snapshot["instances"].values()
    assert len(instance["members"]) <= 256 and instance["message"].endswith("…")
    assert view.decision(view.journal[-1]["id"]) is not None  # a kept decision is found by the id the page shows


def test_a_decisions_summary_names_its_verdict() -> None:
    request = PlacementRequest(model=ModelRef(path="/m/alpha.gguf"), ctx=4096)
    decision = PlacementDecision(decision_id="d", admitted=False, dry_run=False, model=request.model,
                                 reason="insufficient_memory")  # fmt: skip
    (delta,) = FleetView().event(1, "s", stored(ev.PlacementDecided(**envelope(), request=request, decision=decision)))
    assert "/m/alpha.gguf refused (insufficient_memory) ctx=" in delta["value"]["summary"]
    assert delta["value"]["decision"] is True


def test_merge_keeps_the_last_change_of_each_thing_and_every_event() -> None:
    deltas: list[dict[str, Any]] = [{"op": "node", "id": "a", "value": 1}, {"op": "event", "id": "e1", "value": {}},
              {"op": "node", "id": "a", "value": 2}, {"op": "event", "id": "e1", "value": {}}]  # fmt: skip
    assert merge(deltas) == deltas[1:]


# --- a decision explained --------------------------------------------------------------------------------------


def routed(**fields: Any) -> ev.GenerateRouted:
    candidates = (
        Candidate(instance_id="i1", node="n1", slots=2, busy=2, queued=3),
        Candidate(instance_id="i2", node="n2", slots=2, busy=0, queued=0, held_tokens=30, source="resident"),
    )
    decision = route(40, candidates, RouteWeights())
    values: dict[str, Any] = {"request_id": "q", "model": "alpha", "n_prompt": 40, "candidates": candidates,
                              "weights": RouteWeights(), "decision": decision, "router_version": "1"}  # fmt: skip
    return ev.GenerateRouted(**envelope(), **(values | fields))


def test_a_routing_decision_comes_with_its_inputs_and_is_re_decided() -> None:
    detail = explain(stored(routed()))
    assert detail["kind"] == "routing" and detail["decision"]["chosen"] == "i2"
    assert [c["instance_id"] for c in detail["inputs"]["candidates"]] == ["i1", "i2"]
    assert detail["replay"]["same"] is True and detail["replay"]["differences"] == []


def test_a_routing_decision_todays_router_would_make_otherwise_says_where() -> None:
    event = routed()
    changed = msgspec.structs.replace(event, decision=msgspec.structs.replace(event.decision, chosen="i1"))
    replay = explain(stored(changed))["replay"]
    assert replay["same"] is False
    assert {"path": "$.chosen", "recorded": "i1", "now": "i2"} in replay["differences"]


def test_a_placement_decision_without_header_facts_is_shown_but_not_re_decided() -> None:
    request = PlacementRequest(model=ModelRef(path="/m.gguf"), ctx=4096)
    decision = PlacementDecision(decision_id="d", admitted=False, dry_run=False, model=request.model,
                                 reason="model_unreadable")  # fmt: skip
    detail = explain(stored(ev.PlacementDecided(**envelope(), request=request, decision=decision)))
    assert detail["kind"] == "placement" and detail["inputs"]["request"]["ctx"] == 4096
    assert "unreadable" in detail["replay"]["error"]
    with pytest.raises(ValueError):
        explain(event_bytes("x"))


# --- the session cookie ------------------------------------------------------------------------------------------


def test_a_session_token_proves_the_key_until_it_expires() -> None:
    token = session_token("k", now=1000.0, lifetime_s=60)
    assert session_valid(token, "k", 1059.0)
    assert not session_valid(token, "k", 1060.0)  # expired
    assert not session_valid(token, "other-key", 1001.0)  # the key changed
    expires, mac = token.split(".")
    assert not session_valid(f"{int(expires) + 3600}.{mac}", "k", 1001.0)  # a longer life is not forged
    for bad in (None, "", "x", ".", "abc.def", "1" * 200, f"{expires}.", f"-5.{mac}"):
        assert not session_valid(bad, "k", 1001.0)
    assert len(mac) == 64


def test_an_instance_view_is_json() -> None:
    status: InstanceStatus = record("i9", "starting", observed=None)
    (delta, _) = FleetView().instance("i9", status)
    assert delta["value"]["observed"] is None
    json.dumps(delta)
