"""The whole mesh from the outside: `mesh-actor run` processes on one machine, driven by the CLI.

Two nodes share one bus (the second joins the first's embedded NATS with the credentials `nats-env`
prints). A model is placed and started through the CLI, answers `/completion`, and its observed cache
bytes equal the prediction; the node's settings are changed under an admitted reservation (SIGHUP) and
the start is refused for drift; killing a node leaves no llama-server behind.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from messages.runner import RunnerAck, StartInstance
from messages.subjects import Subjects
from runtime.bus import Bus, RemoteError
from runtime.config import NatsOptions
from tests.conftest import processes
from tests.harness.nodes import QUIET, cli, events_of, instances_of, nats_env, need, node, status_of, wait_nodes
from tests.llama_harness import call_server, require_server
from tests.tiny_models import write_llama, write_qwen35

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_server()
    root = tmp_path_factory.mktemp("models")
    return {
        "dense": write_llama(root / "dense.gguf"),
        "hybrid": write_qwen35(root / "hybrid.gguf", n_layer=8, state_size=64, dt_rank=16),
    }


def _servers_of(model: Path) -> list[int]:
    return processes("llama-server", str(model))


async def test_same_model_refused_at_64_slots_and_admitted_at_16_on_nodes_with_a_memory_limit(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    hybrid = models["hybrid"]
    limit = (need(hybrid, 16, 4096) + need(hybrid, 64, 4096)) // 2
    first = tmp_path / "wide"
    async with node(first, "wide", "--parallel", "64", "--memory-limit", str(limit), *QUIET):
        env = await nats_env(first)
        async with node(
            tmp_path / "narrow", "narrow", "--parallel", "16", "--memory-limit", str(limit), *QUIET, env=env
        ):
            await wait_nodes(first, "wide", "narrow")
            code, out, err = await cli("place", str(hybrid), "-c", "4096", "--node", "wide", "--json", env=env)
            refused = json.loads(out)
            assert code == 3 and not refused["admitted"], err
            (rejection,) = refused["rejections"]
            assert rejection["reason"] == "insufficient_memory"
            assert rejection["shortfalls"][0]["need_bytes"] == need(hybrid, 64, 4096)
            assert rejection["shortfalls"][0]["have_bytes"] <= limit

            code, out, err = await cli("place", str(hybrid), "-c", "4096", "--node", "narrow", "--json", env=env)
            admitted = json.loads(out)
            assert code == 0 and admitted["admitted"], err
            assert admitted["stamp"]["settings"]["slots"] == 16  # from the node's advertisement
            code, out, _ = await cli("status", "--json", env=env)
            reservations = json.loads(out)["reservations"]
            assert [(r["node_id"], r["reservation_id"]) for r in reservations] == [
                ("narrow", admitted["reservation_id"])
            ]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
async def test_placed_and_started_instance_answers_and_observed_cache_bytes_equal_the_prediction(
    tmp_path: Path, models: dict[str, Path], kind: str
) -> None:
    data_dir = tmp_path / "node"
    async with node(data_dir, "solo", "--parallel", "2", *QUIET):
        await wait_nodes(data_dir, "solo")
        code, out, err = await cli(
            "place", str(models[kind]), "-c", "2048", "--start", "--json", "--data-dir", str(data_dir)
        )
        assert code == 0, err + out
        decision = json.loads(out)
        instance_id = decision["instance"]["instance_id"]
        async with asyncio.timeout(60):
            while True:
                (instance,) = [i for i in await instances_of(data_dir) if i["id"] == instance_id]
                if instance["state"] == "ready":
                    break
                assert instance["state"] in ("starting",), instance
                await asyncio.sleep(0.2)
        predicted, observed = instance["predicted_memory"], instance["observed_memory"]
        for key in ("kv_bytes", "recurrent_bytes", "draft_kv_bytes"):
            assert observed[key] == predicted[key], key
        if kind == "hybrid":
            assert observed["recurrent_bytes"] > 0
        response = await call_server(
            instance["port"], "POST", "/completion", {"prompt": "hi", "n_predict": 4}, timeout_s=60
        )
        assert response.status == 200 and "content" in response.json()

        code, out, err = await cli("stop", instance_id, "--data-dir", str(data_dir))
        assert code == 0, err
        async with asyncio.timeout(20):
            while True:
                status = await status_of(data_dir)
                if status is not None and not status["reservations"]:
                    break  # the stop released the reservation
                await asyncio.sleep(0.2)
        assert not _servers_of(models[kind])


async def test_settings_changed_after_admission_refuse_the_start_with_drift(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    data_dir = tmp_path / "node"
    data_dir.mkdir()
    config = data_dir / "config.toml"
    config.write_text("[serving]\nslots = 2\ncache_ram_mib = 0\nctx_checkpoints = 0\n")
    async with node(data_dir, "drifty") as process:
        await wait_nodes(data_dir, "drifty")
        code, out, err = await cli("place", str(models["dense"]), "-c", "1024", "--json", "--data-dir", str(data_dir))
        decision = json.loads(out)
        assert code == 0 and decision["stamp"]["settings"]["slots"] == 2, err

        # the operator narrows the bounds below the stamp and changes a setting of the node's own, then reloads:
        # a model's own settings are drift only outside the bounds, the node's own whenever they change
        config.write_text(
            "[serving]\nslots = 3\ncache_ram_mib = 0\nctx_checkpoints = 0\nubatch = 256\n[bounds]\nmax_slots = 1\n"
        )
        process.send_signal(signal.SIGHUP)
        async with asyncio.timeout(20):
            while True:
                status = await wait_nodes(data_dir, "drifty")
                if status["nodes"][0]["settings"]["ubatch"] == 256:
                    break
                await asyncio.sleep(0.2)

        env = await nats_env(data_dir)
        bus = await Bus.connect(
            NatsOptions(
                urls=(env["MESH_ACTOR_NATS"],),
                user=env["MESH_ACTOR_NATS_USER"],
                password=env["MESH_ACTOR_NATS_PASSWORD"],
            ),
            name="test",
        )
        try:
            with pytest.raises(RemoteError) as refused:
                await bus.request(
                    Subjects().runner("drifty", "start"),
                    StartInstance(reservation_id=decision["reservation_id"]),
                    RunnerAck,
                    timeout=30,
                )
        finally:
            await bus.close()
        assert refused.value.code == "settings_drift"
        assert "slots" in str(refused.value.reply.details)
        (event,) = await events_of(data_dir, "--subject", "runner.drift_rejected")
        assert {"field": "slots", "stamped": "2", "current": "outside the node's bounds"} in event["drift"]
        assert {"field": "ubatch", "stamped": "512", "current": "256"} in event["drift"]
        assert not _servers_of(models["dense"])


async def test_killing_a_node_leaves_no_llama_server_behind(tmp_path: Path, models: dict[str, Path]) -> None:
    data_dir = tmp_path / "node"
    model = tmp_path / "victim.gguf"
    model.write_bytes(models["dense"].read_bytes())
    async with node(data_dir, "victim", "--parallel", "1", *QUIET) as process:
        await wait_nodes(data_dir, "victim")
        code, _, err = await cli("place", str(model), "-c", "512", "--start", "--data-dir", str(data_dir))
        assert code == 0, err
        async with asyncio.timeout(30):
            while not _servers_of(model):
                await asyncio.sleep(0.1)
        process.kill()
        await process.wait()
    async with asyncio.timeout(15):
        while _servers_of(model):
            await asyncio.sleep(0.1)
