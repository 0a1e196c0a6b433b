"""Decision events stay small whatever the cluster's size, and replay still has everything: a decision over
a view of 2,000 nodes is journaled as a bounded event naming a side record, and replays identically."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.placement import decision_records
from actors.placement.actor import PlacementActor
from actors.placement.fleet import RIVALS
from actors.placement.replay import differences, inputs_of, recompute
from actors.router.routing import choose, link_key, route
from messages.events import GenerateRouted, PlacementDecided
from messages.generate import Candidate, RouteWeights
from messages.placement import LISTED_REFUSALS
from messages.telemetry import ModelFiles
from runtime import buckets
from runtime.bus import Bus, encode
from runtime.cli import replay as replay_command
from tests.conftest import JournalReader, NatsServer, of_type, supervised
from tests.harness.placement import GIB, SUBJECTS, ask, place, report
from tests.tiny_models import write_llama

NODES = 2000


async def replay_cli(server: NatsServer, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="mesh-actor")
    replay_command.register(parser.add_subparsers(dest="command", required=True))
    options = server.options
    assert options.user and options.password
    secret = server.data_dir / "client-password"
    secret.write_text(options.password + "\n")  # never in argv
    args = parser.parse_args(
        ["replay", "--json", "--nats", server.url, "--nats-user", options.user, "--nats-password-file", str(secret)]
    )
    capsys.readouterr()
    code = await args.func(args)
    result: dict[str, object] = json.loads(capsys.readouterr().out)
    result["exit_code"] = code
    return result


async def test_a_decision_over_2000_nodes_is_a_small_event_and_replays_identically(
    bus: Bus,
    nats_server: NatsServer,
    tmp_path: Path,
    journal_reader: JournalReader,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = write_llama(tmp_path / "dense.gguf", n_layer=4)
    nodes = await buckets.nodes(bus, SUBJECTS)
    for i in range(NODES):
        await nodes.put(f"node-{i}", encode(report(f"node-{i}", (4 + i % 7) * GIB)))
    actor = PlacementActor()
    async with supervised(bus, [actor], node_id="p1"):
        async with asyncio.timeout(30):
            while len(actor._view) < NODES:
                await asyncio.sleep(0.05)
        # The brief answer names the chosen node; its journal records it and its closest rivals, inline.
        brief = await place(bus, ask(model, ctx=2048))
        assert brief.admitted and brief.rejections == () and set(brief.view) == {brief.placements[0].node_id}
        decision = await place(bus, ask(model, ctx=2048, explain=True))
        assert decision.admitted and len(decision.view) == NODES
        refused = await place(bus, ask(model, ctx=2048, settings={"slots": 7}, explain=True))  # 2,000 rejections
        assert not refused.admitted and len(refused.rejections) == NODES
        listed = await place(bus, ask(model, ctx=2048, settings={"slots": 7}))
        assert not listed.admitted and len(listed.rejections) == LISTED_REFUSALS and listed.message == refused.message

        raw = [
            msg
            for msg in await journal_reader.wait_for(of_type("placement_decided"), count=4)
            if msg.get("type") == "placement_decided"
        ]
    recorded_brief = msgspec.convert(raw[0], PlacementDecided)
    assert recorded_brief.record is None and recorded_brief.decision.decision_id == brief.decision_id
    assert brief.placements[0].node_id in {n.node_id for n in recorded_brief.view}
    assert len(recorded_brief.view) <= 2 + RIVALS  # the chosen node, a holder, its rivals
    inputs = inputs_of(recorded_brief)
    assert inputs is not None and inputs.geometry is not None
    assert differences(inputs.decision, recompute(inputs, inputs.geometry)) == []
    for recorded_event, answered in zip(raw[1:], (decision, refused, listed), strict=True):
        size = len(json.dumps(recorded_event).encode())
        assert size < 64 * 1024, size
        event = msgspec.convert(recorded_event, PlacementDecided)
        assert event.record is not None and inputs_of(event) is None and event.view == ()
        assert event.decision.decision_id == answered.decision_id and len(event.decision.rejections) <= 8
        inputs = await decision_records.fetch(bus, SUBJECTS, event.record)
        assert len(inputs.view) == NODES and inputs.decision == answered
        assert inputs.geometry is not None
        assert differences(inputs.decision, recompute(inputs, inputs.geometry)) == []

    result = await replay_cli(nats_server, capsys)
    assert result == {"replayed": 4, "changed": [], "skipped": [], "exit_code": 0}


async def test_a_small_decision_keeps_its_inputs_inline(
    bus: Bus, tmp_path: Path, journal_reader: JournalReader
) -> None:
    model = write_llama(tmp_path / "dense.gguf", n_layer=4)
    nodes = await buckets.nodes(bus, SUBJECTS)
    await nodes.put("a", encode(report("a", 8 * GIB)))
    actor = PlacementActor()
    async with supervised(bus, [actor], node_id="p1"):
        async with asyncio.timeout(10):
            while "a" not in actor._view:
                await asyncio.sleep(0.02)
        await place(bus, ask(model, ctx=2048))
        (recorded,) = await journal_reader.wait_for(of_type("placement_decided"))
    event = msgspec.convert(recorded, PlacementDecided)
    assert event.record is None and [n.node_id for n in event.view] == ["a"] and "a" in event.view_ages
    inputs = inputs_of(event)
    assert inputs is not None and inputs.geometry is not None
    assert differences(event.decision, recompute(inputs, inputs.geometry)) == []


def _candidate(iid: str, node: str, rate: float, **fields: object) -> Candidate:
    base: dict[str, object] = {
        "instance_id": iid, "node": node, "slots": 2, "busy": 0, "queued": 0, "identity": "ef" * 32,
        "prefill_tokens_per_s": rate, "state_bytes_per_token": 100_000.0,
    }  # fmt: skip
    return Candidate(**{**base, **fields})  # type: ignore[arg-type]


async def test_replay_re_decides_an_older_routers_events_and_names_both_versions(
    bus: Bus, nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    links = {link_key("n2", "n1"): 1e9}
    # route-2 priced the prefill node with the decoder's holding: 2,000 tokens (10 s) where it computes 32,000.
    held = [_candidate("a", "n1", 100.0, held_tokens=30_000, source="resident"), _candidate("b", "n2", 200.0)]
    mispriced = msgspec.structs.replace(
        choose(32_001, held),
        prefill_node="n2",
        prefill_reason="prefill 2000 tokens on n2: 10.250s with the handoff vs 20.000s here (break-even 3 tokens)",
    )
    cold = [_candidate("a", "n1", 100.0), _candidate("b", "n2", 1000.0, busy=2, queued=1)]
    recorded = [(held, 32_001, mispriced), (cold, 4001, route(4001, cold, links=links))]
    for i, (candidates, n_prompt, decision) in enumerate(recorded):
        event = GenerateRouted(
            id=f"routed-{i}", time=0.0, node="n1", actor="router", request_id=f"r{i}", model="m",
            n_prompt=n_prompt, candidates=tuple(candidates), weights=RouteWeights(), decision=decision,
            router_version="route-2", links=links,
        )  # fmt: skip
        await bus.js.publish(SUBJECTS.event("router", "generate_routed", "n1"), encode(event))

    result = await replay_cli(nats_server, capsys)
    assert result["replayed"] == 2 and result["skipped"] == [] and result["exit_code"] == 3
    changes = result["changed"]
    assert isinstance(changes, list) and len(changes) == 1
    changed: dict[str, Any] = changes[0]
    assert changed["decision_id"] == "routed-0" and changed["versions"] == {"recorded": "route-2", "now": "route-3"}
    paths = {d["path"]: (d["recorded"], d["now"]) for d in changed["differences"]}
    assert paths["$.prefill_node"] == ("n2", None)


async def test_the_files_each_node_holds_are_journaled_and_a_preference_for_a_holder_replays(
    bus: Bus, tmp_path: Path, journal_reader: JournalReader
) -> None:
    """Issue 21: placement prefers the node that holds the model's file (its report lists it) over one with more
    room, says how much another node would fetch, and replay re-decides both from the journal alone."""
    model = write_llama(tmp_path / "dense.gguf", n_layer=4)
    size = model.stat().st_size
    held = ModelFiles(held=((str(model), size, ""),))
    nodes = await buckets.nodes(bus, SUBJECTS)
    await nodes.put("a", encode(msgspec.structs.replace(report("a", 4 * GIB), model_files=held)))
    await nodes.put("b", encode(msgspec.structs.replace(report("b", 8 * GIB), model_files=ModelFiles())))
    actor = PlacementActor()
    async with supervised(bus, [actor], node_id="p1"):
        async with asyncio.timeout(10):
            while {"a", "b"} - set(actor._view):
                await asyncio.sleep(0.02)
        holder = await place(bus, ask(model, ctx=2048))
        fetcher = await place(bus, ask(model, ctx=2048, nodes=["b"]))
        recorded = await journal_reader.wait_for(of_type("placement_decided"), count=2)
    assert [(p.node_id, p.fetch_bytes) for p in holder.placements] == [("a", 0)]
    assert [(p.node_id, p.fetch_bytes) for p in fetcher.placements] == [("b", size)]
    for raw in recorded:
        event = msgspec.convert(raw, PlacementDecided)
        inputs = inputs_of(event)
        assert inputs is not None and inputs.geometry is not None
        assert differences(event.decision, recompute(inputs, inputs.geometry)) == []
