"""Benchmark: L3 peer fetch over NATS vs a loopback TCP copy of the same bytes, same run, same file.

Two L3 actors on one embedded nats-server (two data dirs on one machine). Node A holds an entry of
`--size-mib` random bytes (ingested before the clock starts). Node B materializes it, which fetches the
manifest and every segment from A (chunks under the server's max_payload, `fetch_window` requests in flight,
each chunk hashed as it arrives), commits the entry to B's store (fsynced) and then assembles it to the
destination file. A second, local materialize on B times the assemble alone; the fetch is the difference.

Baseline: the same file sent over a loopback TCP socket (`socket.sendfile`) into a file that is then
fsynced: what a durable copy between two processes on this machine costs without NATS, hashing or
segments. Ratio = baseline time / fetch time (the issue's target: >= 0.6). Run from the repository root:

    python -m benchmarks.l3_peer_fetch [--size-mib 1024] [--rounds 1] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from actors.l3 import layout
from actors.l3.actor import L3Actor
from actors.l3.api import L3Hit
from actors.l3.store import Store
from benchmarks.environment import print_environment
from benchmarks.transfer import quiet_logs, result_line, running, tcp_copy, transfer_arguments, write_random
from messages.subjects import Subjects
from runtime.allocator import keep_large_buffers
from runtime.bus import Bus
from runtime.embedded import EmbeddedNats
from runtime.journal import ensure_events_stream

MIB = 1024 * 1024
IDENTITY = "1d" * 32
TOKENS = tuple(range(1, 4097))


async def _fetch_round(bus: Bus, root: Path, size: int, n: int) -> tuple[float, float]:
    """(seconds for B's peer materialize, seconds for its local materialize afterwards)."""
    b_dir = root / f"b{n}"
    budget = 4 * size + (64 * MIB)
    b = L3Actor("bench-b", b_dir, budget_bytes=budget)
    async with running(bus, b, "bench-b", lambda: b.running):
        async with asyncio.timeout(60):
            while True:  # until B has seen A's inventory
                hit = await b.lookup(IDENTITY, [*TOKENS, 1], max_tokens=len(TOKENS))
                if hit is not None:
                    break
                await asyncio.sleep(0.05)
        assert hit.source == "l3_peer", hit
        started = time.perf_counter()
        await b.materialize(hit, root / f"peer{n}.bin", deadline_s=600)
        peer = time.perf_counter() - started
        local_hit = L3Hit(entry=hit.entry, n_tokens=hit.n_tokens, bytes=hit.bytes, node="bench-b", source="l3_local")
        started = time.perf_counter()
        await b.materialize(local_hit, root / f"local{n}.bin", deadline_s=600)
        local = time.perf_counter() - started
    for name in (f"peer{n}.bin", f"local{n}.bin"):
        (root / name).unlink()
    await asyncio.to_thread(shutil.rmtree, b_dir)
    return peer, local


async def main_async(args: argparse.Namespace) -> None:
    quiet_logs()
    print_environment()
    print(f"  allocator {keep_large_buffers().reason}")  # what `mesh-actor run` does
    size = args.size_mib * MIB
    base = Path(args.dir) if args.dir else None
    with tempfile.TemporaryDirectory(dir=base, prefix="l3-peer-fetch-") as tmp:
        root = Path(tmp)
        source = root / "slot.bin"
        await asyncio.to_thread(write_random, source, size)
        a_dir = root / "a"
        store = Store(a_dir / "l3")
        await asyncio.to_thread(store.ingest, source, identity=IDENTITY, tokens=TOKENS, payload_kind="llama_slot")
        server = EmbeddedNats(root / "nats", preferred_port=0)
        creds = await server.start()
        bus = await Bus.connect(creds.options(), name="bench")
        try:
            await ensure_events_stream(bus, Subjects(), max_age_s=3600, max_bytes=64 << 20)
            print(f"  max_payload      {bus.max_payload} bytes; segment {layout.DEFAULT_SEGMENT_BYTES // MIB} MiB")
            print(f"  payload          {args.size_mib} MiB of random bytes, {len(TOKENS)} tokens")
            a = L3Actor("bench-a", a_dir, budget_bytes=4 * size)
            fetch_s: list[float] = []
            assemble_s: list[float] = []
            tcp_s: list[float] = []
            async with running(bus, a, "bench-a", lambda: a.running):
                for n in range(args.rounds):
                    tcp_s.append(await asyncio.to_thread(tcp_copy, source, root / "tcp.bin"))
                    (root / "tcp.bin").unlink()
                    peer, local = await _fetch_round(bus, root, size, n)
                    fetch_s.append(peer - local)
                    assemble_s.append(local)
        finally:
            await bus.close()
            await server.stop()

    tcp, fetch, assemble = (statistics.median(v) for v in (tcp_s, fetch_s, assemble_s))
    print("results (median of rounds)")
    print(result_line("loopback TCP copy + fsync", size, tcp, 30))
    print(result_line("peer fetch over NATS (durable)", size, fetch, 30))
    print(result_line("then assemble to dest (local)", size, assemble, 30))
    print(f"  ratio fetch / TCP (throughput) {tcp / fetch:7.2f}x  (target >= 0.6x)")
    print(f"  ratio fetch+assemble / TCP     {tcp / (fetch + assemble):7.2f}x")


def main() -> None:
    asyncio.run(main_async(transfer_arguments(__doc__).parse_args()))


if __name__ == "__main__":
    main()
