"""What the pass-through tests share: one body asked of the front door and of the instance directly, and the
answers compared field by field once what differs between any two answers is set aside."""

from __future__ import annotations

import json
import math
from typing import Any

import aiohttp

from tests.harness.frontdoor import KEY

VOLATILE = frozenset({"id", "created", "created_at", "completed_at", "timings", "model", "system_fingerprint",
                      "id_slot", "tokens_cached"})  # fmt: skip


def normalized(value: Any) -> Any:
    """An answer without what differs between two answers to one body: ids, clocks, timings, the model's name,
    and the prompt cache's share of the prompt (each usage keeps its totals)."""
    if isinstance(value, dict):
        out = {k: normalized(v) for k, v in value.items() if k not in VOLATILE}
        if "usage" in value and isinstance(value["usage"], dict):
            usage = value["usage"]
            cached = int(usage.get("cache_read_input_tokens", 0) or 0)
            out["usage"] = {k: v for k, v in usage.items() if "cache" not in k and not k.endswith("_details")}
            if "input_tokens" in usage:
                out["usage"]["input_tokens"] = usage["input_tokens"] + cached
        return out
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def assert_same(front: Any, direct: Any, where: str = "$") -> None:
    """Equal, field by field; floats (log-probabilities) to the last digits a different batch can change."""
    if isinstance(front, float) or isinstance(direct, float):
        assert isinstance(front, (int, float)) and isinstance(direct, (int, float)), where
        assert math.isclose(front, direct, rel_tol=1e-3, abs_tol=1e-3), (where, front, direct)
        return
    assert type(front) is type(direct), (where, front, direct)
    if isinstance(front, dict):
        assert front.keys() == direct.keys(), (where, sorted(front), sorted(direct))
        for key in front:
            assert_same(front[key], direct[key], f"{where}.{key}")
    elif isinstance(front, list):
        assert len(front) == len(direct), (where, len(front), len(direct))
        for i, (a, b) in enumerate(zip(front, direct, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert front == direct, (where, front, direct)


async def post(url: str, path: str, body: dict[str, Any], *, key: str | None = KEY) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body, headers=headers) as reply:
        data = await reply.read()
        if reply.content_type == "text/event-stream":
            return reply.status, [
                json.loads(line[5:])
                for line in data.decode().splitlines()
                if line.startswith("data:") and line[5:].strip() != "[DONE]"
            ]
        return reply.status, json.loads(data)
