"""Router actor (shell): `mesh.generate` on every node (queue group), forwarded to the chosen runner.

What it keeps, from the bus only (nothing a client says): the ready instances (`MESH_INSTANCES`) and those on their
way to ready (starting, or restarting after a crash), each node's serving report (`mesh.serving.<node>`: slots,
busy, queued, resident prefixes; not used once older than its TTL on this actor's clock), each node's L3 inventory
(`MESH_L3`) and the registry (for model names).

A request names a model by instance id, registry name, model path as placed, or a bare file name (with or without
`.gguf`). Only instances on nodes whose serving report is current are candidates (a node killed before it could
remove its records sends none). When none is ready but one of the model is starting (`place --start` answers then; a
crashed server restarting), the request waits for it within its own `timeout_s`, which the generation then has less
of; only when nothing of the model is on its way is the answer `no_instance` at once. With more than one candidate
and a text prompt, the prompt is tokenized once on one of them (a pass-through body is rendered by the instance:
`mesh.runner.<node>.render`), so prefixes can be compared; the runner then skips its own tokenization. Each
candidate is credited with the prefix it holds (`prefixes.Holdings`), `routing.choose` picks one, the decision is
journaled (`generate_routed`, replayable) and the request goes to `mesh.runner.<node>.generate` with the tokens and
the time spent here. When the chosen runner does not answer at all (no responders) or no longer has the instance,
nothing ran: the choice is made again without it (and journaled again). Any other error reply of the runner passes
through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Final

import msgspec
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from actors.frontdoor.keys import KeyTable, allows
from actors.router.links import LinkBook
from actors.router.prefixes import Holdings
from actors.router.routing import DEFAULT_WEIGHTS, ROUTER_VERSION, link_key, route
from messages.errors import (
    BAD_REQUEST,
    INVALID_API_KEY,
    MODEL_NOT_FOUND,
    NO_INSTANCE,
    NOT_FOUND,
    RATE_LIMITED,
    TIMEOUT,
    UNAVAILABLE,
)
from messages.events import GenerateRouted, LinkMeasured
from messages.generate import (
    GENERATING_ENDPOINTS,
    ApiCall,
    Candidate,
    GenerateRequest,
    GenerateResult,
    InstanceLoad,
    Render,
    RouteChoice,
    RouteWeights,
    RunnerGenerate,
    ServingReport,
    Tokenize,
    Tokens,
)
from messages.l3 import L3Inventory
from messages.registry import RegistryEntry
from messages.runner import InstanceStatus
from messages.tenants import TenantKey, cache_scope
from runtime import buckets, key_limits, tracing
from runtime.actor import Actor, ActorContext, RequestError, request_headers
from runtime.bus import BadMessage, NoResponders, PayloadTooLarge, RemoteError, RequestTimeout, decode_checked
from runtime.roles import requesting_client
from runtime.shared_limits import LimitsUnavailable, SharedLimits

__all__ = ["QUEUE_GROUP", "RouterActor"]

QUEUE_GROUP: Final = "generate"
MAX_CONCURRENT: Final = 256
#: Extra time a forwarded request waits beyond the generation's own timeout (the runner answers by then).
FORWARD_SLACK_S: Final = 5.0
#: The states of an instance on its way to ready: a request for its model waits for it.
ON_ITS_WAY: Final = frozenset({"starting", "restarting"})


class _NotThere(Exception):
    """The chosen instance did not run the request: its runner is gone, or it no longer has the instance."""

    def __init__(self, message: str, *, node_gone: bool) -> None:
        super().__init__(message)
        self.node_gone = node_gone


class RouterActor(Actor):
    name = "router"
    description = "mesh.generate: route a generation to the instance holding its prefix, traded against load"

    def __init__(
        self,
        weights: RouteWeights = DEFAULT_WEIGHTS,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        tokenize_timeout_s: float = 10.0,
    ) -> None:
        self.weights = weights
        self._monotonic = monotonic
        self._tokenize_timeout_s = tokenize_timeout_s
        self._instances: dict[str, InstanceStatus] = {}
        self._on_its_way: dict[str, InstanceStatus] = {}  # starting or restarting
        self._instances_changed = asyncio.Event()  # set (and replaced) on every change of either
        self._reports: dict[str, tuple[ServingReport, float]] = {}  # node -> (report, arrival)
        self._inventories: dict[str, L3Inventory] = {}
        self._inflight: dict[str, int] = {}
        self._holdings: Holdings | None = None  # rebuilt after any change of reports or inventories
        self._links = LinkBook()  # what handoffs between node pairs cost: results, probes
        self._keys = KeyTable()  # the tenants' keys: which key a `client` NATS user's requests are

    async def run(self, ctx: ActorContext) -> None:
        self._instances.clear()
        self._on_its_way.clear()
        self._reports.clear()
        self._inventories.clear()
        self._holdings = None
        self._keys.clear()
        keys_ready = asyncio.Event()
        keys = await buckets.keys(ctx.bus, ctx.subjects)
        ctx.spawn(
            buckets.watch_records(keys, keys_ready, TenantKey, lambda k: k.key_id, "tenant key", put=self._keys.put,
                                  spoil=self._keys.spoil, remove=self._keys.remove, log=ctx.log),
            "watch-keys",
        )  # fmt: skip
        # what a client user's key may still do (rpm, tpm, concurrency): the router's own count of the keys'
        # requests, beside this node's front door's (`-router`: a lease each)
        limits = SharedLimits(ctx.bus, ctx.subjects, f"{ctx.node_id}-router", log=ctx.log)
        ctx.spawn(limits.run(), "limits-flusher")
        instances = await buckets.instances(ctx.bus, ctx.subjects)
        inventories = await buckets.l3(ctx.bus, ctx.subjects)
        self._registry = await buckets.registry(ctx.bus, ctx.subjects)
        instances_ready, inventories_ready = asyncio.Event(), asyncio.Event()
        ctx.spawn(self._watch_instances(ctx, instances, instances_ready), "watch-instances")
        ctx.spawn(self._watch_inventories(ctx, inventories, inventories_ready), "watch-l3")
        await ctx.subscribe(ctx.subjects.serving_all, ServingReport, self._on_report)
        await ctx.subscribe(ctx.subjects.event("handoff", "link_measured", "*"), LinkMeasured, self._on_link)
        async with asyncio.timeout(10):
            await instances_ready.wait()
            await inventories_ready.wait()
            await keys_ready.wait()

        async def generate(request: GenerateRequest) -> GenerateResult:
            client = requesting_client(request_headers())
            key = self._keys.bound(client, time.time()) if client is not None else None
            asked = as_asked(request, client, key)
            if key is None or not key_limits.limited(key):
                return await self.generate(ctx, asked)
            await self._admit(limits, key)
            tokens = 0
            try:
                result = await self.generate(ctx, asked)
                tokens = result.prompt_tokens + result.tokens_generated
                return result
            finally:
                limits.release(key, tokens)

        await ctx.add_endpoint(
            "generate",
            ctx.subjects.generate,
            GenerateRequest,
            generate,
            queue_group=QUEUE_GROUP,
            workers=MAX_CONCURRENT,
            inbox=MAX_CONCURRENT * 4,
            deadline_s=3600.0 + 2 * FORWARD_SLACK_S,  # each request keeps its own `timeout_s`
        )
        await ctx.add_endpoint(  # this node's front door asks its own router (only this node may)
            "generate-own",
            ctx.subjects.router_generate(ctx.node_id),
            GenerateRequest,
            generate,
            workers=MAX_CONCURRENT,
            inbox=MAX_CONCURRENT * 4,
            deadline_s=3600.0 + 2 * FORWARD_SLACK_S,
        )

    @staticmethod
    async def _admit(limits: SharedLimits, key: TenantKey) -> None:
        """A client user's request counted against its key's limits, as a front door counts one."""
        try:
            refused = await limits.admit(key)
        except LimitsUnavailable as exc:
            raise RequestError(UNAVAILABLE, f"this key's limits cannot be checked now: {exc}") from exc
        if refused is not None:
            raise RequestError(
                RATE_LIMITED, refused.message, {"limit": refused.limit, "retry_after_s": refused.retry_after_s}
            )

    # --- views -------------------------------------------------------------------------------------------

    async def _watch_instances(self, ctx: ActorContext, kv: KeyValue, ready: asyncio.Event) -> None:
        async for entry in buckets.watch(kv, ready):
            instance_id = entry.key.rsplit(".", 1)[-1]  # keys are <node>.<instance id>
            self._instances.pop(instance_id, None)
            self._on_its_way.pop(instance_id, None)
            self._instances_changed.set()
            self._instances_changed = asyncio.Event()
            if buckets.removed(entry):
                continue
            try:
                status = buckets.decode_keyed(
                    entry, InstanceStatus, lambda s: ctx.subjects.instance_key(s.node, s.id), "instance"
                )
            except BadMessage as exc:
                ctx.log.warning("bad_instance_record", key=entry.key, error=str(exc))
                continue
            if status.state == "ready" and status.port is not None:
                self._instances[instance_id] = status
            elif status.state in ON_ITS_WAY:
                self._on_its_way[instance_id] = status

    async def _watch_inventories(self, ctx: ActorContext, kv: KeyValue, ready: asyncio.Event) -> None:
        async for entry in buckets.watch(kv, ready):
            self._holdings = None
            if buckets.removed(entry):
                self._inventories.pop(entry.key, None)
                continue
            try:
                inventory = buckets.decode_keyed(entry, L3Inventory, lambda i: i.node_id, "L3 inventory")
            except BadMessage as exc:
                ctx.log.warning("bad_l3_inventory", key=entry.key, error=str(exc))
                self._inventories.pop(entry.key, None)
                continue
            self._inventories[entry.key] = inventory

    async def _on_link(self, event: LinkMeasured, msg: Msg) -> None:
        """A probe's handoffs (the probing node sends, so it must be the event's node and its publisher)."""
        if event.src != event.node or msg.subject.rsplit(".", 1)[-1] != event.node:
            return
        self._links.observe_probe(link_key(event.src, event.dst), event.samples)

    async def _on_report(self, report: ServingReport, msg: Msg) -> None:
        node = msg.subject.rsplit(".", 1)[-1]
        if report.node_id != node:
            return  # a report must come from the node it names
        previous = self._reports.get(node)
        now = self._monotonic()
        # Late, while the report held is current. Once that one has expired, a lower number is a runner that started
        # again (it numbers from 1) whose first report this router missed: taken, or the node would stay unseen
        # until the new numbers passed the old (a minute after a restart in benchmarks/chaos.py).
        late = previous is not None and report.seq <= previous[0].seq and report.seq != 1
        if late and previous is not None and now - previous[1] <= previous[0].ttl_s:
            return
        self._reports[node] = (report, now)
        self._holdings = None

    def _fresh_nodes(self) -> set[str]:
        """The nodes whose last serving report is still current."""
        now = self._monotonic()
        return {node for node, (report, arrived) in self._reports.items() if now - arrived <= report.ttl_s}

    def _loads(self) -> dict[str, InstanceLoad]:
        """Every instance's last load report that is still current."""
        now = self._monotonic()
        loads = {}
        for report, arrived in self._reports.values():
            if now - arrived <= report.ttl_s:
                for load in report.instances:
                    loads[load.instance_id] = load
        return loads

    def _current_holdings(self, loads: dict[str, InstanceLoad]) -> Holdings:
        if self._holdings is None:
            holdings = Holdings()
            for load in loads.values():
                if load.identity is not None:
                    holdings.add_resident(load.instance_id, load.identity, load.resident)
            for node, inventory in self._inventories.items():
                holdings.add_stored(node, inventory.items)
            self._holdings = holdings
        return self._holdings

    # --- requests --------------------------------------------------------------------------------------------

    async def _candidates(self, request: GenerateRequest, pool: dict[str, InstanceStatus]) -> list[InstanceStatus]:
        """The instances of `pool` that may serve `request`: of its model and catalog entry, on a node whose
        serving report is current (one killed before it could remove its records may be dead: never scored, so
        it can never win a tie as "idle"), and not on a forced prefill node."""
        wanted = request.serves  # a catalog model's instances only (its settings and kind)
        fresh = self._fresh_nodes()
        matching = [
            s
            for s in await self._matching(request.model, list(pool.values()))
            if (wanted is None or wanted.met_by(s.settings.settings)) and s.node in fresh
        ]
        if request.prefill_node is not None and any(s.node != request.prefill_node for s in matching):
            # a forced disaggregated generation decodes elsewhere than where it prefills
            matching = [s for s in matching if s.node != request.prefill_node]
        return matching

    async def _ready_or_awaited(
        self, ctx: ActorContext, request: GenerateRequest, request_id: str
    ) -> tuple[list[InstanceStatus], float]:
        """The ready instances that may serve `request`; when there are none but one is on its way (starting,
        restarting), waits for it within the request's `timeout_s`. Returns them and the seconds waited (0: none)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + request.timeout_s
        waited = False
        while not (matching := await self._candidates(request, self._instances)):
            coming = await self._candidates(request, self._on_its_way)
            if not coming or loop.time() >= deadline:
                break
            waited = True
            ctx.log.info("generate_awaits_start", request_id=request_id, model=request.model,
                         instances=sorted(s.id for s in coming))  # fmt: skip
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._instances_changed.wait()
        return matching, loop.time() - start if waited else 0.0

    async def _matching(self, model: str, ready: list[InstanceStatus]) -> list[InstanceStatus]:
        by_id = [s for s in ready if s.id == model]
        if by_id:
            return by_id
        by_path = [s for s in ready if s.model_path == model]
        if by_path:
            return by_path
        file_name = await self._registry_file(model)
        if file_name is not None:
            named = [s for s in ready if s.model_path == file_name or PurePosixPath(s.model_path).name == file_name]
            if named:
                return named
        if "/" not in model:
            return [s for s in ready if model in (PurePosixPath(s.model_path).name, PurePosixPath(s.model_path).stem)]
        return []

    async def _registry_file(self, name: str) -> str | None:
        try:
            async with asyncio.timeout(2.0):
                entry = await self._registry.get(name)
        except Exception:  # no bucket, no key, a name nats-py refuses, a timeout: no registry entry
            return None
        if not entry.value:
            return None
        try:
            return decode_checked(entry.value, RegistryEntry, "registry entry").file_name
        except BadMessage:
            return None

    async def generate(self, ctx: ActorContext, request: GenerateRequest) -> GenerateResult:
        """One request routed, as the routing hop of its trace (the endpoint runs it within the trace context
        its requester sent, or a fresh one): the decision and the forwarded order carry it."""
        endpoint = request.api.endpoint if request.api is not None else None
        with tracing.hop(f"route {tracing.model_name(request.model)}") as span:
            span.update(tracing.request_attributes(endpoint, request.model))
            span.update({"mesh.node": ctx.node_id, "mesh.request_id": request.request_id or None})
            result = await self._generate(ctx, request, span)
            if span.recording:
                span.update(tracing.result_attributes(result))
            return result

    async def _generate(self, ctx: ActorContext, request: GenerateRequest, span: tracing.Hop) -> GenerateResult:
        started = time.perf_counter()
        if request.stream is None:  # without it, a requester that left would hold its slot to the timeout
            raise RequestError(
                BAD_REQUEST, "a generation names a `stream` subject (an inbox of yours that answers the runner's "
                "pings; chunks come there when `chunks` is true): how the mesh knows its requester still waits",
                {"path": "$.stream"},
            )  # fmt: skip
        request_id = request.request_id or uuid.uuid4().hex
        matching, waited_s = await self._ready_or_awaited(ctx, request, request_id)
        if matching and waited_s > 0:  # the generation has what is left of its time
            request = msgspec.structs.replace(request, timeout_s=max(request.timeout_s - waited_s, 0.001))
        loads = self._loads()
        tokens = request.prompt if isinstance(request.prompt, list) else None
        tokenized_by: str | None = None  # the model file whose tokenizer made `tokens` from the text
        if isinstance(request.prompt, str) and len(matching) > 1:
            tokens, tokenized_by = await self._tokenize(ctx, matching, request.prompt)
        elif request.api is not None and request.api.endpoint in GENERATING_ENDPOINTS and len(matching) > 1:
            tokens, tokenized_by = await self._render(ctx, matching, request.api)
        holdings = self._current_holdings(loads)
        hashes: dict[tuple[str, int], str] = {}
        candidates = []
        for status in sorted(matching, key=lambda s: s.id):
            load = loads.get(status.id)
            slots = load.slots if load else status.settings.settings.slots
            credit = None
            if tokens is not None and load is not None:
                credit = holdings.credit(
                    status.id, status.node, load.identity, tokens, max_tokens=len(tokens), cache=hashes
                )
            candidates.append(
                Candidate(
                    instance_id=status.id,
                    node=status.node,
                    slots=slots,
                    busy=load.busy if load else 0,
                    queued=load.queued if load else 0,
                    inflight=self._inflight.get(status.id, 0),
                    held_tokens=credit.n_tokens if credit else 0,
                    source=credit.source if credit else "cold",
                    held_node=credit.node if credit else None,
                    identity=load.identity if load else None,
                    prefill_tokens_per_s=load.prefill_tokens_per_s if load else 0.0,
                    state_bytes_per_token=load.state_bytes_per_token if load else 0.0,
                    state_floor_bytes=load.state_floor_bytes if load else 0.0,
                )
            )
        n_prompt = len(tokens) if tokens is not None else 0
        # (a scoped request's prompt is not prefilled elsewhere: its state would land in another node's store
        # under no scope of its own)
        fitted = (
            self._links.links(self._monotonic()) if request.prefill_node is None and not request.cache_scope else {}
        )
        links = {key: link.bytes_per_s for key, link in fitted.items()}
        fixed = {key: link.fixed_s for key, link in fitted.items()}
        while True:
            decision = route(n_prompt, candidates, self.weights, links, fixed)
            event = ctx.emit(
                GenerateRouted,
                request_id=request_id,
                model=request.model,
                n_prompt=n_prompt,
                candidates=tuple(candidates),
                weights=self.weights,
                decision=decision,
                router_version=ROUTER_VERSION,
                links=links,
                link_fixed_s=fixed,
            )
            span.update({"mesh.request_id": request_id, "mesh.route.decision_id": event.id,
                         "mesh.route.candidates": len(candidates), "mesh.route.chosen": decision.chosen,
                         "mesh.route.prefill_node": decision.prefill_node})  # fmt: skip
            if decision.chosen is None:
                why = f"no ready instance serves {request.model!r}"
                if waited_s > 0 and not matching:
                    why += f": none of those starting became ready within {waited_s:.3g}s"
                raise RequestError(NO_INSTANCE, why, {"model": request.model})
            chosen = next(c for c in candidates if c.instance_id == decision.chosen)
            span.update({"mesh.route.node": chosen.node, "mesh.route.source": chosen.source,
                         "mesh.route.held_tokens": chosen.held_tokens})  # fmt: skip
            chosen_path = (
                self._instances[chosen.instance_id].model_path if chosen.instance_id in self._instances else ""
            )
            forwarded = request
            if decision.prefill_node is not None and request.prefill_node is None:  # the cost model said it pays
                forwarded = msgspec.structs.replace(request, prefill_node=decision.prefill_node)
            order = RunnerGenerate(
                request=forwarded,
                request_id=request_id,
                instance_id=chosen.instance_id,
                tokens=tokens if tokenized_by is None or tokenized_by == chosen_path else None,
                route=RouteChoice(held_tokens=chosen.held_tokens, source=chosen.source, decision_id=event.id),
                routed_ms=(time.perf_counter() - started) * 1000,
            )
            try:
                return await self._forward(ctx, order, chosen, chose_prefill=forwarded is not request)
            except _NotThere as exc:  # nothing ran: the next candidate is asked (the choice journaled again)
                ctx.log.warning("generate_not_there", request_id=request_id, instance_id=chosen.instance_id,
                                node=chosen.node, error=str(exc))  # fmt: skip
                gone = {chosen.node} if exc.node_gone else set()
                candidates = [c for c in candidates if c.instance_id != chosen.instance_id and c.node not in gone]

    async def _forward(
        self, ctx: ActorContext, order: RunnerGenerate, chosen: Candidate, *, chose_prefill: bool
    ) -> GenerateResult:
        """The order to the chosen runner, its result or error passed on; `_NotThere` when it did not run.
        `chose_prefill`: routing chose the order's prefill node (a client's own choice is not rested)."""
        timeout_s = order.request.timeout_s
        self._inflight[chosen.instance_id] = self._inflight.get(chosen.instance_id, 0) + 1
        try:
            result = await ctx.bus.request(
                ctx.subjects.runner(chosen.node, "generate"), order, GenerateResult, timeout=timeout_s + FORWARD_SLACK_S
            )
            if result.path == "disaggregated" and result.prefill_node and result.handoff_ms > 0:
                key = link_key(result.prefill_node, result.node)
                self._links.observe_result(key, result.handoff_bytes, result.handoff_ms / 1000)
            planned = order.request.prefill_node
            if result.prefill_fallback and planned and chose_prefill:  # routing's choice failed: not again soon
                self._links.failed(link_key(planned, result.node), self._monotonic())
            return result
        except RemoteError as exc:
            if exc.reply.code == NOT_FOUND and exc.reply.details.get("instance_id") == chosen.instance_id:
                raise _NotThere(exc.reply.message, node_gone=False) from exc
            raise RequestError(exc.reply.code, exc.reply.message, exc.reply.details) from exc
        except NoResponders as exc:
            raise _NotThere(f"the runner of node {chosen.node} does not answer", node_gone=True) from exc
        except RequestTimeout as exc:
            raise RequestError(TIMEOUT, f"node {chosen.node} did not answer within {timeout_s:g}s") from exc
        except PayloadTooLarge as exc:
            raise RequestError(BAD_REQUEST, f"the prompt is too large for the bus: {exc}") from exc
        finally:
            left = self._inflight.get(chosen.instance_id, 1) - 1
            if left > 0:
                self._inflight[chosen.instance_id] = left
            else:
                self._inflight.pop(chosen.instance_id, None)

    async def _render(
        self, ctx: ActorContext, matching: list[InstanceStatus], call: ApiCall
    ) -> tuple[list[int] | None, str | None]:
        """A pass-through body's prompt tokens as one ready instance renders them, and the model file that did."""
        first = min(matching, key=lambda s: s.id)
        with contextlib.suppress(RemoteError, NoResponders, RequestTimeout, PayloadTooLarge):
            reply = await ctx.bus.request(
                ctx.subjects.runner(first.node, "render"),
                Render(instance_id=first.id, call=call),
                Tokens,
                timeout=self._tokenize_timeout_s,
            )
            return (reply.tokens or None), first.model_path
        return None, None

    async def _tokenize(
        self, ctx: ActorContext, matching: list[InstanceStatus], text: str
    ) -> tuple[list[int] | None, str | None]:
        """The prompt's tokens from one ready instance and the model file that made them (instances of one
        file tokenize alike), or (None, None)."""
        first = min(matching, key=lambda s: s.id)
        with contextlib.suppress(RemoteError, NoResponders, RequestTimeout, PayloadTooLarge):
            reply = await ctx.bus.request(
                ctx.subjects.runner(first.node, "tokenize"),
                Tokenize(instance_id=first.id, text=text),
                Tokens,
                timeout=self._tokenize_timeout_s,
            )
            return reply.tokens, first.model_path
        return None, None


def as_asked(request: GenerateRequest, client: str | None, key: TenantKey | None = None) -> GenerateRequest:
    """`request` as the mesh serves it. A `client` user's (nats-server names it, `client`) is its tenant key's,
    whatever it says: the key's tenant, class, share and cache scope; refused when the user is bound to no live
    key (`invalid_api_key`) or the key may not use the model the request names (`model_not_found`, as for an
    absent one). The mesh's own users (a front door, which set them from the request's key; an admin) are taken
    at their word."""
    if client is None:
        return request
    if key is None:
        raise RequestError(
            INVALID_API_KEY, f"the NATS user {client[:64]} is bound to no tenant key: an admin binds it with "
            "`mesh-actor keys issue --tenant T --client-user USER`",
        )  # fmt: skip
    if not allows(key, request.model):
        raise RequestError(MODEL_NOT_FOUND, f"the model {request.model[:256]!r} does not exist", {"model": "?"})
    return msgspec.structs.replace(
        request, tenant=key.tenant, priority=key.priority, weight=key.weight, cache_scope=cache_scope(key)
    )
