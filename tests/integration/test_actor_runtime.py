"""The actor base, supervisor and bus against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import msgspec
import nats
import nats.errors
import pytest

from messages.errors import BAD_REQUEST
from runtime import actor as actor_module
from runtime.actor import Actor, ActorContext, ActorGaveUpError, RequestError
from runtime.bus import Bus, NoResponders, PayloadTooLarge, RemoteError
from runtime.restart import RestartPolicy
from tests.conftest import JournalReader, NatsServer, of_type, supervised


class Ping(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    n: int
    crash: bool = False  # the handler raises
    fail_task: bool = False  # the actor's own task raises
    slow: bool = False


class Pong(msgspec.Struct, frozen=True, kw_only=True):
    n: int
    incarnation: int


class EchoActor(Actor):
    name = "echo"

    def __init__(self, crash_on_start: int = 0) -> None:
        self.busy = asyncio.Event()
        self.incarnations = 0
        self.crash_on_start = crash_on_start

    async def run(self, ctx: ActorContext) -> None:
        self.incarnations += 1
        incarnation = self.incarnations
        if incarnation <= self.crash_on_start:
            raise RuntimeError(f"cannot start (incarnation {incarnation})")
        task_fails = asyncio.Event()

        async def own_task() -> None:  # a fault of the actor itself (not of a request) crashes the incarnation
            await task_fails.wait()
            raise RuntimeError("own task failed")

        async def handle(ping: Ping) -> Pong:
            if ping.slow:
                self.busy.set()
                await asyncio.sleep(3600)  # until the incarnation ends
            if ping.crash:
                raise RuntimeError("asked to crash")
            if ping.fail_task:
                task_fails.set()
            if ping.n < 0:
                raise RequestError(BAD_REQUEST, "n must not be negative", {"path": "$.n"})
            return Pong(n=ping.n, incarnation=incarnation)

        ctx.spawn(own_task(), "own-task")
        await ctx.add_endpoint("ping", "test.echo.ping", Ping, handle)


async def ping(bus: Bus, n: int, crash: bool = False, timeout: float = 5.0) -> Pong:
    return await bus.request("test.echo.ping", Ping(n=n, crash=crash), Pong, timeout=timeout)


async def wait_serving(bus: Bus) -> None:
    async with asyncio.timeout(10):
        while True:
            try:
                await ping(bus, 0, timeout=1)
                return
            except (NoResponders, RemoteError):
                await asyncio.sleep(0.02)


async def test_crashed_actor_is_restarted_and_serves_again(bus: Bus, journal_reader: JournalReader) -> None:
    actor = EchoActor()
    async with supervised(bus, [actor]):
        await wait_serving(bus)
        assert (await ping(bus, 1)).incarnation == 1
        await bus.request("test.echo.ping", Ping(n=2, fail_task=True), Pong, timeout=5)
        await journal_reader.wait_for(of_type("actor_crashed", actor="echo"))
        await journal_reader.wait_for(of_type("actor_restarted", actor="echo", attempt=2))
        await wait_serving(bus)
        assert (await ping(bus, 3)).incarnation == 2
    crash = (await journal_reader.wait_for(of_type("actor_crashed")))[0]
    assert "own task failed" in crash["error"]
    assert crash["node"] == "test-node"


async def test_a_failing_request_is_an_internal_error_and_never_counts_toward_restarts(
    bus: Bus, journal_reader: JournalReader
) -> None:
    actor = EchoActor()
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff_initial_s=0.01)
    async with supervised(bus, [actor], policy=lambda: policy) as task:
        await wait_serving(bus)
        for n in range(10):  # far past the restart intensity, had these been crashes
            with pytest.raises(RemoteError) as failed:
                await ping(bus, n, crash=True)
            assert failed.value.code == "internal" and "asked to crash" in str(failed.value)
        assert (await ping(bus, 11)).incarnation == 1
        assert not task.done()
    assert actor.incarnations == 1
    assert not [e for e in journal_reader.events if e.get("type") in ("actor_crashed", "actor_gave_up")]


async def test_a_handler_slower_than_the_request_deadline_is_answered_timeout(bus: Bus) -> None:
    actor = EchoActor()
    async with supervised(bus, [actor], request_deadline_s=0.5):
        await wait_serving(bus)
        started = time.monotonic()
        with pytest.raises(RemoteError) as late:
            await bus.request("test.echo.ping", Ping(n=1, slow=True), Pong, timeout=10)
        assert late.value.code == "timeout" and "deadline" in str(late.value)
        assert time.monotonic() - started < 5  # answered at the deadline, not at the requester's timeout
        assert (await ping(bus, 2)).incarnation == 1  # the endpoint serves the next request


async def test_deeply_nested_json_is_a_bad_request(bus: Bus) -> None:
    async with supervised(bus, [EchoActor()]):
        await wait_serving(bus)
        for payload in (b"[" * 100_000 + b"]" * 100_000, b'{"n": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
            msg = await bus.nc.request("test.echo.ping", payload, timeout=5)
            assert msg.headers is not None and msg.headers["Mesh-Error"] == BAD_REQUEST
        assert (await ping(bus, 1)).n == 1


async def test_restart_intensity_exceeded_gives_up_for_good(bus: Bus, journal_reader: JournalReader) -> None:
    actor = EchoActor(crash_on_start=100)
    policy = RestartPolicy(max_restarts=3, window_s=60, backoff_initial_s=0.01)
    async with supervised(bus, [actor], policy=lambda: policy) as task:
        gave_up = (await journal_reader.wait_for(of_type("actor_gave_up", actor="echo")))[0]
        with pytest.raises(ExceptionGroup) as group:
            await asyncio.wait_for(asyncio.shield(task), 5)
        assert group.value.subgroup(ActorGaveUpError) is not None
    assert gave_up["crashes"] == 4
    assert "cannot start" in gave_up["error"]
    assert actor.incarnations == 4
    crashes = [e for e in journal_reader.events if e["type"] == "actor_crashed"]
    assert [c["crashes_in_window"] for c in crashes] == [1, 2, 3]
    with pytest.raises(NoResponders):
        await ping(bus, 1)


async def test_malformed_and_schema_invalid_requests_get_errors_and_actor_keeps_serving(bus: Bus) -> None:
    async with supervised(bus, [EchoActor()]):
        await wait_serving(bus)
        cases = {
            b"{not json": None,
            b'{"n": "seven"}': "$.n",
            b'{"n": 1, "extra": true}': "$",
            b"[]": "$",
            b"": None,
        }
        for payload, path in cases.items():
            msg = await bus.nc.request("test.echo.ping", payload, timeout=5)
            assert msg.headers is not None and msg.headers["Mesh-Error"] == BAD_REQUEST
            assert msg.headers["Nats-Service-Error-Code"] == "400"
            body = json.loads(msg.data)
            assert body["code"] == BAD_REQUEST
            assert body["message"]
            if path is not None:
                assert body["details"]["path"] == path
        with pytest.raises(RemoteError) as refused:
            await ping(bus, -1)
        assert refused.value.code == BAD_REQUEST
        assert (await ping(bus, 5)).n == 5


async def test_oversize_payload_is_refused_at_the_sender_naming_both_sizes(bus: Bus) -> None:
    big = Ping(n=1)
    limit = bus.max_payload
    oversized = {"n": 1, "padding": "x" * (limit + 10)}
    with pytest.raises(PayloadTooLarge) as refused:
        await bus.request("test.echo.ping", oversized, Pong, timeout=5)
    size = len(msgspec.json.encode(oversized))
    assert str(size) in str(refused.value) and str(limit) in str(refused.value)
    with pytest.raises(PayloadTooLarge):
        await bus.publish("test.anything", oversized)
    assert big  # the small message type itself is fine


async def test_no_responders_is_immediate_and_clear(bus: Bus) -> None:
    started = time.monotonic()
    with pytest.raises(NoResponders, match=r"test\.nobody\.home"):
        await bus.request("test.nobody.home", Ping(n=1), Pong, timeout=30)
    assert time.monotonic() - started < 5  # far below the 30 s deadline: not a timeout


async def test_client_without_credentials_is_refused(nats_server: NatsServer) -> None:
    with pytest.raises((nats.errors.Error, OSError)) as refused:
        await nats.connect(nats_server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    assert "authorization" in str(refused.value).lower() or "auth" in repr(refused.value).lower()
    with pytest.raises((nats.errors.Error, OSError)):
        await nats.connect(
            nats_server.url, user="mesh", password="wrong", allow_reconnect=False, max_reconnect_attempts=0
        )


async def test_actor_registers_as_micro_service_with_endpoint_stats(bus: Bus) -> None:
    async with supervised(bus, [EchoActor()]):
        await wait_serving(bus)
        await ping(bus, 1)
        reply = await bus.nc.request("$SRV.PING.mesh-echo", b"", timeout=5)
        assert json.loads(reply.data)["name"] == "mesh-echo"
        info = json.loads((await bus.nc.request("$SRV.INFO.mesh-echo", b"", timeout=5)).data)
        assert info["metadata"]["node"] == "test-node"
        assert [e["subject"] for e in info["endpoints"]] == ["test.echo.ping"]
        stats = json.loads((await bus.nc.request("$SRV.STATS.mesh-echo", b"", timeout=5)).data)
        assert stats["endpoints"][0]["num_requests"] >= 2


async def test_a_request_in_flight_when_the_actor_stops_is_answered_unavailable(bus: Bus) -> None:
    actor = EchoActor()
    async with supervised(bus, [actor]) as task:
        await wait_serving(bus)
        pending = asyncio.create_task(bus.request("test.echo.ping", Ping(n=1, slow=True), Pong, timeout=30))
        async with asyncio.timeout(10):
            await actor.busy.wait()
        started = time.monotonic()
        task.cancel()
        with pytest.raises(RemoteError) as stopped:
            await pending
    assert stopped.value.code == "unavailable"
    assert time.monotonic() - started < 5  # an answer, not the 30 s request deadline


class SwallowingActor(Actor):
    """Swallows cancellations the way the NATS client library does while it flushes (`_flush_pending`)."""

    name = "swallower"

    def __init__(self, *, in_run: bool = False, swallow: int = 1) -> None:
        self.in_run = in_run
        self.swallow = swallow  # how many cancellations its task loses
        self.ready = asyncio.Event()
        self.release = asyncio.Event()
        self.lost = 0

    async def run(self, ctx: ActorContext) -> None:
        async def stubborn() -> None:
            while not self.release.is_set():
                try:
                    self.ready.set()
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self.lost += 1
                    if self.lost > self.swallow:
                        raise

        if self.in_run:
            ctx.spawn(asyncio.sleep(3600), "plain")
            self.ready.set()
            with contextlib.suppress(asyncio.CancelledError):  # lost while "starting"
                await asyncio.sleep(3600)
            return
        ctx.spawn(stubborn(), "stubborn")


@pytest.mark.parametrize("in_run", [False, True], ids=["task-loses-a-cancel", "run-loses-a-cancel"])
async def test_an_actor_that_loses_a_cancellation_still_stops_promptly(bus: Bus, in_run: bool) -> None:
    actor = SwallowingActor(in_run=in_run)
    async with supervised(bus, [actor]) as task:
        async with asyncio.timeout(10):
            await actor.ready.wait()
        started = time.monotonic()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10)
        assert done, "the supervisor waited on a task whose cancellation was lost"
    assert time.monotonic() - started < 3
    assert in_run or actor.lost == 2  # the first cancellation was lost, the second one ended it


async def test_an_actor_that_never_stops_is_abandoned_after_the_shutdown_deadline(bus: Bus) -> None:
    actor = SwallowingActor(swallow=1_000_000)
    try:
        async with supervised(bus, [actor], shutdown_deadline_s=0.5) as task:
            async with asyncio.timeout(10):
                await actor.ready.wait()
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=10)
            assert done, "stopping an actor must be bounded even when its task never ends"
    finally:
        actor.release.set()  # let the abandoned task end before the test's loop closes
        await asyncio.sleep(0)


class FlakyBusActor(Actor):
    """Fails to start with a bus fault (as when NATS is away) a number of times, then serves."""

    name = "echo"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.incarnations = 0

    async def run(self, ctx: ActorContext) -> None:
        self.incarnations += 1
        if self.incarnations <= self.failures:
            raise nats.errors.TimeoutError

        async def handle(ping: Ping) -> Pong:
            return Pong(n=ping.n, incarnation=self.incarnations)

        await ctx.add_endpoint("ping", "test.echo.ping", Ping, handle)


async def test_bus_faults_restart_the_actor_but_never_count_toward_giving_up(
    bus: Bus, journal_reader: JournalReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actor_module, "_OUTAGE_BACKOFF_INITIAL_S", 0.01)
    monkeypatch.setattr(actor_module, "_OUTAGE_BACKOFF_MAX_S", 0.02)
    actor = FlakyBusActor(failures=6)
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff_initial_s=0.01)  # 6 real crashes would give up
    async with supervised(bus, [actor], policy=lambda: policy) as task:
        await wait_serving(bus)
        assert (await ping(bus, 1)).incarnation == 7 and not task.done()
    crashes = await journal_reader.wait_for(of_type("actor_crashed", actor="echo"), count=6)
    assert all(c["crashes_in_window"] == 0 for c in crashes)
    assert not [e for e in journal_reader.events if e.get("type") == "actor_gave_up"]
