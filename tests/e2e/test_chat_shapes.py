"""Messages and Responses bodies through the mesh: rendered as the server renders them, so held and stored
prefixes are found.

One node (`mesh-actor run`, embedded NATS) serves the tiny chat model of `tests/tiny_chat_models.py` on two
slots. For a matrix of Anthropic Messages and OpenAI Responses bodies, the prompt the mesh renders
(`mesh.runner.<node>.render`: the path routing and restore take, `actors/runner/chat_shapes.py` then the
instance's `/apply-template` and `/tokenize`) has exactly as many tokens as the server's own count
(`/v1/messages/count_tokens`, `/v1/responses/input_tokens`), and a body the server refuses is not rendered. A
Claude Code style conversation (system blocks with a billing header whose stamp changes every turn, tools,
`tool_use` and `tool_result`) sent over `mesh.generate` as the front door sends it finds its first turn held in
a slot, or, once both slots served other prompts, restores it from L3; so does a Responses conversation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from messages.generate import ApiCall, GenerateRequest, GenerateResult, RelayHead, Render, Tokens
from messages.subjects import Subjects
from runtime.bus import Bus
from runtime.generate_client import forward
from tests.harness.generate import client, wait_captured, wait_serving
from tests.harness.nodes import cli, instances_of, node, wait_nodes
from tests.llama_harness import call_server, require_server
from tests.tiny_chat_models import write_tool_chat

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]
QUIET = ("--cache-ram", "0", "--ctx-checkpoints", "0", "--parallel", "2")
CTX = 16384  # 8192 cells a slot

WEATHER = {
    "name": "get_weather",
    "description": "the weather for some days",
    "input_schema": {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]},
}
USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {
    "role": "assistant",
    "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"days": 3, "at": [1.5, "é"], "x": None}},
    ],
}
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


def billing(stamp: str) -> list[dict[str, Any]]:
    """Claude Code's system blocks: a billing header whose `cch=` stamp changes on every request, then its prompt."""
    return [
        {
            "type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={stamp};",
        },
        {"type": "text", "text": "You are a careful assistant. " * 12, "cache_control": {"type": "ephemeral"}},
    ]


#: Messages bodies: (name, body). The server must render each exactly as the mesh does.
MESSAGES: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"messages": [USER], "max_tokens": 8}),
    ("system-string", {"system": "Be brief.", "messages": [USER]}),
    (
        "system-blocks",
        {"system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], "messages": [USER]},
    ),
    ("billing-header", {"system": billing("a5145"), "messages": [USER]}),
    (
        "text-blocks",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}
            ]
        },
    ),
    ("tools", {"system": "Be brief.", "messages": [USER], "tools": [WEATHER], "tool_choice": {"type": "auto"}}),
    ("tool-turns", {"messages": [USER, CALL, RESULT], "tools": [WEATHER], "tool_choice": {"type": "any"}}),
    ("tool-turns-no-tools", {"messages": [USER, CALL, RESULT, {"role": "user", "content": "And tomorrow?"}]}),
    (
        "tool-result-blocks",
        {
            "messages": [
                USER,
                CALL,
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "sun"}, {"type": "text", "text": "ny"}],
                        },
                        {"type": "text", "text": "Thanks."},
                    ],
                },
            ],
            "tools": [WEATHER],
        },
    ),
    (
        "thinking",
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Paris.", "signature": "s"},
                        {"type": "text", "text": "Sunny."},
                    ],
                },
                {"role": "user", "content": "Thanks"},
            ],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
    ),
    ("prefill", {"messages": [USER, {"role": "assistant", "content": "It is"}]}),  # the server continues it
    ("template-kwargs", {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}}),
]
#: Responses bodies: (name, body).
RESPONSES: list[tuple[str, dict[str, Any]]] = [
    ("string", {"input": "What is the weather?"}),
    ("instructions", {"instructions": "Be brief.", "input": "What is the weather?", "max_output_tokens": 8}),
    (
        "items",
        {
            "input": [
                {"type": "message", "role": "developer", "content": "Answer in French."},
                {"role": "user", "content": [{"type": "input_text", "text": "What is the weather?"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Il fait beau."}]},
                {"role": "user", "content": "And tomorrow?"},
            ]
        },
    ),
    (
        "function-calls",
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "What is the weather?"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"days":3}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "get_weather",
                    "description": "the weather",
                    "parameters": WEATHER["input_schema"],
                },
                {"type": "web_search"},  # no chat equivalent: skipped by the server
            ],
            "reasoning": {"effort": "low"},
        },
    ),
    (
        "reasoning-joins-its-turn",
        {
            "input": [
                {"role": "user", "content": "Hi"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Greet."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
                {"role": "user", "content": "Bye"},
            ]
        },
    ),
]
#: Bodies the server refuses (no vision on this model, shapes it cannot convert): the mesh renders nothing.
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("messages", {"messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "What is it?"}]}]}),
    ("messages", {"system": "no messages"}),
    (
        "responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
    ),
    ("responses", {"input": [{"type": "item_reference", "id": "x"}]}),
    ("responses", {"input": "x", "previous_response_id": "r1"}),
]
COUNT_PATHS = {"messages": "/v1/messages/count_tokens", "responses": "/v1/responses/input_tokens"}


@dataclass
class Node:
    data_dir: Path
    model: Path
    instance_id: str
    port: int  # the instance's own llama-server
    bus: Bus

    async def render(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        """The prompt's tokens as the mesh renders them for routing and restore (none: not rendered)."""
        call = ApiCall(endpoint=endpoint, body=msgspec.Raw(json.dumps(body).encode()))  # type: ignore[arg-type]
        reply = await self.bus.request(
            Subjects().runner("shapes", "render"), Render(instance_id=self.instance_id, call=call), Tokens, timeout=30
        )
        return reply.tokens

    async def count(self, endpoint: str, body: dict[str, Any]) -> tuple[int, Any]:
        """The server's own answer to the body's token count endpoint."""
        reply = await call_server(self.port, "POST", COUNT_PATHS[endpoint], body, timeout_s=30)
        return reply.status, reply.json()

    async def generate(self, endpoint: str, body: dict[str, Any]) -> tuple[GenerateResult, Any]:
        """The body through `mesh.generate` as the front door sends it: the runner's result and the answer."""
        data = bytearray()
        heads: list[RelayHead] = []

        async def on_head(head: RelayHead) -> None:
            heads.append(head)

        async def on_data(piece: bytes) -> None:
            data.extend(piece)

        call = ApiCall(endpoint=endpoint, body=msgspec.Raw(json.dumps(body).encode()))  # type: ignore[arg-type]
        request = GenerateRequest(model=str(self.model), api=call, timeout_s=120)
        result = await forward(self.bus, Subjects(), request, on_head, on_data)
        assert heads and heads[0].status == 200, bytes(data)
        return result, json.loads(data)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shapes_node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    require_server()
    model = write_tool_chat(tmp_path_factory.mktemp("chat-shapes-models") / "chat.gguf")
    data_dir = tmp_path_factory.mktemp("chat-shapes") / "node"
    async with node(data_dir, "shapes", *QUIET, "--model-root", str(model.parent)):
        await wait_nodes(data_dir, "shapes")
        code, out, err = await cli(
            "place", str(model), "-c", str(CTX), "--start", "--json", "--data-dir", str(data_dir)
        )
        assert code == 0, err + out
        instance_id = str(json.loads(out)["instance"]["instance_id"])
        async with asyncio.timeout(60):
            while True:
                (instance,) = [i for i in await instances_of(data_dir) if i["id"] == instance_id]
                if instance["state"] == "ready":
                    break
                await asyncio.sleep(0.2)
        async with client(data_dir) as bus:
            yield Node(data_dir, model, instance_id, int(instance["port"]), bus)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [("messages", b) for _, b in MESSAGES] + [("responses", b) for _, b in RESPONSES],
    ids=[f"messages-{n}" for n, _ in MESSAGES] + [f"responses-{n}" for n, _ in RESPONSES],
)
async def test_the_mesh_renders_as_many_tokens_as_the_server_counts(
    shapes_node: Node, endpoint: str, body: dict[str, Any]
) -> None:
    status, counted = await shapes_node.count(endpoint, body)
    assert status == 200, counted
    rendered = await shapes_node.render(endpoint, body)
    assert len(rendered) == counted["input_tokens"], (len(rendered), counted)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [("messages", b) for _, b in MESSAGES] + [("responses", b) for _, b in RESPONSES],
    ids=[f"messages-{n}" for n, _ in MESSAGES] + [f"responses-{n}" for n, _ in RESPONSES],
)
async def test_the_server_reuses_every_token_the_mesh_rendered(
    shapes_node: Node, endpoint: str, body: dict[str, Any]
) -> None:
    """Token for token, not only as many: both slots hold the mesh's tokens (the server picks a Messages body's
    slot itself), then the server's own endpoint reuses all of them but the last, whose logits it computes."""
    tokens = await shapes_node.render(endpoint, body)
    for slot in (0, 1):
        prefill = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": True, "temperature": 0}
        reply = await call_server(shapes_node.port, "POST", "/completion", prefill, timeout_s=60)
        assert reply.status == 200, reply.body
    limit = {"max_tokens": 1} if endpoint == "messages" else {"max_output_tokens": 1}
    path = {"messages": "/v1/messages", "responses": "/v1/responses"}[endpoint]
    reply = await call_server(shapes_node.port, "POST", path, {**body, **limit, "temperature": 0}, timeout_s=60)
    assert reply.status == 200, reply.body
    assert _cached(reply.json()) == len(tokens) - 1, (len(tokens), reply.json()["usage"])


@pytest.mark.parametrize(("endpoint", "body"), REFUSED, ids=[f"{e}-{i}" for i, (e, _) in enumerate(REFUSED)])
async def test_a_body_the_server_refuses_to_count_is_not_rendered(
    shapes_node: Node, endpoint: str, body: dict[str, Any]
) -> None:
    status, refused = await shapes_node.count(endpoint, body)
    assert status != 200, refused  # images: this model has no vision; the rest the server cannot convert
    assert await shapes_node.render(endpoint, body) == []


async def _evict_both_slots(node: Node) -> None:
    """Two prompts that share nothing with the chat prompts but their first token (completions of plain text,
    under the capture threshold), at once: the runner never hands out a busy slot, so each takes one, and both
    slots hold other tokens after."""
    bodies = [{"prompt": c * 120, "max_tokens": 64, "ignore_eos": True, "temperature": 0} for c in "qw"]
    results = await asyncio.gather(*(node.generate("completions", body) for body in bodies))
    assert {result.slot for result, _ in results} == {0, 1}


async def _captured(node: Node, n_tokens: int) -> None:
    """Until the prompt less its last token is in the store and the runner gave its slot back (the captures
    after an answer run off the reply's path)."""
    await wait_captured(node.data_dir, n_tokens)
    await wait_serving(node.data_dir, lambda loads: node.instance_id in loads and loads[node.instance_id].busy == 0)


def _cached(answer: dict[str, Any]) -> int:
    usage = answer["usage"]
    return int(
        usage.get("cache_read_input_tokens") or (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
    )


async def test_a_claude_code_turn_extending_the_last_finds_it_held_in_a_slot_or_restores_it_from_l3(
    shapes_node: Node,
) -> None:
    tools = [WEATHER, {**WEATHER, "name": "get_time", "description": "the time"}]
    first = {
        "model": "m",
        "system": billing("a5145"),
        "tools": tools,
        "messages": [USER],
        "max_tokens": 4,
        "temperature": 0,
    }
    n_first = len(await shapes_node.render("messages", first))
    assert n_first > 256  # long enough to be captured
    result, answer = await shapes_node.generate("messages", first)
    assert answer["usage"]["input_tokens"] + _cached(answer) == n_first
    # the next turn (once the first turn's captures gave its slot back: a client's tools take that long): the
    # same conversation, a new stamp (the server overwrites it), a tool call and its result
    await _captured(shapes_node, n_first - 1)
    second = {**first, "system": billing("0b7d2"), "messages": [USER, CALL, RESULT]}
    result, answer = await shapes_node.generate("messages", second)
    assert result.source == "resident", result  # the runner found the first turn in a slot
    assert _cached(answer) >= n_first - 1, answer["usage"]  # and the server reused it
    assert answer["usage"]["input_tokens"] + _cached(answer) == len(await shapes_node.render("messages", second))

    # once both slots served other prompts, the first turn comes back from the node's store
    await _evict_both_slots(shapes_node)
    third = {
        **first,
        "system": billing("9c3e1"),
        "messages": [USER, CALL, RESULT, {"role": "user", "content": "And tomorrow?"}],
    }
    result, answer = await shapes_node.generate("messages", third)
    assert result.source == "l3_local" and result.tokens_restored >= n_first - 1, result
    assert _cached(answer) >= result.tokens_restored, answer["usage"]


async def test_a_responses_turn_extending_the_last_finds_it_held_in_a_slot(shapes_node: Node) -> None:
    instructions = "You are a careful assistant. " * 12
    first = {
        "model": "m",
        "instructions": instructions,
        "input": "What is the weather?",
        "max_output_tokens": 4,
        "temperature": 0,
    }
    n_first = len(await shapes_node.render("responses", first))
    await shapes_node.generate("responses", first)
    await _captured(shapes_node, n_first - 1)
    second = {
        **first,
        "input": [
            {"role": "user", "content": "What is the weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"days":3}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    }
    result, answer = await shapes_node.generate("responses", second)
    assert result.source == "resident", result
    assert _cached(answer) >= n_first - 1, answer["usage"]


async def _slot_tasks(port: int) -> dict[int, Any]:
    reply = await call_server(port, "GET", "/slots", timeout_s=10)
    return {s["id"]: s.get("id_task") for s in reply.json()}


async def test_llama_server_runs_a_messages_body_in_a_slot_of_its_own_choosing(shapes_node: Node) -> None:
    """A limit of the server the mesh lives with (last in this module: it bypasses the runner): its Messages
    conversion builds a new body and drops `id_slot`, so the server picks the slot (the free one sharing the
    longest prefix, over a tenth of the prompt, else the least recently used); a Responses body keeps its fields,
    the pin included. When this fails, the server pins Messages bodies too: docs/architecture.md says otherwise."""
    port = shapes_node.port
    for slot, letter in ((1, "a"), (0, "b")):  # slot 1 is then the least recently used
        body = {"prompt": letter * 300, "n_predict": 1, "id_slot": slot, "cache_prompt": True}
        assert (await call_server(port, "POST", "/completion", body, timeout_s=60)).status == 200
    # each pinned to the slot the server would not pick: the most recently used one
    for path, body, pinned, ran_on in (
        ("/v1/messages", {"messages": [{"role": "user", "content": "c" * 300}], "max_tokens": 1}, 0, 1),
        ("/v1/responses", {"input": "d" * 300, "max_output_tokens": 1}, 1, 1),
    ):
        before = await _slot_tasks(port)
        reply = await call_server(port, "POST", path, {**body, "id_slot": pinned}, timeout_s=60)
        assert reply.status == 200, reply.body
        after = await _slot_tasks(port)
        assert [s for s in after if after[s] != before[s]] == [ran_on], (path, before, after)
