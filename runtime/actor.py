"""Actors and their supervisor.

An actor is a class with a `name` and an async `run(ctx)` that declares what it serves (request
endpoints, subscriptions) and what it does on its own (tasks), all inside the `ActorContext` of one
incarnation. Each incarnation owns an `asyncio.TaskGroup` and a NATS micro service (`mesh-<name>`), so
`$SRV.PING/INFO/STATS` find it. Messages of one endpoint or subscription are handled one at a time by a
task of that group. The incarnation lasts as long as its tasks; an exception escaping any of them is a
crash: the group is torn down (the service unregistered, waiting requesters answered `unavailable`) and
the supervisor restarts the actor with capped exponential backoff, or gives it up for good when it
crashes too often. Every start, crash, restart, give-up and stop is a journal event.

A handler answers a request by returning a Struct, or refuses it by raising `RequestError`; a message
that is not valid JSON or not of the endpoint's schema is answered `bad_request` with the offending path
and never reaches the handler. Nothing a client sends can crash an actor: any other exception raised while
handling one request is an `internal` error reply for that request (logged with its traceback), and the
actor keeps serving; the same holds for one message of a subscription. Every request runs under the request
deadline, counted from its arrival (time in the inbox included): past it, the handler is cancelled and the
requester answered `timeout`. Only the actor's own tasks (and its `run`) crash the incarnation. Each request is
handled within its trace context (`runtime.tracing`): the `traceparent` header it came with, or a fresh trace;
a subscription's message with a valid one is handled within it too.

Replies go only to inboxes (`runtime.bus.reply_allowed`): a request whose reply subject is anything else, or
none, is logged (`reply_refused`) and dropped before any work, on endpoints, subscriptions and the micro
service's own discovery verbs alike; a requester cannot make an actor write where it points.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, Service, ServiceConfig

from messages.errors import BUSY, INTERNAL, TIMEOUT, UNAVAILABLE, ErrorReply
from messages.events import ActorCrashed, ActorGaveUp, ActorRestarted, ActorStarted, ActorStopped
from messages.subjects import Subjects
from runtime import tracing
from runtime.bus import (
    BadMessage,
    Bus,
    ConnectFailed,
    NoResponders,
    PayloadTooLarge,
    RequestTimeout,
    decode_checked,
    encode,
    error_headers,
    refuse_reply,
    reply_allowed,
    stored_answer,
)
from runtime.journal import Journal
from runtime.logging import get_logger
from runtime.restart import GiveUp, RestartPolicy

Req = TypeVar("Req")
Msg_T = TypeVar("Msg_T")

SERVICE_VERSION = "0.1.0"


class RequestError(Exception):
    """Raised by a handler to answer with an error reply; the actor keeps running."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.reply = ErrorReply(code=code, message=message, details=details or {})


class RawReply:
    """A reply of raw bytes (bulk data, e.g. an L3 segment chunk) with its metadata in NATS headers, for a
    handler that returns it instead of a Struct; its size is checked against max_payload like any reply."""

    __slots__ = ("data", "headers")

    def __init__(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.data = data
        self.headers = headers or {}


class ActorGaveUpError(RuntimeError):
    """An actor exceeded its restart intensity; raised by the supervisor when it escalates."""


RequestHandler = Callable[[Req], Awaitable[Any]]


class ActorContext:
    """What one incarnation of an actor may use: the bus, the journal, its task group and its service."""

    def __init__(
        self,
        *,
        actor: str,
        node_id: str,
        bus: Bus,
        journal: Journal,
        subjects: Subjects,
        tg: asyncio.TaskGroup,
        service: Service,
        request_deadline_s: float,
    ) -> None:
        self.actor = actor
        self.node_id = node_id
        self.bus = bus
        self.journal = journal
        self.subjects = subjects
        self.log = get_logger(actor=actor, node=node_id)
        self._tg = tg
        self._service = service
        self._deadline = request_deadline_s
        self.tasks: set[asyncio.Task[None]] = set()
        self._inboxes: list[asyncio.Queue[tuple[Request, float]]] = []
        self._subscriptions: list[Any] = []

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Runs `coro` in this incarnation's task group; its exception is a crash of the actor."""
        task = self._tg.create_task(coro, name=f"{self.actor}:{name}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def cancel_tasks(self) -> None:
        """Cancels every task of this incarnation (again: a cancellation may have been lost)."""
        for task in self.tasks:
            task.cancel()

    def emit(self, event_class: type[Any], **fields: Any) -> Any:
        """Records a journal event from this actor."""
        return self.journal.emit(event_class, self.actor, **fields)

    async def add_endpoint(
        self,
        name: str,
        subject: str,
        request_type: type[Req],
        handler: RequestHandler[Req],
        *,
        queue_group: str | None = None,
        inbox: int = 256,
        workers: int = 1,
        deadline_s: float | None = None,
    ) -> None:
        """Serves request/reply on `subject` (a micro service endpoint), `workers` requests at a time, each under
        `deadline_s` from its arrival (default: the supervisor's request deadline).

        The client library's callback only queues the request (or answers `busy` when the inbox is full), so
        replies keep the library's write batching under load; the workers in this incarnation's task group
        answer (with one worker, in order). A request that waited in the inbox past the request deadline is
        answered `timeout` (its requester has given up); requests still queued when the incarnation ends get
        `unavailable`. A handler may return a `RawReply` (bytes and headers) instead of a Struct.
        """
        if workers < 1:
            raise ValueError("an endpoint needs at least one worker")
        queue: asyncio.Queue[tuple[Request, float]] = asyncio.Queue(maxsize=inbox)
        self._inboxes.append(queue)
        loop = asyncio.get_running_loop()
        limit = self._deadline if deadline_s is None else deadline_s

        async def on_request(request: Request) -> None:
            reply = _reply_of(request)
            if not reply_allowed(reply):
                refuse_reply(self.log, request.subject, reply, endpoint=name)
                return
            try:
                queue.put_nowait((request, loop.time()))
            except asyncio.QueueFull:
                await _respond_error(request, ErrorReply(code=BUSY, message=f"{self.actor} is busy; retry"))

        async def worker() -> None:
            while True:
                request, arrived = await queue.get()
                if loop.time() - arrived > limit:
                    message = f"{self.actor} did not get to the request within {limit:g}s"
                    await _respond_error(request, ErrorReply(code=TIMEOUT, message=message))
                    continue
                try:
                    await self._answer(request, request_type, handler, name, arrived, limit)
                except asyncio.CancelledError:
                    # The incarnation is ending under this request: say so rather than leave it to time out.
                    reply = ErrorReply(code=UNAVAILABLE, message=f"{self.actor} stopped while answering; retry")
                    await _respond_error(request, reply)
                    raise

        for n in range(workers):
            self.spawn(worker(), f"endpoint:{name}" if workers == 1 else f"endpoint:{name}:{n}")
        await self._service.add_endpoint(
            EndpointConfig(name=name, subject=subject, handler=on_request, queue_group=queue_group)
        )

    async def _answer(
        self,
        request: Request,
        request_type: type[Req],
        handler: RequestHandler[Req],
        name: str,
        arrived: float,
        limit: float,
    ) -> None:
        """Answers one request: its reply, or an error reply. Never raises but for cancellation of the actor."""
        headers_of = _REQUEST_HEADERS.set(MappingProxyType(dict(request.headers or {})))
        # The request's trace context (its traceparent, or a fresh trace): the handler, the tasks it spawns, the
        # requests it makes and the events it records all carry it.
        trace_of = tracing.enter(tracing.incoming(request.headers))
        try:
            message = decode_checked(request.data, request_type, f"request on {request.subject!r}")
            async with asyncio.timeout_at(arrived + limit):
                reply = await handler(message)
            headers = reply.headers if isinstance(reply, RawReply) else None
            payload = reply.data if isinstance(reply, RawReply) else encode(reply)
            self.bus.check_size(request.subject, payload)
        except BadMessage as exc:
            self.log.info("bad_request", endpoint=name, error=str(exc))
            await _respond_error(request, exc.to_reply())
            return
        except RequestError as exc:
            await _respond_error(request, exc.reply)
            return
        except TimeoutError:
            # Raised by the deadline above (or by a handler's own deadline): either way the requester hears why.
            late = f"{self.actor} did not answer within the {limit:g}s request deadline"
            self.log.warning("request_timeout", endpoint=name, deadline_s=limit)
            await _respond_error(request, ErrorReply(code=TIMEOUT, message=late))
            return
        except PayloadTooLarge as exc:
            await _respond_error(request, ErrorReply(code=INTERNAL, message=str(exc)))
            return
        except Exception as exc:
            # A bug met by one request: that request fails, the actor keeps serving the others. It does not
            # count toward the restart intensity, so no client can make a node give up.
            self.log.exception("request_failed", endpoint=name, error=repr(exc))
            await _respond_error(request, ErrorReply(code=INTERNAL, message=f"{self.actor} failed: {exc!r}"))
            return
        finally:
            tracing.leave(trace_of)
            _REQUEST_HEADERS.reset(headers_of)
        with contextlib.suppress(nats.errors.Error):
            await request.respond(payload, headers=headers)

    async def subscribe(
        self,
        subject: str,
        message_type: type[Msg_T],
        handler: Callable[[Msg_T, Msg], Awaitable[None]],
        *,
        queue: str = "",
        pending_limit: int = 4096,
    ) -> None:
        """Handles messages on `subject` one at a time, each under the request deadline; undecodable ones are
        logged and skipped (answered `bad_request` when they have a reply subject), failing ones logged."""
        sub = await self.bus.nc.subscribe(subject, queue=queue, pending_msgs_limit=pending_limit)
        self._subscriptions.append(sub)

        async def worker() -> None:
            async for msg in sub.messages:
                if stored_answer(msg):  # JetStream's answer aimed here by a forged reply, not a publish
                    self.log.warning("forged_answer_dropped", subject=msg.subject)
                    continue
                try:
                    message = decode_checked(msg.data, message_type, f"message on {msg.subject!r}")
                except BadMessage as exc:
                    self.log.warning("bad_message", subject=msg.subject, error=str(exc))
                    if msg.reply:
                        await self.bus.respond(msg, encode(exc.to_reply()), headers=error_headers(exc.to_reply()))
                    continue
                try:
                    with tracing.use(tracing.parse((msg.headers or {}).get(tracing.TRACEPARENT))):
                        async with asyncio.timeout(self._deadline):
                            await handler(message, msg)
                except TimeoutError:
                    self.log.warning("message_timeout", subject=msg.subject, deadline_s=self._deadline)
                except Exception as exc:  # one message's failure is that message's, never the actor's
                    self.log.exception("message_failed", subject=msg.subject, error=repr(exc))

        self.spawn(worker(), f"subscription:{subject}")

    async def close(self) -> None:
        for inbox in self._inboxes:
            while not inbox.empty():
                request, _ = inbox.get_nowait()
                await _respond_error(
                    request, ErrorReply(code=UNAVAILABLE, message=f"{self.actor} is restarting; retry")
                )
        for sub in self._subscriptions:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()


#: The headers of the request an endpoint's handler is answering (its worker task's context).
_REQUEST_HEADERS: ContextVar[Mapping[str, str]] = ContextVar("request_headers", default=MappingProxyType({}))


def request_headers() -> Mapping[str, str]:
    """The headers of the request the calling endpoint handler answers (empty outside one): what the requester
    sent, and what nats-server adds (`Nats-Request-Info` on a shared import: who asked)."""
    return _REQUEST_HEADERS.get()


def _reply_of(request: Request) -> str | None:
    reply: str | None = request._msg.reply  # nats.micro's Request has no public accessor for it
    return reply


class _InboxOnlyService(Service):
    """A micro service whose discovery verbs (`$SRV.PING/INFO/STATS`) answer only inboxes, like its endpoints."""

    async def _handle_ping_request(self, msg: Msg) -> None:
        if self._answerable(msg):
            await super()._handle_ping_request(msg)

    async def _handle_info_request(self, msg: Msg) -> None:
        if self._answerable(msg):
            await super()._handle_info_request(msg)

    async def _handle_stats_request(self, msg: Msg) -> None:
        if self._answerable(msg):
            await super()._handle_stats_request(msg)

    def _answerable(self, msg: Msg) -> bool:
        if reply_allowed(msg.reply):
            return True
        refuse_reply(get_logger(component="service", service=self._name), msg.subject, msg.reply)
        return False


async def _respond_error(request: Request, reply: ErrorReply) -> None:
    with contextlib.suppress(nats.errors.Error):
        await request.respond(encode(reply), headers=error_headers(reply))


class Actor:
    """Base class of every actor. Subclasses set `name` and implement `run`."""

    name: ClassVar[str] = "actor"
    description: ClassVar[str] = ""

    async def run(self, ctx: ActorContext) -> None:
        """Declares endpoints, subscriptions and tasks; the incarnation lives as long as they do."""
        raise NotImplementedError


class Supervisor:
    """Runs actors, restarting each one after a crash within its restart intensity."""

    def __init__(
        self,
        *,
        bus: Bus,
        journal: Journal,
        subjects: Subjects,
        node_id: str,
        policy: Callable[[], RestartPolicy] = RestartPolicy,
        escalate: bool = True,
        request_deadline_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        shutdown_deadline_s: float = 5.0,
    ) -> None:
        self._bus = bus
        self._journal = journal
        self._subjects = subjects
        self._node_id = node_id
        self._policy = policy
        self._escalate = escalate
        self._deadline = request_deadline_s
        self._clock = clock
        self._shutdown_deadline = shutdown_deadline_s
        self._log = get_logger(component="supervisor", node=node_id)

    async def run(self, actors: Sequence[Actor]) -> None:
        async with asyncio.TaskGroup() as tg:
            for actor in actors:
                tg.create_task(self.supervise(actor), name=f"supervise:{actor.name}")

    async def supervise(self, actor: Actor) -> None:
        policy = self._policy()
        attempt = 0
        outage_backoff = _OUTAGE_BACKOFF_INITIAL_S
        while True:
            attempt += 1
            if attempt == 1:
                self._journal.emit(ActorStarted, actor.name, attempt=attempt)
            else:
                self._journal.emit(ActorRestarted, actor.name, attempt=attempt)
            started = self._clock()
            try:
                await self._run_incarnation(actor)
            except asyncio.CancelledError:
                self._journal.emit(ActorStopped, actor.name)
                raise
            except Exception as exc:
                error = _describe(exc)
                if _bus_outage(exc):
                    # NATS is away (or JetStream not back yet): the actor is not at fault, so this never counts
                    # toward its restart intensity; it comes back with capped backoff once the bus does.
                    if self._clock() - started > _OUTAGE_RESET_S:
                        outage_backoff = _OUTAGE_BACKOFF_INITIAL_S
                    self._log.warning(
                        "actor_waiting_for_bus", actor=actor.name, error=error, restart_in_s=outage_backoff
                    )
                    self._journal.emit(
                        ActorCrashed, actor.name, error=error, crashes_in_window=0, restart_in_s=outage_backoff
                    )
                    await asyncio.sleep(outage_backoff)
                    outage_backoff = min(outage_backoff * 2, _OUTAGE_BACKOFF_MAX_S)
                    continue
                decision = policy.on_crash(self._clock())
                if isinstance(decision, GiveUp):
                    self._log.error("actor_gave_up", actor=actor.name, error=error, crashes=decision.crashes_in_window)
                    self._journal.emit(
                        ActorGaveUp,
                        actor.name,
                        error=error,
                        crashes=decision.crashes_in_window,
                        window_s=policy.window_s,
                    )
                    if self._escalate:
                        raise ActorGaveUpError(f"actor {actor.name} gave up after repeated crashes: {error}") from exc
                    return
                self._log.warning(
                    "actor_crashed", actor=actor.name, error=error, restart_in_s=decision.delay_s, exc_info=exc
                )
                self._journal.emit(
                    ActorCrashed,
                    actor.name,
                    error=error,
                    crashes_in_window=decision.crashes_in_window,
                    restart_in_s=decision.delay_s,
                )
                await asyncio.sleep(decision.delay_s)
                continue
            self._journal.emit(ActorStopped, actor.name)
            return

    async def _run_incarnation(self, actor: Actor) -> None:
        """Runs one incarnation in its own task, so that stopping it is bounded.

        The NATS client library swallows a cancellation that arrives while it flushes (`_flush_pending`), so
        one `cancel()` may be lost: a loop in an actor task then keeps running, and a task group would wait
        for it forever. When this supervisor is cancelled, it cancels the incarnation and every task of it
        again every half second until they end, and after twice `shutdown_deadline_s` stops waiting (the tasks
        left are logged; they end when the connection closes)."""
        contexts: list[ActorContext] = []
        incarnation = asyncio.create_task(self._incarnation(actor, contexts), name=f"incarnation:{actor.name}")
        try:
            await asyncio.wait({incarnation})
        except asyncio.CancelledError:
            await self._stop(actor, incarnation, contexts)
            raise
        incarnation.result()  # a crash raises here

    async def _stop(self, actor: Actor, incarnation: asyncio.Task[None], contexts: list[ActorContext]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2 * self._shutdown_deadline
        while not incarnation.done() and loop.time() < deadline:
            incarnation.cancel()
            for ctx in contexts:
                ctx.cancel_tasks()
            await asyncio.wait({incarnation}, timeout=0.5)
        if not incarnation.done():
            stuck = [t.get_name() for ctx in contexts for t in ctx.tasks if not t.done()]
            self._log.error("actor_stop_overdue", actor=actor.name, tasks=stuck, deadline_s=2 * self._shutdown_deadline)
        elif not incarnation.cancelled() and (error := incarnation.exception()) is not None:
            self._log.warning("actor_failed_while_stopping", actor=actor.name, error=_describe(error))

    async def _incarnation(self, actor: Actor, contexts: list[ActorContext]) -> None:
        service = _InboxOnlyService(
            self._bus.nc,
            ServiceConfig(
                name=f"mesh-{actor.name}",
                version=SERVICE_VERSION,
                description=actor.description or actor.name,
                metadata={"node": self._node_id, "prefix": self._subjects.prefix},
            ),
        )
        await service.start()  # what nats.micro.add_service does
        ctx: ActorContext | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                ctx = ActorContext(
                    actor=actor.name,
                    node_id=self._node_id,
                    bus=self._bus,
                    journal=self._journal,
                    subjects=self._subjects,
                    tg=tg,
                    service=service,
                    request_deadline_s=self._deadline,
                )
                contexts.append(ctx)
                await actor.run(ctx)
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    # we were cancelled while `run` was inside the client library, which swallowed it
                    raise asyncio.CancelledError("cancelled while the actor was starting")
        finally:
            # Bounded: the client library's drain of the service's subscriptions waits for every pending
            # message with no deadline of its own; a stuck drain must not keep the node from stopping.
            try:
                async with asyncio.timeout(self._shutdown_deadline):
                    if ctx is not None:
                        await ctx.close()
                    with contextlib.suppress(nats.errors.Error, AssertionError, RuntimeError):
                        await service.stop()
            except TimeoutError:
                self._log.warning("actor_shutdown_overdue", actor=actor.name, deadline_s=self._shutdown_deadline)


_OUTAGE_BACKOFF_INITIAL_S = 0.5
_OUTAGE_BACKOFF_MAX_S = 10.0
_OUTAGE_RESET_S = 60.0  # an incarnation that lived this long starts the outage backoff afresh

#: Faults of the bus itself (no server, no answer, JetStream unavailable), as opposed to faults of an actor.
_OUTAGES = (
    nats.errors.TimeoutError,
    nats.errors.NoServersError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.FlushTimeoutError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    ConnectFailed,
    NoResponders,
    RequestTimeout,
)


def _bus_outage(exc: BaseException) -> bool:
    """Whether every failure inside `exc` (possibly an exception group) is a fault of the bus."""
    if isinstance(exc, BaseExceptionGroup):
        return bool(exc.exceptions) and all(_bus_outage(e) for e in exc.exceptions)
    return isinstance(exc, _OUTAGES)


def _describe(exc: BaseException) -> str:
    """The first real error inside (possibly nested) exception groups, as `Type: message`."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
