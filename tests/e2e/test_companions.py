"""Companion files through a real node (`mesh-actor run`, embedded NATS, real llama-servers on tiny models).

A model placed with a draft model (`mesh-actor place --draft`) is admitted from both headers, stamped with the
draft's digest, started with `--model-draft` pinned, verified (the server's draft context, its speculation on
every slot) and its observed buffers, the draft's included, equal the prediction byte for byte; a generation
through the mesh runs on it. A front-door catalog entry with `draft` is served the same way.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import blake3
import openai
import pytest

from runtime.children import free_port
from tests.e2e.test_frontdoor import KEYED, _events, client, write_catalog
from tests.e2e.test_generate import gen
from tests.e2e.test_mesh import cli, node, wait_nodes
from tests.llama_harness import require_server
from tests.tiny_models import write_llama

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
QUIET = ("--cache-ram", "0", "--ctx-checkpoints", "0", "--parallel", "2")
EXACT = ("kv_bytes", "draft_kv_bytes", "weights_bytes", "draft_weights_bytes", "output_bytes")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_server()
    root = tmp_path_factory.mktemp("companion-models")
    return {
        "model": write_llama(root / "model.gguf", n_layer=4, n_embd=256, n_head=8, n_head_kv=4, n_ff=512, n_vocab=600),
        "draft": write_llama(root / "draft.gguf", n_layer=2, n_embd=128, n_head=2, n_head_kv=1, n_ff=256, n_vocab=600),
    }


async def _ready(data_dir: Path, instance_id: str) -> dict[str, Any]:
    async with asyncio.timeout(90):
        while True:
            code, out, _ = await cli("status", "--json", "--data-dir", str(data_dir))
            assert code == 0
            (instance,) = [i for i in json.loads(out)["instances"] if i["id"] == instance_id]
            if instance["state"] == "ready":
                return dict(instance)
            assert instance["state"] == "starting", instance
            await asyncio.sleep(0.2)


async def _commands(data_dir: Path) -> list[list[str]]:
    return [e["command"] for e in await _events(data_dir, "runner.instance_starting")]


def _assert_observed_is_predicted(instance: dict[str, Any]) -> None:
    observed, predicted = instance["observed_memory"], instance["predicted_memory"]
    assert observed["draft_weights_bytes"] == predicted["draft_weights_bytes"] > 0
    assert observed["draft_kv_bytes"] == predicted["draft_kv_bytes"] > 0
    assert observed["kv_bytes"] == predicted["kv_bytes"] > 0
    assert observed["weights_bytes"] == predicted["weights_bytes"] > 0
    assert observed["output_bytes"] == predicted["output_bytes"] > predicted["draft_output_bytes"] > 0


async def test_a_model_placed_with_a_draft_runs_with_it_and_its_observed_buffers_equal_the_prediction(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    data_dir = tmp_path / "node"
    async with node(data_dir, "n1", *QUIET):
        await wait_nodes(data_dir, "n1")
        code, out, err = await cli(
            "place", str(models["model"]), "--draft", str(models["draft"]), "-c", "4096", "--start", "--json",
            "--data-dir", str(data_dir),
        )  # fmt: skip
        assert code == 0, err + out
        decision = json.loads(out)
        stamp = decision["stamp"]
        assert stamp["settings"]["spec_type"] == "draft-simple"
        assert stamp["draft"] == {
            "path": str(models["draft"]),
            "digest": blake3.blake3(models["draft"].read_bytes()).hexdigest(),
        }
        (placement,) = decision["placements"]
        assert placement["breakdown"]["draft_weights_bytes"] > 0
        instance = await _ready(data_dir, decision["instance"]["instance_id"])
        # ready means verified: the server made the draft context and speculates on every slot
        assert instance["settings"]["draft"]["path"] == str(models["draft"])
        _assert_observed_is_predicted(instance)
        (command,) = await _commands(data_dir)
        assert command[command.index("--model-draft") + 1] == str(models["draft"])
        assert (
            command[command.index("-ngld") + 1] == "0" and command[command.index("--spec-type") + 1] == "draft-simple"
        )
        reply = await gen(data_dir, str(models["model"]), list(range(10, 40)), 16)
        assert len(reply["tokens"]) == 16


async def test_a_catalog_model_with_a_draft_is_served_with_it(tmp_path: Path, models: dict[str, Path]) -> None:
    data_dir = tmp_path / "node"
    write_catalog(
        data_dir,
        {
            "spec": {"path": str(models["model"]), "draft": str(models["draft"]), "ctx": 4096},
            "plain": {"path": str(models["model"]), "ctx": 4096},
        },
    )
    port = free_port()
    async with node(data_dir, "door", *QUIET, "--http", str(port), env=KEYED):
        await wait_nodes(data_dir, "door")
        api = client(port)
        done = await api.completions.create(model="spec", prompt="Hello there", max_tokens=8, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == 8
        code, out, _ = await cli("status", "--json", "--data-dir", str(data_dir))
        assert code == 0
        (instance,) = [i for i in json.loads(out)["instances"] if i["state"] == "ready"]
        assert instance["settings"]["draft"]["path"] == str(models["draft"])
        _assert_observed_is_predicted(instance)
        # the same file without the draft is another catalog model: it gets its own instance
        plain = await api.completions.create(model="plain", prompt="Hello there", max_tokens=8, temperature=0)
        assert plain.choices[0].text == done.choices[0].text  # greedy: speculation changes no token
        _, out, _ = await cli("status", "--json", "--data-dir", str(data_dir))
        ready = [i for i in json.loads(out)["instances"] if i["state"] == "ready"]
        assert sorted(bool(i["settings"].get("draft")) for i in ready) == [False, True]
    with pytest.raises(openai.APIConnectionError):  # the node is gone: nothing of it answers any more
        await client(port).models.list()
