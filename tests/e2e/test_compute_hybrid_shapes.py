"""Compute buffers of realistic hybrid widths (issue 27), alone and split over `ggml-rpc-server` members.

The shapes are issue 27's Nemotron-H (n_embd 2048, Mamba-2 inner 10240, 40 heads x 128) and Qwen3.5 (n_embd
2048, heads of 256, a 16/32-head delta net, 248320 tokens) with fewer blocks than released (the buffer depends
on one period of blocks, the context and the slots), written as sparse files. Alone, llama-server's
`sched_reserve` figure must be within the issue's 10% and never under (compute-10 places these graphs: the
benchmark `benchmarks/compute_shapes.py` runs the released block counts). Split over one loopback member, each
device's compute buffer (the member's exact allocation from `GGML_RPC_DEBUG`, the head's printed figure) must
be within the stated bound (`compute.MEASURED_ERROR_RATIO`), as the split of issue 18 promises, and within
the issue's 10% as the unsplit graph is (compute-10 places a Qwen3.5 member's blocks from the hidden state it
receives, with copies of its own blocks' masks).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.placement.compute import MEASURED_ERROR_RATIO
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from actors.runner.allocation_log import parse_allocation_log
from messages.settings import ServingSettings
from tests import tiny_models
from tests.llama_harness import require_server, run_server, server_args
from tests.rpc_harness import require_rpc_server, rpc_servers

pytestmark = pytest.mark.e2e

MIB = 1 << 20
#: The first 16 blocks of issue 27's 56-block Nemotron-H pattern: Mamba-2 blocks, MLPs and one attention block.
NEMOTRON_H_HEAD = "M-M-M-MM-M-M-M*-"


def _nemotron_h(path: Path) -> Path:
    return tiny_models.write_nemotron_h(
        path, layers=NEMOTRON_H_HEAD, n_embd=2048, n_head=40, n_head_kv=8, head_dim=128, n_ff=4096,
        n_vocab=131072, inner=10240, state_size=128, group_count=8, dt_rank=128,
    )  # fmt: skip


def _qwen35(path: Path) -> Path:
    return tiny_models.write_qwen35(
        path, n_layer=8, n_nextn=1, n_embd=2048, n_head=16, n_head_kv=4, head_dim=256, n_ff=6144, n_vocab=248320,
        state_size=128, group_count=16, dt_rank=32, dtype="f16", rope_sections=(11, 11, 10, 0),
    )  # fmt: skip


WRITERS: dict[str, Callable[[Path], Path]] = {"nemotron_h": _nemotron_h, "qwen35": _qwen35}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hybrid-shapes")
    with tiny_models.sparse_files():
        return {name: write(d / f"{name}.gguf") for name, write in WRITERS.items()}


def _s(**kw: Any) -> ServingSettings:
    return msgspec.convert({"cache_ram_mib": 0, "ctx_checkpoints": 0, **kw}, ServingSettings)


ALONE = [
    ("nemotron_h", 8192, _s(slots=1, kv_unified=True)),
    ("nemotron_h", 32768, _s(slots=4, kv_unified=False, cache_type_k="q8_0", cache_type_v="q8_0")),
    ("qwen35", 8192, _s(slots=1, kv_unified=True)),
    ("qwen35", 8192, _s(slots=4, kv_unified=True, spec_type="draft-mtp", spec_draft_n_max=3)),
]


@pytest.mark.parametrize(
    ("model", "n_ctx", "settings"), ALONE, ids=[f"{m}-c{c}-np{s.slots}-{s.spec_type}" for m, c, s in ALONE]
)
def test_hybrid_compute_is_within_ten_percent_and_never_under(
    model: str, n_ctx: int, settings: ServingSettings, models: dict[str, Path]
) -> None:
    binary = require_server()
    path = models[model]
    predicted = estimate(geometry_from_header(read_header(path)), settings, n_ctx).compute_bytes
    run = run_server(path, server_args(settings, n_ctx), binary=binary)
    assert run.healthy, run.log[-3000:]
    log = parse_allocation_log(run.log)
    server = sum(sum(c.compute_buffers.values()) for c in log.contexts) * MIB
    error = predicted / float(server) - 1
    assert -0.01 <= error <= 0.10, f"model {predicted / MIB:.2f} MiB vs server {float(server) / MIB:.2f} ({error:+.1%})"


SPLITS = [
    # the member takes the last blocks: for Nemotron-H two Mamba-2 blocks, MLPs and the attention block
    ("nemotron_h", 5, 8192, _s(slots=1, kv_unified=True)),
    ("qwen35", 4, 8192, _s(slots=4, kv_unified=True)),
]


@pytest.mark.parametrize(
    ("model", "n_gpu_layers", "n_ctx", "settings"), SPLITS, ids=[f"{m}-ngl{n}-np{s.slots}" for m, n, _, s in SPLITS]
)
@pytest.mark.timeout(360)  # beyond its server's own deadline (300 s)
def test_a_hybrid_split_over_loopback_holds_each_devices_compute_buffer(
    model: str, n_gpu_layers: int, n_ctx: int, settings: ServingSettings, models: dict[str, Path]
) -> None:
    binary = require_server()
    require_rpc_server()
    path = models[model]
    geometry = geometry_from_header(read_header(path))
    breakdown = estimate(geometry, settings, n_ctx, n_gpu_layers=n_gpu_layers, gpu_split=(1.0,), rpc_devices=1)
    devices = {d.device: d for d in breakdown.devices}
    with rpc_servers(1) as members:
        extra = ["--rpc", members[0].endpoint, "-ngl", str(n_gpu_layers), "-ts", "1"]
        run = run_server(path, server_args(settings, n_ctx, extra=extra), binary=binary, deadline=300)
        allocated = members[0].allocations()
    assert run.healthy, run.log[-3000:]
    target = parse_allocation_log(run.log).target
    assert target is not None
    errors = {
        "RPC0": devices["RPC0"].compute_bytes / allocated[-1] - 1,
        "CPU": devices["CPU"].compute_bytes / (float(target.compute_buffers["CPU"]) * MIB) - 1,
    }
    worst = max(errors.items(), key=lambda item: abs(item[1]))
    assert abs(worst[1]) <= MEASURED_ERROR_RATIO, f"compute of {worst[0]} off by {worst[1]:+.1%}: {errors}"
    assert abs(worst[1]) <= 0.10, f"compute of {worst[0]} off by {worst[1]:+.1%}: {errors}"
