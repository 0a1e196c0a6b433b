"""Benchmark: a KV handoff over NATS with credits vs a loopback TCP copy and vs a NATS blast without flow control.

Two handoff actors on one embedded nats-server, each in its own process (as two nodes would be). Node A sends
`--size-mib` of random bytes to node B, which stages every chunk (pwrite), hashes every segment, judges the
commit (tiling, counts, payload digest) and restores: here the restore hook fsyncs the staged file, so the
result is as durable as the baseline's. Two sources: a finished file (`send(path)`: its segments read and
hashed one by one while the previous one is sent) and the same bytes as an async iterator of segments (as
while a prefill runs). Both processes apply the allocator policy `mesh-actor run` applies (unless
`--default-allocator`).

Baselines, same run, same file:
* loopback TCP: the file sent over a socket (`socket.sendfile`) into a file, fsynced; once per round, before
  that round's two handoffs, each step after a `sync` (rounds interleave so the machine's drift hits both);
* a raw NATS blast: the same bytes published in `max_payload` chunks as fast as the client can, with no credit,
  to a subscriber with the client's default pending limits that does the receiver's work (write and hash).
  The server drops what the subscriber cannot keep up with (slow consumer): the benchmark reports how much
  arrived;
* the NATS client's own ceiling: the same chunks published to a subject nobody listens on (what nats-py can
  hand to the server at all, on this machine, now).

Ratio = median baseline time / median handoff time (the issue's target: >= 0.6); each round's ratios are
printed too. Run from the repository root:

    python -m benchmarks.handoff_throughput [--size-mib 1024] [--rounds 3] [--window-mib 32]
        [--default-allocator] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import blake3
import nats
import nats.errors
import structlog

from actors.handoff.actor import CommittedHandoff, HandoffActor, HandoffLimits, chunk_bytes
from benchmarks.environment import print_environment
from benchmarks.transfer import running, tcp_copy, write_random
from messages.subjects import Subjects
from runtime.allocator import keep_large_buffers
from runtime.bus import Bus
from runtime.config import NatsOptions
from runtime.embedded import EmbeddedNats
from runtime.journal import ensure_events_stream

MIB = 1024 * 1024
IDENTITY = "1d" * 32
SEGMENT = 32 * MIB


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


async def _sender(spec: dict[str, Any]) -> None:
    """The sending node, in its own process: for each line on stdin, both sends, their times as one JSON line."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if spec["allocator"]:
        keep_large_buffers()  # what `mesh-actor run` does
    options = NatsOptions(urls=tuple(spec["urls"]), user=spec["user"], password=spec["password"], token=spec["token"])
    limits = HandoffLimits(segment_bytes=SEGMENT, idle_timeout_s=30.0, window_bytes=spec["window"])
    source, size = Path(spec["source"]), int(spec["size"])
    bus = await Bus.connect(options, name="bench a")
    try:
        a = HandoffActor("bench-a", Path(spec["root"]) / "a", limits=limits)
        async with running(bus, a, a.node_id, lambda: a.running):
            print(json.dumps({"ready": True}), flush=True)
            while await asyncio.to_thread(sys.stdin.readline):
                started = time.perf_counter()
                report = await a.send("bench-b", source, identity=IDENTITY, n_tokens=1)
                from_file = time.perf_counter() - started
                assert report.bytes == size
                await asyncio.to_thread(os.sync)  # the next send starts with no dirty pages behind it
                started = time.perf_counter()
                segments = _segments_of(source, size)
                report = await a.send("bench-b", segments, identity=IDENTITY, n_tokens=1, max_bytes=size)
                streamed = time.perf_counter() - started
                assert report.bytes == size
                print(json.dumps({"file": from_file, "streamed": streamed}), flush=True)
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

    async def round(self) -> dict[str, float]:
        assert self.child.stdin is not None
        self.child.stdin.write(b"go\n")
        await self.child.stdin.drain()
        return await self._line(600)

    async def stop(self) -> None:
        if self.child.stdin is not None:
            self.child.stdin.close()
        try:
            async with asyncio.timeout(30):
                await self.child.wait()
        except TimeoutError:
            self.child.kill()
            await self.child.wait()


async def main_async(args: argparse.Namespace) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print_environment()
    policy = keep_large_buffers() if not args.default_allocator else None  # what `mesh-actor run` does
    size = args.size_mib * MIB
    base = Path(args.dir) if args.dir else None
    window = args.window_mib * MIB
    budget = max(HandoffLimits().credit_budget_bytes, window + 8 * MIB)  # one session gets the whole window
    limits = HandoffLimits(segment_bytes=SEGMENT, idle_timeout_s=30.0, window_bytes=window, credit_budget_bytes=budget)
    tcp: list[float] = []
    from_file: list[float] = []
    streamed: list[float] = []
    with tempfile.TemporaryDirectory(dir=base, prefix="handoff-bench-") as tmp:
        root = Path(tmp)
        source = root / "slot.bin"
        await asyncio.to_thread(write_random, source, size)
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
            b = HandoffActor("bench-b", root / "b", limits=limits, restore=_durable)
            async with running(bus_b, b, b.node_id, lambda: b.running):
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
                }
                sender = await _SenderProcess.start(spec)
                try:
                    for _ in range(args.rounds):  # interleaved: the machine's drift hits both alike
                        await asyncio.to_thread(os.sync)
                        tcp.append(await asyncio.to_thread(tcp_copy, source, root / "tcp.bin"))
                        (root / "tcp.bin").unlink()
                        await asyncio.to_thread(os.sync)
                        times = await sender.round()
                        from_file.append(times["file"])
                        streamed.append(times["streamed"])
                finally:
                    await sender.stop()
            blast_s, sent, received, slow = await _blast(options, source, size, root / "blast.bin")
            ceiling = await publish_ceiling(options, source, size)
        finally:
            await bus_b.close()
            await server.stop()

    def rate(seconds: float) -> str:
        return f"{size / MIB / seconds:8.0f} MiB/s"

    print(f"rounds ({args.rounds}: TCP copy, handoff from the file, handoff streamed; sync before each)")
    for i, (t, f, st) in enumerate(zip(tcp, from_file, streamed, strict=True), 1):
        print(f"  round {i}: TCP {rate(t)}, file {rate(f)}, streamed {rate(st)};  ratios {t / f:.2f} / {t / st:.2f}")
    tcp_s, file_s, streamed_s = (statistics.median(x) for x in (tcp, from_file, streamed))
    print("results (medians)")
    print(f"  loopback TCP copy + fsync              {tcp_s:7.3f} s  {rate(tcp_s)}")
    print(f"  handoff, file (segments read, hashed)  {file_s:7.3f} s  {rate(file_s)}")
    print(f"  handoff, streamed segments             {streamed_s:7.3f} s  {rate(streamed_s)}")
    print(f"  NATS client publish ceiling            {ceiling:7.3f} s  {rate(ceiling)}  (no subscriber)")
    print(f"  NATS blast, no flow control            {blast_s:7.3f} s  (until the last message arrived)")
    lost = sent - received
    print(f"    messages sent {sent}, received {received}, dropped {lost} ({100 * lost / max(sent, 1):.1f}%),")
    print(f"    slow-consumer errors reported {slow}")
    print(f"  ratio handoff (file) / TCP             {tcp_s / file_s:7.2f}x  (target >= 0.6x)")
    print(f"  ratio handoff (streamed) / TCP         {tcp_s / streamed_s:7.2f}x  (target >= 0.6x)")
    print(f"  ratio handoff (file) / publish ceiling {ceiling / file_s:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of TCP copy and handoffs, interleaved")
    parser.add_argument("--default-allocator", action="store_true", help="leave glibc's thresholds as they are")
    parser.add_argument("--window-mib", type=int, default=HandoffLimits().window_bytes // MIB, help="credit window")
    parser.add_argument("--as-sender", help=argparse.SUPPRESS)  # the sending node's process
    parser.add_argument("--dir", help="where the temporary files go (default: the system temp dir)")
    args = parser.parse_args()
    if args.as_sender:
        asyncio.run(_sender(json.loads(args.as_sender)))
    else:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
