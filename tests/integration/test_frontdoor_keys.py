"""Tenants' API keys at real front doors (issue 20): two front door actors on one real nats-server, the keys
bucket written as `mesh-actor keys` writes it, and a router played by a responder that answers a chat.

With the official `openai` client: a scoped key lists and uses only its models (any other is answered exactly
as an absent one), malformed, unknown, wrong-secret and expired keys are 401 in OpenAI's shape (Anthropic's on
`/v1/messages`), a key revoked through one door is refused by the other within a second, `/metrics` and the
dashboard are the admin key's, and hostile headers and forged records change nothing but what they name.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
from aiohttp import web
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from actors.frontdoor.actor import FrontDoorActor
from actors.frontdoor.catalog import parse_catalog
from actors.frontdoor.keys import format_key, secret_digest
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.generate import RELAY_HEADER, RELAY_SEQ_HEADER, GenerateRequest, GenerateResult, RelayHead
from messages.placement import Stamp
from messages.runner import InstanceStatus
from messages.settings import ServingSettings
from messages.subjects import Subjects
from messages.tenants import TenantKey
from runtime import buckets
from runtime.bus import Bus, encode
from tests import tiny_models
from tests.conftest import supervised

pytestmark = pytest.mark.timeout(90)
SUBJECTS = Subjects()
ADMIN = "the-admin-key"
ANSWER = b'{"id":"c1","object":"chat.completion","created":0,"model":"a.gguf","choices":[{"index":0,' \
         b'"message":{"role":"assistant","content":"hello from a"},"finish_reason":"stop"}],' \
         b'"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}'  # fmt: skip


class Keys:
    """The keys bucket, written as `mesh-actor keys` writes it."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self._n = 0

    async def issue(self, tenant: str = "lab", **fields: Any) -> tuple[str, TenantKey]:
        self._n += 1
        key_id, secret = f"{self._n:016x}", f"{self._n:064x}"
        record = msgspec.convert({"key_id": key_id, "tenant": tenant, "secret_sha256": secret_digest(secret),
                                  "created_at": time.time(), **fields}, TenantKey)  # fmt: skip
        await self.kv.put(key_id, encode(record))
        return format_key(key_id, secret), record


class Mesh:
    def __init__(self, bus: Bus, keys: Keys, ports: list[int], seen: list[GenerateRequest]) -> None:
        self.bus = bus
        self.keys = keys
        self.ports = ports
        self.seen = seen

    def api(self, key: str, door: int = 0) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.ports[door]}/v1", api_key=key, max_retries=0, timeout=20
        )

    async def raw(self, method: str, path: str, door: int = 0, **kwargs: Any) -> tuple[int, Any]:
        url = f"http://127.0.0.1:{self.ports[door]}{path}"
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session,
            session.request(method, url, **kwargs) as reply,
        ):
            try:
                return reply.status, await reply.json(content_type=None)
            except ValueError:
                return reply.status, await reply.text()


#: How long a key's change may take to reach a door: milliseconds (a watch), with room for a loaded machine.
REVOKED_WITHIN_S = 5.0


async def _router(bus: Bus, seen: list[GenerateRequest], msg: Msg) -> None:
    """The mesh's router and runner in one: the request is relayed to the model's server, which answers `ANSWER`."""
    request = msgspec.json.decode(msg.data, type=GenerateRequest)
    seen.append(request)
    assert request.stream is not None
    head = RelayHead(status=200, content_type="application/json")
    await bus.nc.publish(request.stream, encode(head), headers={RELAY_HEADER: "head"})
    await bus.nc.publish(request.stream, ANSWER, headers={RELAY_HEADER: "data", RELAY_SEQ_HEADER: "0"})
    result = GenerateResult(
        request_id=request.request_id or "r", text="", tokens=[], prompt_tokens=3, source="cold", tokens_restored=0,
        tokens_cached=0, tokens_evaluated=3, ttft_ms=1.0, total_ms=1.0, node="n1", instance="i1", slot=0,
        stop_reason="eos", relayed=1,
    )  # fmt: skip
    await bus.respond(msg, encode(result))


@contextlib.asynccontextmanager
async def mesh(bus: Bus, tmp_path: Path, admin: str | None = ADMIN, doors: int = 2) -> AsyncIterator[Mesh]:
    """Front doors serving catalog models `a` (running: an instance is ready) and `b` (never loaded here)."""
    a, b = tiny_models.write_llama(tmp_path / "a.gguf"), tiny_models.write_llama(tmp_path / "b.gguf", n_layer=3)
    catalog = parse_catalog(
        f'[models.a]\npath = "{a}"\nctx = 512\nparallel = 1\ntimeout_s = 5\n'
        f'[models.b]\npath = "{b}"\nctx = 512\nparallel = 1\ntimeout_s = 5\n'
    )
    settings = ServingSettings(slots=1)
    record = InstanceStatus(
        id="i1", node="n1", reservation_id="r1", state="ready", port=1234, model_path=str(a),
        settings=Stamp(settings=settings, ctx=512, n_gpu_layers=0),
        predicted_memory=estimate(geometry_from_header(read_header(a)), settings, 512),
    )  # fmt: skip
    await (await buckets.instances(bus, SUBJECTS)).put(SUBJECTS.instance_key("n1", "i1"), encode(record))
    keys = Keys(await buckets.keys(bus, SUBJECTS))
    seen: list[GenerateRequest] = []

    async def router(msg: Msg) -> None:
        await _router(bus, seen, msg)

    async def metrics(accept: str | None) -> tuple[bytes, str]:
        return b"mesh_up 1\n", "text/plain; version=0.0.4"

    def dashboard(app: web.Application) -> str:
        async def page(request: web.Request) -> web.Response:
            return web.Response(text="the dashboard")

        app.router.add_get("/ui", page)
        return "/ui"

    sub = await bus.nc.subscribe(SUBJECTS.generate, cb=router)
    loop = asyncio.get_running_loop()
    bound: list[asyncio.Future[int]] = [loop.create_future() for _ in range(doors)]
    actors = [
        FrontDoorActor("127.0.0.1", 0, catalog, models_dir=tmp_path, api_key=admin, on_listening=port.set_result,
                       metrics=metrics, dashboard=dashboard)
        for port in bound
    ]  # fmt: skip
    try:
        async with contextlib.AsyncExitStack() as stack:
            for i, actor in enumerate(actors):  # each door on a node of its own
                await stack.enter_async_context(supervised(bus, [actor], node_id=f"door{i}"))
            async with asyncio.timeout(15):
                ports = [await port for port in bound]
            yield Mesh(bus, keys, ports, seen)
    finally:
        await sub.unsubscribe()


def chat(api: openai.AsyncOpenAI, model: str) -> Any:
    return api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)


async def test_a_scoped_key_lists_and_uses_only_its_models_and_another_is_answered_as_absent(
    bus: Bus, tmp_path: Path
) -> None:
    async with mesh(bus, tmp_path) as m:
        scoped, _ = await m.keys.issue(models=["a"])
        everything, _ = await m.keys.issue("ops")
        api = m.api(scoped)
        assert [model.id for model in (await api.models.list()).data] == ["a"]
        assert sorted(model.id for model in (await m.api(everything).models.list()).data) == ["a", "b"]
        assert sorted(model.id for model in (await m.api(ADMIN).models.list()).data) == ["a", "b"]
        assert (await api.models.retrieve("a")).id == "a"
        answer = await chat(api, "a")
        assert answer.choices[0].message.content == "hello from a" and answer.model == "a"
        assert len(m.seen) == 1
        for call in (lambda name: api.models.retrieve(name), lambda name: chat(api, name)):
            with pytest.raises(openai.NotFoundError) as hidden:
                await call("b")
            with pytest.raises(openai.NotFoundError) as absent:
                await call("zzz")
            assert hidden.value.code == absent.value.code == "model_not_found"
            expected = dict(absent.value.body)  # type: ignore[call-overload]
            expected["message"] = expected["message"].replace("'zzz'", "'b'")
            assert hidden.value.body == expected
        assert len(m.seen) == 1  # nothing of b's reached the mesh
        # every way of presenting the key: x-api-key, and the Bearer scheme in any case
        for headers in ({"x-api-key": scoped}, {"Authorization": f"bEaReR {scoped}"}):
            status, listed = await m.raw("GET", "/v1/models", headers=headers)
            assert status == 200 and [x["id"] for x in listed["data"]] == ["a"], listed
        # Anthropic's shape on its endpoint: b is absent there too
        body = {"model": "b", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        status, error = await m.raw("POST", "/v1/messages", headers={"x-api-key": scoped}, json=body)
        assert status == 404 and error["type"] == "error" and error["error"]["type"] == "not_found_error", error
        # the other door follows the same bucket
        assert [model.id for model in (await m.api(scoped, door=1).models.list()).data] == ["a"]


async def test_malformed_unknown_wrong_secret_and_expired_keys_are_401_in_openais_shape(
    bus: Bus, tmp_path: Path
) -> None:
    async with mesh(bus, tmp_path) as m:
        good, record = await m.keys.issue()
        expired, _ = await m.keys.issue(expires_at=time.time() - 1)
        presented = {
            "malformed": "mk_not-a-key",
            "unknown": format_key("f" * 16, "0" * 64),
            "wrong secret": format_key(record.key_id, "e" * 64),
            "expired": expired,
        }
        for what, key in presented.items():
            with pytest.raises(openai.AuthenticationError) as refused:
                await m.api(key).models.list()
            assert refused.value.status_code == 401, what
            error = refused.value.body
            assert isinstance(error, dict) and error["code"] == "invalid_api_key", (what, error)
            assert error["type"] == "authentication_error" and set(error) >= {"message", "type", "param", "code"}
            assert key not in error["message"] and record.secret_sha256 not in error["message"]
            with pytest.raises(openai.AuthenticationError):
                await chat(m.api(key), "a")
        assert len(m.seen) == 0
        status, error = await m.raw("GET", "/v1/models")  # no key at all
        assert status == 401 and error["error"]["code"] == "invalid_api_key", error
        body = {"model": "a", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        status, error = await m.raw("POST", "/v1/messages", headers={"x-api-key": presented["expired"]}, json=body)
        expected = {"type": "error", "error": {"type": "authentication_error", "message": "the API key has expired"}}
        assert status == 401 and error == expected, error
        assert (await chat(m.api(good), "a")).choices  # and the good key still works


async def test_a_key_revoked_through_one_door_is_refused_by_the_other_within_a_second(bus: Bus, tmp_path: Path) -> None:
    async with mesh(bus, tmp_path) as m:
        key, record = await m.keys.issue(models=["a"])
        other, _ = await m.keys.issue("other")
        assert (await chat(m.api(key, door=1), "a")).choices
        await m.keys.kv.delete(record.key_id)
        revoked_at = time.monotonic()
        # the watch delivers it in milliseconds; the deadline leaves room for a loaded machine (CI on 2 cores),
        # and stays far below what an expiry would take (records have no TTL: only the watch can do it)
        async with asyncio.timeout(REVOKED_WITHIN_S):
            while True:
                status, error = await m.raw("GET", "/v1/models", door=1, headers={"Authorization": f"Bearer {key}"})
                if status == 401:
                    break
                assert status == 200
                await asyncio.sleep(0.02)
        refused_after = time.monotonic() - revoked_at
        assert refused_after < REVOKED_WITHIN_S and error["error"]["code"] == "invalid_api_key"
        for door in (0, 1):
            with pytest.raises(openai.AuthenticationError):
                await chat(m.api(key, door=door), "a")
            assert (await chat(m.api(other, door=door), "a")).choices  # the other tenant is untouched


async def test_metrics_and_the_dashboard_are_the_admin_keys(bus: Bus, tmp_path: Path) -> None:
    async with mesh(bus, tmp_path, doors=1) as m:
        key, _ = await m.keys.issue()
        async with asyncio.timeout(REVOKED_WITHIN_S):  # the door's watch has the new key
            while (await m.raw("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"}))[0] != 200:
                await asyncio.sleep(0.02)
        status, error = await m.raw("GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
        assert status == 401 and "admin key" in error["error"]["message"], error
        status, text = await m.raw("GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        assert status == 200 and "mesh_up 1" in text
        # with an admin key the dashboard checks it itself (here a stand-in page that checks nothing)
        assert (await m.raw("GET", "/ui"))[0] == 200
    async with mesh(bus, tmp_path, admin=None, doors=1) as m:  # no admin key; the bucket still holds `key`
        for headers in ({}, {"Authorization": f"Bearer {key}"}):
            status, error = await m.raw("GET", "/ui", headers=headers)
            assert status == 401 and "admin key" in error["error"]["message"], error
            assert (await m.raw("GET", "/metrics", headers=headers))[0] == 401
        assert (await m.raw("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"}))[0] == 200


async def test_a_door_without_keys_is_open_closes_with_the_first_key_and_refuses_a_revoked_one(
    bus: Bus, tmp_path: Path
) -> None:
    async with mesh(bus, tmp_path, admin=None, doors=1) as m:
        anonymous = m.api("sk-no-key-required")  # what clients send to a door without keys
        assert len((await anonymous.models.list()).data) == 2
        key, record = await m.keys.issue(models=["a"])
        async with asyncio.timeout(REVOKED_WITHIN_S):
            while (await m.raw("GET", "/v1/models"))[0] != 401:
                await asyncio.sleep(0.02)
        with pytest.raises(openai.AuthenticationError):
            await anonymous.models.list()
        assert [x.id for x in (await m.api(key).models.list()).data] == ["a"]
        await m.keys.kv.delete(record.key_id)
        async with asyncio.timeout(REVOKED_WITHIN_S):
            while (await m.raw("GET", "/v1/models"))[0] != 200:
                await asyncio.sleep(0.02)
        with pytest.raises(openai.AuthenticationError):  # open again, yet a revoked key is not served as no key
            await m.api(key).models.list()


async def test_hostile_headers_and_forged_records_change_nothing_but_what_they_name(bus: Bus, tmp_path: Path) -> None:
    async with mesh(bus, tmp_path, doors=1) as m:
        good, _ = await m.keys.issue(models=["a"])
        status, _ = await m.raw("GET", "/v1/models", headers={"Authorization": "Bearer " + "k" * 200_000})
        assert status in (400, 431)  # refused by the HTTP parser itself
        for key in (
            "k" * 4000,
            "mk_" + "é" * 16 + "_" + "0" * 64,
            "mk_<script>",
            "mk_" + "Z" * 16 + "_" + "0" * 64,
            good + "x",
            good.upper(),
        ):
            status, error = await m.raw("GET", "/v1/models", headers={"x-api-key": key})
            assert status == 401 and error["error"]["code"] == "invalid_api_key", (key[:20], error)
        # forged records: not JSON, a valid record stored under another key id, a schema violation
        forged_key, forged = await m.keys.issue("mallory")
        await m.keys.kv.put("aaaaaaaaaaaaaaaa", b"{not json")
        await m.keys.kv.put("bbbbbbbbbbbbbbbb", encode(forged))  # claims to be another key
        await m.keys.kv.put(forged.key_id, msgspec.json.encode({**msgspec.to_builtins(forged), "priority": 99}))
        copied = format_key("bbbbbbbbbbbbbbbb", forged_key.rsplit("_", 1)[1])
        async with asyncio.timeout(2.0):  # the spoiled record stops the key it replaced
            while (await m.raw("GET", "/v1/models", headers={"x-api-key": forged_key}))[0] != 401:
                await asyncio.sleep(0.02)
        assert (await m.raw("GET", "/v1/models", headers={"x-api-key": copied}))[0] == 401
        assert [x.id for x in (await m.api(good).models.list()).data] == ["a"]  # the door kept serving
        assert (await chat(m.api(good), "a")).choices
