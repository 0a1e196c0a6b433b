"""Front doors over a live bus: a cluster of doors, a stub router, a ready instance, completions through them."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
from nats.aio.msg import Msg

from actors.frontdoor.actor import FrontDoorActor
from actors.frontdoor.catalog import parse_catalog
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.generate import RELAY_HEADER, RELAY_SEQ_HEADER, GenerateRequest, GenerateResult, RelayHead
from messages.placement import Stamp
from messages.runner import InstanceStatus
from messages.settings import ServingSettings
from messages.subjects import Subjects
from runtime import buckets
from runtime.bus import Bus, decode, encode
from tests import tiny_models
from tests.conftest import supervised

SUBJECTS = Subjects()


class Router:
    """Answers every pass-through on `mesh.generate` (or `subject`) like a runner would: the relayed body (with
    `usage`: prompt tokens as many as the prompt's words, completion tokens as `max_tokens` asks), then the result
    with the same counts. With `hold`, each request waits for `gate` before it is answered."""

    def __init__(self, bus: Bus, *, hold: bool = False, subject: str = SUBJECTS.generate) -> None:
        self._bus = bus
        self._subject = subject
        self.gate = asyncio.Event()
        if not hold:
            self.gate.set()
        self.held = 0
        self.answered = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Router:
        self._sub = await self._bus.nc.subscribe(self._subject, cb=self._on_request)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._sub.unsubscribe()
        for task in self._tasks:
            task.cancel()

    async def _on_request(self, msg: Msg) -> None:
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        order = decode(msg.data, GenerateRequest)
        assert order.api is not None and order.stream is not None
        body = json.loads(bytes(order.api.body))
        text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", ()))
        prompt, generated = len(str(text).split()), int(body.get("max_tokens") or 1)
        self.held += 1
        try:
            await self.gate.wait()
        finally:
            self.held -= 1
        usage = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                 "prompt_tokens_details": {"cached_tokens": 1}}  # fmt: skip
        answer = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m.gguf",
                  "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
                  "usage": usage}  # fmt: skip
        head = RelayHead(status=200, content_type="application/json")
        await self._bus.nc.publish(order.stream, encode(head), headers={RELAY_HEADER: "head"})
        await self._bus.nc.publish(
            order.stream, json.dumps(answer).encode(), headers={RELAY_HEADER: "data", RELAY_SEQ_HEADER: "0"}
        )
        result = GenerateResult(
            request_id=order.request_id or "", text="ok", tokens=[], prompt_tokens=prompt, source="cold",
            tokens_restored=0, tokens_cached=1, tokens_evaluated=prompt - 1, ttft_ms=1.0, total_ms=2.0,
            node="n1", instance="i1", slot=0, stop_reason="limit", tokens_generated=generated, relayed=1,
        )  # fmt: skip
        await self._bus.respond(msg, encode(result))
        self.answered += 1


async def ready_instance(bus: Bus, tmp_path: Path) -> Path:
    """A catalog model with one ready instance (its record in the instances bucket), so no placement is asked."""
    model = tiny_models.write_llama(tmp_path / "m.gguf")
    settings = ServingSettings(slots=1)
    record = InstanceStatus(
        id="i1", node="n1", reservation_id="r1", state="ready", port=1234, model_path=str(model),
        settings=Stamp(settings=settings, ctx=512, n_gpu_layers=0),
        predicted_memory=estimate(geometry_from_header(read_header(model)), settings, 512),
    )  # fmt: skip
    kv = await buckets.instances(bus, SUBJECTS)
    await kv.put(SUBJECTS.instance_key("n1", "i1"), encode(record))
    return model


@contextlib.asynccontextmanager
async def doors(bus: Bus, model: Path, count: int = 2) -> AsyncIterator[list[int]]:
    """`count` front doors on the bus, each its own node, serving catalog model `m`; yields their ports."""
    catalog = parse_catalog(f'[models.m]\npath = "{model}"\nctx = 512\nparallel = 1\ntimeout_s = 20\n')
    async with contextlib.AsyncExitStack() as stack:
        ports = []
        for i in range(count):
            port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            door = FrontDoorActor("127.0.0.1", 0, catalog, models_dir=model.parent, on_listening=port.set_result)
            await stack.enter_async_context(supervised(bus, [door], node_id=f"door-{'ab'[i]}"))
            async with asyncio.timeout(10):
                ports.append(await port)
        yield ports


def client(port: int, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30)


async def complete(port: int, key: str, prompt: str = "one two three", max_tokens: int = 2) -> Any:
    return await client(port, key).completions.create(model="m", prompt=prompt, max_tokens=max_tokens)
