"""Front door (shell): an OpenAI-compatible HTTP server on the node (aiohttp), over `mesh.generate`.

`GET /v1/models` lists the catalog (`models.toml`); `POST /v1/completions` and `POST /v1/chat/completions`
answer whole or streamed (server-sent events in OpenAI's chunk format, then `data: [DONE]`), with `usage`
(prompt, completion and cached tokens). A chat is rendered by the model's own llama-server
(`mesh.runner.<node>.template`); every generation goes through `mesh.generate`, so routing, L3 restore and
capture apply. A client that disconnects stops its generation (the handler is cancelled, the stream's
subscription goes, the runner's next ping finds nobody).

Models on demand and replicas are `ondemand`'s (a part the actor holds, `demand`: one start per model, room made by
`ondemand_rules`, idle stops, the scaler's additions and retirements); an answer is relayed by `relay`. Every
completion is captured into L3 after its reply (the runner does it), so a stopped model resumes from its states
when it is loaded again. Requests for one model are grouped while a swap is pending (`ondemand_rules`);
`group_swaps=False` serves them in arrival order instead, the behaviour grouping is measured against
(`benchmarks/frontdoor_swap.py`).

Keys (`keys`, issue 20): `api_key` is the node's admin key, which opens everything; tenants' keys come from the
keys bucket (followed by a watch: an issued or revoked key takes effect as the watch delivers it, within
milliseconds on every node). With an admin key set or any record in the bucket, every request needs a key
(`Authorization: Bearer <key>` or `x-api-key`; 401 in the endpoint's error shape otherwise); with neither, the
door is open as before (the launcher refuses a non-loopback address without an admin key). A tenant key sees and
uses only its models: `/v1/models` lists those, and any other model is answered exactly as an absent one (404
`model_not_found`). The record of the request's key is `request[TENANT_KEY]` (None: the admin key, or an open
door). `GET /metrics` (with `metrics`: the node's metrics actor's exposition) answers the node's Prometheus
metrics to the admin key only (a tenant key: 401). With `dashboard` (the dashboard actor's `register`), `/ui`
is the dashboard's, which checks the admin key itself (a browser also holds it as a cookie); a door with
tenant keys and no admin key keeps the dashboard shut (401), since no key may open it.

Limits and usage (`accounting`, issue 20): a tenant key's rpm, tpm and max_concurrent are admitted once the
request's model is known (before any instance is waited for or loaded) against a record every front door shares
(`runtime.shared_limits`): a refusal is 429 `rate_limit_exceeded` naming the limit, with Retry-After; a limits
store out of reach is 503. Every API request journals one `request_usage` event (tenant, model, status, tokens,
duration).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
from aiohttp import web
from nats.js.kv import KeyValue

from actors.frontdoor import shapes
from actors.frontdoor.accounting import Accounting
from actors.frontdoor.catalog import Catalog
from actors.frontdoor.keys import KeyRefused, KeyTable, allows, authenticate
from actors.frontdoor.ondemand import ModelDemand, ModelsOnDemand
from actors.frontdoor.relay import Relay, bus_failure, error_response
from actors.runner import passthrough
from messages.errors import (
    BAD_REQUEST,
    INTERNAL,
    INVALID_API_KEY,
    MODEL_NOT_FOUND,
    REQUEST_TOO_LARGE,
    UNAVAILABLE,
    UNKNOWN_ENDPOINT,
)
from messages.frontdoor import FrontDoorReport
from messages.generate import MAX_API_BODY_BYTES, ApiCall, GenerateRequest, GenerateResult
from messages.runner import MAX_MODEL_INFO_BYTES, InstanceStatus
from messages.tenants import TenantKey, cache_scope
from runtime import buckets, tracing
from runtime.actor import Actor, ActorContext
from runtime.buckets import TTL_HEADER
from runtime.bus import BusError, RemoteError
from runtime.generate_client import StreamGap, forward_until_taken

__all__ = ["TENANT_KEY", "FrontDoorActor"]

T = TypeVar("T")

#: How long a connection may stay idle, or take to send a request's head, before it is closed.
KEEPALIVE_TIMEOUT_S: Final = 20.0
#: How long a request's body may take to arrive once its head has (and its key was checked).
BODY_TIMEOUT_S: Final = 30.0
#: Where a request holds the record of the tenant key it presented (`request[TENANT_KEY]`): a `TenantKey`, or
#: None for the admin key (and on an open door): every model, no tenant's limits.
TENANT_KEY: Final = web.RequestKey[TenantKey | None]("tenant_key")


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
        wall_clock: Callable[[], float] = time.time,
        min_idle_s: float = 1.0,
        group_swaps: bool = True,
        on_listening: Callable[[int], None] | None = None,
        metrics: Callable[[str | None], Awaitable[tuple[bytes, str]]] | None = None,
        dashboard: Callable[[web.Application], str] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.api_key = api_key
        self.demand = ModelsOnDemand(catalog, models_dir, clock=clock, group_swaps=group_swaps, min_idle_s=min_idle_s)
        self._clock = clock
        self._wall_clock = wall_clock  # keys expire at a unix time
        self._keys = KeyTable()
        self._on_listening = on_listening
        self._metrics = metrics  # the node's metrics, in the format a scraper's Accept header asks for
        self._dashboard = dashboard  # adds its routes; answers the path under which it checks keys itself
        self._dashboard_prefix: str | None = None
        self.bound_port: int | None = None

    # --- lifetime ----------------------------------------------------------------------------------------

    async def run(self, ctx: ActorContext) -> None:
        self._ctx = ctx
        ready = await self.demand.follow(ctx)
        self._keys.clear()
        keys_ready = asyncio.Event()
        ctx.spawn(self._watch_keys(ctx, await buckets.keys(ctx.bus, ctx.subjects), keys_ready), "watch-keys")
        self._accounting = Accounting(ctx.bus, ctx.subjects, ctx.node_id, emit=ctx.emit, log=ctx.log)
        ctx.spawn(self._accounting.run(), "limits")
        async with asyncio.timeout(10):  # never listen before the keys are known: an open door would let all in
            await ready.wait()
            await keys_ready.wait()
        # keepalive_timeout also bounds a new connection that never completes its request's head
        runner = web.AppRunner(
            self._app(), handler_cancellation=True, access_log=None, keepalive_timeout=KEEPALIVE_TIMEOUT_S,
            shutdown_timeout=5.0,
        )  # fmt: skip
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.port
        ctx.log.info("frontdoor_listening", host=self.host, port=self.bound_port, models=sorted(self.demand.models))
        if self._on_listening is not None:
            self._on_listening(self.bound_port)
        ctx.spawn(self._serve_until_stopped(runner), "http")
        self._reports = await buckets.frontdoors(ctx.bus, ctx.subjects)
        ctx.spawn(self._publish_reports(ctx), "reports")
        await self.demand.keep(ctx, self._reports)

    async def _serve_until_stopped(self, runner: web.AppRunner) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.demand.cancel_starts()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await runner.cleanup()

    async def _watch_keys(self, ctx: ActorContext, kv: KeyValue, ready: asyncio.Event) -> None:
        """The tenants' keys as the bucket holds them. A record that does not decode, or names another key id
        than the one it is stored under, is logged and opens nothing (it still closes an open door)."""
        table = self._keys
        await buckets.watch_records(kv, ready, TenantKey, lambda k: k.key_id, "tenant key", put=table.put,
                                    spoil=table.spoil, remove=table.remove, log=ctx.log)  # fmt: skip

    # --- HTTP ----------------------------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body, middlewares=[self._errors])
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/v1/models/{name}", self._get_model)
        for path in shapes.ENDPOINTS:
            app.router.add_post(path, self._api)
        if self._metrics is not None:
            app.router.add_get("/metrics", self._serve_metrics)
        if self._dashboard is not None:
            self._dashboard_prefix = self._dashboard(app)
        return app

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        assert self._metrics is not None
        body, content_type = await self._metrics(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    @property
    def _max_body(self) -> int:
        """The largest body the front door takes: what a pass-through request can carry over the bus."""
        bus = getattr(getattr(self, "_ctx", None), "bus", None)
        room = bus.max_payload - _ENVELOPE_BYTES if bus is not None else MAX_API_BODY_BYTES
        return max(1024, min(MAX_API_BODY_BYTES, room))

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        shape = shapes.shape_of(request.path)
        try:
            request[TENANT_KEY] = self._authorize(request)
            return await handler(request)
        except shapes.ApiError as exc:
            return error_response(exc, shape)
        except web.HTTPRequestEntityTooLarge:
            error = shapes.ApiError(REQUEST_TOO_LARGE, f"the body is over {self._max_body} bytes")
            return error_response(error, shape)
        except web.HTTPNotFound:
            return error_response(shapes.ApiError(UNKNOWN_ENDPOINT, f"no endpoint {request.path}"), shape)
        except web.HTTPMethodNotAllowed:
            error = shapes.ApiError(BAD_REQUEST, f"{request.method} is not allowed on {request.path}")
            return error_response(error, shape, status=405)
        except web.HTTPException as exc:
            return error_response(shapes.ApiError(BAD_REQUEST, exc.reason or "HTTP error"), shape, status=exc.status)
        except ConnectionResetError:
            raise  # the client went away: its generation stops with this handler
        except asyncio.CancelledError:
            if _being_cancelled():
                raise  # the client went away (or the door closes): its generation stops with this handler
            # a task this request waited on was cancelled under it (a shared start, a bus call): the client gets
            # an answer it can retry on, not a connection closed without one
            self._ctx.log.warning("frontdoor_request_lost_its_work", path=request.path)
            return error_response(shapes.ApiError(UNAVAILABLE, "the work this request waited on was cancelled"), shape)
        except Exception as exc:  # a bug met by one request: that request fails, the front door keeps serving
            self._ctx.log.exception("frontdoor_request_failed", path=request.path, error=repr(exc))
            return error_response(shapes.ApiError(INTERNAL, "the front door failed on this request"), shape)

    def _authorize(self, request: web.Request) -> TenantKey | None:
        """The record of the tenant key `request` presents; None for the admin key or an open door (and on the
        dashboard's paths, where the dashboard checks the admin key itself)."""
        if self._dashboards(request.path):
            if self.api_key is None and self._keys.holds_any:
                raise shapes.ApiError(INVALID_API_KEY, "the dashboard needs the node's admin key (--api-key): this "
                                      "node has none, and tenant keys do not open it")  # fmt: skip
            return None
        try:
            tenant = authenticate(
                shapes.presented_key(request.headers), admin_key=self.api_key, table=self._keys,
                now=self._wall_clock(),
            )  # fmt: skip
        except KeyRefused as exc:
            self._ctx.log.info("frontdoor_key_refused", reason=exc.reason, key_id=exc.key_id, path=request.path)
            raise shapes.ApiError(INVALID_API_KEY, str(exc)) from exc
        if tenant is not None and request.path == "/metrics":
            raise shapes.ApiError(INVALID_API_KEY, "/metrics needs the node's admin key: a tenant key does not open it")
        return tenant

    def _dashboards(self, path: str) -> bool:
        """Whether `path` is the dashboard's (which checks the key itself: a header, or its session cookie)."""
        prefix = self._dashboard_prefix
        return prefix is not None and (path == prefix or path.startswith(prefix + "/"))

    def _model_object(self, name: str, m: ModelDemand) -> dict[str, Any]:
        ready = self.demand.ready_of(m)
        # the catalog's kind, else what the running instance was stamped with (read from the model's header)
        kind = m.entry.kind or (ready.settings.settings.kind if ready is not None else None)
        described = {"id": name, "object": "model", "created": 0, "owned_by": "mesh-actor",
                     "state": "ready" if ready else "starting" if m.starting else "stopped",
                     "queued": m.waiting + m.held, "pinned": m.entry.pinned, "kind": kind}  # fmt: skip
        return {**described, **_server_said(ready)}

    async def _list_models(self, request: web.Request) -> web.Response:
        tenant = request.get(TENANT_KEY)
        data = [self._model_object(name, m) for name, m in sorted(self.demand.models.items()) if allows(tenant, name)]
        return web.json_response({"object": "list", "data": data})

    async def _get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        return web.json_response(self._model_object(name, self._model(name, request)))

    def _model(self, name: str, request: web.Request) -> ModelDemand:
        """The catalog model `name`, if the request's key may see it; else exactly the answer for no such model."""
        model = self.demand.models.get(name)
        if model is None or not allows(request.get(TENANT_KEY), name):
            raise shapes.ApiError(MODEL_NOT_FOUND, f"the model {name!r} does not exist (see /v1/models)",
                                  param="model")  # fmt: skip
        return model

    async def _api(self, request: web.Request) -> web.StreamResponse:
        """One of llama-server's endpoints, within the request's trace (its `traceparent` header, or a fresh
        trace): the front door's hop, whose context the mesh carries to every hop after it."""
        endpoint = shapes.ENDPOINTS[request.path]
        operation = tracing.operation(endpoint)
        with tracing.use(tracing.incoming(request.headers)), tracing.hop(operation) as span:
            span.update(
                {"http.request.method": request.method, "url.path": request.path, "mesh.node": self._ctx.node_id}
            )
            passing = self._pass_through(request, endpoint, span)
            response = await self._accounting.account(request, request.get(TENANT_KEY), endpoint, passing)
            span.update({"http.response.status_code": response.status})
            return response

    async def _pass_through(self, request: web.Request, endpoint: str, span: tracing.Hop) -> web.StreamResponse:
        """The client's body goes through the mesh to an instance of the model, and the server's answer comes
        back as it sent it (its model named as the client named it)."""
        shape = shapes.shape_of(request.path)
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                raw = await request.read()  # over the limit: 413 (answered by `_errors`)
        except TimeoutError as exc:
            raise shapes.ApiError(BAD_REQUEST, f"the body did not arrive within {BODY_TIMEOUT_S:g}s") from exc
        try:
            body = passthrough.decode_body(raw)
        except ValueError as exc:
            raise shapes.ApiError(BAD_REQUEST, str(exc)) from exc
        name = body.get("model")
        if not isinstance(name, str) or not name or len(name) > MAX_MODEL_NAME:
            raise shapes.ApiError(BAD_REQUEST, "`model` is required: a model of /v1/models", param="model")
        span.rename(f"{tracing.operation(endpoint)} {name}")
        span.update(tracing.request_attributes(endpoint, name))
        await self._accounting.admit(request, name)  # the key's limits (429 or 503 here): a 404 counts too
        model = self._model(name, request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + model.entry.timeout_s
        request_class = _request_class(request.get(TENANT_KEY))
        instance = await self.demand.instance_for(model, deadline, request_class)
        order = GenerateRequest(
            model=instance.model_path,  # any instance of this file that serves this catalog model:
            serves=model.entry.served_as(self.demand.kind_of(model)),
            api=ApiCall(endpoint=endpoint, body=msgspec.Raw(raw)),  # type: ignore[arg-type]
            timeout_s=max(1.0, deadline - loop.time()),
            request_id=uuid.uuid4().hex,
            **_queue_claim(request.get(TENANT_KEY)),
        )
        relay = Relay(request, name, shape)
        with self.demand.in_use(model, instance, request_class):
            span.update({"mesh.request_id": order.request_id})
            try:
                # A client that leaves is charged what the server did all the same (the runner says what)
                charge = functools.partial(self._accounting.answered, request)
                result = await self._forward(order, relay, deadline, charge)
                self._accounting.answered(request, result)
                if span.recording:
                    span.update(tracing.result_attributes(result))
            except RemoteError as exc:
                error = shapes.ApiError(exc.reply.code, exc.reply.message)
                return await relay.failed(error)
            except BusError as exc:
                error = shapes.ApiError(UNAVAILABLE, f"the mesh did not carry the answer: {bus_failure(exc)}")
                return await relay.failed(error)
            except StreamGap as exc:
                error = shapes.ApiError(UNAVAILABLE, f"the mesh did not carry the answer: {exc}")
                return await relay.failed(error)
            return await relay.finish()

    async def _forward(
        self, order: GenerateRequest, relay: Relay, deadline: float, on_gone: Callable[[GenerateResult], None]
    ) -> GenerateResult:
        """`order` through this node's own router first, asked again while an answer says nothing ran (this door
        saw the instance ready: a router whose watch has not yet says `no_instance` for a moment)."""
        own = self._ctx.subjects.router_generate(self._ctx.node_id)
        return await forward_until_taken(
            self._ctx.bus, self._ctx.subjects, order, relay.head, relay.data, deadline=deadline, own_router=own,
            on_gone=on_gone,
        )  # fmt: skip

    def report(self, node_id: str) -> FrontDoorReport:
        return FrontDoorReport(
            node_id=node_id,
            address=f"http://{self.host}:{self.bound_port}",
            auth=self.api_key is not None or self._keys.holds_any,
            models=self.demand.report(),
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


#: The longest model name a request may give (a catalog name; what the journal records of a refused one).
MAX_MODEL_NAME: Final = 256

#: What a pass-through request adds around the client's body on the bus (its fields and headers).
_ENVELOPE_BYTES: Final = 8 << 10


#: What a model's object takes of its instance's own `/v1/models` entry (the server's words, as it said them):
#: its figures (`meta`: n_ctx of a slot, n_vocab, n_ctx_train, n_embd, n_params, size, …) and modalities. Not
#: its id or aliases: those name the server's file, and a client knows the model by its catalog name.
_FROM_THE_SERVER: Final = ("meta", "architecture", "tags")


def _server_said(ready: InstanceStatus | None) -> dict[str, Any]:
    """The fields of `_FROM_THE_SERVER` its ready instance's record carries (a record any node writes: read
    bounded: one over `MAX_MODEL_INFO_BYTES` is left out)."""
    entry = ready.model_info if ready is not None else None
    if not entry or len(msgspec.json.encode(entry)) > MAX_MODEL_INFO_BYTES:
        return {}
    said: dict[str, Any] = {field: entry[field] for field in _FROM_THE_SERVER if field in entry}
    return {**said, "aliases": []}


def _request_class(key: TenantKey | None) -> int:
    """A request's class: its tenant key's priority (the admin key, an open door: the default class, 0)."""
    return key.priority if key is not None else 0


def _queue_claim(key: TenantKey | None) -> dict[str, Any]:
    """Who a request is in its instance's queue: its key's tenant, class and share (the admin key, an open door:
    nobody's, the default class)."""
    if key is None:
        return {}
    return {"tenant": key.tenant, "priority": key.priority, "weight": key.weight, "cache_scope": cache_scope(key)}


def _being_cancelled() -> bool:
    """Whether the running task itself is asked to stop (not merely handed a CancelledError from what it awaited)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0
