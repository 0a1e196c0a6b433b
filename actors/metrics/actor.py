"""Metrics actor (shell): the node's Prometheus metrics, folded from what the mesh already publishes.

What it follows, all of it this node's own (so that each node's scrape counts each event once):

* the journal's live subjects of this node (`<prefix>.events.*.*.<node>`), decoded as events;
* the runner's serving reports (`<prefix>.serving.<node>`);
* this node's keys of the buckets, watched (never polled): its instance records (`<node>.*` of the instances
  bucket), its reservation ledger, its telemetry, its L3 inventory and its front door's report.

All of it goes into `fold.NodeMetrics` (pure). When scraped (`exposition`), it asks each ready instance's
llama-server for its own `/metrics` (loopback, in parallel, each under `engine_timeout_s`; one that does not answer
is `mesh_engine_metrics_up 0`), relabels those (`engine.relabel`) and renders everything in the format the scraper
asks for (`Accept`: Prometheus text or OpenMetrics, by prometheus-client's own encoders). Nothing happens per token:
the serving path only records the events it always did.

Where it is served: `GET /metrics` on the front door's listener (`--http`, which calls `exposition`), and, with
`listen` (`mesh-actor run --metrics HOST:PORT`), on a listener of its own that serves only `/metrics`. Either one
requires the node's API key when one is set (`Authorization: Bearer KEY`, what Prometheus sends with its scrape
config's `authorization`); the launcher refuses an address beyond loopback without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, cast

import aiohttp
import msgspec
from aiohttp import web
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from actors.frontdoor import shapes
from actors.metrics.engine import relabel
from actors.metrics.fold import EVENT_TYPES, EngineTarget, NodeMetrics
from actors.runner.command import LOOPBACK
from messages.errors import INVALID_API_KEY
from messages.events import AnyEvent, Event
from messages.frontdoor import FrontDoorReport
from messages.generate import ServingReport
from messages.l3 import L3Inventory
from messages.placement import LEDGER_KEY_PREFIX, NodeLedger
from messages.runner import InstanceStatus
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.actor import Actor, ActorContext
from runtime.bus import BadMessage, decode_checked

__all__ = ["MetricsActor"]

#: The largest `/metrics` answer read from one llama-server (its own is a few kilobytes).
MAX_ENGINE_BYTES: Final = 1 << 20
#: How long the watches may take to deliver the current records before the actor counts as failed to start.
READY_S: Final = 10.0
KEEPALIVE_TIMEOUT_S: Final = 20.0
_EVENTS = cast(type[Event], AnyEvent)  # a tagged union decodes as any of its members


class _Snapshot(Collector):
    """The families of one scrape, as prometheus-client's encoders read a registry."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


class MetricsActor(Actor):
    name = "metrics"
    description = "Prometheus metrics of this node, from its events, records, serving reports and llama-servers"

    def __init__(
        self,
        node_id: str,
        *,
        listen: tuple[str, int] | None = None,
        api_key: str | None = None,
        engine_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_listening: Callable[[int], None] | None = None,
    ) -> None:
        self.core = NodeMetrics(node_id)  # kept across incarnations: counters survive an actor restart
        self.listen = listen
        self.api_key = api_key
        self.engine_timeout_s = engine_timeout_s
        self._clock = clock
        self._on_listening = on_listening
        self.bound_port: int | None = None
        self._log: Any = None
        self._seen_instances: set[str] | None = None  # the records a starting incarnation's watch delivered

    async def run(self, ctx: ActorContext) -> None:
        self._log = ctx.log
        node, subjects = ctx.node_id, ctx.subjects
        # Taken raw: only the types that change a figure are decoded (the subject names the type).
        await ctx.subscribe(subjects.events_from(node), msgspec.Raw, self._on_event)
        await ctx.subscribe(subjects.usage_from(node), msgspec.Raw, self._on_event)  # the private ones
        await ctx.subscribe(subjects.serving(node), ServingReport, self._on_serving)
        core = self.core
        # What the watches' first values do not name went while nobody watched (an earlier incarnation's view).
        self._seen_instances = set()
        for clear in (core.ledger, core.telemetry, core.l3, core.frontdoor):
            clear(None)
        follows: list[tuple[KeyValue, str, Callable[[str, bytes | None], None]]] = [
            (await buckets.instances(ctx.bus, subjects), subjects.instance_key(node, "*"), self._on_instance),
            (await buckets.reservations(ctx.bus, subjects), f"{LEDGER_KEY_PREFIX}{node}",
             _record(NodeLedger, "ledger", core.ledger)),
            (await buckets.nodes(ctx.bus, subjects), node, _record(NodeResources, "telemetry", core.telemetry)),
            (await buckets.l3(ctx.bus, subjects), node, _record(L3Inventory, "L3 inventory", core.l3)),
            (await buckets.frontdoors(ctx.bus, subjects), node, _record(FrontDoorReport, "front door", core.frontdoor)),
        ]  # fmt: skip
        ready = [asyncio.Event() for _ in follows]
        for (kv, key, apply), done in zip(follows, ready, strict=True):
            ctx.spawn(self._follow(ctx, kv, key, done, apply), f"watch:{key}")
        async with asyncio.timeout(READY_S):
            for done in ready:
                await done.wait()
        core.keep_instances(self._seen_instances)
        self._seen_instances = None
        if self.listen is not None:
            await self._listen(ctx, *self.listen)

    # --- what it follows -----------------------------------------------------------------------------------

    async def _on_event(self, raw: msgspec.Raw, msg: Msg) -> None:
        if msg.subject.rsplit(".", 2)[-2] not in EVENT_TYPES:  # <prefix>.events.<actor>.<type>.<node>
            return
        try:
            event = decode_checked(bytes(raw), _EVENTS, f"event on {msg.subject!r}")
        except BadMessage as exc:
            self._log.warning("metrics_bad_event", subject=msg.subject, error=str(exc))
            return
        self.core.event(event)

    async def _on_serving(self, report: ServingReport, msg: Msg) -> None:
        self.core.serving(report, self._clock())

    def _on_instance(self, key: str, value: bytes | None) -> None:
        instance_id = key.split(".", 1)[1]
        if value is None:
            self.core.instance_removed(instance_id)
            return
        status = decode_checked(value, InstanceStatus, f"instance {key}")
        if f"{status.node}.{status.id}" != key:
            raise BadMessage(f"instance under key {key}", f"claims to be {status.node}.{status.id}")
        self.core.instance_record(status)
        if self._seen_instances is not None:
            self._seen_instances.add(status.id)

    async def _follow(
        self,
        ctx: ActorContext,
        kv: KeyValue,
        key: str,
        ready: asyncio.Event,
        apply: Callable[[str, bytes | None], None],
    ) -> None:
        async for entry in buckets.watch(kv, ready, key=key):
            try:
                apply(entry.key, None if buckets.removed(entry) else entry.value)
            except BadMessage as exc:  # a record that does not decode is left out, not taken as the truth
                ctx.log.warning("metrics_bad_record", key=entry.key, error=str(exc))

    # --- being scraped ---------------------------------------------------------------------------------------

    async def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The node's metrics in the format `accept` prefers (Prometheus text unless it asks for OpenMetrics), and
        that format's content type."""
        targets = self.core.engine_targets()
        scraped = await self._scrape(targets) if targets else {}
        families = self.core.families(self._clock(), scraped)
        encoder, content_type = choose_encoder(accept or "")
        return encoder(_Snapshot(families)), content_type

    async def _scrape(self, targets: Sequence[EngineTarget]) -> dict[str, list[Metric] | None]:
        timeout = aiohttp.ClientTimeout(total=self.engine_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            answers = await asyncio.gather(*(self._engine(session, t) for t in targets))
        return {t.instance_id: answer for t, answer in zip(targets, answers, strict=True)}

    async def _engine(self, session: aiohttp.ClientSession, target: EngineTarget) -> list[Metric] | None:
        """One llama-server's families, relabelled; None when it does not answer in time or in the format."""
        try:
            async with session.get(f"http://{LOOPBACK}:{target.port}/metrics") as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                body = bytearray()
                while chunk := await response.content.read(MAX_ENGINE_BYTES + 1 - len(body)):
                    body += chunk
                    if len(body) > MAX_ENGINE_BYTES:
                        raise ValueError(f"an answer over {MAX_ENGINE_BYTES} bytes")
            return relabel(body.decode("utf-8", errors="replace"), target.labels)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if self._log is not None:
                error = str(exc) or repr(exc)
                self._log.info("engine_metrics_unavailable", instance_id=target.instance_id, error=error)
            return None

    # --- the metrics-only listener ---------------------------------------------------------------------------

    async def _listen(self, ctx: ActorContext, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, keepalive_timeout=KEEPALIVE_TIMEOUT_S, shutdown_timeout=5.0
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        sockets = getattr(getattr(site, "_server", None), "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else port
        ctx.log.info("metrics_listening", host=host, port=self.bound_port, auth=self.api_key is not None)
        if self._on_listening is not None:
            self._on_listening(self.bound_port)
        ctx.spawn(_serve_until_stopped(runner), "http")

    async def _handle(self, request: web.Request) -> web.Response:
        if self.api_key is not None and not shapes.key_matches(shapes.presented_key(request.headers), self.api_key):
            error = shapes.ApiError(INVALID_API_KEY, "a valid API key is required (Authorization: Bearer KEY)")
            headers = {**shapes.error_headers(error.code), "WWW-Authenticate": "Bearer"}
            return web.json_response(shapes.error_body(error, "openai"), status=error.status, headers=headers)
        try:
            body, content_type = await self.exposition(request.headers.get("Accept"))
        except Exception as exc:  # a bug met by one scrape: that scrape fails, the listener keeps serving
            self._log.exception("metrics_scrape_failed", error=repr(exc))
            return web.Response(status=500, text="the metrics could not be rendered\n")
        return web.Response(body=body, headers={"Content-Type": content_type})


async def _serve_until_stopped(runner: web.AppRunner) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await runner.cleanup()


def _record(value_type: type[Any], what: str, apply: Callable[[Any], None]) -> Callable[[str, bytes | None], None]:
    """Applies one key's value (None: removed or expired) decoded as `value_type`."""

    def on_entry(key: str, value: bytes | None) -> None:
        apply(None if value is None else decode_checked(value, value_type, f"{what} {key}"))

    return on_entry
