"""The render memo (`actors.runner.renders`) and the pass-through's use of it (`forward.Forwarder.render`): a body
sent again unchanged is not rendered again on the server (issue 29: two round trips before the slot is chosen)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from actors.runner.forward import Forwarder
from actors.runner.renders import Rendered, RenderMemo, render_key
from actors.runner.served import ServedInstance, ServingLimits
from actors.runner.slots import PromptLimit
from runtime.actor import RequestError


def _rendered(n: int, size: int = 10) -> Rendered:
    return Rendered(tuple(range(n)), size)


def test_a_body_is_known_by_its_scope_its_endpoint_and_its_exact_bytes() -> None:
    body = b'{"messages":[{"role":"user","content":"hi"}]}'
    assert render_key("", "chat", body) == render_key("", "chat", bytes(body))
    assert render_key("", "chat", body) != render_key("", "messages", body)
    assert render_key("", "chat", body) != render_key("tenant-a", "chat", body)  # another tenant's: not shared
    assert render_key("", "chat", body) != render_key("", "chat", body.replace(b":", b": ", 1))  # bytes, not meaning
    assert render_key("", "chat", body) != render_key("", "cha", b"t\0" + body)  # each part's end is marked


def test_an_entry_is_used_until_its_time_is_up() -> None:
    memo = RenderMemo(ttl_s=60.0)
    memo.put(b"k", _rendered(3), now=100.0)
    assert memo.get(b"k", now=159.9) == _rendered(3)
    assert memo.get(b"k", now=160.0) is None
    assert len(memo) == 0 and memo.tokens == 0  # an expired entry goes when it is met


def test_the_least_recently_used_entry_leaves_first_past_the_entry_bound() -> None:
    memo = RenderMemo(max_entries=2)
    memo.put(b"a", _rendered(1), now=0.0)
    memo.put(b"b", _rendered(1), now=0.0)
    assert memo.get(b"a", now=1.0) is not None  # `b` is now the least recently used
    memo.put(b"c", _rendered(1), now=1.0)
    assert memo.get(b"b", now=1.0) is None
    assert memo.get(b"a", now=1.0) is not None and memo.get(b"c", now=1.0) is not None


def test_the_tokens_held_are_bounded_and_a_prompt_too_long_is_not_kept() -> None:
    memo = RenderMemo(max_tokens=10, max_entry_tokens=6)
    memo.put(b"long", _rendered(7), now=0.0)
    assert memo.get(b"long", now=0.0) is None and memo.tokens == 0
    memo.put(b"a", _rendered(6), now=0.0)
    memo.put(b"b", _rendered(5), now=0.0)  # 11 tokens: `a` leaves
    assert memo.get(b"a", now=0.0) is None and memo.tokens == 5
    memo.put(b"b", _rendered(2), now=0.0)  # replaced, not counted twice
    assert memo.tokens == 2 and len(memo) == 1


class _Api:
    """llama-server's render endpoints, counted."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def json(self, port: int, method: str, path: str, body: Any, *, timeout_s: float) -> Any:
        self.calls.append(path)
        return {"prompt": "<user>" + body["messages"][0]["content"]}

    async def tokenize(self, port: int, text: str, *, timeout_s: float) -> list[int]:
        self.calls.append("/tokenize")
        return [ord(c) for c in text]


class _Shell:
    def __init__(self) -> None:
        self.api = _Api()
        self.limits = ServingLimits()


def _instance() -> ServedInstance:
    return ServedInstance("i1", 8080, 2, slot_dir=None, generation=1, rollback=True)  # type: ignore[arg-type]


def _chat(text: str, scope: str = "") -> tuple[dict[str, Any], bytes]:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True}
    return body, render_key(scope, "chat", json.dumps(body).encode())


def test_the_same_body_again_is_rendered_from_the_memo_without_asking_the_server() -> None:
    shell = _Shell()
    forwarder = Forwarder(shell)  # type: ignore[arg-type]
    instance = _instance()
    body, raw = _chat("hello")

    first = asyncio.run(forwarder.render(instance, "chat", body, raw))
    assert shell.api.calls == ["/apply-template", "/tokenize"]
    again = asyncio.run(forwarder.render(instance, "chat", body, raw))
    assert again == first == [ord(c) for c in "<user>hello"]
    assert shell.api.calls == ["/apply-template", "/tokenize"]  # no round trip the second time

    other, other_key = _chat("hello!")
    asyncio.run(forwarder.render(instance, "chat", other, other_key))
    assert len(shell.api.calls) == 4  # another body is rendered by the server
    asyncio.run(forwarder.render(instance, "chat", body, _chat("hello", scope="tenant-a")[1]))
    assert len(shell.api.calls) == 6  # the same body of another cache scope too
    asyncio.run(forwarder.render(_instance(), "chat", body, raw))
    assert len(shell.api.calls) == 8  # another incarnation of the server renders for itself
    asyncio.run(forwarder.render(instance, "chat", body))
    assert len(shell.api.calls) == 10  # without a key (the router's render: no scope said), no memo


def test_a_remembered_prompt_is_still_refused_when_its_slot_can_no_longer_hold_it() -> None:
    shell = _Shell()
    forwarder = Forwarder(shell)  # type: ignore[arg-type]
    instance = _instance()
    body, raw = _chat("x" * 100)
    assert asyncio.run(forwarder.render(instance, "chat", body, raw)) is not None
    instance.context = PromptLimit(n_ctx_seq=10, longest_token_bytes=4)  # 40 bytes at most: 106 are over
    with pytest.raises(RequestError, match="bytes"):
        asyncio.run(forwarder.render(instance, "chat", body, raw))
    assert shell.api.calls == ["/apply-template", "/tokenize"]
