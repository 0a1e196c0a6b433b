"""Dashboard (shell): the fleet in a browser, served at `/ui` on the front door's listener.

What it follows: every key of the nodes, instances, reservations, front doors and L3 buckets (watched, never
polled), and the whole journal (`<prefix>.events.>`: its last `journal_limit` stored events when it starts, then
each one as it is published). All of it goes into `view.FleetView` (pure), which returns the deltas each change
makes.

What it serves (`register` adds the routes to the front door's application):

* `GET /ui`: the page (`static/index.html`, plain HTML and JavaScript modules, no build step); `GET
  /ui/static/<file>` its files;
* `GET /ui/stream`: server-sent events, a `snapshot` of the whole view when a page connects, then `delta`s as
  the records and the journal change (the browser's `EventSource` reconnects by itself, and gets a snapshot);
* `GET /ui/events/<id>`: a placement or routing decision with its inputs and its replay (`explain`; at most
  `EXPLAINING` at once, in threads).

Keys: with an API key set, every route answers 401 without it. A request presents it as the rest of the listener
takes it (`Authorization: Bearer KEY`, `x-api-key`), or as the session cookie a browser gets by posting the key
to `POST /ui/session` from the page's form (`access`): an `EventSource` cannot send a header, and a key in a URL
would be logged. The front door leaves the key check of `/ui` to this actor.

Hostile clients: at most `max_clients` streams at once (503 beyond); each has a queue of `queue_limit` deltas,
and a client that falls that far behind, or takes over `write_timeout_s` to take one write, is dropped (its
browser reconnects and starts afresh from a snapshot), so no client holds more than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from importlib import resources
from typing import Any, Final

import msgspec
from aiohttp import web
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from actors.dashboard.access import COOKIE, SESSION_S, session_token, session_valid
from actors.dashboard.explain import explain
from actors.dashboard.view import Delta, FleetView, merge
from actors.frontdoor import shapes
from messages.errors import BAD_REQUEST, BUSY, INVALID_API_KEY, NOT_FOUND, UNAVAILABLE
from messages.frontdoor import FrontDoorReport
from messages.l3 import L3Inventory
from messages.placement import LEDGER_KEY_PREFIX, NodeLedger
from messages.runner import InstanceStatus
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.actor import Actor, ActorContext
from runtime.bus import BadMessage, decode_checked, stored_answer
from runtime.direct_get import DirectGetFailed, read_stored

__all__ = ["PREFIX", "DashboardActor"]

#: The paths this actor serves (and whose key check the front door leaves to it).
PREFIX: Final = "/ui"
#: How long the watches may take to deliver the current records before the actor counts as failed to start.
READY_S: Final = 15.0
#: A comment line sent to an idle stream this often, so that proxies and the browser see it alive.
KEEPALIVE_S: Final = 15.0
#: How long a login form's body may take to arrive.
FORM_TIMEOUT_S: Final = 10.0
#: Decisions explained at once (a placement's replay is CPU work, done in a thread), and how long one waits its turn.
EXPLAINING: Final = 2
EXPLAIN_WAIT_S: Final = 10.0
_STATIC: Final = {
    "index.html": "text/html; charset=utf-8",
    "login.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_PAGE_POLICY: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
_CLOSE: Final = b""  # what a dropped client's queue holds: the end of its stream


class _Client:
    """One open stream: what it has yet to be sent."""

    __slots__ = ("dropped", "queue")

    def __init__(self, limit: int) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=limit)
        self.dropped = False

    def send(self, chunk: bytes) -> bool:
        """Queues `chunk`; False (and the stream ends) when the client is `limit` chunks behind."""
        if self.dropped:
            return False
        try:
            self.queue.put_nowait(chunk)
        except asyncio.QueueFull:
            self.close()
            return False
        return True

    def close(self) -> None:
        self.dropped = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(_CLOSE)


class DashboardActor(Actor):
    name = "dashboard"
    description = "the fleet in a browser: /ui on the front door's listener, kept current by server-sent events"

    def __init__(
        self,
        *,
        api_key: str | None = None,
        journal_limit: int = 500,
        max_clients: int = 32,
        queue_limit: int = 256,
        write_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api_key = api_key
        self.journal_limit = journal_limit
        self.max_clients = max_clients
        self.queue_limit = queue_limit
        self.write_timeout_s = write_timeout_s
        self._clock = clock
        self._view: FleetView | None = None  # None while the actor is not running (routes answer 503)
        self._clients: set[_Client] = set()
        self._log: Any = None
        self._explaining = asyncio.Semaphore(EXPLAINING)
        self._files = {name: (resources.files(__package__) / "static" / name).read_bytes() for name in _STATIC}

    # --- what it follows -------------------------------------------------------------------------------------

    async def run(self, ctx: ActorContext) -> None:
        self._log = ctx.log
        view = FleetView(journal_limit=self.journal_limit)
        subjects = ctx.subjects
        follows: list[tuple[str, KeyValue, Callable[[str, bytes | None], list[Delta]]]] = [
            ("nodes", await buckets.nodes(ctx.bus, subjects), _record(NodeResources, "telemetry", view.node)),
            ("instances", await buckets.instances(ctx.bus, subjects), _instance(view)),
            ("reservations", await buckets.reservations(ctx.bus, subjects), _ledger(view)),
            ("frontdoors", await buckets.frontdoors(ctx.bus, subjects),
             _record(FrontDoorReport, "front door", view.frontdoor)),
            ("l3", await buckets.l3(ctx.bus, subjects), _record(L3Inventory, "L3 inventory", view.l3)),
        ]  # fmt: skip
        ready = [asyncio.Event() for _ in range(len(follows) + 1)]
        for (name, kv, apply), done in zip(follows, ready, strict=False):
            ctx.spawn(self._follow(ctx, kv, done, apply), f"watch:{name}")
        ctx.spawn(self._follow_journal(ctx, view, ready[-1]), "journal")
        async with asyncio.timeout(READY_S):
            for done in ready:
                await done.wait()
        self._view = view
        ctx.spawn(self._until_stopped(), "streams")
        ctx.log.info("dashboard_ready", path=PREFIX, auth=self.api_key is not None)

    async def _until_stopped(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self._view = None
            for client in list(self._clients):
                client.close()  # their pages reconnect to the next incarnation

    async def _follow(
        self,
        ctx: ActorContext,
        kv: KeyValue,
        ready: asyncio.Event,
        apply: Callable[[str, bytes | None], list[Delta]],
    ) -> None:
        async for entry in buckets.watch(kv, ready):
            try:
                deltas = apply(entry.key, None if buckets.removed(entry) else entry.value)
            except BadMessage as exc:  # a record that does not decode is left out, not taken as the truth
                ctx.log.warning("dashboard_bad_record", key=entry.key, error=str(exc))
                continue
            if self._view is not None:
                self._publish(deltas)

    async def _follow_journal(self, ctx: ActorContext, view: FleetView, ready: asyncio.Event) -> None:
        """The journal's last events, then each one as it is published. The live subscription opens first, so
        nothing published while the tail is read is missed (the view shows an event read twice once)."""
        sub = await ctx.bus.nc.subscribe(ctx.subjects.events_all, pending_msgs_limit=8192)
        try:
            await self._read_tail(ctx, view)
            ready.set()
            async for msg in sub.messages:
                if stored_answer(msg):  # JetStream's answer aimed here by a forged reply, not a publish
                    continue
                deltas = view.event(None, msg.subject, msg.data)
                if deltas and self._view is not None:
                    self._publish(deltas)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _read_tail(self, ctx: ActorContext, view: FleetView) -> None:
        stream = ctx.subjects.events_stream
        try:
            info = await ctx.bus.js.stream_info(stream)
        except NotFoundError:
            return  # no journal yet: the live events are all there is
        start = max(1, info.state.last_seq - self.journal_limit + 1)
        try:
            async with asyncio.timeout(READY_S):
                async for stored in read_stored(ctx.bus, stream, ctx.subjects.events_all, start_seq=start):
                    view.event(stored.seq, stored.subject, stored.data)
        except (DirectGetFailed, TimeoutError) as exc:  # the page starts with the live events only
            ctx.log.warning("dashboard_journal_tail_unread", error=str(exc) or type(exc).__name__)

    def _publish(self, deltas: list[Delta]) -> None:
        if not deltas or not self._clients:
            return
        chunk = _sse("delta", merge(deltas))
        for client in list(self._clients):
            if not client.send(chunk):
                self._clients.discard(client)
                if self._log is not None:
                    self._log.info("dashboard_client_dropped", reason="behind", queue_limit=self.queue_limit)

    # --- what it serves --------------------------------------------------------------------------------------

    def register(self, app: web.Application) -> str:
        """Adds the dashboard's routes to the front door's `app`; the path prefix whose keys it checks itself."""
        app.router.add_get(PREFIX, self._page)
        app.router.add_get(f"{PREFIX}/", self._page)
        app.router.add_post(f"{PREFIX}/session", self._session)
        app.router.add_get(f"{PREFIX}/static/{{name}}", self._static)
        app.router.add_get(f"{PREFIX}/stream", self._stream)
        app.router.add_get(f"{PREFIX}/events/{{id}}", self._detail)
        return PREFIX

    def _authorized(self, request: web.Request) -> bool:
        if self.api_key is None:
            return True
        if shapes.key_matches(shapes.presented_key(request.headers), self.api_key):
            return True
        return session_valid(request.cookies.get(COOKIE), self.api_key, self._clock())

    def _refused(self) -> web.Response:
        error = shapes.ApiError(INVALID_API_KEY, "a valid API key is required (Authorization: Bearer KEY, or the "
                                "session cookie the page at /ui sets)")  # fmt: skip
        return web.json_response(shapes.error_body(error, "openai"), status=401,
                                 headers={"WWW-Authenticate": "Bearer", "Cache-Control": "no-store"})  # fmt: skip

    def _file(self, name: str, status: int = 200) -> web.Response:
        headers = {"Content-Type": _STATIC[name], "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                   "Content-Security-Policy": _PAGE_POLICY, "Referrer-Policy": "same-origin"}  # fmt: skip
        return web.Response(body=self._files[name], status=status, headers=headers)

    async def _page(self, request: web.Request) -> web.Response:
        """The dashboard; without the key, the form that asks for it (401, still an HTML page)."""
        if not self._authorized(request):
            return self._file("login.html", status=401)
        return self._file("index.html")

    async def _session(self, request: web.Request) -> web.Response:
        """The login form's post: a valid key gets the session cookie and goes to the page."""
        origin = request.headers.get("Origin")  # a browser's form names its page's origin (scripts send none)
        if origin is not None and origin != f"{request.scheme}://{request.host}":
            return web.Response(status=403, text="a form of another site\n")
        try:
            async with asyncio.timeout(FORM_TIMEOUT_S):
                form = await request.post()
        except TimeoutError:
            return web.Response(status=408, text="the form did not arrive in time\n")
        key = form.get("key")
        response = web.Response(status=303, headers={"Location": PREFIX, "Cache-Control": "no-store"})
        if self.api_key is None:
            return response
        if not isinstance(key, str) or not shapes.key_matches(key.strip(), self.api_key):
            if self._log is not None:
                self._log.info("dashboard_key_refused", peer=request.remote)
            return self._file("login.html", status=401)
        response.set_cookie(
            COOKIE, session_token(self.api_key, self._clock()), max_age=SESSION_S, path=PREFIX, httponly=True,
            samesite="Strict", secure=request.secure,
        )  # fmt: skip
        return response

    async def _static(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._refused()
        name = request.match_info["name"]
        if name not in _STATIC or name.endswith(".html"):
            raise web.HTTPNotFound()
        return self._file(name)

    async def _detail(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._refused()
        view = self._view
        if view is None:
            raise shapes.ApiError(UNAVAILABLE, "the dashboard is starting")
        data = view.decision(request.match_info["id"])
        if data is None:
            raise shapes.ApiError(NOT_FOUND, "no such decision among the latest the dashboard keeps")
        try:
            async with asyncio.timeout(EXPLAIN_WAIT_S):
                await self._explaining.acquire()
        except TimeoutError as exc:
            raise shapes.ApiError(BUSY, "other decisions are being explained: try again") from exc
        # Replaying a placement is CPU work, in a thread; its turn ends when the thread does, even if the page left.
        work = asyncio.get_running_loop().run_in_executor(None, explain, data)
        work.add_done_callback(self._explained)
        try:
            detail = await asyncio.shield(work)
        except (ValueError, msgspec.DecodeError) as exc:
            raise shapes.ApiError(BAD_REQUEST, f"not a decision: {exc}") from exc
        return web.json_response(detail, dumps=_dumps, headers={"Cache-Control": "no-store"})

    def _explained(self, work: asyncio.Future[dict[str, Any]]) -> None:
        self._explaining.release()
        if not work.cancelled():
            work.exception()  # retrieved here: a page that left does not read it

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return self._refused()
        if self._view is None:
            raise shapes.ApiError(UNAVAILABLE, "the dashboard is starting")
        if len(self._clients) >= self.max_clients:
            if self._log is not None:
                self._log.warning("dashboard_clients_full", limit=self.max_clients, peer=request.remote)
            return web.Response(status=503, text=f"at most {self.max_clients} dashboards at once\n",
                                headers={"Retry-After": "10"})  # fmt: skip
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        view = self._view
        if view is None:
            return response
        client = _Client(self.queue_limit)
        self._clients.add(client)
        snapshot = b"retry: 2000\n\n" + _sse("snapshot", view.snapshot())  # taken as the client joins: no gap
        try:
            chunk = snapshot
            while chunk is not _CLOSE:
                async with asyncio.timeout(self.write_timeout_s):
                    await response.write(chunk)
                try:
                    async with asyncio.timeout(KEEPALIVE_S):
                        chunk = await client.queue.get()
                except TimeoutError:
                    chunk = b": keepalive\n\n"
        except TimeoutError:
            if self._log is not None:
                self._log.info("dashboard_client_dropped", reason="slow", write_timeout_s=self.write_timeout_s)
        except (ConnectionResetError, ConnectionError):
            pass  # the page went away
        finally:
            self._clients.discard(client)
        return response

    @property
    def clients(self) -> int:
        """Streams open now."""
        return len(self._clients)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, default=str)


def _sse(kind: str, value: Any) -> bytes:
    """One server-sent event (its JSON holds no newline: one `data:` line)."""
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(value) + b"\n\n"


def _record(
    value_type: type[Any], what: str, apply: Callable[[str, Any], list[Delta]]
) -> Callable[[str, bytes | None], list[Delta]]:
    """Applies one key's value (None: removed or expired) decoded as `value_type`."""

    def on_entry(key: str, value: bytes | None) -> list[Delta]:
        return apply(key, None if value is None else decode_checked(value, value_type, f"{what} {key}"))

    return on_entry


def _instance(view: FleetView) -> Callable[[str, bytes | None], list[Delta]]:
    """An instance's record under its key `<node>.<id>` (one that claims another key is refused)."""

    def on_entry(key: str, value: bytes | None) -> list[Delta]:
        instance_id = key.split(".", 1)[-1]
        if value is None:
            return view.instance(instance_id, None)
        status = decode_checked(value, InstanceStatus, f"instance {key}")
        if f"{status.node}.{status.id}" != key:
            raise BadMessage(f"instance under key {key}", f"claims to be {status.node}.{status.id}")
        return view.instance(instance_id, status)

    return on_entry


def _ledger(view: FleetView) -> Callable[[str, bytes | None], list[Delta]]:
    def on_entry(key: str, value: bytes | None) -> list[Delta]:
        if not key.startswith(LEDGER_KEY_PREFIX):
            return []  # the bucket's other keys (none a page shows)
        node_id = key.removeprefix(LEDGER_KEY_PREFIX)
        return view.ledger(node_id, None if value is None else decode_checked(value, NodeLedger, f"ledger {key}"))

    return on_entry
