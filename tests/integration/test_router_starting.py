"""A generation for a model whose only instance is starting waits for it (bounded by its own timeout) on a real
nats-server, instead of `no_instance` at once; a model with nothing on its way is refused at once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from actors.router.actor import RouterActor
from messages.generate import GenerateRequest, GenerateResult, RunnerGenerate, ServingReport
from runtime.bus import Bus, RemoteError, decode_checked, encode
from runtime.generate_client import generate
from tests.conftest import supervised
from tests.harness.router import SUBJECTS, ready_instance
from tests.tiny_models import write_llama


async def _node(bus: Bus, orders: list[RunnerGenerate]) -> asyncio.Task[None]:
    """Node n1's runner (answers every generation, keeping the order) and its serving reports, every 0.2 s."""

    async def runner(msg: Msg) -> None:
        order = decode_checked(msg.data, RunnerGenerate, "order")
        orders.append(order)
        result = GenerateResult(
            request_id=order.request_id, text="", tokens=[], prompt_tokens=3, source="cold", tokens_restored=0,
            tokens_cached=0, tokens_evaluated=3, ttft_ms=1.0, total_ms=1.0, node="n1", instance=order.instance_id,
            slot=0, stop_reason="limit",
        )  # fmt: skip
        await bus.nc.publish(msg.reply, encode(result))

    await bus.nc.subscribe(SUBJECTS.runner("n1", "generate"), cb=runner)

    async def reports() -> None:
        seq = 0
        while True:
            seq += 1
            report = ServingReport(node_id="n1", seq=seq, ttl_s=5.0, instances=())
            await bus.nc.publish(SUBJECTS.serving("n1"), encode(report))
            await asyncio.sleep(0.2)

    return asyncio.create_task(reports())


async def _ask(bus: Bus, model: str, timeout_s: float) -> GenerateResult:
    request = GenerateRequest(model=model, prompt=[5, 6, 7], n_predict=1, timeout_s=timeout_s)
    return await generate(bus, SUBJECTS, request)


async def test_a_generation_waits_for_its_starting_instance_and_keeps_what_is_left_of_its_time(
    bus: Bus, tmp_path: Path
) -> None:
    model = write_llama(tmp_path / "m.gguf")
    other = write_llama(tmp_path / "other.gguf")
    orders: list[RunnerGenerate] = []
    reporting = await _node(bus, orders)
    try:
        await ready_instance(bus, model, "i1", state="starting")  # as `place --start` leaves it when it answers
        await ready_instance(bus, other, "i2", state="failed")
        async with supervised(bus, [RouterActor()]):
            await asyncio.sleep(0.5)  # the router's views (a first report among them)
            # nothing of `other` is on its way: refused at once, not after its 20 s
            began = time.monotonic()
            with pytest.raises(RemoteError) as refused:
                await _ask(bus, "other.gguf", 20.0)
            assert refused.value.reply.code == "no_instance" and time.monotonic() - began < 5

            asked = asyncio.create_task(_ask(bus, "m.gguf", 20.0))
            await asyncio.sleep(1.0)
            assert not asked.done() and not orders  # waiting, nothing sent to the runner
            await ready_instance(bus, model, "i1", state="ready")
            async with asyncio.timeout(10):
                result = await asked
            assert result.instance == "i1" and [o.instance_id for o in orders] == ["i1"]
            assert 0 < orders[0].request.timeout_s <= 19.0  # the second or more it waited came off its time

            # a start that is still under way when the request's time is up: no_instance, saying so
            await ready_instance(bus, other, "i2", state="restarting")
            began = time.monotonic()
            with pytest.raises(RemoteError) as late:
                await _ask(bus, "other.gguf", 1.0)
            assert late.value.reply.code == "no_instance" and "became ready" in late.value.reply.message
            assert 0.9 < time.monotonic() - began < 10

            # a start that fails ends the wait at once, well before the request's time
            asked = asyncio.create_task(_ask(bus, "other.gguf", 30.0))
            await asyncio.sleep(0.5)
            began = time.monotonic()
            await ready_instance(bus, other, "i2", state="failed")
            with pytest.raises(RemoteError) as failed:
                async with asyncio.timeout(10):
                    await asked
            assert failed.value.reply.code == "no_instance" and time.monotonic() - began < 5
    finally:
        reporting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporting  # a report that could not be sent fails the test


pytestmark = pytest.mark.timeout(90)
