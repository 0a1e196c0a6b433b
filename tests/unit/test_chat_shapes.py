"""Messages and Responses bodies as the chat bodies llama-server converts them to (`actors/runner/chat_shapes.py`).

Each expectation is what `server_chat_convert_anthropic_to_oai` and `server_chat_convert_responses_to_chatcmpl`
(tools/server/server-chat.cpp of the pinned build) build from the same body, read branch by branch; the end to
end tests (`tests/e2e/test_chat_shapes.py`) check the rendered prompts against the server's own counts.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.runner import passthrough
from actors.runner.chat_shapes import ShapeError, anthropic_to_chat, responses_to_chat
from actors.runner.server_json import dump_json

USER = {"role": "user", "content": "What is the weather in Paris?"}


# ---- Anthropic Messages ----


def test_a_plain_messages_body_keeps_its_messages_and_gets_the_servers_defaults() -> None:
    body = {"model": "m", "messages": [USER], "max_tokens": 8, "temperature": 0, "stream": True, "top_k": 3}
    assert anthropic_to_chat(body) == {
        "messages": [USER],
        "max_tokens": 8,
        "temperature": 0,
        "top_k": 3,
        "stream": True,
    }
    assert anthropic_to_chat({"messages": []}) == {"messages": [], "max_tokens": 4096}  # the server's default


def test_a_system_prompt_as_a_string_or_as_text_blocks_joined_without_a_separator() -> None:
    system = {"role": "system", "content": "Be brief."}
    assert anthropic_to_chat({"system": "Be brief.", "messages": [USER]})["messages"] == [system, USER]
    blocks = [
        {"type": "text", "text": "Be "},
        {"type": "image", "source": {}},  # not text: left out
        {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}},
    ]
    assert anthropic_to_chat({"system": blocks, "messages": [USER]})["messages"] == [system, USER]
    assert anthropic_to_chat({"system": None, "messages": [USER]})["messages"] == [USER]  # null: none
    assert anthropic_to_chat({"system": 3, "messages": [USER]})["messages"][0] == {"role": "system", "content": ""}


def test_the_billing_header_stamp_is_overwritten_as_the_server_does() -> None:
    header = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;You are Claude Code."
    (system,) = anthropic_to_chat({"system": header, "messages": []})["messages"]
    assert system["content"] == header.replace("cch=a5145;", "cch=fffff;")
    (blocks,) = anthropic_to_chat({"system": [{"type": "text", "text": header}], "messages": []})["messages"]
    assert blocks["content"] == system["content"]
    for untouched in (
        "You are x-anthropic-billing-header: cch=a5145;",  # not at the start
        "x-anthropic-billing-header: cch=a514;x",  # no `;` five characters on
        "x-anthropic-billing-header: cch=a5145",  # nothing after the stamp
        "x-anthropic-billing-header: cc_version=2",  # no stamp
    ):
        assert anthropic_to_chat({"system": untouched, "messages": []})["messages"][0]["content"] == untouched
    # the server counts bytes: five bytes, then `;`
    for stamp, written in (("éé;x;", "éé;x;"), ("éa;b;", "fffff;")):
        system = f"x-anthropic-billing-header: cch={stamp}"
        converted = anthropic_to_chat({"system": system, "messages": []})["messages"][0]["content"]
        assert converted == f"x-anthropic-billing-header: cch={written}"


def test_content_blocks_become_parts_tool_calls_reasoning_and_tool_messages_in_the_servers_order() -> None:
    text = {"type": "text", "text": "Let me look.", "cache_control": {"type": "ephemeral"}}
    body = {
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "the user ", "signature": "x"},
                    {"type": "redacted_thinking", "data": "?"},  # not converted
                    {"type": "thinking", "thinking": "wants weather"},
                    text,
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"days": 3, "at": [1.5, "x"]}},
                    {"type": "tool_use", "id": "t2", "name": "now"},  # no input: {}
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "content": [{"type": "text", "text": "10"}, {"type": "text", "text": ":00"}],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ]
    }
    assert anthropic_to_chat(body)["messages"] == [
        USER,
        {
            "role": "assistant",
            "content": [text],
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"days":3,"at":[1.5,"x"]}'},
                },
                {"id": "t2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ],
            "reasoning_content": "the user wants weather",
        },
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},  # before the tool results
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "10:00"},
    ]


def test_a_message_of_tool_calls_or_thinking_only_has_empty_content_and_one_of_results_only_none() -> None:
    calls = {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}
    results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a"}]}  # no content: ""
    thinking = {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}
    assert anthropic_to_chat({"messages": [calls, results, thinking]})["messages"] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "a", "content": ""},
        {"role": "assistant", "content": "", "reasoning_content": "hm"},
    ]
    # blocks the server does not convert leave no message at all; an assistant without content is dropped
    unknown = {"role": "user", "content": [{"type": "document", "source": {}}]}
    assert anthropic_to_chat({"messages": [unknown, {"role": "assistant"}]})["messages"] == []
    assert anthropic_to_chat({"messages": [{"role": "user"}, "x"]})["messages"] == [{"role": "user"}, "x"]


def test_images_become_image_url_parts_and_tool_results_with_images_keep_their_parts() -> None:
    png = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    jpeg = {"type": "image", "source": {"type": "base64", "data": "BBBB"}}  # the server's default media type
    url = {"type": "image", "source": {"type": "url", "url": "https://example.invalid/a.png"}}
    other = {"type": "image", "source": {"type": "file", "file_id": "f"}}  # skipped
    body = {
        "messages": [
            {"role": "user", "content": [png, jpeg, url, other, {"type": "text", "text": "what?"}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": [png, {"type": "text", "text": "x"}, other]}
                ],
            },
        ]
    }
    assert anthropic_to_chat(body)["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,BBBB"}},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
                {"type": "text", "text": "what?"},
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "t",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "x"},
            ],
        },
    ]


def test_tools_tool_choice_thinking_stops_and_metadata_as_the_server_converts_them() -> None:
    schema = {"type": "object", "properties": {"days": {"type": "integer"}}}
    body = {
        "messages": [USER],
        "tools": [{"name": "get_weather", "description": "weather", "input_schema": schema}, {"name": "bare"}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "stop_sequences": ["END"],
        "thinking": {"type": "enabled", "budget_tokens": 512.9},
        "metadata": {"user_id": "u1"},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    out = anthropic_to_chat(body)
    assert out["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": schema}},
        {"type": "function", "function": {"name": "bare", "description": "", "parameters": {}}},
    ]
    assert out["tool_choice"] == "required"
    assert out["stop"] == ["END"] and out["thinking_budget_tokens"] == 512 and out["__metadata_user_id"] == "u1"
    assert out["chat_template_kwargs"] == {"enable_thinking": False}
    assert anthropic_to_chat({**body, "tool_choice": {"type": "any"}})["tool_choice"] == "required"
    assert anthropic_to_chat({**body, "tool_choice": {"type": "auto"}})["tool_choice"] == "auto"
    assert "tool_choice" not in anthropic_to_chat({**body, "tool_choice": {"type": "none"}})  # the server's gap
    assert "tool_choice" not in anthropic_to_chat({**body, "tool_choice": "auto"})
    assert anthropic_to_chat({**body, "thinking": {"type": "enabled"}})["thinking_budget_tokens"] == 10000
    assert "thinking_budget_tokens" not in anthropic_to_chat({**body, "thinking": {"type": "disabled"}})
    assert "__metadata_user_id" not in anthropic_to_chat({**body, "metadata": {"user_id": 7}})
    assert "tools" not in anthropic_to_chat({**body, "tools": {"name": "x"}})


def test_a_messages_body_without_messages_is_refused_like_the_server_refuses_it() -> None:
    with pytest.raises(ShapeError, match="'messages' is required"):
        anthropic_to_chat({"system": "x"})
    assert anthropic_to_chat({"system": "x", "messages": "hi"})["messages"] == [{"role": "system", "content": "x"}]


# ---- OpenAI Responses ----


def test_a_responses_body_keeps_every_field_it_does_not_convert() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": "What is the weather?",
        "max_output_tokens": 8,
        "reasoning": {"effort": "low", "summary": "auto"},
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "text": {"format": {"type": "text"}},
        "temperature": 0,
    }
    assert responses_to_chat(body) == {
        "model": "m",
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "text": {"format": {"type": "text"}},
        "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"}],
        "max_tokens": 8,
        "reasoning_effort": "low",
    }
    assert responses_to_chat({"input": "x", "instructions": None})["messages"][0] == {"role": "system", "content": ""}
    assert "reasoning_effort" not in responses_to_chat({"input": "x", "reasoning": {"summary": "auto"}})


def test_input_items_become_chat_messages_and_assistant_output_joins_the_assistant_turn_before_it() -> None:
    body = {
        "input": [
            {"type": "message", "role": "developer", "content": "rules", "status": "completed", "id": "m0"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "hi"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"},
                ],
            },
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Looking."}, {"type": "refusal", "refusal": "no"}],
                "status": "completed",
            },
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"days":3}'},
            {"type": "function_call", "call_id": "c2", "name": "now", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [
                    {"type": "input_text", "text": "10:00"},
                    {"type": "input_image", "image_url": "https://example.invalid/c.png"},
                ],
            },
            {"type": "function_call", "call_id": "c3", "name": "again", "arguments": "{}"},
            {"type": "message", "role": "assistant", "content": "plain"},
        ]
    }
    assert responses_to_chat(body)["messages"] == [
        {"role": "developer", "content": [{"text": "rules", "type": "text"}], "id": "m0"},
        {
            "role": "user",
            "content": [
                {"text": "hi", "type": "text"},
                {"image_url": {"url": "data:image/png;base64,AA"}, "type": "image_url"},
            ],
        },
        {
            "role": "assistant",
            "content": [{"text": "Looking.", "type": "text"}, {"refusal": "no", "type": "refusal"}],
            "reasoning_content": "think",
            "tool_calls": [
                {"function": {"arguments": '{"days":3}', "name": "get_weather"}, "id": "c1", "type": "function"},
                {"function": {"arguments": "{}", "name": "now"}, "id": "c2", "type": "function"},
            ],
        },
        {"content": "sunny", "role": "tool", "tool_call_id": "c1"},
        {
            "content": [
                {"type": "text", "text": "10:00"},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/c.png"}},
            ],
            "role": "tool",
            "tool_call_id": "c2",
        },
        {
            "role": "assistant",
            "tool_calls": [{"function": {"arguments": "{}", "name": "again"}, "id": "c3", "type": "function"}],
            "content": [{"text": "plain", "type": "text"}],
        },
    ]


def test_responses_tools_are_functions_with_strict_by_default_and_other_tools_are_skipped() -> None:
    weather = {"type": "function", "name": "get_weather", "description": "w", "parameters": {"type": "object"}}
    body = {"input": "x", "tools": [weather, {"type": "web_search"}, {**weather, "name": "loose", "strict": False}]}
    assert responses_to_chat(body)["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "w", "parameters": {"type": "object"}, "strict": True},
        },
        {
            "type": "function",
            "function": {"name": "loose", "description": "w", "parameters": {"type": "object"}, "strict": False},
        },
    ]
    assert "tools" not in responses_to_chat({"input": "x", "tools": [{"type": "web_search"}]})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "'input' is required"),
        ({"input": "x", "previous_response_id": "r1"}, "previous_response_id"),
        ({"input": 3}, "must be a string or array"),
        ({"input": ["x"]}, "Cannot determine type"),
        ({"input": [{"type": "item_reference", "id": "i"}]}, "Cannot determine type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "must be one of"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "requires 'text'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "'image_url' is required"),
        ({"input": [{"type": "message", "role": "assistant", "content": [{"type": "x"}]}]}, "output_text"),
        ({"input": [{"type": "message", "role": "assistant", "content": [{"type": "refusal"}]}]}, "requires"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"text": "x"}]}]}, "missing 'type'"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}]}, "should be"),
        ({"input": [{"type": "reasoning", "summary": [], "content": []}]}, "is empty"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "not an array"),
        ({"input": [{"type": "reasoning", "summary": [], "content": [{}]}]}, "not a string"),
        ({"input": "x", "tools": None}, "'tools' must be an array"),
    ],
)
def test_a_responses_body_the_server_refuses_is_refused_with_its_reason(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ShapeError, match=message):
        responses_to_chat(body)


# ---- the JSON the server writes, and what is rendered ----


@pytest.mark.parametrize(
    ("value", "written"),
    [
        ({"b": 1, "a": [True, None, "x"]}, '{"b":1,"a":[true,null,"x"]}'),  # keys in their order, no spaces
        ('é\u2028\x7f\x01\t"\\/', '"é\u2028\x7f\\u0001\\t\\"\\\\/"'),  # only quotes, backslash, controls
        ([1.5, 100.0, -0.0, 0.0, 1e-05, 0.0001, 123456.789], "[1.5,100.0,-0.0,0.0,1e-05,0.0001,123456.789]"),
        ([1e15, 1e16, 1.23e15, 1e100, 5e-324], "[1e+15,1e+16,1.23e+15,1e+100,5e-324]"),  # 1e15: not Python's
        (
            [10**30, -(2**63), 2**64 - 1, 2**64],
            "[1e+30,-9223372036854775808,18446744073709551615,1.8446744073709552e+19]",
        ),
        ({}, "{}"),
        ([[], {}], "[[],{}]"),
        # Grisu2's digits, not the shortest (Python's repr): what the vendored library printed for these
        ([7.036870839547745e177, 5.299064834871378e16], "[7.0368708395477454e+177,5.2990648348713776e+16]"),
        ([-6016.951217939863, 5.890036180278533e-255], "[-6016.9512179398635,5.8900361802785335e-255]"),
        ([-1.738457356755671e-288, 2.225073858507201e-308], "[-1.7384573567556708e-288,2.225073858507201e-308]"),
    ],
)
def test_json_is_written_as_llama_cpp_writes_it(value: Any, written: str) -> None:
    assert dump_json(value) == written


def test_json_nested_as_deeply_as_a_body_may_be_is_written() -> None:
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    assert dump_json(deep) == "[" * 5001 + "]" * 5001


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_written_json_reads_back_to_the_same_value(value: Any) -> None:
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, int) and not isinstance(a, bool) and not -(2**63) <= a < 2**64:
            return isinstance(b, float) and math.isclose(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return type(a) is type(b) and a == b

    assert same(value, json.loads(dump_json(value)))


_PART = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "input_text", "x"]) | _JSON,
        "text": _JSON,
        "content": _JSON,
        "input": _JSON,
        "source": _JSON,
        "thinking": _JSON,
    },
)
_ITEM = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "developer"]) | _JSON,
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | _JSON,
        "content": st.lists(_PART, max_size=3) | _JSON,
        "call_id": _JSON,
        "name": _JSON,
        "arguments": _JSON,
        "output": _JSON,
        "summary": _JSON,
    },
)
_BODY = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(_ITEM, max_size=3) | _JSON,
        "input": st.lists(_ITEM, max_size=3) | _JSON,
        "system": _JSON,
        "instructions": _JSON,
        "tools": _JSON,
        "tool_choice": _JSON,
        "thinking": _JSON,
        "metadata": _JSON,
        "reasoning": _JSON,
    },
)


@settings(max_examples=400, deadline=None)
@given(_BODY)
def test_any_body_is_converted_or_refused_never_crashed_on(body: dict[str, Any]) -> None:
    for convert in (anthropic_to_chat, responses_to_chat):
        try:
            out = convert(body)
        except ShapeError:
            continue
        assert isinstance(out["messages"], list)
        json.dumps(out)  # a body /apply-template can be sent
    for endpoint in ("messages", "count_tokens", "responses", "responses_input_tokens"):
        plan = passthrough.render_plan(endpoint, body)
        assert plan is None or isinstance(plan, passthrough.Template)
