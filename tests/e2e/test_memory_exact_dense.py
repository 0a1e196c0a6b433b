"""The memory model against the real llama-server for the dense families it served by the rules of proven
ones without a server check: mistral3, gemma, granite, command-r and starcoder2.

Same method and helpers as `tests/e2e/test_memory_exact.py`: exact cell/layer/stream counts, the K/V figures
printed identically from the predicted bytes, weights and output buffers, compute within its stated error.
Each family's tiny model exercises the width rule that family depends on: an explicit head size that makes
Q narrower (mistral3) or wider (gemma) than n_embd, the derived head n_embd / n_head (granite, command-r,
starcoder2), command-r's parallel block and starcoder2's ungated FFN.

`REALISTIC_CASES` are hold-out shapes: sparse files at a released model's widths (fewer blocks: the buffers
depend on one block's widths, the context and the slots), 1, 4 and 16 unified slots at 8192 context, and a
smaller released shape per family at 16 unified slots and at 2 per-slot streams without flash attention; each
records its compute error and must be within 10%.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest

from actors.placement.compute import MEASURED_ERROR_RATIO
from actors.placement.memory import cache_allocations, estimate
from actors.runner.allocation_log import parse_allocation_log
from tests import tiny_models_dense
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
    d = tmp_path_factory.mktemp("models-dense")
    t = tiny_models_dense
    v = N_VOCAB
    return {
        # Q 4 x 32 = 128 wide against n_embd 256: the head size comes from key_length, not n_embd / n_head
        "mistral3": t.write_mistral3(
            d / "mistral3.gguf", n_embd=256, n_head=4, n_head_kv=2, head_dim=32, n_ff=512, n_vocab=v
        ),
        # Q 4 x 64 = 256 wide against n_embd 128 (Gemma 7B's 16 x 256 against 3072)
        "gemma": t.write_gemma(d / "gemma.gguf", n_embd=128, n_head=4, n_head_kv=1, head_dim=64, n_ff=384, n_vocab=v),
        "granite": t.write_granite(d / "granite.gguf", n_embd=128, n_head=4, n_head_kv=2, n_ff=320, n_vocab=v),
        "command-r": t.write_command_r(d / "command-r.gguf", n_embd=128, n_head=4, n_head_kv=2, n_ff=384, n_vocab=v),
        "starcoder2": t.write_starcoder2(d / "starcoder2.gguf", n_embd=128, n_head=4, n_head_kv=2, n_ff=512, n_vocab=v),
    }


CASES = [
    Case("mistral3", 8192, _s(slots=1)),
    Case("mistral3", 8192, _s(slots=4, kv_unified=True)),
    Case("mistral3", 8192, _s(slots=2, cache_type_k="q8_0")),
    Case("gemma", 8192, _s(slots=1)),
    Case("gemma", 8192, _s(slots=4, kv_unified=True, flash_attn="off")),
    Case("gemma", 8192, _s(slots=2, cache_type_k="q8_0", cache_type_v="q8_0")),
    Case("granite", 8192, _s(slots=1)),
    Case("granite", 8192, _s(slots=4, kv_unified=True)),
    Case("granite", 8192, _s(slots=2, cache_type_k="q4_0", flash_attn="off")),
    Case("command-r", 8192, _s(slots=1)),
    Case("command-r", 8192, _s(slots=4, kv_unified=True)),
    Case("command-r", 8192, _s(slots=2, cache_type_k="q8_0", cache_type_v="q8_0")),
    Case("starcoder2", 8192, _s(slots=1)),
    Case("starcoder2", 8192, _s(slots=4, kv_unified=True, flash_attn="off")),
    Case("starcoder2", 8192, _s(slots=2, cache_type_k="q8_0")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cache_bytes_match_llama_server_exactly(case: Case, models: dict[str, Path], binary: str) -> None:
    _, error = _check(case, models, binary)
    assert abs(error) <= MEASURED_ERROR_RATIO, f"compute buffer off by {error:+.1%}"


def test_every_dense_family_has_byte_exact_k_and_v_lines(models: dict[str, Path]) -> None:
    """Each family must have at least one K and one V line large enough that the printed figure pins the
    byte count, and its quantized case one whose quantized type does, or its part of the proof is vacuous."""
    exact: set[tuple[str, str]] = set()
    for case in CASES:
        for a in cache_allocations(_geometry(models[case.model]), case.settings, case.n_ctx):
            for t in (a.type_a, a.type_b):
                if a.layers and a.cells * a.streams * _row_step(t) > PRINT_STEP:
                    exact.add((case.model, t))
    for name in models:
        assert (name, "f16") in exact, name
        assert {t for model, t in exact if model == name} - {"f16"}, f"{name}: no quantized line pins its bytes"


def test_command_r_plus_depth_adds_per_head_qk_norms(tmp_path: Path, binary: str) -> None:
    """From 64 blocks on command-r loads per-head Q and K norms (Command R+): the writer's file loads, and
    the norms change the weights, not the cache."""
    path = tiny_models_dense.write_command_r(tmp_path / "command-r-plus.gguf", n_layer=64, n_embd=64, n_vocab=N_VOCAB)
    case = Case("command-r-plus", 4096, _s(slots=2))
    _, error = _check(case, {"command-r-plus": path}, binary)
    assert abs(error) <= MEASURED_ERROR_RATIO, f"compute buffer off by {error:+.1%}"


# --- released widths (hold-out): the compute buffer within the stated bound ------------------------------------


def _realistic(name: str, path: Path) -> Path:
    t = tiny_models_dense
    match name:
        case "mistral3":  # Mistral-Small-3.1-24B: Q 32 x 128 = 4096 against n_embd 5120
            return t.write_mistral3(
                path,
                n_layer=2,
                n_embd=5120,
                n_head=32,
                n_head_kv=8,
                head_dim=128,
                n_ff=32768,
                n_vocab=131072,
                dtype="f16",
                sparse=True,
            )
        case "gemma":  # Gemma-7B: 16 heads of 256 against n_embd 3072, no GQA
            return t.write_gemma(
                path,
                n_layer=2,
                n_embd=3072,
                n_head=16,
                n_head_kv=16,
                head_dim=256,
                n_ff=24576,
                n_vocab=256000,
                dtype="f16",
                sparse=True,
            )
        case "granite":  # Granite-3.1-8B
            return t.write_granite(
                path,
                n_layer=2,
                n_embd=4096,
                n_head=32,
                n_head_kv=8,
                n_ff=12800,
                n_vocab=49155,
                dtype="f16",
                sparse=True,
            )
        case "command-r":  # Command-R-08-2024 (32B)
            return t.write_command_r(
                path,
                n_layer=2,
                n_embd=8192,
                n_head=64,
                n_head_kv=8,
                n_ff=24576,
                n_vocab=256000,
                dtype="f16",
                sparse=True,
            )
        case "starcoder2":  # StarCoder2-15B
            return t.write_starcoder2(
                path,
                n_layer=2,
                n_embd=6144,
                n_head=48,
                n_head_kv=4,
                n_ff=24576,
                n_vocab=49152,
                dtype="f16",
                sparse=True,
            )
        # smaller released widths of each family, flash attention off and per-slot streams among their cases
        case "ministral3-8b":  # Ministral-3-8B: YaRN and the attention temperature (Q scaled per token)
            return t.write_mistral3(
                path,
                n_layer=2,
                n_embd=4096,
                n_head=32,
                n_head_kv=8,
                head_dim=128,
                n_ff=14336,
                n_vocab=131072,
                dtype="f16",
                yarn=True,
                sparse=True,
            )
        case "gemma-2b":  # Gemma-2B: one KV head of 256
            return t.write_gemma(
                path,
                n_layer=2,
                n_embd=2048,
                n_head=8,
                n_head_kv=1,
                head_dim=256,
                n_ff=16384,
                n_vocab=256000,
                dtype="f16",
                sparse=True,
            )
        case "granite-2b":  # Granite-3.3-2B
            return t.write_granite(
                path,
                n_layer=2,
                n_embd=2048,
                n_head=32,
                n_head_kv=8,
                n_ff=8192,
                n_vocab=49159,
                dtype="f16",
                sparse=True,
            )
        case "command-r-v01":  # Command-R v01 (35B): no GQA
            return t.write_command_r(
                path,
                n_layer=2,
                n_embd=8192,
                n_head=64,
                n_head_kv=64,
                n_ff=22528,
                n_vocab=256000,
                dtype="f16",
                sparse=True,
            )
        case "starcoder2-3b":  # StarCoder2-3B
            return t.write_starcoder2(
                path,
                n_layer=2,
                n_embd=3072,
                n_head=24,
                n_head_kv=2,
                n_ff=12288,
                n_vocab=49152,
                dtype="f16",
                sparse=True,
            )
    raise ValueError(name)


#: The bound at released widths (the compute model's hold-out figure on `benchmarks/compute_shapes.py`);
#: the tiny shapes keep `MEASURED_ERROR_RATIO`.
REALISTIC_COMPUTE_ERROR = 0.10
REALISTIC = ("mistral3", "gemma", "granite", "command-r", "starcoder2")
SMALLER = ("ministral3-8b", "gemma-2b", "granite-2b", "command-r-v01", "starcoder2-3b")
REALISTIC_CASES = [
    *(Case(name, 8192, _s(slots=slots, kv_unified=True)) for name in REALISTIC for slots in (1, 4, 16)),
    *(Case(name, 8192, _s(slots=16, kv_unified=True)) for name in SMALLER),
    *(Case(name, 8192, _s(slots=2, flash_attn="off")) for name in SMALLER),
]


@pytest.fixture(scope="module")
def realistic_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models-dense-released")
    return {name: _realistic(name, d / f"{name}.gguf") for name in REALISTIC + SMALLER}


@pytest.mark.parametrize("case", REALISTIC_CASES, ids=[c.id for c in REALISTIC_CASES])
@pytest.mark.timeout(360)  # beyond its server's own deadline (300 s)
def test_released_widths_compute_buffer_within_the_stated_bound(
    case: Case, realistic_models: dict[str, Path], binary: str, record_property: Callable[[str, object], None]
) -> None:
    path = realistic_models[case.model]
    geometry = _geometry(path)
    run = run_server(path, server_args(case.settings, case.n_ctx), binary=binary, deadline=300)
    assert run.healthy, run.log[-3000:]
    log = parse_allocation_log(run.log)
    _assert_context(log, geometry, case.settings, case.n_ctx)
    assert _assert_caches(log, geometry, case.settings, case.n_ctx) >= 1
    breakdown = estimate(geometry, case.settings, case.n_ctx, cpu_features=node_features())
    assert log.model_buffers == printed_model_buffers(breakdown)
    measured = float(sum((sum(c.compute_buffers.values(), Decimal(0)) for c in log.contexts), Decimal(0)))
    error = (breakdown.compute_bytes / MIB - measured) / measured
    record_property("compute_server_mib", f"{measured:.2f}")
    record_property("compute_model_mib", f"{breakdown.compute_bytes / MIB:.2f}")
    record_property("compute_error", f"{error:+.2%}")
    assert abs(error) <= REALISTIC_COMPUTE_ERROR, f"compute {measured:.2f} MiB: off by {error:+.1%}"


#: command-r's parallel block reserves no row beyond a sequential block's: its compute is exact to the
#: printed figure at every width measured, so a bound this tight catches the extra row (+6-7% at 32B widths)
COMMAND_R_COMPUTE_ERROR = 0.01


@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.timeout(360)  # beyond its server's own deadline (300 s)
def test_command_r_parallel_block_reserves_no_extra_row(
    slots: int, realistic_models: dict[str, Path], binary: str
) -> None:
    path = realistic_models["command-r"]
    settings = _s(slots=slots, kv_unified=True)
    run = run_server(path, server_args(settings, 8192), binary=binary, deadline=300)
    assert run.healthy, run.log[-3000:]
    log = parse_allocation_log(run.log)
    measured = float(sum((sum(c.compute_buffers.values(), Decimal(0)) for c in log.contexts), Decimal(0)))
    error = (estimate(_geometry(path), settings, 8192).compute_bytes / MIB - measured) / measured
    assert abs(error) <= COMMAND_R_COMPUTE_ERROR, f"compute {measured:.2f} MiB: off by {error:+.1%}"
