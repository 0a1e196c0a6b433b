"""Generations through real nodes: starting a model, waiting until it serves, generating, the captured prompt states."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from messages.generate import InstanceLoad, ServingReport
from messages.subjects import Subjects
from runtime.bus import Bus
from runtime.cli import generate as generate_cli
from runtime.cli import l3 as l3_cli
from runtime.cli import placement as placement_cli
from runtime.cli.common import CliError
from runtime.config import NatsOptions
from tests.harness.nodes import instances_of, nats_env, parsed

QUIET = ("--cache-ram", "0", "--ctx-checkpoints", "0", "--parallel", "2")


async def start_model(data_dir: Path, model: Path, ctx: int = 2048) -> str:
    """`mesh-actor place MODEL -c CTX --start` (its code, in this process), then until the instance is ready."""
    async with asyncio.timeout(120):
        decision, ack = await placement_cli.run_place(
            parsed("place", str(model), "-c", str(ctx), "--start", "--json", "--data-dir", str(data_dir))
        )
    assert decision.admitted and ack is not None, decision
    instance_id = ack.instance_id
    async with asyncio.timeout(60):
        while True:
            (instance,) = [i for i in await instances_of(data_dir) if i["id"] == instance_id]
            if instance["state"] == "ready":
                return instance_id
            assert instance["state"] == "starting", instance
            await asyncio.sleep(0.2)


async def gen(data_dir: Path, model: str, tokens: list[int], n: int = 32, *extra: str) -> dict[str, Any]:
    """What `mesh-actor generate MODEL IDS --tokens -n N --temperature 0 --json EXTRA...` prints (its code, in
    this process)."""
    ids = ",".join(map(str, tokens))
    args = parsed(
        "generate", model, ids, "--tokens", "-n", str(n), "--temperature", "0", "--json", *extra,
        "--data-dir", str(data_dir),
    )  # fmt: skip
    async with asyncio.timeout(120):
        return generate_cli.generate_record(*await generate_cli.run_generate(args))


async def wait_captured(data_dir: Path, n_tokens: int) -> None:
    """Until the node's L3 lists an entry of `n_tokens` tokens (captures are committed off the reply's path)."""
    args = parsed("l3", "ls", "--json", "--data-dir", str(data_dir))
    async with asyncio.timeout(30):
        while True:
            with contextlib.suppress(CliError, TimeoutError):  # no node's NATS to reach yet, or no inventory
                if any(e["tokens"] == n_tokens for e in l3_cli.ls_rows(await l3_cli.read_inventories(args))):
                    return
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def client(data_dir: Path) -> Any:
    env = await nats_env(data_dir)
    bus = await Bus.connect(
        NatsOptions(
            urls=(env["MESH_ACTOR_NATS"],),
            user=env["MESH_ACTOR_NATS_USER"],
            password=env["MESH_ACTOR_NATS_PASSWORD"],
        ),
        name="test-client",
    )
    try:
        yield bus
    finally:
        await bus.close()


async def wait_serving(data_dir: Path, holds: Callable[[dict[str, InstanceLoad]], bool]) -> None:
    """Until the runners' serving reports, which every router reads, say what `holds` wants (the latest load of
    each instance, by id). A router hears a report as this test does; the next request comes after."""
    async with client(data_dir) as bus:
        reports = await bus.nc.subscribe(Subjects().serving_all)
        latest: dict[str, InstanceLoad] = {}
        async with asyncio.timeout(30):
            while not holds(latest):
                report = msgspec.json.decode((await reports.next_msg(timeout=30)).data, type=ServingReport)
                latest.update({load.instance_id: load for load in report.instances})


async def wait_ready(data_dir: Path, instance_id: str) -> None:
    async with asyncio.timeout(60):
        while True:
            states = [i["state"] for i in await instances_of(data_dir) if i["id"] == instance_id]
            if states == ["ready"]:
                return
            assert states in ([], ["starting"]), states
            await asyncio.sleep(0.2)
