"""A draft model (`--model-draft`, "draft-simple" speculation) against the real llama-server, byte for byte.

Each case writes a tiny model and a smaller draft model sharing its vocabulary (llama-server refuses a draft
whose vocabulary differs), starts the server with every allocation-relevant flag pinned as the runner pins
them, and compares what it logs with the prediction:

* the draft model's own mapped buffer (the second model the server loads) prints as its declared tensor bytes,
  and the model's buffer as the model's; with quantized draft weights, the draft's `CPU_REPACK` and (on a CPU
  with AMX) `AMX` buffers as its predicted copies;
* the draft context (the server's second llama context): n_ctx, n_ctx_seq, slots and micro-batch as predicted,
  every KV line (cells, layers, seqs, streams, the -ctkd/-ctvd types, K and V figures), and its logits buffer;
* the observed footprint the runner derives from the log recovers every exact figure (KV, draft KV, weights,
  draft weights, output), and the compute buffers of both contexts together are within the compute model's
  stated error.

Print-step argument as in `test_memory_exact.py`: a line whose cells x streams x one row step exceeds 0.01 MiB
admits only one byte count; the matrix holds such draft lines for f16, q8_0 and q4_0.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import msgspec
import pytest

from actors.placement.caches import cache_allocations
from actors.placement.compute import MEASURED_ERROR_RATIO
from actors.placement.context import draft_model_settings, resolve_context
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import MemoryModelError, estimate
from actors.runner.allocation_log import parse_allocation_log, printed_mib, printed_mib_f32
from actors.runner.observed import observed_memory
from messages.model import ModelGeometry
from messages.settings import ServingSettings
from tests import tiny_models
from tests.harness.memory_exact import allocated, node_features, printed_model_buffers
from tests.harness.quantized import write_quantized_llama
from tests.llama_harness import require_server, run_server, server_args

pytestmark = pytest.mark.e2e

MIB = 1 << 20
N_VOCAB = 2000


@pytest.fixture(scope="module")
def binary() -> str:
    return require_server()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("draft-models")
    return {
        "llama": tiny_models.write_llama(d / "llama.gguf", n_layer=4, n_embd=256, n_head=8, n_head_kv=4, n_ff=512,
                                         n_vocab=N_VOCAB),
        # the drafts: smaller, the same byte-fallback vocabulary (a few tokens fewer is within llama-server's 128)
        "draft": tiny_models.write_llama(d / "draft.gguf", n_layer=2, n_embd=128, n_head=2, n_head_kv=1, n_ff=256,
                                         n_vocab=N_VOCAB - 16),
        "draft-q4_0": write_quantized_llama(
            d / "draft-q4_0.gguf", n_layer=2, n_embd=256, n_ff=512, n_vocab=N_VOCAB,
            types={"q": "q4_0", "k": "q4_0", "v": "q4_0", "o": "q4_0", "gate": "q4_0", "up": "q4_0", "output": "q4_0"},
        ),
        "draft-gemma3": tiny_models.write_gemma3(
            d / "draft-gemma3.gguf", n_layer=3, n_embd=128, n_head=2, n_head_kv=1, head_dim=64, n_swa=256,
            swa_pattern=3, n_vocab=N_VOCAB,
        ),
        "far-vocab": tiny_models.write_llama(d / "far-vocab.gguf", n_layer=1, n_embd=64, n_head=2, n_head_kv=1,
                                             n_ff=128, n_vocab=N_VOCAB + 200),
    }  # fmt: skip


@dataclass(frozen=True)
class Case:
    draft: str
    n_ctx: int
    settings: ServingSettings

    @property
    def id(self) -> str:
        s = self.settings
        streams = "kvu" if s.kv_unified else "streams"
        types = f"{s.spec_draft_type_k}-{s.spec_draft_type_v}"
        return f"{self.draft}_c{self.n_ctx}_np{s.slots}_{streams}_{types}_fa-{s.flash_attn}_n{s.spec_draft_n_max}"


def _s(**kw: object) -> ServingSettings:
    return msgspec.convert({"cache_ram_mib": 0, "spec_type": "draft-simple", **kw}, ServingSettings)


CASES = [
    Case("draft", 8192, _s(slots=2, spec_draft_n_max=4, spec_draft_type_k="q8_0", spec_draft_type_v="q8_0")),
    Case("draft", 8192, _s(slots=4, kv_unified=True, spec_draft_n_max=8)),
    Case("draft", 6000, _s(slots=3, spec_draft_n_max=3, spec_draft_type_k="q4_0", spec_draft_type_v="q4_0")),
    Case("draft", 4096, _s(slots=2, flash_attn="off", spec_draft_type_k="bf16", spec_draft_type_v="f32")),
    Case("draft-q4_0", 8192, _s(slots=2, spec_draft_n_max=5)),
    # a sliding-window draft: its context has a non-SWA and a window-sized SWA cache of its own
    Case("draft-gemma3", 8192, _s(slots=2, spec_draft_n_max=3)),
]


def _geometry(path: Path) -> ModelGeometry:
    return geometry_from_header(read_header(path))


def _server_args(case: Case, draft: Path) -> list[str]:
    return server_args(case.settings, case.n_ctx, extra=["--model-draft", str(draft), "-ngl", "0", "-ngld", "0"])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_draft_model_allocations_match_llama_server_exactly(case: Case, models: dict[str, Path], binary: str) -> None:
    geometry, draft = _geometry(models["llama"]), _geometry(models[case.draft])
    run = run_server(models["llama"], _server_args(case, models[case.draft]), binary=binary)
    assert allocated(run), run.log[-3000:]
    log = parse_allocation_log(run.log)
    predicted = estimate(geometry, case.settings, case.n_ctx, draft=draft, cpu_features=node_features())
    allocations = cache_allocations(geometry, case.settings, case.n_ctx, draft)

    # weights: each model's buffers, the draft's loaded second
    assert log.model_buffers == printed_model_buffers(predicted)
    assert log.draft_model_buffers == printed_model_buffers(predicted, draft=True)
    # the f32 model has no copies (neither repacked nor taken by AMX): all are the draft's
    assert (predicted.draft_repack_bytes, predicted.draft_amx_bytes) == (predicted.repack_bytes, predicted.amx_bytes)

    # the draft context: the target's n_ctx and slots, its own layers and cache types, one output per slot
    assert len(log.contexts) == 2
    shape = resolve_context(geometry, case.settings, case.n_ctx)
    draft_shape = resolve_context(draft, draft_model_settings(case.settings), shape.n_ctx)
    ctx = log.contexts[1]
    assert (ctx.n_ctx, ctx.n_ctx_seq, ctx.n_seq_max, ctx.n_ubatch, ctx.n_rs_seq) == (
        draft_shape.n_ctx, draft_shape.n_ctx_seq, draft_shape.n_seq_max, draft_shape.n_ubatch, 0,
    )  # fmt: skip
    lines = [(ctx_name, line) for ctx_name, c in (("target", log.contexts[0]), ("draft", ctx)) for line in c.kv]
    assert len(lines) == len(allocations)
    for (context, line), want in zip(lines, allocations, strict=True):
        assert context == want.context
        assert (line.cells, line.layers, line.seqs, line.streams, line.k_type, line.v_type) == (
            want.cells, want.layers, want.seqs, want.streams, want.type_a, want.type_b,
        )  # fmt: skip
        assert (line.k_mib, line.v_mib) == (printed_mib_f32(want.a_bytes), printed_mib_f32(want.b_bytes))
    assert ctx.output_buffers == {"CPU": printed_mib(predicted.draft_output_bytes)}
    assert predicted.draft_output_bytes == 4 * draft.n_vocab * case.settings.slots

    # the runner's observation recovers every exact figure, the draft's included
    observation = observed_memory(log, predicted, allocations)
    assert observation.exact >= {"kv_bytes", "draft_kv_bytes", "weights_bytes", "draft_weights_bytes", "output_bytes"}
    memory = observation.memory
    assert (memory.kv_bytes, memory.draft_kv_bytes) == (predicted.kv_bytes, predicted.draft_kv_bytes)
    assert (memory.weights_bytes, memory.draft_weights_bytes) == (
        predicted.weights_bytes,
        predicted.draft_weights_bytes + predicted.draft_repack_bytes + predicted.draft_amx_bytes,
    )
    assert memory.output_bytes == predicted.output_bytes

    # the speculation the server set up is the one stamped
    assert [(impl.type, impl.n_max) for impl in log.speculative] == [("draft-simple", case.settings.spec_draft_n_max)]

    measured = float(sum((sum(c.compute_buffers.values(), Decimal(0)) for c in log.contexts), Decimal(0)))
    error = (predicted.compute_bytes / MIB - measured) / measured
    assert abs(error) <= MEASURED_ERROR_RATIO, f"compute buffers off by {error:+.1%}"


def test_matrix_includes_byte_exact_draft_lines(models: dict[str, Path]) -> None:
    """Equality of printed figures is byte-exact only for lines larger than the print step: the matrix must
    hold such draft KV lines, or the proof above would be vacuous."""
    exact: set[str] = set()
    geometry = _geometry(models["llama"])
    for case in CASES:
        for a in cache_allocations(geometry, case.settings, case.n_ctx, _geometry(models[case.draft])):
            step = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34, "q4_0": 18}[a.type_a]
            if a.context == "draft" and a.cells * a.streams * step > 0.01 * MIB:
                exact.add(a.type_a)
    assert exact >= {"f16", "q8_0", "q4_0"}


def test_incompatible_draft_vocabulary_is_refused_where_llama_server_drops_the_draft(
    models: dict[str, Path], binary: str
) -> None:
    """200 tokens more than the model's (at most 128 apart): llama-server frees the draft and serves without
    speculation, which is not what a stamp with a draft says; the estimate refuses it before anything starts."""
    case = Case("far-vocab", 4096, _s(slots=1))
    with pytest.raises(MemoryModelError, match="vocabulary"):
        estimate(_geometry(models["llama"]), case.settings, case.n_ctx, draft=_geometry(models["far-vocab"]))
    run = run_server(models["llama"], _server_args(case, models["far-vocab"]), binary=binary)
    assert "the target and draft vocabs are not compatible" in run.log


def test_draft_cache_type_its_heads_cannot_hold_is_refused_like_llama_server(
    models: dict[str, Path], binary: str
) -> None:
    """The gemma3 draft's 64-wide heads take q8_0; a draft of 16-wide heads does not with flash attention."""
    narrow = tiny_models.write_llama(
        models["llama"].parent / "narrow.gguf", n_layer=1, n_embd=64, n_head=4, n_head_kv=1, n_ff=128, n_vocab=N_VOCAB
    )
    case = Case("narrow", 4096, _s(slots=1, spec_draft_type_k="q8_0", spec_draft_type_v="q8_0"))
    with pytest.raises(MemoryModelError, match="head size 16"):
        estimate(_geometry(models["llama"]), case.settings, case.n_ctx, draft=_geometry(narrow))
    run = run_server(models["llama"], _server_args(case, narrow), binary=binary)
    assert not run.healthy
