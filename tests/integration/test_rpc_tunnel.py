"""The RPC tunnel: bytes between nodes only inside mutual TLS under the cluster's route CA.

A member's exit carries verified connections to a loopback target (here an echo server standing in for
`ggml-rpc-server`); a peer without a certificate, with one from another cluster, or speaking plain TCP completes
no handshake and its connection never reaches the target."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import sys
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


# --- the head learns when a member's side ends ----------------------------------------------------------------


class Target:
    """A loopback server standing in for `ggml-rpc-server` behind the exit: each connection it accepts is handed
    to the test, which closes it (the far end ends) or waits until the other side ended it."""

    def __init__(self) -> None:
        self.connections: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> Target:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self.connections.put((reader, writer))

        self._server = await asyncio.start_server(accepted, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        """Stops listening (the RPC server is down): the exit can no longer reach it."""
        if self._server is not None:
            self._server.close()
            async with asyncio.timeout(5):
                await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Target:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class WatchedEntrance(TunnelEntrance):
    """A real entrance that also says when it finished with each connection: the moment by which an `on_end`
    for that connection has come if it was going to, so that its absence can be asserted without sleeping."""

    def __init__(self, files: TlsFiles, host: str, port: int) -> None:
        self.reasons: list[str] = []
        self.finished: asyncio.Queue[None] = asyncio.Queue()
        super().__init__(files, host, port, on_end=self.reasons.append)

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await super()._carry(reader, writer)
        finally:
            self.finished.put_nowait(None)


async def test_the_entrance_tells_when_the_far_end_closes_and_not_when_its_own_client_does(tmp_path: Path) -> None:
    member, head = certificates(tmp_path / "m", SECRET), certificates(tmp_path / "h", SECRET)
    async with Target() as target, TunnelExit(member, target.port) as exit_:
        await exit_.start("127.0.0.1")
        async with WatchedEntrance(head, "127.0.0.1", exit_.port) as entrance:
            await entrance.start()
            async with asyncio.timeout(10):
                # llama-server closes its own connection first (it is done with it): nothing is lost.
                reader, writer = await asyncio.open_connection("127.0.0.1", entrance.port)
                writer.write(b"ping")
                await writer.drain()
                far_reader, far_writer = await target.connections.get()
                assert await far_reader.readexactly(4) == b"ping"
                far_writer.write(b"pong")
                await far_writer.drain()
                assert await reader.readexactly(4) == b"pong"
                writer.close()
                assert await far_reader.read(100) == b""  # the close went all the way through
                far_writer.close()
                await entrance.finished.get()
            assert entrance.reasons == []

            async with asyncio.timeout(10):
                # The RPC server ends the connection (it exited): the head is told, and its client sees the end.
                reader, writer = await asyncio.open_connection("127.0.0.1", entrance.port)
                writer.write(b"ping")
                await writer.drain()
                far_reader, far_writer = await target.connections.get()
                assert await far_reader.readexactly(4) == b"ping"
                far_writer.close()
                assert await reader.read(100) == b""
                writer.close()
                await entrance.finished.get()
            assert entrance.reasons == [f"its RPC connection through 127.0.0.1:{exit_.port} was closed by the far end"]

            async with asyncio.timeout(10):
                # The RPC server is down (being restarted): the exit reaches nothing and ends the connection.
                await target.stop()
                reader, writer = await asyncio.open_connection("127.0.0.1", entrance.port)
                assert await reader.read(100) == b""
                writer.close()
                await entrance.finished.get()
            assert len(entrance.reasons) == 2
            assert entrance.reasons[1].startswith(f"its RPC connection through 127.0.0.1:{exit_.port} was ")


async def test_the_entrance_tells_when_the_exit_cannot_be_reached_or_verified(tmp_path: Path) -> None:
    head, stranger = certificates(tmp_path / "h", SECRET), certificates(tmp_path / "x", "other")
    with socket.socket() as bound:  # bound, never listening: connections to its port are refused
        bound.bind(("127.0.0.1", 0))
        port = int(bound.getsockname()[1])
        async with WatchedEntrance(head, "127.0.0.1", port) as entrance:
            await entrance.start()
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection("127.0.0.1", entrance.port)
                assert await reader.read(100) == b""
                writer.close()
                await entrance.finished.get()
            assert len(entrance.reasons) == 1
            assert entrance.reasons[0].startswith(f"its tunnel exit 127.0.0.1:{port} is unreachable: ")
            assert "ConnectionRefusedError" in entrance.reasons[0]

    # An exit that is not a member of this cluster is as good as none.
    async with Echo() as target, TunnelExit(stranger, target.port) as impostor:
        await impostor.start("127.0.0.1")
        async with WatchedEntrance(head, "127.0.0.1", impostor.port) as entrance:
            await entrance.start()
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection("127.0.0.1", entrance.port)
                assert await reader.read(100) == b""
                writer.close()
                await entrance.finished.get()
            assert len(entrance.reasons) == 1
            assert entrance.reasons[0].startswith(f"its tunnel exit 127.0.0.1:{impostor.port} is unreachable: ")
        assert target.reached == 0


async def test_an_entrance_carries_only_its_servers_process_connections(tmp_path: Path) -> None:
    """Issue 30, F15: the head's entrance accepted any local process on loopback (and llama.cpp's RPC has no
    authentication of its own). It now carries only the connections its server's process holds, as the kernel
    tells (`/proc`); another process on the same host reaching its port gets nothing."""
    member, head = certificates(tmp_path / "m", SECRET), certificates(tmp_path / "h", SECRET)
    script = (
        "import socket, sys\n"
        "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=10)\n"
        "s.sendall(b'ping'); print(s.recv(4).decode(), flush=True); s.close()\n"
    )
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def server_pid() -> int:
        return await started

    async with Echo() as target, TunnelExit(member, target.port) as exit_:
        await exit_.start("127.0.0.1")
        async with TunnelEntrance(head, "127.0.0.1", exit_.port, server_pid=server_pid) as entrance:
            await entrance.start()
            server = await asyncio.create_subprocess_exec(
                sys.executable, "-c", script, str(entrance.port), stdout=asyncio.subprocess.PIPE
            )
            started.set_result(server.pid)  # the "server": its connection is carried
            async with asyncio.timeout(20):
                out, _ = await server.communicate()
            assert out.decode().strip() == "ping" and target.reached == 1
            async with asyncio.timeout(10):  # this test's own process is not the server: nothing carried
                reader, writer = await asyncio.open_connection("127.0.0.1", entrance.port)
                writer.write(b"hello")
                await writer.drain()
                assert await reader.read(100) == b""
                writer.close()
            assert target.reached == 1
