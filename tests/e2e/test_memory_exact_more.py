"""The memory model against the real llama-server, for the families `test_memory_exact` does not start.

Same method and helpers as `tests/e2e/test_memory_exact.py` (exact cell/layer/stream counts, the K/V and R/S
figures printed identically from the predicted bytes, weights and output buffers, compute within its stated
error), on one tiny model per distinct memory rule:

* dense GQA: qwen2 (head size n_embd / n_head, Q/K/V biases), qwen3 (explicit head size), qwen3moe (expert
  tensors change the weights, not the cache);
* sliding window: gemma2 (every other layer; the default 4096 window and a per-layer bool pattern),
  cohere2 (three sliding layers then one global), gpt-oss (every other layer, attention sinks);
* hybrids: nemotron_h (MLP blocks hold neither KV nor state), lfm2 (short-conv state
  `n_embd x (l_cache - 1)`, no S; with a window, the attention blocks slide), falcon-h1 (every block holds both),
  jamba (Mamba v1 state without groups), qwen3next (gated delta net, attention every 4th block);
* pure recurrent: mamba (v1) and rwkv7 (token-shift rows and a wkv state);
* MLA: deepseek2 caches one latent K row per token and no V.

The routed-expert cases (`MOE_COMPUTE_CASES`) use the mixture families at the width ratios of released
models (experts used x expert width against n_embd) and a short context, so that the experts' rows, not the
attention masks, make the compute buffer: each reports its compute error with the expert widths and with
the dense `feed_forward_length` the geometry used to stand in for them.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import msgspec
import pytest

from actors.placement.compute import MEASURED_ERROR_RATIO
from actors.placement.memory import MemoryModelError, cache_allocations, estimate
from actors.runner.allocation_log import parse_allocation_log
from messages.model import ModelGeometry
from tests import tiny_models
from tests.harness.memory_exact import (
    MIB,
    PRINT_STEP,
    Case,
    _assert_caches,
    _assert_context,
    _check,
    _geometry,
    _row_step,
    _s,
    node_features,
    printed_model_buffers,
)
from tests.llama_harness import require_server, run_server, server_args

pytestmark = pytest.mark.e2e

N_VOCAB = 8000


@pytest.fixture(scope="module")
def binary() -> str:
    return require_server()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models-more")
    v = N_VOCAB
    return {
        "qwen2": tiny_models.write_qwen2(d / "qwen2.gguf", n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=v),
        # head size 16 with 2 KV heads: 32-element rows, but a q8_0 block spans two heads
        "qwen2-h16": tiny_models.write_qwen2(d / "qwen2-h16.gguf", n_embd=64, n_head=4, n_head_kv=2, n_vocab=v),
        "qwen3": tiny_models.write_qwen3(
            d / "qwen3.gguf", n_embd=128, n_head=4, n_head_kv=2, head_dim=64, n_ff=256, n_vocab=v
        ),
        "qwen3moe": tiny_models.write_qwen3moe(
            d / "qwen3moe.gguf",
            n_embd=128,
            n_head=4,
            n_head_kv=4,
            head_dim=64,
            n_ff=384,
            n_vocab=v,
            n_expert=8,
            n_expert_used=4,
            n_ff_exp=96,
        ),
        "gemma2": tiny_models.write_gemma2(
            d / "gemma2.gguf", n_embd=128, n_head=4, n_head_kv=2, head_dim=64, n_ff=256, n_vocab=v, n_swa=256
        ),
        # no sliding_window key: gemma 2's default window of 4096; layers 0, 1 and 3 of 4 slide
        "gemma2-4k": tiny_models.write_gemma2(
            d / "gemma2-4k.gguf",
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            head_dim=64,
            n_vocab=v,
            n_swa=None,
            swa_pattern=[True, True, False, True],
        ),
        "cohere2": tiny_models.write_cohere2(
            d / "cohere2.gguf", n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=v, n_swa=256
        ),
        "gpt-oss": tiny_models.write_gpt_oss(
            d / "gpt-oss.gguf", n_embd=128, n_head=4, n_head_kv=2, head_dim=64, n_vocab=v, n_swa=128, n_ff_exp=128
        ),
        "nemotron_h": tiny_models.write_nemotron_h(
            d / "nemotron_h.gguf",
            layers="M*M-M*-",
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            n_ff=256,
            n_vocab=v,
            inner=256,
            state_size=64,
            group_count=2,
            dt_rank=8,
        ),
        "lfm2": tiny_models.write_lfm2(
            d / "lfm2.gguf", attention_layers=(2, 5), n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=768, n_vocab=v
        ),
        "lfm2-swa": tiny_models.write_lfm2(
            d / "lfm2-swa.gguf",
            attention_layers=(1, 3),
            n_layer=4,
            n_embd=256,
            n_head=4,
            n_head_kv=2,
            n_ff=768,
            n_vocab=v,
            n_swa=256,
        ),
        "falcon-h1": tiny_models.write_falcon_h1(
            d / "falcon-h1.gguf",
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            head_dim=64,
            n_vocab=v,
            inner=256,
            state_size=32,
            group_count=1,
            dt_rank=8,
        ),
        "jamba": tiny_models.write_jamba(
            d / "jamba.gguf", n_embd=128, n_head=4, n_head_kv=2, n_ff=384, n_vocab=v, state_size=16
        ),
        "mamba": tiny_models.write_mamba(d / "mamba.gguf", n_embd=256, state_size=16, dt_rank=16, n_vocab=v),
        "rwkv7": tiny_models.write_rwkv7(d / "rwkv7.gguf", n_embd=256, head_size=64, n_vocab=v),
        "deepseek2": tiny_models.write_deepseek2(
            d / "deepseek2.gguf",
            n_embd=128,
            n_head=4,
            kv_lora_rank=96,
            rope_dim=32,
            n_ff=384,
            n_vocab=v,
            n_ff_exp=96,
            n_expert=8,
            n_expert_used=3,
            n_nextn=1,
        ),
        "qwen3next": tiny_models.write_qwen3next(
            d / "qwen3next.gguf",
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            head_dim=64,
            n_ff=384,
            n_vocab=v,
            n_expert=8,
            n_expert_used=4,
            n_ff_exp=96,
            state_size=32,
            group_count=2,
            dt_rank=8,
            n_nextn=1,
        ),
        "nemotron_h_moe": tiny_models.write_nemotron_h_moe(
            d / "nemotron_h_moe.gguf",
            layers="ME*ME",
            n_nextn=1,
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            n_vocab=v,
            inner=256,
            state_size=64,
            group_count=2,
            dt_rank=8,
            n_expert=8,
            n_expert_used=3,
            n_ff_exp=128,
        ),
        "qwen35moe": tiny_models.write_qwen35moe(
            d / "qwen35moe.gguf",
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            head_dim=64,
            n_vocab=v,
            state_size=32,
            group_count=2,
            dt_rank=8,
            n_expert=8,
            n_expert_used=4,
            n_ff_exp=96,
        ),
        "plamo2": tiny_models.write_plamo2(
            d / "plamo2.gguf",
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            head_dim=64,
            n_ff=384,
            n_vocab=v,
            state_size=64,
            dt_rank=4,
        ),
        "glm4moe": tiny_models.write_glm4moe(
            d / "glm4moe.gguf",
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            head_dim=64,
            n_ff=384,
            n_vocab=v,
            n_expert=8,
            n_expert_used=4,
            n_ff_exp=96,
        ),
        "phi3": tiny_models.write_phi3(
            d / "phi3.gguf", n_embd=128, n_head=4, n_head_kv=2, n_ff=384, n_vocab=v, n_swa=256
        ),
        "arwkv7": tiny_models.write_arwkv7(d / "arwkv7.gguf", n_embd=256, head_size=64, n_ff=768, n_vocab=v),
    }


CASES = [
    # dense GQA
    Case("qwen2", 8192, _s(slots=1)),
    Case("qwen2", 5000, _s(slots=3, cache_type_k="q8_0", cache_type_v="q8_0")),
    Case("qwen2", 8192, _s(slots=2, flash_attn="off")),
    Case("qwen2-h16", 8192, _s(slots=2, cache_type_k="q8_0", flash_attn="off")),  # whole blocks per row suffice
    Case("qwen3", 8192, _s(slots=4)),
    Case("qwen3", 8192, _s(slots=4, kv_unified=True, cache_type_k="bf16", cache_type_v="f32", flash_attn="off")),
    Case("qwen3moe", 8192, _s(slots=2)),
    Case("qwen3moe", 8192, _s(slots=2, cache_type_k="q4_0", cache_type_v="q4_0")),
    # glm4moe: a dense model's MTP head, K and V, in the draft context; the target context leaves it out
    Case("glm4moe", 8192, _s(slots=1)),
    Case("glm4moe", 8192, _s(slots=2, flash_attn="off", spec_type="draft-mtp", spec_draft_n_max=3)),
    Case(
        "glm4moe",
        8192,
        _s(slots=4, kv_unified=True, spec_type="draft-mtp", spec_draft_type_k="q8_0", spec_draft_type_v="q4_0"),
    ),
    Case("phi3", 8192, _s(slots=2)),  # the header's sliding window is ignored: one full cache
    Case("phi3", 8192, _s(slots=3, kv_unified=True)),
    # sliding window
    Case("gemma2", 8192, _s(slots=1)),
    Case("gemma2", 8192, _s(slots=4)),
    Case("gemma2", 8192, _s(slots=4, kv_unified=True)),
    Case("gemma2", 8192, _s(slots=2, swa_full=True)),
    Case("gemma2", 8192, _s(slots=2, flash_attn="off")),
    Case("gemma2-4k", 16384, _s(slots=1)),  # the 4096 window + a micro-batch, below the 16k context
    Case("gemma2-4k", 16384, _s(slots=2, kv_unified=True)),  # 2 x 4096 + 512 cells of a 16k unified stream
    Case("gemma2-4k", 4096, _s(slots=1)),  # the window exceeds the context: the SWA cache is the context
    Case("cohere2", 8192, _s(slots=2)),
    Case("cohere2", 8192, _s(slots=3, kv_unified=True, ubatch=256)),
    Case("gpt-oss", 8192, _s(slots=2)),
    Case("gpt-oss", 8192, _s(slots=4, kv_unified=True, cache_type_k="q8_0", cache_type_v="q8_0")),
    # hybrids
    Case("nemotron_h", 8192, _s(slots=1)),
    Case("nemotron_h", 8192, _s(slots=8)),
    Case("nemotron_h", 8192, _s(slots=2, flash_attn="off")),
    Case("lfm2", 8192, _s(slots=1)),
    Case("lfm2", 8192, _s(slots=16, kv_unified=True)),
    Case("lfm2", 8192, _s(slots=2, flash_attn="off")),
    Case("lfm2-swa", 8192, _s(slots=2)),
    Case("lfm2-swa", 8192, _s(slots=4, kv_unified=True)),
    Case("lfm2-swa", 8192, _s(slots=2, swa_full=True)),
    Case("falcon-h1", 8192, _s(slots=1)),
    Case("falcon-h1", 8192, _s(slots=4)),
    Case("falcon-h1", 8192, _s(slots=4, kv_unified=True, flash_attn="off")),
    Case("jamba", 8192, _s(slots=1)),
    Case("jamba", 8192, _s(slots=6)),
    Case("jamba", 8192, _s(slots=2, flash_attn="off")),
    Case("qwen3next", 8192, _s(slots=1)),
    Case("qwen3next", 8192, _s(slots=4)),
    Case("qwen3next", 8192, _s(slots=4, kv_unified=True, flash_attn="off")),
    # MTP on qwen3next: the nextn block's KV in the draft context, but no rollback rows (unlike qwen35)
    Case("qwen3next", 8192, _s(slots=4, spec_type="draft-mtp", spec_draft_n_max=3)),
    # nemotron_h_moe: MTP on a Mamba2 hybrid that rolls back (rows per draft token), plain MTP cache
    Case("nemotron_h_moe", 8192, _s(slots=1)),
    Case("nemotron_h_moe", 8192, _s(slots=4, spec_type="draft-mtp", spec_draft_n_max=3)),
    Case("nemotron_h_moe", 8192, _s(slots=2, kv_unified=True, flash_attn="off", spec_type="draft-mtp")),
    Case("qwen35moe", 8192, _s(slots=2, spec_type="draft-mtp", spec_draft_n_max=2)),
    Case("qwen35moe", 8192, _s(slots=4, kv_unified=True)),
    # pure recurrent
    Case("mamba", 4096, _s(slots=1)),
    Case("mamba", 4096, _s(slots=8, kv_unified=True)),
    Case("rwkv7", 4096, _s(slots=1)),
    Case("rwkv7", 4096, _s(slots=8)),
    Case("arwkv7", 4096, _s(slots=1)),  # one token-shift row (n_embd), not rwkv7's two
    Case("arwkv7", 4096, _s(slots=12, kv_unified=True)),
    # MLA: K only
    Case("deepseek2", 8192, _s(slots=1)),
    Case("deepseek2", 8192, _s(slots=4)),
    Case("deepseek2", 8192, _s(slots=2, flash_attn="off")),
    Case("deepseek2", 8192, _s(slots=4, kv_unified=True, cache_type_k="q8_0", cache_type_v="q8_0")),
    Case(
        "deepseek2",
        8192,
        _s(slots=2, spec_type="draft-mtp", spec_draft_n_max=3, spec_draft_type_k="q8_0", spec_draft_type_v="q8_0"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cache_bytes_match_llama_server_exactly(case: Case, models: dict[str, Path], binary: str) -> None:
    _, error = _check(case, models, binary)
    assert abs(error) <= MEASURED_ERROR_RATIO, f"compute buffer off by {error:+.1%}"


def test_every_family_has_a_byte_exact_kv_line(models: dict[str, Path]) -> None:
    """As in the main matrix: each model with attention must have at least one KV line large enough that
    its printed figure pins the byte count, or its part of the proof would be vacuous."""
    exact: set[str] = set()
    for case in CASES:
        geometry = _geometry(models[case.model])
        for a in cache_allocations(geometry, case.settings, case.n_ctx):
            if a.kind != "recurrent" and a.layers and a.cells * a.streams * _row_step(a.type_a) > PRINT_STEP:
                exact.add(case.model)
    with_attention = {name for name in models if name not in ("mamba", "rwkv7", "arwkv7", "plamo2")}
    assert exact >= with_attention


def test_mla_cache_types_must_be_equal_like_llama_server(models: dict[str, Path], binary: str) -> None:
    """MLA keeps V as a view of the K latents, so llama.cpp refuses different K and V cache types."""
    settings = _s(slots=1, cache_type_k="q8_0", cache_type_v="f16")
    with pytest.raises(MemoryModelError, match="must be equal"):
        estimate(_geometry(models["deepseek2"]), settings, 4096)
    run = run_server(models["deepseek2"], server_args(settings, 4096), binary=binary)
    assert not run.healthy
    assert "does not support different K (q8_0) and V (f16) cache types" in run.log


def test_quantized_k_cache_needs_whole_blocks_per_head_with_flash_attention(
    models: dict[str, Path], binary: str
) -> None:
    """With flash attention a q8_0 block must not straddle two heads: 16-wide heads are refused even though
    the 32-wide rows are whole blocks (without flash attention the same cache is allocated, see CASES)."""
    settings = _s(slots=2, cache_type_k="q8_0")
    with pytest.raises(MemoryModelError, match="K head size 16 is not a multiple of q8_0's block"):
        estimate(_geometry(models["qwen2-h16"]), settings, 8192)
    run = run_server(models["qwen2-h16"], server_args(settings, 8192), binary=binary)
    assert not run.healthy
    assert "does not divide n_embd_head_k=16" in run.log


PLAMO2_CASES = [Case("plamo2", 8192, _s(slots=1)), Case("plamo2", 8192, _s(slots=6, flash_attn="off"))]


@pytest.mark.parametrize("case", PLAMO2_CASES, ids=[c.id for c in PLAMO2_CASES])
def test_plamo2_caches_match_before_its_first_graph_stalls(case: Case, models: dict[str, Path], binary: str) -> None:
    """PLaMo 2's layer 0 is a Mamba block with no heads: the head size comes from the family's own
    key_length (the generic rule would give 0), and llama.cpp's rope dimension count stays 0, on which this
    build's first graph computation does not finish. The caches are allocated and logged before that, so
    they are compared from the log of a run stopped after a few seconds."""
    path = models[case.model]
    geometry = _geometry(path)
    run = run_server(path, server_args(case.settings, case.n_ctx), binary=binary, deadline=3)
    log = parse_allocation_log(run.log)
    _assert_context(log, geometry, case.settings, case.n_ctx)
    assert _assert_caches(log, geometry, case.settings, case.n_ctx) == 1
    breakdown = estimate(geometry, case.settings, case.n_ctx, cpu_features=node_features())
    assert log.model_buffers == printed_model_buffers(breakdown)


# --- routed experts: the compute buffer follows n_expert_used x n_ff_exp ------------------------------------

#: How close the compute model is to these cases (it is exact to a few tenths of a percent on them).
MOE_COMPUTE_ERROR = 0.05


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One model per mixture family at n_embd 128-256, with the expert width to n_embd ratio and the experts
    used of a released model (Qwen3-30B-A3B, gpt-oss-20b, Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B, GLM-4.5-Air,
    DeepSeek-V3, Nemotron-3-Nano, Jamba), and its dense feed_forward_length ratio where the writer takes one."""
    d = tmp_path_factory.mktemp("models-moe")
    v = N_VOCAB
    return {
        "qwen3moe": tiny_models.write_qwen3moe(
            d / "qwen3moe.gguf", n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=768, n_vocab=v,
            n_expert=8, n_expert_used=8, n_ff_exp=96,
        ),
        "gpt-oss": tiny_models.write_gpt_oss(
            d / "gpt-oss.gguf", n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_vocab=v, n_swa=128,
            n_expert=8, n_expert_used=4, n_ff_exp=256, n_ff=256,
        ),
        "qwen35moe": tiny_models.write_qwen35moe(
            d / "qwen35moe.gguf", n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_vocab=v, state_size=32,
            group_count=2, dt_rank=8, n_expert=8, n_expert_used=8, n_ff_exp=64,
        ),
        "qwen3next": tiny_models.write_qwen3next(
            d / "qwen3next.gguf", n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=640, n_vocab=v,
            state_size=32, group_count=2, dt_rank=8, n_expert=16, n_expert_used=10, n_ff_exp=64,
        ),
        "glm4moe": tiny_models.write_glm4moe(
            d / "glm4moe.gguf", n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=672, n_vocab=v,
            n_expert=8, n_expert_used=8, n_ff_exp=96, n_nextn=0,
        ),
        "deepseek2": tiny_models.write_deepseek2(
            d / "deepseek2.gguf", n_embd=256, n_head=4, kv_lora_rank=128, rope_dim=32, n_ff=640, n_vocab=v,
            n_expert=8, n_expert_used=8, n_ff_exp=64,
        ),
        "nemotron_h_moe": tiny_models.write_nemotron_h_moe(
            d / "nemotron_h_moe.gguf", layers="ME*E", n_nextn=0, n_embd=256, n_head=4, n_head_kv=2, n_vocab=v,
            inner=384, state_size=16, group_count=2, dt_rank=12, n_expert=8, n_expert_used=6, n_ff_exp=192,
        ),
        "jamba": tiny_models.write_jamba(
            d / "jamba.gguf", n_embd=128, n_head=4, n_head_kv=2, n_ff=448, n_vocab=v, state_size=16,
            n_expert=4, n_expert_used=2,
        ),
    }  # fmt: skip


MOE_COMPUTE_CASES = [
    case
    for model in ("qwen3moe", "gpt-oss", "qwen35moe", "qwen3next", "glm4moe", "deepseek2", "nemotron_h_moe", "jamba")
    for case in (Case(model, 1024, _s(slots=1)), Case(model, 4096, _s(slots=4, kv_unified=True)))
]
#: jamba's experts are feed_forward_length wide, which the compute model knew before expert widths existed
#: and at nemotron_h_moe's tiny widths the recurrent stage (compute-5) sets the peak whatever the FFN width
DENSE_WIDTH_ALREADY_RIGHT = frozenset({"jamba", "nemotron_h_moe"})


def _without_expert_widths(geometry: ModelGeometry) -> ModelGeometry:
    """The geometry as encoded before expert widths and head sizes existed."""
    layers = tuple(
        msgspec.structs.replace(layer, head_k=0, head_v=0, n_ff_exp=0, n_expert_used=0) for layer in geometry.layers
    )
    return msgspec.structs.replace(geometry, layers=layers)


@pytest.mark.parametrize("case", MOE_COMPUTE_CASES, ids=[c.id for c in MOE_COMPUTE_CASES])
def test_moe_compute_buffer_follows_the_routed_expert_width(
    case: Case, moe_models: dict[str, Path], binary: str, record_property: Callable[[str, object], None]
) -> None:
    log, error = _check(case, moe_models, binary)
    measured = float(sum((sum(c.compute_buffers.values(), Decimal(0)) for c in log.contexts), Decimal(0)))
    dense = estimate(_without_expert_widths(_geometry(moe_models[case.model])), case.settings, case.n_ctx)
    dense_error = (dense.compute_bytes / MIB - measured) / measured
    record_property("compute_error", f"{error:+.2%}")
    record_property("compute_error_dense_n_ff", f"{dense_error:+.2%}")
    report = f"compute {measured:.2f} MiB: off by {error:+.1%} (by {dense_error:+.1%} with the dense n_ff)"
    assert abs(error) <= MOE_COMPUTE_ERROR, report
    if case.model not in DENSE_WIDTH_ALREADY_RIGHT:
        assert abs(dense_error) > MOE_COMPUTE_ERROR, f"the case does not exercise the expert width: {report}"


def test_mla_v_head_must_be_whole_quantized_blocks_with_flash_attention(tmp_path: Path, binary: str) -> None:
    """An MLA model's V is a view of its K latent, but llama.cpp still checks its V head size (the
    kv_lora_rank) against a quantized V cache's block: 80 is refused for q8_0, though the 96-wide K rows
    (latent + rope) are whole blocks."""
    path = tiny_models.write_deepseek2(
        tmp_path / "deepseek2-v80.gguf", n_embd=128, n_head=4, kv_lora_rank=80, rope_dim=16, n_ff=384, n_vocab=N_VOCAB
    )
    geometry = _geometry(path)
    settings = _s(slots=1, cache_type_k="q8_0", cache_type_v="q8_0")
    with pytest.raises(MemoryModelError, match="V head size 80 is not a multiple of q8_0's block of 32"):
        estimate(geometry, settings, 4096)
    run = run_server(path, server_args(settings, 4096), binary=binary)
    assert not run.healthy
    assert "does not divide n_embd_head_v=80" in run.log
    # the same cache at f16 is fine for both
    assert estimate(geometry, _s(slots=1), 4096).kv_v_bytes == 0
    assert run_server(path, server_args(_s(slots=1), 4096), binary=binary).healthy
