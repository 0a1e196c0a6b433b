"""Embedding and rerank servers: the memory model against llama-server's own reports, and the output buffer's growth.

Each case writes an embedding or rerank model (tiny widths with random weights; released widths as sparse files
whose weights read as zeros), starts llama-server as the runner starts a pooled instance (`--embeddings` or
`--rerank`, `--pooling`, `-b`/`-ub` a whole input: the per-slot context, every allocation flag pinned, no
warm-up), reads what it reports (`sched_reserve: CPU compute buffer size`, the output buffer, the KV cache) and
compares the memory model's prediction: compute (modelled; the error in per cent, and what the generation
graph's output stage would have predicted, the model before compute-8), output buffer and KV (exact, compared
as printed). Cases are split into the shapes the pooled output stage was chosen on (fit) and the others
(hold-out).

Then one server is sent a one-token input and an input that fills its batch, and the anonymous mappings of its
process are compared between the two (`/proc/<pid>/maps`): the output buffer grows from a row per slot to a
row per token of the batch at run time (`llama_context::output_reserve` allocates it anew, a mapping of its
own, and clears it, so every page is touched), which admission counts as a host extra.

Run from the repository root: `python -m benchmarks.pooled_compute` (about 4 min on 2 cores; `--only
SUBSTRING` runs the cases whose label contains it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import msgspec

from actors.placement import compute
from actors.placement.compute import CALIBRATION_VERSION, MEASURED_ERROR_RATIO
from actors.placement.context import resolve_context
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import LLAMA_CPP_VERSION, estimate
from actors.runner.allocation_log import parse_allocation_log, printed_mib, printed_mib_f32
from messages.settings import ServingSettings
from tests import tiny_pooled_models as tp
from tests.llama_harness import call_server, find_server, run_server, server_args

MIB = 1 << 20

Writer = Callable[[Path], Path]


@dataclass(frozen=True)
class Case:
    label: str
    write: Writer
    kind: str
    pooling: str
    n_ubatch: int  # the per-slot context: a whole input
    slots: int
    flash_attn: str
    split: str  # "fit" or "holdout"

    def settings(self) -> ServingSettings:
        return msgspec.convert(
            {
                "slots": self.slots, "kind": self.kind, "pooling": self.pooling, "batch": self.n_ubatch,
                "ubatch": self.n_ubatch, "flash_attn": self.flash_attn, "cache_ram_mib": 0, "ctx_checkpoints": 0,
            },
            ServingSettings,
        )  # fmt: skip


def _llama(**kw: object) -> Writer:
    return lambda p: tp.write_llama_embedding(p, **kw)  # type: ignore[arg-type]


def _qwen3(**kw: object) -> Writer:
    return lambda p: tp.write_qwen3_embedding(p, **kw)  # type: ignore[arg-type]


def _reranker(**kw: object) -> Writer:
    return lambda p: tp.write_qwen3_reranker(p, **kw)  # type: ignore[arg-type]


#: Qwen3-Embedding-0.6B / Qwen3-Reranker-0.6B widths: 1024, 16 heads / 8 KV x 128, n_ff 3072, vocab 151669
QWEN3_06B = {"n_embd": 1024, "n_head": 16, "n_head_kv": 8, "head_dim": 128, "n_ff": 3072, "n_vocab": 151669}


def cases() -> list[Case]:
    out: list[Case] = []
    fit_shapes: list[tuple[str, Writer, str]] = [
        ("llama e256 ff512 v4096", _llama(n_embd=256, n_ff=512, n_head=8, n_head_kv=4, n_vocab=4096), "mean"),
        (
            "llama e1024 ff2816 v32000",
            _llama(n_embd=1024, n_ff=2816, n_head=16, n_head_kv=8, n_vocab=32000, sparse=True),
            "mean",
        ),
    ]
    for label, write, pooling in fit_shapes:
        for t, slots, fa in ((512, 1, "on"), (1024, 2, "on"), (512, 1, "off")):
            out.append(Case(label, write, "embedding", pooling, t, slots, fa, "fit"))
    holdout: list[tuple[str, Writer, str, str]] = [
        ("llama e64 ff128 v259", _llama(), "embedding", "mean"),
        ("llama e64 ff256 v2048 cls", _llama(n_ff=256, n_vocab=2048, pooling="cls"), "embedding", "cls"),
        (
            "llama e256 ff1024 v8192",
            _llama(n_embd=256, n_ff=1024, n_head=8, n_head_kv=4, n_vocab=8192),
            "embedding",
            "mean",
        ),
        (
            "llama e512 ff1376 v16000",
            _llama(n_embd=512, n_ff=1376, n_head=8, n_head_kv=2, n_vocab=16000, sparse=True),
            "embedding",
            "mean",
        ),
        ("qwen3 e64 last", _qwen3(), "embedding", "last"),
        (
            "qwen3 e1024 ff3072 v32000 last",
            _qwen3(n_embd=1024, n_ff=3072, n_head=16, n_head_kv=8, head_dim=128, n_vocab=32000, sparse=True),
            "embedding",
            "last",
        ),
        ("qwen3 reranker e64", _reranker(), "rerank", "rank"),
    ]
    for label, write, kind, pooling in holdout:
        for t, slots, fa in ((512, 1, "on"), (1024, 2, "on"), (512, 1, "off")):
            out.append(Case(label, write, kind, pooling, t, slots, fa, "holdout"))
    for label, write, kind, pooling in (
        ("Qwen3-Embedding-0.6B", _qwen3(n_layer=4, sparse=True, **QWEN3_06B), "embedding", "last"),
        ("Qwen3-Reranker-0.6B", _reranker(n_layer=4, sparse=True, **QWEN3_06B), "rerank", "rank"),
    ):
        for t, slots in ((512, 4), (2048, 2), (8192, 1)):
            out.append(Case(label, write, kind, pooling, t, slots, "on", "holdout"))
    return out


@dataclass(frozen=True)
class Result:
    case: Case
    measured_compute: Decimal
    predicted_compute: int
    generation_stage: int  # the prediction with a generation graph's output stage (before compute-8)
    output_exact: bool
    kv_exact: bool
    seconds: float


def measure(case: Case, directory: Path) -> Result | str:
    path = case.write(directory / "m.gguf")
    geometry = geometry_from_header(read_header(path))
    settings = case.settings()
    n_ctx = case.n_ubatch * case.slots
    run = run_server(path, server_args(settings, n_ctx), deadline=300)
    target = parse_allocation_log(run.log).target
    if target is None or not target.compute_buffers:
        return f"no allocation lines (healthy={run.healthy}, rc={run.returncode})"
    breakdown = estimate(geometry, settings, n_ctx)
    shape = resolve_context(geometry, settings, n_ctx)
    generation = compute.compute_buffers(geometry, shape, flash_attn=case.flash_attn == "on", n_outputs=case.n_ubatch)
    return Result(
        case=case,
        measured_compute=sum(target.compute_buffers.values(), Decimal(0)),
        predicted_compute=breakdown.compute_bytes,
        generation_stage=generation.device,
        output_exact=sum(target.output_buffers.values(), Decimal(0)) == printed_mib(breakdown.output_bytes),
        kv_exact=target.kv_mib() == printed_mib_f32(breakdown.kv_bytes),
        seconds=run.seconds,
    )


def _anonymous_mappings(pid: int) -> set[tuple[int, int]]:
    """The process's anonymous writable memory mappings (start, end): where glibc puts each large allocation
    (the reserved, inaccessible rest of a malloc arena is left out)."""
    out = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 5 and fields[1].startswith("rw"):  # no path: anonymous
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.add((start, end))
    return out


def output_growth(directory: Path) -> str:
    """One server's resident memory before and after an input that fills its batch, against the prediction."""
    binary = find_server()
    assert binary is not None
    n_embd, n_vocab, batch = 1024, 32000, 2048
    path = tp.write_llama_embedding(
        directory / "growth.gguf", n_embd=n_embd, n_ff=2816, n_head=16, n_head_kv=8, n_vocab=n_vocab, sparse=True
    )
    geometry = geometry_from_header(read_header(path))
    settings = msgspec.convert(
        {"slots": 1, "kind": "embedding", "pooling": "mean", "batch": batch, "ubatch": batch, "cache_ram_mib": 0,
         "ctx_checkpoints": 0},
        ServingSettings,
    )  # fmt: skip
    predicted = estimate(geometry, settings, batch)
    port = 18000 + os.getpid() % 1000
    argv = [binary, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), *server_args(settings, batch)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if asyncio.run(call_server(port, "GET", "/health", timeout_s=2)).status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        pid = proc.pid  # the server itself: started without a shell or wrapper
        small = asyncio.run(call_server(port, "POST", "/v1/embeddings", {"input": "a"}, timeout_s=300))
        before = _anonymous_mappings(pid)
        text = "a" * (batch - 8)  # one byte token a character, within the batch
        reply = asyncio.run(call_server(port, "POST", "/v1/embeddings", {"input": text}, timeout_s=300))
        after = _anonymous_mappings(pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    new = sorted((end - start for start, end in after - before), reverse=True)
    buffer = predicted.output_bytes + predicted.host_extra_bytes  # a row per token of the batch
    return (
        f"output buffer at a full batch ({batch} tokens, n_vocab {n_vocab}, n_embd {n_embd}; statuses "
        f"{small.status}, {reply.status}): largest new mapping {new[0] / MIB if new else 0:.2f} MiB, predicted "
        f"buffer {buffer / MIB:.2f} MiB (start {predicted.output_bytes / MIB:.2f} MiB + host extra "
        f"{predicted.host_extra_bytes / MIB:.2f} MiB); new mappings {[f'{n / MIB:.2f}' for n in new[:3]]} MiB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases whose label contains this")
    args = parser.parse_args(argv)
    if find_server() is None:
        print("no llama-server installed", file=sys.stderr)
        return 1
    print(f"llama.cpp: {LLAMA_CPP_VERSION}")
    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus")
    print(f"compute calibration {CALIBRATION_VERSION}, stated error bound {MEASURED_ERROR_RATIO:.0%}")
    print(f"{'case':<52} {'split':<8} {'measured':>10} {'model':>10} {'err':>7} {'gen-stage':>9} out  kv")
    errors: dict[str, list[float]] = {"fit": [], "holdout": []}
    for case in cases():
        label = f"{case.label} {case.kind}/{case.pooling} ub{case.n_ubatch} np{case.slots} fa-{case.flash_attn}"
        if args.only and args.only not in label:
            continue
        with tempfile.TemporaryDirectory(prefix="pooled-") as tmp:
            result = measure(case, Path(tmp))
        if isinstance(result, str):
            print(f"{label:<52} {case.split:<8} {result}")
            continue
        measured = float(result.measured_compute) * MIB
        error = (result.predicted_compute - measured) / measured
        before = (result.generation_stage - measured) / measured
        errors[case.split].append(error)
        print(
            f"{label:<52} {case.split:<8} {float(result.measured_compute):>9.2f}M "
            f"{result.predicted_compute / MIB:>9.2f}M {error:>+7.1%} {before:>+9.1%} "
            f"{'=' if result.output_exact else 'x':>3} {'=' if result.kv_exact else 'x':>3}",
            flush=True,
        )
    for split, values in errors.items():
        if values:
            print(f"{split}: {len(values)} cases, compute error {min(values):+.1%} .. {max(values):+.1%}")
    if not args.only:
        with tempfile.TemporaryDirectory(prefix="pooled-") as tmp:
            print(output_growth(Path(tmp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
