"""The dashboard of a node in this process, on a real nats-server: its stream's snapshot names the node and its
front door's models, an event published in the mesh arrives as a delta, and after the NATS server was killed and
restarted, a page that connects again gets the mesh afresh and hears new events."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from runtime.children import free_port
from runtime.config import load_config
from runtime.launcher import run_node
from tests.conftest import NatsServer

KEY = "node-dashboard-key"


@contextlib.asynccontextmanager
async def node_with_front_door(tmp_path: Path, server: NatsServer, port: int) -> AsyncIterator[None]:
    env = {
        "MESH_ACTOR_NATS": server.url,
        "MESH_ACTOR_NATS_USER": server.options.user or "",
        "MESH_ACTOR_NATS_PASSWORD": server.options.password or "",
        "MESH_ACTOR_API_KEY": KEY,
    }
    flags = {"data_dir": str(tmp_path / "door"), "node_id": "door", "telemetry_interval": "0.3",
             "http": f"127.0.0.1:{port}"}  # fmt: skip
    config = load_config(flags, env)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_node(config, announce=lambda _: ready.set(), stop=stop))
    try:
        await asyncio.wait({task, asyncio.ensure_future(ready.wait())}, timeout=20, return_when="FIRST_COMPLETED")
        assert ready.is_set(), f"the node did not come up within 20 s: {task}"
        yield
    finally:
        stop.set()
        done, _ = await asyncio.wait({task}, timeout=20)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=10)
            raise AssertionError("the node did not stop within 20 s of its stop event")
        assert task.result() == 0


async def events(reply: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, Any]]:
    """The stream's server-sent events as (name, decoded data)."""
    kind = ""
    while True:
        line = (await reply.content.readline()).decode()
        if line == "":
            return
        if line.startswith("event: "):
            kind = line.removeprefix("event: ").strip()
        elif line.startswith("data: "):
            yield kind, json.loads(line.removeprefix("data: "))


async def snapshot_then(reply: aiohttp.ClientResponse, wanted: Any, timeout_s: float = 20) -> dict[str, Any]:
    """The snapshot, then deltas until one satisfies `wanted`; returns the snapshot."""
    snapshot: dict[str, Any] = {}
    async with asyncio.timeout(timeout_s):
        async for kind, data in events(reply):
            if kind == "snapshot":
                snapshot = data
            elif kind == "delta" and any(wanted(d) for d in data):
                return snapshot
    raise AssertionError("the stream ended")


async def connect_when_up(session: aiohttp.ClientSession, url: str, timeout_s: float = 30) -> aiohttp.ClientResponse:
    """The stream, once the dashboard answers it again (503 while it restarts)."""
    async with asyncio.timeout(timeout_s):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                reply = await session.get(url, headers={"Authorization": f"Bearer {KEY}"})
                if reply.status == 200:
                    return reply
                reply.release()
            await asyncio.sleep(0.3)


async def test_the_dashboard_follows_the_mesh_and_comes_back_after_a_nats_outage(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/ui/stream"

    def telemetry(d: dict[str, Any]) -> bool:
        return bool((d["op"] == "event" and d["value"]["type"] == "telemetry_changed") or d["op"] == "node")

    async with (
        node_with_front_door(tmp_path, nats_server, port),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=20)) as session,
    ):
        reply = await connect_when_up(session, url)
        snapshot = await snapshot_then(reply, telemetry)
        assert "door" in snapshot["nodes"] and snapshot["nodes"]["door"]["devices"]
        assert [e["type"] for e in snapshot["journal"]][:1] == ["node_started"]
        reply.close()

        await nats_server.kill()
        await asyncio.sleep(2.0)  # the node runs without NATS for a while (a fixed outage is the point)
        await nats_server.start()

        reply = await connect_when_up(session, url)
        snapshot = await snapshot_then(reply, telemetry, timeout_s=30)
        assert "door" in snapshot["nodes"]
        reply.close()
