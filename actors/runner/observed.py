"""What a running server allocated, in bytes, recovered from its allocation log (runner core).

llama-server prints its allocations in MiB with two decimals, so a printed figure alone only bounds the
bytes to within 0.005 MiB. Each cache line also prints exact integers (cells, layers, sequences, streams,
rollback rows) and its element types, and the memory model predicts every cache tensor's bytes from the
model geometry. A cache's bytes are cells x streams x (the sum of its layers' row sizes), and a row can only
change by one element (one block for a quantized type). So:

* when a line's integers and types equal the predicted allocation's and the predicted K and V (R and S)
  bytes print exactly as the line does (`printed_mib_f32`, float32 rounding as llama.cpp does), the observed
  bytes are the predicted bytes. Whenever cells x streams x one row step exceeds the 0.01 MiB print step,
  this is the only byte count consistent with the line; for smaller caches it is the one consistent with
  the line and with the row formula;
* otherwise (a line the model did not predict, or one that prints differently) the bytes are the printed
  MiB times 2^20, and the figure is not exact.

Weights follow the same rule for a single model buffer (beside the CPU backend's `CPU_REPACK` and `AMX`
buffers of copied weights, which must print as predicted too), for the model and for a draft model alike,
and the output (logits) buffer for each context (`printed_mib`, double rounding). Compute buffers have no
exact counterpart and are always printed MiB times 2^20. `Observation.exact` names the figures that were
recovered exactly.

A multimodal projector's weights print as the sum of its file's tensors (`load_hparams: model size`): when
that prints as the projector's predicted tensor bytes, the observed weights are its predicted buffer (each
tensor rounded up to the buffer's alignment), otherwise the printed MiB times 2^20. Its compute buffer is
reserved at the first image (the server starts without a warm-up), so at start it is not in the log: it is
counted at its prediction plus its compute margin as `pending_bytes` (in the total, not in the buffers),
until a log that shows it says otherwise. Pure core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal

from actors.placement.memory import CacheAllocation, compute_margin
from actors.runner.allocation_log import (
    AllocationLog,
    KvCacheLine,
    RecurrentLine,
    printed_mib,
    printed_mib_f32,
)
from messages.memory import MemoryBreakdown
from messages.model import ProjectorGeometry
from messages.runner import ObservedMemory

__all__ = ["Observation", "mib_to_bytes", "observed_memory"]

MIB = 1 << 20
REPACK_BUFFER = "CPU_REPACK"  # the CPU backend's buffer of repacked quantized weights
AMX_BUFFER = "AMX"  # the CPU backend's buffer of weights in the AMX kernels' layout (a CPU with AMX)


def mib_to_bytes(mib: Decimal) -> int:
    """A printed MiB figure as bytes (nearest integer)."""
    return int((mib * MIB).to_integral_value())


@dataclass(frozen=True)
class Observation:
    memory: ObservedMemory
    exact: frozenset[str]  # which of kv, recurrent, draft_kv, (draft, projector) weights and output bytes are exact


def _line_matches(line: KvCacheLine | RecurrentLine, want: CacheAllocation) -> bool:
    printed = (printed_mib_f32(want.a_bytes), printed_mib_f32(want.b_bytes))
    if isinstance(line, RecurrentLine):
        shape = (line.cells, line.layers, line.seqs, line.rs_seq, line.r_type, line.s_type)
        wanted = (want.cells, want.layers, want.seqs, want.rs_seq, want.type_a, want.type_b)
        return shape == wanted and (line.r_mib, line.s_mib) == printed
    shape_kv = (line.cells, line.layers, line.seqs, line.streams, line.k_type, line.v_type)
    wanted_kv = (want.cells, want.layers, want.seqs, want.streams, want.type_a, want.type_b)
    return shape_kv == wanted_kv and (line.k_mib, line.v_mib) == printed


def _caches(lines: Sequence[KvCacheLine | RecurrentLine], predicted: Sequence[CacheAllocation]) -> tuple[int, bool]:
    """Bytes of the logged caches of one kind, and whether every one was recovered exactly."""
    total = 0
    exact = len(lines) == len(predicted)
    for i, line in enumerate(lines):
        want = predicted[i] if i < len(predicted) else None
        if want is not None and _line_matches(line, want):
            total += want.a_bytes + want.b_bytes
        else:
            total += mib_to_bytes(line.size_mib)
            exact = False
    return total, exact


def _sum_mib(values: Iterable[Decimal]) -> int:
    return sum((mib_to_bytes(v) for v in values), 0)


def _weights(logged: dict[str, Decimal], weights_bytes: int, copies: dict[str, int]) -> int | None:
    """One model's weights recovered exactly: the mapped (or loaded) buffer prints as the predicted tensor
    bytes and each buffer of the CPU backend's copies (`copies`, by buffer name) as its predicted bytes, and
    is there only when predicted; None otherwise. The observed weights include the copies, as the server's
    buffers do."""
    buffers = dict(logged)
    for name, n_bytes in copies.items():
        printed = buffers.pop(name, None)
        if (printed is None) != (n_bytes == 0) or (printed is not None and printed != printed_mib(n_bytes)):
            return None
    if len(buffers) != 1 or next(iter(buffers.values())) != printed_mib(weights_bytes):
        return None
    return weights_bytes + sum(copies.values())


def observed_memory(
    log: AllocationLog,
    predicted: MemoryBreakdown,
    allocations: Sequence[CacheAllocation],
    projector: ProjectorGeometry | None = None,
) -> Observation:
    """The observed footprint of a server whose log is `log`, predicted as `predicted` / `allocations`;
    `projector` is the multimodal projector it was started with, if any."""
    exact: set[str] = set()

    def by(context: str, keep: Callable[[CacheAllocation], bool]) -> list[CacheAllocation]:
        return [a for a in allocations if a.context == context and keep(a)]

    target, draft = log.target, log.draft
    kv, kv_exact = _caches(target.kv if target else [], by("target", lambda a: a.kind != "recurrent"))
    recurrent, rs_exact = _caches(target.recurrent if target else [], by("target", lambda a: a.kind == "recurrent"))
    draft_kv, draft_exact = _caches(draft.kv if draft else [], by("draft", lambda a: True))
    for name, ok in (("kv_bytes", kv_exact), ("recurrent_bytes", rs_exact), ("draft_kv_bytes", draft_exact)):
        if ok:
            exact.add(name)

    draft_copies = {REPACK_BUFFER: predicted.draft_repack_bytes, AMX_BUFFER: predicted.draft_amx_bytes}
    copies = {
        REPACK_BUFFER: predicted.repack_bytes - predicted.draft_repack_bytes,
        AMX_BUFFER: predicted.amx_bytes - predicted.draft_amx_bytes,
    }
    weights = _weights(log.model_buffers, predicted.weights_bytes, copies)
    if weights is not None:
        exact.add("weights_bytes")
    else:
        weights = _sum_mib(log.model_buffers.values())
    draft_weights = 0
    if predicted.draft_weights_bytes or log.draft_model_buffers:
        recovered = _weights(log.draft_model_buffers, predicted.draft_weights_bytes, draft_copies)
        if recovered is not None:
            draft_weights = recovered
            exact.add("draft_weights_bytes")
        else:
            draft_weights = _sum_mib(log.draft_model_buffers.values())

    compute = sum((_sum_mib(c.compute_buffers.values()) for c in log.contexts), 0)
    # one logits buffer per context: the target's, then the draft context's (a breakdown made before the
    # draft's part was kept splits them evenly, as an MTP context mirrors the target's)
    n_predicted = 2 if any(a.context == "draft" for a in allocations) else 1
    draft_output = predicted.draft_output_bytes or (predicted.output_bytes // 2 if n_predicted == 2 else 0)
    per_context = [predicted.output_bytes - draft_output, draft_output][:n_predicted]
    output, output_exact = 0, len(log.contexts) == n_predicted
    for i, context in enumerate(log.contexts):
        want = per_context[i] if i < len(per_context) else None
        printed = sum(context.output_buffers.values(), Decimal(0))
        if want is not None and len(context.output_buffers) == 1 and printed == printed_mib(want):
            output += want
        else:
            output += mib_to_bytes(printed)
            output_exact = False
    if output_exact:
        exact.add("output_bytes")

    devices: dict[str, int] = {}

    def add(name: str, mib: Decimal) -> None:
        devices[name] = devices.get(name, 0) + mib_to_bytes(mib)

    projector_weights = pending = 0
    clip = log.projector
    if clip is not None and clip.model_mib is not None:
        if projector is not None and clip.model_mib == printed_mib(projector.tensor_bytes):
            projector_weights = predicted.projector_weights_bytes
            exact.add("projector_weights_bytes")
        else:
            projector_weights = mib_to_bytes(clip.model_mib)
        where = clip.backend or "CPU"
        devices[where] = devices.get(where, 0) + projector_weights
    if clip is not None and clip.compute_buffers:
        compute += _sum_mib(clip.compute_buffers.values())
        for name, mib in clip.compute_buffers.items():
            add(name, mib)
    elif predicted.projector_compute_bytes:
        pending = predicted.projector_compute_bytes + compute_margin(predicted.projector_compute_bytes)

    for name, mib in [*log.model_buffers.items(), *log.draft_model_buffers.items()]:
        add(name, mib)
    for context in log.contexts:
        lines: list[KvCacheLine | RecurrentLine] = [*context.kv, *context.recurrent]
        for line in lines:
            for name, mib in line.buffers:
                add(name, mib)
        for name, mib in [*context.output_buffers.items(), *context.compute_buffers.items()]:
            add(name, mib)

    total = kv + recurrent + draft_kv + weights + draft_weights + projector_weights + compute + output + pending
    memory = ObservedMemory(
        kv_bytes=kv,
        recurrent_bytes=recurrent,
        draft_kv_bytes=draft_kv,
        weights_bytes=weights,
        compute_bytes=compute,
        output_bytes=output,
        total_bytes=total,
        devices=devices,
        draft_weights_bytes=draft_weights,
        projector_weights_bytes=projector_weights,
        pending_bytes=pending,
    )
    return Observation(memory=memory, exact=frozenset(exact))
