"""The router's view of serving reports on a real nats-server: a node whose runner restarted is seen again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from actors.router.actor import RouterActor
from messages.generate import GenerateRequest, GenerateResult, ServingReport
from runtime.bus import Bus, NoResponders, RemoteError, encode
from runtime.generate_client import generate
from tests.conftest import supervised
from tests.harness.router import SUBJECTS, ready_instance
from tests.tiny_models import write_llama


async def _answers(bus: Bus) -> bool:
    try:
        await generate(bus, SUBJECTS, GenerateRequest(model="i1", prompt=[5, 6, 7], n_predict=1, timeout_s=5))
    except NoResponders:  # the router is not up yet
        return False
    except RemoteError as exc:
        assert exc.code == "no_instance", exc
        return False
    return True


async def test_a_restarted_runner_whose_first_report_was_lost_is_seen_once_the_old_report_expired(
    bus: Bus, tmp_path: Path
) -> None:
    # A runner numbers its reports from 1 each time it starts; the router drops a report numbered below the last
    # one it holds (a late one). When the first report of a restarted runner is lost (a router cut off from NATS
    # while the node restarted), every later one was dropped until the new numbers passed the old: a minute
    # after a restart under load (benchmarks/chaos.py), a day's worth after a day. Once the report it holds has
    # expired, a lower number is a new runner, not a late report (while it is current, one is still dropped).
    clock = [1000.0]
    await ready_instance(bus, write_llama(tmp_path / "m.gguf"))

    async def runner(msg: Msg) -> None:  # the node's runner: answers every generation
        result = GenerateResult(
            request_id="x", text="", tokens=[], prompt_tokens=3, source="cold", tokens_restored=0, tokens_cached=0,
            tokens_evaluated=3, ttft_ms=1.0, total_ms=1.0, node="n1", instance="i1", slot=0, stop_reason="limit",
        )  # fmt: skip
        await bus.nc.publish(msg.reply, encode(result))

    await bus.nc.subscribe(SUBJECTS.runner("n1", "generate"), cb=runner)

    async def report(seq: int) -> None:
        fresh = ServingReport(node_id="n1", seq=seq, ttl_s=10.0, instances=())
        await bus.nc.publish(SUBJECTS.serving("n1"), encode(fresh))
        await bus.nc.flush()

    async with supervised(bus, [RouterActor(monotonic=lambda: clock[0])]):
        async with asyncio.timeout(10):
            while not await _answers(bus):  # until the router has the record and the report
                await report(500)
                await asyncio.sleep(0.1)
        clock[0] += 11  # the old runner's last report (number 500) expires: the node restarted meanwhile
        assert not await _answers(bus)  # no current report
        for seq in (2, 3):  # the new runner's reports; its first one was lost
            await report(seq)
        async with asyncio.timeout(5):
            while not await _answers(bus):
                await asyncio.sleep(0.1)  # the reports travel on their own subscription


pytestmark = pytest.mark.timeout(60)
