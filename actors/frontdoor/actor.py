"""Front door (shell): an OpenAI-compatible HTTP server on the node (aiohttp), over `mesh.generate`.

`GET /v1/models` lists the catalog (`models.toml`); `POST /v1/completions` and `POST /v1/chat/completions`
answer whole or streamed (server-sent events in OpenAI's chunk format, then `data: [DONE]`), with `usage`
(prompt, completion and cached tokens). A chat is rendered by the model's own llama-server
(`mesh.runner.<node>.template`); every generation goes through `mesh.generate`, so routing, L3 restore and
capture apply. A client that disconnects stops its generation (the handler is cancelled, the stream's
subscription goes, the runner's next ping finds nobody).

Models on demand: a request for a catalog model without a ready instance waits (at most `max_queue` per model,
beyond that 429) while one start is in flight for that model: placement is asked (with the model's required
serving settings: slots, cache types, flash attention, speculation); when it refuses for memory,
`lifecycle.plan_room` says which instances to stop (they are stopped, and placement is asked again), to wait
for busy ones, or that the model never fits (507 at once, with need and have). Instances of catalog models
with an `idle_ttl_s` stop when idle that long. Every completion is captured into L3 after its reply (the
runner does it), so a stopped model resumes from its states when it is loaded again. Requests for one model
are grouped while a swap is pending (`lifecycle`); `group_swaps=False` serves them in arrival order instead,
the behaviour grouping is measured against (`benchmarks/frontdoor_swap.py`).

Keys: with `api_key` set, every request needs `Authorization: Bearer <key>` (401 otherwise); the launcher
refuses a non-loopback address without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import msgspec
from aiohttp import web
from nats.js.kv import KeyValue

from actors.frontdoor import openai_api as oa
from actors.frontdoor.catalog import Catalog, CatalogModel
from actors.frontdoor.lifecycle import ArrivalOrder, NeverFits, Running, Stop, Wait, idle_expired, plan_room
from actors.placement.ledger import device_sizes
from actors.runner.records import TTL_HEADER
from messages.errors import BAD_REQUEST, NO_INSTANCE, TIMEOUT
from messages.events import IdleStopped, ModelLoaded, ModelLoading, ModelRefused, RoomMade
from messages.frontdoor import FrontDoorModel, FrontDoorReport, ModelState
from messages.generate import ApplyTemplate, ChatTurn, GenerateChunk, GenerateResult, Prompt
from messages.placement import ModelRef, NodeLedger, PlacementDecision, PlacementRequest
from messages.runner import InstanceStatus, RunnerAck, StartInstance, StopInstance
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.actor import Actor, ActorContext
from runtime.bus import BadMessage, BusError, RemoteError
from runtime.generate_client import StreamGap, generate
from runtime.model_files import ModelFileError, resolve

__all__ = ["FrontDoorActor"]

MAX_BODY_BYTES: Final = 8 << 20
_STATUS_OF_CODE: Final = {BAD_REQUEST: 400, NO_INSTANCE: 503, TIMEOUT: 504, "busy": 429, "unavailable": 503}


class _Model:
    """One catalog model's requests on this front door."""

    def __init__(self, name: str, entry: CatalogModel) -> None:
        self.name = name
        self.entry = entry
        self.waiting = 0  # requests waiting for an instance
        self.held = 0  # requests held back behind earlier ones for other models (grouping off)
        self.active = 0  # requests generating
        self.starting: asyncio.Task[InstanceStatus] | None = None
        self.last_used = 0.0


class FrontDoorActor(Actor):
    name = "frontdoor"
    description = "OpenAI-compatible HTTP front door over mesh.generate, with models loaded on demand"

    def __init__(
        self,
        host: str,
        port: int,
        catalog: Catalog,
        *,
        models_dir: Path,
        api_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        min_idle_s: float = 1.0,
        group_swaps: bool = True,
        on_listening: Callable[[int], None] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.catalog = catalog
        self.models_dir = models_dir
        self.api_key = api_key
        self._clock = clock
        # Grouping off: no grace for the model just used, and requests in arrival order across models.
        self._min_idle_s = min_idle_s if group_swaps else 0.0
        self._order = None if group_swaps else ArrivalOrder()
        self._order_moved = asyncio.Event()
        self._on_listening = on_listening
        self._models = {name: _Model(name, entry) for name, entry in catalog.models.items()}
        self._instances: dict[str, InstanceStatus] = {}
        self._instance_used: dict[str, float] = {}
        self._starts: set[asyncio.Task[InstanceStatus]] = set()  # shared by a model's waiters; cancelled at the end
        self.bound_port: int | None = None

    # --- lifetime ----------------------------------------------------------------------------------------

    async def run(self, ctx: ActorContext) -> None:
        self._ctx = ctx
        self._instances.clear()
        kv = await buckets.instances(ctx.bus, ctx.subjects)
        ready = asyncio.Event()
        ctx.spawn(self._watch_instances(ctx, kv, ready), "watch-instances")
        async with asyncio.timeout(10):
            await ready.wait()
        runner = web.AppRunner(self._app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, shutdown_timeout=5.0)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.port
        ctx.log.info("frontdoor_listening", host=self.host, port=self.bound_port, models=sorted(self._models))
        if self._on_listening is not None:
            self._on_listening(self.bound_port)
        ctx.spawn(self._serve_until_stopped(runner), "http")
        ctx.spawn(self._stop_idle(ctx), "idle")
        self._reports = await buckets.frontdoors(ctx.bus, ctx.subjects)
        ctx.spawn(self._publish_reports(ctx), "reports")

    async def _serve_until_stopped(self, runner: web.AppRunner) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            for task in self._starts:
                task.cancel()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await runner.cleanup()

    async def _watch_instances(self, ctx: ActorContext, kv: KeyValue, ready: asyncio.Event) -> None:
        async for entry in buckets.watch(kv, ready):
            if buckets.removed(entry):
                self._instances.pop(entry.key, None)
                continue
            try:
                self._instances[entry.key] = buckets.decode_keyed(
                    entry, InstanceStatus, lambda s: ctx.subjects.instance_key(s.node, s.id), "instance"
                )
            except BadMessage as exc:
                ctx.log.warning("bad_instance_record", key=entry.key, error=str(exc))
                self._instances.pop(entry.key, None)

    # --- HTTP ----------------------------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
                raise oa.ApiError(401, "a valid API key is required (Authorization: Bearer …)", "authentication_error",
                                  code="invalid_api_key")  # fmt: skip
            return await handler(request)
        except oa.ApiError as exc:
            return web.json_response(oa.error_body(exc), status=exc.status)
        except web.HTTPRequestEntityTooLarge:
            error = oa.ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
            return web.json_response(oa.error_body(error), status=413)
        except web.HTTPException as exc:
            error = oa.ApiError(exc.status, exc.reason or "HTTP error", "invalid_request_error")
            return web.json_response(oa.error_body(error), status=exc.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise  # the client went away: its generation stops with this handler
        except Exception as exc:  # a bug met by one request: that request fails, the front door keeps serving
            self._ctx.log.exception("frontdoor_request_failed", path=request.path, error=repr(exc))
            error = oa.ApiError(500, f"the front door failed: {exc!r}", "server_error")
            return web.json_response(oa.error_body(error), status=500)

    async def _list_models(self, request: web.Request) -> web.Response:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "mesh-actor",
             "state": "ready" if self._ready_of(m) else "starting" if m.starting else "stopped",
             "queued": m.waiting + m.held, "pinned": m.entry.pinned}
            for name, m in sorted(self._models.items())
        ]  # fmt: skip
        return web.json_response({"object": "list", "data": data})

    async def _body(self, request: web.Request, kind: type[Any]) -> Any:
        return oa.decode(await request.read(), kind)  # an oversize body raises 413 (answered by `_errors`)

    def _model(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            raise oa.ApiError(404, f"the model {name!r} does not exist (see /v1/models)", param="model",
                              code="model_not_found")  # fmt: skip
        return model

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body: oa.CompletionRequest = await self._body(request, oa.CompletionRequest)
        prompt: str | list[int]
        if isinstance(body.prompt, str):
            prompt = body.prompt
        elif all(isinstance(t, int) for t in body.prompt):
            prompt = [int(t) for t in body.prompt]
        elif len(body.prompt) == 1 and isinstance(body.prompt[0], str):
            prompt = body.prompt[0]
        else:
            raise oa.ApiError(400, "the prompt is a text, a list of one text, or a list of token ids", param="prompt")
        if not prompt:
            raise oa.ApiError(400, "the prompt is empty", param="prompt")
        model = self._model(body.model)
        return await self._generate(request, model, body, lambda instance: _given(prompt), chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body: oa.ChatRequest = await self._body(request, oa.ChatRequest)
        model = self._model(body.model)
        turns = [ChatTurn(role=m["role"], content=m["content"]) for m in oa.chat_messages(body)]  # type: ignore[arg-type]

        async def render(instance: InstanceStatus) -> str:
            try:
                reply = await self._ctx.bus.request(
                    self._ctx.subjects.runner(instance.node, "template"),
                    ApplyTemplate(instance_id=instance.id, messages=turns),
                    Prompt,
                    timeout=30,
                )
            except RemoteError as exc:
                status = _STATUS_OF_CODE.get(exc.reply.code, 502)
                raise oa.ApiError(status, exc.reply.message, code=exc.reply.code) from exc
            except BusError as exc:
                raise oa.ApiError(503, f"cannot render the chat: {exc}", "server_error") from exc
            return reply.prompt

        return await self._generate(request, model, body, render, chat=True)

    async def _generate(
        self,
        request: web.Request,
        model: _Model,
        body: oa.CompletionRequest | oa.ChatRequest,
        make_prompt: Callable[[InstanceStatus], Awaitable[str | list[int]]],
        *,
        chat: bool,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + model.entry.timeout_s
        instance = await self._instance_for(model, deadline)
        prompt = await make_prompt(instance)
        request_id = uuid.uuid4().hex
        remaining = max(1.0, deadline - loop.time())
        order = oa.to_generate(body, prompt, timeout_s=remaining, request_id=request_id)
        order = msgspec.structs.replace(order, model=instance.model_path)  # any instance of this file
        created = int(time.time())
        model.active += 1
        try:
            if not body.stream:
                result = await self._mesh(order, None)
                shape = oa.chat_completion if chat else oa.completion
                return web.json_response(shape(result, model=model.name, created=created))
            return await self._stream(request, model, body, order, created, chat=chat)
        finally:
            model.active -= 1
            model.last_used = self._clock()
            self._instance_used[instance.id] = model.last_used

    async def _mesh(self, order: Any, on_chunk: Callable[[GenerateChunk], Awaitable[None]] | None) -> GenerateResult:
        try:
            return await generate(self._ctx.bus, self._ctx.subjects, order, on_chunk)
        except RemoteError as exc:
            status = _STATUS_OF_CODE.get(exc.reply.code, 502)
            raise oa.ApiError(status, exc.reply.message, "server_error" if status >= 500 else "invalid_request_error",
                              code=exc.reply.code) from exc  # fmt: skip
        except (BusError, StreamGap) as exc:
            raise oa.ApiError(503, f"the mesh did not answer: {exc}", "server_error") from exc

    async def _stream(
        self, request: web.Request, model: _Model, body: Any, order: Any, created: int, *, chat: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        rid = order.request_id

        async def send(payload: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        if chat:
            await send(oa.chat_chunk(rid, model=model.name, created=created, delta={"role": "assistant"}, finish=None))

        async def on_chunk(chunk: GenerateChunk) -> None:
            if not chunk.text:
                return
            if chat:
                await send(oa.chat_chunk(rid, model=model.name, created=created, delta={"content": chunk.text},
                                         finish=None))  # fmt: skip
            else:
                await send(oa.completion_chunk(rid, model=model.name, created=created, text=chunk.text, finish=None))

        try:
            result = await self._mesh(order, on_chunk)
        except oa.ApiError as exc:  # the stream has begun: the error goes in it
            await send(oa.error_body(exc))
            await response.write(b"data: [DONE]\n\n")
            return response
        finish = oa.finish_reason(result)
        if chat:
            await send(oa.chat_chunk(rid, model=model.name, created=created, delta={}, finish=finish))
        else:
            await send(oa.completion_chunk(rid, model=model.name, created=created, text="", finish=finish))
        if body.stream_options is not None and body.stream_options.include_usage:
            shape = oa.chat_chunk if chat else oa.completion_chunk
            extra: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
            await send(shape(rid, model=model.name, created=created, finish=None, usage_=oa.usage(result), **extra))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # --- models on demand ----------------------------------------------------------------------------------

    def _path_of(self, entry: CatalogModel) -> str | None:
        if entry.registry:
            return None
        try:
            return str(resolve(entry.path, self.models_dir))
        except ModelFileError:
            return None

    def _ready_of(self, model: _Model) -> InstanceStatus | None:
        path = self._path_of(model.entry)
        for status in sorted(self._instances.values(), key=lambda s: s.id):
            if status.state == "ready" and status.port is not None and _same_model(status, model.entry, path):
                return status
        return None

    async def _instance_for(self, model: _Model, deadline: float) -> InstanceStatus:
        if self._order is None:
            return await self._grouped(model, deadline)
        if model.waiting + model.held >= model.entry.max_queue:
            raise _queue_full(model)
        ticket = self._order.arrive(model.name)
        model.held += 1
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    while not self._order.may_go(ticket):
                        moved = self._order_moved
                        await moved.wait()
            except TimeoutError as exc:
                raise _load_timeout(model) from exc
            finally:
                model.held -= 1  # from here it waits like any request (and keeps its model's instance in use)
            return await self._grouped(model, deadline, queued=True)
        finally:
            self._order.leave(ticket)
            self._order_moved.set()  # wake the waiters to look again
            self._order_moved = asyncio.Event()

    async def _grouped(self, model: _Model, deadline: float, *, queued: bool = False) -> InstanceStatus:
        """A ready instance of `model`, after waiting with its other requests for the one start in flight."""
        ready = self._ready_of(model)
        if ready is not None:
            return ready
        if not queued and model.waiting >= model.entry.max_queue:
            raise _queue_full(model)
        model.waiting += 1
        try:
            while True:
                ready = self._ready_of(model)
                if ready is not None:
                    return ready
                if model.starting is None or model.starting.done():
                    self._ctx.emit(ModelLoading, model=model.name, waiting=model.waiting)
                    model.starting = asyncio.get_running_loop().create_task(self._start(model, deadline))
                    self._starts.add(model.starting)
                    model.starting.add_done_callback(self._starts.discard)
                    model.starting.add_done_callback(_retrieve)
                try:
                    async with asyncio.timeout_at(deadline):
                        return await asyncio.shield(model.starting)
                except TimeoutError as exc:
                    raise _load_timeout(model) from exc
        finally:
            model.waiting -= 1

    async def _start(self, model: _Model, deadline: float) -> InstanceStatus:
        """Places and starts one instance of `model`, making room when memory is short."""
        ctx = self._ctx
        entry = model.entry
        ref = ModelRef(registry=entry.path) if entry.registry else ModelRef(path=self._path_of(entry) or entry.path)
        placement = PlacementRequest(
            model=ref, ctx=entry.ctx, settings=entry.required_settings(), request_id=f"frontdoor-{model.name}"
        )
        loop = asyncio.get_running_loop()
        began = loop.time()
        while loop.time() < deadline:
            try:
                decision = await ctx.bus.request(
                    ctx.subjects.placement_request, placement, PlacementDecision, timeout=30
                )
            except (RemoteError, BusError) as exc:
                raise oa.ApiError(503, f"placement did not answer: {exc}", "server_error") from exc
            if decision.admitted and decision.reservation_id and decision.placements:
                node = decision.placements[0].node_id
                try:
                    ack = await ctx.bus.request(
                        ctx.subjects.runner(node, "start"),
                        StartInstance(reservation_id=decision.reservation_id),
                        RunnerAck,
                        timeout=60,
                    )
                except (RemoteError, BusError) as exc:
                    raise oa.ApiError(503, f"the start on {node} failed: {exc}", "server_error") from exc
                ready = await self._until_ready(ack.instance_id, deadline)
                load_ms = (loop.time() - began) * 1000
                ctx.emit(ModelLoaded, model=model.name, instance_id=ready.id, instance_node=ready.node, load_ms=load_ms)
                return ready
            shortfalls = {
                r.node_id: r.shortfalls
                for r in decision.rejections
                if r.reason == "insufficient_memory" and r.shortfalls
            }
            if not shortfalls:
                ctx.emit(ModelRefused, model=model.name, reason=f"{decision.reason}: {decision.message}")
                raise oa.ApiError(503, f"{model.name!r} cannot be placed: {decision.reason}: {decision.message}",
                                  "server_error", code=str(decision.reason))  # fmt: skip
            running = await self._running()
            sizes = await self._sizes()
            plan = plan_room(shortfalls, running, now=self._clock(), min_idle_s=self._min_idle_s, sizes=sizes)
            ctx.log.info(
                "frontdoor_room", model=model.name, plan=msgspec.to_builtins(plan),
                shortfalls=msgspec.to_builtins(shortfalls), running=msgspec.to_builtins(running),
            )  # fmt: skip
            if isinstance(plan, NeverFits):
                ctx.emit(
                    ModelRefused, model=model.name, reason="never_fits", need_bytes=plan.need, have_bytes=plan.have
                )
                raise oa.ApiError(
                    507, f"{model.name!r} never fits: it needs {plan.need} bytes and at most {plan.have} can be "
                    f"freed on {plan.node}", "insufficient_memory", code="insufficient_memory",
                    extra={"need_bytes": plan.need, "have_bytes": plan.have, "node": plan.node},
                )  # fmt: skip
            if isinstance(plan, Stop):
                ctx.log.info("frontdoor_making_room", model=model.name, node=plan.node, stopping=plan.instances)
                await asyncio.gather(*(self._stop_instance(i) for i in plan.instances))
                ctx.emit(RoomMade, model=model.name, stopped_on=plan.node, stopped=plan.instances, frees=plan.frees)
            elif isinstance(plan, Wait):
                await asyncio.sleep(0.2)
        raise oa.ApiError(504, f"{model.name!r} did not load in {entry.timeout_s:g}s", "server_error", code="timeout")

    async def _until_ready(self, instance_id: str, deadline: float) -> InstanceStatus:
        async with asyncio.timeout_at(deadline):
            while True:
                status = self._by_id(instance_id)
                if status is not None and status.state == "ready" and status.port is not None:
                    return status
                if status is not None and status.state in ("failed", "rejected", "stopped"):
                    raise oa.ApiError(503, f"instance {instance_id} ended {status.state}: {status.message}",
                                      "server_error")  # fmt: skip
                await asyncio.sleep(0.05)

    def _by_id(self, instance_id: str) -> InstanceStatus | None:
        return next((s for s in self._instances.values() if s.id == instance_id), None)

    async def _stop_instance(self, instance_id: str) -> None:
        status = self._by_id(instance_id)
        if status is None:
            return
        with contextlib.suppress(RemoteError, BusError):
            await self._ctx.bus.request(
                self._ctx.subjects.runner(status.node, "stop"), StopInstance(instance_id=instance_id), RunnerAck,
                timeout=35,
            )  # fmt: skip

    async def _sizes(self) -> dict[str, dict[str, int]]:
        """Each live node's device sizes, capped by its memory limit (from its telemetry)."""
        nodes, _ = await buckets.read_all(self._ctx.bus, self._ctx.subjects.nodes_bucket, NodeResources)
        return {n.node_id: {d: size for d, (size, _) in device_sizes(n).items()} for _, n in nodes}

    async def _running(self) -> list[Running]:
        """Every live instance with what its reservation holds, and what this front door knows of its use."""
        held: dict[str, dict[str, int]] = {}
        running = []
        records, _ = await buckets.read_all(self._ctx.bus, self._ctx.subjects.reservations_bucket, NodeLedger)
        live = {s.id for s in self._instances.values()}
        for _, ledger in records:
            for r in ledger.reservations:
                if r.instance_id is not None and r.instance_id in live:
                    held[r.instance_id] = dict(r.held)
                else:  # booked, its instance not started (or not seen) yet: it will be stoppable once it runs
                    running.append(
                        Running(
                            instance_id=f"reservation:{r.reservation_id}", node=r.node_id, model=None,
                            held=dict(r.held), last_used=self._clock(), in_use=True,
                        )
                    )  # fmt: skip
        for status in self._instances.values():
            if status.state in ("stopped", "failed", "rejected") and status.id not in held:
                continue  # ended, and its memory released
            model = next((m for m in self._models.values() if _same_model(status, m.entry, self._path_of(m.entry))),
                         None)  # fmt: skip
            running.append(
                Running(
                    instance_id=status.id,
                    node=status.node,
                    model=model.name if model else None,
                    held=held.get(status.id, {}),
                    last_used=self._instance_used.get(status.id, 0.0),
                    priority=model.entry.priority if model else 0,
                    pinned=model.entry.pinned if model else True,  # not ours: never stopped by us
                    in_use=bool(model and (model.active or model.waiting)) or status.state != "ready",
                    idle_ttl_s=model.entry.idle_ttl_s if model else None,
                )
            )
        return running

    def report(self, node_id: str) -> FrontDoorReport:
        models = []
        for name, m in sorted(self._models.items()):
            path = self._path_of(m.entry)
            ready = [s for s in self._instances.values() if s.state == "ready" and _same_model(s, m.entry, path)]
            held = sum(s.observed_memory.total_bytes if s.observed_memory else s.predicted_memory.total_bytes
                       for s in ready)  # fmt: skip
            state: ModelState = "ready" if ready else "starting" if m.starting and not m.starting.done() else "stopped"
            models.append(
                FrontDoorModel(
                    name=name, path=m.entry.path, state=state, instances=tuple(sorted(s.id for s in ready)),
                    held_bytes=held, queued=m.waiting + m.held, active=m.active, pinned=m.entry.pinned,
                    priority=m.entry.priority, idle_ttl_s=m.entry.idle_ttl_s, ctx=m.entry.ctx,
                    max_queue=m.entry.max_queue, settings=m.entry.required_settings(),
                )
            )  # fmt: skip
        return FrontDoorReport(
            node_id=node_id,
            address=f"http://{self.host}:{self.bound_port}",
            auth=self.api_key is not None,
            models=tuple(models),
            sent_at=time.time(),
        )

    async def _publish_reports(self, ctx: ActorContext) -> None:
        """This front door's report under the node's key: within a second of a change, and every 10 s."""
        last = b""
        since = -1e9
        while True:
            report = self.report(ctx.node_id)
            unchanged = msgspec.json.encode(msgspec.structs.replace(report, sent_at=0.0))
            now = self._clock()
            if unchanged != last or now - since > 10:
                with contextlib.suppress(Exception):  # NATS away: the next pass writes it
                    await ctx.bus.js.publish(
                        f"$KV.{ctx.subjects.frontdoors_bucket}.{ctx.node_id}", msgspec.json.encode(report),
                        timeout=5, headers={TTL_HEADER: "30s"},
                    )  # fmt: skip
                    last, since = unchanged, now
            await asyncio.sleep(1.0)

    async def _stop_idle(self, ctx: ActorContext) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                running = await self._running()
            except (BusError, Exception) as exc:  # a bucket read failing skips one pass
                ctx.log.warning("frontdoor_idle_check_failed", error=repr(exc))
                continue
            now = self._clock()
            by_id = {r.instance_id: r for r in running}
            for instance_id in idle_expired(running, now=now):
                idle = by_id[instance_id]
                ctx.log.info("frontdoor_idle_stop", instance_id=instance_id)
                await self._stop_instance(instance_id)
                ctx.emit(IdleStopped, model=idle.model, instance_id=instance_id, idle_s=now - idle.last_used)


def _same_model(status: InstanceStatus, entry: CatalogModel, path: str | None) -> bool:
    """Whether `status` is an instance of the catalog model: its file, run with the settings it requires."""
    if not entry.runs_on(status.settings.settings):
        return False
    if path is not None:
        return status.model_path == path
    return Path(status.model_path).name == entry.path or Path(status.model_path).stem == entry.path


def _queue_full(model: _Model) -> oa.ApiError:
    return oa.ApiError(429, f"{model.waiting + model.held} requests already wait for {model.name!r}; retry",
                       "rate_limit_error", code="queue_full")  # fmt: skip


def _load_timeout(model: _Model) -> oa.ApiError:
    return oa.ApiError(504, f"{model.name!r} did not load in {model.entry.timeout_s:g}s", "server_error",
                       code="timeout")  # fmt: skip


async def _given(prompt: str | list[int]) -> str | list[int]:
    return prompt


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a start nobody waits for any more must not warn when it failed
