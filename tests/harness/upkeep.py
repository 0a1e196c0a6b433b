"""A runner actor that keeps its instances (upkeep) on a live bus, with its node ledger and settings."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from actors.runner.actor import RunnerActor
from messages.placement import NodeLedger
from runtime import buckets
from runtime.bus import Bus, decode
from tests.conftest import supervised
from tests.harness.runner import (
    NODE,
    QUICK,
    SLEEPER,
    SUBJECTS,
    _settings,
)

SETTINGS = _settings(slots=1)


@contextlib.asynccontextmanager
async def runner(bus: Bus, data_dir: Path) -> AsyncIterator[RunnerActor]:
    actor = RunnerActor(
        NODE, data_dir, Path(sys.executable), lambda: SETTINGS, limits=QUICK,
        rewrite_command=lambda argv: SLEEPER, booking_check_s=0.2,
    )  # fmt: skip
    async with supervised(bus, [actor], node_id=NODE):
        yield actor


async def ledger(bus: Bus) -> NodeLedger:
    entry = await (await buckets.reservations(bus, SUBJECTS)).get(f"node.{NODE}")
    assert entry.value
    return decode(entry.value, NodeLedger)
