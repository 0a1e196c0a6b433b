"""Benchmark: request/reply through the typed bus helpers and an actor endpoint, against bare nats-py.

Starts a real nats-server (embedded: loopback, JetStream, credentials), then, in this one process and event
loop, as a node's actors and its local clients share one:

- typed: `Bus.request(subject, Probe, ProbeReply)` to an endpoint served by a `runtime.actor.Actor` under a
  `Supervisor` (`ctx.add_endpoint`: a NATS micro service endpoint, the actor's bounded inbox and worker,
  schema-checked decoding, size-checked reply);
- bare: `nc.request(subject, bytes)` to a plain `nc.subscribe(subject, cb=...)` that echoes the bytes; the
  payloads are the typed path's JSON, so the same bytes cross the wire both ways;
- two half-way paths that tell which side the overhead is on: the typed client against the bare echo, and
  a bare client against the actor.

Client and responder use separate connections, the same ones for every path. Each path runs the same number
of sequential requests after a warm-up, interleaved in rounds (rotating the order) so the drift of a shared
machine hits every path alike; then the same with a fixed number of requests in flight. Reported: p50, p99
and mean latency, requests/s, and each path's ratio to bare. `--profile` adds a cProfile of the typed and
bare paths (client and actor both run here, so both sides show): Python calls and event-loop turns per
request, which do not depend on the machine's speed, and the top entries by own time.

Run from the repository root:

    python -m benchmarks.bus_roundtrip [--requests 4000] [--in-flight 16] [--profile]

The measuring helpers here are shared with `benchmarks.placement_latency`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import math
import pstats
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats.errors
from nats.aio.msg import Msg

from benchmarks.environment import print_environment
from messages.subjects import Subjects
from runtime.actor import Actor, ActorContext, Supervisor
from runtime.bus import Bus, NoResponders, encode
from runtime.embedded import EmbeddedNats
from runtime.journal import Journal, ensure_events_stream
from runtime.logging import configure_logging

SUBJECT_TYPED = "bench.roundtrip.typed"
SUBJECT_BARE = "bench.roundtrip.bare"
TIMEOUT_S = 5.0
BARE = "bare nats-py"
TYPED = "typed (Bus.request -> actor)"
TARGET_P50_RATIO = 1.3  # the typed round trip may cost at most this much of the bare one (p50)

Call = Callable[[], Awaitable[object]]


class Probe(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    body: str


class ProbeReply(msgspec.Struct, frozen=True, kw_only=True):
    """The same fields as `Probe`, so the bare echo's reply decodes as one (the half-way path needs it)."""

    seq: int
    body: str


class ProbeActor(Actor):
    name = "bench-probe"
    description = "benchmark probe: answers a small struct with a small struct"

    async def run(self, ctx: ActorContext) -> None:
        async def handle(probe: Probe) -> ProbeReply:
            return ProbeReply(seq=probe.seq, body=probe.body)

        await ctx.add_endpoint("probe", SUBJECT_TYPED, Probe, handle)


# --- measuring -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Summary:
    n: int
    p50_s: float
    p99_s: float
    mean_s: float
    per_s: float  # requests completed per second of the wall time spent on this path


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in [0, 1])."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(latencies: Sequence[float], wall_s: float) -> Summary:
    ordered = sorted(latencies)
    return Summary(
        n=len(ordered),
        p50_s=percentile(ordered, 0.50),
        p99_s=percentile(ordered, 0.99),
        mean_s=sum(ordered) / len(ordered),
        per_s=len(ordered) / wall_s,
    )


async def timed_sequential(call: Call, n: int) -> tuple[list[float], float]:
    """Latency of each of `n` requests made one after another, and the wall time of all of them."""
    latencies: list[float] = []
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        latencies.append(time.perf_counter() - t0)
    return latencies, time.perf_counter() - start


async def timed_concurrent(call: Call, n: int, in_flight: int) -> tuple[list[float], float]:
    """`n` requests with `in_flight` of them outstanding at any time (one client connection)."""
    latencies: list[float] = []
    remaining = n

    async def requester() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(in_flight):
            tg.create_task(requester())
    return latencies, time.perf_counter() - start


async def compare(
    paths: Mapping[str, Call], *, requests: int, warmup: int, rounds: int, in_flight: int = 1
) -> dict[str, Summary]:
    """Runs every path `requests` times (after `warmup`), interleaved in `rounds` with a rotating order."""
    for call in paths.values():
        for _ in range(warmup):
            await call()
    names = list(paths)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    walls = dict.fromkeys(names, 0.0)
    per_round = max(1, requests // rounds)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if in_flight > 1:
                lat, wall = await timed_concurrent(paths[name], per_round, in_flight)
            else:
                lat, wall = await timed_sequential(paths[name], per_round)
            latencies[name] += lat
            walls[name] += wall
    return {name: summarize(latencies[name], walls[name]) for name in names}


@dataclass(frozen=True, slots=True)
class Profile:
    calls_per_request: float  # Python function calls
    loop_turns_per_request: float  # event-loop iterations (each one an epoll wait)
    sends_per_request: float  # socket writes, client and responder together
    table: str  # the top entries by own time


async def profile(call: Call, n: int, top: int, in_flight: int = 1) -> Profile:
    """Profiles `n` requests; the counts per request do not depend on the machine's speed."""
    profiler = cProfile.Profile()
    profiler.enable()
    if in_flight > 1:
        await timed_concurrent(call, n, in_flight)
    else:
        await timed_sequential(call, n)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    calls: int = stats.total_calls  # type: ignore[attr-defined]
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]] = stats.stats  # type: ignore[attr-defined]
    turns = sum(v[1] for (filename, _, name), v in raw.items() if name == "_run_once" and "asyncio" in filename)
    sends = sum(v[1] for (_, _, name), v in raw.items() if name == "<method 'send' of '_socket.socket' objects>")
    return Profile(calls / n, turns / n, sends / n, out.getvalue())


def print_table(title: str, results: Mapping[str, Summary], baseline: str) -> None:
    base = results[baseline]
    print(title)
    print(f"  {'path':<32}{'p50 µs':>9}{'p99 µs':>9}{'mean µs':>9}{'req/s':>9}{'p50 x':>8}{'p99 x':>7}{'rate x':>8}")
    for name, s in results.items():
        print(
            f"  {name:<32}{s.p50_s * 1e6:9.1f}{s.p99_s * 1e6:9.1f}{s.mean_s * 1e6:9.1f}{s.per_s:9.0f}"
            f"{s.p50_s / base.p50_s:8.2f}{s.p99_s / base.p99_s:7.2f}{s.per_s / base.per_s:8.2f}"
        )


def verdict(met: bool) -> str:
    return "MET" if met else "MISSED"


# --- wiring ----------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def supervised(bus: Bus, actors: Sequence[Actor], node_id: str = "bench") -> AsyncIterator[None]:
    """Runs `actors` under a `Supervisor` with a running journal, as a node does; stops both on exit."""
    subjects = Subjects()
    journal = Journal(bus, subjects, node_id)
    supervisor = Supervisor(bus=bus, journal=journal, subjects=subjects, node_id=node_id)
    async with asyncio.TaskGroup() as tg:
        journal_task = tg.create_task(journal.run(), name="journal")
        supervisor_task = tg.create_task(supervisor.run(actors), name="supervisor")
        try:
            yield
        finally:
            supervisor_task.cancel()
            await asyncio.wait([supervisor_task], timeout=10)
            await journal.flush(5)
            journal_task.cancel()


async def wait_serving(call: Call, deadline_s: float = 20.0) -> None:
    """Returns once `call` gets an answer (the responder has registered), within a deadline."""
    async with asyncio.timeout(deadline_s):
        while True:
            try:
                await call()
                return
            except (NoResponders, nats.errors.NoRespondersError):
                await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def embedded_buses() -> AsyncIterator[tuple[Bus, Bus]]:
    """A fresh nats-server in a temporary directory with the events stream, and two connections to it
    (service side, client side). The server is stopped and its files removed on exit."""
    with tempfile.TemporaryDirectory(prefix="mesh-bench-") as tmp:
        async with EmbeddedNats(Path(tmp) / "nats", preferred_port=0) as server:
            assert server.credentials is not None
            options = server.credentials.options()
            service = await Bus.connect(options, name="bench-service")
            try:
                client = await Bus.connect(options, name="bench-client")
                try:
                    await ensure_events_stream(service, Subjects(), max_age_s=600.0, max_bytes=64 << 20)
                    yield service, client
                finally:
                    await client.close()
            finally:
                await service.close()


@contextlib.asynccontextmanager
async def bare_echo(bus: Bus, subject: str, reply: bytes | None = None) -> AsyncIterator[None]:
    """A plain nats-py responder on `subject`: answers every request with `reply`, or echoes it."""

    async def respond(msg: Msg) -> None:
        await msg.respond(msg.data if reply is None else reply)

    sub = await bus.nc.subscribe(subject, cb=respond)
    await bus.nc.flush(timeout=round(TIMEOUT_S))  # the server has the subscription before the first request
    try:
        yield
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


# --- the benchmark ---------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> None:
    configure_logging("warning", json=True)
    print_environment()
    probe = Probe(seq=1, body="x" * args.body)
    raw = encode(probe)
    async with embedded_buses() as (service, client):
        nc = client.nc

        async def bare() -> Msg:
            return await nc.request(SUBJECT_BARE, raw, timeout=TIMEOUT_S)

        async def typed_client_bare_echo() -> ProbeReply:
            return await client.request(SUBJECT_BARE, probe, ProbeReply, timeout=TIMEOUT_S)

        async def bare_client_actor() -> Msg:
            return await nc.request(SUBJECT_TYPED, raw, timeout=TIMEOUT_S)

        async def typed() -> ProbeReply:
            return await client.request(SUBJECT_TYPED, probe, ProbeReply, timeout=TIMEOUT_S)

        paths: dict[str, Call] = {
            BARE: bare,
            "typed client -> bare echo": typed_client_bare_echo,
            "bare client -> actor": bare_client_actor,
            TYPED: typed,
        }
        async with supervised(service, [ProbeActor()]), bare_echo(service, SUBJECT_BARE):
            await wait_serving(typed)
            # Every path must carry the same bytes and answer correctly, or the ratios mean nothing.
            reply_typed, reply_bare = await bare_client_actor(), await bare()
            assert reply_typed.data == reply_bare.data == raw, (reply_typed.data, raw)
            assert await typed() == await typed_client_bare_echo() == ProbeReply(seq=1, body=probe.body)
            print("input")
            print(f"  payload   {len(raw)} bytes each way, every path; request timeout {TIMEOUT_S:g}s")
            print(f"  rounds    {args.rounds} interleaved, after {args.warmup} warm-up requests per path")

            sequential = await compare(paths, requests=args.requests, warmup=args.warmup, rounds=args.rounds)
            concurrent = await compare(
                paths, requests=args.requests, warmup=0, rounds=args.rounds, in_flight=args.in_flight
            )
            print_table(f"sequential ({args.requests} requests per path; x = ratio to bare)", sequential, BARE)
            print_table(f"{args.in_flight} in flight ({args.requests} requests per path)", concurrent, BARE)
            ratio = sequential[TYPED].p50_s / sequential[BARE].p50_s
            print("target")
            print(f"  typed p50 <= {TARGET_P50_RATIO}x bare p50: {ratio:.2f}x -> {verdict(ratio <= TARGET_P50_RATIO)}")

            if args.profile:
                n = args.profile_requests
                print(f"profile ({n} requests per row under cProfile; client and responder together, per request)")
                print(f"  {'path':<32}{'in flight':>10}{'py calls':>10}{'loop turns':>12}{'socket sends':>14}")
                tables = []
                for in_flight in (1, args.in_flight):
                    for name in (BARE, TYPED):
                        found = await profile(paths[name], n, args.profile_top, in_flight)
                        print(
                            f"  {name:<32}{in_flight:>10}{found.calls_per_request:10.0f}"
                            f"{found.loop_turns_per_request:12.2f}{found.sends_per_request:14.2f}"
                        )
                        if name == TYPED and in_flight == 1:
                            tables.append(found.table)
                print(f"profile: {TYPED}, sequential, top {args.profile_top} by own time")
                print("".join(tables))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000, help="measured requests per path and mode")
    ap.add_argument("--warmup", type=int, default=500, help="unmeasured requests per path first")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds the requests are split into")
    ap.add_argument("--in-flight", type=int, default=16, help="outstanding requests in the concurrent mode")
    ap.add_argument("--body", type=int, default=64, help="characters in the probe's body field")
    ap.add_argument("--profile", action="store_true", help="also profile the typed and bare paths (cProfile)")
    ap.add_argument("--profile-requests", type=int, default=2000)
    ap.add_argument("--profile-top", type=int, default=25, help="profile rows to print, by own time")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
