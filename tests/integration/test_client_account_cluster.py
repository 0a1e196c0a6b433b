"""A client on one server of a NATS cluster reaches a node on another, through the accounts of both.

Users stay per server: the client is issued on server a only, the node serves on server b. Its request crosses
a's account boundary and the route; its forged reply subject still lands nowhere; a runner on b reaches the
client's inbox on a (the import on a gives the mesh's account interest in it, which the route carries).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.msg import Msg

from messages.generate import STREAM_PING_HEADER
from messages.subjects import Subjects
from runtime import embedded
from runtime.bus import Bus, ConnectFailed
from runtime.children import free_port
from runtime.creds import issue
from runtime.embedded import ClusterSpec, Credentials, EmbeddedNats
from runtime.roles import Role, inbox_prefix

S = Subjects()
pytestmark = pytest.mark.timeout(120)


def _spec(name: str, port: int, routes: list[int]) -> ClusterSpec:
    return ClusterSpec(
        name=S.prefix,
        host="127.0.0.1",
        port=port,
        routes=tuple(f"127.0.0.1:{p}" for p in routes),
        secret=None,  # loopback: plain routes
        server_name=name,
    )


async def _connect(creds: Credentials, name: str) -> Bus:
    async with asyncio.timeout(10):  # a freshly issued user is loaded once the server has reloaded
        while True:
            try:
                return await Bus.connect(creds.options(), name=name, deadline_s=2)
            except ConnectFailed:
                await asyncio.sleep(0.05)


async def test_a_client_on_one_server_is_served_by_a_node_on_another(tmp_path: Path) -> None:
    pa, pb = free_port(), free_port()
    a = EmbeddedNats(tmp_path / "a", preferred_port=0, node_id="na", cluster=_spec("na", pa, [pa, pb]))
    b = EmbeddedNats(tmp_path / "b", preferred_port=0, node_id="nb", cluster=_spec("nb", pb, [pa, pb]))
    await asyncio.gather(a.start(), b.start())
    buses: list[Bus] = []
    try:
        assert a.credentials is not None and b.node_credentials is not None
        node = await Bus.connect(b.node_credentials.options(), name="node-b")
        buses.append(node)
        watcher = await Bus.connect(b.credentials.options(), name="admin-b")  # type: ignore[union-attr]
        buses.append(watcher)
        user = issue(a.data_dir, Role("client"))
        assert embedded.reload(a.data_dir) == a.pid
        client = await _connect(Credentials(a.credentials.url, user.user, user.password), "client-a")
        buses.append(client)

        landed: list[str] = []

        async def on_landed(msg: Msg) -> None:
            landed.append(msg.subject)

        ledger = f"$KV.{S.reservations_bucket}.node.nb"
        await watcher.nc.subscribe(ledger, cb=on_landed)
        pongs: list[bytes] = []

        async def serve(msg: Msg) -> None:
            stream = json.loads(msg.data).get("stream")
            if stream:  # a runner's chunk and ping to the client's inbox, from server b
                await node.nc.publish(stream, b'{"chunk": 0}')
                pong = await node.nc.request(stream, b"{}", timeout=5, headers={STREAM_PING_HEADER: "1"})
                pongs.append(pong.data)
            await msg.respond(b'{"served_by": "nb"}')

        await node.nc.subscribe(S.placement_fit, cb=serve)
        await node.nc.flush(timeout=5)
        await watcher.nc.flush(timeout=5)

        async with asyncio.timeout(20):  # until the node's interest has crossed the route to a
            while True:
                try:
                    answer = await client.nc.request(S.placement_fit, b"{}", timeout=1)
                    break
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    await asyncio.sleep(0.1)
        assert json.loads(answer.data) == {"served_by": "nb"}

        await client.nc.publish(S.placement_fit, b"{}", reply=ledger)  # the confused deputy, across the route
        chunks: list[bytes] = []
        got_chunk = asyncio.Event()

        async def on_chunk(msg: Msg) -> None:
            if msg.headers and STREAM_PING_HEADER in msg.headers:
                await client.respond(msg, b"")
                return
            chunks.append(msg.data)
            got_chunk.set()

        stream = f"{inbox_prefix(user.user)}.stream"
        await client.nc.subscribe(stream, cb=on_chunk)
        await client.nc.flush(timeout=5)
        answer = await client.nc.request(S.placement_fit, json.dumps({"stream": stream}).encode(), timeout=10)
        assert json.loads(answer.data) == {"served_by": "nb"}
        async with asyncio.timeout(5):
            await got_chunk.wait()
        assert chunks == [b'{"chunk": 0}'] and pongs == [b""]
        await watcher.nc.flush(timeout=5)
        assert landed == []
    finally:
        for bus in buses:
            await bus.close()
        await asyncio.gather(a.stop(), b.stop())
