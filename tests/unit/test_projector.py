"""A multimodal projector (`--mmproj`): its header, the memory model, admission and replay, the runner's
command line, log parsing, observation and drift.

The compute figures of `MEASURED` were printed by llama-server (`reserve_compute_meta: CPU compute buffer
size`) at the first image of tiny LLaVA projectors written by `tests/tiny_projectors.py`, on the build named
in `LLAMA_CPP_VERSION`; `tests/e2e/test_projector.py` checks the same against the real server each run.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import TypedDict, Unpack

import msgspec
import pytest

from actors.placement.admission import ModelFacts, ViewEntry
from actors.placement.caches import cache_allocations
from actors.placement.fleet import decide
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import Budgets, MemoryModelError, compute_margin, estimate, max_context
from actors.placement.projector import (
    ProjectorError,
    UnsupportedProjector,
    image_embedding_bytes,
    n_image_tokens,
    projector_compute_bytes,
    projector_from_header,
)
from actors.placement.replay import recompute
from actors.runner.allocation_log import parse_allocation_log, printed_mib
from actors.runner.command import build_command, with_files
from actors.runner.drift import ServerReport, server_drift
from actors.runner.observed import observed_memory
from messages.events import DecisionInputs
from messages.model import ModelGeometry, ProjectorGeometry
from messages.placement import Companion, PlacementRequest, Reservation, Stamp
from messages.settings import ServingSettings, SettingsBounds
from messages.telemetry import HostInfo, LlamaServerInfo, NodeResources
from tests import tiny_models
from tests.tiny_models import ModelSpec, write_model
from tests.tiny_projectors import write_llava_projector

NOW = 1_000_000.0
GIB = 1 << 30
SETTINGS = ServingSettings(slots=2, cache_ram_mib=0, ctx_checkpoints=0)


class TowerShape(TypedDict, total=False):
    """The tower arguments of `write_llava_projector` a measured shape sets (the rest are its defaults)."""

    n_embd: int
    n_head: int
    n_ff: int
    n_layer: int
    image_size: int
    patch_size: int
    mm_hidden: int
    class_embedding: bool
    pre_norm: bool
    post_norm: bool


#: (tower shape, flash attention, the compute buffer llama-server printed at the first image, MiB).
MEASURED: list[tuple[TowerShape, bool, str]] = [
    ({"n_embd": 64, "n_head": 4, "n_ff": 128, "n_layer": 2, "image_size": 32, "patch_size": 8}, True, "0.02"),
    ({"n_embd": 256, "n_head": 4, "n_ff": 1024, "n_layer": 2, "image_size": 224, "patch_size": 14}, True, "1.58"),
    ({"n_embd": 128, "n_head": 2, "n_ff": 512, "n_layer": 3, "image_size": 112, "patch_size": 16,
      "class_embedding": False}, True, "0.24"),
    ({"n_embd": 512, "n_head": 8, "n_ff": 2048, "n_layer": 2, "image_size": 336, "patch_size": 14}, True, "6.93"),
    ({"n_embd": 1024, "n_head": 16, "n_ff": 4096, "n_layer": 2, "image_size": 336, "patch_size": 14}, True, "19.32"),
    ({"n_embd": 1024, "n_head": 16, "n_ff": 4096, "n_layer": 2, "image_size": 336, "patch_size": 14,
      "mm_hidden": 2048}, True, "19.32"),
    ({"n_embd": 384, "n_head": 6, "n_ff": 256, "n_layer": 2, "image_size": 224, "patch_size": 16, "pre_norm": False,
      "post_norm": True}, True, "1.73"),
    ({"n_embd": 256, "n_head": 4, "n_ff": 1024, "n_layer": 4, "image_size": 448, "patch_size": 14,
      "mm_hidden": 512}, True, "7.31"),
    ({"n_embd": 64, "n_head": 4, "n_ff": 128, "n_layer": 2, "image_size": 32, "patch_size": 8}, False, "0.02"),
    ({"n_embd": 128, "n_head": 2, "n_ff": 512, "n_layer": 3, "image_size": 112, "patch_size": 16,
      "class_embedding": False}, False, "0.24"),
    ({"n_embd": 512, "n_head": 8, "n_ff": 2048, "n_layer": 2, "image_size": 336, "patch_size": 14}, False, "14.84"),
    ({"n_embd": 1024, "n_head": 16, "n_ff": 4096, "n_layer": 2, "image_size": 336, "patch_size": 14}, False, "32.88"),
    ({"n_embd": 384, "n_head": 6, "n_ff": 256, "n_layer": 2, "image_size": 224, "patch_size": 16, "pre_norm": False,
      "post_norm": True}, False, "2.33"),
    ({"n_embd": 256, "n_head": 4, "n_ff": 1024, "n_layer": 4, "image_size": 448, "patch_size": 14,
      "mm_hidden": 512}, False, "20.34"),
]  # fmt: skip
TEXT_EMBD = 128  # the text model these projectors were measured beside


def _projector(path: Path, **shape: Unpack[TowerShape]) -> ProjectorGeometry:
    return projector_from_header(read_header(write_llava_projector(path, text_embd=TEXT_EMBD, sparse=True, **shape)))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("projector")
    return {
        "model": tiny_models.write_llama(d / "model.gguf", n_layer=2, n_embd=64, n_head=4, n_ff=128),
        "wide": tiny_models.write_llama(d / "wide.gguf", n_layer=1, n_embd=128, n_head=4, n_ff=256),
        "mmproj": write_llava_projector(d / "mmproj.gguf", text_embd=64, n_embd=64, n_ff=128, image_size=32),
    }


@pytest.fixture(scope="module")
def model(files: dict[str, Path]) -> ModelGeometry:
    return geometry_from_header(read_header(files["model"]))


@pytest.fixture(scope="module")
def projector(files: dict[str, Path]) -> ProjectorGeometry:
    return projector_from_header(read_header(files["mmproj"]))


# ---- the header ----


def test_a_llava_projector_header_reads_as_its_tower_and_mlp(projector: ProjectorGeometry) -> None:
    assert (projector.projector_type, projector.n_embd, projector.n_ff, projector.n_layer) == ("mlp", 64, 128, 2)
    assert (projector.image_size, projector.patch_size, projector.mm_hidden, projector.n_mmproj_embd) == (32, 8, 64, 64)
    assert projector.class_embedding and projector.pre_norm and not projector.post_norm
    assert projector.patch_kernel_type == "f16"
    assert n_image_tokens(projector) == 16  # 4 x 4 patches, the class token dropped
    # every tensor of this writer is a multiple of 32 bytes, so the buffer is the tensors' sum
    assert projector.buffer_bytes == projector.tensor_bytes > 0


def _clip(path: Path, kv: dict[str, object], tensors: list[tuple[str, tuple[int, ...]]]) -> Path:
    spec = ModelSpec(arch="clip", kv=dict(kv))
    for name, shape in tensors:
        spec.add(name, shape)
    return write_model(spec, path, sparse=True)


_KV: dict[str, object] = {
    "clip.has_vision_encoder": True, "clip.projector_type": "mlp", "clip.vision.embedding_length": 32,
    "clip.vision.feed_forward_length": 64, "clip.vision.block_count": 1, "clip.vision.projection_dim": 32,
    "clip.vision.attention.head_count": 2, "clip.vision.attention.layer_norm_epsilon": 1e-5,
    "clip.vision.image_size": 16, "clip.vision.patch_size": 8, "clip.vision.image_mean": [0.5, 0.5, 0.5],
    "clip.vision.image_std": [0.5, 0.5, 0.5],
}  # fmt: skip
_TENSORS: list[tuple[str, tuple[int, ...]]] = [
    ("v.patch_embd.weight", (8, 8, 3, 32)), ("v.position_embd.weight", (32, 4)),
    ("v.blk.0.attn_q.weight", (32, 32)), ("v.blk.0.attn_k.weight", (32, 32)), ("v.blk.0.attn_v.weight", (32, 32)),
    ("v.blk.0.attn_out.weight", (32, 32)), ("v.blk.0.ffn_up.weight", (32, 64)), ("v.blk.0.ffn_down.weight", (64, 32)),
    ("mm.0.weight", (32, 32)), ("mm.2.weight", (32, 32)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kv", "tensors", "error", "match"),
    [
        ({"clip.projector_type": "qwen2vl"}, [], UnsupportedProjector, "'qwen2vl' is not sized"),
        ({"clip.vision.image_grid_pinpoints": [32, 32, 64, 64]}, [], UnsupportedProjector, "image slicing"),
        ({"clip.vision.feature_layer": [1]}, [], UnsupportedProjector, "feature layers"),
        ({"clip.has_audio_encoder": True}, [], UnsupportedProjector, "audio"),
        ({}, [("mm.3.weight", (32, 32))], UnsupportedProjector, "norms"),
        ({}, [("v.blk.0.ffn_gate.weight", (32, 64))], UnsupportedProjector, "gated"),
        ({"clip.has_vision_encoder": False}, [], ProjectorError, "no vision encoder"),
        ({"clip.vision.image_size": 9000}, [], ProjectorError, "over 8192"),
        ({"clip.vision.attention.head_count": 3}, [], ProjectorError, "multiple of its 3 heads"),
        ({"clip.vision.image_mean": [0.5]}, [], ProjectorError, "three numbers"),
        ({"clip.vision.block_count": 2}, [], ProjectorError, "v.blk.1.attn_q.weight"),
    ],
)
def test_what_the_estimate_does_not_size_or_the_server_would_not_load_is_refused(
    tmp_path: Path, kv: dict[str, object], tensors: list[tuple[str, tuple[int, ...]]], error: type, match: str
) -> None:
    path = _clip(tmp_path / "p.gguf", _KV | kv, _TENSORS + tensors)
    with pytest.raises(error, match=match):
        projector_from_header(read_header(path))


def test_a_model_file_is_not_a_projector(files: dict[str, Path]) -> None:
    with pytest.raises(ProjectorError, match="architecture is 'clip'"):
        projector_from_header(read_header(files["model"]))


# ---- the compute buffer ----


@pytest.mark.parametrize(("shape", "flash_attn", "printed"), MEASURED)
def test_the_image_graph_is_placed_as_llama_server_reserves_it(
    tmp_path: Path, shape: TowerShape, flash_attn: bool, printed: str
) -> None:
    projector = _projector(tmp_path / "p.gguf", **shape)
    assert printed_mib(projector_compute_bytes(projector, flash_attn=flash_attn)) == Decimal(printed)


def test_without_flash_attention_the_score_matrix_dominates_a_wide_image(tmp_path: Path) -> None:
    projector = _projector(tmp_path / "p.gguf", n_embd=256, n_head=16, n_ff=1024, image_size=448, patch_size=14)
    n_pos = n_image_tokens(projector) + 1
    without = projector_compute_bytes(projector, flash_attn=False)
    assert without >= 4 * n_pos * n_pos * projector.n_head > projector_compute_bytes(projector, flash_attn=True)


# ---- the memory model ----


def test_a_projector_adds_its_weights_its_graph_and_its_image_embeddings(
    model: ModelGeometry, projector: ProjectorGeometry
) -> None:
    plain = estimate(model, SETTINGS, 4096)
    with_it = estimate(model, SETTINGS, 4096, projector=projector)
    graph = projector_compute_bytes(projector, flash_attn=True)
    assert with_it.projector_weights_bytes == projector.buffer_bytes
    assert with_it.projector_compute_bytes == graph
    assert with_it.compute_bytes == plain.compute_bytes + graph
    assert with_it.host_extra_bytes == plain.host_extra_bytes + image_embedding_bytes(projector)
    margin = compute_margin(plain.compute_bytes + graph) - compute_margin(plain.compute_bytes)
    extra = projector.buffer_bytes + graph + margin + image_embedding_bytes(projector)
    assert with_it.total_bytes == plain.total_bytes + extra
    (host,) = with_it.devices
    assert host.projector_weights_bytes == projector.buffer_bytes
    # KV, weights and output do not change: the image tokens are ordinary cells of the context
    assert (with_it.kv_bytes, with_it.weights_bytes, with_it.output_bytes) == (
        plain.kv_bytes, plain.weights_bytes, plain.output_bytes,
    )  # fmt: skip


def test_a_projector_follows_offloaded_layers_to_the_first_gpu(
    model: ModelGeometry, projector: ProjectorGeometry
) -> None:
    split = estimate(model, SETTINGS, 4096, n_gpu_layers=-1, gpu_split=(1.0, 1.0), projector=projector)
    by_name = {d.device: d for d in split.devices}
    assert by_name["GPU0"].projector_weights_bytes == projector.buffer_bytes
    assert by_name["GPU1"].projector_weights_bytes == 0 and by_name["CPU"].projector_weights_bytes == 0
    kept = estimate(model, SETTINGS, 4096, n_gpu_layers=0, gpu_split=(1.0,), projector=projector)
    assert {d.device: d.projector_weights_bytes for d in kept.devices}["CPU"] == projector.buffer_bytes


def test_a_projector_lowers_the_context_ceiling_and_a_mismatched_one_is_refused(
    files: dict[str, Path], model: ModelGeometry, projector: ProjectorGeometry
) -> None:
    budget = Budgets(host=estimate(model, SETTINGS, 8192).total_bytes)
    assert (max_context(model, SETTINGS, budget) or 0) > (
        max_context(model, SETTINGS, budget, projector=projector) or 0
    )
    wide = geometry_from_header(read_header(files["wide"]))
    with pytest.raises(MemoryModelError, match="64 wide, the model's 128"):
        estimate(wide, SETTINGS, 4096, projector=projector)


# ---- admission and replay ----


def _node(usable: int) -> NodeResources:
    return NodeResources(
        node_id="a", seq=1, sent_at=NOW - 1, started_at=NOW - 100, ttl_s=15,
        host=HostInfo(ram_total_bytes=64 * GIB, ram_available_bytes=usable, usable_bytes=usable, cpu_count=8),
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info=""),
        settings=ServingSettings(cache_ram_mib=0, ctx_checkpoints=0), bounds=SettingsBounds(),
    )  # fmt: skip


def _request(**model: str) -> PlacementRequest:
    return msgspec.convert({"model": {"path": "m.gguf", **model}, "ctx": 4096}, PlacementRequest)


def test_admission_sizes_the_projector_and_stamps_it_with_its_digest(
    model: ModelGeometry, projector: ProjectorGeometry
) -> None:
    stamped = Companion(path="p.gguf", digest="cd" * 32)
    facts = ModelFacts(geometry=model, path="m.gguf", projector=projector, projector_file=stamped)
    view = {"a": ViewEntry(resources=_node(8 * GIB), revision=1)}
    outcome = decide(_request(mmproj="p.gguf"), facts, view, {}, now=NOW, decision_id="d1", reservation_id="r1",
                     dry_run=False)  # fmt: skip
    decision = outcome.decision
    assert decision.admitted and decision.stamp is not None and decision.stamp.mmproj == stamped
    (placement,) = decision.placements
    assert placement.breakdown.projector_weights_bytes == projector.buffer_bytes
    assert placement.breakdown.projector_compute_bytes == projector_compute_bytes(projector, flash_attn=True)
    assert outcome.reservations[0].stamp.mmproj == stamped
    inputs = DecisionInputs(
        request=_request(mmproj="p.gguf"), view=(view["a"].resources,), view_revisions={"a": 1}, ledgers=(),
        geometry=model, model_path="m.gguf", decision=decision, projector_geometry=projector,
    )  # fmt: skip
    assert recompute(inputs, model) == decision


def test_a_node_the_projector_would_overfill_is_refused(model: ModelGeometry, projector: ProjectorGeometry) -> None:
    roomy = {"a": ViewEntry(resources=_node(8 * GIB), revision=1)}
    alone = decide(_request(), ModelFacts(geometry=model, path="m.gguf"), roomy, {}, now=NOW, decision_id="d0",
                   reservation_id="r0", dry_run=True).decision  # fmt: skip
    need = alone.placements[0].breakdown.total_bytes  # the model alone on this node's settings
    view = {"a": ViewEntry(resources=_node(need + projector.buffer_bytes // 2), revision=1)}
    facts = ModelFacts(geometry=model, path="m.gguf", projector=projector, projector_file=Companion(path="p.gguf"))
    assert decide(_request(), ModelFacts(geometry=model, path="m.gguf"), view, {}, now=NOW, decision_id="d1",
                  reservation_id="r1", dry_run=True).decision.admitted  # fmt: skip
    outcome = decide(_request(mmproj="p.gguf"), facts, view, {}, now=NOW, decision_id="d1", reservation_id="r1",
                     dry_run=True)  # fmt: skip
    assert not outcome.decision.admitted
    assert outcome.decision.rejections[0].reason == "insufficient_memory"


# ---- the runner: command line, log, observation, drift ----


def _reservation(mmproj: Companion | None, *, n_gpu_layers: int = 0, split: tuple[float, ...] = ()) -> Reservation:
    stamp = Stamp(settings=SETTINGS, ctx=4096, n_gpu_layers=n_gpu_layers, gpu_split=split, mmproj=mmproj)
    return Reservation(
        reservation_id="r1", decision_id="d1", node_id="n1", state="reserved", model_path="m.gguf", stamp=stamp,
        layers=(0, 2), devices=(), held={}, created_at=NOW,
    )  # fmt: skip


def test_the_command_pins_the_projector_file_and_where_it_runs() -> None:
    stamped = _reservation(Companion(path="p.gguf", digest="cd" * 32))
    resolved = with_files(stamped, "/models/m.gguf", mmproj="/models/p.gguf")
    assert resolved.stamp.mmproj == Companion(path="/models/p.gguf", digest="cd" * 32)
    argv = build_command("llama-server", resolved, port=8080, slot_save_dir="/s")
    assert argv[argv.index("--mmproj") + 1] == "/models/p.gguf"
    assert "--no-mmproj-offload" in argv and "--mmproj-offload" not in argv
    offloaded = _reservation(Companion(path="p.gguf"), n_gpu_layers=-1, split=(1.0,))
    assert "--mmproj-offload" in build_command("llama-server", offloaded, port=8080, slot_save_dir="/s")
    plain = build_command("llama-server", _reservation(None), port=8080, slot_save_dir="/s")
    assert not any("mmproj" in arg for arg in plain)


#: What llama-server logs for a model with a projector (abridged from a real run: the lines the parser reads).
LOG = """\
0.00.004.851 I llama_model_loader: loaded meta data with 18 key-value pairs and 21 tensors from m.gguf
0.00.007.567 I load_tensors:   CPU_Mapped model buffer size =     {weights} MiB
0.00.007.816 I llama_context: constructing llama_context
0.00.007.817 I llama_context: n_seq_max             = 2
0.00.009.772 I llama_context:        CPU  output buffer size =     {output} MiB
0.00.014.104 I sched_reserve:        CPU compute buffer size =     2.14 MiB
0.00.014.725 I clip_ctx: CLIP using CPU backend
0.00.015.112 I load_hparams: projector:          mlp
0.00.015.344 I load_hparams: model size:         {mmproj} MiB
0.00.015.357 I load_hparams: metadata size:      0.01 MiB
0.00.017.730 I srv    load_model: loaded multimodal model, 'p.gguf'
"""
FIRST_IMAGE = "0.03.746.372 I reserve_compute_meta:        CPU compute buffer size =     {compute} MiB\n"


def _log(predicted_weights: int, predicted_output: int, projector: ProjectorGeometry) -> str:
    return LOG.format(
        weights=printed_mib(predicted_weights), output=printed_mib(predicted_output),
        mmproj=printed_mib(projector.tensor_bytes),
    )  # fmt: skip


def test_at_start_the_projectors_weights_are_exact_and_its_graph_is_pending(
    model: ModelGeometry, projector: ProjectorGeometry
) -> None:
    predicted = estimate(model, SETTINGS, 4096, projector=projector)
    log = parse_allocation_log(_log(predicted.weights_bytes, predicted.output_bytes, projector))
    assert log.projector is not None
    assert (log.projector.backend, log.projector.projector_type) == ("CPU", "mlp")
    observation = observed_memory(log, predicted, cache_allocations(model, SETTINGS, 4096), projector)
    memory = observation.memory
    assert "projector_weights_bytes" in observation.exact
    assert memory.projector_weights_bytes == projector.buffer_bytes
    graph = predicted.projector_compute_bytes
    assert memory.pending_bytes == graph + compute_margin(graph)
    assert memory.total_bytes == (
        memory.kv_bytes + memory.weights_bytes + memory.projector_weights_bytes + memory.compute_bytes
        + memory.output_bytes + memory.pending_bytes
    )  # fmt: skip


def test_once_an_image_reserved_the_graph_it_is_observed_not_pending(
    model: ModelGeometry, projector: ProjectorGeometry
) -> None:
    predicted = estimate(model, SETTINGS, 4096, projector=projector)
    text = _log(predicted.weights_bytes, predicted.output_bytes, projector) + FIRST_IMAGE.format(compute="0.02")
    log = parse_allocation_log(text)
    assert log.projector is not None and log.projector.compute_buffers == {"CPU": Decimal("0.02")}
    memory = observed_memory(log, predicted, cache_allocations(model, SETTINGS, 4096), projector).memory
    assert memory.pending_bytes == 0
    before = observed_memory(parse_allocation_log(_log(predicted.weights_bytes, predicted.output_bytes, projector)),
                             predicted, cache_allocations(model, SETTINGS, 4096), projector).memory  # fmt: skip
    assert memory.compute_bytes == before.compute_bytes + round(Decimal("0.02") * (1 << 20))


def test_a_projector_that_prints_another_size_is_not_exact(model: ModelGeometry, projector: ProjectorGeometry) -> None:
    predicted = estimate(model, SETTINGS, 4096, projector=projector)
    text = _log(predicted.weights_bytes, predicted.output_bytes, projector).replace(
        f"{printed_mib(projector.tensor_bytes)} MiB", "9.99 MiB"
    )
    observation = observed_memory(parse_allocation_log(text), predicted, [], projector)
    assert "projector_weights_bytes" not in observation.exact
    assert observation.memory.projector_weights_bytes == round(Decimal("9.99") * (1 << 20))


def _report(log: str) -> ServerReport:
    props = {"total_slots": 2, "default_generation_settings": {"n_ctx": 2048}}
    slots = [{"n_ctx": 2048, "speculative": False}] * 2
    return ServerReport(props, slots, parse_allocation_log(log))


def test_a_stamped_projector_the_server_did_not_load_or_put_elsewhere_is_drift(
    model: ModelGeometry, projector: ProjectorGeometry
) -> None:
    predicted = estimate(model, SETTINGS, 4096, projector=projector)
    text = _log(predicted.weights_bytes, predicted.output_bytes, projector)
    without = "\n".join(line for line in text.splitlines() if "clip_ctx" not in line and "load_hparams" not in line)
    stamp = _reservation(Companion(path="p.gguf")).stamp
    fields = {d.field for d in server_drift(stamp, predicted.context, _report(without))}
    assert "log.mmproj" in fields
    assert not {d.field for d in server_drift(stamp, predicted.context, _report(text))} & {"log.mmproj"}
    on_gpu = text.replace("CLIP using CPU backend", "CLIP using CUDA0 backend")
    drift = {d.field: d for d in server_drift(stamp, predicted.context, _report(on_gpu))}
    assert (drift["log.mmproj_backend"].stamped, drift["log.mmproj_backend"].current) == ("host", "gpu")
    unstamped = _reservation(None).stamp
    assert "log.mmproj" in {d.field for d in server_drift(unstamped, predicted.context, _report(text))}
