"""Anthropic Messages and OpenAI Responses bodies as the chat-completions body llama-server builds from them
(runner core, pure), so that the mesh renders their prompts through the instance's `/apply-template` exactly as
the server renders them itself.

llama-server serves `/v1/messages` (and `/count_tokens`) and `/v1/responses` (and `/input_tokens`) by
converting the body to a chat-completions body (`server_chat_convert_anthropic_to_oai` and
`server_chat_convert_responses_to_chatcmpl` in tools/server/server-chat.cpp of the pinned build), then applying
its chat template to that (`oaicompat_chat_params_parse`). `/apply-template` only takes the chat shape, so the
two conversions are ported here, branch for branch: same defaults for missing or mistyped fields (the C++
`json_value` falls back to its default when a field is absent, null or of another type), same order of
messages and content parts, same errors (`ShapeError`, where the server answers 400).

Rules this module keeps:

* A port, not an improvement: whatever the server does to a body is done here, quirks included (system blocks
  joined without a separator, a Messages `tool_choice` of type `none` dropped, a Responses tool of another type
  than `function` skipped). A difference would only cost a cold prefill (the server renders the body it is sent
  itself, and reuses only what a slot shares with that), never a wrong answer; but it would cost it every turn.
* The one string the server writes itself is a tool call's `arguments` (a Messages `tool_use` input, dumped):
  `server_json.dump_json` writes it byte for byte as the server does.
* Claude Code's `x-anthropic-billing-header` system prompt carries a `cch=` stamp that changes on every
  request; the server overwrites it (with `fffff`) so that a conversation's prefix stays cacheable. So does
  this port, on the prompt's UTF-8 bytes as the server does.
* Fields the server reads only after rendering (sampling, limits, stops) are converted too: the body is the one
  the server builds, so a field that matters to the template can never be missed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from actors.runner.server_json import dump_json

__all__ = ["ShapeError", "anthropic_to_chat", "responses_to_chat"]


class ShapeError(ValueError):
    """The server refuses this body (it answers 400 with this message)."""


# ---- llama.cpp's JSON, as its server reads it ------------------------------------------------------------------


def _value(obj: Any, key: str) -> Any:
    """`json_value(obj, key, json())`: the field, or None when `obj` is not an object or has no such field."""
    return obj.get(key) if isinstance(obj, dict) else None


def _string(obj: Any, key: str, default: str = "") -> str:
    """`json_value(obj, key, std::string)`: the field when it is a string, else `default`."""
    value = _value(obj, key)
    return value if isinstance(value, str) else default


def _has_string(obj: Any, key: str) -> bool:
    return isinstance(_value(obj, key), str)


def _has_list(obj: Any, key: str) -> bool:
    return isinstance(_value(obj, key), list)


def _int(obj: Any, key: str, default: int) -> int:
    """`json_value(obj, key, int)`: numbers and booleans convert (a fraction truncated), anything else is
    `default`."""
    value = _value(obj, key)
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    return default


# ---- Anthropic Messages (server_chat_convert_anthropic_to_oai) --------------------------------------------------

_BILLING_HEADER: Final = b"x-anthropic-billing-header:"
_CCH_LENGTH: Final = 5


def _billing_header_normalized(text: str) -> str:
    """The system prompt with the 5 characters of `cch=` in a billing header overwritten with `f`, when a `;`
    follows them; any other prompt as it is. On bytes, as the server does it."""
    if not text.startswith(_BILLING_HEADER.decode()):
        return text
    raw = bytearray(text.encode())
    found = raw.find(b"cch=", len(_BILLING_HEADER))
    if found < 0:
        return text
    start = found + 4
    if start + _CCH_LENGTH < len(raw) and raw[start + _CCH_LENGTH] == ord(";"):
        # whole characters: the five bytes start after `=` and end before `;`
        raw[start : start + _CCH_LENGTH] = b"f" * _CCH_LENGTH
        return raw.decode()
    return text


def _image_url(source: Any) -> str | None:
    """An Anthropic image block's source as the URL of an `image_url` part (None: a source type it skips)."""
    kind = _string(source, "type")
    if kind == "base64":
        return f"data:{_string(source, 'media_type', 'image/jpeg')};base64,{_string(source, 'data')}"
    if kind == "url":
        return _string(source, "url")
    return None


def _tool_result(block: Any) -> dict[str, Any]:
    """A `tool_result` block as a `tool` message: text only collapses to one string, images keep parts."""
    tool_use_id = _string(block, "tool_use_id")
    content = _value(block, "content")
    if isinstance(content, str):
        return {"role": "tool", "tool_call_id": tool_use_id, "content": content}
    if not isinstance(content, list):
        return {"role": "tool", "tool_call_id": tool_use_id, "content": ""}
    text = ""
    parts: list[dict[str, Any]] = []
    has_images = False
    for item in content:
        kind = _string(item, "type")
        if kind == "text":
            piece = _string(item, "text")
            text += piece
            parts.append({"type": "text", "text": piece})
        elif kind == "image":
            has_images = True
            url = _image_url(_value(item, "source"))  # absent, null or not an object: no type, skipped
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"role": "tool", "tool_call_id": tool_use_id, "content": parts if has_images else text}


def _anthropic_message(message: Any) -> list[Any]:
    """One Messages message as chat messages: itself when its content is not a list of blocks; else one
    message of its text, images, thinking and tool calls (when it has any), then a `tool` message per result."""
    role = _string(message, "role")
    if not isinstance(message, dict) or "content" not in message:
        return [] if role == "assistant" else [message]
    content = message["content"]
    if not isinstance(content, list):
        return [message]
    parts: list[Any] = []
    tool_calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = _string(block, "type")
        if kind == "text":
            parts.append(block)  # as it came (its cache_control and all)
        elif kind == "thinking":
            reasoning += _string(block, "thinking")
        elif kind == "image":
            url = _image_url(_value(block, "source"))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            arguments = _value(block, "input")
            tool_calls.append(
                {
                    "id": _string(block, "id"),
                    "type": "function",
                    "function": {
                        "name": _string(block, "name"),
                        "arguments": dump_json(arguments if arguments is not None else {}),
                    },
                }
            )
        elif kind == "tool_result":
            results.append(_tool_result(block))
    out: list[Any] = []
    if parts or tool_calls or reasoning:
        converted: dict[str, Any] = {"role": role, "content": parts if parts else ""}
        if tool_calls:
            converted["tool_calls"] = tool_calls
        if reasoning:
            converted["reasoning_content"] = reasoning
        out.append(converted)
    return out + results


def _anthropic_system(system: Any) -> str:
    """The system prompt: a string, or the text blocks joined as they are (no separator)."""
    if isinstance(system, str):
        return _billing_header_normalized(system)
    if isinstance(system, list):
        return "".join(
            _billing_header_normalized(_string(block, "text")) for block in system if _string(block, "type") == "text"
        )
    return ""


def anthropic_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body llama-server makes of a Messages body (ShapeError: it refuses the body)."""
    messages: list[Any] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _anthropic_system(body["system"])})
    if "messages" not in body:
        raise ShapeError("'messages' is required")
    if isinstance(body["messages"], list):
        for message in body["messages"]:
            messages += _anthropic_message(message)
    out: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": _string(tool, "name"),
                    "description": _string(tool, "description"),
                    "parameters": tool["input_schema"] if isinstance(tool, dict) and "input_schema" in tool else {},
                },
            }
            for tool in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = _string(choice, "type")
        if kind == "auto":
            out["tool_choice"] = "auto"
        elif kind in ("any", "tool"):
            out["tool_choice"] = "required"
    if "stop_sequences" in body:
        out["stop"] = body["stop_sequences"]
    out["max_tokens"] = body.get("max_tokens", 4096)  # null stays null, as in the server
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs"):
        if key in body:
            out[key] = body[key]
    if "thinking" in body:
        thinking = body["thinking"] if body["thinking"] is not None else {}
        if _string(thinking, "type") == "enabled":
            out["thinking_budget_tokens"] = _int(thinking, "budget_tokens", 10000)
    if "metadata" in body:
        user_id = _string(body["metadata"], "user_id")
        if user_id:
            out["__metadata_user_id"] = user_id
    return out


# ---- OpenAI Responses (server_chat_convert_responses_to_chatcmpl) -----------------------------------------------


def _input_message(item: dict[str, Any]) -> dict[str, Any]:
    """A user, system or developer input message, its content parts as chat parts."""
    content: list[dict[str, Any]] = []
    for part in item["content"]:
        kind = _string(part, "type")
        if kind == "input_text":
            if "text" not in part:
                raise ShapeError("'Input text' requires 'text'")
            content.append({"text": part["text"], "type": "text"})
        elif kind == "input_image":
            if "image_url" not in part:  # its `detail` is optional: "auto"
                raise ShapeError("'image_url' is required")
            content.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        elif kind == "input_file":
            raise ShapeError("'input_file' is not supported by llamacpp at this moment")
        else:
            raise ShapeError("'type' must be one of 'input_text', 'input_image', or 'input_file'")
    out = {k: v for k, v in item.items() if k not in ("type", "status")}
    out["content"] = content
    return out


def _output_content(item: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant output message's content as chat parts (text and refusals)."""
    content = item.get("content")
    if isinstance(content, str):
        return [{"text": content, "type": "text"}]
    out: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else []:
        kind = _string(part, "type")
        if kind in ("output_text", "input_text"):  # a string content was made an input_text part
            if not _has_string(part, "text"):
                raise ShapeError("'Output text' requires 'text'")
            out.append({"text": part["text"], "type": "text"})
        elif kind == "refusal":
            if not _has_string(part, "refusal"):
                raise ShapeError("'Refusal' requires 'refusal'")
            out.append({"refusal": part["refusal"], "type": "refusal"})
        else:
            raise ShapeError("'type' must be one of 'output_text' or 'refusal'")
    return out


def _tool_output(item: dict[str, Any]) -> dict[str, Any]:
    """A function call's output as a `tool` message (a list of text and image parts as chat parts)."""
    output = item["output"]
    if isinstance(output, str):
        return {"content": output, "role": "tool", "tool_call_id": item["call_id"]}
    parts: list[dict[str, Any]] = []
    for part in output:
        if not isinstance(part, dict) or "type" not in part:
            raise ShapeError("Output of tool call missing 'type' field")
        if part["type"] not in ("input_text", "input_image"):
            raise ShapeError("Output of tool call should be 'Input text' or 'Input image'")
        part = dict(part)
        if part["type"] == "input_text":
            part["type"] = "text"
        else:
            if "image_url" not in part:
                raise ShapeError("'image_url' is required")
            part["type"] = "image_url"
            part["image_url"] = {"url": part["image_url"]}
        parts.append(part)
    return {"content": parts, "role": "tool", "tool_call_id": item["call_id"]}


def _input_items(items: list[Any]) -> list[dict[str, Any]]:
    """The input item list as chat messages. Assistant output (messages, function calls, reasoning) that follows
    an assistant message joins it, as one assistant turn."""
    messages: list[dict[str, Any]] = []
    for raw in items:
        merge = bool(messages) and messages[-1].get("role") == "assistant"
        item = dict(raw) if isinstance(raw, dict) else raw
        if _has_string(item, "content"):  # an input message's text: as a list of one input_text part
            item["content"] = [{"text": item["content"], "type": "input_text"}]
        role = _value(item, "role")
        kind = _value(item, "type")
        if _has_list(item, "content") and role in ("user", "system", "developer"):
            messages.append(_input_message(item))
        elif role == "assistant" and kind == "message":
            content = _output_content(item)
            if merge:
                previous = messages[-1]
                if not isinstance(previous.get("content"), list):
                    previous["content"] = []
                previous["content"] += content
            else:
                messages.append({**{k: v for k, v in item.items() if k not in ("status", "type")}, "content": content})
        elif (
            _has_string(item, "arguments")
            and _has_string(item, "call_id")
            and _has_string(item, "name")
            and kind == "function_call"
        ):
            call = {
                "function": {"arguments": item["arguments"], "name": item["name"]},
                "id": item["call_id"],
                "type": "function",
            }
            if merge:
                previous = messages[-1]
                if not isinstance(previous.get("tool_calls"), list):
                    previous["tool_calls"] = []
                previous["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif (
            _has_string(item, "call_id")
            and (_has_string(item, "output") or _has_list(item, "output"))
            and kind == "function_call_output"
        ):
            messages.append(_tool_output(item))
        elif _has_list(item, "summary") and kind == "reasoning":
            reasoning = item.get("content")
            if not isinstance(reasoning, list):
                raise ShapeError("item['content'] is not an array")
            if not reasoning:
                raise ShapeError("item['content'] is empty")
            if not _has_string(reasoning[0], "text"):
                raise ShapeError("item['content']['text'] is not a string")
            if merge:
                messages[-1]["reasoning_content"] = reasoning[0]["text"]
            else:
                messages.append({"role": "assistant", "content": [], "reasoning_content": reasoning[0]["text"]})
        else:
            raise ShapeError("Cannot determine type of 'item'")
    return messages


def responses_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body llama-server makes of a Responses body (ShapeError: it refuses the body).
    Every field it does not convert stays, as in the server."""
    if "input" not in body:
        raise ShapeError("'input' is required")
    if _string(body, "previous_response_id"):
        raise ShapeError("llama.cpp does not support 'previous_response_id'.")
    given = body["input"]
    out = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _string(body, "instructions")})
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages += _input_items(given)
    else:
        raise ShapeError("'input' must be a string or array of objects")
    out["messages"] = messages
    if "tools" in body:
        if not isinstance(body["tools"], list):
            raise ShapeError("'tools' must be an array of objects")
        tools = []
        for tool in body["tools"]:
            if _string(tool, "type") != "function":
                continue  # no chat equivalent: the server skips it with a warning
            function = {k: v for k, v in tool.items() if k != "type"}
            function.setdefault("strict", True)
            tools.append({"type": "function", "function": function})
        del out["tools"]
        if tools:
            out["tools"] = tools
    if "max_output_tokens" in body:
        del out["max_output_tokens"]
        out["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = body["reasoning"]
        if isinstance(reasoning, dict) and "effort" in reasoning:
            out["reasoning_effort"] = reasoning["effort"]
        del out["reasoning"]
    return out
