"""The memory model against the real llama-server: cache bytes exact, compute within its stated error.

Each case writes a tiny model that really loads, starts llama-server with every allocation-relevant flag
pinned (`-lv 4 --no-warmup --fit off`, explicit `-c`/`-np`), parses its allocation lines and compares them
with the prediction, line by line:

* exact integers: n_ctx, n_ctx_seq, n_seq_max, n_ubatch, n_rs_seq, and for every cache its cells, layers,
  seqs and streams (rollback rows for the recurrent state);
* the K/V (R/S) figures and the line total, which llama.cpp prints in MiB with two decimals from the exact
  byte counts: the predicted bytes must print identically (same float32 rounding). A cache's bytes are
  cells x streams x (the sum of its layers' row sizes), and a row can only change by one element (one
  block for a quantized type); where cells x streams x that step exceeds the 0.01 MiB print step, only one
  byte count is consistent with the printed figure and the exact cell count, so equality there is
  byte-exact. The matrix includes such lines for every cache type;
* weights (the mapped model buffer) and the output buffer, same rounding;
* the compute buffers within the model's stated error (`compute.MEASURED_ERROR_RATIO`).

The `--log-jsonl` `fit_memory_breakdown` record is integer MiB (rounded down), so the 2-decimal lines are
the most exact source the server offers; it is checked for consistency in one case.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from actors.placement.compute import MEASURED_ERROR_RATIO, compute_buffers
from actors.placement.context import draft_settings
from actors.placement.memory import Budgets, MemoryModelError, cache_allocations, estimate, resolve_context
from actors.runner.allocation_log import parse_allocation_log
from actors.telemetry.probes import read_host
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


@pytest.fixture(scope="module")
def binary() -> str:
    return require_server()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    return {
        **tiny_models.write_hybrid_set(d, n_vocab=8000, llama_layers=4),
        "mamba2": tiny_models.write_mamba2(
            d / "mamba2.gguf", n_layer=3, n_embd=64, inner=256, state_size=32, group_count=2, dt_rank=8
        ),
        "gemma3": tiny_models.write_gemma3(
            d / "gemma3.gguf", n_layer=6, n_embd=128, n_head=4, n_head_kv=2, head_dim=64, n_swa=256, swa_pattern=3
        ),
    }


CASES = [
    # dense llama
    Case("llama", 8192, _s(slots=1)),
    Case("llama", 8192, _s(slots=4)),
    Case("llama", 8192, _s(slots=4, kv_unified=True)),
    Case("llama", 5000, _s(slots=3)),  # 5000 -> 5120 -> 1706/slot -> 1792 cells per stream
    Case("llama", 8192, _s(slots=2, cache_type_k="q8_0", cache_type_v="q4_0")),
    Case("llama", 8192, _s(slots=2, cache_type_k="q5_1", cache_type_v="iq4_nl")),
    Case("llama", 8192, _s(slots=2, cache_type_k="q4_1", cache_type_v="q5_0")),
    Case("llama", 8192, _s(slots=2, flash_attn="off")),
    Case("llama", 8192, _s(slots=2, cache_type_k="bf16", cache_type_v="f32", flash_attn="off")),
    Case("llama", 200, _s(slots=1, batch=256, ubatch=128)),  # batch capped by the requested context
    # qwen35 hybrid with one MTP block: recurrent state, rollback rows, the MTP draft context
    Case("qwen35", 8192, _s(slots=1)),
    Case("qwen35", 8192, _s(slots=4, spec_type="draft-mtp", spec_draft_n_max=3)),
    Case("qwen35", 8192, _s(slots=4, kv_unified=True, spec_type="draft-mtp", spec_draft_n_max=0)),
    Case(
        "qwen35",
        6000,
        _s(
            slots=3,
            cache_type_k="q4_0",
            cache_type_v="q4_0",
            spec_type="draft-mtp",
            spec_draft_n_max=5,
            spec_draft_type_k="q8_0",
            spec_draft_type_v="q8_0",
        ),
    ),
    Case("qwen35", 8192, _s(slots=2, flash_attn="off", spec_type="draft-mtp", spec_draft_n_max=2)),
    Case("qwen35", 8192, _s(slots=8, spec_type="draft-mtp", spec_draft_n_max=7)),
    Case("qwen35", 8192, _s(slots=2, spec_type="ngram-mod")),  # speculation without rollback rows
    # granitehybrid: attention where head_count_kv > 0 (1, 4 and 2 KV heads: per-layer widths, and the
    # V cache padded to the widest layer without flash attention), Mamba2 state elsewhere, no rollback
    Case("granitehybrid", 8192, _s(slots=1)),
    Case("granitehybrid", 8192, _s(slots=2, flash_attn="off")),
    Case("granitehybrid", 8192, _s(slots=4)),
    Case("granitehybrid", 8192, _s(slots=4, kv_unified=True, cache_type_k="bf16", cache_type_v="f32")),
    # pure recurrent
    Case("mamba2", 4096, _s(slots=1)),
    Case("mamba2", 4096, _s(slots=5, kv_unified=True)),
    # sliding window (gemma3, every third layer global): window + micro-batch cells, per stream or unified
    Case("gemma3", 8192, _s(slots=1)),
    Case("gemma3", 8192, _s(slots=4)),
    Case("gemma3", 8192, _s(slots=4, kv_unified=True)),
    Case("gemma3", 8192, _s(slots=2, swa_full=True)),
    Case("gemma3", 8192, _s(slots=2, ubatch=1024)),
    Case("gemma3", 8192, _s(slots=2, cache_type_k="q8_0", cache_type_v="q8_0")),
    Case("gemma3", 8192, _s(slots=2, flash_attn="off")),
    Case("gemma3", 512, _s(slots=1)),  # window larger than the context: the SWA cache is the context
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cache_bytes_match_llama_server_exactly(case: Case, models: dict[str, Path], binary: str) -> None:
    _, error = _check(case, models, binary)
    assert abs(error) <= MEASURED_ERROR_RATIO, f"compute buffer off by {error:+.1%}"


def test_matrix_includes_byte_exact_lines_for_every_cache_type(models: dict[str, Path]) -> None:
    """The print-step argument makes equality byte-exact only for large enough caches: the matrix must
    contain such lines for each K and V type it checks, or the e2e proof would be vacuous."""
    exact_types: set[str] = set()
    for case in CASES:
        geometry = _geometry(models[case.model])
        for a in cache_allocations(geometry, case.settings, case.n_ctx):
            if a.kind == "recurrent" or not a.layers:
                continue
            for t in (a.type_a, a.type_b):
                if a.cells * a.streams * _row_step(t) > PRINT_STEP:
                    exact_types.add(t)
    assert exact_types >= {"f16", "bf16", "f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"}


def test_draft_mtp_on_a_model_without_nextn_is_refused_like_llama_server(models: dict[str, Path], binary: str) -> None:
    settings = _s(slots=1, spec_type="draft-mtp")
    with pytest.raises(MemoryModelError, match="nextn"):
        estimate(_geometry(models["granitehybrid"]), settings, 4096)
    run = run_server(models["granitehybrid"], server_args(settings, 4096), binary=binary)
    assert not run.healthy


def test_quantized_cache_row_that_is_not_whole_blocks_is_refused_like_llama_server(
    models: dict[str, Path], binary: str
) -> None:
    """granitehybrid's 1-KV-head layer has 16-element rows; q8_0 packs 32 per block, so llama.cpp cannot
    create the cache and the server fails to start."""
    settings = _s(slots=1, cache_type_k="q8_0", cache_type_v="q8_0")
    with pytest.raises(MemoryModelError, match="not a multiple of q8_0's block"):
        estimate(_geometry(models["granitehybrid"]), settings, 4096)
    run = run_server(models["granitehybrid"], server_args(settings, 4096), binary=binary)
    assert not run.healthy


def test_fit_memory_breakdown_record_agrees_with_the_exact_lines(models: dict[str, Path], binary: str) -> None:
    """The JSON record holds whole MiB rounded down; it must agree with the exact figures."""
    case = Case("qwen35", 8192, _s(slots=4, spec_type="draft-mtp"))
    path = models[case.model]
    run = run_server(path, server_args(case.settings, case.n_ctx, extra=["--log-jsonl"]), binary=binary)
    assert run.healthy
    log = parse_allocation_log(run.log)
    assert log.breakdown is not None, "no fit_memory_breakdown record at shutdown"
    (host,) = [row for row in log.breakdown if row.kind == "host"]
    breakdown = estimate(_geometry(path), case.settings, case.n_ctx)
    # the record covers the target context only: its KV and recurrent state
    assert host.context_mib == (breakdown.kv_bytes + breakdown.recurrent_bytes) // MIB
    assert host.model_mib == breakdown.weights_bytes // MIB


@pytest.mark.timeout(660)  # beyond its server's own deadline (600 s)
def test_sparse_qwen35_9b_shape_matches_llama_server(tmp_path: Path, binary: str) -> None:
    """A Qwen3.5-9B geometry (32 layers + 1 nextn, 8 attention / 24 recurrent) as a sparse file: weights,
    KV, recurrent state and MTP KV as the server reports them, at a realistic scale (~40 s to load)."""
    path = tiny_models.write_qwen35_9b(tmp_path / "qwen35-9b.gguf")
    geometry = _geometry(path)
    settings = _s(slots=1, spec_type="draft-mtp", spec_draft_n_max=3)
    ram = read_host().ram_total_bytes
    breakdown = estimate(geometry, settings, 8192, cpu_features=node_features(), budgets=Budgets(host=ram))
    if not breakdown.fits:  # e.g. a CPU with AMX: its 15 GiB copy beside the 17 GiB mapped (the kernel kills it)
        pytest.skip(
            f"admission refuses it on this machine: {breakdown.total_bytes / 2**30:.1f} GiB > {ram / 2**30:.1f}"
        )
    run = run_server(path, server_args(settings, 8192), binary=binary, deadline=600)
    assert run.healthy, run.log[-3000:]
    log = parse_allocation_log(run.log)
    _assert_context(log, geometry, settings, 8192)
    assert _assert_caches(log, geometry, settings, 8192) >= 1
    assert log.model_buffers == printed_model_buffers(breakdown)
    assert breakdown.recurrent_bytes == 4 * 52_690_944  # REFERENCE: 1 slot, times 1 + 3 rollback rows
    assert breakdown.kv_bytes == 32_768 * 8192


@pytest.mark.timeout(360)  # beyond its server's own deadline (300 s)
def test_qwen35_mtp_draft_compute_is_placed_as_llama_server_places_it(tmp_path: Path, binary: str) -> None:
    """The MTP context's compute buffer at Qwen3.5-9B widths (4 blocks + nextn, sparse; 4 slots, 8192
    cells, depth 3) is the server's figure to the print step: the draft graph is placed node by node as
    ggml-alloc places it (compute-5 sized it as a trunk layer: 120 MiB against the server's 88.02)."""
    path = tiny_models.write_qwen35_9b(tmp_path / "qwen35-9b-widths.gguf", n_layer=4)
    geometry = _geometry(path)
    settings = _s(slots=4, kv_unified=True, spec_type="draft-mtp", spec_draft_n_max=3)
    run = run_server(path, server_args(settings, 8192), binary=binary, deadline=300)
    assert run.healthy, run.log[-3000:]
    log = parse_allocation_log(run.log)
    assert len(log.contexts) == 2
    server_draft = float(sum(log.contexts[1].compute_buffers.values(), Decimal(0)))
    shape = resolve_context(geometry, settings, 8192)
    draft_shape = resolve_context(geometry, draft_settings(settings), shape.n_ctx)
    modelled = compute_buffers(geometry, shape, flash_attn=True, n_outputs=16, draft_shape=draft_shape).draft
    assert abs(modelled / MIB - server_draft) <= 0.02, f"draft compute {modelled / MIB:.2f} vs {server_draft} MiB"
