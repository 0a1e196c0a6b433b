"""Benchmark: a model file pulled from a peer over NATS vs a loopback TCP copy of the same file, same run.

Two files actors on one embedded nats-server (two data dirs on one machine). Node A holds `--size-mib` random
bytes as the file of catalog model `bench` (hashed once before the clock starts, as a node that served it
before would have it cached). Node B pulls it (`mesh.files.b.pull`): the holders asked, the free space checked,
chunks under the server's max_payload, `window` requests in flight, each chunk's blake3 checked, written to the
part file with its journal, the whole file hashed as it lands and verified, fsynced, linked into place.

Baseline: the same file sent over a loopback TCP socket (`socket.sendfile`) into a file that is then fsynced.
Ratio = baseline time / pull time (the issue's target: >= 0.7, like the handoff). Run from the repository root:

    python -m benchmarks.file_transfer [--size-mib 1024] [--rounds 1] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

import structlog

from actors.files.actor import FilesActor
from benchmarks.environment import print_environment
from benchmarks.transfer import running, tcp_copy, write_random
from messages.files import PullReply, PullRequest
from messages.subjects import Subjects
from runtime.allocator import keep_large_buffers
from runtime.bus import Bus
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


async def _pull_round(bus: Bus, root: Path, n: int) -> float:
    data, models = _node(root, f"b{n}")
    b = FilesActor("bench-b", data, models_dir=models)
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
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print_environment()
    print(f"  allocator {keep_large_buffers().reason}")  # what `mesh-actor run` does
    size = args.size_mib * MIB
    base = Path(args.dir) if args.dir else None
    with tempfile.TemporaryDirectory(dir=base, prefix="file-transfer-") as tmp:
        root = Path(tmp)
        data_a, models_a = _node(root, "a")
        source = models_a / "bench.gguf"
        await asyncio.to_thread(write_random, source, size)
        digests = FileDigests()
        await asyncio.to_thread(digests.digest, source)  # a holder hashes a file version once
        server = EmbeddedNats(root / "nats", preferred_port=0)
        creds = await server.start()
        bus = await Bus.connect(creds.options(), name="bench")
        try:
            await ensure_events_stream(bus, S, max_age_s=3600, max_bytes=64 << 20)
            print(f"  max_payload      {bus.max_payload} bytes")
            print(f"  file             {args.size_mib} MiB of random bytes")
            a = FilesActor("bench-a", data_a, models_dir=models_a, digests=digests)
            pull_s: list[float] = []
            tcp_s: list[float] = []
            async with running(bus, a, "bench-a", lambda: a.running):
                for n in range(args.rounds):
                    tcp_s.append(await asyncio.to_thread(tcp_copy, source, root / "tcp.bin"))
                    (root / "tcp.bin").unlink()
                    pull_s.append(await _pull_round(bus, root, n))
        finally:
            await bus.close()
            await server.stop()

    def rate(seconds: float) -> str:
        return f"{size / MIB / seconds:8.0f} MiB/s"

    tcp, pull = statistics.median(tcp_s), statistics.median(pull_s)
    print("results (median of rounds)")
    print(f"  loopback TCP copy + fsync           {tcp:7.3f} s  {rate(tcp)}")
    print(f"  pull over NATS (verified, durable)  {pull:7.3f} s  {rate(pull)}")
    print(f"  ratio pull / TCP (throughput)       {tcp / pull:7.2f}x  (target >= 0.7x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dir", help="where the temporary files go (default: the system temp dir)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
