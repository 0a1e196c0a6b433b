"""Benchmark: a model file pulled from a peer over the direct data path (plain and mutual TLS) and over NATS, vs a
loopback TCP copy of the same file without fsync, same run.

Files actors on one embedded nats-server. The holder runs in a child process (two nodes on one machine, as a
deployment has them: one event loop each) with two files actors on the same models dir: `bench-a` (its data
listener on loopback, tickets only) and `bench-at` (mutual TLS under a cluster CA, as a node with cluster
certificates). It holds `--size-mib` random bytes as the file of catalog model `bench` (hashed once before the
clock starts, as a node that served it before has it cached). This process, node B, pulls it
(`mesh.files.b.pull`): the holder asked, the free space checked, a ticket asked on `.offer`, the range on a TCP
stream, each chunk's blake3 checked as it lands, written to the part file with its journal, the whole file hashed
and verified, fsynced, linked into place. `--nats` adds a pull over NATS chunk requests (no data path).

Baseline: the same file sent over a loopback TCP socket (`socket.sendfile`) into a file, not fsynced. Rounds are
interleaved (TCP copy, direct, direct TLS[, NATS]; a `sync` before each) and ratios are taken on medians:
ratio = baseline time / pull time (the issue's target: >= 0.8 for the direct path). CPU seconds per GiB for each
process: the puller (this process, `getrusage`), the holder and nats-server (`/proc/<pid>/stat`). Put `--dir` on
a tmpfs to take the disk's fsync out of the pull (the baseline has none). Run from the repository root:

    python -m benchmarks.file_transfer [--size-mib 1024] [--rounds 3] [--dir DIR] [--window 8] [--nats]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from actors.files.actor import FilesActor, FilesLimits
from benchmarks.environment import print_environment
from benchmarks.transfer import (
    cpu_seconds,
    quiet_logs,
    rate,
    result_line,
    running,
    tcp_copy,
    transfer_arguments,
    write_random,
)
from messages.files import PullReply, PullRequest
from messages.subjects import Subjects
from runtime.allocator import keep_large_buffers
from runtime.bus import Bus
from runtime.config import NatsOptions
from runtime.datapath import DataPathConfig
from runtime.embedded import EmbeddedNats
from runtime.journal import ensure_events_stream
from runtime.model_files import FileDigests
from runtime.tls import TlsFiles, ensure_route_certificates

MIB = 1024 * 1024
GIB = 1024 * MIB
SECRET = "bench-cluster-secret"
NAMES = ["127.0.0.1", "localhost"]
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
    tls = TlsFiles(*(Path(p) for p in spec["tls"]))
    bus = await Bus.connect(options, name="bench a")
    try:
        plain = FilesActor("bench-a", data, models_dir=models, digests=digests, datapath=DataPathConfig())
        mtls = FilesActor(
            "bench-at", data, models_dir=models, digests=digests, datapath=DataPathConfig(bind="127.0.0.1", tls=tls)
        )
        async with (
            running(bus, plain, "bench-a", lambda: plain.running),
            running(bus, mtls, "bench-at", lambda: mtls.running),
        ):
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


MODES: dict[str, str] = {  # mode -> the holder that serves it
    "direct": "bench-a",
    "direct_tls": "bench-at",
    "nats": "bench-a",
}


async def _pull_round(
    bus: Bus, root: Path, n: int, limits: FilesLimits, mode: str, tls: TlsFiles
) -> tuple[float, float]:
    """(seconds, this process's CPU seconds) of one pull by a fresh node B over `mode`."""
    data, models = _node(root, f"b{n}-{mode}")
    datapath = None if mode == "nats" else DataPathConfig(tls=tls if mode == "direct_tls" else None)
    b = FilesActor("bench-b", data, models_dir=models, limits=limits, datapath=datapath)
    async with running(bus, b, "bench-b", lambda: b.running):
        cpu = _own_cpu()
        started = time.perf_counter()
        reply = await bus.request(
            S.files("bench-b", "pull"), PullRequest(name="bench", peer=MODES[mode]), PullReply, timeout=3600
        )
        took = time.perf_counter() - started
        cpu = _own_cpu() - cpu
    assert reply.moved_bytes == reply.size and not reply.already, reply
    assert reply.transport == mode, reply
    (models / "bench.gguf").unlink()
    return took, cpu


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _tcp_round(source: Path, dest: Path) -> tuple[float, float]:
    cpu = _own_cpu()
    took = tcp_copy(source, dest, fsync=False)
    return took, _own_cpu() - cpu


async def main_async(args: argparse.Namespace) -> None:
    quiet_logs()
    print_environment()
    print(f"  allocator {keep_large_buffers().reason}")  # what `mesh-actor run` does
    size = args.size_mib * MIB
    limits = FilesLimits(window=args.window, keep_free_bytes=0)
    base = Path(args.dir) if args.dir else None
    modes = ["direct", "direct_tls", *(["nats"] if args.nats else [])]
    times: dict[str, list[float]] = {m: [] for m in ["tcp", *modes]}
    cpu: dict[str, dict[str, list[float]]] = {m: {"puller": [], "holder": [], "nats-server": []} for m in times}
    with tempfile.TemporaryDirectory(dir=base, prefix="file-transfer-") as tmp:
        root = Path(tmp)
        data_a, models_a = _node(root, "a")
        source = models_a / "bench.gguf"
        await asyncio.to_thread(write_random, source, size)
        holder_tls = ensure_route_certificates(root / "tls-a", SECRET, NAMES)
        puller_tls = ensure_route_certificates(root / "tls-b", SECRET, NAMES)
        server = EmbeddedNats(root / "nats", preferred_port=0)
        creds = await server.start()
        options = creds.options()
        bus = await Bus.connect(options, name="bench b")
        try:
            await ensure_events_stream(bus, S, max_age_s=3600, max_bytes=64 << 20)
            print(f"  max_payload      {bus.max_payload} bytes")
            print(f"  file             {args.size_mib} MiB of random bytes")
            print(f"  files under      {root.parent}")
            spec = {
                "urls": list(options.urls),
                "user": options.user,
                "password": options.password,
                "token": options.token,
                "data": str(data_a),
                "models": str(models_a),
                "tls": [str(holder_tls.ca), str(holder_tls.cert), str(holder_tls.key)],
            }
            holder = await _HolderProcess.start(spec)
            pids = {"holder": holder.child.pid, "nats-server": server.pid}
            try:
                for n in range(args.rounds):  # interleaved: the machine's drift hits every path alike
                    for mode in ["tcp", *modes]:
                        await asyncio.to_thread(os.sync)
                        others = {name: cpu_seconds(pid) for name, pid in pids.items() if pid is not None}
                        if mode == "tcp":
                            took, own = await asyncio.to_thread(_tcp_round, source, root / "tcp.bin")
                            (root / "tcp.bin").unlink()
                        else:
                            took, own = await _pull_round(bus, root, n, limits, mode, puller_tls)
                        times[mode].append(took)
                        cpu[mode]["puller"].append(own)
                        for name, before in others.items():
                            cpu[mode][name].append(cpu_seconds(pids[name] or 0) - before)
            finally:
                await holder.stop()
        finally:
            await bus.close()
            await server.stop()

    print(f"rounds ({args.rounds}: {', '.join(['TCP copy', *modes])}; sync before each)")
    for i in range(args.rounds):
        tcp = times["tcp"][i]
        line = ", ".join(f"{m} {rate(size, times[m][i])} ({tcp / times[m][i]:.2f}x)" for m in modes)
        print(f"  round {i + 1}: TCP {rate(size, tcp)}; {line}")
    tcp = statistics.median(times["tcp"])
    labels = {
        "direct": "pull, direct (ticket, plain TCP)",
        "direct_tls": "pull, direct (mutual TLS)",
        "nats": "pull over NATS chunks",
    }
    print("results (medians)")
    print(result_line("loopback TCP copy, no fsync", size, tcp))
    for mode in modes:
        print(result_line(labels[mode], size, statistics.median(times[mode])))
    for mode in modes:
        ratio = tcp / statistics.median(times[mode])
        target = "  (target >= 0.8x)" if mode.startswith("direct") else ""
        print(f"  ratio {mode + ' / TCP':<30} {ratio:7.2f}x{target}")
    print("CPU seconds per GiB (medians; the TCP copy's sender and receiver are both this process)")
    print(f"  {'':<12} {'puller':>8} {'holder':>8} {'nats-server':>12}")
    for mode in ["tcp", *modes]:
        cells = [statistics.median(cpu[mode][p]) * GIB / size if cpu[mode][p] else 0.0 for p in cpu[mode]]
        print(f"  {mode:<12} {cells[0]:8.2f} {cells[1]:8.2f} {cells[2]:12.2f}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--as-holder":
        asyncio.run(_holder(json.loads(sys.argv[2])))
        return
    parser = transfer_arguments(__doc__, rounds=3)
    parser.add_argument("--window", type=int, default=FilesLimits().window, help="chunk requests in flight")
    parser.add_argument("--nats", action="store_true", help="also pull over NATS chunk requests")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
