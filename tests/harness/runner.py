"""The runner actor under test: a fake node, its ledger and telemetry, reservations and starts, fake
llama-server processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from actors.runner.actor import RunnerActor, RunnerLimits
from actors.runner.driver import DriverFault, SignalFilter
from actors.runner.instance_lifecycle import Timings
from messages.memory import MemoryBreakdown
from messages.placement import NodeLedger, Reservation, Stamp
from messages.runner import InstanceStatus, RunnerAck, StartInstance
from messages.settings import ServingSettings
from messages.subjects import Subjects
from messages.telemetry import HostInfo, NodeResources
from runtime import buckets
from runtime.bus import Bus, NoResponders, decode, encode
from runtime.restart import RestartPolicy
from tests.conftest import supervised

NODE = "node-a"


SUBJECTS = Subjects()


GIB = 1 << 30


def _settings(**fields: Any) -> ServingSettings:
    return msgspec.convert({"cache_ram_mib": 0, "slots": 2, **fields}, ServingSettings)


def _predict(model: Path, settings: ServingSettings, ctx: int) -> MemoryBreakdown:
    return estimate(geometry_from_header(read_header(model)), settings, ctx, n_gpu_layers=0)


def _reservation(
    rid: str, model: Path, settings: ServingSettings, ctx: int, *, multi_node: bool = False, node: str = NODE
) -> Reservation:
    predicted = _predict(model, settings, ctx)
    return Reservation(
        reservation_id=rid,
        decision_id=f"d-{rid}",
        node_id=node,
        state="reserved",
        model_path=str(model),
        stamp=Stamp(settings=settings, ctx=ctx, n_gpu_layers=0),
        layers=(0, 4),
        devices=predicted.devices,
        held={d.device: d.total_bytes for d in predicted.devices},
        multi_node=multi_node,
        created_at=time.time(),
        expires_at=time.time() + 600,
    )


async def _put_ledger(bus: Bus, *reservations: Reservation, node: str = NODE) -> None:
    kv = await buckets.reservations(bus, SUBJECTS)
    await kv.put(f"node.{node}", encode(NodeLedger(node_id=node, reservations=reservations)))


async def _put_telemetry(bus: Bus, *, usable: int = 64 * GIB, node: str = NODE) -> None:
    now = time.time()
    report = NodeResources(
        node_id=node,
        seq=1,
        sent_at=now,
        started_at=now,
        ttl_s=600,
        host=HostInfo(ram_total_bytes=usable, ram_available_bytes=usable, usable_bytes=usable, cpu_count=2),
    )
    kv = await buckets.nodes(bus, SUBJECTS)
    await kv.put(node, encode(report))


@dataclass
class Node:
    """What a test controls: the node's current serving settings (read by the runner at each start)."""

    settings: ServingSettings | None


FAST = RunnerLimits(timings=Timings(ready_timeout_s=60, verify_timeout_s=20, stop_grace_s=5, kill_grace_s=5))


@contextlib.asynccontextmanager
async def runner(
    bus: Bus,
    data_dir: Path,
    binary: str,
    node: Node,
    *,
    policy: RestartPolicy | None = None,
    rewrite: Callable[[tuple[str, ...]], Sequence[str]] | None = None,
    limits: RunnerLimits = FAST,
    fault: DriverFault | None = None,
    signal_filter: SignalFilter | None = None,
) -> AsyncIterator[RunnerActor]:
    actor = RunnerActor(
        NODE,
        data_dir,
        Path(binary),
        lambda: node.settings,
        limits=limits,
        restart_policy=(lambda: policy) if policy else lambda: RestartPolicy(backoff_initial_s=0.05),
        rewrite_command=rewrite,
        driver_fault=fault,
        signal_filter=signal_filter,
    )
    async with supervised(bus, [actor], node_id=NODE):
        yield actor


async def _request(bus: Bus, verb: str, message: Any, *, timeout: float = 30) -> RunnerAck:
    """A request to the runner, retried while its endpoint is not registered yet."""
    async with asyncio.timeout(10):
        while True:
            try:
                return await bus.request(SUBJECTS.runner(NODE, verb), message, RunnerAck, timeout=timeout)
            except NoResponders:
                await asyncio.sleep(0.02)


async def _start(bus: Bus, rid: str) -> RunnerAck:
    return await _request(bus, "start", StartInstance(reservation_id=rid))


async def _status(bus: Bus, instance_id: str) -> InstanceStatus:
    kv = await buckets.instances(bus, SUBJECTS)
    entry = await kv.get(SUBJECTS.instance_key(NODE, instance_id))
    assert entry.value
    return decode(entry.value, InstanceStatus)


#: The "engine": sleeps until signalled (it never answers /health; these tests never need it to).
SLEEPER = (sys.executable, "-c", "import time; time.sleep(600)")


QUICK = RunnerLimits(timings=Timings(ready_timeout_s=300, stop_grace_s=5, kill_grace_s=5))
