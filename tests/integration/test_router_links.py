"""The router's handoff links on a real nats-server: a link whose planned prefill failed rests, then returns."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

from actors.router.actor import RouterActor
from actors.router.links import REST_S
from messages.events import LinkMeasured
from messages.generate import GenerateRequest, GenerateResult, InstanceLoad, RunnerGenerate, ServingReport
from messages.subjects import Subjects
from runtime.bus import Bus, NoResponders, RemoteError, encode
from runtime.generate_client import generate
from tests.conftest import JournalReader, of_type, supervised
from tests.harness.router import ready_instance
from tests.tiny_models import write_llama

SUBJECTS = Subjects()
PROMPT = list(range(1, 2001))  # long enough that a fast prefill node over a fast link wins (see `_announce`)


def _load(instance: str, *, busy: int, prefill_tokens_per_s: float) -> InstanceLoad:
    return InstanceLoad(
        instance_id=instance, slots=2, busy=busy, queued=0, identity="same-identity",
        prefill_tokens_per_s=prefill_tokens_per_s, state_bytes_per_token=1000.0,
    )  # fmt: skip


async def _announce(bus: Bus) -> None:
    """Current reports of both nodes (i2 is busier, so i1 decodes, but prefills 1,000 times faster) and a probe of
    the link n2>n1 at 100 MB/s: prefilling the prompt on n2 and handing it to n1 wins by far."""
    reports = {
        "n1": _load("i1", busy=0, prefill_tokens_per_s=100.0),
        "n2": _load("i2", busy=1, prefill_tokens_per_s=100_000.0),
    }
    for seq, (node, load) in enumerate(reports.items(), start=1):
        report = ServingReport(node_id=node, seq=seq, ttl_s=10.0, instances=(load,))
        await bus.nc.publish(SUBJECTS.serving(node), encode(report))
    probe = LinkMeasured(
        id="probe", time=0.0, node="n2", actor="handoff", src="n2", dst="n1", bytes_per_s=1e8, fixed_s=0.001,
        samples=((1_000_000, 0.011), (10_000_000, 0.101)),
    )  # fmt: skip
    await bus.nc.publish(SUBJECTS.event("handoff", "link_measured", "n2"), encode(probe))
    await bus.nc.flush()


async def test_a_link_whose_planned_prefill_failed_is_not_chosen_again_until_it_has_rested(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    """Routing chose to prefill on n2 for i1; n1's runner computed the prompt itself (`prefill_fallback`):
    the next requests decode on i1 without a remote prefill (each would pay one more failed try) until the link
    has rested `REST_S`; then routing may choose it again."""
    clock = [1000.0]
    model = write_llama(tmp_path / "m.gguf")
    for instance, node in (("i1", "n1"), ("i2", "n2")):  # two ready instances of one model
        await ready_instance(bus, model, instance, node)
    orders: list[RunnerGenerate] = []

    async def runner(msg: Msg) -> None:  # n1's runner: every planned prefill on another node fails
        order = msgspec.json.decode(msg.data, type=RunnerGenerate)
        orders.append(order)
        planned = order.request.prefill_node
        result = GenerateResult(
            request_id=order.request_id, text="", tokens=[], prompt_tokens=len(PROMPT), source="cold",
            tokens_restored=0, tokens_cached=0, tokens_evaluated=len(PROMPT), ttft_ms=1.0, total_ms=1.0, node="n1",
            instance=order.instance_id, slot=0, stop_reason="limit",
            prefill_fallback=f"prefill on {planned} failed (not_found)" if planned else "",
        )  # fmt: skip
        await bus.nc.publish(msg.reply, encode(result))

    await bus.nc.subscribe(SUBJECTS.runner("n1", "generate"), cb=runner)

    asked = [0]

    async def ask() -> tuple[RunnerGenerate, dict[str, Any]]:
        """The order n1's runner received and the routing decision the router journaled for it."""
        asked[0] += 1
        request_id = f"ask-{asked[0]}"
        request = GenerateRequest(model="m", prompt=PROMPT, n_predict=1, timeout_s=5, request_id=request_id)
        await generate(bus, SUBJECTS, request)
        (routed,) = await journal_reader.wait_for(of_type("generate_routed", request_id=request_id))
        return orders[-1], routed

    async with supervised(bus, [RouterActor(monotonic=lambda: clock[0])]):
        async with asyncio.timeout(10):
            while True:  # until the router holds both records, both reports and the probe: it plans n2's prefill
                await _announce(bus)
                try:
                    first, _ = await ask()
                except (NoResponders, RemoteError):  # not up yet, or no record yet (no_instance)
                    await asyncio.sleep(0.1)
                    continue
                if first.request.prefill_node == "n2":
                    break
                await asyncio.sleep(0.1)
        assert first.instance_id == "i1"
        clock[0] += REST_S - 1  # resting; the reports sent now are current (they travel on their own subscription)
        await _announce(bus)
        async with asyncio.timeout(5):
            while True:
                with contextlib.suppress(RemoteError):  # no_instance until the new reports arrived
                    resting, routed = await ask()
                    if len(routed["candidates"]) == 2:
                        break
                await asyncio.sleep(0.1)
        assert resting.instance_id == "i1" and resting.request.prefill_node is None, resting
        assert "n2>n1" not in routed["links"], routed
        clock[0] += 2  # rested
        await _announce(bus)
        async with asyncio.timeout(5):
            while True:
                with contextlib.suppress(RemoteError):
                    again, routed = await ask()
                    if again.request.prefill_node == "n2":
                        break
                await asyncio.sleep(0.1)
        assert again.instance_id == "i1" and "n2>n1" in routed["links"]


pytestmark = pytest.mark.timeout(60)
