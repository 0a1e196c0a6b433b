"""NATS roles on a real nats-server: the `server` fixture, issued credentials, buses that connect as a
role once its rights have loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client

from messages.subjects import Subjects
from runtime import embedded
from runtime.bus import Bus, ConnectFailed
from runtime.creds import issue
from runtime.embedded import Credentials, EmbeddedNats
from runtime.journal import ensure_events_stream
from runtime.roles import Role, inbox_prefix

S = Subjects()


class Session:
    """A raw client of one user that records the server's errors (permission violations arrive there)."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def refused(self, subject: str, what: str = "publish to", timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            # nats-py reports the server's -ERR in lower case
            while not any(f'permissions violation for {what} "{subject.lower()}"' in e.lower() for e in self.errors):
                await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def session(creds: Credentials) -> AsyncIterator[Session]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        creds.url,
        user=creds.user,
        password=creds.password,
        inbox_prefix=inbox_prefix(creds.user),
        tls=ssl.create_default_context(cafile=creds.tls_ca) if creds.tls_ca else None,
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=5,
    )
    try:
        yield Session(nc, errors)
    finally:
        await nc.close()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    nats_server = EmbeddedNats(tmp_path / "node", preferred_port=0, node_id="n1")
    await nats_server.start()
    try:
        yield nats_server
    finally:
        await nats_server.stop()


def issued(server: EmbeddedNats, role: Role) -> Credentials:
    """A new user of `role`, usable at once: `embedded.reload` returns once the server applied the reload whole."""
    user = issue(server.data_dir, role)
    assert embedded.reload(server.data_dir) == server.pid
    assert server.credentials is not None
    return Credentials(server.credentials.url, user.user, user.password, server.credentials.tls_ca)


async def admin_bus(server: EmbeddedNats) -> Bus:
    assert server.credentials is not None
    bus = await Bus.connect(server.credentials.options(), name="admin")
    await ensure_events_stream(bus, S, max_age_s=3600, max_bytes=64 << 20)
    return bus


@contextlib.asynccontextmanager
async def connect_when_loaded(creds: Credentials) -> AsyncIterator[Session]:
    """The reload is asynchronous in the server: a new user may be refused for a moment."""
    async with asyncio.timeout(10):
        while True:
            try:
                connected = session(creds)
                joined = await connected.__aenter__()
                break
            except (nats.errors.Error, OSError):
                await asyncio.sleep(0.05)
    try:
        yield joined
    finally:
        await connected.__aexit__(None, None, None)


async def bus_when_loaded(creds: Credentials, name: str) -> Bus:
    """A bus of a freshly issued user (the server may refuse it for a moment while it reloads)."""
    async with asyncio.timeout(10):
        while True:
            try:
                return await Bus.connect(creds.options(), name=name, deadline_s=2)
            except ConnectFailed:
                await asyncio.sleep(0.05)
