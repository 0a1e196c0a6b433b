"""Whole nodes as processes: `mesh-actor run` started and stopped (`node`), the CLI against them (`cli`),
their NATS environment, waiting for them to join.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.settings import ServingSettings
from runtime.cli import journal as journal_cli
from runtime.cli import node as node_cli
from runtime.cli import parser_for
from runtime.cli.common import CliError, client_options, connection_record
from tests.conftest import node_process, run_cli

QUIET = ("--cache-ram", "0", "--ctx-checkpoints", "0")


async def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str, str]:
    return await run_cli(*args, timeout=timeout, env=env)


def parsed(*argv: str) -> argparse.Namespace:
    """`mesh-actor ARGV...`'s arguments as the command's own parser reads them (to run its code in this process:
    a setup or a poll starts no process; the CLI's own tests run the real command)."""
    return parser_for(argv).parse_args(argv)


async def status_of(data_dir: Path) -> dict[str, Any] | None:
    """What `mesh-actor status --json --data-dir DATA_DIR` prints, read by the command's own code in this process
    (a wait that polls it starts no process); None where the command fails (no node's NATS to reach yet)."""
    try:
        async with asyncio.timeout(30):
            status = await node_cli.read_status(parsed("status", "--json", "--data-dir", str(data_dir)))
    except CliError:
        return None
    return node_cli.status_record(status, time.time())


async def instances_of(data_dir: Path) -> list[dict[str, Any]]:
    """Every instance `status` lists (as `status_of`; the node must be reachable)."""
    status = await status_of(data_dir)
    assert status is not None, f"no status from {data_dir}"
    return list(status["instances"])


async def events_of(data_dir: Path, *args: str, timeout: float = 30) -> list[dict[str, Any]]:
    """The events `mesh-actor events --json ARGS --data-dir DATA_DIR` prints, read by the command's own code in
    this process (`--subject runner.generate_cancelled`, `--usage`, `--since 5m`, ...)."""
    argv = parsed("events", "--json", *args, "--data-dir", str(data_dir))
    async with asyncio.timeout(timeout):
        return [row["event"] async for row in journal_cli.event_rows(argv)]


@contextlib.asynccontextmanager
async def node(data_dir: Path, node_id: str, *args: str, env: dict[str, str] | None = None) -> AsyncIterator[Any]:
    async with node_process(data_dir, node_id, *args, env=env) as process:
        yield process


@contextlib.asynccontextmanager
async def joined_node(
    leader: Path, data_dir: Path, node_id: str, *args: str, stderr: Path | None = None
) -> AsyncIterator[Path]:
    """A second node on the first's NATS, as an operator adds one: `mesh-actor creds issue --role node --node
    NODE_ID` on the running first node (data dir `leader`), then `mesh-actor run --nats-creds FILE` with them.
    Yields the credentials file (what a command acting as that node passes as `--nats-creds`)."""
    creds = data_dir.with_name(f"{data_dir.name}.{node_id}.creds.json")
    issue = ("creds", "issue", "--role", "node", "--node", node_id, "--data-dir", str(leader), "--out", str(creds))
    code, _, err = await cli(*issue)
    assert code == 0, err
    async with node_process(data_dir, node_id, "--nats-creds", str(creds), *args, stderr=stderr):
        yield creds


async def nats_env(data_dir: Path) -> dict[str, str]:
    """How a client reaches the node's NATS, as `mesh-actor nats-env --json` says (its code, in this process)."""
    record = connection_record(client_options(parsed("nats-env", "--json", "--data-dir", str(data_dir))))
    return {
        "MESH_ACTOR_NATS": record["url"],
        "MESH_ACTOR_NATS_USER": record["user"],
        "MESH_ACTOR_NATS_PASSWORD": record["password"],
    }


async def wait_nodes(data_dir: Path, *names: str) -> dict[str, Any]:
    async with asyncio.timeout(30):
        while True:
            status = await status_of(data_dir) or {"nodes": []}
            if {n["node_id"] for n in status["nodes"]} >= set(names):
                return status
            await asyncio.sleep(0.2)


def need(model: Path, slots: int, ctx: int) -> int:
    settings = ServingSettings(slots=slots, cache_ram_mib=0, ctx_checkpoints=0)
    return estimate(geometry_from_header(read_header(model)), settings, ctx).total_bytes


async def wait_listening(*ports: int, timeout: float = 30) -> None:
    """Until each loopback port accepts a connection: a node prints "running" when its actors start, and its HTTP
    listeners (front door, metrics) bind a moment later, each in its actor."""
    async with asyncio.timeout(timeout):
        for port in ports:
            while True:
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    await asyncio.sleep(0.1)
                    continue
                writer.close()
                await writer.wait_closed()
                break
