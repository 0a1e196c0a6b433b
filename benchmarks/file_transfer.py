"""Benchmark: a model file pulled from a peer over NATS vs a loopback TCP copy of the same file, same run.

Two files actors on one embedded nats-server, each in its own process (two nodes on one machine, as a
deployment has them: one event loop each). Node A, the holder, runs in a child process and holds `--size-mib`
random bytes as the file of catalog model `bench` (hashed once before the clock starts, as a node that served it
before would have it cached). Node B, in this process, pulls it (`mesh.files.b.pull`): the holders asked, the
free space checked, chunks under the server's max_payload, `window` requests in flight, each chunk's blake3
checked, written to the part file with its journal, the whole file hashed as it lands and verified, fsynced,
linked into place. Both apply the allocator policy of `mesh-actor run`.

Baseline: the same file sent over a loopback TCP socket (`socket.sendfile`) into a file that is then fsynced.
Rounds are interleaved (TCP copy, pull; a `sync` before each) and the ratio is taken on medians:
ratio = baseline time / pull time (the issue's target: >= 0.7, like the handoff). Run from the repository root:

    python -m benchmarks.file_transfer [--size-mib 1024] [--rounds 3] [--dir DIR] [--window 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from actors.files.actor import FilesActor, FilesLimits
from benchmarks.environment import print_environment
from benchmarks.handoff_throughput import publish_ceiling
from benchmarks.transfer import quiet_logs, rate, result_line, running, tcp_copy, transfer_arguments, write_random
from messages.files import PullReply, PullRequest
from messages.subjects import Subjects
from runtime.allocator import keep_large_buffers
from runtime.bus import Bus
from runtime.config import NatsOptions
from runtime.embedded import EmbeddedNats
from runtime.journal import ensure_events_stream
from runtime.model_files import FileDigests

MIB = 1024 * 1024
CATALOG = '[models.bench]\npath = "bench.gguf"\n'
S = Subjects()


def _node(root: Path, name: str) -> tuple[Path, Path]:
    data = root / name
    (data / "models").mkdir(parents=True, exist_ok=True)
    (data / "models.toml").write_text(CATALOG)
    return data, data / "models"


async def _holder(spec: dict[str, Any]) -> None:
    """Node A in its own process: serves its file until stdin closes."""
    quiet_logs()
    keep_large_buffers()  # what `mesh-actor run` does
    options = NatsOptions(urls=tuple(spec["urls"]), user=spec["user"], password=spec["password"], token=spec["token"])
    data, models = Path(spec["data"]), Path(spec["models"])
    digests = FileDigests()
    await asyncio.to_thread(digests.digest, models / "bench.gguf")  # a holder hashes a file version once
    bus = await Bus.connect(options, name="bench a")
    try:
        a = FilesActor("bench-a", data, models_dir=models, digests=digests)
        async with running(bus, a, "bench-a", lambda: a.running):
            print(json.dumps({"ready": True}), flush=True)
            while await asyncio.to_thread(sys.stdin.readline):
                pass
    finally:
        await bus.close()


class _HolderProcess:
    """Node A's process, started once for every round."""

    def __init__(self, child: asyncio.subprocess.Process) -> None:
        self.child = child

    @classmethod
    async def start(cls, spec: dict[str, Any]) -> _HolderProcess:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.file_transfer",
            "--as-holder",
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        holder = cls(child)
        try:
            assert child.stdout is not None
            async with asyncio.timeout(120):
                line = await child.stdout.readline()
            if not line:
                raise RuntimeError(f"the holder's process ended (exit {await child.wait()})")
        except BaseException:
            await holder.stop()
            raise
        return holder

    async def stop(self) -> None:
        if self.child.stdin is not None:
            self.child.stdin.close()
        try:
            async with asyncio.timeout(30):
                await self.child.wait()
        except TimeoutError:
            self.child.kill()
            await self.child.wait()


async def _pull_round(bus: Bus, root: Path, n: int, limits: FilesLimits) -> float:
    data, models = _node(root, f"b{n}")
    b = FilesActor("bench-b", data, models_dir=models, limits=limits)
    async with running(bus, b, "bench-b", lambda: b.running):
        started = time.perf_counter()
        reply = await bus.request(
            S.files("bench-b", "pull"), PullRequest(name="bench", peer="bench-a"), PullReply, timeout=3600
        )
        took = time.perf_counter() - started
    assert reply.moved_bytes == reply.size and not reply.already, reply
    (models / "bench.gguf").unlink()
    return took


async def main_async(args: argparse.Namespace) -> None:
    quiet_logs()
    print_environment()
    print(f"  allocator {keep_large_buffers().reason}")  # what `mesh-actor run` does
    size = args.size_mib * MIB
    limits = FilesLimits(window=args.window)
    base = Path(args.dir) if args.dir else None
    pull_s: list[float] = []
    tcp_s: list[float] = []
    with tempfile.TemporaryDirectory(dir=base, prefix="file-transfer-") as tmp:
        root = Path(tmp)
        data_a, models_a = _node(root, "a")
        source = models_a / "bench.gguf"
        await asyncio.to_thread(write_random, source, size)
        server = EmbeddedNats(root / "nats", preferred_port=0)
        creds = await server.start()
        options = creds.options()
        bus = await Bus.connect(options, name="bench b")
        try:
            await ensure_events_stream(bus, S, max_age_s=3600, max_bytes=64 << 20)
            print(f"  max_payload      {bus.max_payload} bytes")
            print(f"  file             {args.size_mib} MiB of random bytes")
            print(f"  window           {limits.window} chunk requests in flight")
            spec = {
                "urls": list(options.urls),
                "user": options.user,
                "password": options.password,
                "token": options.token,
                "data": str(data_a),
                "models": str(models_a),
            }
            holder = await _HolderProcess.start(spec)
            try:
                for n in range(args.rounds):  # interleaved: the machine's drift hits both alike
                    await asyncio.to_thread(os.sync)
                    tcp_s.append(await asyncio.to_thread(tcp_copy, source, root / "tcp.bin"))
                    (root / "tcp.bin").unlink()
                    await asyncio.to_thread(os.sync)
                    pull_s.append(await _pull_round(bus, root, n, limits))
            finally:
                await holder.stop()
            ceiling = await publish_ceiling(options, source, size)
        finally:
            await bus.close()
            await server.stop()

    print(f"rounds ({args.rounds}: TCP copy, pull; sync before each)")
    for i, (t, p) in enumerate(zip(tcp_s, pull_s, strict=True), 1):
        print(f"  round {i}: TCP {rate(size, t)}, pull {rate(size, p)};  ratio {t / p:.2f}")
    tcp, pull = statistics.median(tcp_s), statistics.median(pull_s)
    print("results (medians)")
    print(result_line("loopback TCP copy + fsync", size, tcp))
    print(result_line("pull over NATS (verified, durable)", size, pull))
    print(result_line("NATS client publish ceiling", size, ceiling) + "  (no subscriber, no pull)")
    print(f"  ratio pull / TCP (throughput)        {tcp / pull:7.2f}x  (target >= 0.7x)")
    # Every byte of a pull is published once by the holder's client: the pull cannot beat that ceiling.
    print(f"  ratio ceiling / TCP (best possible)  {tcp / ceiling:7.2f}x")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--as-holder":
        asyncio.run(_holder(json.loads(sys.argv[2])))
        return
    parser = transfer_arguments(__doc__, rounds=3)
    parser.add_argument("--window", type=int, default=FilesLimits().window, help="chunk requests in flight")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
