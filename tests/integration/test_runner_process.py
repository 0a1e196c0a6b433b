"""The runner's process shell without llama-server: the bounded server log, the HTTP client, process groups."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.runner.actor import RunnerActor, RunnerLimits
from actors.runner.process import HttpError, ServerLog, ServerProcess, http_request
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


def test_a_runaway_line_is_cut_and_the_tail_is_bounded(tmp_path: Path) -> None:
    log = ServerLog(tmp_path / "server.log", max_line_bytes=100, tail_lines=3)
    log.feed(b"llama_context: " + b"y" * 10_000)
    log.feed(b"y" * 10_000 + b"\n")
    for i in range(10):
        log.feed(f"tail {i}\n".encode())
    assert all(len(line) <= 100 for line in log.allocation_text().splitlines())
    assert log.tail().splitlines() == ["tail 7", "tail 8", "tail 9"]
    log.close()


# --- the HTTP client ---------------------------------------------------------------------------------------


async def test_get_with_content_length_and_post_with_a_body() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"Content-Length")), 0
        )
        seen.append(head + await reader.readexactly(length))
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"status":"ok"}')
        await writer.drain()
        writer.close()

    async with http_server(handler) as port:
        response = await http_request(port, "GET", "/health", timeout_s=5)
        assert (response.status, response.json()) == (200, {"status": "ok"})
        await http_request(port, "POST", "/completion", body=b'{"n": 1}', timeout_s=5)
    assert seen[0].startswith(b"GET /health HTTP/1.1\r\n")
    assert seen[1].startswith(b"POST /completion HTTP/1.1\r\n") and seen[1].endswith(b'\r\n\r\n{"n": 1}')


async def test_chunked_and_close_delimited_bodies_are_read() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n3\r\nefg\r\n0\r\n\r\n"
    async with http_server(_respond(chunked)) as port:
        assert (await http_request(port, "GET", "/", timeout_s=5)).body == b"abcdefg"
    async with http_server(_respond(b"HTTP/1.0 503 Service Unavailable\r\n\r\nloading")) as port:
        response = await http_request(port, "GET", "/health", timeout_s=5)
        assert (response.status, response.body) == (503, b"loading")


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffff\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n" + b"z" * 2048,
    ],
    ids=["declared", "chunked", "until-close"],
)
async def test_a_body_over_the_ceiling_is_an_error_before_it_is_read(raw: bytes) -> None:
    async with http_server(_respond(raw)) as port:
        with pytest.raises(HttpError, match="limit"):
            await http_request(port, "GET", "/", timeout_s=5, max_bytes=1024)


async def test_malformed_answers_silence_and_refusal_are_http_errors() -> None:
    async with http_server(_respond(b"SSH-2.0-OpenSSH\r\n\r\n")) as port:
        with pytest.raises(HttpError, match="malformed status line"):
            await http_request(port, "GET", "/", timeout_s=5)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers

    async with http_server(silent) as port:
        with pytest.raises(HttpError, match=r"no answer within 0\.2s"):
            await http_request(port, "GET", "/", timeout_s=0.2)
    with pytest.raises(HttpError):
        await http_request(free_port(), "GET", "/", timeout_s=5)


_RESPONSE_PARTS = st.sampled_from(
    [
        b"HTTP/1.1 200 OK\r\n",
        b"HTTP/1.1 ",
        b"Content-Length: 5\r\n",
        b"Content-Length: -3\r\n",
        b"Content-Length: x\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"\r\n",
        b"5\r\nhello\r\n",
        b"zz\r\n",
        b"0\r\n\r\n",
        b"hello",
        b"\xff\xfe",
    ]
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(_RESPONSE_PARTS, st.binary(max_size=40)), max_size=12))
def test_any_response_bytes_give_a_response_or_an_http_error(parts: list[bytes]) -> None:
    async def exchange() -> None:
        async with http_server(_respond(b"".join(parts))) as port:
            with contextlib.suppress(HttpError):
                response = await http_request(port, "GET", "/", timeout_s=2, max_bytes=4096)
                assert len(response.body) <= 4096

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
