"""Benchmark: a KV handoff over the direct data path (plain and mutual TLS) and over NATS with credits, vs a
loopback TCP copy without fsync, same run.

Handoff actors on one embedded nats-server, the senders in a child process (as two nodes would be). Node A
sends `--size-mib` of random bytes from a finished file to node B, which stages every chunk (pwrite), hashes
every segment, judges the commit (tiling, counts, payload digest) and restores: here the restore hook fsyncs the
staged file (put `--dir` on a tmpfs to take the disk's fsync out; the baseline has none). Three paths, each a
sender and receiver pair: `direct` (the chunks pushed on a stream to B's data listener, loopback, ticket only),
`direct_tls` (the same inside mutual TLS under a cluster CA), and, with `--nats`, `nats` (every chunk published,
credits). Open, credits and commit are on NATS for all three. Both processes apply the allocator policy
`mesh-actor run` applies.

Baseline: the file sent over a loopback TCP socket (`socket.sendfile`) into a file, not fsynced. Rounds are
interleaved (TCP copy, then each path; a `sync` before each) and ratios are taken on medians: ratio = baseline
time / handoff time (the issue's target for the direct path: >= 0.8). CPU seconds per GiB per process: the
receiver (this process, `getrusage`), the sender and nats-server (`/proc/<pid>/stat`). With `--nats` the run also
measures a raw NATS blast without flow control and the NATS client's publish ceiling. Run from the repository
root:

    python -m benchmarks.handoff_throughput [--size-mib 1024] [--rounds 3] [--window-mib 32] [--nats]
        [--default-allocator] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import blake3
import nats
import nats.errors
import structlog

from actors.handoff.actor import CommittedHandoff, HandoffActor, HandoffLimits, chunk_bytes
from benchmarks.environment import print_environment
from benchmarks.transfer import cpu_seconds, running, tcp_copy, write_random
from messages.subjects import Subjects
from runtime.allocator import keep_large_buffers
from runtime.bus import Bus
from runtime.config import NatsOptions
from runtime.datapath import DataPathConfig
from runtime.embedded import EmbeddedNats
from runtime.journal import ensure_events_stream
from runtime.tls import TlsFiles, ensure_route_certificates

MIB = 1024 * 1024
GIB = 1024 * MIB
IDENTITY = "1d" * 32
SEGMENT = 32 * MIB
SECRET = "bench-cluster-secret"
NAMES = ["127.0.0.1", "localhost"]
#: path -> (sender, receiver) node ids
PAIRS: dict[str, tuple[str, str]] = {
    "direct": ("bench-ad", "bench-b"),
    "direct_tls": ("bench-at", "bench-bt"),
    "nats": ("bench-a", "bench-b"),
}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _durable(state: CommittedHandoff) -> str | None:
    await asyncio.to_thread(_fsync, state.path)
    return None


def _read(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(length)


async def _segments_of(path: Path, size: int) -> AsyncIterator[bytes]:
    for offset in range(0, size, SEGMENT):
        yield await asyncio.to_thread(_read, path, offset, min(SEGMENT, size - offset))


async def _blast(options: Any, source: Path, size: int, dest: Path) -> tuple[float, int, int, int]:
    """(seconds until the last message arrived or the flow went quiet, messages sent, received, slow-consumer
    errors): the bytes published with no flow control to a subscriber doing the receiver's work."""
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    kwargs: dict[str, Any] = {"error_cb": on_error}
    if options.user:
        kwargs.update(user=options.user, password=options.password or "")
    if options.token:
        kwargs["token"] = options.token
    publisher = await nats.connect(list(options.urls), **kwargs)
    consumer = await nats.connect(list(options.urls), **kwargs)
    step = chunk_bytes(publisher.max_payload)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    hasher = blake3.blake3()
    received = 0
    last = time.perf_counter()
    done = asyncio.Event()
    total = (size + step - 1) // step
    work: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        nonlocal received, last
        received += 1
        last = time.perf_counter()
        work.put_nowait((int(msg.headers["Offset"]), msg.data))
        if received == total:
            done.set()

    async def writer() -> None:
        while True:
            offset, data = await work.get()
            await asyncio.to_thread(_write_hash, fd, hasher, data, offset)
            work.task_done()

    sub = await consumer.subscribe("bench.blast", cb=on_msg)  # the client's default pending limits
    await consumer.flush()
    write_task = asyncio.create_task(writer())
    started = time.perf_counter()
    sent = 0
    try:
        with source.open("rb") as f:
            for offset in range(0, size, step):
                data = f.read(step)
                await publisher.publish("bench.blast", data, headers={"Offset": str(offset)})
                sent += 1
        await publisher.flush(timeout=60)
        while not done.is_set() and time.perf_counter() - last < 2.0:  # quiet for 2 s: the rest was dropped
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await done.wait()
        elapsed = last - started
        async with asyncio.timeout(60):
            await work.join()
    finally:
        write_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await write_task
        os.close(fd)
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
        await publisher.close()
        await consumer.close()
    slow = sum(1 for e in errors if isinstance(e, nats.errors.SlowConsumerError))
    return elapsed, sent, received, slow


async def publish_ceiling(options: Any, source: Path, size: int) -> float:
    """Seconds to publish the file in chunks to a subject with no subscriber (the client's ceiling)."""
    kwargs: dict[str, Any] = {}
    if options.user:
        kwargs.update(user=options.user, password=options.password or "")
    if options.token:
        kwargs["token"] = options.token
    publisher = await nats.connect(list(options.urls), **kwargs)
    try:
        step = chunk_bytes(publisher.max_payload)
        chunks = []
        with source.open("rb") as f:
            for _ in range(0, min(size, 256 * MIB), step):  # a quarter GiB is enough for a rate
                chunks.append(f.read(step))
        started = time.perf_counter()
        for chunk in chunks:
            await publisher.publish("bench.nobody", chunk, headers={"Offset": "0"})
        await publisher.flush(timeout=60)
        return (time.perf_counter() - started) * size / sum(len(c) for c in chunks)
    finally:
        await publisher.close()


def _write_hash(fd: int, hasher: Any, data: bytes, offset: int) -> None:
    os.pwrite(fd, data, offset)
    hasher.update(data)


def _serving(actor: HandoffActor) -> Callable[[], bool]:
    return lambda: actor.running


async def _sender(spec: dict[str, Any]) -> None:
    """The sending node, in its own process: for each path named on stdin, one send from the file, its time as
    one JSON line."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if spec["allocator"]:
        keep_large_buffers()  # what `mesh-actor run` does
    options = NatsOptions(urls=tuple(spec["urls"]), user=spec["user"], password=spec["password"], token=spec["token"])
    limits = HandoffLimits(segment_bytes=SEGMENT, idle_timeout_s=30.0, window_bytes=spec["window"])
    source, size, root = Path(spec["source"]), int(spec["size"]), Path(spec["root"])
    tls = TlsFiles(*(Path(p) for p in spec["tls"]))
    datapaths = {"direct": DataPathConfig(), "direct_tls": DataPathConfig(bind="127.0.0.1", tls=tls), "nats": None}
    bus = await Bus.connect(options, name="bench a")
    try:
        senders = {
            path: HandoffActor(PAIRS[path][0], root / PAIRS[path][0], limits=limits, datapath=datapaths[path])
            for path in PAIRS
        }
        async with contextlib.AsyncExitStack() as stack:
            for actor in senders.values():
                await stack.enter_async_context(running(bus, actor, actor.node_id, _serving(actor)))
            print(json.dumps({"ready": True}), flush=True)
            while line := (await asyncio.to_thread(sys.stdin.readline)).strip():
                started = time.perf_counter()
                report = await senders[line].send(PAIRS[line][1], source, identity=IDENTITY, n_tokens=1)
                took = time.perf_counter() - started
                assert report.bytes == size and report.transport == line, report
                print(json.dumps({"seconds": took}), flush=True)
    finally:
        await bus.close()


class _SenderProcess:
    """The sending node's process, driven one round at a time (so each round's TCP copy runs between them)."""

    def __init__(self, child: asyncio.subprocess.Process) -> None:
        self.child = child

    @classmethod
    async def start(cls, spec: dict[str, Any]) -> _SenderProcess:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.handoff_throughput",
            "--as-sender",
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        sender = cls(child)
        try:
            await sender._line(120)
        except BaseException:
            await sender.stop()
            raise
        return sender

    async def _line(self, timeout_s: float) -> dict[str, float]:
        assert self.child.stdout is not None
        async with asyncio.timeout(timeout_s):
            line = await self.child.stdout.readline()
        if not line:
            raise RuntimeError(f"the sending process ended (exit {await self.child.wait()})")
        result: dict[str, float] = json.loads(line)
        return result

    async def send(self, path: str) -> float:
        assert self.child.stdin is not None
        self.child.stdin.write(path.encode() + b"\n")
        await self.child.stdin.drain()
        return (await self._line(600))["seconds"]

    async def stop(self) -> None:
        if self.child.stdin is not None:
            self.child.stdin.close()
        try:
            async with asyncio.timeout(30):
                await self.child.wait()
        except TimeoutError:
            self.child.kill()
            await self.child.wait()


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main_async(args: argparse.Namespace) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print_environment()
    policy = keep_large_buffers() if not args.default_allocator else None  # what `mesh-actor run` does
    size = args.size_mib * MIB
    base = Path(args.dir) if args.dir else None
    window = args.window_mib * MIB
    budget = max(HandoffLimits().credit_budget_bytes, window + 8 * MIB)  # one session gets the whole window
    limits = HandoffLimits(segment_bytes=SEGMENT, idle_timeout_s=30.0, window_bytes=window, credit_budget_bytes=budget)
    paths = ["direct", "direct_tls", *(["nats"] if args.nats else [])]
    times: dict[str, list[float]] = {p: [] for p in ["tcp", *paths]}
    cpu: dict[str, dict[str, list[float]]] = {p: {"receiver": [], "sender": [], "nats-server": []} for p in times}
    with tempfile.TemporaryDirectory(dir=base, prefix="handoff-bench-") as tmp:
        root = Path(tmp)
        source = root / "slot.bin"
        await asyncio.to_thread(write_random, source, size)
        sender_tls = ensure_route_certificates(root / "tls-a", SECRET, NAMES)
        receiver_tls = ensure_route_certificates(root / "tls-b", SECRET, NAMES)
        server = EmbeddedNats(root / "nats", preferred_port=0)
        creds = await server.start()
        options = creds.options()
        bus_b = await Bus.connect(options, name="bench b")
        try:
            await ensure_events_stream(bus_b, Subjects(), max_age_s=3600, max_bytes=64 << 20)
            print(f"  max_payload      {bus_b.max_payload} bytes; chunk {chunk_bytes(bus_b.max_payload)} bytes")
            print(f"  payload          {args.size_mib} MiB of random bytes, segments of {SEGMENT // MIB} MiB")
            print(f"  credit window    {window // MIB} MiB (receiver's budget {budget // MIB} MiB)")
            print(f"  allocator        {policy.reason if policy else 'defaults (--default-allocator)'}")
            print(f"  files under      {root.parent}")
            b = HandoffActor("bench-b", root / "b", limits=limits, restore=_durable, datapath=DataPathConfig())
            bt = HandoffActor(
                "bench-bt", root / "bt", limits=limits, restore=_durable,
                datapath=DataPathConfig(bind="127.0.0.1", tls=receiver_tls),
            )  # fmt: skip
            async with (
                running(bus_b, b, b.node_id, lambda: b.running),
                running(bus_b, bt, bt.node_id, lambda: bt.running),
            ):
                spec = {
                    "urls": list(options.urls),
                    "user": options.user,
                    "password": options.password,
                    "token": options.token,
                    "window": limits.window_bytes,
                    "source": str(source),
                    "root": str(root),
                    "size": size,
                    "allocator": policy is not None,
                    "tls": [str(sender_tls.ca), str(sender_tls.cert), str(sender_tls.key)],
                }
                sender = await _SenderProcess.start(spec)
                pids = {"sender": sender.child.pid, "nats-server": server.pid}
                try:
                    for _ in range(args.rounds):  # interleaved: the machine's drift hits every path alike
                        for path in ["tcp", *paths]:
                            await asyncio.to_thread(os.sync)
                            others = {name: cpu_seconds(pid) for name, pid in pids.items() if pid is not None}
                            own = _own_cpu()
                            if path == "tcp":
                                took = await asyncio.to_thread(tcp_copy, source, root / "tcp.bin", fsync=False)
                                (root / "tcp.bin").unlink()
                            else:
                                took = await sender.send(path)
                            times[path].append(took)
                            cpu[path]["receiver"].append(_own_cpu() - own)
                            for name, before in others.items():
                                cpu[path][name].append(cpu_seconds(pids[name] or 0) - before)
                finally:
                    await sender.stop()
            if args.nats:
                blast_s, sent, received, slow = await _blast(options, source, size, root / "blast.bin")
                ceiling = await publish_ceiling(options, source, size)
        finally:
            await bus_b.close()
            await server.stop()

    def rate(seconds: float) -> str:
        return f"{size / MIB / seconds:8.0f} MiB/s"

    print(f"rounds ({args.rounds}: {', '.join(['TCP copy', *paths])}, each a handoff from the file; sync before each)")
    for i in range(args.rounds):
        tcp = times["tcp"][i]
        line = ", ".join(f"{p} {rate(times[p][i])} ({tcp / times[p][i]:.2f}x)" for p in paths)
        print(f"  round {i + 1}: TCP {rate(tcp)}; {line}")
    tcp_s = statistics.median(times["tcp"])
    labels = {
        "direct": "handoff, direct (ticket, plain TCP)",
        "direct_tls": "handoff, direct (mutual TLS)",
        "nats": "handoff over NATS (credits)",
    }
    print("results (medians)")
    print(f"  {'loopback TCP copy, no fsync':<38} {tcp_s:7.3f} s  {rate(tcp_s)}")
    for path in paths:
        seconds = statistics.median(times[path])
        print(f"  {labels[path]:<38} {seconds:7.3f} s  {rate(seconds)}")
    for path in paths:
        target = "  (target >= 0.8x)" if path.startswith("direct") else ""
        print(f"  ratio {path + ' / TCP':<32} {tcp_s / statistics.median(times[path]):7.2f}x{target}")
    if args.nats:
        print(f"  NATS client publish ceiling            {ceiling:7.3f} s  {rate(ceiling)}  (no subscriber)")
        print(f"  NATS blast, no flow control            {blast_s:7.3f} s  (until the last message arrived)")
        lost = sent - received
        print(f"    messages sent {sent}, received {received}, dropped {lost} ({100 * lost / max(sent, 1):.1f}%),")
        print(f"    slow-consumer errors reported {slow}")
    print("CPU seconds per GiB (medians; the TCP copy's sender and receiver are both this process)")
    print(f"  {'':<12} {'receiver':>9} {'sender':>8} {'nats-server':>12}")
    for path in ["tcp", *paths]:
        cells = [statistics.median(cpu[path][p]) * GIB / size if cpu[path][p] else 0.0 for p in cpu[path]]
        print(f"  {path:<12} {cells[0]:9.2f} {cells[1]:8.2f} {cells[2]:12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of TCP copy and handoffs, interleaved")
    parser.add_argument("--default-allocator", action="store_true", help="leave glibc's thresholds as they are")
    parser.add_argument("--window-mib", type=int, default=HandoffLimits().window_bytes // MIB, help="credit window")
    parser.add_argument("--nats", action="store_true", help="also the NATS path, a raw blast and the client's ceiling")
    parser.add_argument("--as-sender", help=argparse.SUPPRESS)  # the sending node's process
    parser.add_argument("--dir", help="where the temporary files go (default: the system temp dir)")
    args = parser.parse_args()
    if args.as_sender:
        asyncio.run(_sender(json.loads(args.as_sender)))
    else:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
