"""Model files from peers, from the outside: two `mesh-actor run` nodes on one bus, the file on one of them.

`mesh-actor models pull tiny --node b` copies the catalog model's file into node b's models dir (same relative
name), verified; a second pull finds it there; then a model placed by that relative name on node b starts
llama-server on the pulled file and answers `/completion`. `mesh-actor models` (a's front door lists the
catalog) shows which nodes hold the file, before and after, and so does `mesh-actor status`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import blake3
import msgspec
import pytest

from actors.files.actor import FilesActor
from messages.placement import ModelRef, PlacementRequest
from messages.runner import RunnerAck, StartInstance, StopInstance
from messages.subjects import Subjects
from runtime import buckets
from runtime.bus import Bus, RemoteError, encode
from runtime.children import free_port
from runtime.config import NatsOptions
from tests.conftest import JournalReader, node_process, of_type, run_cli, supervised
from tests.harness.nodes import QUIET, instances_of, nats_env, wait_nodes
from tests.harness.placement import place
from tests.harness.placement import report as placement_report
from tests.harness.runner import (
    NODE,
    Node,
    _put_ledger,
    _put_telemetry,
    _request,
    _reservation,
    _settings,
    _start,
    _status,
    runner,
)
from tests.llama_harness import call_server, require_server
from tests.tiny_models import write_llama

pytestmark = pytest.mark.e2e
CATALOG = '[models.tiny]\npath = "tiny.gguf"\n'
S = Subjects()


async def place_and_start(env: dict[str, str], path: str, node: str) -> str:
    """Places the model by its relative name (each node finds it in its own models dir) and starts it."""
    options = NatsOptions(
        urls=(env["MESH_ACTOR_NATS"],), user=env["MESH_ACTOR_NATS_USER"], password=env["MESH_ACTOR_NATS_PASSWORD"]
    )
    bus = await Bus.connect(options, name="test")
    try:
        request = PlacementRequest(model=ModelRef(path=path), ctx=1024, nodes=(node,))
        decision = await place(bus, request, timeout_s=60)  # asks again while the placement actor registers
        assert decision.admitted and decision.reservation_id, decision
        start = StartInstance(reservation_id=decision.reservation_id)
        ack = await bus.request(S.runner(node, "start"), start, RunnerAck, timeout=120)
        return ack.instance_id
    finally:
        await bus.close()


async def ready(data_dir: Path, instance_id: str) -> dict[str, Any]:
    """The instance's status once it is ready (as `mesh-actor status --json` shows it)."""
    async with asyncio.timeout(90):
        while True:
            (instance,) = [i for i in await instances_of(data_dir) if i["id"] == instance_id]
            if instance["state"] == "ready":
                return dict(instance)
            assert instance["state"] == "starting", instance
            await asyncio.sleep(0.3)


async def models_listing(env: dict[str, str]) -> str:
    """`mesh-actor models` once the front door has reported its catalog."""
    async with asyncio.timeout(30):
        while True:
            code, out, err = await run_cli("models", env=env)
            assert code == 0, err
            if "tiny" in out:
                return out
            await asyncio.sleep(0.3)


def digest(path: Path) -> str:
    return str(blake3.blake3(path.read_bytes()).hexdigest())


async def test_a_node_without_the_file_pulls_it_from_its_peer_and_serves_it(tmp_path: Path) -> None:
    require_server()
    data_a, data_b = tmp_path / "a", tmp_path / "b"
    for data in (data_a, data_b):
        (data / "models").mkdir(parents=True)
        (data / "models.toml").write_text(CATALOG)
    model = write_llama(data_a / "models" / "tiny.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512)
    pulled = data_b / "models" / "tiny.gguf"
    async with node_process(data_a, "a", "--parallel", "1", *QUIET, "--http", str(free_port())):
        env = await nats_env(data_a)
        async with node_process(data_b, "b", "--parallel", "1", *QUIET, env=env):
            await wait_nodes(data_a, "a", "b")
            assert "file held on a\n" in await models_listing(env)
            code, out, err = await run_cli("models", "pull", "tiny", "--node", "b", "--json", env=env, timeout=120)
            assert code == 0, err + out
            reply = json.loads(out)
            assert (reply["node_id"], reply["path"], reply["peer"]) == ("b", "tiny.gguf", "a")
            assert reply["blake3"] == digest(model) == digest(pulled)
            assert reply["moved_bytes"] == model.stat().st_size
            assert sorted(p.name for p in pulled.parent.iterdir()) == ["tiny.gguf"]

            code, out, err = await run_cli("models", "pull", "tiny", "--node", "b", env=env)
            assert code == 0 and "already on b" in out, err + out
            assert "file held on a, b\n" in await models_listing(env)
            code, out, err = await run_cli("status", "--json", env=env)
            assert code == 0, err
            (held,) = [f for f in json.loads(out)["model_files"] if f["path"] == "tiny.gguf"]
            assert (held["nodes"], held["models"], held["blake3"]) == (["a", "b"], ["tiny"], digest(model)), held
            code, out, err = await run_cli("status", env=env)
            assert code == 0 and any(
                line.startswith("tiny.gguf ") and line.endswith(" a, b") for line in out.splitlines()
            ), out

            code, out, err = await run_cli("models", "pull", "nothing", "--node", "b", env=env)
            assert code == 1 and "not_named" in err, err + out

            instance_id = await place_and_start(env, "tiny.gguf", "b")
            instance = await ready(data_a, instance_id)
            assert instance["node"] == "b" and instance["model_path"] == str(pulled), instance
            response = await call_server(
                instance["port"], "POST", "/completion", {"prompt": "hi", "n_predict": 4}, timeout_s=60
            )
            assert response.status == 200 and "content" in response.json()
            code, _, err = await run_cli("stop", instance_id, env=env)
            assert code == 0, err


async def test_a_runner_without_the_file_a_reservation_names_fetches_it_from_a_peer_and_starts(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    """Placement admitted the model on node-a (from a registry entry's signed facts, or a peer's header), but
    node-a lacks the file: its runner has its files actor fetch it (at the stamped digest) before the start,
    and llama-server runs the fetched file. Without a holder, the start is refused and the memory released."""
    binary = require_server()
    settings = _settings(slots=1)
    holder_data, data = tmp_path / "holder", tmp_path / "data"
    for directory in (holder_data, data):
        (directory / "models").mkdir(parents=True)
        (directory / "models.toml").write_text('[models.named]\npath = "named.gguf"\n')
    model = write_llama(holder_data / "models" / "named.gguf", n_layer=4, n_embd=128, n_head=4, n_ff=256)
    wanted = msgspec.structs.replace(
        _reservation("r-fetch", model, settings, 512), model_path="named.gguf", model_digest=digest(model)
    )
    orphan = msgspec.structs.replace(_reservation("r-orphan", model, settings, 512), model_path="nowhere.gguf")
    await _put_ledger(bus, wanted, orphan)
    await _put_telemetry(bus)
    holder = FilesActor("holder", holder_data, models_dir=holder_data / "models")
    own = FilesActor(NODE, data, models_dir=data / "models")
    async with (
        supervised(bus, [holder], node_id="holder"),
        supervised(bus, [own], node_id=NODE),
        runner(bus, data, binary, Node(settings)),
    ):
        for put in ("holder", NODE):  # live nodes: the holders a pull asks
            await (await buckets.nodes(bus, S)).put(put, encode(placement_report(put, 1 << 30)))
        await _put_telemetry(bus)
        ack = await _start(bus, "r-fetch")
        await journal_reader.wait_for(of_type("instance_ready", instance_id=ack.instance_id), timeout=60)
        fetched = data / "models" / "named.gguf"
        assert digest(fetched) == digest(model)
        assert (await _status(bus, ack.instance_id)).model_path == str(fetched)
        (pulled,) = await journal_reader.wait_for(of_type("model_file_pulled", node=NODE))
        assert (pulled["path"], pulled["peer"]) == ("named.gguf", "holder")
        with pytest.raises(RemoteError) as refused:
            await _start(bus, "r-orphan")
        assert refused.value.code == "model_unreadable" and "cannot be fetched" in refused.value.reply.message
        await _request(bus, "stop", StopInstance(instance_id=ack.instance_id))


async def test_a_model_placed_on_a_node_without_its_file_is_fetched_there_and_served(tmp_path: Path) -> None:
    """No `models pull`: the model is placed by its relative name on node b, which lacks the file (placement
    reads it there, or asks the nodes that hold it), and b's runner fetches it from a before llama-server
    starts on it."""
    require_server()
    data_a, data_b = tmp_path / "a", tmp_path / "b"
    for data in (data_a, data_b):
        (data / "models").mkdir(parents=True)
        (data / "models.toml").write_text(CATALOG)
    model = write_llama(data_a / "models" / "tiny.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512)
    async with node_process(data_a, "a", "--parallel", "1", *QUIET):
        env = await nats_env(data_a)
        async with node_process(data_b, "b", "--parallel", "1", *QUIET, env=env):
            await wait_nodes(data_a, "a", "b")
            instance_id = await place_and_start(env, "tiny.gguf", "b")
            instance = await ready(data_a, instance_id)
            fetched = data_b / "models" / "tiny.gguf"
            assert instance["model_path"] == str(fetched) and digest(fetched) == digest(model)
            response = await call_server(
                instance["port"], "POST", "/completion", {"prompt": "hi", "n_predict": 4}, timeout_s=60
            )
            assert response.status == 200
            code, _, err = await run_cli("stop", instance_id, env=env)
            assert code == 0, err
