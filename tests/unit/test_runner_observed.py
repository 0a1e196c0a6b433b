"""Observed memory from the allocation log: exact bytes where the printed lines allow, MiB otherwise."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from decimal import Decimal

import msgspec
import pytest

from actors.placement.memory import CacheAllocation, cache_allocations, estimate
from actors.runner.allocation_log import parse_allocation_log, printed_mib, printed_mib_f32
from actors.runner.observed import mib_to_bytes, observed_memory
from messages.memory import MemoryBreakdown
from tests.harness.memory_model import llama, qwen35_9b, serving

MIB = 1 << 20
QWEN = qwen35_9b()
MTP = serving(slots=4, spec_type="draft-mtp", spec_draft_n_max=3)
CTX = 16384


def _kv_line(a: CacheAllocation) -> str:
    size = printed_mib_f32(a.a_bytes + a.b_bytes)
    return (
        f"0.00.001.000 I llama_kv_cache:        CPU KV buffer size = {printed_mib(a.a_bytes + a.b_bytes):8.2f} MiB\n"
        f"0.00.001.001 I llama_kv_cache: size = {size:8.2f} MiB ({a.cells:6d} cells, {a.layers:3d} layers, "
        f"{a.seqs:2d}/{a.streams} seqs), K ({a.type_a}): {printed_mib_f32(a.a_bytes):8.2f} MiB, "
        f"V ({a.type_b}): {printed_mib_f32(a.b_bytes):8.2f} MiB"
    )


def _rs_line(a: CacheAllocation) -> str:
    size = printed_mib_f32(a.a_bytes + a.b_bytes)
    return (
        f"0.00.001.002 I llama_memory_recurrent: size = {size:8.2f} MiB ({a.cells:6d} cells, {a.layers:3d} layers, "
        f"{a.seqs:2d} seqs {a.rs_seq:2d} rs_seq), R (f32): {printed_mib_f32(a.a_bytes):8.2f} MiB, "
        f"S (f32): {printed_mib_f32(a.b_bytes):8.2f} MiB, P (f32):     0.00 MiB"
    )


def _log(
    predicted: MemoryBreakdown,
    allocations: Sequence[CacheAllocation],
    *,
    weights: dict[str, int] | None = None,
    compute: tuple[str, ...] = ("3.65",),
    output: str | None = None,
) -> str:
    """The allocation lines a server prints for these allocations, one context after the other."""
    lines = [
        f"load_tensors: {name} model buffer size = {printed_mib(n):8.2f} MiB"
        for name, n in (weights or {"CPU_Mapped": predicted.weights_bytes}).items()
    ]
    contexts = sorted({a.context for a in allocations}, key=["target", "draft"].index)
    if output is None:  # what the server prints for the predicted logits buffer of each context
        per_context = predicted.output_bytes // (2 if any(a.context == "draft" for a in allocations) else 1)
        output = f"{printed_mib(per_context):8.2f}"
    for i, context in enumerate(contexts):
        lines.append("llama_context: constructing llama_context")
        lines.append(f"llama_context:        CPU  output buffer size = {output} MiB")
        for a in allocations:
            if a.context == context:
                lines.append(_rs_line(a) if a.kind == "recurrent" else _kv_line(a))
        lines.append(f"sched_reserve:        CPU compute buffer size = {compute[min(i, len(compute) - 1)]} MiB")
    return "\n".join(lines)


def test_cache_lines_printing_the_predicted_bytes_recover_them_exactly() -> None:
    predicted = estimate(QWEN, MTP, CTX)
    allocations = cache_allocations(QWEN, MTP, CTX)
    observation = observed_memory(parse_allocation_log(_log(predicted, allocations)), predicted, allocations)
    memory = observation.memory
    assert (memory.kv_bytes, memory.recurrent_bytes, memory.draft_kv_bytes, memory.weights_bytes) == (
        predicted.kv_bytes,
        predicted.recurrent_bytes,
        predicted.draft_kv_bytes,
        predicted.weights_bytes,
    )
    assert memory.output_bytes == predicted.output_bytes
    assert observation.exact == {"kv_bytes", "recurrent_bytes", "draft_kv_bytes", "weights_bytes", "output_bytes"}


def test_a_cache_that_prints_other_bytes_than_predicted_falls_back_to_the_printed_mib() -> None:
    predicted = estimate(QWEN, MTP, CTX)
    allocations = cache_allocations(QWEN, MTP, CTX)
    # the server allocated one more 256-byte row per cell than the model says: a different printed figure
    logged = [
        dataclasses.replace(a, a_bytes=a.a_bytes + 256 * a.cells * a.streams) if a.kind == "kv" else a
        for a in allocations
    ]
    (target_kv,) = [a for a in logged if a.kind == "kv" and a.context == "target"]
    observation = observed_memory(parse_allocation_log(_log(predicted, logged)), predicted, allocations)
    assert observation.memory.kv_bytes == mib_to_bytes(printed_mib_f32(target_kv.a_bytes + target_kv.b_bytes))
    assert observation.memory.kv_bytes != predicted.kv_bytes
    assert "kv_bytes" not in observation.exact and "draft_kv_bytes" not in observation.exact
    assert observation.memory.recurrent_bytes == predicted.recurrent_bytes


def test_equal_megabytes_with_other_cell_counts_are_not_taken_for_the_prediction() -> None:
    predicted = estimate(QWEN, MTP, CTX)
    allocations = cache_allocations(QWEN, MTP, CTX)
    logged = [dataclasses.replace(a, rs_seq=a.rs_seq + 1) if a.kind == "recurrent" else a for a in allocations]
    observation = observed_memory(parse_allocation_log(_log(predicted, logged)), predicted, allocations)
    assert "recurrent_bytes" not in observation.exact
    (rs,) = [a for a in allocations if a.kind == "recurrent"]
    assert observation.memory.recurrent_bytes == mib_to_bytes(printed_mib_f32(rs.a_bytes + rs.b_bytes))


def test_missing_or_unexpected_cache_lines_are_counted_but_not_exact() -> None:
    predicted = estimate(QWEN, MTP, CTX)
    allocations = cache_allocations(QWEN, MTP, CTX)
    without_draft = [a for a in allocations if a.context == "target"]
    observation = observed_memory(parse_allocation_log(_log(predicted, without_draft)), predicted, allocations)
    assert observation.memory.draft_kv_bytes == 0 and "draft_kv_bytes" not in observation.exact

    dense = serving(slots=2)
    small = estimate(llama(), dense, 4096)
    small_allocations = cache_allocations(llama(), dense, 4096)
    doubled = [*small_allocations, *small_allocations]  # a line the model did not predict
    observation = observed_memory(parse_allocation_log(_log(small, doubled)), small, small_allocations)
    (line,) = small_allocations
    assert observation.memory.kv_bytes == line.a_bytes + line.b_bytes + mib_to_bytes(
        printed_mib_f32(line.a_bytes + line.b_bytes)
    )
    assert "kv_bytes" not in observation.exact


def test_weights_are_exact_for_one_buffer_and_printed_mib_for_several() -> None:
    predicted = estimate(QWEN, MTP, CTX)
    allocations = cache_allocations(QWEN, MTP, CTX)
    split = {
        "CPU_Mapped": predicted.weights_bytes // 3,
        "CUDA0": predicted.weights_bytes - predicted.weights_bytes // 3,
    }
    observation = observed_memory(
        parse_allocation_log(_log(predicted, allocations, weights=split)), predicted, allocations
    )
    assert "weights_bytes" not in observation.exact
    assert observation.memory.weights_bytes == sum(mib_to_bytes(printed_mib(n)) for n in split.values())
    assert observation.memory.devices["CUDA0"] == mib_to_bytes(printed_mib(split["CUDA0"]))


def test_compute_output_devices_and_total_come_from_the_printed_buffers() -> None:
    predicted = estimate(QWEN, MTP, CTX)
    allocations = cache_allocations(QWEN, MTP, CTX)
    log = parse_allocation_log(_log(predicted, allocations, compute=("100.25", "3.50"), output="0.95"))
    observation = observed_memory(log, predicted, allocations)
    memory = observation.memory
    assert "output_bytes" not in observation.exact  # 0.95 MiB is not the predicted logits buffer
    assert memory.compute_bytes == mib_to_bytes(Decimal("103.75"))
    assert memory.output_bytes == 2 * mib_to_bytes(Decimal("0.95"))
    assert memory.total_bytes == (
        memory.kv_bytes
        + memory.recurrent_bytes
        + memory.draft_kv_bytes
        + memory.weights_bytes
        + memory.compute_bytes
        + memory.output_bytes
    )
    cpu = memory.devices["CPU"]
    assert cpu == sum(
        mib_to_bytes(v)
        for v in [
            *(Decimal("0.95"),) * 2,
            Decimal("100.25"),
            Decimal("3.50"),
            *(b for c in log.contexts for line in c.kv for _, b in line.buffers),
        ]
    )


def test_an_empty_log_observes_nothing_and_claims_no_exactness_for_what_was_predicted() -> None:
    predicted = estimate(QWEN, MTP, CTX)
    allocations = cache_allocations(QWEN, MTP, CTX)
    observation = observed_memory(parse_allocation_log(""), predicted, allocations)
    assert observation.memory.total_bytes == 0
    assert observation.exact == set()


@pytest.mark.parametrize("mib", ["0.00", "0.01", "1.00", "1234.56"])
def test_mib_to_bytes_is_the_nearest_integer(mib: str) -> None:
    assert mib_to_bytes(Decimal(mib)) == round(Decimal(mib) * MIB)


def test_weights_with_a_repack_buffer_are_exact_when_both_buffers_print_as_predicted() -> None:
    geometry = llama()
    settings = serving()
    predicted = estimate(geometry, settings, 1024)
    repacked = msgspec.structs.replace(predicted, repack_bytes=1_974_272)
    allocations = cache_allocations(geometry, settings, 1024)
    lines = (
        f"load_tensors:   CPU_Mapped model buffer size = {printed_mib(repacked.weights_bytes)} MiB\n"
        f"load_tensors:   CPU_REPACK model buffer size = {printed_mib(repacked.repack_bytes)} MiB\n"
    )
    observation = observed_memory(parse_allocation_log(lines), repacked, allocations)
    assert "weights_bytes" in observation.exact
    assert observation.memory.weights_bytes == repacked.weights_bytes + repacked.repack_bytes
    # a repack buffer the prediction did not expect (or one that prints differently) is not exact
    unexpected = observed_memory(parse_allocation_log(lines), predicted, allocations)
    assert "weights_bytes" not in unexpected.exact
    assert unexpected.memory.weights_bytes == mib_to_bytes(printed_mib(predicted.weights_bytes)) + mib_to_bytes(
        printed_mib(repacked.repack_bytes)
    )
