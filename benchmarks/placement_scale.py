"""Benchmark: placement at fleet scale: `placement.fit` over 1,000, 3,000 and 10,000 simulated nodes beside a bare
NATS echo, `placement.request` (booking and journal) at saturation with its decisions replayed from the journal,
and the telemetry fan-in of the largest fleet at 1 Hz into the placement actor's view.

For each fleet size, a fresh nats-server (JetStream, loopback, with its monitoring port, which says whether it
cut off a slow consumer) and the real `PlacementActor` under a `Supervisor` with a running journal, in this
process; then a second process simulates the fleet: every node has its own GPUs (none to 8, of 24, 48 or
80 GiB, partly used by others), host RAM, CPU features and serving settings (slots, unified KV, cache types,
prompt cache), a few have no llama-server, and each one reports at 1 Hz (spread over the second) exactly as
the telemetry actor does: `mesh.telemetry.<node>` and its key in the nodes bucket with a per-message TTL.
One report in ten moves a node's free memory (other work starting and stopping), so node states and GPU
splits keep changing under the decisions.

Measured while the telemetry flows: `PlacementRequest(model=<a sparse file with a 9B qwen35 geometry>,
ctx=4096)` on `mesh.placement.fit`, sequential and with `--in-flight` outstanding, interleaved with a bare
nats-py responder answering the same request bytes with the decision's bytes (the baseline: same bytes, no
work). Also the pure decision alone in this process, the fleet index against the full scan (every node sized,
as before the index: `tests/placement_oracle.py`) on the same view, checked equal (the full scan up to
`--full-scan-max` nodes: it takes seconds per decision beyond; the index judging every node is checked equal at
every size). Then `--bookings` requests on `mesh.placement.request` with `--in-flight` outstanding (each books a
reservation, writes a ledger with compare-and-set and journals its decision), and every one of those decisions
read back from the journal and decided again (`replay.recompute`), which must find no difference.

At the largest size, over a `--fan-in-s` window: reports delivered into the view per second, drops (the
server's slow-consumer count, the client library's slow-consumer errors, and reports acknowledged by
JetStream that never reached the view), the view's lag (arrival in the actor minus the node's `sent_at`: one
machine, one clock), and this process's resident memory (actor, client and echo) sampled every second, with
the actor's own table sizes.

Run from the repository root:

    python -m benchmarks.placement_scale [--sizes 1000,3000,10000] [--requests 400] [--rounds 4] [--fan-in-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import pstats
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError

from actors.placement import decision_records
from actors.placement.actor import PlacementActor
from actors.placement.admission import ModelFacts, Outcome
from actors.placement.fleet import FleetIndex, snapshot
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.replay import differences, inputs_of, recompute
from benchmarks.bus_roundtrip import (
    Summary,
    bare_echo,
    compare,
    percentile,
    print_table,
    summarize,
    supervised,
    timed_concurrent,
    timed_sequential,
    verdict,
    wait_serving,
)
from benchmarks.environment import print_environment
from messages.events import PlacementDecided
from messages.placement import ModelRef, PlacementDecision, PlacementRequest
from messages.settings import ServingSettings
from messages.subjects import Subjects
from messages.telemetry import GpuInfo, HostInfo, LlamaServerInfo, NodeResources
from runtime import buckets
from runtime.buckets import TTL_HEADER
from runtime.bus import Bus, decode_checked, encode
from runtime.cli.journal import read_events
from runtime.config import NatsOptions
from runtime.embedded import find_nats_server
from runtime.journal import ensure_events_stream
from runtime.logging import configure_logging
from tests import tiny_models
from tests.placement_oracle import full_scan

GIB = 1 << 30
MIB = 1 << 20
CTX = 4096
TIMEOUT_S = 10.0
ECHO_SUBJECT = "bench.placement.echo"
NODE_TTL_S = 15.0
MOVE_EVERY = 10  # one report in this many moves the node's free memory, each node at its own phase
TARGET_P99_S = 0.005


# --- the simulated fleet ---------------------------------------------------------------------------------


@dataclass
class SimNode:
    """One simulated node: fixed hardware and settings, free memory that moves now and then."""

    node_id: str
    gpu_size: int
    gpu_used: list[int]
    host_total: int
    host_used: int
    features: tuple[str, ...]
    settings: ServingSettings | None
    phase: int = 0  # which of its reports move: not every node's at once (a fleet-wide storm)
    seq: int = 0
    started_at: float = 0.0
    last: NodeResources | None = None

    def report(self, rng: random.Random, now: float) -> NodeResources:
        self.seq += 1
        if self.seq > 1 and (self.seq + self.phase) % MOVE_EVERY == 0:
            self.gpu_used = [min(self.gpu_size, max(0, u + rng.randrange(-2 * GIB, 2 * GIB))) for u in self.gpu_used]
            self.host_used = min(self.host_total, max(0, self.host_used + rng.randrange(-4 * GIB, 4 * GIB)))
        elif self.last is not None:  # nothing moved: the same report, only newer
            self.last = msgspec.structs.replace(self.last, seq=self.seq, sent_at=now)
            return self.last
        gpus = tuple(
            GpuInfo(
                index=i,
                name="simulated GPU",
                uuid=f"GPU-{self.node_id}-{i}",
                total_bytes=self.gpu_size,
                free_bytes=self.gpu_size - used,
                used_bytes=used,
                usable_bytes=self.gpu_size - used,
            )
            for i, used in enumerate(self.gpu_used)
        )
        free = self.host_total - self.host_used
        self.last = NodeResources(
            node_id=self.node_id,
            seq=self.seq,
            sent_at=now,
            started_at=self.started_at,
            ttl_s=NODE_TTL_S,
            host=HostInfo(
                ram_total_bytes=self.host_total,
                ram_available_bytes=free,
                usable_bytes=free,
                cpu_count=32,
                cpu_features=self.features,
            ),
            gpus=gpus,
            nvml="simulated" if gpus else None,
            nvml_error=None if gpus else "no NVIDIA device",
            llama_server=LlamaServerInfo(path="llama-server", version="sim", build_info="") if self.settings else None,
            llama_server_error=None if self.settings else "llama-server not found",
            settings=self.settings,
        )
        return self.last


def fleet(n: int, seed: int) -> list[SimNode]:
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        n_gpus = rng.choices((0, 1, 2, 4, 8), weights=(10, 40, 25, 15, 10))[0]
        size = rng.choice((24, 48, 80)) * GIB
        settings: ServingSettings | None = None
        if rng.random() > 0.02:
            k = rng.choice(("f16", "f16", "q8_0", "q4_0"))
            settings = ServingSettings(
                slots=rng.choice((1, 2, 4, 4, 8, 16)),
                kv_unified=rng.random() < 0.3,
                cache_type_k=k,  # type: ignore[arg-type]
                cache_type_v=rng.choice(("f16", k)),  # type: ignore[arg-type]
                cache_ram_mib=rng.choice((0, 2048, 8192)),
                ctx_checkpoints=rng.choice((0, 8, 32)),
            )
        host = rng.choice((64, 128, 256, 512)) * GIB
        nodes.append(
            SimNode(
                node_id=f"sim-{i}",
                gpu_size=size,
                gpu_used=[int(size * rng.uniform(0.0, 0.95)) for _ in range(n_gpus)],
                host_total=host,
                host_used=int(host * rng.uniform(0.1, 0.9)),
                features=rng.choice((("AVX2",), ("AVX2", "AVX512"), ("NEON", "DOTPROD"))),
                settings=settings,
                phase=i % MOVE_EVERY,
                started_at=time.time(),
            )
        )
    return nodes


async def simulate(url: str, n: int, seed: int, duration_s: float) -> dict[str, Any]:
    """Publishes every node's report once a second, spread over the second, for `duration_s` (or until
    stopped by SIGTERM); returns the counts.

    Each report goes out as the telemetry actor sends it (`mesh.telemetry.<node>`, then the node's key in the
    nodes bucket with its TTL header and a reply subject for JetStream's acknowledgement), but the
    acknowledgements come back on one subscription and are counted there, not awaited one by one: a future and
    a task per report held this process to about 2,500 reports/s on 2 shared CPUs, below the 10,000 it must
    send. A node whose free memory did not move sends its last report again with only its sequence number and
    time new, byte for byte what the telemetry actor's encoder writes then."""
    subjects = Subjects()
    bus = await Bus.connect(NatsOptions(urls=(url,)), name="bench-fleet")
    await buckets.nodes(bus, subjects)
    rng = random.Random(seed + 1)
    nodes = fleet(n, seed)
    acked = failed = 0
    behind: list[float] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(15, stop.set)
    inbox = bus.nc.new_inbox()
    drained = asyncio.Event()
    published = 0

    async def on_ack(msg: Msg) -> None:
        nonlocal acked, failed
        if b'"error"' in msg.data or not msg.data:
            failed += 1
        else:
            acked += 1
        if stop.is_set() and acked + failed >= published:
            drained.set()

    sub = await bus.nc.subscribe(f"{inbox}.*", cb=on_ack)
    headers = {TTL_HEADER: f"{round(NODE_TTL_S)}s"}

    async def put(report: NodeResources) -> None:
        nonlocal published
        payload = encode(report)
        await bus.nc.publish(subjects.telemetry(report.node_id), payload)
        await bus.nc.publish(
            f"$KV.{subjects.nodes_bucket}.{report.node_id}", payload, reply=f"{inbox}.{published}", headers=headers
        )
        published += 1

    start = time.monotonic()
    tick = 0.01
    i = 0
    while not stop.is_set() and time.monotonic() - start < duration_s:
        due = start + i * (1.0 / n)
        now = time.monotonic()
        if due > now:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=min(tick, due - now))
            continue
        behind.append(now - due)
        # Everything due now goes out together.
        while start + i * (1.0 / n) <= now:
            await put(nodes[i % n].report(rng, time.time()))
            i += 1
    seconds = time.monotonic() - start
    stop.set()
    if acked + failed < published:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(drained.wait(), timeout=10)
    await sub.unsubscribe()
    await bus.close()
    behind.sort()
    return {
        "published": published,
        "acked": acked,
        "failed": failed + max(0, published - acked - failed),  # not acknowledged within 10 s of the end
        "seconds": seconds,
        "behind_p99_s": percentile(behind, 0.99) if behind else 0.0,
    }


# --- the server ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Server:
    url: str
    monitor: str

    def varz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.monitor}/varz", timeout=5) as response:
            return dict(json.load(response))


@contextlib.asynccontextmanager
async def nats_server(directory: Path) -> AsyncIterator[Server]:
    """A plain nats-server with JetStream on loopback and its monitoring port."""
    port, http = _free_port(), _free_port()
    args = [find_nats_server(), "-a", "127.0.0.1", "-p", str(port), "-m", str(http), "-js", "-sd", str(directory)]
    process = await asyncio.create_subprocess_exec(*args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(url=f"nats://127.0.0.1:{port}", monitor=f"http://127.0.0.1:{http}")
    try:
        async with asyncio.timeout(20):
            while True:
                try:
                    await asyncio.to_thread(server.varz)
                    break
                except OSError:
                    await asyncio.sleep(0.05)
        yield server
    finally:
        await _stop(process)


async def _stop(process: asyncio.subprocess.Process) -> bytes:
    """Terminates `process` and returns what it wrote (killed if it does not end within 20 s)."""
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    try:
        async with asyncio.timeout(20):
            out, _ = await process.communicate()
    except TimeoutError:
        process.kill()
        out, _ = await process.communicate()
    return out or b""


async def wait_until(condition: Callable[[], bool], deadline_s: float) -> bool:
    """Whether `condition` became true within the deadline (checked every 50 ms)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(deadline_s):
            while True:
                if condition():
                    return True
                await asyncio.sleep(0.05)
    return False


# --- the placement actor, measured ---------------------------------------------------------------------


class MeasuredPlacement(PlacementActor):
    """The real actor; it also notes each report's lag into the view (arrival minus the node's `sent_at`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lags: deque[float] = deque(maxlen=1_000_000)

    def _saw_report(self, node: NodeResources) -> None:
        super()._saw_report(node)
        self.lags.append(time.time() - node.sent_at)


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Replayed:
    """The journal's `placement_decided` events read back and decided again."""

    decisions: int
    differing: int
    side_records: int  # decisions whose inputs were too large to travel in the event
    largest_event: int
    seconds: float


@dataclass
class SizeResult:
    nodes: int
    echo: Summary
    fit: Summary
    fit_concurrent: Summary
    echo_concurrent: Summary
    decision_bytes: int
    core_index: Summary
    core_full: Summary | None
    bookings: Summary
    replay: Replayed
    rss_empty: int  # this process before the fleet reports
    rss_full: int  # once the view holds every node


async def measure_size(args: argparse.Namespace, n: int, model: Path, facts: ModelFacts) -> SizeResult:
    subjects = Subjects()
    with tempfile.TemporaryDirectory(prefix="mesh-bench-scale-") as tmp:
        async with nats_server(Path(tmp)) as server:
            service = await Bus.connect(NatsOptions(urls=(server.url,)), name="bench-service")
            client = await Bus.connect(NatsOptions(urls=(server.url,)), name="bench-client")
            slow_errors = 0
            original_error_cb = service.nc._error_cb

            async def counting(exc: Exception) -> None:
                nonlocal slow_errors
                if isinstance(exc, SlowConsumerError):
                    slow_errors += 1
                await original_error_cb(exc)

            service.nc._error_cb = counting
            await ensure_events_stream(service, subjects, max_age_s=600.0, max_bytes=256 << 20)
            actor = MeasuredPlacement()
            simulator = None
            try:
                async with supervised(service, [actor]):
                    request = PlacementRequest(model=ModelRef(path=str(model)), ctx=CTX)
                    raw_request = encode(request)

                    async def fit() -> PlacementDecision:
                        return await client.request(
                            subjects.placement_fit, request, PlacementDecision, timeout=TIMEOUT_S
                        )

                    await wait_serving(fit)
                    rss_empty = rss_bytes()
                    simulator = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "benchmarks.placement_scale", "--simulate", server.url, str(n),
                        str(args.seed), "3600", stdout=subprocess.PIPE,
                    )  # fmt: skip
                    if not await wait_until(lambda: actor.stats().view_nodes >= n, 60):
                        raise SystemExit(f"the view has {actor.stats().view_nodes} of {n} nodes after 60 s")
                    rss_full = rss_bytes()
                    first = await fit()
                    if not first.admitted:
                        raise SystemExit(f"{n} nodes: not admitted ({first.reason}: {first.message[:300]})")
                    decision_bytes = encode(first)

                    async def echo() -> Msg:
                        return await client.nc.request(ECHO_SUBJECT, raw_request, timeout=TIMEOUT_S)

                    async with bare_echo(service, ECHO_SUBJECT, reply=decision_bytes):
                        paths = {"bare echo": echo, "placement.fit": fit}
                        seq = await compare(paths, requests=args.requests, warmup=args.warmup, rounds=args.rounds)
                        conc = await compare(
                            paths, requests=args.requests, warmup=0, rounds=args.rounds, in_flight=args.in_flight
                        )
                    if args.profile and n == max(args.sizes):
                        profiler = cProfile.Profile()
                        profiler.enable()
                        await timed_sequential(fit, 300)
                        profiler.disable()
                        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
                    core_index, core_full, every_node = await time_cores(
                        actor, request, facts, args.core_runs, full_scan_max=args.full_scan_max
                    )
                    print_size(n, first, decision_bytes, seq, conc, core_index, core_full, every_node, actor)
                    print(f"  memory (this process)   RSS {rss_empty / MIB:.1f} MiB before the fleet reported, "
                          f"{rss_full / MIB:.1f} MiB once the view held {n} nodes")  # fmt: skip
                    bookings, refused = await measure_bookings(client, subjects, request, args)
                    await asyncio.sleep(2)  # the journal stores the last decisions' events
                    replayed = await replay_journal(client, subjects, facts)
                    print_bookings(bookings, refused, replayed, args.in_flight)
                    if n == max(args.sizes):
                        await asyncio.sleep(2)  # the reports queued while the full scan held the loop go in first
                        async with bare_echo(service, ECHO_SUBJECT, reply=decision_bytes):
                            fan_in = await measure_fan_in(args, actor, fit, echo)
                        simulated = await stop_simulator(simulator)
                        simulator = None
                        # What JetStream acknowledged reaches the view, or it was dropped: wait for it to arrive.
                        acked = int(simulated.get("acked", 0))
                        await wait_until(lambda: actor.stats().reports_seen >= acked, 10)
                        await print_fan_in(fan_in, simulated, actor, server, slow_errors)
            finally:
                if simulator is not None:
                    await stop_simulator(simulator)
                await client.close()
                await service.close()
    return SizeResult(
        nodes=n,
        echo=seq["bare echo"],
        fit=seq["placement.fit"],
        fit_concurrent=conc["placement.fit"],
        echo_concurrent=conc["bare echo"],
        decision_bytes=len(decision_bytes),
        core_index=core_index,
        core_full=core_full,
        bookings=bookings,
        replay=replayed,
        rss_empty=rss_empty,
        rss_full=rss_full,
    )


async def measure_bookings(
    client: Bus, subjects: Subjects, request: PlacementRequest, args: argparse.Namespace
) -> tuple[Summary, int]:
    """`--bookings` requests on `placement.request` with `--in-flight` outstanding: each decides, books (ledger
    compare-and-set) and journals. Their reservations expire unclaimed after a minute."""
    booking = msgspec.structs.replace(request, hold_s=60.0)
    refused = 0

    async def book() -> PlacementDecision:
        nonlocal refused
        decision = await client.request(subjects.placement_request, booking, PlacementDecision, timeout=TIMEOUT_S)
        refused += not decision.admitted
        return decision

    latencies, wall = await timed_concurrent(book, args.bookings, args.in_flight)
    return summarize(latencies, wall), refused


async def replay_journal(bus: Bus, subjects: Subjects, facts: ModelFacts) -> Replayed:
    """Every `placement_decided` event of the journal decided again with today's core (inline inputs, or the
    side record an event names)."""
    decisions = differing = records = largest = 0
    start = time.monotonic()
    async for stored in read_events(bus, subjects, "placement.placement_decided", since=None, follow=False):
        event = decode_checked(stored.data, PlacementDecided, f"event {stored.seq}")
        largest = max(largest, len(stored.data))
        inputs = inputs_of(event)
        if inputs is None:
            assert event.record is not None
            inputs = await decision_records.fetch(bus, subjects, event.record)
            records += 1
        again = await asyncio.to_thread(recompute, inputs, facts.geometry)
        decisions += 1
        differing += bool(differences(inputs.decision, again))
    return Replayed(decisions, differing, records, largest, time.monotonic() - start)


def print_bookings(bookings: Summary, refused: int, replayed: Replayed, in_flight: int) -> None:
    print(
        f"  placement.request       {bookings.n} bookings, {in_flight} in flight: {bookings.per_s:.0f} decisions/s, "
        f"p50 {bookings.p50_s * 1e3:.2f} ms, p99 {bookings.p99_s * 1e3:.2f} ms, {refused} refused"
    )
    print(
        f"  replay from the journal {replayed.decisions} decisions decided again in {replayed.seconds:.1f} s: "
        f"{replayed.differing} differ; {replayed.side_records} side records; largest event {replayed.largest_event} B"
    )


async def stop_simulator(process: asyncio.subprocess.Process) -> dict[str, Any]:
    """Stops the simulated fleet; its counts."""
    out = (await _stop(process)).decode()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return dict(json.loads(lines[-1])) if lines else {}


async def time_cores(
    actor: PlacementActor, request: PlacementRequest, facts: ModelFacts, runs: int, *, full_scan_max: int
) -> tuple[Summary, Summary | None, Summary]:
    """The decision alone over the actor's current view: the fleet index as the actor keeps it (tracked: two
    nodes touched before each decision, about what 1,000 reports/s leave between decisions), and the full scan,
    equal. (Every node judged, untracked, is printed beside.)"""
    view, arrived, ledgers = dict(actor._view), dict(actor._arrived), dict(actor._ledger_cache)
    mono = time.monotonic()
    now = time.time()
    names = sorted(view)

    def timed(index: FleetIndex, touches: int) -> tuple[Outcome, Summary]:
        def indexed() -> Outcome:
            return index.decide(
                request, facts, view, arrived, ledgers, now=now, monotonic_now=mono, decision_id="d",
                reservation_id="r", dry_run=True,
            )  # fmt: skip

        first = indexed()
        latencies = []
        start = time.perf_counter()
        for i in range(runs):
            t0 = time.perf_counter()
            for k in range(touches):
                index.touch(names[(i * touches + k) % len(names)])
            indexed()
            latencies.append(time.perf_counter() - t0)
        return first, summarize(latencies, time.perf_counter() - start)

    fast, core_index = timed(FleetIndex(tracked=True), 2)
    untracked, every_node = timed(FleetIndex(), 0)
    if untracked != fast:
        raise SystemExit("the tracked and the untracked fleet index disagree")
    if len(view) > full_scan_max:
        return core_index, None, every_node
    full_runs = 3 if len(view) > 100 else 20
    inputs = snapshot(request, view, arrived, ledgers, {}, mono)

    def scanned() -> tuple[Outcome, Summary]:
        latencies = []
        start = time.perf_counter()
        for _ in range(full_runs):
            t0 = time.perf_counter()
            full = full_scan(  # the old scan of every node: what the index is measured against, and must agree with
                request, facts, inputs.view, inputs.held, now=now, decision_id="d", reservation_id="r", dry_run=True,
                unreadable=inputs.unreadable,
            )  # fmt: skip
            latencies.append(time.perf_counter() - t0)
        return full, summarize(latencies, time.perf_counter() - start)

    # In a thread: seconds per decision at 1,000 nodes, which would starve the connection's pings on the loop.
    full, core_full = await asyncio.to_thread(scanned)
    if full != fast:
        raise SystemExit("the fleet index and the full scan disagree")
    return core_index, core_full, every_node


@dataclass
class FanIn:
    seconds: float
    delivered: int
    lags: list[float]
    rss: list[int]
    fits_during: Summary
    echoes_during: Summary


async def measure_fan_in(
    args: argparse.Namespace,
    actor: MeasuredPlacement,
    fit: Callable[[], Awaitable[PlacementDecision]],
    echo: Callable[[], Awaitable[object]],
) -> FanIn:
    """Reports delivered, lag and memory over a window, with a decision every 10 ms meanwhile, each followed by
    the bare echo (the same-window baseline: what waking up and one round trip cost on this machine then)."""
    seen0 = actor.stats().reports_seen
    actor.lags.clear()
    rss: list[int] = []
    latencies: list[float] = []
    echoes: list[float] = []
    start = time.monotonic()
    next_sample = start
    while (now := time.monotonic()) - start < args.fan_in_s:
        if now >= next_sample:
            rss.append(rss_bytes())
            next_sample += 1.0
        t0 = time.perf_counter()
        await fit()
        latencies.append(time.perf_counter() - t0)
        await asyncio.sleep(0.005)
        t0 = time.perf_counter()
        await echo()
        echoes.append(time.perf_counter() - t0)
        await asyncio.sleep(0.005)
    seconds = time.monotonic() - start
    return FanIn(
        seconds=seconds,
        delivered=actor.stats().reports_seen - seen0,
        lags=sorted(actor.lags),
        rss=rss,
        fits_during=summarize(latencies, sum(latencies)),
        echoes_during=summarize(echoes, sum(echoes)),
    )


# --- output ----------------------------------------------------------------------------------------------


def _us(s: Summary) -> str:
    return f"{s.p50_s * 1e6:9.1f} / {s.p99_s * 1e6:9.1f} µs"


def print_size(
    n: int,
    first: PlacementDecision,
    decision_bytes: bytes,
    seq: dict[str, Summary],
    conc: dict[str, Summary],
    core_index: Summary,
    core_full: Summary | None,
    every_node: Summary,
    actor: PlacementActor,
) -> None:
    stats = actor.stats()
    print(
        f"fleet of {n} nodes: chosen {first.placements[0].node_id} ({len(first.rejections)} refusals listed); "
        f"decision {len(decision_bytes)} B; index: {stats.index.profiles} profiles, {stats.index.layouts} layouts, "
        f"{stats.index.sizings} sizings"
    )
    print_table("  sequential (x = ratio to the echo)", seq, "bare echo")
    print_table("  in flight", conc, "bare echo")
    print("  the decision alone, this process (p50 / p99)")
    print(f"    fleet index (tracked, 2 touched)    {_us(core_index)}")
    print(f"    fleet index, every node judged      {_us(every_node)}")
    if core_full is not None:
        ratio = core_full.p50_s / core_index.p50_s
        print(f"    full scan (every node sized)        {_us(core_full)}  ({ratio:.0f}x the index; equal decisions)")


async def print_fan_in(
    fan_in: FanIn, simulated: dict[str, Any], actor: MeasuredPlacement, server: Server, slow_errors: int
) -> None:
    varz = await asyncio.to_thread(server.varz)
    stats = actor.stats()
    lags = fan_in.lags
    acked = int(simulated.get("acked", 0))
    print(f"telemetry fan-in ({fan_in.seconds:.0f} s window, a fit every 10 ms meanwhile)")
    print(
        f"  delivered into the view   {fan_in.delivered / fan_in.seconds:8.1f} reports/s ({fan_in.delivered} reports)"
    )
    print(
        f"  simulator                 {simulated.get('published', 0)} reports in {simulated.get('seconds', 0):.0f} s, "
        f"{acked} acknowledged by JetStream, {simulated.get('failed', 0)} failed; "
        f"its schedule slipped p99 {simulated.get('behind_p99_s', 0) * 1e3:.1f} ms"
    )
    print(
        f"  drops                     server slow consumers {varz.get('slow_consumers', '?')}, "
        f"client slow-consumer errors {slow_errors}, "
        f"acknowledged but not in the view {max(0, acked - stats.reports_seen)} "
        f"(view saw {stats.reports_seen} of {acked})"
    )
    if lags:
        print(
            f"  view lag                  p50 {percentile(lags, 0.5) * 1e3:.2f} ms, "
            f"p99 {percentile(lags, 0.99) * 1e3:.2f} ms, max {lags[-1] * 1e3:.2f} ms ({len(lags)} reports)"
        )
    rss = fan_in.rss
    print(
        f"  memory (this process)     RSS {rss[0] / MIB:.1f} MiB at the start, {rss[-1] / MIB:.1f} MiB at the end, "
        f"max {max(rss) / MIB:.1f} MiB ({len(rss)} samples)"
    )
    index = stats.index
    print(
        f"  actor tables              view {stats.view_nodes} nodes, ledgers {stats.ledgers}; "
        f"index: {index.nodes} node states, {index.profiles} profiles, {index.layouts} layouts, "
        f"{index.sizings} sizings, {index.sized} estimates made, {index.resets} resets"
    )
    heartbeats = getattr(stats, "heartbeats", None)  # (the actor counts them since issue 28)
    if heartbeats is not None:
        print(
            f"  taken in as heartbeats    {heartbeats} of {stats.reports_seen} reports (not decoded whole, not "
            f"indexed); index touches {index.touches}"
        )
    print(f"  fit during the window     {_us(fan_in.fits_during)} (p50 / p99, {fan_in.fits_during.n} decisions)")
    print(f"  echo during the window    {_us(fan_in.echoes_during)} (p50 / p99, the same-window baseline)")


async def run(args: argparse.Namespace) -> None:
    configure_logging("warning", json=True)
    print_environment()
    with tempfile.TemporaryDirectory(prefix="mesh-bench-models-") as tmp:
        model = tiny_models.write_qwen35_9b(Path(tmp) / "qwen35-9b.gguf")
        facts = ModelFacts(geometry=geometry_from_header(read_header(model)), path=str(model))
        print("input")
        print(
            f"  fleets    {', '.join(map(str, args.sizes))} simulated nodes (seed {args.seed}), each reporting at 1 Hz"
        )
        print(f"  request   PlacementRequest(model=<qwen35 9B shape>, ctx={CTX}) on placement.fit")
        print(f"  rounds    {args.requests} per path and mode, {args.rounds} interleaved rounds, {args.warmup} warm-up")
        results = [await measure_size(args, n, model, facts) for n in args.sizes]
    print("summary (sequential p50 / p99; decisions/s sequential and with in-flight requests; bookings/s)")
    head = ("nodes", "echo p50", "echo p99", "fit p50", "fit p99", "x echo", "seq/s", "conc/s", "bytes", "book/s")
    print("  " + "".join(f"{h:>10}" for h in head))
    for r in results:
        ms = (r.echo.p50_s, r.echo.p99_s, r.fit.p50_s, r.fit.p99_s)
        cells = [f"{r.nodes:>10}", *(f"{v * 1e3:8.3f}ms" for v in ms), f"{r.fit.p50_s / r.echo.p50_s:9.2f}x"]
        cells += [f"{r.fit.per_s:10.0f}", f"{r.fit_concurrent.per_s:10.0f}", f"{r.decision_bytes:10d}"]
        cells += [f"{r.bookings.per_s:10.0f}"]
        print("  " + "".join(cells))
    largest = results[-1]
    print(
        f"target: p99 < {TARGET_P99_S * 1e3:g} ms at {largest.nodes} nodes: {largest.fit.p99_s * 1e3:.2f} ms -> "
        f"{verdict(largest.fit.p99_s < TARGET_P99_S)}"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--simulate":
        url, n, seed, duration = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
        print(json.dumps(asyncio.run(simulate(url, n, seed, duration))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 3000, 10000])
    ap.add_argument("--requests", type=int, default=400, help="measured requests per path and mode")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--bookings", type=int, default=400, help="placement.request bookings at saturation")
    ap.add_argument("--full-scan-max", type=int, default=1000, help="largest fleet the full scan is timed on")
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--core-runs", type=int, default=200, help="runs of the decision alone (fleet index)")
    ap.add_argument("--fan-in-s", type=float, default=20.0, help="fan-in window at the largest size")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--profile", action="store_true", help="cProfile 300 fits at the largest size (both sides)")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
