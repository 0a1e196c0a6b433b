"""`mesh-actor place --start` while the admitted node's runner does not listen yet (a node starting: its telemetry,
and so placement's admission, come before its runner's endpoints), or while no placement actor listens yet (a
node that has just said it runs): a real nats-server, the CLI as a process, placement and the runner played by
responders, coming up late or never.

No responders means the request was never sent, so the CLI asks again until its `--timeout`; a runner that never
listens is a clear error once that passes.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

from nats.aio.msg import Msg

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.placement import ModelRef, NodePlacement, PlacementDecision
from messages.runner import RunnerAck
from messages.settings import ServingSettings
from messages.subjects import Subjects
from runtime.bus import Bus, encode
from tests import tiny_models
from tests.cluster_harness import cli
from tests.conftest import NatsServer

SUBJECTS = Subjects()


async def _admit_on_n1(bus: Bus, model: Path) -> None:
    breakdown = estimate(geometry_from_header(read_header(model)), ServingSettings(slots=1), 512)
    decision = PlacementDecision(
        decision_id=uuid.uuid4().hex, admitted=True, dry_run=False, model=ModelRef(path=str(model)),
        reservation_id="r1", placements=(NodePlacement(node_id="n1", layers=(0, 1), breakdown=breakdown,
        telemetry_revision=1),),
    )  # fmt: skip

    async def admit(msg: Msg) -> None:
        await msg.respond(encode(decision))

    await bus.nc.subscribe(SUBJECTS.placement_request, cb=admit)


async def _place(nats_server: NatsServer, model: Path, timeout_s: float) -> asyncio.Task[tuple[int, str, str]]:
    options = nats_server.options
    assert options.user and options.password
    password = model.with_name("nats-password")
    password.write_text(options.password)
    args = ("place", str(model), "-c", "512", "--start", "--json", "--timeout", str(timeout_s))
    account = ("--nats", nats_server.url, "--nats-user", options.user, "--nats-password-file", str(password))
    tls = ("--nats-tls-ca", options.tls_ca) if options.tls_ca else ()
    return asyncio.create_task(cli(*args, *account, *tls, timeout=60))


async def test_a_start_sent_before_the_runner_listens_reaches_it(
    bus: Bus, nats_server: NatsServer, tmp_path: Path
) -> None:
    model = tiny_models.write_llama(tmp_path / "m.gguf")
    await _admit_on_n1(bus, model)
    placing = await _place(nats_server, model, timeout_s=20)
    await asyncio.sleep(2.0)  # the CLI has its decision, and nothing listens on the runner's start subject
    assert not placing.done()
    starts: list[bytes] = []

    async def runner(msg: Msg) -> None:
        starts.append(msg.data)
        await msg.respond(encode(RunnerAck(instance_id="i1", node_id="n1", state="ready", port=1234)))

    await bus.nc.subscribe(SUBJECTS.runner("n1", "start"), cb=runner)
    async with asyncio.timeout(30):
        code, out, err = await placing
    assert code == 0, err
    assert json.loads(out)["instance"]["instance_id"] == "i1"
    assert len(starts) == 1  # asked until someone listened, then once


async def test_a_place_sent_before_placement_listens_gets_its_decision(
    bus: Bus, nats_server: NatsServer, tmp_path: Path
) -> None:
    model = tiny_models.write_llama(tmp_path / "m.gguf")
    placing = await _place(nats_server, model, timeout_s=20)
    await asyncio.sleep(2.0)  # nothing listens on placement's subject yet
    assert not placing.done()
    await _admit_on_n1(bus, model)

    async def runner(msg: Msg) -> None:
        await msg.respond(encode(RunnerAck(instance_id="i1", node_id="n1", state="ready", port=1234)))

    await bus.nc.subscribe(SUBJECTS.runner("n1", "start"), cb=runner)
    async with asyncio.timeout(30):
        code, out, err = await placing
    assert code == 0, err
    assert json.loads(out)["reservation_id"] == "r1"


async def test_a_runner_that_never_listens_is_a_clear_error_after_the_timeout(
    bus: Bus, nats_server: NatsServer, tmp_path: Path
) -> None:
    model = tiny_models.write_llama(tmp_path / "m.gguf")
    await _admit_on_n1(bus, model)
    started = asyncio.get_running_loop().time()
    async with asyncio.timeout(30):
        code, _, err = await (await _place(nats_server, model, timeout_s=2))
    waited = asyncio.get_running_loop().time() - started
    assert code != 0 and "admitted, but the start on n1 failed" in err and "no responders" in err, err
    assert 2.0 <= waited < 20.0, waited
