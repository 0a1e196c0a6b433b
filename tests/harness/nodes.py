"""Whole nodes as processes: `mesh-actor run` started and stopped (`node`), the CLI against them (`cli`),
their NATS environment, waiting for them to join.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.settings import ServingSettings
from tests.conftest import node_process, run_cli

QUIET = ("--cache-ram", "0", "--ctx-checkpoints", "0")


async def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str, str]:
    return await run_cli(*args, timeout=timeout, env=env)


@contextlib.asynccontextmanager
async def node(data_dir: Path, node_id: str, *args: str, env: dict[str, str] | None = None) -> AsyncIterator[Any]:
    async with node_process(data_dir, node_id, *args, env=env) as process:
        yield process


async def nats_env(data_dir: Path) -> dict[str, str]:
    code, out, err = await cli("nats-env", "--json", "--data-dir", str(data_dir))
    assert code == 0, err
    record = json.loads(out)
    return {
        "MESH_ACTOR_NATS": record["url"],
        "MESH_ACTOR_NATS_USER": record["user"],
        "MESH_ACTOR_NATS_PASSWORD": record["password"],
    }


async def wait_nodes(data_dir: Path, *names: str) -> dict[str, Any]:
    async with asyncio.timeout(30):
        while True:
            code, out, _ = await cli("status", "--json", "--data-dir", str(data_dir))
            status = json.loads(out) if code == 0 else {"nodes": []}
            if {n["node_id"] for n in status["nodes"]} >= set(names):
                return dict(status)
            await asyncio.sleep(0.2)


def need(model: Path, slots: int, ctx: int) -> int:
    settings = ServingSettings(slots=slots, cache_ram_mib=0, ctx_checkpoints=0)
    return estimate(geometry_from_header(read_header(model)), settings, ctx).total_bytes
