"""Starts real `ggml-rpc-server` processes on loopback for end-to-end tests of split serving, and stops them.

Each server is one "member" of a split: llama-server reaches it with `--rpc HOST:PORT` and treats it as a device
(`RPC<i>[HOST:PORT]` in its log). The servers run with `GGML_RPC_DEBUG=1`, so each logs every buffer it
allocates with its exact byte size (`[alloc_buffer] device: 0, size: N -> …`): the ground truth of what a
member holds, to the byte, where llama-server's own lines print MiB with two decimals. The RPC server has no
memory budget of its own (it reports the host's free memory), so nothing here limits one.

`rpc_servers` is a context manager: every server it started is stopped when it exits (SIGTERM to its process
group, SIGKILL if it lingers), whatever happened, and no port is left listening.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from actors.runner.engine import rpc_server_beside
from tests.llama_harness import find_server

__all__ = ["RpcServer", "alloc_sizes", "find_rpc_server", "require_rpc_server", "rpc_servers"]

_ALLOC = re.compile(r"^\[alloc_buffer\] device: (\d+), size: (\d+) -> remote_ptr: [0-9a-f]+, remote_size: (\d+)")


def find_rpc_server() -> str | None:
    """`ggml-rpc-server` beside llama-server (the `llama` extra built with `-DGGML_RPC=ON`), or None."""
    server = find_server()
    if server is None:
        return None
    path = str(rpc_server_beside(server))
    return path if os.access(path, os.X_OK) else None


def require_rpc_server() -> str:
    path = find_rpc_server()
    if path is None:
        pytest.skip("no ggml-rpc-server beside llama-server (build the llama extra with -DGGML_RPC=ON)")
    return path


@dataclass
class RpcServer:
    """One running member: its endpoint and the file its log goes to."""

    endpoint: str
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def allocations(self) -> list[int]:
        """The exact byte size of every buffer this server allocated, in order (model, caches, compute)."""
        return alloc_sizes(self.log())


def alloc_sizes(text: str) -> list[int]:
    """Sizes of the `[alloc_buffer]` lines of a `GGML_RPC_DEBUG` server log (failed allocations left out)."""
    return [int(m.group(3)) for line in text.splitlines() if (m := _ALLOC.match(line.strip()))]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def rpc_servers(count: int, *, deadline: float = 30.0, threads: int = 1) -> Iterator[list[RpcServer]]:
    """`count` RPC servers on free loopback ports, listening when this yields; all stopped on exit.

    A server that is probed for listening sees one connection that closes at once, which it logs and forgets.
    """
    exe = require_rpc_server()
    started: list[RpcServer] = []
    with tempfile.TemporaryDirectory(prefix="mesh-rpc-") as tmp:
        try:
            for i in range(count):
                port = _free_port()
                log_path = Path(tmp) / f"rpc{i}.log"
                env = {**os.environ, "GGML_RPC_DEBUG": "1"}
                with open(log_path, "wb") as log_file:
                    proc = subprocess.Popen(
                        [exe, "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                started.append(RpcServer(endpoint=f"127.0.0.1:{port}", log_path=log_path, process=proc))
            end = time.monotonic() + deadline
            for server in started:
                port = int(server.endpoint.rsplit(":", 1)[1])
                while not _listening(port):
                    if server.process.poll() is not None:
                        raise RuntimeError(f"ggml-rpc-server exited at start: {server.log()[-2000:]}")
                    if time.monotonic() > end:
                        raise TimeoutError(f"ggml-rpc-server on {server.endpoint} not listening after {deadline}s")
                    time.sleep(0.05)
            yield started
        finally:
            for server in started:
                _stop(server.process, grace=5.0)
