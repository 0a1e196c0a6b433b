"""Benchmark: one memory estimate for a new GPU split, with the layout-free parts shared (as placement asks)
against the same parts computed afresh for every ask (the same-run baseline: what an estimate cost before
`memory._model_parts`).

A sparse file with the 9B qwen35 geometry (4 slots, 8,192 cells) is estimated for `--splits` different 3-GPU
splits (as a multi-GPU node's free memory moves); the baseline clears the shared parts before each ask. Rounds
alternate the two, and the medians are reported with their ratio. The answers of both are checked equal.

Run from the repository root:

    python -m benchmarks.memory_estimate [--splits 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from actors.placement import memory
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from benchmarks.environment import print_environment
from messages.memory import MemoryBreakdown
from messages.model import ModelGeometry
from messages.settings import ServingSettings
from tests import tiny_models

SETTINGS = msgspec.convert({"slots": 4, "cache_ram_mib": 0}, ServingSettings)
CTX = 8192
FEATURES = ("AVX2",)


def _ask(geometry: ModelGeometry, split: tuple[float, ...]) -> MemoryBreakdown:
    return memory.estimate(geometry, SETTINGS, CTX, gpu_split=split, cpu_features=FEATURES)


def _round(geometry: ModelGeometry, splits: list[tuple[float, ...]], *, fresh: bool) -> tuple[float, list[bytes]]:
    """Microseconds per estimate, and the answers."""
    answers = []
    started = time.perf_counter()
    for split in splits:
        if fresh:
            memory._model_parts.cache_clear()
        answers.append(msgspec.json.encode(_ask(geometry, split)))
    return (time.perf_counter() - started) / len(splits) * 1e6, answers


async def _main(args: argparse.Namespace) -> None:
    print_environment(("msgspec",))
    with tempfile.TemporaryDirectory() as tmp:
        geometry = geometry_from_header(read_header(tiny_models.write_qwen35_9b(Path(tmp) / "qwen35-9b.gguf")))
    splits: list[tuple[float, ...]] = [(1.0 + i / 1000, 1.0, 0.5 + i / 3000) for i in range(args.splits)]
    for split in splits[:50]:  # warm-up: the layer splits' own memo, imports
        _ask(geometry, split)
    print("input")
    print(f"  model     qwen35 9B shape, {SETTINGS.slots} slots, ctx {CTX}, CPU features {FEATURES}")
    print(f"  asks      {args.splits} different 3-GPU splits per round, {args.rounds} rounds alternated")
    shared_us, fresh_us = [], []
    for _ in range(args.rounds):
        us, shared = _round(geometry, splits, fresh=False)
        shared_us.append(us)
        us, fresh = _round(geometry, splits, fresh=True)
        fresh_us.append(us)
        if shared != fresh:
            raise SystemExit("the shared parts answered differently from parts computed afresh")
    print("results (µs per estimate; every answer equal)")
    print("  parts computed afresh  " + " ".join(f"{u:6.1f}" for u in fresh_us))
    print("  parts shared           " + " ".join(f"{u:6.1f}" for u in shared_us))
    fresh_median, shared_median = statistics.median(fresh_us), statistics.median(shared_us)
    print(f"  medians: afresh {fresh_median:.1f}, shared {shared_median:.1f} ({shared_median / fresh_median:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--splits", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
