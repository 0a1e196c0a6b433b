"""Benchmark: predicted vs measured handoff time over a sweep of sizes (the issue's target: error <= 15%).

Two handoff actors on one embedded nats-server, one process (node A's and node B's actors each on their own
connection). Each round runs the link probe the operator runs (`mesh.handoff.bench-a.probe`, as `mesh-actor
handoff bench` sends it: a warm-up, then one handoff of 256 KiB and one of `--probe-mib`), then one handoff of
each size in `--sizes-mib` (random bytes, the same path as a probe's: credits, every segment hashed and
verified, the commit judged; nothing restored). The probes of every round are fitted together to
`seconds = fixed + bytes / rate` (`cost.fit_link`, as the router fits them), so probe and sweep see the machine
alike (this VM's speed drifts by 20% between minutes), and each size's median is compared with the fit.
Run from the repository root:

    python -m benchmarks.handoff_predict [--sizes-mib 1,4,16,64,128,256] [--probe-mib 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import structlog

from actors.handoff import cost
from actors.handoff.actor import HandoffActor, HandoffLimits
from actors.handoff.probe import PROBE_IDENTITY, blocks
from benchmarks.environment import print_environment
from benchmarks.transfer import running
from messages.handoff import PROBE_PAYLOAD_KIND, LinkProbe, LinkProbeResult
from messages.subjects import Subjects
from runtime.allocator import keep_large_buffers
from runtime.bus import Bus
from runtime.embedded import EmbeddedNats
from runtime.journal import ensure_events_stream

MIB = 1024 * 1024
SEGMENT = 32 * MIB


async def _timed_handoff(a: HandoffActor, block: bytes, size: int) -> float:
    started = time.perf_counter()
    await a.send(
        "bench-b", blocks(block, size), identity=PROBE_IDENTITY, n_tokens=0, payload_kind=PROBE_PAYLOAD_KIND,
        max_bytes=size,
    )  # fmt: skip
    return time.perf_counter() - started


async def main_async(args: argparse.Namespace) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print_environment()
    print(f"  allocator {keep_large_buffers().reason}")  # what `mesh-actor run` does
    sizes = [int(s) * MIB for s in args.sizes_mib.split(",")]
    limits = HandoffLimits(segment_bytes=SEGMENT, idle_timeout_s=30.0)
    block = os.urandom(SEGMENT)
    with tempfile.TemporaryDirectory(prefix="handoff-predict-", dir=args.dir) as tmp:
        root = Path(tmp)
        server = EmbeddedNats(root / "nats", preferred_port=0)
        options = (await server.start()).options()
        bus_a = await Bus.connect(options, name="bench a")
        bus_b = await Bus.connect(options, name="bench b")
        try:
            await ensure_events_stream(bus_a, Subjects(), max_age_s=3600, max_bytes=64 << 20)
            a = HandoffActor("bench-a", root / "a", limits=limits)
            b = HandoffActor("bench-b", root / "b", limits=limits)
            async with running(bus_b, b, b.node_id, lambda: b.running), running(bus_a, a, a.node_id, lambda: a.running):
                probe = LinkProbe(peer="bench-b", bytes=args.probe_mib * MIB, rounds=1)
                probed: list[tuple[int, float]] = []
                measured: dict[int, list[float]] = {size: [] for size in sizes}
                for _ in range(args.rounds):  # a probe, then every size: both see the machine as it is then
                    result = await bus_a.request(
                        Subjects().handoff("bench-a", "probe"), probe, LinkProbeResult, timeout=600
                    )
                    probed += result.samples
                    for size in sizes:
                        measured[size].append(await _timed_handoff(a, block, size))
                link = cost.fit_link(probed)
                assert link is not None
        finally:
            await bus_a.close()
            await bus_b.close()
            await server.stop()

    print(f"  segments         {SEGMENT // MIB} MiB; credit window {limits.window_bytes // MIB} MiB; one process")
    print(
        f"probes (256 KiB and {args.probe_mib} MiB, one of each per round, fitted together): "
        f"{link.bytes_per_s / MIB:.1f} MiB/s, fixed {link.fixed_s * 1000:.1f} ms"
    )
    for size, seconds in probed:
        print(f"  probe sample {size / MIB:9.2f} MiB  {seconds * 1000:9.1f} ms")
    print(f"{'size MiB':>9} {'predicted ms':>13} {'measured ms (median)':>21} {'min..max ms':>17} {'error':>7}")
    worst = 0.0
    for size in sizes:
        predicted = link.fixed_s + size / link.bytes_per_s
        median = statistics.median(measured[size])
        error = abs(median - predicted) / median
        worst = max(worst, error)
        spread = f"{min(measured[size]) * 1000:.1f}..{max(measured[size]) * 1000:.1f}"
        print(f"{size / MIB:9.0f} {predicted * 1000:13.1f} {median * 1000:21.1f} {spread:>17} {100 * error:6.1f}%")
    print(f"worst error {100 * worst:.1f}% (target <= 15%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="1,4,16,64,128,256")
    ap.add_argument("--probe-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the temporary files go (default: the system temp dir)")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
