"""Companion files through a real node (`mesh-actor run`, embedded NATS, real llama-servers on tiny models).

A model placed with a draft model (`mesh-actor place --draft`) is admitted from both headers, stamped with the
draft's digest, started with `--model-draft` pinned, verified (the server's draft context, its speculation on
every slot) and its observed buffers, the draft's included, equal the prediction byte for byte; a generation
through the mesh runs on it. A front-door catalog entry with `draft` is served the same way.

A model placed with a multimodal projector (`mesh-actor place --mmproj`) runs with `--mmproj` pinned on the
host, its projector's weights observed exactly and its image graph counted as pending until an image comes;
a catalog entry with `mmproj` takes chat bodies with image parts through the front door, answered as the
server answers the same body, and no state holding an image is captured (the server's slot file of such a
prompt lists its media, which the capture refuses).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import blake3
import openai
import pytest

from actors.placement.memory import compute_margin
from actors.runner.allocation_log import printed_mib
from actors.runner.observed import mib_to_bytes
from actors.runner.state_file import state_tokens
from runtime.children import free_port
from tests.harness.frontdoor import KEYED, _events, client, write_catalog
from tests.harness.generate import gen
from tests.harness.images import image_part
from tests.harness.nodes import cli, instances_of, node, wait_nodes
from tests.harness.passthrough import assert_same, normalized, post
from tests.llama_harness import require_server
from tests.tiny_chat_models import write_tool_chat
from tests.tiny_models import write_llama
from tests.tiny_projectors import write_llava_projector

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
        # a chat model (a ChatML template) and a LLaVA projector whose embeddings are its width
        "chat": write_tool_chat(root / "chat.gguf", n_embd=64),
        "mmproj": write_llava_projector(root / "mmproj.gguf", text_embd=64, n_embd=64, n_ff=128, image_size=32),
    }


async def _ready(data_dir: Path, instance_id: str) -> dict[str, Any]:
    async with asyncio.timeout(90):
        while True:
            (instance,) = [i for i in await instances_of(data_dir) if i["id"] == instance_id]
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
        (instance,) = [i for i in await instances_of(data_dir) if i["state"] == "ready"]
        assert instance["settings"]["draft"]["path"] == str(models["draft"])
        _assert_observed_is_predicted(instance)
        # the same file without the draft is another catalog model: it gets its own instance
        plain = await api.completions.create(model="plain", prompt="Hello there", max_tokens=8, temperature=0)
        assert plain.choices[0].text == done.choices[0].text  # greedy: speculation changes no token
        ready = [i for i in await instances_of(data_dir) if i["state"] == "ready"]
        assert sorted(bool(i["settings"].get("draft")) for i in ready) == [False, True]
    with pytest.raises(openai.APIConnectionError):  # the node is gone: nothing of it answers any more
        await client(port).models.list()


async def _instance(data_dir: Path, instance_id: str) -> dict[str, Any]:
    (instance,) = [i for i in await instances_of(data_dir) if i["id"] == instance_id]
    return dict(instance)


def _assert_projector_observed(instance: dict[str, Any], *, pending: bool) -> None:
    observed, predicted = instance["observed_memory"], instance["predicted_memory"]
    assert observed["projector_weights_bytes"] == predicted["projector_weights_bytes"] > 0
    graph = predicted["projector_compute_bytes"]
    assert graph > 0
    assert observed["pending_bytes"] == (graph + compute_margin(graph) if pending else 0)
    parts = ("kv_bytes", "weights_bytes", "projector_weights_bytes", "compute_bytes", "output_bytes", "pending_bytes")
    assert observed["total_bytes"] == sum(observed[p] for p in parts)
    for part in ("kv_bytes", "weights_bytes", "output_bytes"):
        assert observed[part] == predicted[part] > 0, part


async def test_a_model_placed_with_a_projector_runs_with_it_its_graph_counted_until_an_image_comes(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    data_dir = tmp_path / "node"
    async with node(data_dir, "n1", *QUIET):
        await wait_nodes(data_dir, "n1")
        code, out, err = await cli(
            "place", str(models["chat"]), "--mmproj", str(models["mmproj"]), "-c", "4096", "--start", "--json",
            "--data-dir", str(data_dir),
        )  # fmt: skip
        assert code == 0, err + out
        decision = json.loads(out)
        assert decision["stamp"]["mmproj"] == {
            "path": str(models["mmproj"]),
            "digest": blake3.blake3(models["mmproj"].read_bytes()).hexdigest(),
        }
        (placement,) = decision["placements"]
        assert placement["breakdown"]["projector_weights_bytes"] > 0
        instance = await _ready(data_dir, decision["instance"]["instance_id"])
        assert instance["settings"]["mmproj"]["path"] == str(models["mmproj"])
        _assert_projector_observed(instance, pending=True)
        (command,) = await _commands(data_dir)
        assert command[command.index("--mmproj") + 1] == str(models["mmproj"])
        assert "--no-mmproj-offload" in command


async def test_a_catalog_model_with_a_projector_passes_images_through_and_captures_none(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    data_dir = tmp_path / "node"
    write_catalog(data_dir, {"vision": {"path": str(models["chat"]), "mmproj": str(models["mmproj"]), "ctx": 4096}})
    port = free_port()
    async with node(data_dir, "door", *QUIET, "--http", str(port), env=KEYED):
        await wait_nodes(data_dir, "door")
        door = f"http://127.0.0.1:{port}"
        # prompts over the 256 tokens a capture needs (a byte vocabulary: about a token a character), so an image
        # body would be captured if it held no image
        long = "Describe what you see, in every detail you can find. " * 8
        text = {"type": "text", "text": long}
        body = {
            "model": "vision",
            "messages": [{"role": "user", "content": [text, image_part()]}],
            "max_tokens": 8,
            "temperature": 0,
        }
        front_status, front = await post(door, "/v1/chat/completions", body)  # loads the model
        assert front_status == 200, front
        (instance,) = [i for i in await instances_of(data_dir) if i["state"] == "ready"]
        assert instance["settings"]["mmproj"]["path"] == str(models["mmproj"])
        direct = f"http://127.0.0.1:{instance['port']}"
        for streamed in (False, True):
            sent = {**body, **({"stream": True, "stream_options": {"include_usage": True}} if streamed else {})}
            direct_status, direct_answer = await post(direct, "/v1/chat/completions", sent, key=None)
            front_status, front_answer = await post(door, "/v1/chat/completions", sent)
            assert (front_status, direct_status) == (200, 200), (front_answer, direct_answer)
            assert_same(normalized(front_answer), normalized(direct_answer))
        # the image reserved the projector's graph: the runner observes it, nothing is pending any more
        async with asyncio.timeout(60):
            while (now := await _instance(data_dir, instance["id"]))["observed_memory"]["pending_bytes"]:
                await asyncio.sleep(0.5)
        observed, graph = now["observed_memory"], now["predicted_memory"]["projector_compute_bytes"]
        assert observed["compute_bytes"] >= mib_to_bytes(printed_mib(graph)) > 0
        _assert_projector_observed(now, pending=False)
        # a text-only body on the same instance is served and captured as usual (its whole slot, and its prompt
        # one token short); once that is journaled, no capture holds as many tokens as an image prompt (the image
        # bodies, answered before it, captured nothing, though their text alone is as long)
        image_tokens = front["usage"]["prompt_tokens"]
        plain = {"model": "vision", "messages": [{"role": "user", "content": long}], "max_tokens": 4}
        status, answer = await post(door, "/v1/chat/completions", plain)
        assert status == 200, answer
        async with asyncio.timeout(60):
            while not (captured := await _events(data_dir, "l3.l3_captured")):
                await asyncio.sleep(0.2)
        text_tokens = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        assert text_tokens < image_tokens - 1
        assert all(event["n_tokens"] < text_tokens for event in captured), (captured, text_tokens, image_tokens)

        # the server's own slot file of an image prompt lists its media: the capture refuses such a state
        slot_dir = data_dir / "runner" / instance["id"] / "slots"
        files = []
        async with aiohttp.ClientSession() as session:
            for slot in range(2):
                name = f"probe-{slot}.bin"
                async with session.post(f"{direct}/slots/{slot}?action=save", json={"filename": name}) as reply:
                    assert reply.status == 200, await reply.text()
                files.append(slot_dir / name)
        listed = [await asyncio.to_thread(state_tokens, f, max_tokens=1 << 20) for f in files]
        assert any(entry.media for entry in listed), listed
