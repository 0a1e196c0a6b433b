"""The memory model of a split over llama.cpp's RPC backend: devices, layers, weights, caches, refusals.

The byte-exact checks against real `ggml-rpc-server` members are in `tests/e2e/test_memory_exact_rpc.py`.
"""

from __future__ import annotations

import pytest

from actors.placement.memory import Budgets, MemoryModelError, estimate, max_context
from tests.harness.memory_model import MIB, gemma3, llama, qwen35_9b, serving


def test_rpc_devices_come_before_the_gpus_and_take_the_offloaded_layers_in_order() -> None:
    g = llama(8)
    b = estimate(g, serving(slots=1), 4096, n_gpu_layers=6, gpu_split=(1.0, 1.0), rpc_devices=2)
    layers = {d.device: d.layers for d in b.devices}
    # -ngl 6 of 9 "layers" (8 blocks and the output): blocks 3-7 and the output offloaded, split 3/3
    assert layers == {"CPU": (0, 3), "RPC0": (3, 6), "RPC1": (6, 8)}
    with_gpu = estimate(g, serving(slots=1), 4096, n_gpu_layers=6, gpu_split=(1.0, 1.0, 1.0), rpc_devices=2)
    assert [d.device for d in with_gpu.devices] == ["CPU", "RPC0", "RPC1", "GPU0"]


def test_each_device_holds_the_kv_of_its_own_layers() -> None:
    g = gemma3()
    alone = estimate(g, serving(slots=2), 8192)
    split = estimate(g, serving(slots=2), 8192, n_gpu_layers=4, gpu_split=(1.0, 1.0), rpc_devices=2)
    assert split.kv_bytes == alone.kv_bytes
    assert sum(d.kv_bytes for d in split.devices) == alone.kv_bytes  # every tensor here is a multiple of 32 B
    assert all(d.kv_bytes > 0 for d in split.devices)


def test_the_host_keeps_the_token_embeddings_and_a_member_the_output() -> None:
    g = llama(4)
    b = estimate(g, serving(slots=1), 4096, n_gpu_layers=2, gpu_split=(1.0,), rpc_devices=1)
    host, member = b.devices
    assert host.weights_bytes == g.input_tensor_bytes + sum(layer.tensor_bytes for layer in g.layers[:3])
    assert member.weights_bytes == g.layers[3].padded_bytes + g.output_padded_bytes
    assert host.output_bytes > 0 and member.output_bytes == 0  # the logits are read on the host
    assert host.host_extra_bytes == b.host_extra_bytes and member.host_extra_bytes == 0


def test_every_device_with_layers_has_a_compute_buffer_and_its_margin() -> None:
    b = estimate(llama(6), serving(slots=1), 4096, n_gpu_layers=5, gpu_split=(1.0, 1.0), rpc_devices=2)
    for device in b.devices:
        assert device.compute_bytes > 0
        assert device.compute_margin_bytes == -(-device.compute_bytes // 4)


@pytest.mark.parametrize("ngl", [0, 5, -1])
def test_a_split_keeps_at_least_the_first_block_on_the_host(ngl: int) -> None:
    """With every layer offloaded llama.cpp turns on pipeline parallelism, whose graph copies are not modelled."""
    with pytest.raises(MemoryModelError, match="host keeps its first block"):
        estimate(llama(4), serving(slots=1), 4096, n_gpu_layers=ngl, gpu_split=(1.0,), rpc_devices=1)


def test_a_split_is_not_sized_with_an_mtp_context() -> None:
    with pytest.raises(MemoryModelError, match="not sized with a draft"):
        estimate(
            qwen35_9b(), serving(slots=1, spec_type="draft-mtp"), 4096, n_gpu_layers=8, gpu_split=(1.0,), rpc_devices=1
        )


def test_member_budgets_bound_the_context() -> None:
    g = llama(4, embedding_length=1024, feed_forward_length=2048)
    settings = serving(slots=1)
    small = Budgets(host=1 << 40, rpc=(64 * MIB,))
    large = Budgets(host=1 << 40, rpc=(1 << 40,))
    tight = max_context(g, settings, small, n_gpu_layers=3, gpu_split=(1.0,), rpc_devices=1)
    roomy = max_context(g, settings, large, n_gpu_layers=3, gpu_split=(1.0,), rpc_devices=1)
    assert tight is not None and roomy is not None and tight < roomy
    b = estimate(g, settings, tight, budgets=small, n_gpu_layers=3, gpu_split=(1.0,), rpc_devices=1)
    assert b.fits and b.max_context == tight
    member = next(d for d in b.devices if d.device == "RPC0")
    assert member.budget_bytes == 64 * MIB and member.fits
