"""The runner's process shell without llama-server: the bounded server log, the HTTP client (`ServerApi`) against
hostile servers, process groups."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.runner.actor import RunnerActor, RunnerLimits
from actors.runner.process import ServerLog, ServerProcess
from actors.runner.server_api import ServerApi, ServerApiError
from runtime.children import free_port, port_free

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def http_server(handler: Handler) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.close()
        await server.wait_closed()


def _respond(raw: bytes) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(raw)
        await writer.drain()
        writer.close()

    return handler


# --- the server log ----------------------------------------------------------------------------------------


def test_log_rotates_at_its_size_limit_and_keeps_one_old_file(tmp_path: Path) -> None:
    log = ServerLog(tmp_path / "server.log", max_bytes=1000)
    for i in range(100):
        log.feed(f"line {i:04d} {'x' * 40}\n".encode())
    log.close()
    current, old = tmp_path / "server.log", tmp_path / "server.log.1"
    assert current.stat().st_size <= 1000 and old.stat().st_size <= 1000
    assert not (tmp_path / "server.log.2").exists()
    assert "line 0099" in current.read_text()


def test_allocation_lines_are_kept_until_the_model_has_loaded(tmp_path: Path) -> None:
    log = ServerLog(tmp_path / "server.log")
    log.begin("generation 1")
    log.feed(b"0.00.001 I load_tensors:   CPU_Mapped model buffer size =     1.08 MiB\nunrelated\nllama_cont")
    assert not log.loaded.is_set()
    log.feed(b"ext: n_ctx                 = 4096\nsrv  llama_server: model loaded\n")
    assert log.loaded.is_set()
    log.feed(b"sched_reserve: CPU compute buffer size = 9.00 MiB (after loading: not an allocation line)\n")
    assert log.allocation_text().splitlines() == [
        "0.00.001 I load_tensors:   CPU_Mapped model buffer size =     1.08 MiB",
        "llama_context: n_ctx                 = 4096",
    ]
    assert log.tail().splitlines()[-1].startswith("sched_reserve")
    log.begin("generation 2")  # a restart starts over
    assert log.allocation_text() == "" and not log.loaded.is_set()
    log.close()
    assert "=== generation 2" in (tmp_path / "server.log").read_text()


def test_a_projectors_graph_reserved_after_the_load_is_kept_apart(tmp_path: Path) -> None:
    log = ServerLog(tmp_path / "server.log")
    log.begin("generation 1")
    log.feed(b"clip_ctx: CLIP using CPU backend\nsrv  llama_server: model loaded\n")
    assert log.late_text() == ""
    log.feed(b"slot encode_mtmd_: id  0 | task 0 | encoding mtmd batch\n")
    log.feed(b"reserve_compute_meta:        CPU compute buffer size =     0.02 MiB\n")
    assert log.allocation_text() == "clip_ctx: CLIP using CPU backend"
    assert log.late_text() == "reserve_compute_meta:        CPU compute buffer size =     0.02 MiB"
    log.begin("generation 2")  # a restart starts over: the new server reserves it again at its first image
    assert log.late_text() == ""
    log.close()


def test_a_runaway_line_is_cut_and_the_tail_is_bounded(tmp_path: Path) -> None:
    log = ServerLog(tmp_path / "server.log", max_line_bytes=100, tail_lines=3)
    log.feed(b"llama_context: " + b"y" * 10_000)
    log.feed(b"y" * 10_000 + b"\n")
    for i in range(10):
        log.feed(f"tail {i}\n".encode())
    assert all(len(line) <= 100 for line in log.allocation_text().splitlines())
    assert log.tail().splitlines() == ["tail 7", "tail 8", "tail 9"]
    log.close()


# --- the HTTP client (aiohttp through ServerApi) against hostile servers ------------------------------------


@contextlib.asynccontextmanager
async def server_api() -> AsyncIterator[ServerApi]:
    session = ServerApi.session()
    try:
        yield ServerApi(session)
    finally:
        await session.close()


async def test_get_and_post_reach_the_server_and_a_503_is_a_status() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
        )
        seen.append(head + await reader.readexactly(length))
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"status":"ok"}')
        await writer.drain()
        writer.close()

    async with server_api() as api, http_server(handler) as port:
        assert await api.json(port, "GET", "/props", None, timeout_s=5) == {"status": "ok"}
        assert await api.json(port, "POST", "/completion", {"n": 1}, timeout_s=5) == {"status": "ok"}
    assert seen[0].startswith(b"GET /props HTTP/1.1\r\n")
    assert seen[1].startswith(b"POST /completion HTTP/1.1\r\n") and seen[1].endswith(b'\r\n\r\n{"n": 1}')

    loading = (
        b'HTTP/1.1 503 Service Unavailable\r\nContent-Length: 45\r\n\r\n{"error":{"code":503,"message":"Loading..."}}'
    )
    async with server_api() as api, http_server(_respond(loading)) as port:
        assert await api.status(port, "/health", timeout_s=5) == 503
        with pytest.raises(ServerApiError, match=r"GET /props: HTTP 503: Loading\.\.\.") as caught:
            await api.json(port, "GET", "/props", None, timeout_s=5)
        assert caught.value.status == 503


async def test_chunked_close_delimited_and_trickled_bodies_are_read_whole() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n[1, \r\n3\r\n2 ]\r\n0\r\n\r\n"
    async with server_api() as api, http_server(_respond(chunked)) as port:
        assert await api.json(port, "GET", "/slots", None, timeout_s=5) == [1, 2]
    async with server_api() as api, http_server(_respond(b"HTTP/1.0 200 OK\r\n\r\n[3]")) as port:
        assert await api.json(port, "GET", "/slots", None, timeout_s=5) == [3]

    reply = json.dumps({"slots": ["x" * 100] * 200}).encode()  # arrives in many pieces: all of them are read

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(reply))
        for i in range(0, len(reply), 1000):
            writer.write(reply[i : i + 1000])
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()

    async with server_api() as api, http_server(trickle) as port:
        assert await api.json(port, "GET", "/slots", None, timeout_s=5) == json.loads(reply)


async def _endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
    with contextlib.suppress(OSError):
        while True:  # until the client hangs up
            writer.write(b"z" * 65536)
            await writer.drain()


@pytest.mark.parametrize(
    "handler",
    [
        _respond(b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n"),
        _respond(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n" + b"z" * 2048 + b"\r\n0\r\n\r\n"),
        _respond(b"HTTP/1.1 200 OK\r\n\r\n" + b"z" * 2048),
        _endless,
    ],
    ids=["declared", "chunked", "until-close", "endless"],
)
async def test_a_reply_over_the_ceiling_is_refused_with_a_clear_error(handler: Handler) -> None:
    async with server_api() as api, http_server(handler) as port:
        with pytest.raises(ServerApiError, match=r"^GET /props: a reply .*over the limit of 1024 bytes$"):
            await api.json(port, "GET", "/props", None, timeout_s=5, max_bytes=1024)


async def test_a_health_reply_is_bounded_too() -> None:
    async with server_api() as api, http_server(_endless) as port:
        with pytest.raises(ServerApiError, match="GET /health: a reply over the limit"):
            await api.status(port, "/health", timeout_s=5)


async def test_garbage_silence_a_stalled_body_and_refusal_are_server_api_errors() -> None:
    async with server_api() as api:
        async with http_server(_respond(b"SSH-2.0-OpenSSH\r\n\r\n")) as port:
            with pytest.raises(ServerApiError, match=r"^GET /health: malformed reply: Bad status line") as caught:
                await api.status(port, "/health", timeout_s=5)
            assert caught.value.status is None

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # never answers

        async with http_server(silent) as port:
            with pytest.raises(ServerApiError, match=r"^GET /health: no answer within 0\.2s$"):
                await api.status(port, "/health", timeout_s=0.2)

        async def stalled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n[")
            await writer.drain()
            await reader.read()  # the rest never comes

        async with http_server(stalled) as port:
            with pytest.raises(ServerApiError, match=r"^GET /props: no answer within 0\.2s$"):
                await api.json(port, "GET", "/props", None, timeout_s=0.2)

        with pytest.raises(ServerApiError, match=r"^GET /health: ClientConnectorError: ") as caught:
            await api.status(free_port(), "/health", timeout_s=5)
        assert caught.value.status is None


_RESPONSE_PARTS = st.sampled_from(
    [
        b"HTTP/1.1 200 OK\r\n",
        b"HTTP/1.1 503 Service Unavailable\r\n",
        b"HTTP/1.1 ",
        b"Content-Length: 5\r\n",
        b"Content-Length: -3\r\n",
        b"Content-Length: x\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Content-Encoding: gzip\r\n",
        b"\r\n",
        b"5\r\nhello\r\n",
        b"zz\r\n",
        b"0\r\n\r\n",
        b"hello",
        b'{"a": 1}',
        b"\xff\xfe",
    ]
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(_RESPONSE_PARTS, st.binary(max_size=40)), max_size=12))
def test_any_response_bytes_give_a_reply_or_a_server_api_error(parts: list[bytes]) -> None:
    async def exchange() -> None:
        async with server_api() as api, http_server(_respond(b"".join(parts))) as port:
            with contextlib.suppress(ServerApiError):
                assert 100 <= await api.status(port, "/health", timeout_s=2) <= 999
            with contextlib.suppress(ServerApiError):
                reply = await api.json(port, "GET", "/props", None, timeout_s=2, max_bytes=4096)
                assert len(json.dumps(reply)) <= 4 * 4096  # parsed from at most 4096 bytes

    asyncio.run(exchange())


def test_a_free_port_is_free_and_a_bound_one_is_not() -> None:
    import socket

    port = free_port()
    assert port_free(port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert not port_free(port)


def _running(pid: int) -> bool:
    """True while `pid` runs (a zombie's cmdline is empty)."""
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


# --- processes ---------------------------------------------------------------------------------------------


async def test_terminate_signals_the_whole_process_group_then_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    """The child ignores SIGTERM and starts a grandchild in its group; both are gone after terminate."""
    script = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('grandchild', child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    log = ServerLog(tmp_path / "server.log")
    process = await ServerProcess.spawn([sys.executable, "-c", script], env=dict(os.environ), cwd=tmp_path, log=log)
    pump = asyncio.create_task(process.pump())
    async with asyncio.timeout(10):
        while "grandchild" not in log.tail():
            await asyncio.sleep(0.02)
    grandchild = int(log.tail().split()[-1])
    assert os.getpgid(grandchild) == process.pid  # the server leads its own group
    code = await process.terminate(0.3, 5)
    assert code == -signal.SIGKILL
    async with asyncio.timeout(10):
        while _running(grandchild):
            await asyncio.sleep(0.02)
    await pump
    log.close()
    process.signal(signal.SIGTERM)  # a reaped process is never signalled again (its pid may be reused)


# --- instance directories ----------------------------------------------------------------------------------


def test_directories_of_ended_instances_are_pruned_oldest_first_beyond_the_limit(tmp_path: Path) -> None:
    actor = RunnerActor("n1", tmp_path, None, lambda: None, limits=RunnerLimits(kept_instance_dirs=2))
    root = tmp_path / "runner"
    for age, name in enumerate(["newest", "newer", "older", "oldest"]):
        (root / name / "slots").mkdir(parents=True)
        os.utime(root / name, (1_000_000 - age, 1_000_000 - age))
    actor._prune_instance_dirs(frozenset())
    assert sorted(d.name for d in root.iterdir()) == ["newer", "newest"]
