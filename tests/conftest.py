"""Shared fixtures: a real nats-server per test (JetStream, credentials), a connected bus, a journal reader."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from messages.subjects import Subjects
from runtime import buckets
from runtime.actor import Supervisor
from runtime.bus import Bus, encode
from runtime.config import NatsOptions
from runtime.embedded import EmbeddedNats
from runtime.journal import Journal, ensure_events_stream
from runtime.logging import configure_logging
from runtime.restart import RestartPolicy

configure_logging("warning", json=True)
#: The shared helpers' asserts explain a failure as a test module's do (they are imported after this).
pytest.register_assert_rewrite("tests.harness")
#: Placement refuses model files outside a node's model directories. Tests and benchmarks write their models under
#: the temporary directory (pytest's and their own), so every node started from here (whatever starts it) may read
#: models there; a test of the refusal passes its own value.
os.environ.setdefault("MESH_ACTOR_MODEL_ROOTS", tempfile.gettempdir())
#: Property tests judge results, never time: hypothesis's per-example deadline (200 ms) failed a pure test once
#: when a shared 2-core machine paused it for 600 ms. pytest-timeout still bounds every test.
settings.register_profile("mesh", deadline=None)
settings.load_profile("mesh")


class NatsServer:
    """A real nats-server for one test; `restart` keeps its port, data (JetStream files) and password."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._server = EmbeddedNats(data_dir, preferred_port=0)
        self.options = NatsOptions()

    async def start(self) -> None:
        creds = await self._server.start()
        self.options = creds.options()
        self._server.preferred_port = int(creds.url.rsplit(":", 1)[1])

    async def stop(self) -> None:
        await self._server.stop()

    async def kill(self) -> None:
        """Kills the server without a graceful shutdown."""
        pid = self._server.pid
        assert pid is not None
        os.kill(pid, 9)
        await self._server.stop()

    @property
    def url(self) -> str:
        return self.options.urls[0]


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    server = NatsServer(tmp_path / "nats")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    connected = await Bus.connect(nats_server.options, name="test")
    await ensure_events_stream(connected, Subjects(), max_age_s=3600, max_bytes=64 << 20)
    try:
        yield connected
    finally:
        await connected.close()


class JournalReader:
    """Reads the events stream from its start and waits for events matching a predicate."""

    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self._bus = bus
        self._subjects = subjects
        self.events: list[dict[str, Any]] = []
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self._bus.js.subscribe(
            self._subjects.events_all, stream=self._subjects.events_stream, ordered_consumer=True
        )

    async def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], *, timeout: float = 10.0, count: int = 1
    ) -> list[dict[str, Any]]:
        async with asyncio.timeout(timeout):
            while True:
                matching = [e for e in self.events if predicate(e)]
                if len(matching) >= count:
                    return matching
                msg = await self._sub.next_msg(timeout=timeout)
                try:
                    self.events.append(json.loads(msg.data))
                except ValueError:  # a test may publish garbage on purpose
                    self.events.append({"unparsable": msg.data.decode(errors="replace")})

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()


@pytest.fixture
async def journal_reader(bus: Bus) -> AsyncIterator[JournalReader]:
    reader = JournalReader(bus, Subjects())
    await reader.start()
    try:
        yield reader
    finally:
        await reader.stop()


def of_type(kind: str, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("type") == kind and all(e.get(k) == v for k, v in fields.items())


def mesh_actor_command() -> list[str]:
    """The installed console script, or the module when it is not on PATH."""
    script = Path(sys.executable).parent / "mesh-actor"
    if script.exists():
        return [str(script)]
    found = shutil.which("mesh-actor")
    return [found] if found else [sys.executable, "-m", "runtime.cli"]


async def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`mesh-actor ARGS...` to its end: (exit code, stdout, stderr). Past `timeout` it is killed (nothing is
    left running) and TimeoutError raised."""
    process = await asyncio.create_subprocess_exec(
        *mesh_actor_command(),
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **env} if env else None,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@contextlib.asynccontextmanager
async def node_process(
    data_dir: Path,
    node_id: str,
    *args: str,
    env: dict[str, str] | None = None,
    stderr: Path | None = None,
    ready_s: float = 30.0,
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A `mesh-actor run` process on its embedded NATS (unless `args` say otherwise), up once it prints its
    "running" line; stopped with SIGTERM (SIGKILL after 30 s) at the end. `stderr`: where its log goes
    (default: a file beside the data dir, whose tail is logged when the test fails inside this context)."""
    if stderr is None:
        stderr = data_dir.with_name(f"{data_dir.name}.{node_id}.log")
    err = stderr.open("ab")
    try:
        process = await asyncio.create_subprocess_exec(
            *mesh_actor_command(), "run", "--data-dir", str(data_dir), "--node-id", node_id, "--nats-port", "0",
            "--telemetry-interval", "0.5", *args,
            stdout=subprocess.PIPE, stderr=err, env={**os.environ, **(env or {})},
        )  # fmt: skip
    finally:
        err.close()  # the child holds its own copy
    try:
        assert process.stdout is not None
        async with asyncio.timeout(ready_s):
            line = (await process.stdout.readline()).decode()
        assert "running" in line, line
        yield process
    except BaseException:
        tail = stderr.read_text(errors="replace").splitlines()[-80:] if stderr.exists() else []
        logging.getLogger("tests.node").error("node %s failed the test; its log ends:\n%s", node_id, "\n".join(tail))
        raise
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(30):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


@contextlib.asynccontextmanager
async def supervised(
    bus: Bus,
    actors: list[Any],
    *,
    node_id: str = "test-node",
    subjects: Subjects | None = None,
    policy: Callable[[], RestartPolicy] | None = None,
    escalate: bool = True,
    request_deadline_s: float = 30.0,
    shutdown_deadline_s: float = 5.0,
) -> AsyncIterator[asyncio.Task[None]]:
    """Runs `actors` under a real Supervisor with a running Journal; stops them at the end.

    Plain tasks, not a TaskGroup: a test may let the supervisor fail on purpose and inspect the task."""
    subjects = subjects or Subjects()
    journal = Journal(bus, subjects, node_id)
    supervisor = Supervisor(
        bus=bus,
        journal=journal,
        subjects=subjects,
        node_id=node_id,
        policy=policy or (lambda: RestartPolicy(backoff_initial_s=0.01)),
        escalate=escalate,
        request_deadline_s=request_deadline_s,
        shutdown_deadline_s=shutdown_deadline_s,
    )
    journal_task = asyncio.create_task(journal.run())
    task = asyncio.create_task(supervisor.run(actors))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await journal.flush(5)
        journal_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await journal_task


async def put_telemetry(bus: Bus, report: Any, *, subjects: Subjects | None = None) -> None:
    """Writes a node's report into the nodes bucket, as its telemetry actor would."""
    kv = await buckets.nodes(bus, subjects or Subjects())
    await kv.put(report.node_id, encode(report))


def processes(program: str, text: str) -> list[int]:
    """Pids of running `program` processes (by executable name) whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if argv and argv[0].endswith(program.encode()) and text.encode() in b" ".join(argv):
                    found.append(int(entry.name))
    return found
