"""Fleet index: the same decisions as admission's full scan, on random fleets that change between requests."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from actors.placement import fleet
from actors.placement.admission import ModelFacts, Outcome, ViewEntry, decide
from actors.placement.fleet import FleetIndex, LedgerEntry, snapshot
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.placement import ModelRef, NodeLedger, PlacementRequest, PreferredSettings, Reservation, Stamp
from messages.settings import ServingSettings
from messages.telemetry import GpuInfo, HostInfo, LlamaServerInfo, ModelFiles, NodeResources
from tests.tiny_models import write_llama, write_qwen35

MIB = 1 << 20
NOW = 1_000_000.0
MONOTONIC = 5_000.0
QUIET = {"cache_ram_mib": 0, "ctx_checkpoints": 0}
#: What nodes advertise: several sharing one profile, one llama-server refuses for these models (a quantized V
#: cache without flash attention), and none at all.
PROFILES: tuple[ServingSettings | None, ...] = (
    ServingSettings(**QUIET),
    ServingSettings(slots=1, **QUIET),
    ServingSettings(slots=8, kv_unified=True, cache_type_k="q8_0", **QUIET),
    ServingSettings(slots=2, flash_attn="off", **QUIET),
    ServingSettings(slots=4, cache_ram_mib=16, ctx_checkpoints=2),
    ServingSettings(cache_type_v="q8_0", flash_attn="off", **QUIET),
    None,
)
NAMES = tuple(f"n-{i}" for i in range(1, 25))
#: The model files nodes report holding (the models' names in the tests' `ModelFacts`).
HOLDINGS = (
    None,
    ModelFiles(),
    ModelFiles(held=(("llama.gguf", 7 * MIB, ""),)),
    ModelFiles(held=(("llama.gguf", 7 * MIB, "e" * 64),)),  # another version than the models' (digest "f" * 64)
    ModelFiles(held=(("qwen35.gguf", 5, "f" * 64),)),
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelFacts, ...]:
    d = tmp_path_factory.mktemp("m")
    paths = (
        write_llama(d / "llama.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512),
        write_qwen35(d / "qwen35.gguf", n_layer=8, state_size=64, dt_rank=16, group_count=2),
    )
    digests = ("f" * 64, None)  # one model known by its digest (held files of another version do not count)
    return tuple(
        ModelFacts(geometry=geometry_from_header(read_header(p)), path=p.name, digest=d)
        for p, d in zip(paths, digests, strict=True)
    )


def gpu(index: int, total_mib: int, usable_mib: int) -> GpuInfo:
    usable = min(usable_mib, total_mib) * MIB
    return GpuInfo(
        index=index,
        name="test",
        uuid=f"GPU-{index}",
        total_bytes=total_mib * MIB,
        free_bytes=usable,
        used_bytes=total_mib * MIB - usable,
        usable_bytes=usable,
    )


@st.composite
def reports(draw: st.DrawFn, name: str, seq: int) -> NodeResources:
    profile = draw(st.sampled_from(PROFILES))
    n_gpus = draw(st.sampled_from((0, 1, 1, 2, 3)))
    size = draw(st.sampled_from((32, 64, 96)))
    # Few distinct amounts, so that nodes share sizings and layouts, and some tie on headroom.
    gpus = tuple(gpu(i, size, draw(st.sampled_from((0, 8, 24, 40, 64, 96)))) for i in range(n_gpus))
    host = draw(st.sampled_from((4, 16, 48, 128, 512))) * MIB
    return NodeResources(
        node_id=name,
        seq=seq,
        sent_at=NOW - 1,
        started_at=NOW - 100,
        ttl_s=15,
        host=HostInfo(
            ram_total_bytes=1024 * MIB,
            ram_available_bytes=host,
            usable_bytes=host,
            cpu_count=8,
            cpu_features=draw(st.sampled_from((None, ("AVX2",), ("NEON", "DOTPROD")))),
        ),
        gpus=gpus,
        memory_limit_bytes=draw(st.sampled_from((None, None, 40 * MIB))),
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info="") if profile else None,
        llama_server_error=None if profile else "not installed",
        settings=profile,
        model_files=draw(st.sampled_from(HOLDINGS)),
    )


@st.composite
def ledgers(draw: st.DrawFn, name: str) -> LedgerEntry:
    kind = draw(st.sampled_from(("none", "none", "held", "unreadable")))
    if kind == "none":
        return fleet.NO_LEDGER
    if kind == "unreadable":
        return (None, -1)
    held = {device: draw(st.integers(1, 48)) * MIB for device in draw(st.sets(st.sampled_from(("CPU", "GPU0"))))}
    reservation = Reservation(
        reservation_id=f"r-{name}",
        decision_id="d",
        node_id=name,
        state=draw(st.sampled_from(("reserved", "running"))),
        model_path="m.gguf",
        stamp=Stamp(settings=ServingSettings(), ctx=256, n_gpu_layers=0),
        layers=(0, 1),
        devices=(),
        held=held,
        created_at=NOW - 10,
        # NOW - 0.5 lies between a report (sent at NOW - 1) and its heartbeat (a second later): the heartbeat sees
        # the memory the report could not.
        running_since=draw(st.sampled_from((None, NOW - 5, NOW - 0.5))),
    )
    return NodeLedger(node_id=name, reservations=(reservation,)), draw(st.integers(1, 50))


@st.composite
def requests(draw: st.DrawFn) -> PlacementRequest:
    fields: dict[str, object] = {"model": {"path": "m.gguf"}}
    mode = draw(st.sampled_from(("fixed", "fixed", "fixed", "max_ctx", "ceiling")))
    if mode != "ceiling":
        fields["ctx"] = draw(st.sampled_from((1, 256, 1000, 4096, 16384, 65536)))
    if mode == "max_ctx":
        fields["max_ctx"] = True
    fields["n_gpu_layers"] = draw(st.sampled_from((-1, -1, 0, 3, 100)))
    if draw(st.booleans()):
        fields["nodes"] = tuple(draw(st.lists(st.sampled_from((*NAMES[:8], "ghost")), max_size=6)))
    if draw(st.integers(0, 4)) == 0:
        fields["settings"] = PreferredSettings(slots=draw(st.sampled_from((1, 4))))
    if draw(st.integers(0, 4)) == 0:
        fields["prefer"] = tuple(draw(st.lists(st.sampled_from(NAMES[:8]), max_size=3, unique=True)))
    return msgspec.convert(fields, PlacementRequest, from_attributes=True)


@dataclass
class Fleet:
    """The placement actor's state as the index sees it: view, arrival times and ledgers."""

    view: dict[str, ViewEntry] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)
    ledgers: dict[str, LedgerEntry] = field(default_factory=dict)
    revision: int = 0
    touched: list[str] = field(default_factory=list)  # what changed, for a tracked index


@st.composite
def changes(draw: st.DrawFn, current: Fleet) -> None:
    """Changes a few nodes of `current` in place: a new report, a new ledger, or gone."""
    for name in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=8)):
        current.touched.append(name)
        what = draw(st.sampled_from(("report", "report", "heartbeat", "ledger", "gone")))
        if what == "heartbeat" and name in current.view:  # the same report again, only newer
            current.revision += 1
            old = current.view[name].resources
            again = msgspec.structs.replace(old, seq=old.seq + 1, sent_at=old.sent_at + 1)
            current.view[name] = ViewEntry(resources=again, revision=current.revision)
            current.arrived[name] = MONOTONIC - draw(st.sampled_from((0.0, 3.0, 15.1)))
        elif what == "gone":
            current.view.pop(name, None)
            current.arrived.pop(name, None)
        elif what == "ledger":
            current.ledgers[name] = draw(ledgers(name))
        else:
            current.revision += 1
            current.view[name] = ViewEntry(resources=draw(reports(name, current.revision)), revision=current.revision)
            current.arrived[name] = MONOTONIC - draw(st.sampled_from((0.0, 0.5, 3.0, 14.9, 15.1, 40.0)))


def both(
    index: FleetIndex, request: PlacementRequest, model: ModelFacts, current: Fleet, fresh: dict[str, LedgerEntry]
) -> tuple[Outcome, Outcome]:
    ids = {"now": NOW, "decision_id": "d1", "reservation_id": "r1"}
    dry_run = request.hold_s == 600.0 and bool(current.revision % 2)
    fast = index.decide(
        request, model, current.view, current.arrived, current.ledgers, monotonic_now=MONOTONIC, dry_run=dry_run,
        fresh=fresh, **ids,
    )  # fmt: skip
    inputs = snapshot(request, current.view, current.arrived, current.ledgers, fresh, MONOTONIC)
    full = decide(
        request, model, inputs.view, inputs.held, unreadable=inputs.unreadable, dry_run=dry_run, **ids
    )  # fmt: skip
    return fast, full


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_index_decides_exactly_what_the_full_scan_decides_on_fleets_that_change(
    data: st.DataObject, models: tuple[ModelFacts, ...]
) -> None:
    index = FleetIndex()
    current = Fleet()
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        data.draw(changes(current))
        request = data.draw(requests(), label="request")
        model = data.draw(st.sampled_from(models), label="model")
        fresh: dict[str, LedgerEntry] = {}
        if data.draw(st.booleans(), label="fresh ledgers"):
            fresh = {name: data.draw(ledgers(name)) for name in data.draw(st.sets(st.sampled_from(NAMES[:6])))}
        fast, full = both(index, request, model, current, fresh)
        assert fast == full
        decision = fast.decision
        event("admitted" if decision.admitted else f"refused: {decision.reason}")
        for reason in sorted({r.reason for r in decision.rejections}):
            event(f"a node refused: {reason}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_tracked_index_judging_only_what_changed_decides_exactly_what_the_full_scan_decides(
    data: st.DataObject, models: tuple[ModelFacts, ...]
) -> None:
    # The placement actor's index: told of every change (`touch`), it judges again only the nodes touched, those
    # gone stale as time passes (no report needed: the clock moves here) and the stale ones; several questions
    # (models, contexts, -ngl, settings) interleaved, each with its own standing answer.
    index = FleetIndex(tracked=True)
    current = Fleet()
    ids = {"now": NOW, "decision_id": "d1", "reservation_id": "r1"}
    clock = MONOTONIC
    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        if data.draw(st.booleans(), label="change"):
            data.draw(changes(current))
        for name in current.touched:
            index.touch(name)
        current.touched.clear()
        clock += data.draw(st.sampled_from((0.0, 0.4, 2.0, 9.0)), label="seconds pass")
        request = data.draw(requests(), label="request")
        model = data.draw(st.sampled_from(models), label="model")
        fast = index.decide(
            request, model, current.view, current.arrived, current.ledgers, monotonic_now=clock, dry_run=True,
            fresh={}, **ids,
        )  # fmt: skip
        inputs = snapshot(request, current.view, current.arrived, current.ledgers, {}, clock)
        full = decide(request, model, inputs.view, inputs.held, unreadable=inputs.unreadable, dry_run=True, **ids)
        assert fast == full
        event("admitted" if fast.decision.admitted else f"refused: {fast.decision.reason}")


def test_many_nodes_share_one_sizing_per_profile_and_layout(models: tuple[ModelFacts, ...]) -> None:
    dense = models[0]
    current = Fleet()
    for i in range(200):
        name = f"node-{i}"
        report = NodeResources(
            node_id=name, seq=1, sent_at=NOW, started_at=NOW, ttl_s=15,
            host=HostInfo(ram_total_bytes=1024 * MIB, ram_available_bytes=512 * MIB, usable_bytes=512 * MIB,
                          cpu_count=8),
            gpus=(gpu(0, 96, 20 + i % 60),), settings=PROFILES[i % 2],
        )  # fmt: skip
        current.view[name] = ViewEntry(resources=report, revision=i + 1)
        current.arrived[name] = MONOTONIC
    index = FleetIndex()
    request = PlacementRequest(model=ModelRef(path="m.gguf"), ctx=4096)
    for _ in range(3):
        fast, full = both(index, request, dense, current, {})
        assert fast == full and fast.decision.admitted
    stats = index.stats()
    assert stats.nodes == 200 and stats.profiles == 2 and stats.sized == 2  # one sizing per profile, reused


def test_tables_stay_bounded_when_nodes_come_and_go(
    models: tuple[ModelFacts, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fleet, "MAX_SIZINGS", 8)
    monkeypatch.setattr(fleet, "MAX_PROFILES", 4)
    index = FleetIndex()
    current = Fleet()
    for step in range(100):
        name = f"node-{step}"
        profile = ServingSettings(slots=1 + step % 16, **QUIET)  # a new profile now and then
        report = NodeResources(
            node_id=name, seq=1, sent_at=NOW, started_at=NOW, ttl_s=15,
            host=HostInfo(ram_total_bytes=1024 * MIB, ram_available_bytes=512 * MIB, usable_bytes=512 * MIB,
                          cpu_count=8),
            settings=profile,
        )  # fmt: skip
        current.view = {name: ViewEntry(resources=report, revision=step + 1)}  # the fleet is one node, each time new
        current.arrived = {name: MONOTONIC}
        fast, full = both(index, PlacementRequest(model=ModelRef(path="m.gguf"), ctx=256 * (1 + step % 5)),
                          models[step % 2], current, {})  # fmt: skip
        assert fast == full
        stats = index.stats()
        # each limit is checked before a decision, which adds at most one entry per node of the view
        assert stats.sizings <= 8 + 1 and stats.profiles <= 4 + 1 and stats.nodes <= 1 + 64 + 1
    assert index.stats().resets > 0


@pytest.mark.parametrize("tracked", [False, True])
def test_a_heartbeat_after_a_reservation_became_running_frees_what_the_report_now_shows(
    models: tuple[ModelFacts, ...], tracked: bool
) -> None:
    # The live term subtracts what the report cannot see yet: a reservation ready after the report was taken. A
    # heartbeat (the same report, only newer) sent after it became running shows its memory as used, so the
    # subtraction ends there, and a decision must see the memory it frees.
    dense = models[0]
    request = PlacementRequest(model=ModelRef(path="m.gguf"), ctx=4096)
    need = estimate(dense.geometry, PROFILES[0] or ServingSettings(), 4096).total_bytes
    usable = need + 64 * MIB
    report = NodeResources(
        node_id="a", seq=1, sent_at=NOW - 10, started_at=NOW - 100, ttl_s=15,
        host=HostInfo(ram_total_bytes=4096 * MIB, ram_available_bytes=usable, usable_bytes=usable, cpu_count=8),
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info=""), settings=PROFILES[0],
    )  # fmt: skip
    running = Reservation(
        reservation_id="r-a", decision_id="d", node_id="a", state="running", model_path="m.gguf",
        stamp=Stamp(settings=ServingSettings(), ctx=256, n_gpu_layers=0), layers=(0, 1), devices=(),
        held={"CPU": 128 * MIB}, created_at=NOW - 20, running_since=NOW - 5,
    )  # fmt: skip
    current = Fleet(
        view={"a": ViewEntry(resources=report, revision=1)},
        arrived={"a": MONOTONIC},
        ledgers={"a": (NodeLedger(node_id="a", reservations=(running,)), 1)},
    )
    index = FleetIndex(tracked=tracked)
    before, full = both(index, request, dense, current, {})
    assert before == full and not before.decision.admitted  # usable - 128 MiB unseen < need
    heartbeat = msgspec.structs.replace(report, seq=2, sent_at=NOW)  # sent after running_since
    current.view["a"] = ViewEntry(resources=heartbeat, revision=2)
    index.touch("a")
    after, full = both(index, request, dense, current, {})
    assert full.decision.admitted
    assert after == full
