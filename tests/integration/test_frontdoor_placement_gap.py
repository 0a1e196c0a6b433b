"""The front door while no placement actor or router listens (a node starting, an actor restarting): a real
nats-server and the front door actor, placement and the router played by responders that come up late or never.

A request for a catalog model asks placement (not loaded) or the router (loaded); no responders then is a gap a
client's retry would bridge (nothing was sent), so the front door asks again until the request's deadline, and
says so without naming the mesh's subjects when the deadline passes first.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import aiohttp
import pytest
from nats.aio.msg import Msg

from actors.frontdoor.actor import FrontDoorActor
from actors.frontdoor.catalog import parse_catalog
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.errors import ErrorReply
from messages.placement import ModelRef, PlacementDecision, Stamp
from messages.runner import InstanceStatus
from messages.settings import ServingSettings
from messages.subjects import Subjects
from runtime import buckets
from runtime.bus import Bus, encode, error_headers
from tests import tiny_models
from tests.conftest import supervised

SUBJECTS = Subjects()


async def _door(bus: Bus, tmp_path: Path, timeout_s: float) -> tuple[FrontDoorActor, asyncio.Future[int]]:
    model = tiny_models.write_llama(tmp_path / "m.gguf")
    catalog = parse_catalog(f'[models.m]\npath = "{model}"\nctx = 512\nparallel = 1\ntimeout_s = {timeout_s}\n')
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    door = FrontDoorActor("127.0.0.1", 0, catalog, models_dir=tmp_path, on_listening=port.set_result)
    return door, port


async def _ask(port: int) -> tuple[int, dict[str, str], dict[str, object]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        body = {"model": "m", "prompt": "hello", "max_tokens": 1}
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
            return response.status, dict(response.headers), await response.json()


async def test_a_request_made_before_placement_listens_waits_for_its_answer(bus: Bus, tmp_path: Path) -> None:
    door, port = await _door(bus, tmp_path, timeout_s=20)
    asked: list[float] = []

    async def refuse(msg: Msg) -> None:
        asked.append(asyncio.get_running_loop().time())
        decision = PlacementDecision(
            decision_id=uuid.uuid4().hex, admitted=False, dry_run=False, model=ModelRef(path="m.gguf"),
            reason="not_found", message="the late placement's own refusal",
        )  # fmt: skip
        await msg.respond(encode(decision))

    async with supervised(bus, [door]):
        async with asyncio.timeout(10):
            bound = await port
        asking = asyncio.create_task(_ask(bound))
        await asyncio.sleep(1.0)  # the request is in, and nothing listens on placement's subject
        assert not asking.done()
        sub = await bus.nc.subscribe(SUBJECTS.placement_request, cb=refuse)
        try:
            async with asyncio.timeout(15):
                status, _, body = await asking
        finally:
            await sub.unsubscribe()
    assert len(asked) == 1
    error = body["error"]
    assert isinstance(error, dict)
    assert status == 500 and "the late placement's own refusal" in str(error["message"]), body


async def test_placement_that_never_listens_is_a_503_within_the_deadline_naming_no_subject(
    bus: Bus, tmp_path: Path
) -> None:
    door, port = await _door(bus, tmp_path, timeout_s=1.5)
    async with supervised(bus, [door]):
        async with asyncio.timeout(10):
            bound = await port
        started = asyncio.get_running_loop().time()
        async with asyncio.timeout(15):
            status, headers, body = await _ask(bound)
        waited = asyncio.get_running_loop().time() - started
    error = body["error"]
    assert isinstance(error, dict)
    assert status == 503 and "Retry-After" in headers, body
    assert "mesh." not in str(error["message"]) and "placement" in str(error["message"]), body
    assert 1.0 <= waited < 5.0, waited  # it kept asking until the model's deadline, then answered


async def test_a_start_cancelled_under_its_waiting_request_is_an_answer_and_the_door_serves_on(
    bus: Bus, tmp_path: Path
) -> None:
    # the model's one start (which its requests share) is cancelled while a request waits on it, as a bus call
    # cancelled under it would: the request is answered 503 (seen: the connection closed with no answer)
    door, port = await _door(bus, tmp_path, timeout_s=1.5)
    async with supervised(bus, [door]):
        async with asyncio.timeout(10):
            bound = await port
        asking = asyncio.create_task(_ask(bound))
        async with asyncio.timeout(10):
            while (start := door.demand.models["m"].starting) is None:
                await asyncio.sleep(0.05)
        start.cancel()
        async with asyncio.timeout(15):
            status, headers, body = await asking
        assert status == 503 and "Retry-After" in headers and "cancelled" in str(body["error"]), body
        async with asyncio.timeout(15):  # the door still answers the next request (placement never listens)
            again, _, body = await _ask(bound)
        assert again == 503 and "placement" in str(body["error"]), body


async def test_a_request_for_a_loaded_model_made_before_the_router_listens_waits_for_it(
    bus: Bus, tmp_path: Path
) -> None:
    door, port = await _door(bus, tmp_path, timeout_s=20)
    model = tmp_path / "m.gguf"
    settings = ServingSettings(slots=1)
    record = InstanceStatus(
        id="i1", node="n1", reservation_id="r1", state="ready", port=1234, model_path=str(model),
        settings=Stamp(settings=settings, ctx=512, n_gpu_layers=0),
        predicted_memory=estimate(geometry_from_header(read_header(model)), settings, 512),
    )  # fmt: skip
    kv = await buckets.instances(bus, SUBJECTS)
    await kv.put(SUBJECTS.instance_key("n1", "i1"), encode(record))
    asked: list[Msg] = []

    async def late_router(msg: Msg) -> None:
        asked.append(msg)
        reply = ErrorReply(code="no_instance", message="the late router's own answer")
        await bus.nc.publish(msg.reply, b"", headers=error_headers(reply))

    async with supervised(bus, [door]):
        async with asyncio.timeout(10):
            bound = await port
        asking = asyncio.create_task(_ask(bound))
        await asyncio.sleep(1.0)  # the request is in, and nothing listens on the router's subject
        assert not asking.done()
        sub = await bus.nc.subscribe(SUBJECTS.generate, cb=late_router)
        try:
            async with asyncio.timeout(15):
                status, _, body = await asking
        finally:
            await sub.unsubscribe()
    # a router's `no_instance` for an instance this door saw ready is asked again for up to 5 s (its watch may
    # lag the door's), then passed on as the router said it
    assert 1 < len(asked) <= 5.0 / 0.2 + 1
    assert status == 503 and "the late router's own answer" in str(body["error"]), body


pytestmark = pytest.mark.timeout(60)
