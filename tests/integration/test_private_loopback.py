"""Issue 30 (F15, a member's side): a lent `ggml-rpc-server` accepted any local process on the host's loopback.

It now runs on a loopback of its own (`runtime.private_loopback`: a network namespace), which the tunnel exit
reaches through the server's broker: the exit's dial connects, a local process connecting to the same port
reaches nothing, and the broker ends with its program.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from actors.runner.parts import rpc_server_command
from actors.runner.process import ServerLog, ServerProcess
from runtime import private_loopback
from runtime.children import free_port
from runtime.private_loopback import BrokerGone, PrivateLoopback
from tests.rpc_harness import require_rpc_server

ECHO = (  # a TCP echo server on loopback `port`, one connection at a time
    "import socket,sys\n"
    "s=socket.create_server(('127.0.0.1',int(sys.argv[1])))\n"
    "while True:\n"
    "    c,_=s.accept()\n"
    "    with c:\n"
    "        while (b:=c.recv(65536)): c.sendall(b)\n"
)


@pytest.fixture(autouse=True)
async def _namespaces() -> None:
    assert await private_loopback.available(), "this host permits no user namespaces (`unshare --user --net`)"


@asynccontextmanager
async def privately(
    program: list[str], port: int, log: ServerLog
) -> AsyncIterator[tuple[PrivateLoopback, ServerProcess]]:
    broker = PrivateLoopback()
    argv = private_loopback.command(program, broker.child_fd, port)
    try:
        process = await ServerProcess.spawn(argv, env={}, log=log, pass_fds=(broker.child_fd,))
    finally:
        broker.spawned()
    pump = asyncio.create_task(process.pump())
    try:
        yield broker, process
    finally:
        await process.terminate(5.0)
        broker.close()
        async with asyncio.timeout(5):
            await pump


def _reachable_from_the_host(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


async def test_the_exit_dials_the_program_and_no_other_local_process_reaches_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    async with privately([sys.executable, "-c", ECHO, str(port)], port, ServerLog(tmp_path / "log")) as (broker, _):
        assert await broker.listening(10)
        for round_ in range(3):  # one connection at a time, each a new one
            reader, writer = await broker.dial()
            writer.write(b"hello %d" % round_)
            async with asyncio.timeout(5):
                assert await reader.readexactly(7) == b"hello %d" % round_
            writer.close()
            await writer.wait_closed()
        assert not _reachable_from_the_host(port)  # on the host's loopback the port is nobody's


async def test_the_real_rpc_server_is_reached_only_through_its_broker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    program = list(rpc_server_command(require_rpc_server(), port, 1))
    async with privately(program, port, ServerLog(tmp_path / "log")) as (broker, process):
        assert await broker.listening(10)
        assert not _reachable_from_the_host(port)
        _reader, writer = await broker.dial()
        writer.close()  # the server takes the connection; closing it leaves the server serving the next
        await writer.wait_closed()
        _reader, writer = await broker.dial()
        writer.close()
        assert process.returncode is None


async def test_the_broker_ends_with_its_program_and_then_dials_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    program = [sys.executable, "-c", "import sys,time; time.sleep(0.5); sys.exit(3)"]
    async with privately(program, port, ServerLog(tmp_path / "log")) as (broker, process):
        assert not await broker.listening(10)  # it never listened: the broker says so by ending
        assert await process.wait_for(10) == 3  # with the program's exit code
        with pytest.raises(BrokerGone):
            await broker.dial()


async def test_a_killed_program_is_the_brokers_exit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    async with privately([sys.executable, "-c", ECHO, str(port)], port, ServerLog(tmp_path / "log")) as (
        broker,
        process,
    ):
        assert await broker.listening(10)
        process.signal(signal.SIGKILL)  # the whole group, as the runner stops a part
        assert await process.wait_for(10) is not None
        with pytest.raises(BrokerGone):
            await broker.dial()
