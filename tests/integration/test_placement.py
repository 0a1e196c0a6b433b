"""The placement actor on a real nats-server: requests, reservations, the registry, the journal and replay."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import pytest

from actors.placement.actor import PlacementActor, ledger_key
from actors.placement.admission import Outcome
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.registry import public_key_of, sign
from actors.placement.replay import differences, recompute
from messages.events import InstanceReady, InstanceStopped, PlacementDecided
from messages.memory import MemoryBreakdown
from messages.placement import NodeLedger, PlacementDecision, PlacementRequest, Reservation, Stamp
from messages.registry import RegistryEntry
from messages.runner import ObservedMemory
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.actor import ActorContext
from runtime.bus import Bus, decode, encode
from runtime.cli.placement import _build_entry
from runtime.journal import Journal
from tests.conftest import JournalReader, NatsServer, of_type, put_telemetry, supervised
from tests.harness.placement import GIB, QUIET, SUBJECTS, ask, ledger, need, place, report, wait_view
from tests.tiny_models import write_llama, write_qwen35

MIB = 1 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "dense": write_llama(root / "dense.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512),
        "hybrid": write_qwen35(root / "hybrid.gguf", n_layer=8, state_size=64, dt_rank=16),
        "other": write_llama(root / "other.gguf", n_layer=4),
    }


@pytest.fixture
async def placement(bus: Bus) -> AsyncIterator[PlacementActor]:
    actor = PlacementActor(trusted_registry_keys=(), sweep_interval_s=0.2)
    async with supervised(bus, [actor], node_id="p1"):
        yield actor


async def test_admitted_with_breakdown_and_refused_with_need_and_have(
    bus: Bus, placement: PlacementActor, models: dict[str, Path], journal_reader: JournalReader
) -> None:
    total = need(models["dense"])
    await put_telemetry(bus, report("a", total + 10 * MIB))
    await wait_view(placement, "a")
    decision = await place(bus, ask(models["dense"]))
    assert decision.admitted and decision.reservation_id and decision.placements[0].node_id == "a"
    assert decision.stamp is not None and decision.stamp.settings == QUIET
    device = decision.placements[0].breakdown.devices[0]
    assert device.total_bytes == total and device.budget_bytes == total + 10 * MIB
    stored = await ledger(bus, "a")
    assert [r.reservation_id for r in stored.reservations] == [decision.reservation_id]

    again = await place(bus, ask(models["dense"]))
    assert not again.admitted and again.reason == "insufficient_memory"
    (shortfall,) = again.rejections[0].shortfalls
    assert (shortfall.device, shortfall.need_bytes, shortfall.have_bytes) == ("CPU", total, 10 * MIB)

    recorded = await journal_reader.wait_for(of_type("placement_decided"), count=2)
    assert [e["decision"]["admitted"] for e in recorded] == [True, False]
    assert recorded[0]["view_revisions"] == {"a": decision.view["a"]}
    assert recorded[1]["ledgers"][0]["reservations"][0]["reservation_id"] == decision.reservation_id


async def test_fit_answers_without_reserving_or_journaling(
    bus: Bus, placement: PlacementActor, models: dict[str, Path], journal_reader: JournalReader
) -> None:
    await put_telemetry(bus, report("a", need(models["dense"]) + MIB))
    await wait_view(placement, "a")
    for _ in range(3):
        decision = await place(bus, ask(models["dense"]), fit=True)
        assert decision.admitted and decision.dry_run and decision.reservation_id is None
    kv = await buckets.reservations(bus, SUBJECTS)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(ledger_key("a"))
    real = await place(bus, ask(models["dense"]))
    (recorded,) = await journal_reader.wait_for(of_type("placement_decided"))
    assert recorded["decision"]["decision_id"] == real.decision_id  # the what-ifs were not journaled


async def test_hybrid_model_refused_until_node_advertises_settings(
    bus: Bus, placement: PlacementActor, models: dict[str, Path]
) -> None:
    await put_telemetry(bus, report("bare", 32 * GIB, settings=None))
    await wait_view(placement, "bare")
    decision = await place(bus, ask(models["hybrid"]))
    assert not decision.admitted and decision.reason == "settings_unknown"
    assert "llama-server not found" in decision.rejections[0].message
    await put_telemetry(bus, report("bare", 32 * GIB))
    async with asyncio.timeout(10):
        while placement._view["bare"].resources.settings is None:
            await asyncio.sleep(0.02)
    assert (await place(bus, ask(models["hybrid"]))).admitted


async def test_a_node_with_a_skewed_clock_stays_eligible_while_it_reports_and_goes_stale_when_it_stops(
    bus: Bus, placement: PlacementActor, models: dict[str, Path]
) -> None:
    skews = {"ahead": 30.0, "behind": -30.0}  # the nodes' clocks against ours; their reports live 2 s

    async def fits(name: str) -> PlacementDecision:
        return await place(bus, ask(models["dense"], nodes=[name]), fit=True)

    for seq in range(1, 4):
        for name, skew in skews.items():
            await put_telemetry(bus, report(name, 4 * GIB, sent_at=time.time() + skew, ttl_s=2.0, seq=seq))
        async with asyncio.timeout(10):
            while not all(n in placement._view and placement._view[n].resources.seq == seq for n in skews):
                await asyncio.sleep(0.02)
        for name in skews:
            decision = await fits(name)
            assert decision.admitted, (name, decision.message)
    # The reports stop: both become stale, judged by when their last report arrived here.
    async with asyncio.timeout(15):
        while [(await fits(name)).reason for name in skews] != ["telemetry_stale"] * len(skews):
            await asyncio.sleep(0.1)


async def test_placement_splits_a_model_over_nodes_only_when_allowed(
    bus: Bus, placement: PlacementActor, models: dict[str, Path]
) -> None:
    total = need(models["dense"])
    for name in ("x", "y"):
        await put_telemetry(bus, report(name, int(total * 0.75)))  # together they hold it, neither alone
    await wait_view(placement, "x", "y")
    decision = await place(bus, ask(models["dense"]))
    assert not decision.admitted and decision.reason == "insufficient_memory" and not decision.multi_node
    kv = await buckets.reservations(bus, SUBJECTS)
    for name in ("x", "y"):
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get(ledger_key(name))
    asked = await place(bus, ask(models["dense"], allow_multi_node=True))  # tests/integration/test_placement_split.py
    assert asked.admitted and asked.multi_node and {p.node_id for p in asked.placements} == {"x", "y"}


async def test_two_placement_actors_never_over_commit(
    bus: Bus, nats_server: NatsServer, models: dict[str, Path]
) -> None:
    one = need(models["dense"])
    await put_telemetry(bus, report("shared", 3 * one + one // 2))  # room for exactly three
    second_bus = await Bus.connect(nats_server.options, name="placement-2")
    first, second = PlacementActor(), PlacementActor()
    try:
        async with supervised(bus, [first], node_id="p1"), supervised(second_bus, [second], node_id="p2"):
            await wait_view(first, "shared")
            await wait_view(second, "shared")
            await place(bus, ask(models["dense"]), fit=True)  # both endpoints registered
            decisions = await asyncio.gather(*(place(bus, ask(models["dense"])) for _ in range(10)))
    finally:
        await second_bus.close()
    assert sum(d.admitted for d in decisions) == 3
    stored = await ledger(bus, "shared")
    assert len(stored.reservations) == 3
    assert sum(r.held["CPU"] for r in stored.reservations) <= 3 * one + one // 2
    assert {r.reservation_id for r in stored.reservations} == {d.reservation_id for d in decisions if d.admitted}


async def test_runner_events_replace_and_release_reservations(
    bus: Bus, placement: PlacementActor, models: dict[str, Path], journal_reader: JournalReader
) -> None:
    await put_telemetry(bus, report("a", 4 * GIB))
    await wait_view(placement, "a")
    decision = await place(bus, ask(models["dense"]))
    assert decision.reservation_id
    rid = decision.reservation_id
    predicted: MemoryBreakdown = decision.placements[0].breakdown
    runner_journal = Journal(bus, SUBJECTS, "a")  # what the node's runner would publish
    task = asyncio.create_task(runner_journal.run())
    try:
        observed = ObservedMemory(
            kv_bytes=1, recurrent_bytes=0, draft_kv_bytes=0, weights_bytes=1, compute_bytes=1, output_bytes=1,
            total_bytes=12345,
        )  # fmt: skip
        ids = {"instance_id": "i1", "reservation_id": rid}
        ready = runner_journal.emit(InstanceReady, "runner", **ids, port=1, predicted=predicted, observed=observed)
        await journal_reader.wait_for(of_type("reservation_observed", reservation_id=rid))
        (running,) = (await ledger(bus, "a")).reservations
        assert running.state == "running" and running.held == {"CPU": 12345} and running.expires_at is None
        assert running.running_since == ready.time  # the node's clock, compared only with its own reports
        assert running.instance_id == "i1"
        assert running.node_started_at == placement._view["a"].resources.started_at
        runner_journal.emit(InstanceStopped, "runner", **ids, reason="stop requested")
        released = await journal_reader.wait_for(of_type("reservation_released", reservation_id=rid))
        assert released[0]["reason"] == "stopped"
        assert (await ledger(bus, "a")).reservations == ()
    finally:
        await runner_journal.flush(5)
        task.cancel()


async def test_reservation_never_started_expires(
    bus: Bus, placement: PlacementActor, models: dict[str, Path], journal_reader: JournalReader
) -> None:
    await put_telemetry(bus, report("a", 4 * GIB))
    await wait_view(placement, "a")
    decision = await place(bus, ask(models["dense"], hold_s=0.5))
    released = await journal_reader.wait_for(of_type("reservation_released", reservation_id=decision.reservation_id))
    assert released[0]["reason"] == "expired"
    assert (await ledger(bus, "a")).reservations == ()


@pytest.fixture
def signing_key(tmp_path: Path) -> tuple[Path, str]:
    import nacl.signing
    import nkeys

    seed = nkeys.encode_seed(bytes(nacl.signing.SigningKey.generate()), nkeys.PREFIX_BYTE_ACCOUNT)
    path = tmp_path / "registry.nk"
    path.write_bytes(seed)
    return path, public_key_of(seed)


async def test_signed_registry_entries_are_trusted_and_tampered_unsigned_or_renamed_ones_refused(
    bus: Bus, models: dict[str, Path], signing_key: tuple[Path, str]
) -> None:
    key_file, public = signing_key
    entry = _build_entry(models["dense"], "dense", key_file)
    registry = await buckets.registry(bus, SUBJECTS)
    await registry.put("dense", encode(entry))
    tampered = _build_entry(models["dense"], "tampered", key_file)
    tampered = msgspec.structs.replace(
        tampered, geometry=msgspec.structs.replace(tampered.geometry, n_ctx_train=tampered.geometry.n_ctx_train * 2)
    )
    await registry.put("tampered", encode(tampered))
    unsigned = msgspec.structs.replace(_build_entry(models["dense"], "unsigned", key_file), signature="")
    await registry.put("unsigned", encode(unsigned))
    foreign = sign(msgspec.structs.replace(entry, name="foreign", signature=""), _fresh_seed())  # nobody trusts it
    await registry.put("foreign", encode(foreign))
    await registry.put("copied", encode(entry))  # a valid entry for "dense", stored under another name

    actor = PlacementActor(trusted_registry_keys=(public,))
    async with supervised(bus, [actor], node_id="p1"):
        await put_telemetry(bus, report("a", 8 * GIB))
        await wait_view(actor, "a")
        # The placement node does not need the file: the signed facts are enough.
        remote = await place(bus, ask(None, model={"registry": "dense"}))
        assert remote.admitted and remote.model_digest == entry.blake3 and remote.architecture == "llama"
        with_file = await place(bus, ask(None, model={"registry": "dense", "path": str(models["dense"])}), fit=True)
        assert with_file.admitted
        for name, needle in (
            ("tampered", "does not match its signature"),
            ("unsigned", "unsigned"),
            ("foreign", "not a trusted registry key"),
            ("copied", "signed for 'dense'"),
        ):
            refused = await place(bus, ask(None, model={"registry": name}))
            assert not refused.admitted and refused.reason == "registry_untrusted", name
            assert needle in refused.message, refused.message
        mismatch = await place(bus, ask(None, model={"registry": "dense", "path": str(models["other"])}))
        assert not mismatch.admitted and mismatch.reason == "registry_untrusted"
        assert "signed for" in mismatch.message or "differs" in mismatch.message
        missing = await place(bus, ask(None, model={"registry": "nope"}))
        assert not missing.admitted and missing.reason == "model_unreadable"
    assert isinstance(entry, RegistryEntry)


def _fresh_seed() -> bytes:
    import nacl.signing
    import nkeys

    return bytes(nkeys.encode_seed(bytes(nacl.signing.SigningKey.generate()), nkeys.PREFIX_BYTE_ACCOUNT))


async def test_malformed_requests_get_errors_and_the_actor_keeps_serving(
    bus: Bus, placement: PlacementActor, models: dict[str, Path]
) -> None:
    await put_telemetry(bus, report("a", 4 * GIB))
    await wait_view(placement, "a")
    await place(bus, ask(models["dense"]), fit=True)
    cases = {
        b"{nope": None,
        b'{"model": {"path": 5}, "ctx": 8192}': "$.model.path",
        b'{"model": {"path": "x"}, "ctx": "big"}': "$.ctx",
        b'{"model": {"path": "x"}, "ctx": 0}': "$.ctx",
        b'{"ctx": 8192}': "$",
        b'{"model": {"path": "x"}, "ctx": 8192, "slots": 4}': "$",
    }
    for payload, path in cases.items():
        msg = await bus.nc.request(SUBJECTS.placement_request, payload, timeout=5)
        body = json.loads(msg.data)
        assert body["code"] == "bad_request", payload
        if path:
            assert body["details"]["path"] == path, (payload, body)
    unknown = await place(bus, ask(Path("/no/such/model.gguf")))
    assert not unknown.admitted and unknown.reason == "model_unreadable" and "No such file" in unknown.message
    garbage = models["dense"].parent / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 64)
    hostile = await place(bus, ask(garbage))
    assert not hostile.admitted and hostile.reason == "model_unreadable" and "at byte 4" in hostile.message
    assert (await place(bus, ask(models["dense"]))).admitted  # still serving
    minimal = await bus.nc.request(
        SUBJECTS.placement_fit, json.dumps({"model": {"path": str(models["dense"])}, "ctx": 8192}).encode(), timeout=5
    )
    assert json.loads(minimal.data)["admitted"] is True


async def test_replay_finds_a_changed_decision_after_a_core_change_and_none_otherwise(
    bus: Bus, placement: PlacementActor, models: dict[str, Path], journal_reader: JournalReader
) -> None:
    await put_telemetry(bus, report("a", 4 * GIB, settings=msgspec.structs.replace(QUIET, slots=2)))
    await wait_view(placement, "a")
    await place(bus, ask(models["hybrid"]))
    await place(bus, ask(models["dense"], ctx=10**6))  # refused
    recorded = await journal_reader.wait_for(of_type("placement_decided"), count=2)
    events = [msgspec.convert(e, PlacementDecided) for e in recorded]
    geometries = [geometry_from_header(read_header(e.model_path or "")) for e in events]

    for event, geometry in zip(events, geometries, strict=True):
        assert differences(event.decision, recompute(event, geometry)) == []

    def changed_core(request: PlacementRequest, facts: Any, view: Any, ledgers: Any, **kw: Any) -> Outcome:
        # A core that stamps one more slot than the node advertises.
        from actors.placement.admission import ViewEntry
        from actors.placement.fleet import decide

        def bump(node: NodeResources) -> NodeResources:
            assert node.settings is not None
            return msgspec.structs.replace(
                node, settings=msgspec.structs.replace(node.settings, slots=node.settings.slots + 1)
            )

        bumped = {
            name: ViewEntry(resources=bump(e.resources), revision=e.revision, age_s=e.age_s) for name, e in view.items()
        }
        return decide(request, facts, bumped, ledgers, **kw)

    diff = differences(events[0].decision, recompute(events[0], geometries[0], decide_fn=changed_core))
    paths = {d.path for d in diff}
    assert "$.stamp.settings.slots" in paths
    assert next(d for d in diff if d.path == "$.stamp.settings.slots").recorded == 2


async def test_an_unreadable_ledger_refuses_its_node_and_placement_keeps_serving(
    bus: Bus, placement: PlacementActor, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    await put_telemetry(bus, report("broken", 8 * GIB))
    await put_telemetry(bus, report("fine", 2 * GIB))
    await wait_view(placement, "broken", "fine")
    kv = await buckets.reservations(bus, SUBJECTS)
    await kv.put(ledger_key("broken"), b'{"node_id": "broken", "reservations": [{"oops": 1}]}')
    decision = await place(bus, ask(models["dense"], explain=True))
    assert decision.admitted and decision.placements[0].node_id == "fine"
    assert [(r.node_id, r.reason) for r in decision.rejections] == [("broken", "ledger_unreadable")]
    only = await place(bus, ask(models["dense"], nodes=["broken"]))
    assert not only.admitted and only.reason == "ledger_unreadable"
    assert (await kv.get(ledger_key("broken"))).value == b'{"node_id": "broken", "reservations": [{"oops": 1}]}'
    sweeps = asyncio.Semaphore(0)
    sweep = placement.reconcile

    async def counted(ctx: ActorContext) -> None:
        await sweep(ctx)
        sweeps.release()

    monkeypatch.setattr(placement, "reconcile", counted)
    async with asyncio.timeout(10):
        for _ in range(2):  # a few sweeps over the broken ledger: the actor is still up and answering
            await sweeps.acquire()
    assert (await place(bus, ask(models["dense"]), fit=True)).admitted


async def test_instances_of_a_node_process_that_restarted_are_released(
    bus: Bus, placement: PlacementActor, models: dict[str, Path], journal_reader: JournalReader
) -> None:
    await put_telemetry(bus, report("a", 4 * GIB))
    await wait_view(placement, "a")
    decision = await place(bus, ask(models["dense"]))
    kv = await buckets.reservations(bus, SUBJECTS)
    entry = await kv.get(ledger_key("a"))
    (reserved,) = decode(entry.value or b"", NodeLedger).reservations
    earlier = time.time() - 600  # the node process that ran the instance
    running = msgspec.structs.replace(
        reserved, state="running", expires_at=None, running_since=time.time() - 60, node_started_at=earlier
    )
    await kv.put(ledger_key("a"), encode(NodeLedger(node_id="a", reservations=(running,))))
    await put_telemetry(bus, report("a", 4 * GIB))  # the node process started after the instance was running
    released = await journal_reader.wait_for(of_type("reservation_released", reservation_id=decision.reservation_id))
    assert released[0]["reason"] == "node_restarted"
    assert (await ledger(bus, "a")).reservations == ()


async def test_lying_telemetry_and_malformed_runner_events_change_nothing(
    bus: Bus, placement: PlacementActor, models: dict[str, Path], journal_reader: JournalReader
) -> None:
    nodes = await buckets.nodes(bus, SUBJECTS)
    honest = report("honest", 4 * GIB)
    await nodes.put("honest", encode(honest))
    liar = msgspec.to_builtins(report("liar", 4 * GIB))
    liar["host"]["usable_bytes"] = -1  # negative memory
    await nodes.put("liar", json.dumps(liar).encode())
    await nodes.put("impostor", encode(report("honest", 64 * GIB)))  # claims another node's id
    # The watch applies the bucket in order: once a later report is in the view, the bad ones were handled.
    await nodes.put("marker", encode(report("marker", 4 * GIB)))
    await wait_view(placement, "honest", "marker")
    await nodes.delete("marker")
    async with asyncio.timeout(10):
        while "marker" in placement._view:
            await asyncio.sleep(0.02)
    assert set(placement._view) == {"honest"}

    decision = await place(bus, ask(models["dense"]))
    rid = decision.reservation_id
    assert decision.admitted and rid
    bogus = (
        b'{"type": "instance_ready", "reservation_id": "' + rid.encode() + b'", "node": "honest"}',  # no fields
        b'{"type": "instance_stopped", "node": 7}',
        b"not json at all",
    )
    for payload in bogus:
        await bus.js.publish(SUBJECTS.event("runner", "instance_ready", "honest"), payload)
    runner_journal = Journal(bus, SUBJECTS, "honest")
    task = asyncio.create_task(runner_journal.run())
    try:
        runner_journal.emit(InstanceStopped, "runner", instance_id="i", reservation_id=rid, reason="stop requested")
        await journal_reader.wait_for(of_type("reservation_released", reservation_id=rid))
    finally:
        await runner_journal.flush(5)
        task.cancel()
    assert (await ledger(bus, "honest")).reservations == ()  # the valid event after the bad ones still applied


async def test_a_model_path_that_is_not_a_regular_file_is_refused_at_once(
    bus: Bus, placement: PlacementActor, tmp_path: Path
) -> None:
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)  # opening it would block forever
    await put_telemetry(bus, report("a", 4 * GIB))
    await wait_view(placement, "a")
    decision = await place(bus, ask(fifo))
    assert not decision.admitted and decision.reason == "model_unreadable" and "not a regular file" in decision.message


async def test_a_refusal_decided_from_a_lagging_local_copy_is_rechecked_against_the_bucket(
    bus: Bus, placement: PlacementActor, models: dict[str, Path]
) -> None:
    await put_telemetry(bus, report("a", need(models["dense"]) + 10 * MIB))
    await wait_view(placement, "a")
    assert (await place(bus, ask(models["dense"]), fit=True)).admitted
    full = Reservation(
        reservation_id="gone", decision_id="d", node_id="a", state="running", model_path="m.gguf",
        stamp=Stamp(settings=QUIET, ctx=256, n_gpu_layers=0), layers=(0, 1), devices=(), held={"CPU": 64 * GIB},
        created_at=0.0,
    )  # fmt: skip
    # The local copy shows the node full; the bucket's next write frees it, and lands only when the actor checks
    # the bucket after refusing: the copy lags the bucket then, and catches up before the refusal is answered.
    kv = await buckets.reservations(bus, SUBJECTS)
    revision = await kv.create(ledger_key("a"), encode(NodeLedger(node_id="a", reservations=(full,))))
    async with asyncio.timeout(10):
        while placement._ledger_cache.get("a", (None, 0))[1] != revision:
            await asyncio.sleep(0.01)
    catch_up = placement._catch_up
    checked = 0

    async def checking() -> bool:
        nonlocal checked
        checked += 1
        if checked == 1:
            await kv.update(ledger_key("a"), encode(NodeLedger(node_id="a")), last=revision)
        return await catch_up()

    placement._catch_up = checking  # type: ignore[method-assign]
    decision = await place(bus, ask(models["dense"]))
    assert decision.admitted, decision.message
    assert checked == 1  # the refusal from the lagging copy was decided again once the copy caught up
    assert [r.reservation_id for r in (await ledger(bus, "a")).reservations] == [decision.reservation_id]


async def test_concurrent_requests_spread_over_the_nodes_their_bookings_in_flight_leave_room_on(
    bus: Bus, models: dict[str, Path]
) -> None:
    # Eight nodes with room for one instance each, eight requests at once to one placement actor that tries a
    # booking twice at most: a decision sees the bookings still in flight (their compare-and-set not answered
    # yet), so each picks another node; none is over-committed and none loses the race twice (without the
    # bookings in flight, each would pick the node with the most room, and most would).
    actor = PlacementActor(max_attempts=2)
    names = [f"n{i}" for i in range(8)]
    async with supervised(bus, [actor], node_id="p1"):
        for i, name in enumerate(names):
            await put_telemetry(bus, report(name, need(models["dense"]) + (10 + i) * MIB))
        await wait_view(actor, *names)
        decisions = await asyncio.gather(*(place(bus, ask(models["dense"])) for _ in names))
    assert all(d.admitted for d in decisions), [d.message for d in decisions if not d.admitted]
    assert sorted(d.placements[0].node_id for d in decisions) == sorted(names)
    for name in names:
        assert len((await ledger(bus, name)).reservations) == 1
