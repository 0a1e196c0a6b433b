"""The RPC tunnel: bytes between nodes only inside mutual TLS under the cluster's route CA.

A member's exit carries verified connections to a loopback target (here an echo server standing in for
`ggml-rpc-server`); a peer without a certificate, with one from another cluster, or speaking plain TCP completes
no handshake and its connection never reaches the target."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path

import pytest

from runtime.rpc_tunnel import TunnelEntrance, TunnelExit, client_context
from runtime.tls import TlsFiles, ensure_route_certificates

SECRET = "cluster-secret-1"
NAMES = ["127.0.0.1", "localhost"]


class Echo:
    """A loopback echo server counting the connections that reached it."""

    def __init__(self) -> None:
        self.reached = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Echo:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.reached += 1
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        self._server = await asyncio.start_server(echo, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        async with asyncio.timeout(5):
            await self._server.wait_closed()


def certificates(root: Path, secret: str) -> TlsFiles:
    return ensure_route_certificates(root, secret, NAMES)


async def test_bytes_cross_only_between_members_of_the_cluster(tmp_path: Path) -> None:
    member, head, stranger = (certificates(tmp_path / n, s) for n, s in (("m", SECRET), ("h", SECRET), ("x", "other")))
    async with Echo() as target, TunnelExit(member, target.port) as exit_:
        await exit_.start("127.0.0.1")
        async with TunnelEntrance(head, "127.0.0.1", exit_.port) as entrance:
            await entrance.start()
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection("127.0.0.1", entrance.port)
                payload = bytes(range(256)) * 4096  # 1 MiB each way
                writer.write(payload)
                await writer.drain()
                assert await reader.readexactly(len(payload)) == payload
                writer.close()
            assert target.reached == 1

            # A peer under another cluster's secret: its own entrance gets nowhere.
            async with TunnelEntrance(stranger, "127.0.0.1", exit_.port) as wrong:
                await wrong.start()
                async with asyncio.timeout(10):
                    reader, writer = await asyncio.open_connection("127.0.0.1", wrong.port)
                    writer.write(b"hello")
                    await writer.drain()
                    assert await reader.read(100) == b""  # closed: nothing relayed
                    writer.close()

            # A TLS client without a certificate, and plain TCP: no handshake, nothing relayed.
            anonymous = ssl.create_default_context(cafile=str(member.ca))
            anonymous.check_hostname = False
            with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
                async with asyncio.timeout(10):
                    reader, writer = await asyncio.open_connection("127.0.0.1", exit_.port, ssl=anonymous)
                    writer.write(b"hello")
                    await writer.drain()
                    if not await reader.read(100):  # TLS 1.3 reports a refused client certificate on first read
                        raise ConnectionError("closed")
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection("127.0.0.1", exit_.port)
                writer.write(b"\x00" * 64)
                await writer.drain()
                assert await reader.read(100) == b""
                writer.close()
            assert target.reached == 1  # only the member's connection ever reached the RPC server


async def test_a_stranger_cannot_pose_as_the_exit(tmp_path: Path) -> None:
    """The entrance verifies the exit too: a listener with another cluster's certificate gets no bytes."""
    head, stranger = certificates(tmp_path / "h", SECRET), certificates(tmp_path / "x", "other")
    async with Echo() as target, TunnelExit(stranger, target.port) as impostor:
        await impostor.start("127.0.0.1")
        async with TunnelEntrance(head, "127.0.0.1", impostor.port) as entrance:
            await entrance.start()
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection("127.0.0.1", entrance.port)
                writer.write(b"secret weights")
                await writer.drain()
                assert await reader.read(100) == b""
                writer.close()
        assert target.reached == 0
    assert client_context(head).verify_mode == ssl.CERT_REQUIRED
