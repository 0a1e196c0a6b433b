"""`mesh-actor run` end to end: the node as a subprocess, and in-process when NATS must be killed under it."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import pytest

from messages.subjects import Subjects
from messages.telemetry import NodeResources
from runtime.bus import Bus
from runtime.children import free_port
from runtime.config import load_config
from runtime.embedded import find_nats_server
from runtime.launcher import run_node
from tests.conftest import JournalReader, NatsServer, mesh_actor_command, processes, run_cli


def _pids_with(text: str) -> list[int]:
    """nats-server processes whose command line contains `text` (the config file of one data dir)."""
    return processes("nats-server", text)


async def _wait_gone(text: str, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while _pids_with(text):
            await asyncio.sleep(0.05)


async def _cli(*args: str, timeout: float = 30.0) -> tuple[int, str, str]:
    return await run_cli(*args, timeout=timeout)


@contextlib.asynccontextmanager
async def node_process(data_dir: Path, *extra: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    process = await asyncio.create_subprocess_exec(
        *mesh_actor_command(),
        "run",
        "--data-dir",
        str(data_dir),
        "--nats-port",
        "0",
        "--telemetry-interval",
        "0.5",
        "--telemetry-ttl",
        "3",
        *extra,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode()
        assert "running" in line, line
        yield process, line
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_run_is_ready_visible_in_status_and_journal_and_sigterm_leaves_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    async with node_process(data_dir, "--node-id", "alpha", "--memory-limit", "3GiB") as (process, line):
        assert "alpha" in line and "embedded" in line
        assert _pids_with(str(data_dir / "nats-server.conf")), "embedded nats-server should be running"
        assert oct((data_dir / "nats.json").stat().st_mode & 0o777) == "0o600"

        code, out, err = await _cli("status", "--json", "--data-dir", str(data_dir))
        assert code == 0, err
        nodes = json.loads(out)["nodes"]
        assert [n["node_id"] for n in nodes] == ["alpha"]
        assert nodes[0]["host"]["usable_bytes"] <= 3 << 30
        assert nodes[0]["age_s"] < 5
        assert nodes[0]["memory_limit_bytes"] == 3 << 30

        code, out, err = await _cli("events", "--json", "--data-dir", str(data_dir))
        assert code == 0, err
        events = [json.loads(row)["event"] for row in out.splitlines()]
        types = [e["type"] for e in events]
        assert "node_started" in types and "actor_started" in types
        telemetry = next(e for e in events if e["type"] == "telemetry_changed")
        assert telemetry["resources"]["node_id"] == "alpha"

        code, out, _ = await _cli("events", "--json", "--subject", "telemetry.>", "--data-dir", str(data_dir))
        filtered = [json.loads(r)["event"] for r in out.splitlines()]
        assert code == 0 and {e["actor"] for e in filtered} == {"telemetry"}
        assert "telemetry_changed" in {e["type"] for e in filtered}

        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            assert await process.wait() == 0
    await _wait_gone(str(data_dir / "nats-server.conf"))


async def test_killed_node_leaves_no_nats_server_behind(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    async with node_process(data_dir, "--node-id", "beta") as (process, _):
        assert _pids_with(str(data_dir / "nats-server.conf"))
        process.kill()
        await process.wait()
    await _wait_gone(str(data_dir / "nats-server.conf"))


async def test_node_whose_embedded_nats_server_dies_stops_with_exit_code_1(tmp_path: Path) -> None:
    # Without its server the node can never reach the bus again (it would wait forever, and so would every node
    # on that bus): it stops, so that its service manager restarts it and the server with it.
    data_dir = tmp_path / "node"
    async with node_process(data_dir, "--node-id", "delta") as (process, _):
        os.kill(int((data_dir / "nats-server.pid").read_text().strip()), signal.SIGKILL)
        async with asyncio.timeout(30):
            assert await process.wait() == 1
        assert process.stderr is not None
        assert b"embedded_nats_exited" in await process.stderr.read()


async def test_second_node_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    async with node_process(data_dir, "--node-id", "gamma"):
        code, _, err = await _cli("run", "--data-dir", str(data_dir), "--node-id", "other")
        assert code == 1
        assert "in use" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--memory-limit", "lots"], "--memory-limit"),
        (["run", "--node-id", "no spaces"], "node id"),
        (["run", "--parallel", "0"], "slots"),
        (["run", "--cache-type-k", "q3"], "invalid choice"),
        (["run", "--nats", "localhost"], "not a URL"),
        (["run", "--nats-password", "s3cret"], "unrecognized arguments"),  # no password in argv, not even abbreviated
    ],
)
async def test_bad_run_flags_are_usage_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    code, _, err = await _cli(*args, "--data-dir", str(tmp_path))
    assert code == 2
    assert needle in err and "Traceback" not in err


async def test_client_commands_without_a_node_say_how_to_start_one(tmp_path: Path) -> None:
    for command in ("status", "events", "nats-env"):
        code, _, err = await _cli(command, "--data-dir", str(tmp_path / "empty"))
        assert code == 1
        assert "mesh-actor run" in err and "Traceback" not in err


async def test_nats_env_describes_the_embedded_server(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    async with node_process(data_dir, "--node-id", "delta"):
        code, out, _ = await _cli("nats-env", "--json", "--data-dir", str(data_dir))
        record = json.loads(out)
        assert code == 0 and set(record) == {"url", "user", "password", "inbox_prefix"}
        assert record["inbox_prefix"] == f"_INBOX.{record['user']}"  # what the bus uses; the admin may use any
        code, out, _ = await _cli("nats-env", "--data-dir", str(data_dir))
        assert out.splitlines()[0] == f"NATS_URL={record['url']}"
        # What it prints is enough for a plain nats-py client.
        nc = await nats.connect(record["url"], user=record["user"], password=record["password"])
        await nc.close()


@contextlib.asynccontextmanager
async def node_in_process(
    tmp_path: Path, server: NatsServer, node_id: str, *, ttl: str = "3", handle_signals: bool = False
) -> AsyncIterator[asyncio.Task[int]]:
    """`run_node` in this process; leaving the block stops it, and it must end within 20 s."""
    env = {
        "MESH_ACTOR_NATS": server.url,
        "MESH_ACTOR_NATS_USER": server.options.user or "",
        "MESH_ACTOR_NATS_PASSWORD": server.options.password or "",
    }
    flags = {"data_dir": str(tmp_path / node_id), "node_id": node_id, "telemetry_interval": "0.3", "telemetry_ttl": ttl}
    config = load_config(flags, env)
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(
        run_node(config, announce=lambda _: ready.set(), stop=stop, handle_signals=handle_signals)
    )
    try:
        # asyncio.wait never swallows a cancellation of ours, and never waits past its timeout
        await asyncio.wait({task, asyncio.ensure_future(ready.wait())}, timeout=20, return_when="FIRST_COMPLETED")
        assert ready.is_set(), f"the node did not come up within 20 s: {task}"
        yield task
    finally:
        stop.set()
        done, _ = await asyncio.wait({task}, timeout=20)
        if not done:
            stacks = _task_stacks()
            task.cancel()
            await asyncio.wait({task}, timeout=10)
            raise AssertionError(f"the node did not stop within 20 s of its stop event; tasks:\n{stacks}")
        assert task.result() == 0


def _task_stacks() -> str:
    """Where every task of the loop waits, down the chain of awaits: what a stuck shutdown needs to be seen."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        out.write(f"--- {task.get_name()} {'cancelling' if task.cancelling() else ''}\n")
        awaited: Any = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
            if frame is not None:
                out.write(f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}\n")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
    return out.getvalue()


async def _until(predicate: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Polls `predicate` until it holds. The deadline is checked on every turn, so it holds even when a
    cancellation by `asyncio.timeout` is lost in a library's own `wait_for` (Python 3.11 can lose one)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} within {timeout:g}s")
        await asyncio.sleep(0.1)


async def _next_report(bus: Bus, node_id: str, timeout: float = 10.0) -> NodeResources:
    sub = await bus.nc.subscribe(Subjects().telemetry(node_id))
    try:
        msg = await sub.next_msg(timeout=timeout)
        return msgspec.json.decode(msg.data, type=NodeResources)
    finally:
        await sub.unsubscribe()


async def test_nats_killed_and_restarted_mid_run_node_reconnects_and_journal_is_intact(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    async with node_in_process(tmp_path, nats_server, "epsilon") as task:
        probe = await Bus.connect(nats_server.options, name="probe")
        before = await _next_report(probe, "epsilon")
        reader = JournalReader(probe, Subjects())
        await reader.start()
        await reader.wait_for(lambda e: e["type"] == "telemetry_changed")
        await reader.stop()
        info = await probe.js.stream_info(Subjects().events_stream)
        stored_before = info.state.messages
        assert stored_before >= 3
        await probe.close()

        await nats_server.kill()
        await asyncio.sleep(1.0)  # the node runs without NATS for a while (several telemetry intervals)
        assert not task.done()
        await nats_server.start()

        probe = await Bus.connect(nats_server.options, name="probe")
        try:
            after = await _next_report(probe, "epsilon", timeout=15)
            assert after.seq > before.seq and after.started_at == before.started_at
            reader = JournalReader(probe, Subjects())
            await reader.start()
            # Everything stored before the kill is still there, in order, and new events keep arriving.
            early = await reader.wait_for(lambda e: True, count=stored_before)
            assert [e["type"] for e in early[:2]] == ["node_started", "actor_started"]
            kv = await probe.js.key_value(Subjects().nodes_bucket)

            async def newer_report_stored() -> bool:
                with contextlib.suppress(nats.js.errors.KeyNotFoundError, nats.errors.TimeoutError):
                    entry = await kv.get("epsilon")
                    return bool(msgspec.json.decode(entry.value or b"{}", type=dict)["seq"] > before.seq)
                return False

            await _until(newer_report_stored, 10, "the nodes bucket holds no report newer than before the outage")
            await reader.stop()
        finally:
            await probe.close()


async def test_dead_node_disappears_from_the_nodes_bucket_after_its_ttl(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    probe = await Bus.connect(nats_server.options, name="probe")
    try:
        async with node_in_process(tmp_path, nats_server, "zeta", ttl="2"):
            await _next_report(probe, "zeta")
            kv = await probe.js.key_value(Subjects().nodes_bucket)

            async def stored() -> bool:  # the report goes out on its subject just before the bucket put
                with contextlib.suppress(nats.js.errors.KeyNotFoundError, nats.errors.TimeoutError):
                    return bool((await kv.get("zeta")).value)
                return False

            await _until(stored, 10, "the live node's report is not in the nodes bucket")
        # On expiry the server leaves a delete marker: the key reads back empty (or not at all).

        async def expired() -> bool:
            try:
                return not (await kv.get("zeta")).value
            except nats.js.errors.KeyNotFoundError:
                return True
            except nats.errors.TimeoutError:
                return False

        await _until(expired, 15, "the dead node's key did not expire")
        secret = tmp_path / "nats-password"
        secret.write_text(f"{nats_server.options.password}\n")  # the password never appears in argv
        code, out, err = await _cli(
            "status",
            "--json",
            "--nats",
            nats_server.url,
            "--nats-user",
            nats_server.options.user or "",
            "--nats-password-file",
            str(secret),
        )
        assert code == 0 and json.loads(out)["nodes"] == [], err
    finally:
        await probe.close()
    assert os.environ.get("MESH_ACTOR_NATS") is None  # in-process nodes took their config from a dict


async def test_client_commands_follow_the_data_dirs_config_to_an_external_nats(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    data_dir = tmp_path / "node"
    data_dir.mkdir()
    (data_dir / "config.toml").write_text(
        f'prefix = "other"\n[nats]\nurls = ["{nats_server.url}"]\n'
        f'user = "{nats_server.options.user}"\npassword = "{nats_server.options.password}"\n'
    )
    code, out, err = await _cli("nats-env", "--json", "--data-dir", str(data_dir))
    assert code == 0, err
    assert json.loads(out)["url"] == nats_server.url
    code, out, err = await _cli("status", "--json", "--data-dir", str(data_dir))
    assert code == 0 and json.loads(out)["nodes"] == [], err
    (data_dir / "config.toml").write_text("no_such_option = 1\n")
    code, _, err = await _cli("status", "--data-dir", str(data_dir))
    assert code == 2 and "no_such_option" in err


async def test_in_process_node_leaves_no_signal_handlers_behind(tmp_path: Path, nats_server: NatsServer) -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    async with node_in_process(tmp_path, nats_server, "eta"):
        assert {sig: signal.getsignal(sig) for sig in before} == before  # a library caller's handlers stay
    assert {sig: signal.getsignal(sig) for sig in before} == before


async def test_node_handling_signals_stops_on_sigterm_and_restores_the_previous_handlers(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    async with node_in_process(tmp_path, nats_server, "theta", handle_signals=True) as task:
        os.kill(os.getpid(), signal.SIGTERM)  # reaches the node's handler, not pytest's default
        done, _ = await asyncio.wait({task}, timeout=20)
        assert done and task.result() == 0
    assert {sig: signal.getsignal(sig) for sig in before} == before


async def test_a_long_nats_outage_crashes_no_actor_and_the_node_carries_on(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    """Longer than the supervisor's restart window allows crashes for: a bus fault must not end the node."""
    async with node_in_process(tmp_path, nats_server, "iota") as task:
        probe = await Bus.connect(nats_server.options, name="probe")
        before = await _next_report(probe, "iota")
        await probe.close()
        await nats_server.kill()
        await asyncio.sleep(12)  # the node runs without NATS (a fixed outage is the point, not a wait)
        assert not task.done()
        await nats_server.start()
        probe = await Bus.connect(nats_server.options, name="probe")
        try:
            after = await _next_report(probe, "iota", timeout=15)
            assert after.seq > before.seq and not task.done()
            stored = (await probe.js.stream_info(Subjects().events_stream)).state.messages
            reader = JournalReader(probe, Subjects())
            await reader.start()
            events = await reader.wait_for(lambda e: True, count=stored)  # the whole journal so far
            await reader.stop()
            assert events[0]["type"] == "node_started"
            assert not [e for e in events if e.get("type") == "actor_gave_up"]
            # an incarnation may fail while the bus is away; none of that counts toward the restart intensity
            assert all(e["crashes_in_window"] == 0 for e in events if e.get("type") == "actor_crashed")
        finally:
            await probe.close()


async def test_a_nats_server_without_jetstream_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    port = free_port()
    server = await asyncio.create_subprocess_exec(
        find_nats_server(), "-a", "127.0.0.1", "-p", str(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        data_dir = tmp_path / "node"
        data_dir.mkdir()
        (data_dir / "config.toml").write_text(f'[nats]\nurls = ["nats://127.0.0.1:{port}"]\n')
        code, _, err = await _cli("run", "--data-dir", str(data_dir), timeout=60)
        assert code == 1 and "JetStream is not available" in err and "Traceback" not in err, err
    finally:
        server.kill()
        async with asyncio.timeout(10):
            await server.wait()
