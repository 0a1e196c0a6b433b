"""What the serving benchmarks share: a `mesh-actor run` node process, a model placed on it, a bus client, and
the provenance block (binary and model digests, hardware).

The model is a sparse GGUF of a realistic shape (zeros, so no disk, but every matmul of a real model of that
size): time to first token then costs what it costs on a real model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import blake3

from actors.runner.engine import find_llama_server
from messages.generate import GenerateChunk, GenerateRequest, GenerateResult, Sampling
from messages.subjects import Subjects
from runtime.bus import Bus
from runtime.config import NatsOptions
from runtime.generate_client import generate
from tests.conftest import node_process, run_cli
from tests.tiny_models import sparse_files, write_llama

#: A 0.5B-parameter llama shape (Qwen2-0.5B's widths, a 32k vocabulary), f16.
SHAPE_0_5B: dict[str, Any] = {
    "n_layer": 24, "n_embd": 896, "n_head": 14, "n_head_kv": 2, "n_ff": 4864, "n_vocab": 32000, "dtype": "f16",
}  # fmt: skip


def write_model(path: Path, shape: dict[str, Any] = SHAPE_0_5B) -> Path:
    if not path.exists():
        with sparse_files():
            write_llama(path, **shape)
    return path


def _command() -> list[str]:
    return [sys.executable, "-m", "runtime.cli"]


async def cli(*args: str, timeout: float = 600) -> Any:
    """The command's JSON output (run it with `--json`)."""
    process = await asyncio.create_subprocess_exec(*_command(), *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    async with asyncio.timeout(timeout):
        out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"mesh-actor {' '.join(args[:2])} failed ({process.returncode}): {err.decode()[-2000:]}")
    return json.loads(out)


@contextlib.asynccontextmanager
async def node(data_dir: Path, *flags: str) -> AsyncIterator[asyncio.subprocess.Process]:
    async with node_process(data_dir, "bench", *flags, ready_s=60) as process:
        yield process


@contextlib.asynccontextmanager
async def two_nodes(
    data_a: Path, data_b: Path, port: int | None, *flags: str, b_flags: tuple[str, ...] = ()
) -> AsyncIterator[None]:
    """Node `a` (its embedded NATS server, a front door on `port` unless None) and node `b` joined to it with a
    node's credentials, both run with `flags` (and `b` with `b_flags` too)."""
    door = ("--http", str(port)) if port is not None else ()
    async with node_process(data_a, "a", *flags, *door, ready_s=60):
        creds = data_a.with_name("node-b.json")
        code, _, err = await run_cli("creds", "issue", "--role", "node", "--node", "b", "--data-dir", str(data_a),
                                     "--out", str(creds))  # fmt: skip
        if code != 0:
            raise RuntimeError(f"mesh-actor creds issue failed ({code}): {err[-2000:]}")
        async with node_process(data_b, "b", *flags, *b_flags, "--nats-creds", str(creds), ready_s=60):
            yield


async def start_model(data_dir: Path, model: Path, ctx: int, node: str | None = None) -> dict[str, Any]:
    """Places and starts `model` (on `node`, or where placement chooses); returns its instance record once ready."""
    on = ("--node", node) if node is not None else ()
    decision = await cli("place", str(model), "-c", str(ctx), *on, "--start", "--json", "--data-dir", str(data_dir))
    instance_id = decision["instance"]["instance_id"]
    async with asyncio.timeout(300):
        while True:
            status = await cli("status", "--json", "--data-dir", str(data_dir))
            for instance in status["instances"]:
                if instance["id"] == instance_id and instance["state"] == "ready":
                    return dict(instance)
            await asyncio.sleep(0.3)


async def timed_generate(data_dir: Path, model: str, prompt: list[int]) -> tuple[float, GenerateResult]:
    """`prompt` through `mesh.generate` (4 tokens, greedy): the client-side time to the first chunk in ms, and the
    reply."""
    bus = await connect(data_dir)
    first: list[float] = []

    async def on_chunk(chunk: GenerateChunk) -> None:
        if not first:
            first.append(time.perf_counter())

    try:
        request = GenerateRequest(
            model=model, prompt=prompt, n_predict=4, sampling=Sampling(temperature=0), timeout_s=3600
        )
        started = time.perf_counter()
        result = await generate(bus, Subjects(), request, on_chunk)
    finally:
        await bus.close()
    return ((first[0] if first else time.perf_counter()) - started) * 1000, result


async def connect(data_dir: Path) -> Bus:
    env = await cli("nats-env", "--json", "--data-dir", str(data_dir))
    options = NatsOptions(urls=(env["url"],), user=env["user"], password=env["password"])
    return await Bus.connect(options, name="benchmark")


def file_digest(path: Path) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(str(path))
    return str(hasher.hexdigest())


def _cpu() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def print_provenance(model: Path) -> None:
    engine = find_llama_server(os.environ.get("MESH_ACTOR_LLAMA_SERVER"))
    version = subprocess.run([str(engine), "--version"], capture_output=True, text=True, timeout=30, check=False)
    lines = [x for x in (version.stdout + version.stderr).splitlines() if x.startswith("version")]
    print("provenance")
    print(f"  cpu           {_cpu()} ({os.cpu_count()} cpus)")
    print(f"  platform      {platform.platform()}")
    print(f"  llama-server  {lines[0] if lines else 'unknown'}; blake3 {file_digest(engine)[:16]}")
    size = model.stat().st_size
    print(f"  model         {model.name}: {size / 2**30:.2f} GiB sparse, blake3 {file_digest(model)[:16]}")
    print(f"  time          {time.strftime('%Y-%m-%d %H:%M:%S')}")
