"""A llama-server process and its output (runner shell: processes, files).

* `ServerProcess.spawn` starts the server from an argument list (never a shell) in its own process group
  (`process_group=0`), through the exec wrapper of `runtime.children.dying_with_parent`, which arms the Linux
  parent-death signal (SIGKILL) before it execs the server: the server cannot outlive the process that
  started it, even when that one is killed with SIGKILL. No `preexec_fn` (unsafe while threads run).
  Signals go to the whole group, and only while the server has not been reaped (a reaped pid may already
  belong to someone else).
* Its output goes through a pipe we drain into a `ServerLog`: a file in the data dir (written from a worker
  thread, never on the event loop) that is rotated at a size limit (one old file kept), the allocation
  lines kept in memory until the model has loaded (for the verification and the observed footprint), the
  few allocations a server makes later (a projector's image graph, reserved at the first image), and the
  last lines for crash reports.

Talking to the server over HTTP is `actors.runner.server_api` (aiohttp), not this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from runtime.children import dying_with_parent

__all__ = ["ServerLog", "ServerProcess"]

MIB = 1 << 20

# Substrings of the lines `parse_allocation_log` and the drift check read; everything else stays in the file.
_ALLOCATION_MARKERS = (
    "llama_model_loader: loaded meta data",  # where each model's buffers begin (the model's, then a draft's)
    "load_tensors:",
    "llama_context:",
    "llama_kv_cache",
    "llama_memory_recurrent",
    "sched_reserve:",
    "speculative implementation",
    "- n_max=",
    "common_params_print_info",
    "fit_memory_breakdown",
    "clip_ctx: CLIP using",  # a multimodal projector: its backend, type and size
    "load_hparams: projector:",
    "load_hparams: model size:",
    "reserve_compute_meta:",
)
#: Printed once the model and every context are allocated (right after /health turns 200).
LOADED_MARKER = "model loaded"
#: Allocations a server makes after it has loaded, kept for the observed footprint: a multimodal projector's
#: compute buffer, reserved at the first image (the server runs without a warm-up).
_LATE_MARKERS = ("reserve_compute_meta:",)
_MAX_LATE_LINES = 64


class ServerLog:
    """Where one instance's server output goes: a size-bounded file, the allocation lines, a tail."""

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = 16 * MIB,
        tail_lines: int = 40,
        max_kept_lines: int = 50_000,
        max_line_bytes: int = 64 * 1024,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._max_kept = max_kept_lines
        self._max_line = max_line_bytes
        self._file = path.open("ab")
        self._size = self._file.tell()
        self._partial = b""
        self._kept: list[str] = []
        self._late: list[str] = []
        self._tail: deque[str] = deque(maxlen=tail_lines)
        self.loaded = asyncio.Event()
        self._lock = threading.Lock()  # the file is written from worker threads

    def restart(self) -> None:
        """Starts a new generation in memory: fresh allocation lines and tail (event loop)."""
        self._partial = b""
        self._kept = []
        self._late = []
        self._tail.clear()
        self.loaded = asyncio.Event()

    @staticmethod
    def header(text: str) -> bytes:
        return f"=== {text}\n".encode()

    def begin(self, header: str) -> None:
        """`restart` and the header line written at once (for callers that may block)."""
        self.restart()
        self.write(self.header(header))

    def feed(self, data: bytes) -> None:
        """`take` and `write` at once (for callers that may block)."""
        self.write(data)
        self.take(data)

    def take(self, data: bytes) -> None:
        """The in-memory part of new output: lines, allocation lines, tail (event loop; no I/O)."""
        chunk = self._partial + data
        *lines, rest = chunk.split(b"\n")
        # a line longer than the limit is cut; llama-server's lines are short, a runaway one must not grow us
        self._partial = rest[-self._max_line :]
        for raw in lines:
            self._line(raw[: self._max_line].decode("utf-8", errors="replace").rstrip("\r"))

    def finish(self) -> None:
        """The output ended: its last, unterminated line counts too (event loop; no I/O)."""
        if self._partial:
            self._line(self._partial.decode("utf-8", errors="replace"))
            self._partial = b""

    def _line(self, line: str) -> None:
        self._tail.append(line)
        if self.loaded.is_set():
            if len(self._late) < _MAX_LATE_LINES and any(marker in line for marker in _LATE_MARKERS):
                self._late.append(line)
            return
        if LOADED_MARKER in line:
            self.loaded.set()
        elif len(self._kept) < self._max_kept and any(marker in line for marker in _ALLOCATION_MARKERS):
            self._kept.append(line)

    def write(self, data: bytes) -> None:
        """The file part: appends `data`, rotating at the size limit. Blocking: call it from a worker thread."""
        with self._lock:
            try:
                if self._size + len(data) > self.max_bytes:
                    self._rotate()
                self._file.write(data)
                self._size += len(data)
            except (OSError, ValueError):
                pass  # a full disk (or a closed file) must not stop the server; memory still serves supervision

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._file = self.path.open("ab")
        self._size = 0

    def allocation_text(self) -> str:
        return "\n".join(self._kept)

    def late_text(self) -> str:
        """The allocation lines printed after the model loaded (in order; empty when none)."""
        return "\n".join(self._late)

    def tail(self, max_chars: int = 4000) -> str:
        return "\n".join(self._tail)[-max_chars:]

    def close_file(self) -> None:
        """Flushes and closes the file. Blocking: call it from a worker thread."""
        with self._lock, contextlib.suppress(OSError):
            self._file.close()

    def close(self) -> None:
        self.finish()
        self.close_file()


class ServerProcess:
    """One running llama-server. Create with `spawn`; `pump` drains its output into the log."""

    def __init__(self, process: asyncio.subprocess.Process, log: ServerLog) -> None:
        self._process = process
        self.log = log
        self.pid = process.pid

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log: ServerLog,
        cwd: Path | None = None,
        pass_fds: Sequence[int] = (),
    ) -> ServerProcess:
        """Starts `argv` (`argv[0]` a path). Must run on the event loop's thread: the parent-death signal
        follows the thread that forked, so a child forked from a worker thread would be killed when that
        thread ends. A program that is not there is an `OSError` here, as without the wrapper."""
        if not os.access(argv[0], os.X_OK):
            raise FileNotFoundError(f"{argv[0]} is not an executable file")
        process = await asyncio.create_subprocess_exec(
            *dying_with_parent(list(argv), signal.SIGKILL, os.getpid()),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=dict(env),
            process_group=0,  # its own process group: we signal the group
            pass_fds=tuple(pass_fds),
        )
        return cls(process, log)

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    async def pump(self) -> None:
        """Copies the server's output into the log until it closes its end of the pipe (the file writes in a
        worker thread, one chunk at a time, in order)."""
        stream = self._process.stdout
        assert stream is not None
        try:
            while chunk := await stream.read(65536):
                self.log.take(chunk)
                await asyncio.to_thread(self.log.write, chunk)
        finally:
            self.log.finish()

    async def wait(self) -> int:
        return await self._process.wait()

    async def wait_for(self, timeout_s: float) -> int | None:
        """The exit code once the process is reaped, or None if it is not within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._process.wait()
        except TimeoutError:
            return None

    def signal(self, sig: signal.Signals) -> None:
        """Sends `sig` to the server's process group while the server has not been reaped (its pid is ours
        until then). A server that left its group still gets it, directly."""
        if self._process.returncode is not None:
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def terminate(self, grace_s: float, kill_grace_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; returns the exit code (None if it was not reaped within
        `kill_grace_s` after SIGKILL: it may still be alive; see `actors.runner.reaper` for the honest stop)."""
        self.signal(signal.SIGTERM)
        code = await self.wait_for(grace_s)
        if code is not None:
            return code
        self.signal(signal.SIGKILL)
        return await self.wait_for(kill_grace_s)
