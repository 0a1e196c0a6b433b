"""Mutual-TLS tunnels for llama.cpp's RPC traffic between nodes (runtime shell).

llama.cpp's RPC protocol has no authentication (its own docs: never expose `ggml-rpc-server` on an open
network). A node lending memory runs its RPC server on loopback only; the bytes between nodes travel inside TLS
with both ends verified under the cluster's route CA (`runtime.tls.ensure_route_certificates`: derived from the
cluster secret every node already shares, so nothing is distributed), terminated next to each end:

    llama-server --rpc 127.0.0.1:A  ->  TunnelEntrance (head node, loopback :A; its server's process only)
        ==TLS, client certificate==>  TunnelExit (member node, cluster address :B, certificate required)
        ->  ggml-rpc-server (member node, loopback :C of a network namespace of its own where the host permits
            one, `runtime.private_loopback`: no other local process reaches it)

A peer without a certificate issued under that CA completes no handshake and reaches nothing; the exit opens
its connection to the RPC server only once the handshake succeeded. On the head, the entrance carries only the
connections of its own llama-server process (`server_pid`, told by the kernel: `runtime.peer_process`): another
local process reaching the entrance's port gets nothing. Every connect and handshake has a deadline;
the two directions of a connection are copied until either side closes, and a failure of one closes both.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from typing import Final, Self

from runtime.logging import get_logger
from runtime.peer_process import peer_is
from runtime.tls import TlsFiles

__all__ = ["Dial", "TunnelEntrance", "TunnelExit", "client_context", "server_context"]

_log = get_logger(component="rpc-tunnel")
CHUNK: Final = 1 << 18  # a read's most; RPC moves weights in large messages, tokens in small ones
CONNECT_TIMEOUT_S: Final = 10.0
HANDSHAKE_TIMEOUT_S: Final = 10.0


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The exit's side: its certificate, and a client certificate under the cluster CA required."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.verify_mode = ssl.CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """The entrance's side: its certificate, and the exit's verified under the cluster CA. Any member's
    certificate names that member's own addresses; membership is what is proven (only the cluster secret
    issues under this CA), so the peer's host name is not checked against the address dialled."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str | None:
    """Copies until the reader's side ends (None; a failing read raises), or writing fails (returns why: the
    writer's side is gone)."""
    while data := await reader.read(CHUNK):
        try:
            writer.write(data)
            await writer.drain()
        except (OSError, ssl.SSLError) as exc:
            return repr(exc)
    return None


async def _splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> str | None:
    """Copies both ways until either side ends (or fails), then closes both. Returns None when `a`'s side
    ended or failed first, else how `b`'s did. No half-close is carried: TLS streams here cannot send one, and
    an RPC client that stops sending is done with its connection."""
    copies = [asyncio.create_task(_copy(a[0], b[1])), asyncio.create_task(_copy(b[0], a[1]))]
    try:
        done, _ = await asyncio.wait(copies, return_when=asyncio.FIRST_COMPLETED)
        task = copies[0] if copies[0] in done else copies[1]
        error = task.exception()
        if error is not None:
            _log.info("rpc_tunnel_connection_ended", error=repr(error))
        written = None if error is not None else task.result()  # a failed write: the other side is gone
        if task is copies[0]:  # a's reads ended (a's side) or writing to b failed (b's side)
            return f"failed: {written}" if written is not None else None
        if written is not None:  # writing to a failed: a's side
            return None
        return f"failed: {error!r}" if error is not None else "closed by the far end"
    finally:
        for task in copies:
            task.cancel()
        await asyncio.gather(*copies, return_exceptions=True)
        for _, writer in (a, b):
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
                async with asyncio.timeout(2):
                    await writer.wait_closed()


class _Listener:
    """A TCP listener whose connections are each handled by `handle`, all of them closed with it."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    async def _listen(
        self,
        host: str,
        port: int,
        handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
        context: ssl.SSLContext | None,
    ) -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._connections.add(task)
            try:
                await handle(reader, writer)
            finally:
                self._connections.discard(task)

        self._server = await asyncio.start_server(
            accepted, host, port, ssl=context, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if context else None
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(self._connections, timeout=5)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


#: How an exit reaches its RPC server: a new connection each time.
Dial = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class TunnelExit(_Listener):
    """On a member node: accepts TLS connections from other members (a client certificate under the cluster CA
    required) on `host:port` and carries each to the RPC server: on loopback `target` (a port), or through
    `target` (a `Dial`: the server on a loopback of its own, `runtime.private_loopback`)."""

    def __init__(self, files: TlsFiles, target: int | Dial) -> None:
        super().__init__()
        self._context = server_context(files)
        self._target = target

    async def start(self, host: str, port: int = 0) -> TunnelExit:
        await self._listen(host, port, self._carry, self._context)
        return self

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                target = await self._dial()
        except (OSError, TimeoutError) as exc:
            where = self._target if isinstance(self._target, int) else "its own loopback"
            _log.warning("rpc_tunnel_target_unreachable", target=where, peer=str(peer), error=repr(exc))
            writer.close()
            return
        await _splice((reader, writer), target)

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if isinstance(self._target, int):
            return await asyncio.open_connection("127.0.0.1", self._target)
        return await self._target()


class TunnelEntrance(_Listener):
    """On the head node: accepts llama-server's RPC connections on loopback and carries each over TLS (with this
    node's certificate) to a member's `TunnelExit` at `host:port`."""

    def __init__(
        self,
        files: TlsFiles,
        host: str,
        port: int,
        on_end: Callable[[str], None] | None = None,
        server_pid: Callable[[], Awaitable[int]] | None = None,
    ) -> None:
        """`on_end` is told why whenever the member's side of a carried connection ends or fails, or the
        exit cannot be reached (not when llama-server closes its own side): a split's head learns so that a
        member is gone. `server_pid`: the process whose connections alone are carried (awaited: the server
        starts after its entrances); None: any local process's."""
        super().__init__()
        self._context = client_context(files)
        self._remote = (host, port)
        self._on_end = on_end or (lambda reason: None)
        self._server_pid = server_pid

    async def start(self, port: int = 0) -> TunnelEntrance:
        await self._listen("127.0.0.1", port, self._carry, None)
        return self

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self._remote
        if self._server_pid is not None and not await self._from_server(writer):
            writer.close()
            return
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S + HANDSHAKE_TIMEOUT_S):
                remote = await asyncio.open_connection(host, port, ssl=self._context, server_hostname=host)
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            _log.warning("rpc_tunnel_exit_unreachable", host=host, port=port, error=repr(exc))
            writer.close()
            self._on_end(f"its tunnel exit {host}:{port} is unreachable: {exc!r}")
            return
        ended = await _splice((reader, writer), remote)
        if ended is not None:
            self._on_end(f"its RPC connection through {host}:{port} was {ended}")

    async def _from_server(self, writer: asyncio.StreamWriter) -> bool:
        """Whether the connection is the server's own (its process holds the peer socket), logged when not."""
        assert self._server_pid is not None
        sockname, peername = writer.get_extra_info("sockname"), writer.get_extra_info("peername")
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                pid = await self._server_pid()
        except TimeoutError:
            _log.warning("rpc_tunnel_refused", peer=str(peername), reason="no server started to carry for")
            return False
        if await asyncio.to_thread(peer_is, pid, sockname, peername):
            return True
        _log.warning("rpc_tunnel_refused", peer=str(peername), reason=f"not the server's process ({pid})")
        return False
