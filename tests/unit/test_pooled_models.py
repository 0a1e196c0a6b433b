"""Embedding and rerank models: what a model is served as, what admission sizes and stamps, what the runner pins
and checks (`actors.placement.pooled` and the places that use it)."""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from pathlib import Path

import msgspec
import pytest

from actors.frontdoor.catalog import CatalogError, parse_catalog
from actors.placement import compute, pooled
from actors.placement.admission import ModelFacts
from actors.placement.bounds import invalid, out_of_bounds
from actors.placement.context import MemoryModelError, resolve_context
from actors.placement.geometry import GeometryError, geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from actors.runner.allocation_log import AllocationLog, ContextAllocation
from actors.runner.drift import ServerReport, server_drift, settings_drift
from messages.model import ModelGeometry
from messages.placement import PreferredSettings, Stamp
from messages.settings import ServingSettings, SettingsBounds
from tests.harness.admission import DEFAULT, GIB, OPEN, Quiet, node, request, run, view
from tests.tiny_models import write_llama
from tests.tiny_pooled_models import write_llama_embedding, write_qwen3_embedding, write_qwen3_reranker

QUIET: Quiet = {"cache_ram_mib": 0, "ctx_checkpoints": 0}


def _geometry(path: Path) -> ModelGeometry:
    return geometry_from_header(read_header(path))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelGeometry]:
    d = tmp_path_factory.mktemp("pooled")
    return {
        "mean": _geometry(write_llama_embedding(d / "mean.gguf", n_vocab=300)),
        "last": _geometry(write_qwen3_embedding(d / "last.gguf")),
        "rank": _geometry(write_qwen3_reranker(d / "rank.gguf")),
        "headless": _geometry(write_qwen3_reranker(d / "headless.gguf", head=False)),
        "plain": _geometry(write_llama(d / "plain.gguf")),
    }


def _pooled(kind: str = "embedding", pooling: str = "mean", **fields: object) -> ServingSettings:
    return msgspec.convert({"kind": kind, "pooling": pooling, **QUIET, **fields}, ServingSettings)


def test_the_header_says_what_a_model_is_for(models: dict[str, ModelGeometry]) -> None:
    assert (models["mean"].pooling, models["last"].pooling, models["rank"].pooling) == ("mean", "last", "rank")
    assert models["plain"].pooling == "" and not models["plain"].rank_head
    assert models["rank"].rank_head and not models["headless"].rank_head
    assert [pooled.header_kind(models[m]) for m in ("mean", "last", "rank", "plain")] == [
        "embedding", "embedding", "rerank", None,
    ]  # fmt: skip


def test_a_pooling_type_outside_llama_cpps_is_refused_by_name(tmp_path: Path) -> None:
    path = write_llama_embedding(tmp_path / "m.gguf")
    header = read_header(path)
    bad = dataclasses.replace(header, kv={**header.kv, "llama.pooling_type": 9})
    with pytest.raises(GeometryError, match="pooling_type 9"):
        geometry_from_header(bad)


def test_kind_and_pooling_come_from_the_header_unless_asked_for(models: dict[str, ModelGeometry]) -> None:
    assert pooled.resolved(None, models["plain"]) is None  # a generation model: the node's defaults
    assert pooled.resolved(None, models["mean"]) == PreferredSettings(kind="embedding", pooling="mean")
    assert pooled.resolved(None, models["rank"]) == PreferredSettings(kind="rerank", pooling="rank")
    slots = PreferredSettings(slots=2)
    assert pooled.resolved(slots, models["last"]) == PreferredSettings(slots=2, kind="embedding", pooling="last")
    generate = PreferredSettings(kind="generate")
    assert pooled.resolved(generate, models["mean"]) is generate  # a pooled header served as a generator
    # an embedding server of a model whose header names no pooling pools by mean (none answers no OpenAI call)
    assert pooled.resolved(PreferredSettings(kind="embedding"), models["plain"]) == PreferredSettings(
        kind="embedding", pooling="mean"
    )
    asked = PreferredSettings(kind="embedding", pooling="cls")
    assert pooled.resolved(asked, models["last"]) == asked


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"pooling": "mean"}, "only an embedding or rerank model pools"),
        ({"kind": "embedding"}, "needs a pooling type"),
        ({"kind": "rerank", "pooling": "mean"}, "pools by rank"),
        ({"kind": "embedding", "pooling": "mean", "spec_type": "ngram-simple"}, "does not speculate"),
    ],
)
def test_kind_and_pooling_that_do_not_go_together_are_refused(settings: dict[str, str], why: str) -> None:
    refused = invalid(msgspec.convert(settings, ServingSettings))
    assert refused is not None and why in refused


def test_a_reranker_without_a_classification_head_is_refused(models: dict[str, ModelGeometry]) -> None:
    with pytest.raises(MemoryModelError, match="no classification head"):
        estimate(models["headless"], _pooled("rerank", "rank"), 1024)
    estimate(models["rank"], _pooled("rerank", "rank"), 1024)  # with one it is sized


@pytest.mark.parametrize(("unified", "ctx", "ubatch"), [(False, 4096, 2048), (True, 4096, 4096), (True, 1000, 1000)])
def test_a_pooled_servers_micro_batch_holds_a_whole_input(
    models: dict[str, ModelGeometry], unified: bool, ctx: int, ubatch: int
) -> None:
    settings = _pooled(slots=2, kv_unified=unified)  # the node's batch (2048/512) is not what it runs with
    shape = resolve_context(models["mean"], settings, ctx)
    assert shape.n_ubatch == ubatch == min(ctx, shape.n_ctx_seq)
    stamped = pooled.whole_input(settings, shape)
    assert stamped.batch == stamped.ubatch == ubatch
    assert resolve_context(models["mean"], stamped, ctx) == shape  # the stamp builds the same context
    plain = ServingSettings(slots=2, **QUIET)
    assert resolve_context(models["plain"], plain, ctx).n_ubatch == 512 and pooled.whole_input(plain, shape) is plain


def test_a_pooled_server_outputs_every_token_into_host_memory(models: dict[str, ModelGeometry]) -> None:
    g = models["mean"]
    settings = _pooled(slots=2)
    breakdown = estimate(g, settings, 2048)
    row = 4 * (g.n_vocab + g.n_embd)  # the logits and the embedding of one output
    assert breakdown.output_bytes == row * 2  # one row per slot at start, as llama.cpp logs it
    assert breakdown.host_extra_bytes == row * (1024 - 2)  # grown to the whole batch at run time
    generate = estimate(g, ServingSettings(slots=2, **QUIET), 2048)
    assert generate.output_bytes == 4 * g.n_vocab * 2 and generate.host_extra_bytes == 0
    assert breakdown.kv_bytes == generate.kv_bytes  # the same cache per slot


def test_a_pooled_graph_reserves_the_logits_of_its_whole_micro_batch(models: dict[str, ModelGeometry]) -> None:
    g = msgspec.structs.replace(models["mean"], n_vocab=32000, n_embd=1024)  # where the output stage dominates
    for flash in (True, False):
        settings = _pooled(slots=1, flash_attn="on" if flash else "off")
        shape = resolve_context(g, settings, 512)
        got = compute.compute_buffers(g, shape, flash_attn=flash, n_outputs=1, pooled=True).device
        rows = compute.POOLED_OUTPUT_EMBD_ROWS[flash]
        assert got >= 4 * 512 * (32000 + rows * 1024)
        # measured on this shape (llama, n_embd 1024, n_ff 2816, vocab 32000, -ub 512): 73.02 MiB with flash attention
        if flash:
            assert abs(got / (1 << 20) - 73.02) / 73.02 < 0.01
    generate = compute.compute_buffers(g, shape, flash_attn=True, n_outputs=1)
    assert generate.device < got


def test_bounds_refuse_a_kind_the_node_does_not_serve_and_leave_a_pooled_models_batch_its_own() -> None:
    bounds = SettingsBounds(kinds=("generate",))
    settings = _pooled(batch=4096, ubatch=4096)
    fields, message = out_of_bounds(settings, DEFAULT, bounds)
    assert fields == ("kind",) and "kind embedding not in kinds (generate)" in message
    assert out_of_bounds(settings, DEFAULT, OPEN) == ((), "")  # its batch sizes are its whole input
    generate = msgspec.structs.replace(DEFAULT, batch=4096)
    assert out_of_bounds(generate, DEFAULT, OPEN)[0] == ("batch",)  # a generation server's are the node's


def test_admission_stamps_an_embedding_model_from_its_header_with_a_whole_input_batch(tmp_path: Path) -> None:
    path = write_llama_embedding(tmp_path / "e.gguf")
    model = ModelFacts(geometry=_geometry(path), path=str(path))
    outcome = run(request(ctx=4096, settings={"slots": 2}), model, view(node("a", 8 * GIB, bounds=OPEN)))
    stamp = outcome.decision.stamp
    assert outcome.decision.admitted and stamp is not None
    s = stamp.settings
    assert (s.kind, s.pooling, s.slots, s.batch, s.ubatch) == ("embedding", "mean", 2, 2048, 2048)
    (placement,) = outcome.decision.placements
    assert placement.breakdown.context.n_ubatch == 2048
    assert estimate(model.geometry, s, stamp.ctx).total_bytes == placement.breakdown.total_bytes  # the runner's
    # asked to generate, it generates
    outcome = run(request(ctx=4096, settings={"kind": "generate"}), model, view(node("a", 8 * GIB, bounds=OPEN)))
    assert outcome.decision.stamp is not None and outcome.decision.stamp.settings == DEFAULT


def test_a_node_that_serves_no_embeddings_is_refused_naming_the_bound(tmp_path: Path) -> None:
    path = write_llama_embedding(tmp_path / "e.gguf")
    model = ModelFacts(geometry=_geometry(path), path=str(path))
    nodes = view(node("a", 8 * GIB, bounds=SettingsBounds(kinds=("generate",))))
    decision = run(request(ctx=4096), model, nodes).decision
    assert not decision.admitted and decision.reason == "settings_mismatch"
    assert decision.rejections[0].fields == ("kind",)


def test_a_reranker_without_a_head_is_refused_as_unsupported(tmp_path: Path) -> None:
    path = write_qwen3_reranker(tmp_path / "r.gguf", head=False)
    model = ModelFacts(geometry=_geometry(path), path=str(path))
    decision = run(request(ctx=1024), model, view(node("a", 8 * GIB, bounds=OPEN))).decision
    assert not decision.admitted and decision.reason == "unsupported_settings"
    assert "classification head" in decision.rejections[0].message


def _report(context: ContextAllocation) -> ServerReport:
    slots = [{"n_ctx": 1024, "speculative": False}, {"n_ctx": 1024, "speculative": False}]
    props = {"total_slots": 2, "default_generation_settings": {"n_ctx": 1024}}
    return ServerReport(props=props, slots=slots, log=AllocationLog(contexts=[context]))


def test_a_pooled_server_is_checked_for_its_batch_and_every_token_an_output(models: dict[str, ModelGeometry]) -> None:
    settings = _pooled(slots=2, batch=1024, ubatch=1024)
    stamp = Stamp(settings=settings, ctx=2048, n_gpu_layers=0)
    shape = resolve_context(models["mean"], settings, 2048)
    good = ContextAllocation(
        n_seq_max=2, n_ctx=2048, n_ctx_seq=1024, n_batch=1024, n_ubatch=1024, n_rs_seq=0, n_outputs_max=1024,
        flash_attn="on", kv_unified=False,
    )  # fmt: skip
    assert server_drift(stamp, shape, _report(good)) == ()
    # a server without embeddings on: its outputs are one per slot
    drifted = server_drift(stamp, shape, _report(dataclasses.replace(good, n_outputs_max=2)))
    assert [(d.field, d.stamped, d.current) for d in drifted] == [("log.n_outputs_max", "1024", "2")]
    # and before start, its batch sizes are not drift from the node's
    assert settings_drift(stamp, DEFAULT, bounds=OPEN) == ()
    assert [d.field for d in settings_drift(stamp, DEFAULT, bounds=SettingsBounds(kinds=("generate",)))] == ["kind"]


def test_the_allocation_log_gives_a_contexts_output_limit() -> None:
    from actors.runner.allocation_log import parse_allocation_log

    log = parse_allocation_log(
        "llama_context: constructing llama_context\nllama_context: n_batch               = 512\n"
        "llama_context: n_outputs_max         = 512\nllama_context: n_outputs_max_per_seq = 1\n"
        "llama_context:        CPU  output buffer size =     0.13 MiB\n"
    )
    assert log.target is not None and (log.target.n_batch, log.target.n_outputs_max) == (512, 512)
    assert log.target.output_buffers == {"CPU": Decimal("0.13")}


def test_a_catalog_entry_says_what_its_model_is_for() -> None:
    catalog = parse_catalog(
        '[models.e]\npath = "e.gguf"\nkind = "embedding"\npooling = "cls"\n'
        '[models.r]\npath = "r.gguf"\nkind = "rerank"\n'
        '[models.h]\npath = "h.gguf"\n'
    )
    assert catalog.models["e"].required_settings() == PreferredSettings(kind="embedding", pooling="cls")
    assert catalog.models["r"].required_settings() == PreferredSettings(kind="rerank")
    assert catalog.models["h"].required_settings() is None  # the header decides
    assert catalog.models["e"].runs_on(_pooled("embedding", "cls"))
    assert not catalog.models["e"].runs_on(ServingSettings())  # a generation server of the same file
    for table, why in (
        ('kind = "generate"\npooling = "mean"', "does not pool"),
        ('kind = "rerank"\npooling = "mean"', "pools by rank"),
        ('kind = "classify"', "kind"),
    ):
        with pytest.raises(CatalogError, match=why):
            parse_catalog(f'[models.x]\npath = "x.gguf"\n{table}\n')
