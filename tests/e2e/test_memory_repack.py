"""The CPU backend's repacked weights against the real llama-server (CPU build, this machine's CPU).

llama.cpp's CPU backend copies every quantized weight a matrix multiplication reads into a `CPU_REPACK`
buffer when its type has an interleaved kernel for the CPU's features and its row count suits that kernel
(`ggml_repack_get_optimal_repack_type`); the mapped file stays mapped beside it. Each case writes a tiny
llama whose weights mix the quantized types (Q4_0, Q8_0 and MXFP4 quantized by gguf's own functions; Q4_K,
Q2_K, Q6_K and IQ4_NL as zero blocks, which gguf cannot quantize and which load as zeros), starts the server
and checks, with the CPU features this node's telemetry advertises:

* the `CPU_REPACK` model buffer prints exactly as the predicted repack bytes (every repacked tensor here is
  larger than the 0.01 MiB print step, so one tensor more or less would print differently) and the mapped
  buffer as the declared tensor bytes;
* the observed footprint recovers both exactly, and the breakdown counts the copy in the host total;
* with the features unknown the estimate is an upper bound.

Only the x86 rules (AVX2, AVX512) can be checked on this machine; the Arm and s390x rows of
`actors.placement.weights.REPACK_RULES` are read from the same function of the llama.cpp source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from actors.placement.caches import cache_allocations
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from actors.runner.allocation_log import parse_allocation_log, printed_mib
from actors.runner.observed import observed_memory
from messages.settings import ServingSettings
from tests.harness.memory_exact import allocated, node_features, printed_model_buffers
from tests.harness.quantized import write_quantized_llama
from tests.llama_harness import require_server, run_server, server_args

pytestmark = pytest.mark.e2e

ROLES = ("embd", "output", "q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class Case:
    id: str
    n_ff: int
    n_vocab: int
    types: dict[str, str]
    tied: bool = False


CASES = [
    # every x86-repackable type (q4_0, q4_k, iq4_nl, mxfp4; q2_k with AVX512) beside Arm-only ones (q6_k, q8_0)
    Case(
        "all-types",
        n_ff=1280,
        n_vocab=1000,
        types={
            "embd": "q4_k",  # read by get_rows: never repacked
            "output": "q6_k",
            "q": "q4_0",
            "k": "iq4_nl",
            "v": "q8_0",
            "o": "q2_k",
            "gate": "q4_k",
            "up": "mxfp4",
            "down": "q6_k",
        },
    ),
    # tied embeddings: llama.cpp duplicates token_embd as the output matrix, and repacks that copy
    Case(
        "tied-q4_0",
        n_ff=1536,
        n_vocab=1000,
        tied=True,
        types={"embd": "q4_0", "q": "q4_k", "k": "q4_0", "v": "q4_0", "o": "q4_k", "gate": "iq4_nl", "up": "q4_0"},
    ),
    # row counts that are not a multiple of 8 (n_ff 1028, n_vocab 1004) are left in the mapped file
    Case(
        "rows-not-multiple-of-8",
        n_ff=1028,
        n_vocab=1004,
        types={"embd": "q8_0", "output": "q4_0", "q": "q4_0", "k": "q4_0", "v": "q4_0", "o": "q4_0", "gate": "q4_0"},
    ),
    # a Q4_K_M-like mix: attention and FFN Q4_K, V and down Q6_K, output Q6_K
    Case(
        "q4_k_m-mix",
        n_ff=1536,
        n_vocab=2048,
        types={
            "embd": "q4_k",
            "output": "q6_k",
            "q": "q4_k",
            "k": "q4_k",
            "v": "q6_k",
            "o": "q4_k",
            "gate": "q4_k",
            "up": "q4_k",
            "down": "q6_k",
        },
    ),
]


@pytest.fixture(scope="module")
def binary() -> str:
    return require_server()


@pytest.fixture(scope="module", name="node_features")
def readable_node_features() -> tuple[str, ...]:
    features = node_features()
    if features is None:
        pytest.skip("this machine's CPU flags are not readable")
    return features


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cpu_repack_buffer_is_predicted_from_the_advertised_cpu_features(
    case: Case, binary: str, node_features: tuple[str, ...], tmp_path: Path
) -> None:
    path = write_quantized_llama(
        tmp_path / f"{case.id}.gguf", n_layer=3, n_embd=512, n_ff=case.n_ff, n_vocab=case.n_vocab,
        types=case.types, tied=case.tied,
    )  # fmt: skip
    geometry = geometry_from_header(read_header(path))
    settings = msgspec.convert({"slots": 1, "cache_ram_mib": 0}, ServingSettings)
    breakdown = estimate(geometry, settings, 512, cpu_features=node_features)
    run = run_server(path, server_args(settings, 512), binary=binary)
    assert allocated(run), run.log[-3000:]
    log = parse_allocation_log(run.log)

    # the features telemetry derives from the kernel's CPU flags are the ones this build reports
    assert log.cpu_features is not None
    assert set(node_features) <= log.cpu_features
    assert breakdown.repack_bytes + breakdown.amx_bytes > 0
    assert log.model_buffers == printed_model_buffers(breakdown)
    host = breakdown.devices[0]
    assert (host.repack_bytes, host.amx_bytes) == (breakdown.repack_bytes, breakdown.amx_bytes)
    assert host.total_bytes >= host.weights_bytes + host.repack_bytes + host.amx_bytes + host.compute_bytes

    observation = observed_memory(log, breakdown, cache_allocations(geometry, settings, 512))
    assert "weights_bytes" in observation.exact
    assert observation.memory.weights_bytes == breakdown.weights_bytes + breakdown.repack_bytes + breakdown.amx_bytes

    unknown = estimate(geometry, settings, 512)  # features not advertised: every copy taken, the span whole
    assert unknown.total_bytes >= breakdown.total_bytes


def test_no_repack_buffer_for_a_float_model(binary: str, node_features: tuple[str, ...], tmp_path: Path) -> None:
    path = write_quantized_llama(tmp_path / "f32.gguf", n_layer=2, n_embd=256, n_ff=512, n_vocab=1000, types={})
    geometry = geometry_from_header(read_header(path))
    settings = msgspec.convert({"slots": 1, "cache_ram_mib": 0}, ServingSettings)
    breakdown = estimate(geometry, settings, 512)
    run = run_server(path, server_args(settings, 512), binary=binary)
    assert run.healthy, run.log[-3000:]
    assert parse_allocation_log(run.log).model_buffers == {"CPU_Mapped": printed_mib(breakdown.weights_bytes)}
    assert breakdown.repack_bytes == 0
