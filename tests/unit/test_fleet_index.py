"""Fleet index: the same decisions as a brute-force full scan (`tests/placement_oracle.py`), on random fleets that
change between requests, for every kind of request: a fixed context or the largest that fits, with a draft
model or a projector, with preferred nodes, allowing a split over nodes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TypedDict

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from actors.placement import fleet
from actors.placement.admission import ModelFacts, Outcome, ViewEntry
from actors.placement.fleet import FleetIndex, LedgerEntry, decide, snapshot
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from actors.placement.projector import projector_from_header
from messages.placement import (
    LISTED_REFUSALS,
    Companion,
    ModelRef,
    NodeLedger,
    NodeRejection,
    PlacementDecision,
    PlacementRequest,
    PreferredSettings,
    Reservation,
    Stamp,
)
from messages.settings import ServingSettings, SettingsBounds
from messages.telemetry import GpuInfo, HostInfo, LlamaServerInfo, ModelFiles, NodeResources, SplitServing
from tests.harness.admission import Quiet
from tests.placement_oracle import explained_scan, full_scan
from tests.tiny_models import write_llama, write_qwen35
from tests.tiny_projectors import write_llava_projector

MIB = 1 << 20
NOW = 1_000_000.0
MONOTONIC = 5_000.0
QUIET: Quiet = {"cache_ram_mib": 0, "ctx_checkpoints": 0}
#: What nodes advertise: several sharing one profile, one llama-server refuses for these models (a quantized V
#: cache without flash attention), one that speculates with a draft model (refused without one), and none.
PROFILES: tuple[ServingSettings | None, ...] = (
    ServingSettings(**QUIET),
    ServingSettings(slots=1, **QUIET),
    ServingSettings(slots=8, kv_unified=True, cache_type_k="q8_0", **QUIET),
    ServingSettings(slots=2, flash_attn="off", **QUIET),
    ServingSettings(slots=4, cache_ram_mib=16, ctx_checkpoints=2),
    ServingSettings(cache_type_v="q8_0", flash_attn="off", **QUIET),
    DRAFTING := ServingSettings(slots=2, spec_type="draft-simple", spec_draft_n_max=4, **QUIET),
    None,
)
#: A node that heads or lends to a split over nodes (it holds the cluster's certificates and lends its host).
LENDS = SplitServing(lend_host="127.0.0.1", lend_devices=("CPU",))
#: The kinds of request the index once left to a full scan, each asked on its own below.
KINDS = ("draft", "mmproj", "max_ctx", "multi_node", "prefer")
NAMES = tuple(f"n-{i}" for i in range(1, 25))
#: The model files nodes report holding (the models' names in the tests' `ModelFacts`).
HOLDINGS = (
    None,
    ModelFiles(),
    ModelFiles(held=(("llama.gguf", 7 * MIB, ""),)),
    ModelFiles(held=(("llama.gguf", 9 * MIB, ""),)),  # of another size: which holder a fetch names shows
    ModelFiles(held=(("llama.gguf", 7 * MIB, "e" * 64),)),  # another version than the models' (digest "f" * 64)
    ModelFiles(held=(("qwen35.gguf", 5, "f" * 64),)),
)


class Ids(TypedDict):
    """The clock and identities of one decision: the same keywords for the index and the full scan."""

    now: float
    decision_id: str
    reservation_id: str


class IdsAndDryRun(Ids):
    dry_run: bool


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelFacts, ...]:
    """Two models alone, then the first with a draft model, with a projector, and with both, and the second
    with a projector of another width (llama-server refuses it)."""
    d = tmp_path_factory.mktemp("m")
    paths = (
        write_llama(d / "llama.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512),
        write_qwen35(d / "qwen35.gguf", n_layer=8, state_size=64, dt_rank=16, group_count=2),
    )
    digests = ("f" * 64, None)  # one model known by its digest (held files of another version do not count)
    alone = tuple(
        ModelFacts(geometry=geometry_from_header(read_header(p)), path=p.name, digest=d)
        for p, d in zip(paths, digests, strict=True)
    )
    # 3 layers: its 4 layer slots split over GPUs at other fractions than the model's 9
    draft = geometry_from_header(read_header(write_llama(d / "draft.gguf", n_layer=3, n_embd=128, n_ff=256)))
    projector = projector_from_header(read_header(write_llava_projector(d / "mmproj.gguf", text_embd=256)))
    drafted = Companion(path="draft.gguf", digest="d" * 64)
    projected = Companion(path="mmproj.gguf", digest="e" * 64)
    llama, qwen = alone
    return (
        *alone,
        dataclasses.replace(llama, draft=draft, draft_file=drafted),
        dataclasses.replace(llama, projector=projector, projector_file=projected),
        dataclasses.replace(llama, draft=draft, draft_file=drafted, projector=projector, projector_file=projected),
        dataclasses.replace(qwen, projector=projector, projector_file=projected),
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
def reports(draw: st.DrawFn, name: str, seq: int, *, mode: str = "any") -> NodeResources:
    """A node's report, any (`mode` "any"), or mostly a node without GPUs that lends its host to splits with
    less memory than the models need at most contexts ("lending": a split is what holds them), or a node with
    room, its GPUs free in many proportions ("roomy": most requests fit, on layouts that differ); both with
    open bounds."""
    lending, roomy = mode == "lending", mode == "roomy"
    profiles = PROFILES[:3] if lending else (*PROFILES[:3], DRAFTING, DRAFTING) if roomy else PROFILES
    profile = draw(st.sampled_from(profiles))
    n_gpus = draw(st.sampled_from((0, 0, 0, 1) if lending else (0, 1, 2, 3, 3) if roomy else (0, 1, 1, 2, 3)))
    size = draw(st.sampled_from((32, 64, 96)))
    # Few distinct amounts, so that nodes share sizings and layouts, and some tie on headroom.
    amounts = range(40, 97, 4) if roomy else (0, 8, 24, 40, 64, 96)
    gpus = tuple(gpu(i, 96 if roomy else size, draw(st.sampled_from(amounts))) for i in range(n_gpus))
    hosts = (8, 12, 16, 20) if lending else (256, 512) if roomy else (4, 16, 48, 128, 512)
    host = draw(st.sampled_from(hosts)) * MIB
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
        memory_limit_bytes=None if roomy else draw(st.sampled_from((None, None, 40 * MIB))),
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info="") if profile else None,
        llama_server_error=None if profile else "not installed",
        settings=profile,
        # open bounds take a request's settings
        bounds=SettingsBounds() if roomy or lending else draw(st.sampled_from((None, None, SettingsBounds()))),
        split=LENDS if lending else draw(st.sampled_from((None, LENDS))),
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
def requests(draw: st.DrawFn, kind: str | None = None) -> PlacementRequest:
    """A request, any kind; with `kind` ("max_ctx", "multi_node", "prefer"), always of that kind."""
    fields: dict[str, object] = {"model": {"path": "m.gguf"}}
    mode = draw(st.sampled_from(("fixed", "fixed", "fixed", "max_ctx", "ceiling")))
    if kind == "max_ctx":
        mode = draw(st.sampled_from(("max_ctx", "ceiling")))
    if mode != "ceiling":
        small = kind == "multi_node"  # contexts a few small nodes hold together
        fields["ctx"] = draw(st.sampled_from((1, 256, 1000, 4096) if small else (1, 256, 1000, 4096, 16384, 65536)))
    if mode == "max_ctx":
        fields["max_ctx"] = True
    fields["n_gpu_layers"] = draw(st.sampled_from((-1, -1, 0, 3, 100)))
    if draw(st.booleans()):
        fields["nodes"] = tuple(draw(st.lists(st.sampled_from((*NAMES[:8], "ghost")), max_size=6)))
    if draw(st.integers(0, 4)) == 0:
        fields["settings"] = draw(
            st.sampled_from(
                (PreferredSettings(slots=1), PreferredSettings(slots=4), PreferredSettings(spec_type="draft-simple"))
            )
        )
    if kind == "prefer" or draw(st.integers(0, 4)) == 0:
        fields["prefer"] = tuple(
            draw(st.lists(st.sampled_from(NAMES[:8]), min_size=kind == "prefer", max_size=3, unique=True))
        )
    if kind == "multi_node" or draw(st.integers(0, 5)) == 0:
        fields["allow_multi_node"] = True
    if draw(st.integers(0, 3)) == 0:
        fields["explain"] = True  # every refusal and revision; else the brief answer (`fleet.brief`)
    return msgspec.convert(fields, PlacementRequest, from_attributes=True)


def models_of(kind: str | None, models: tuple[ModelFacts, ...]) -> tuple[ModelFacts, ...]:
    """The models a request of `kind` asks for: with a draft model, with a projector, or any."""
    if kind == "draft":
        return tuple(m for m in models if m.draft is not None)
    if kind == "mmproj":
        return tuple(m for m in models if m.projector is not None)
    if kind == "multi_node":  # mostly models alone: a split is not sized with a draft model or a projector
        return (*models[:2], *models[:2], *models[:2], models[2])
    return models


def asking(request: PlacementRequest, model: ModelFacts) -> PlacementRequest:
    """`request` naming the model's companion files, as a client asking for them does."""
    draft = model.draft_file.path if model.draft_file else None
    mmproj = model.projector_file.path if model.projector_file else None
    return msgspec.structs.replace(request, model=ModelRef(path=model.path, draft=draft, mmproj=mmproj))


@dataclass
class Fleet:
    """The placement actor's state as the index sees it: view, arrival times and ledgers."""

    view: dict[str, ViewEntry] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)
    ledgers: dict[str, LedgerEntry] = field(default_factory=dict)
    revision: int = 0
    touched: list[str] = field(default_factory=list)  # what changed, for a tracked index
    heartbeats: list[str] = field(default_factory=list)  # of those, the reports that only said the same again


@st.composite
def changes(draw: st.DrawFn, current: Fleet, *, mode: str = "any") -> None:
    """Changes a few nodes of `current` in place: a new report (`mode`: what kind, as `reports` says), a new
    ledger, or gone."""
    for name in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=8)):
        current.touched.append(name)
        what = draw(st.sampled_from(("report", "report", "heartbeat", "ledger", "gone")))
        if what == "heartbeat" and name in current.view:  # the same report again, only newer
            current.revision += 1
            old = current.view[name].resources
            again = msgspec.structs.replace(old, seq=old.seq + 1, sent_at=old.sent_at + 1)
            current.view[name] = ViewEntry(resources=again, revision=current.revision)
            # it arrives after the report it repeats (the actor's clock does not go back)
            current.arrived[name] = max(current.arrived[name], MONOTONIC - draw(st.sampled_from((0.0, 3.0, 15.1))))
            current.heartbeats.append(name)
        elif what == "gone":
            current.view.pop(name, None)
            current.arrived.pop(name, None)
        elif what == "ledger":
            current.ledgers[name] = draw(ledgers(name))
        else:
            current.revision += 1
            report = draw(reports(name, current.revision, mode=mode))
            current.view[name] = ViewEntry(resources=report, revision=current.revision)
            ages = (0.0, 0.5, 3.0, 14.9, 15.1, 40.0) if mode == "any" else (0.0, 0.5, 3.0, 15.1)
            current.arrived[name] = MONOTONIC - draw(st.sampled_from(ages))


@st.composite
def fleets(draw: st.DrawFn, mode: str) -> Fleet:
    """A fleet of a few nodes of the kind `mode` says (`reports`), most of them fresh."""
    current = Fleet()
    for name in draw(st.lists(st.sampled_from(NAMES[:8]), min_size=2, max_size=8, unique=True)):
        current.revision += 1
        report = draw(reports(name, current.revision, mode=mode))
        current.view[name] = ViewEntry(resources=report, revision=current.revision)
        current.arrived[name] = MONOTONIC - draw(st.sampled_from((0.0, 0.5, 3.0, 15.1)))
        current.touched.append(name)
    return current


def both(
    index: FleetIndex, request: PlacementRequest, model: ModelFacts, current: Fleet, fresh: dict[str, LedgerEntry]
) -> tuple[Outcome, Outcome]:
    ids: Ids = {"now": NOW, "decision_id": "d1", "reservation_id": "r1"}
    dry_run = request.hold_s == 600.0 and bool(current.revision % 2)
    fast = index.decide(
        request, model, current.view, current.arrived, current.ledgers, monotonic_now=MONOTONIC, dry_run=dry_run,
        fresh=fresh, **ids,
    )  # fmt: skip
    inputs = snapshot(request, current.view, current.arrived, current.ledgers, fresh, MONOTONIC)
    full = full_scan(
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
        model = data.draw(st.sampled_from(models), label="model")
        request = asking(data.draw(requests(), label="request"), model)
        fresh: dict[str, LedgerEntry] = {}
        if data.draw(st.booleans(), label="fresh ledgers"):
            fresh = {name: data.draw(ledgers(name)) for name in data.draw(st.sets(st.sampled_from(NAMES[:6])))}
        fast, full = both(index, request, model, current, fresh)
        assert fast == full
        decision = fast.decision
        note(decision)


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
    ids: Ids = {"now": NOW, "decision_id": "d1", "reservation_id": "r1"}
    clock = MONOTONIC
    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        if data.draw(st.booleans(), label="change"):
            data.draw(changes(current))
        for name in current.touched:
            index.touch(name)
        current.touched.clear()
        clock += data.draw(st.sampled_from((0.0, 0.4, 2.0, 9.0)), label="seconds pass")
        model = data.draw(st.sampled_from(models), label="model")
        request = asking(data.draw(requests(), label="request"), model)
        fast = index.decide(
            request, model, current.view, current.arrived, current.ledgers, monotonic_now=clock, dry_run=True,
            fresh={}, **ids,
        )  # fmt: skip
        inputs = snapshot(request, current.view, current.arrived, current.ledgers, {}, clock)
        full = full_scan(request, model, inputs.view, inputs.held, unreadable=inputs.unreadable, dry_run=True, **ids)
        assert fast == full
        note(fast.decision)


def tell(index: FleetIndex, current: Fleet) -> None:
    """What the placement actor tells its index of the changes since the last decision: a node whose every change
    was a heartbeat (`intake.heartbeat_of`) is `refreshed`, any other touched."""
    for name in dict.fromkeys(current.touched):
        if current.touched.count(name) == current.heartbeats.count(name):
            index.refreshed(name, current.view[name])
        else:
            index.touch(name)
    current.touched.clear()
    current.heartbeats.clear()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_tracked_index_told_only_of_new_reports_not_heartbeats_decides_exactly_what_the_full_scan_decides(
    data: st.DataObject, models: tuple[ModelFacts, ...]
) -> None:
    # Issue 28: a heartbeat (the same report, only newer) is not a touch: the node is judged again only when its
    # older report would have turned stale, and a decision naming it reads its newer report from the view. Brief
    # and explained answers alike, so the chosen node's report and revision are compared too.
    index = FleetIndex(tracked=True)
    current = Fleet()
    ids: Ids = {"now": NOW, "decision_id": "d1", "reservation_id": "r1"}
    clock = MONOTONIC
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        if data.draw(st.booleans(), label="change"):
            data.draw(changes(current))
        tell(index, current)
        clock += data.draw(st.sampled_from((0.0, 0.4, 2.0, 9.0)), label="seconds pass")
        model = data.draw(st.sampled_from(models), label="model")
        request = asking(data.draw(requests(), label="request"), model)
        fast = index.decide(
            request, model, current.view, current.arrived, current.ledgers, monotonic_now=clock, dry_run=True,
            fresh={}, **ids,
        )  # fmt: skip
        inputs = snapshot(request, current.view, current.arrived, current.ledgers, {}, clock)
        full = full_scan(request, model, inputs.view, inputs.held, unreadable=inputs.unreadable, dry_run=True, **ids)
        assert fast == full
        note(fast.decision)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_kind_of_request_is_decided_by_the_index_exactly_as_by_the_full_scan(
    data: st.DataObject, models: tuple[ModelFacts, ...], kind: str
) -> None:
    # Requests the index once left to a full scan (a draft model, a projector, the largest context that fits,
    # a split allowed, preferred nodes), asked of the placement actor's tracked index, of an untracked one and of
    # a one-shot one (`fleet.decide`, as replay asks it), on a fleet that changes and ages between them. A
    # few requests are asked again and again (the answers the indexes keep are read back), now and then with
    # the context ceiling asked for or not (two questions that differ only there).
    tracked, untracked = FleetIndex(tracked=True), FleetIndex()
    mode = "lending" if kind == "multi_node" else "roomy"
    current = data.draw(fleets(mode), label="fleet")
    asked = [
        (model, asking(data.draw(requests(kind), label="request"), model))
        for model in data.draw(st.lists(st.sampled_from(models_of(kind, models)), min_size=1, max_size=3))
    ]
    ids: Ids = {"now": NOW, "decision_id": "d1", "reservation_id": "r1"}
    clock = MONOTONIC
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        if data.draw(st.booleans(), label="change"):
            data.draw(changes(current, mode=mode))
        for name in current.touched:
            tracked.touch(name)
        current.touched.clear()
        clock += data.draw(st.sampled_from((0.0, 0.5, 2.0, 9.0)), label="seconds pass")
        model, request = asked[data.draw(st.integers(0, len(asked) - 1), label="which request")]
        if request.ctx is not None and data.draw(st.booleans(), label="ceiling toggled"):
            request = msgspec.structs.replace(request, max_ctx=not request.max_ctx)
        inputs = snapshot(request, current.view, current.arrived, current.ledgers, {}, clock)
        full = full_scan(request, model, inputs.view, inputs.held, unreadable=inputs.unreadable, dry_run=False, **ids)
        for index in (tracked, untracked):
            fast = index.decide(
                request, model, current.view, current.arrived, current.ledgers, monotonic_now=clock, dry_run=False,
                **ids,
            )  # fmt: skip
            assert fast == full
        once = decide(request, model, inputs.view, inputs.held, unreadable=inputs.unreadable, dry_run=False, **ids)
        assert once == full
        note(full.decision)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_decision_recorded_without_ages_is_decided_again_as_the_full_scan_decides_it(
    data: st.DataObject, models: tuple[ModelFacts, ...]
) -> None:
    # Replay of a decision journaled before ages were kept: a report's age is the decision time minus its
    # `sent_at` (the node's clock: it may read ahead of ours, a negative age).
    current = Fleet()
    data.draw(changes(current))
    skew = data.draw(st.sampled_from((-30.0, 0.0, 14.0, 20.0)), label="node clocks ahead by")
    view = {
        name: ViewEntry(
            resources=msgspec.structs.replace(entry.resources, sent_at=entry.resources.sent_at - skew),
            revision=entry.revision,
        )
        for name, entry in current.view.items()
    }
    model = data.draw(st.sampled_from(models), label="model")
    request = asking(data.draw(requests(), label="request"), model)
    held = {name: ledger for name, (ledger, _) in current.ledgers.items() if ledger is not None}
    unreadable = frozenset(name for name, (_, revision) in current.ledgers.items() if revision < 0)
    ids: IdsAndDryRun = {"now": NOW, "decision_id": "d1", "reservation_id": "r1", "dry_run": False}
    once = decide(request, model, view, held, unreadable=unreadable, **ids)
    assert once == full_scan(request, model, view, held, unreadable=unreadable, **ids)
    note(once.decision)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_brief_answer_never_admits_what_the_full_scan_refuses_and_replays_from_the_nodes_it_records(
    data: st.DataObject, models: tuple[ModelFacts, ...]
) -> None:
    # The placement actor's index answers a request that does not ask for every refusal from its standing answer
    # (the nodes touched since, the heap's best), without walking the view, and names the few nodes (`witnesses`)
    # whose reports and ledgers its journal records. Held to the whole decision, every node judged: it never
    # admits what the full scan refuses, chooses what it chooses, and says so (hypothesis' statistics) when it
    # refuses what the full scan admits, which must never happen; replay over the recorded nodes alone decides
    # it again identically.
    index = FleetIndex(tracked=True)
    current = Fleet()
    ids: Ids = {"now": NOW, "decision_id": "d1", "reservation_id": "r1"}
    clock = MONOTONIC
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        data.draw(changes(current, mode=data.draw(st.sampled_from(("any", "roomy")), label="kind of nodes")))
        for name in current.touched:
            index.touch(name)
        current.touched.clear()
        clock += data.draw(st.sampled_from((0.0, 0.4, 2.0, 9.0)), label="seconds pass")
        model = data.draw(st.sampled_from(models), label="model")
        request = msgspec.structs.replace(asking(data.draw(requests(), label="request"), model), explain=False)
        decided = index.decision(
            request, model, current.view, current.arrived, current.ledgers, monotonic_now=clock, dry_run=False,
            **ids,
        )  # fmt: skip
        inputs = snapshot(request, current.view, current.arrived, current.ledgers, {}, clock)
        whole = explained_scan(
            request, model, inputs.view, inputs.held, unreadable=inputs.unreadable, dry_run=False, **ids
        ).decision
        answer = decided.outcome.decision
        if answer.admitted:
            assert whole.admitted, "admitted what the full scan refuses"
            assert (answer.placements, answer.stamp, answer.ctx) == (whole.placements, whole.stamp, whole.ctx)
            assert (
                decided.outcome.reservations
                == full_scan(
                    request, model, inputs.view, inputs.held, unreadable=inputs.unreadable, dry_run=False, **ids
                ).reservations
            )
            assert answer.rejections == () and set(answer.view) == {p.node_id for p in answer.placements}
        elif whole.admitted:
            event("refused what the full scan admits")
        assert answer.admitted == whole.admitted
        assert len(answer.rejections) <= LISTED_REFUSALS
        assert {r.node_id for r in answer.rejections} <= {r.node_id for r in whole.rejections}
        if decided.witnesses is None:
            event("recorded: the whole view")
            continue
        event("recorded: the chosen node, its file's holder and its rivals")
        assert len(decided.witnesses) <= 2 + fleet.RIVALS
        recorded = snapshot(request, current.view, current.arrived, current.ledgers, {}, clock, decided.witnesses)
        again = decide(
            request, model, recorded.view, recorded.held, unreadable=recorded.unreadable, dry_run=False, **ids
        )  # fmt: skip
        assert again == decided.outcome


def test_a_brief_refusal_lists_the_nodes_closest_to_fitting_first(models: tuple[ModelFacts, ...]) -> None:
    current = Fleet()
    for i in range(200):
        name = f"node-{i}"
        report = NodeResources(
            node_id=name, seq=1, sent_at=NOW, started_at=NOW, ttl_s=15,
            host=HostInfo(ram_total_bytes=1024 * MIB, ram_available_bytes=4 * MIB, usable_bytes=4 * MIB,
                          cpu_count=8),
            gpus=(gpu(0, 96, i % 50),), settings=PROFILES[0] if i % 7 else None,
        )  # fmt: skip
        current.view[name] = ViewEntry(resources=report, revision=i + 1)
        current.arrived[name] = MONOTONIC
    request = PlacementRequest(model=ModelRef(path="m.gguf"), ctx=65536)
    fast, _ = both(FleetIndex(tracked=True), request, models[0], current, {})
    whole = both(FleetIndex(), msgspec.structs.replace(request, explain=True), models[0], current, {})[0].decision
    answer = fast.decision
    assert not answer.admitted and len(whole.rejections) == 200 and len(answer.rejections) == LISTED_REFUSALS
    assert answer.message == whole.message and set(answer.view) == {r.node_id for r in answer.rejections}

    def worst(r: NodeRejection) -> int:
        return max(s.need_bytes - s.have_bytes for s in r.shortfalls)

    short = sorted((r for r in whole.rejections if r.reason == "insufficient_memory"), key=worst)
    assert [worst(r) for r in answer.rejections] == [worst(r) for r in short[:LISTED_REFUSALS]]
    assert all(r.reason == "insufficient_memory" for r in answer.rejections)


def note(decision: PlacementDecision) -> None:
    """What a decision was, for hypothesis' statistics (`--hypothesis-show-statistics`)."""
    if decision.admitted:
        event("admitted on several nodes" if decision.multi_node else "admitted")
    else:
        event(f"refused: {decision.reason}" + (" (and no split)" if "no split" in decision.message else ""))
    for reason in sorted({r.reason for r in decision.rejections}):
        event(f"a node refused: {reason}")


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


def test_a_tracked_index_takes_in_most_of_the_fleet_leaving_at_once(models: tuple[ModelFacts, ...]) -> None:
    # Most nodes leave while their answers stand (the index drops what it kept of them before it judges them
    # again) and the rest report anew, round after round: the standing answer's heap is rebuilt meanwhile.
    # Every decision is the full scan's.
    current = Fleet()

    def reported(i: int, seq: int) -> None:
        name = f"node-{i}"
        node = NodeResources(
            node_id=name, seq=seq, sent_at=NOW, started_at=NOW, ttl_s=15,
            host=HostInfo(ram_total_bytes=1024 * MIB, ram_available_bytes=512 * MIB, usable_bytes=512 * MIB,
                          cpu_count=8),
            gpus=(gpu(0, 96, 40 + (i + seq) % 50),), settings=PROFILES[0],
        )  # fmt: skip
        current.revision += 1
        current.view[name] = ViewEntry(resources=node, revision=current.revision)
        current.arrived[name] = MONOTONIC
        current.touched.append(name)

    index = FleetIndex(tracked=True)
    request = PlacementRequest(model=ModelRef(path="m.gguf"), ctx=4096)
    for round_ in range(12):
        for i in range(150):
            if round_ < 6 or i < 20:
                reported(i, round_ + 1)
            elif f"node-{i}" in current.view:  # gone
                del current.view[f"node-{i}"], current.arrived[f"node-{i}"]
                current.touched.append(f"node-{i}")
        for name in current.touched:
            index.touch(name)
        current.touched.clear()
        fast, full = both(index, request, models[0], current, {})
        assert fast == full and fast.decision.admitted


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


@pytest.mark.parametrize(("tracked", "refreshed"), [(False, False), (True, False), (True, True)])
def test_a_heartbeat_after_a_reservation_became_running_frees_what_the_report_now_shows(
    models: tuple[ModelFacts, ...], tracked: bool, refreshed: bool
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
    if refreshed:
        index.refreshed("a", current.view["a"])  # as the actor tells it of a heartbeat: it must judge the node again
    else:
        index.touch("a")
    after, full = both(index, request, dense, current, {})
    assert full.decision.admitted
    assert after == full


@pytest.mark.parametrize("tracked", [False, True])
def test_nodes_whose_gpus_place_the_model_alike_but_its_draft_model_not_are_sized_apart(
    models: tuple[ModelFacts, ...], tracked: bool
) -> None:
    # GPUs free 48:152 and 52:148 put the model's 9 layer slots alike (3 on the first GPU) but the draft
    # model's 4 apart (1 or 2): a sizing shared by the model's layout alone would size one node wrongly.
    drafted = models[2]
    assert drafted.draft is not None
    current = Fleet()
    for i, (name, free) in enumerate((("a", (48, 152)), ("b", (52, 148)))):
        report = NodeResources(
            node_id=name, seq=1, sent_at=NOW - 1, started_at=NOW - 100, ttl_s=15,
            host=HostInfo(ram_total_bytes=1024 * MIB, ram_available_bytes=512 * MIB, usable_bytes=512 * MIB,
                          cpu_count=8),
            gpus=tuple(gpu(g, 160, usable) for g, usable in enumerate(free)),
            llama_server=LlamaServerInfo(path="llama-server", version="test", build_info=""), settings=DRAFTING,
        )  # fmt: skip
        current.view[name] = ViewEntry(resources=report, revision=i + 1)
        current.arrived[name] = MONOTONIC
    index = FleetIndex(tracked=tracked)
    for prefer in ((), ("a",), ("b",)):
        request = asking(PlacementRequest(model=ModelRef(path="m.gguf"), ctx=4096, prefer=prefer), drafted)
        fast, full = both(index, request, drafted, current, {})
        assert fast == full and fast.decision.admitted
    assert index.stats().layouts == 2


@pytest.mark.parametrize(("tracked", "refreshed"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("ctx", [None, 256])
def test_a_heartbeat_keeps_a_nodes_answer_at_its_ceiling_and_the_decision_names_the_newer_report(
    models: tuple[ModelFacts, ...], tracked: bool, refreshed: bool, ctx: int | None
) -> None:
    # A node sized at its own ceiling keeps that answer through a report that only says it is alive, but the
    # decision is made on the newer report (its revision is the one the placement records).
    dense = models[0]
    report = NodeResources(
        node_id="a", seq=1, sent_at=NOW - 1, started_at=NOW - 100, ttl_s=15,
        host=HostInfo(ram_total_bytes=1024 * MIB, ram_available_bytes=256 * MIB, usable_bytes=256 * MIB,
                      cpu_count=8),
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info=""), settings=PROFILES[0],
    )  # fmt: skip
    current = Fleet(view={"a": ViewEntry(resources=report, revision=1)}, arrived={"a": MONOTONIC})
    index = FleetIndex(tracked=tracked)
    request = PlacementRequest(model=ModelRef(path="m.gguf"), max_ctx=ctx is None, ctx=ctx)
    before, full = both(index, request, dense, current, {})
    assert before == full and before.decision.admitted
    heartbeat = msgspec.structs.replace(report, seq=2, sent_at=NOW)
    current.view["a"] = ViewEntry(resources=heartbeat, revision=2)
    if refreshed:  # as the actor tells it of a heartbeat (issue 28): not judged again, yet named as it is now
        index.refreshed("a", current.view["a"])
    else:
        index.touch("a")
    sized = index.stats().sized
    after, full = both(index, request, dense, current, {})
    assert after == full and after.decision.placements[0].telemetry_revision == 2
    assert index.stats().sized == sized  # the answer stood


def test_questions_asked_in_turn_each_keep_their_own_answer_at_a_nodes_ceiling(models: tuple[ModelFacts, ...]) -> None:
    # A node remembers only the last question asked of it; a tracked index's standing answer to another question
    # keeps how the model ran there for that one.
    dense = models[0]
    report = NodeResources(
        node_id="a", seq=1, sent_at=NOW - 1, started_at=NOW - 100, ttl_s=15,
        host=HostInfo(ram_total_bytes=1024 * MIB, ram_available_bytes=64 * MIB, usable_bytes=64 * MIB,
                      cpu_count=8),
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info=""), settings=PROFILES[0],
        bounds=SettingsBounds(),
    )  # fmt: skip
    current = Fleet(view={"a": ViewEntry(resources=report, revision=1)}, arrived={"a": MONOTONIC})
    index = FleetIndex(tracked=True)
    one = PlacementRequest(model=ModelRef(path="m.gguf"), max_ctx=True)
    other = msgspec.structs.replace(one, settings=PreferredSettings(slots=1))
    contexts = []
    for request in (one, other, one, other):
        fast, full = both(index, request, dense, current, {})
        assert fast == full and fast.decision.admitted
        contexts.append(fast.decision.ctx)
    assert contexts[0] != contexts[1]
