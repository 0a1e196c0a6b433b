"""Exactness checks of the memory model against a real llama-server's printed buffers: the cases and how
they are compared.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import msgspec

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import CACHE_TYPES, cache_allocations, estimate, resolve_context
from actors.placement.weights import AMX
from actors.runner.allocation_log import AllocationLog, parse_allocation_log, printed_mib, printed_mib_f32
from actors.telemetry.probes import read_host
from actors.telemetry.resources import ggml_cpu_features
from messages.memory import MemoryBreakdown
from messages.model import ModelGeometry
from messages.settings import ServingSettings
from tests.llama_harness import ServerRun, run_server, server_args

MIB = 1 << 20


PRINT_STEP = 0.01 * MIB  # two decimals of MiB


@dataclass(frozen=True)
class Case:
    model: str
    n_ctx: int
    settings: ServingSettings

    @property
    def id(self) -> str:
        s = self.settings
        parts = [self.model, f"c{self.n_ctx}", f"np{s.slots}", "kvu" if s.kv_unified else "streams"]
        parts.append(f"{s.cache_type_k}-{s.cache_type_v}")
        parts.append(f"fa-{s.flash_attn}")
        if s.ubatch != 512:
            parts.append(f"ub{s.ubatch}")
        if s.swa_full:
            parts.append("swa-full")
        if s.spec_type != "none":
            parts.append(f"{s.spec_type}{s.spec_draft_n_max}-{s.spec_draft_type_k}")
        return "_".join(parts)


@functools.cache
def node_features() -> tuple[str, ...] | None:
    """This machine's llama.cpp CPU features, as its telemetry advertises them (they decide the CPU backend's
    copies of weights: AMX, repack)."""
    return ggml_cpu_features(read_host().cpu_flags)


def printed_model_buffers(breakdown: MemoryBreakdown, *, draft: bool = False) -> dict[str, Decimal]:
    """The model buffers a CPU-only llama-server prints for the model (or its draft model): the mapped file,
    and the CPU backend's `CPU_REPACK` and `AMX` copies when it makes any."""
    if draft:
        sizes = (breakdown.draft_weights_bytes, breakdown.draft_repack_bytes, breakdown.draft_amx_bytes)
    else:
        repack = breakdown.repack_bytes - breakdown.draft_repack_bytes
        sizes = (breakdown.weights_bytes, repack, breakdown.amx_bytes - breakdown.draft_amx_bytes)
    named = zip(("CPU_Mapped", "CPU_REPACK", "AMX"), sizes, strict=True)
    return {name: printed_mib(n) for i, (name, n) in enumerate(named) if n or i == 0}


def allocated(run: ServerRun) -> bool:
    """The server came up, or allocated everything and then faulted in the AMX kernels of a machine whose CPU
    advertises AMX without running it (a VM that exposes the AMX flags but not its tile state: SIGILL or
    SIGSEGV at the warm-up, with weights in the AMX buffer). Its allocations are printed before the fault, so
    they are compared all the same; any other failure to come up is a failure."""
    if run.healthy:
        return True
    faulted = run.returncode in (-signal.SIGILL, -signal.SIGSEGV)
    amx = frozenset(node_features() or ()) >= AMX
    log = parse_allocation_log(run.log)
    return faulted and amx and "AMX" in {**log.model_buffers, **log.draft_model_buffers}


def _s(**kw: object) -> ServingSettings:
    return msgspec.convert({"cache_ram_mib": 0, **kw}, ServingSettings)


def _row_step(cache_type: str) -> int:
    """The smallest change in a cache row's bytes: one element, or one block of a quantized type."""
    return CACHE_TYPES[cache_type][1]


def _geometry(path: Path) -> ModelGeometry:
    return geometry_from_header(read_header(path))


def _assert_context(log: AllocationLog, geometry: ModelGeometry, settings: ServingSettings, n_ctx: int) -> None:
    shape = resolve_context(geometry, settings, n_ctx)
    target = log.target
    assert target is not None, "no llama_context in the log"
    assert (target.n_ctx, target.n_ctx_seq, target.n_seq_max, target.n_ubatch, target.n_rs_seq) == (
        shape.n_ctx,
        shape.n_ctx_seq,
        shape.n_seq_max,
        shape.n_ubatch,
        shape.n_rs_seq,
    )


def _assert_caches(log: AllocationLog, geometry: ModelGeometry, settings: ServingSettings, n_ctx: int) -> int:
    """Compares every cache line; returns how many KV lines were byte-exact by construction."""
    predicted = cache_allocations(geometry, settings, n_ctx)
    observed: list[tuple[str, object]] = []
    for name, ctx in (("target", log.target), ("draft", log.draft)):
        if ctx is None:
            continue
        observed += [(name, line) for line in ctx.kv]
        observed += [(name, line) for line in ctx.recurrent]
    assert len(observed) == len(predicted), f"{len(observed)} cache lines logged, {len(predicted)} predicted"
    exact = 0
    for (context, line), want in zip(observed, predicted, strict=True):
        assert context == want.context
        fields = dataclasses.asdict(want)
        if want.kind == "recurrent":
            got = (line.cells, line.layers, line.seqs, line.rs_seq, line.r_type, line.s_type)  # type: ignore[attr-defined]
            assert got == (want.cells, want.layers, want.seqs, want.rs_seq, "f32", "f32"), fields
            mibs = (line.r_mib, line.s_mib)  # type: ignore[attr-defined]
        else:
            got = (line.cells, line.layers, line.seqs, line.streams, line.k_type, line.v_type)  # type: ignore[attr-defined]
            assert got == (want.cells, want.layers, want.seqs, want.streams, want.type_a, want.type_b), fields
            assert line.swa == {"kv": None, "kv_base": False, "kv_swa": True}[want.kind]  # type: ignore[attr-defined]
            mibs = (line.k_mib, line.v_mib)  # type: ignore[attr-defined]
            if want.layers and want.cells * want.streams * _row_step(want.type_a) > PRINT_STEP:
                exact += 1
        assert mibs == (printed_mib_f32(want.a_bytes), printed_mib_f32(want.b_bytes)), fields
        assert line.size_mib == printed_mib_f32(want.a_bytes + want.b_bytes), fields  # type: ignore[attr-defined]
    return exact


def _check(case: Case, models: dict[str, Path], binary: str) -> tuple[AllocationLog, float]:
    path = models[case.model]
    geometry = _geometry(path)
    run = run_server(path, server_args(case.settings, case.n_ctx), binary=binary)
    assert run.healthy, run.log[-3000:]
    log = parse_allocation_log(run.log)
    _assert_context(log, geometry, case.settings, case.n_ctx)
    _assert_caches(log, geometry, case.settings, case.n_ctx)

    breakdown = estimate(geometry, case.settings, case.n_ctx, cpu_features=node_features())
    assert log.model_buffers == printed_model_buffers(breakdown)
    target = log.target
    assert target is not None
    assert target.output_buffers["CPU"] == printed_mib(4 * geometry.n_vocab * case.settings.slots)
    allocations = cache_allocations(geometry, case.settings, case.n_ctx)
    kv = sum(a.a_bytes + a.b_bytes for a in allocations if a.context == "target" and a.kind != "recurrent")
    recurrent = sum(a.a_bytes + a.b_bytes for a in allocations if a.kind == "recurrent")
    draft = sum(a.a_bytes + a.b_bytes for a in allocations if a.context == "draft")
    assert (breakdown.kv_bytes, breakdown.recurrent_bytes, breakdown.draft_kv_bytes) == (kv, recurrent, draft)

    measured = sum(
        (sum(c.compute_buffers.values(), Decimal(0)) for c in log.contexts),
        Decimal(0),
    )
    error = (breakdown.compute_bytes / MIB - float(measured)) / float(measured)
    return log, error
