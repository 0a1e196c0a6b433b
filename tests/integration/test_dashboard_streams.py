"""The dashboard's server-sent events under hostile clients: a client that stops reading is dropped once it is
`queue_limit` deltas behind or a write takes over `write_timeout_s`, and at most `max_clients` streams are open at
once. The dashboard's routes are served by aiohttp on loopback, fed deltas directly (no bus is needed for this)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from actors.dashboard.actor import DashboardActor
from actors.dashboard.view import FleetView

KEY = "stream-key"
HEAD = {"Authorization": f"Bearer {KEY}"}


@contextlib.asynccontextmanager
async def serving(actor: DashboardActor) -> AsyncIterator[str]:
    """The dashboard's routes on a loopback port, with a view as if its actor were running."""
    actor._view = FleetView()  # what `run` sets once its watches delivered the records
    app = web.Application()
    actor.register(app)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        async with asyncio.timeout(10):
            await runner.cleanup()


async def until(condition: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


async def read_event(reply: aiohttp.ClientResponse) -> str:
    """The next server-sent event's name (comments and `retry:` lines skipped)."""
    kind = ""
    async with asyncio.timeout(10):
        while True:
            line = (await reply.content.readline()).decode()
            if line == "":
                return "<end>"
            if line.startswith("event: "):
                kind = line.removeprefix("event: ").strip()
            elif line == "\n" and kind:
                return kind


def delta(i: int, pad: int = 0) -> list[dict[str, Any]]:
    return [{"op": "event", "id": f"e{i}", "value": {"id": f"e{i}", "summary": "x" * pad}}]


async def stalled_client(base: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream opened over a raw socket with a small receive buffer, whose reader then reads nothing more."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
    writer.write(f"GET /ui/stream HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    await writer.drain()
    async with asyncio.timeout(10):
        assert b"200" in await reader.readline()
    return reader, writer


async def test_a_client_that_falls_behind_is_dropped_and_the_others_keep_their_stream() -> None:
    actor = DashboardActor(api_key=KEY, queue_limit=8, write_timeout_s=1.0)
    async with (
        serving(actor) as base,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(f"{base}/ui/stream", headers=HEAD) as reader_reply,
    ):
        assert await read_event(reader_reply) == "snapshot"
        _, writer = await stalled_client(base)
        try:
            await until(lambda: actor.clients == 2)
            sent = 0
            async with asyncio.timeout(20):
                while actor.clients == 2:  # the stalled one goes: its queue or its socket is full
                    actor._publish(delta(sent, pad=50_000))
                    sent += 1
                    assert await read_event(reader_reply) == "delta"  # the reading client keeps up
                    await asyncio.sleep(0.01)
            assert actor.clients == 1 and sent > 1
            actor._publish(delta(sent))
            assert await read_event(reader_reply) == "delta"
        finally:
            writer.close()


async def test_a_burst_beyond_a_clients_queue_ends_its_stream_and_a_reconnect_starts_from_a_snapshot() -> None:
    actor = DashboardActor(api_key=KEY, queue_limit=4)
    async with serving(actor) as base, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(f"{base}/ui/stream", headers=HEAD) as reply:
            assert await read_event(reply) == "snapshot"
            for i in range(10):  # all at once: the handler cannot send any before the queue is full
                actor._publish(delta(i))
            assert actor.clients == 0
            assert await read_event(reply) == "<end>"
        async with session.get(f"{base}/ui/stream", headers=HEAD) as again:
            assert await read_event(again) == "snapshot"


async def test_streams_are_bounded_and_a_closed_one_frees_its_place() -> None:
    actor = DashboardActor(api_key=KEY, max_clients=3)
    async with serving(actor) as base, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with contextlib.AsyncExitStack() as streams:
            for _ in range(3):
                reply = await streams.enter_async_context(session.get(f"{base}/ui/stream", headers=HEAD))
                assert await read_event(reply) == "snapshot"
            async with session.get(f"{base}/ui/stream", headers=HEAD) as refused:
                assert refused.status == 503 and refused.headers["Retry-After"]
        await until(lambda: actor.clients == 0)
        async with session.get(f"{base}/ui/stream", headers=HEAD) as reply:
            assert await read_event(reply) == "snapshot"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Cookie": "mesh_ui_session=1.x"}])
async def test_a_stream_without_the_key_is_refused(headers: dict[str, str]) -> None:
    actor = DashboardActor(api_key=KEY)
    async with (
        serving(actor) as base,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(f"{base}/ui/stream", headers=headers) as reply,
    ):
        assert reply.status == 401 and actor.clients == 0


async def test_the_key_posted_once_becomes_a_session_cookie_and_a_form_of_another_site_is_refused() -> None:
    actor = DashboardActor(api_key=KEY)
    async with serving(actor) as base, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        post = f"{base}/ui/session"
        async with session.post(post, data={"key": KEY}, headers={"Origin": "http://elsewhere.test"}) as other:
            assert other.status == 403
        async with session.post(post, data={"key": "wrong"}, allow_redirects=False) as wrong:
            assert wrong.status == 401 and wrong.content_type == "text/html" and "Set-Cookie" not in wrong.headers
        async with session.post(post, data={"key": KEY}, headers={"Origin": base}, allow_redirects=False) as right:
            assert right.status == 303 and right.headers["Location"] == "/ui"
            cookie = right.headers["Set-Cookie"]
        assert all(part in cookie for part in ("HttpOnly", "SameSite=Strict", "Path=/ui")) and KEY not in cookie
        pair = cookie.split(";", 1)[0]
        async with session.get(f"{base}/ui", headers={"Cookie": pair}) as page:
            assert page.status == 200 and "<main>" in await page.text()
        async with session.get(f"{base}/ui/stream", headers={"Cookie": pair}) as stream:
            assert await read_event(stream) == "snapshot"
