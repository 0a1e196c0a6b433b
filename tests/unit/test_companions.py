"""A model's companion files (a draft model for "draft-simple" speculation): the catalog, the memory model,
admission and its replay, the runner's command line, log parsing and observation, and drift.

Geometries come from tiny GGUF headers written here; the byte-exactness of every figure against the real
server is `tests/e2e/test_memory_exact_draft.py`.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import msgspec
import pytest

from actors.frontdoor.catalog import CatalogError, parse_catalog
from actors.placement.admission import ModelFacts, ViewEntry
from actors.placement.caches import cache_allocations
from actors.placement.context import resolve_context
from actors.placement.fleet import FleetIndex, decide
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import Budgets, MemoryModelError, estimate, max_context
from actors.placement.replay import recompute
from actors.runner.allocation_log import parse_allocation_log, printed_mib, printed_mib_f32
from actors.runner.command import build_command, with_files
from actors.runner.drift import ServerReport, server_drift
from actors.runner.observed import observed_memory
from messages.events import DecisionInputs
from messages.model import ModelGeometry
from messages.placement import Companion, PlacementRequest, Reservation, Stamp
from messages.settings import ServingSettings, SettingsBounds
from messages.telemetry import HostInfo, LlamaServerInfo, NodeResources
from tests import tiny_models

NOW = 1_000_000.0
GIB = 1 << 30
DRAFT_SETTINGS = ServingSettings(slots=2, spec_type="draft-simple", spec_draft_n_max=4, cache_ram_mib=0)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("companions")
    return {
        "model": tiny_models.write_llama(d / "model.gguf", n_layer=4, n_embd=256, n_head=8, n_ff=512, n_vocab=1000),
        "draft": tiny_models.write_llama(d / "draft.gguf", n_layer=2, n_embd=128, n_head=2, n_head_kv=1, n_ff=256,
                                         n_vocab=1000),
        "hybrid": tiny_models.write_qwen35(d / "hybrid.gguf", n_layer=4, state_size=16, dt_rank=4, n_vocab=1000),
        "far": tiny_models.write_llama(d / "far.gguf", n_layer=1, n_vocab=1200),
        "mtp": tiny_models.write_qwen35(d / "mtp.gguf", n_layer=4, state_size=16, dt_rank=4, n_vocab=1000),
    }  # fmt: skip


def _geometry(path: Path) -> ModelGeometry:
    return geometry_from_header(read_header(path))


@pytest.fixture(scope="module")
def model(files: dict[str, Path]) -> ModelGeometry:
    return _geometry(files["model"])


@pytest.fixture(scope="module")
def draft(files: dict[str, Path]) -> ModelGeometry:
    return _geometry(files["draft"])


# ---- the memory model ----


def test_a_draft_model_adds_its_weights_its_context_and_its_logits(model: ModelGeometry, draft: ModelGeometry) -> None:
    alone = estimate(model, msgspec.structs.replace(DRAFT_SETTINGS, spec_type="none"), 8192)
    both = estimate(model, DRAFT_SETTINGS, 8192, draft=draft)
    assert both.draft_weights_bytes == draft.file_size - _header_bytes(draft) > 0
    assert both.weights_bytes == alone.weights_bytes  # the model's own tensors are unchanged
    # the draft context: the target's 2 streams of 4096 cells over the draft's 2 layers, f16 K and V
    k_row = 2 * draft.layers[0].k_width
    assert both.draft_kv_bytes == 2 * draft.n_layer * k_row * 4096 * 2
    assert both.draft_output_bytes == 4 * draft.n_vocab * 2
    assert both.output_bytes == alone.output_bytes + both.draft_output_bytes
    (cpu,) = both.devices
    assert cpu.draft_weights_bytes == both.draft_weights_bytes
    extra = both.draft_weights_bytes + both.draft_kv_bytes + both.draft_output_bytes
    assert cpu.total_bytes - alone.devices[0].total_bytes > extra  # and the draft context's compute buffer
    assert both.total_bytes == sum(d.total_bytes for d in both.devices)


def _header_bytes(geometry: ModelGeometry) -> int:
    """The file minus its tensor data: what `draft_weights_bytes` must leave out (tiny f32 tensors pad to 32)."""
    tensors = geometry.input_tensor_bytes + geometry.output_tensor_bytes + sum(x.tensor_bytes for x in geometry.layers)
    return geometry.file_size - tensors


def test_the_draft_context_follows_the_targets_slots_streams_and_draft_cache_types(
    model: ModelGeometry, draft: ModelGeometry
) -> None:
    settings = msgspec.structs.replace(
        DRAFT_SETTINGS, slots=4, kv_unified=True, spec_draft_type_k="q8_0", spec_draft_type_v="q4_0"
    )
    lines = cache_allocations(model, settings, 6000, draft)
    target, drafted = lines
    assert (target.context, drafted.context) == ("target", "draft")
    assert (drafted.cells, drafted.streams, drafted.seqs, drafted.layers) == (target.cells, 1, 4, draft.n_layer)
    assert (drafted.type_a, drafted.type_b) == ("q8_0", "q4_0")
    assert drafted.a_bytes == draft.n_layer * (draft.layers[0].k_width // 32 * 34) * drafted.cells


def test_a_draft_on_gpus_is_split_like_the_model(model: ModelGeometry, draft: ModelGeometry) -> None:
    both = estimate(model, DRAFT_SETTINGS, 4096, draft=draft, n_gpu_layers=-1, gpu_split=(1.0, 1.0))
    by_name = {d.device: d for d in both.devices}
    assert by_name["GPU0"].draft_weights_bytes > 0 and by_name["GPU1"].draft_weights_bytes > 0
    assert by_name["CPU"].draft_weights_bytes == draft.input_tensor_bytes  # its token embeddings stay on the host
    assert sum(d.draft_weights_bytes for d in both.devices) == both.draft_weights_bytes + draft.token_embd_bytes * (
        draft.tied_output
    )
    assert both.draft_repack_bytes == 0  # nothing is repacked beside a GPU


def test_a_draft_lowers_the_context_ceiling(model: ModelGeometry, draft: ModelGeometry) -> None:
    budgets = Budgets(host=64 << 20)
    alone = max_context(model, msgspec.structs.replace(DRAFT_SETTINGS, spec_type="none"), budgets)
    with_draft = max_context(model, DRAFT_SETTINGS, budgets, draft=draft)
    assert alone is not None and with_draft is not None and with_draft < alone


def test_what_llama_server_refuses_or_drops_of_a_draft_is_refused(
    files: dict[str, Path], model: ModelGeometry, draft: ModelGeometry
) -> None:
    with pytest.raises(MemoryModelError, match="needs a draft model"):
        estimate(model, DRAFT_SETTINGS, 4096)
    with pytest.raises(MemoryModelError, match="only with spec_type 'draft-simple'"):
        estimate(model, msgspec.structs.replace(DRAFT_SETTINGS, spec_type="ngram-mod"), 4096, draft=draft)
    with pytest.raises(MemoryModelError, match="cannot be combined"):
        settings = msgspec.structs.replace(DRAFT_SETTINGS, spec_type="draft-simple,draft-mtp")
        estimate(_geometry(files["mtp"]), settings, 4096, draft=draft)
    with pytest.raises(MemoryModelError, match="only attention-only drafts"):
        estimate(model, DRAFT_SETTINGS, 4096, draft=_geometry(files["hybrid"]))
    with pytest.raises(MemoryModelError, match="vocabulary"):
        estimate(model, DRAFT_SETTINGS, 4096, draft=_geometry(files["far"]))
    with pytest.raises(MemoryModelError, match="quantized draft V cache"):
        settings = msgspec.structs.replace(DRAFT_SETTINGS, flash_attn="off", spec_draft_type_v="q8_0")
        estimate(model, settings, 4096, draft=draft)


# ---- admission and replay ----


def _node(node_id: str, usable: int) -> NodeResources:
    return NodeResources(
        node_id=node_id, seq=1, sent_at=NOW - 1, started_at=NOW - 100, ttl_s=15,
        host=HostInfo(ram_total_bytes=64 * GIB, ram_available_bytes=usable, usable_bytes=usable, cpu_count=8),
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info=""),
        settings=ServingSettings(cache_ram_mib=0, ctx_checkpoints=0), bounds=None if node_id == "old" else _open(),
    )  # fmt: skip


def _open() -> SettingsBounds:
    return SettingsBounds()


def _request(**model: str) -> PlacementRequest:
    raw = {"model": {"path": "m.gguf", **model}, "ctx": 4096, "settings": {"spec_type": "draft-simple"}}
    return msgspec.convert(raw, PlacementRequest)


def test_admission_sizes_the_draft_and_stamps_it_with_its_digest(model: ModelGeometry, draft: ModelGeometry) -> None:
    facts = ModelFacts(
        geometry=model, path="m.gguf", draft=draft, draft_file=Companion(path="d.gguf", digest="ab" * 32)
    )
    view = {"a": ViewEntry(resources=_node("a", 8 * GIB), revision=1)}
    outcome = decide(_request(draft="d.gguf"), facts, view, {}, now=NOW, decision_id="d1", reservation_id="r1",
                     dry_run=False)  # fmt: skip
    decision = outcome.decision
    assert decision.admitted and decision.stamp is not None
    assert decision.stamp.draft == Companion(path="d.gguf", digest="ab" * 32)
    assert decision.stamp.settings.spec_type == "draft-simple"
    (placement,) = decision.placements
    assert placement.breakdown.draft_weights_bytes > 0
    assert outcome.reservations[0].stamp.draft == decision.stamp.draft
    # replay recomputes it from the recorded draft geometry, and finds nothing changed
    inputs = DecisionInputs(
        request=_request(draft="d.gguf"), view=(view["a"].resources,), view_revisions={"a": 1}, ledgers=(),
        geometry=model, model_path="m.gguf", decision=decision, draft_geometry=draft,
    )  # fmt: skip
    assert recompute(inputs, model) == decision


def test_a_request_for_draft_simple_without_a_draft_is_refused_as_unsupported(model: ModelGeometry) -> None:
    view = {"a": ViewEntry(resources=_node("a", 8 * GIB), revision=1)}
    outcome = decide(_request(), ModelFacts(geometry=model, path="m.gguf"), view, {}, now=NOW, decision_id="d1",
                     reservation_id="r1", dry_run=True)  # fmt: skip
    assert not outcome.decision.admitted
    (refusal,) = outcome.decision.rejections
    assert refusal.reason == "unsupported_settings" and "needs a draft model" in refusal.message


def test_the_fleet_index_answers_requests_with_companions_from_shared_sizings() -> None:
    # One decision path: requests with companions are sized like any other with a fixed context (sizings kept
    # per model and companions), cheap enough for the placement actor's event loop; only the largest context
    # that fits and a split size per node, off that loop (`tests/unit/test_fleet_index.py`: the same decisions).
    assert FleetIndex.covers(msgspec.convert({"model": {"path": "m"}, "ctx": 4096}, PlacementRequest))
    assert FleetIndex.covers(_request(draft="d.gguf"))
    assert FleetIndex.covers(msgspec.convert({"model": {"path": "m", "mmproj": "p"}, "ctx": 4096}, PlacementRequest))
    assert not FleetIndex.covers(msgspec.convert({"model": {"path": "m"}, "max_ctx": True}, PlacementRequest))


# ---- the runner: command line, log, observation, drift ----


def _reservation(draft: Companion | None) -> Reservation:
    return Reservation(
        reservation_id="r1", decision_id="d1", node_id="n1", state="reserved", model_path="m.gguf",
        stamp=Stamp(settings=DRAFT_SETTINGS, ctx=4096, n_gpu_layers=0, draft=draft), layers=(0, 4), devices=(),
        held={}, created_at=NOW,
    )  # fmt: skip


def test_the_command_pins_the_draft_file_and_offloads_it_as_the_model() -> None:
    stamped = _reservation(Companion(path="d.gguf", digest="ab" * 32))
    resolved = with_files(stamped, "/models/m.gguf", draft="/models/d.gguf")
    assert resolved.stamp.draft == Companion(path="/models/d.gguf", digest="ab" * 32)  # the digest as stamped
    argv = build_command("llama-server", resolved, port=8080, slot_save_dir="/s")
    assert argv[argv.index("--model-draft") + 1] == "/models/d.gguf"
    assert argv[argv.index("-ngld") + 1] == "0" and argv[argv.index("-m") + 1] == "/models/m.gguf"
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    plain = build_command("llama-server", with_files(_reservation(None), "/m.gguf"), port=8080, slot_save_dir="/s")
    assert "--model-draft" not in plain and "-ngld" not in plain


#: What llama-server logs for a model and its draft (abridged from a real run: the lines the parser reads).
LOG = """\
0.00.004.851 I llama_model_loader: loaded meta data with 18 key-value pairs and 39 tensors from m.gguf
0.00.007.567 I load_tensors:   CPU_Mapped model buffer size =     {weights} MiB
0.00.007.816 I llama_context: constructing llama_context
0.00.007.817 I llama_context: n_seq_max             = 2
0.00.009.772 I llama_context:        CPU  output buffer size =     {output} MiB
0.00.012.616 I llama_kv_cache: size = {kv} MiB (2048 cells, 4 layers, 2/2 seqs), K (f16): {k} MiB, V (f16): {v} MiB
0.00.014.104 I sched_reserve:        CPU compute buffer size =     4.77 MiB
0.00.011.963 I common_speculative_init_result: loading draft model 'd.gguf'
0.00.012.273 I llama_model_loader: loaded meta data with 18 key-value pairs and 21 tensors from d.gguf
0.00.014.771 I load_tensors:   CPU_Mapped model buffer size =     {draft_weights} MiB
0.00.014.848 I llama_context: constructing llama_context
0.00.014.859 I llama_context: n_seq_max             = 2
0.00.014.872 I llama_context:        CPU  output buffer size =     {draft_output} MiB
0.00.015.312 I llama_kv_cache: size = {dkv} MiB (2048 cells, 2 layers, 2/2 seqs), K (f16): {dk} MiB, V (f16): {dv} MiB
0.00.016.111 I sched_reserve:        CPU compute buffer size =     3.14 MiB
0.00.017.804 I spec common_specu: adding speculative implementation 'draft-simple'
0.00.017.805 I spec common_specu: - n_max=4, n_min=0, p_min=0.750000
"""


def test_the_log_keeps_the_drafts_buffers_apart_and_the_observation_recovers_them_exactly(
    model: ModelGeometry, draft: ModelGeometry
) -> None:
    predicted = estimate(model, DRAFT_SETTINGS, 4096, draft=draft)
    allocations = cache_allocations(model, DRAFT_SETTINGS, 4096, draft)
    target, drafted = allocations
    figures = dict(
        weights=printed_mib(predicted.weights_bytes), output=printed_mib(predicted.output_bytes // 2),
        kv=printed_mib_f32(target.a_bytes + target.b_bytes), k=printed_mib_f32(target.a_bytes),
        v=printed_mib_f32(target.b_bytes), draft_weights=printed_mib(predicted.draft_weights_bytes),
        draft_output=printed_mib(predicted.draft_output_bytes), dkv=printed_mib_f32(drafted.a_bytes + drafted.b_bytes),
        dk=printed_mib_f32(drafted.a_bytes), dv=printed_mib_f32(drafted.b_bytes),
    )  # fmt: skip
    log = parse_allocation_log(LOG.format(**figures))
    assert log.model_buffers == {"CPU_Mapped": printed_mib(predicted.weights_bytes)}
    assert log.draft_model_buffers == {"CPU_Mapped": printed_mib(predicted.draft_weights_bytes)}
    observation = observed_memory(log, predicted, allocations)
    assert observation.exact >= {"weights_bytes", "draft_weights_bytes", "draft_kv_bytes", "output_bytes"}
    memory = observation.memory
    assert (memory.weights_bytes, memory.draft_weights_bytes) == (
        predicted.weights_bytes,
        predicted.draft_weights_bytes,
    )
    assert memory.total_bytes >= memory.weights_bytes + memory.draft_weights_bytes + memory.draft_kv_bytes
    # a draft buffer that prints otherwise is counted as printed, and not exact
    other = parse_allocation_log(LOG.format(**{**figures, "draft_weights": "9.99"}))
    off = observed_memory(other, predicted, allocations)
    assert "draft_weights_bytes" not in off.exact and off.memory.draft_weights_bytes == round(
        Decimal("9.99") * (1 << 20)
    )


def test_a_stamped_draft_whose_context_the_server_did_not_create_is_drift(
    model: ModelGeometry, draft: ModelGeometry
) -> None:
    stamp = _reservation(Companion(path="d.gguf")).stamp
    shape = resolve_context(model, DRAFT_SETTINGS, 4096)
    without_draft = parse_allocation_log(LOG.split("0.00.011.963")[0])
    props = {"total_slots": 2, "default_generation_settings": {"n_ctx": shape.n_ctx_seq}}
    slots = [{"n_ctx": shape.n_ctx_seq, "speculative": False}] * 2
    fields = {d.field for d in server_drift(stamp, shape, ServerReport(props, slots, without_draft))}
    assert {"log.draft_context", "slots.speculative", "log.spec_type"} <= fields


# ---- the catalog ----


def test_a_catalog_entry_names_its_companions_and_speculates_with_its_draft() -> None:
    catalog = parse_catalog(
        '[models.m]\npath = "m.gguf"\ndraft = "d.gguf"\nmmproj = "p.gguf"\n'
        '[models.r]\npath = "entry"\nregistry = true\ndraft = "/abs/d.gguf"\n'
        '[models.plain]\npath = "m.gguf"\n'
    )
    m, r, plain = catalog.models["m"], catalog.models["r"], catalog.models["plain"]
    settings = m.required_settings()
    assert settings is not None and settings.spec_type == "draft-simple"  # a draft speculates with it
    ref = m.model_ref("/models/m.gguf")
    assert (ref.path, ref.draft, ref.mmproj) == ("/models/m.gguf", "d.gguf", "p.gguf")
    assert (r.model_ref().registry, r.model_ref().draft) == ("entry", "/abs/d.gguf")
    assert plain.model_ref().draft is None and plain.required_settings() is None
    with pytest.raises(CatalogError, match=r"\[models.x\].*draft.*draft-simple"):
        parse_catalog('[models.x]\npath = "m.gguf"\ndraft = "d.gguf"\nspec_type = "draft-mtp"\n')


def test_an_instance_serves_a_catalog_model_only_with_exactly_its_companions() -> None:
    entry = parse_catalog('[models.m]\npath = "m.gguf"\ndraft = "sub/d.gguf"\n').models["m"]
    running = msgspec.structs.replace(DRAFT_SETTINGS, slots=4)

    def stamp(draft: str | None, mmproj: str | None = None) -> Stamp:
        return Stamp(
            settings=running, ctx=4096, n_gpu_layers=0,
            draft=Companion(path=draft) if draft else None, mmproj=Companion(path=mmproj) if mmproj else None,
        )  # fmt: skip

    assert entry.runs_on(stamp("sub/d.gguf")) and entry.runs_on(stamp("/data/models/sub/d.gguf"))
    assert not entry.runs_on(stamp("/data/models/other/d.gguf"))
    assert not entry.runs_on(stamp(None))  # the same file without a draft serves another model
    assert not entry.runs_on(stamp("sub/d.gguf", "p.gguf"))
    assert not entry.runs_on(msgspec.structs.replace(stamp("sub/d.gguf"), settings=ServingSettings()))
    assert entry.runs_on(running)  # given settings alone, as before: companions are not checked
