"""Embedding and rerank models through the mesh: started as what they are, sized exactly, answered alike.

One node (`mesh-actor run --http`, embedded NATS, default settings) serves two catalog models the suite writes
(`tests/tiny_pooled_models.py`): `embed`, a llama whose header declares mean pooling (its catalog entry names
no kind: the header decides), and `rerank`, a qwen3 reranker with a two-label classification head (`kind =
"rerank"`). The same `/v1/embeddings` and `/v1/rerank` bodies go to the front door and, directly, to the
llama-server it chose, and answer equal field by field; so does whatever the server says to a body it does not
serve (chat on an embedding server, rerank on a server that does not rerank). Each instance runs with the flags
its stamp says (`--embeddings`/`--rerank`, `--pooling`, `-b`/`-ub` a whole input), its observed buffers equal
the prediction where the model is exact (weights, KV, output) and its compute buffer is within the stated
margin. An input longer than the node's default micro-batch is embedded (the whole-input batch), and nothing of
a pooled request is captured into L3.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from runtime.children import free_port
from tests.harness.frontdoor import KEYED, client, instances, write_catalog
from tests.harness.nodes import events_of, node, wait_nodes
from tests.harness.passthrough import assert_same, normalized, post
from tests.llama_harness import require_server
from tests.tiny_pooled_models import write_llama_embedding, write_qwen3_reranker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]
QUIET = ("--cache-ram", "0", "--ctx-checkpoints", "0")
#: The embedding model: wide enough (n_embd 256, 4096 tokens, 8 slots) that its output buffer prints apart from
#: a generation server's (0.13 MiB against 0.12), so an exact observation says the embeddings rows are there.
EMBED = {"n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "n_vocab": 4096}
EMBED_CTX, EMBED_SLOTS = 8192, 8  # 1024 cells a slot: the micro-batch, twice the node's default of 512
#: 704 tokens (a space is three byte tokens in this vocabulary): over the node's default micro-batch (512), within
#: a slot's 1024
LONG = "word " * 100
GREEDY = {"max_tokens": 4, "temperature": 0}
DOCUMENTS = ["a cat sat on the mat", "the weather is sunny", "what is it? it is a cat"]

#: (model, endpoint, body, status): answered alike by the front door and the instance, whatever the answer.
MATRIX: list[tuple[str, str, dict[str, Any], int]] = [
    ("embed", "/v1/embeddings", {"input": "hello world"}, 200),
    ("embed", "/v1/embeddings", {"input": ["first text", "a second, longer text"]}, 200),
    ("embed", "/v1/embeddings", {"input": [1, 80, 81, 82, 83]}, 200),
    ("embed", "/v1/embeddings", {"input": "hello", "encoding_format": "base64"}, 200),
    ("embed", "/v1/embeddings", {"input": LONG}, 200),
    ("embed", "/v1/embeddings", {"input": LONG * 2}, 500),  # over a slot: the server's own error
    ("embed", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **GREEDY}, 200),
    ("embed", "/v1/rerank", {"query": "what is it?", "documents": DOCUMENTS}, 501),
    ("rerank", "/v1/rerank", {"query": "what is it?", "documents": DOCUMENTS, "top_n": 2}, 200),
    ("rerank", "/v1/rerank", {"query": "what is it?", "texts": DOCUMENTS}, 200),
    ("rerank", "/v1/rerank", {"query": "what is it?", "documents": []}, 400),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_server()
    root = tmp_path_factory.mktemp("pooled-models")
    return {
        "embed": write_llama_embedding(root / "embed.gguf", **EMBED),  # type: ignore[arg-type]
        "rerank": write_qwen3_reranker(root / "rerank.gguf"),
    }


class Door:
    def __init__(self, data_dir: Path, port: int, models: dict[str, Path]) -> None:
        self.data_dir = data_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.models = models

    async def instance(self, name: str) -> dict[str, Any]:
        (instance,) = [
            i
            for i in await instances(self.data_dir)
            if i["state"] == "ready" and Path(i["model_path"]).name == self.models[name].name
        ]
        return instance

    async def server(self, name: str) -> str:
        return f"http://127.0.0.1:{(await self.instance(name))['port']}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def door(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> AsyncIterator[Door]:
    data_dir = tmp_path_factory.mktemp("pooled") / "node"
    write_catalog(
        data_dir,
        {
            "embed": {"path": str(models["embed"]), "ctx": EMBED_CTX, "parallel": EMBED_SLOTS},
            "rerank": {"path": str(models["rerank"]), "ctx": 2048, "parallel": 2, "kind": "rerank"},
        },
    )
    port = free_port()
    async with node(data_dir, "pooled", *QUIET, "--http", str(port), "--model-root", str(models["embed"].parent),
                    env=KEYED):  # fmt: skip
        await wait_nodes(data_dir, "pooled")
        front = Door(data_dir, port, models)
        api = client(port)
        await api.embeddings.create(model="embed", input="load")  # loads the models
        status, _ = await post(front.url, "/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d"]})
        assert status == 200
        yield front


@pytest.mark.parametrize(
    ("model", "path", "body", "status"),
    MATRIX,
    ids=[f"{m}-{p.rsplit('/', 1)[-1]}-{i}" for i, (m, p, _, _) in enumerate(MATRIX)],
)
async def test_the_same_body_answers_alike_through_the_front_door_and_directly(
    door: Door, model: str, path: str, body: dict[str, Any], status: int
) -> None:
    sent = {"model": model, **body}
    direct_status, direct = await post(await door.server(model), path, sent, key=None)
    front_status, front = await post(door.url, path, sent)
    assert front_status == direct_status == status, (front, direct)
    if front_status >= 400:  # the server's own error, kept (its shape is the front door's for the endpoint)
        assert front["error"]["message"] == direct["error"]["message"], (front, direct)
        return
    assert_same(normalized(front), normalized(direct))
    if isinstance(front, dict):  # (TEI's rerank shape is a list)
        assert front.get("model") in (None, model)  # never the server's file name


async def test_what_each_server_answers_is_what_it_is(door: Door) -> None:
    embed = await door.server("embed")
    status, answer = await post(door.url, "/v1/embeddings", {"model": "embed", "input": ["one", "two", "three"]})
    assert status == 200 and [d["index"] for d in answer["data"]] == [0, 1, 2]
    assert {len(d["embedding"]) for d in answer["data"]} == {EMBED["n_embd"]}
    assert answer["data"][0]["embedding"] != answer["data"][1]["embedding"]
    # an embedding server does not rerank: the server's 501, through the front door as it said it
    status, error = await post(door.url, "/v1/rerank", {"model": "embed", "query": "q", "documents": ["d"]})
    assert status == 501 and error["error"]["type"] == "not_supported_error"
    direct_status, _ = await post(embed, "/v1/rerank", {"query": "q", "documents": ["d"]}, key=None)
    assert direct_status == 501
    status, ranked = await post(door.url, "/v1/rerank", {"model": "rerank", "query": "q", "documents": DOCUMENTS})
    assert status == 200 and sorted(r["index"] for r in ranked["results"]) == [0, 1, 2]
    scores = [r["relevance_score"] for r in ranked["results"]]
    assert len(set(scores)) > 1  # two labels: scores vary with the document


async def test_the_openai_client_creates_embeddings_through_the_front_door(door: Door) -> None:
    api = client(door.port)
    # the client asks for base64 by default and decodes it
    created = await api.embeddings.create(model="embed", input=["hello", "a longer input text"])
    assert created.model == "embed" and [d.index for d in created.data] == [0, 1]
    assert all(len(d.embedding) == EMBED["n_embd"] for d in created.data)
    assert created.usage.prompt_tokens > 0
    _, direct = await post(await door.server("embed"), "/v1/embeddings",
                           {"input": ["hello", "a longer input text"]}, key=None)  # fmt: skip
    assert_same([d.embedding for d in created.data], [d["embedding"] for d in direct["data"]])
    floats = await api.embeddings.create(model="embed", input="hello", encoding_format="float")
    assert_same(floats.data[0].embedding, created.data[0].embedding)


async def test_pooled_instances_run_as_stamped_and_their_memory_is_the_prediction(door: Door) -> None:
    starts = await events_of(door.data_dir, "--subject", "runner.instance_starting")
    commands = {Path(c[c.index("-m") + 1]).name: c for c in (e["command"] for e in starts)}
    expected = {"embed": ("embedding", "mean", EMBED_CTX // EMBED_SLOTS), "rerank": ("rerank", "rank", 1024)}
    for name, (kind, pooling, whole) in expected.items():
        instance = await door.instance(name)
        stamped = instance["settings"]["settings"]
        assert (stamped["kind"], stamped["pooling"], stamped["batch"], stamped["ubatch"]) == (
            kind, pooling, whole, whole,
        )  # fmt: skip
        command = commands[door.models[name].name]
        assert ("--embeddings" if kind == "embedding" else "--rerank") in command
        assert command[command.index("--pooling") + 1] == pooling
        assert command[command.index("-b") + 1] == command[command.index("-ub") + 1] == str(whole)
        observed, predicted = instance["observed_memory"], instance["predicted_memory"]
        for part in ("weights_bytes", "kv_bytes", "output_bytes"):
            assert observed[part] == predicted[part] > 0, (name, part)
        # the compute buffer is modelled: within the margin admission adds for it
        error = abs(observed["compute_bytes"] - predicted["compute_bytes"])
        assert error <= predicted["compute_margin_bytes"], (name, observed["compute_bytes"], predicted)
    embed = (await door.instance("embed"))["predicted_memory"]
    row = 4 * (EMBED["n_vocab"] + EMBED["n_embd"])  # the logits and the embedding of one output
    assert embed["output_bytes"] == row * EMBED_SLOTS  # 0.13 MiB: a generation server's would print 0.12
    assert embed["host_extra_bytes"] == row * (EMBED_CTX // EMBED_SLOTS - EMBED_SLOTS)  # grown to a whole batch


async def test_nothing_of_a_pooled_request_is_captured(door: Door) -> None:
    for _ in range(2):  # the same long input twice: a generation would be captured and restored
        status, answer = await post(door.url, "/v1/embeddings", {"model": "embed", "input": LONG})
        assert status == 200, answer
    status, _ = await post(door.url, "/v1/rerank", {"model": "rerank", "query": LONG, "documents": ["d"]})
    assert status == 200
    assert not await events_of(door.data_dir, "--subject", "l3.l3_captured")
