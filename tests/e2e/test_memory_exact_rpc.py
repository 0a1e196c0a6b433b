"""The memory model of a split over llama.cpp's RPC backend, against real `ggml-rpc-server` members.

Each case starts one `ggml-rpc-server` per member on loopback (`tests/rpc_harness.py`; `GGML_RPC_DEBUG=1`, so
each logs the exact byte size of every buffer it allocates) and llama-server with `--rpc` to them, `-ngl` and
`-ts` pinned, and compares, per device:

* each member's model buffer and cache buffers (KV, a sliding-window model's SWA cache, recurrent state) with
  the predicted `weights_bytes` and `kv_bytes + recurrent_bytes` of its `RPC<i>` device, **byte for byte**
  (the member's own allocation lines), and with what llama-server prints for `RPC<i>[host:port]`;
* the head's repacked and cache buffers as printed (the host keeps the token embeddings and its own blocks; a
  tied output matrix is copied to the output layer's member as well). Its mapped buffer is the file range from
  its first to its last tensor, which may enclose tensors a member holds (the output matrix sits between the
  embeddings and the first block in these files): pages of the file, read once to send them and then
  reclaimable, so the breakdown counts the host's own tensors, and the test checks the range;
* the layer assignment (which blocks' caches each device holds, and where the output matrix went);
* every device's compute buffer within the stated error (`compute.MEASURED_ERROR_RATIO`).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import msgspec
import pytest

from actors.placement.compute import MEASURED_ERROR_RATIO
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from actors.runner.allocation_log import parse_allocation_log, printed_mib, remote_devices
from messages.memory import DeviceMemory
from messages.settings import ServingSettings
from tests import tiny_models
from tests.harness.memory_exact import allocated, node_features
from tests.harness.quantized import write_quantized_llama
from tests.llama_harness import require_server, run_server, server_args
from tests.rpc_harness import require_rpc_server, rpc_servers

pytestmark = pytest.mark.e2e

MIB = 1 << 20


@pytest.fixture(scope="module")
def binary() -> str:
    require_rpc_server()
    return require_server()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("rpc-models")
    hybrid = d / "hybrid"
    hybrid.mkdir()
    return {
        "llama": tiny_models.write_llama(
            d / "llama.gguf", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=8000
        ),
        "llama_tied": tiny_models.write_llama(
            d / "llama_tied.gguf", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=8000, tied=True
        ),
        "llama_wide_ff": tiny_models.write_llama(
            d / "llama_wide_ff.gguf", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=1024, n_vocab=4000
        ),
        "gemma3": tiny_models.write_gemma3(
            d / "gemma3.gguf", n_layer=6, n_embd=128, n_head=4, n_head_kv=2, head_dim=64, n_swa=256, swa_pattern=3
        ),
        **{k: v for k, v in tiny_models.write_hybrid_set(hybrid, n_vocab=8000, llama_layers=4).items() if k != "llama"},
    }


@dataclass(frozen=True)
class Case:
    model: str
    members: int
    n_gpu_layers: int
    split: tuple[float, ...]
    n_ctx: int
    settings: ServingSettings

    @property
    def id(self) -> str:
        s = self.settings
        split = "ts" + "-".join(f"{w:g}" for w in self.split)
        parts = [self.model, f"m{self.members}", f"ngl{self.n_gpu_layers}", split]
        parts += [f"c{self.n_ctx}", f"np{s.slots}", "kvu" if s.kv_unified else "streams", f"fa-{s.flash_attn}"]
        return "_".join(parts)


def _s(**kw: object) -> ServingSettings:
    return msgspec.convert({"cache_ram_mib": 0, **kw}, ServingSettings)


CASES = [
    # dense: one member taking the tail (output layer with it), two and three members, uneven splits
    Case("llama", 1, 3, (1,), 4096, _s(slots=1)),
    Case("llama", 1, 6, (1,), 4096, _s(slots=4)),
    Case("llama", 2, 6, (1, 1), 4096, _s(slots=1)),
    Case("llama", 2, 4, (1, 3), 4096, _s(slots=2)),  # the first member holds a single block
    Case("llama", 3, 6, (1, 1, 1), 4096, _s(slots=1)),
    Case("llama", 2, 5, (2, 3), 8192, _s(slots=4, kv_unified=True, flash_attn="off")),
    Case("llama_tied", 2, 6, (1, 1), 4096, _s(slots=1)),  # the tied output matrix copied to the last member
    Case("llama_wide_ff", 2, 4, (1, 1), 4096, _s(slots=1)),
    Case("llama_wide_ff", 3, 4, (1, 1, 2), 4096, _s(slots=1)),  # one block on each member
    # sliding window: each member holds a non-SWA and a SWA cache for its layers
    Case("gemma3", 1, 3, (1,), 8192, _s(slots=1)),
    Case("gemma3", 2, 6, (1, 1), 8192, _s(slots=1)),
    Case("gemma3", 2, 5, (1, 1), 8192, _s(slots=4)),
    Case("gemma3", 1, 4, (1,), 8192, _s(slots=2, flash_attn="off")),
    # hybrid: KV and recurrent state where each layer lives
    Case("qwen35", 1, 4, (1,), 8192, _s(slots=1)),
    Case("qwen35", 1, 5, (1,), 8192, _s(slots=4)),
    Case("granitehybrid", 1, 3, (1,), 8192, _s(slots=1)),
    Case("granitehybrid", 2, 5, (1, 1), 8192, _s(slots=1)),
    Case("granitehybrid", 2, 5, (1, 1), 8192, _s(slots=4)),
]


def _mapped_range(path: Path, devices: tuple[DeviceMemory, ...]) -> int:
    """The file range the head maps: from its first to its last tensor (the embeddings and its own blocks)."""
    header = read_header(path)
    (host,) = [d for d in devices if d.device == "CPU"]
    assert host.layers is not None
    first, last = host.layers
    mine = [
        t
        for t in header.tensors
        if t.name.startswith("token_embd.") or any(t.name.startswith(f"blk.{il}.") for il in range(first, last))
    ]
    return max(t.offset + t.n_bytes for t in mine) - min(t.offset for t in mine)


def _error(predicted: int, printed: Decimal) -> float:
    return (predicted / MIB - float(printed)) / float(printed)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_each_member_allocates_what_the_split_predicts(case: Case, models: dict[str, Path], binary: str) -> None:
    path = models[case.model]
    geometry = geometry_from_header(read_header(path))
    breakdown = estimate(
        geometry, case.settings, case.n_ctx, n_gpu_layers=case.n_gpu_layers, gpu_split=case.split,
        rpc_devices=case.members, cpu_features=node_features(),
    )  # fmt: skip
    with rpc_servers(case.members) as members:
        endpoints = [m.endpoint for m in members]
        extra = ["--rpc", ",".join(endpoints), "-ngl", str(case.n_gpu_layers)]
        extra += ["-ts", ",".join(f"{w:g}" for w in case.split)]
        run = run_server(path, server_args(case.settings, case.n_ctx, extra=extra), binary=binary)
        allocations = [m.allocations() for m in members]
    assert run.healthy, run.log[-3000:]
    log = parse_allocation_log(run.log)
    remote = {r.endpoint: r for r in remote_devices(log).values()}
    devices = {d.device: d for d in breakdown.devices}
    errors: dict[str, float] = {}
    for i, (endpoint, own) in enumerate(zip(endpoints, allocations, strict=True)):
        predicted = devices.get(f"RPC{i}")
        printed = remote.get(endpoint)
        if predicted is None:  # a member the split gives nothing (never planned, but llama.cpp allows it)
            assert printed is None or printed.model_mib == 0
            continue
        assert printed is not None, f"nothing printed for member {endpoint}"
        caches = predicted.kv_bytes + predicted.recurrent_bytes
        n_caches = len(printed.cache_mib)
        # the member's own lines: model, one buffer per cache, then the compute buffer (the last reservation)
        assert own[0] == predicted.weights_bytes, f"RPC{i} model buffer {own[0]}"
        assert sum(own[1 : 1 + n_caches]) == caches, f"RPC{i} cache buffers {own[1 : 1 + n_caches]}"
        assert printed.model_mib == printed_mib(predicted.weights_bytes)
        assert (n_caches == 0) == (caches == 0)
        assert printed.compute_mib is not None
        assert own[-1] == max(own[1 + n_caches :])  # a compute buffer that grew is own again
        errors[f"RPC{i}"] = (predicted.compute_bytes - own[-1]) / own[-1]
    # the head: the token embeddings and its own blocks mapped (repacked as a host alone would), its caches
    host = devices["CPU"]
    assert log.model_buffers.get("CPU_Mapped") == printed_mib(_mapped_range(path, breakdown.devices))
    assert log.model_buffers.get("CPU_REPACK", Decimal(0)) == printed_mib(host.repack_bytes)
    assert log.model_buffers.get("AMX", Decimal(0)) == printed_mib(host.amx_bytes)
    target = log.target
    assert target is not None
    lines = [line.buffers for line in target.kv] + [line.buffers for line in target.recurrent]
    host_caches = [mib for buffers in lines for name, mib in buffers if name == "CPU"]
    assert (sum(host_caches, Decimal(0)) == 0) == (host.kv_bytes + host.recurrent_bytes == 0)
    errors["CPU"] = _error(host.compute_bytes, target.compute_buffers["CPU"])
    worst = max(errors.items(), key=lambda item: abs(item[1]))
    assert abs(worst[1]) <= MEASURED_ERROR_RATIO, f"compute of {worst[0]} off by {worst[1]:+.1%}: {errors}"


def test_the_tied_output_matrix_is_held_twice_by_a_split(models: dict[str, Path]) -> None:
    """The token embeddings stay on the head and the tied output matrix goes with the last layer to a member."""
    geometry = geometry_from_header(read_header(models["llama_tied"]))
    settings = _s(slots=1)
    split = estimate(geometry, settings, 4096, n_gpu_layers=3, gpu_split=(1.0,), rpc_devices=1)
    alone = estimate(geometry, settings, 4096)
    member = next(d for d in split.devices if d.device == "RPC0")
    assert split.weights_bytes == alone.weights_bytes + geometry.token_embd_bytes
    assert member.layers == (4, 6)
    assert member.weights_bytes >= geometry.token_embd_bytes


def test_the_head_repacks_its_own_quantized_blocks_and_no_member_does(binary: str, tmp_path: Path) -> None:
    """RPC devices have no host buffer type, so the head's CPU backend repacks the blocks it keeps as a host alone
    would; a member's server copies its tensors as they are (its model buffer is the padded tensor bytes)."""
    path = write_quantized_llama(
        tmp_path / "q4.gguf", n_layer=4, n_embd=256, n_ff=512, n_vocab=2000,
        types={role: "q4_0" for role in ("q", "k", "v", "o", "gate", "up", "down")},
    )  # fmt: skip
    geometry = geometry_from_header(read_header(path))
    settings = _s(slots=1)
    breakdown = estimate(
        geometry, settings, 2048, n_gpu_layers=3, gpu_split=(1.0,), rpc_devices=1, cpu_features=node_features()
    )
    devices = {d.device: d for d in breakdown.devices}
    with rpc_servers(1) as members:
        extra = ["--rpc", members[0].endpoint, "-ngl", "3", "-ts", "1"]
        run = run_server(path, server_args(settings, 2048, extra=extra), binary=binary)
        allocations = members[0].allocations()
    assert allocated(run), run.log[-3000:]
    log = parse_allocation_log(run.log)
    assert devices["CPU"].layers == (0, 2) and devices["RPC0"].layers == (2, 4)
    host = devices["CPU"]
    assert host.repack_bytes + host.amx_bytes > 0  # repacked, or on a CPU with AMX taken by its kernels
    assert log.model_buffers.get("CPU_REPACK", Decimal(0)) == printed_mib(host.repack_bytes)
    assert log.model_buffers.get("AMX", Decimal(0)) == printed_mib(host.amx_bytes)
    assert allocations[0] == devices["RPC0"].weights_bytes
