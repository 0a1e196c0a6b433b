"""Handoff actor (shell): streams saved slot states to a peer node and receives them, with credits.

The decisions are the pure cores': `receiver.Receiver` (what a receiving session accepts, when it grants
credit, whether a commit holds) and `sender.Sender` (what may be published, when to commit, when to give up).
This module only moves bytes and enforces the deadlines the cores name.

* Receiving: `mesh.handoff.<node>.open` (a micro endpoint) admits a session (`receiver.seat`: each sending
  node's share of `max_sessions`, an empty session of a node over its share preempted for one under it;
  `receiver.admit`: staging reserved for each session's `max_bytes`) and answers with its subject and first
  credit. Every session message (`<session>.data` chunks, `.commit`, `.abort`) comes through one subscription
  on `mesh.handoff.<node>.*.*`, so a session's messages are judged in the order its sender published them;
  that task only feeds the core and queues bytes, never waits on disk. Each session has one task that stages
  its chunks (pwrite into `<data_dir>/handoff/<session>.part` and blake3, in a worker thread), feeds `Tick`
  when the core's deadline passes, runs the restore, and frees the staging file whatever happens. The
  subscription's pending limits are sized for every session's full window, and no session may publish past
  its window, so the server never drops a chunk as a slow consumer.
* Restoring: only after the commit held, the shell calls the `restore` hook with a `CommittedHandoff` (the
  verified staging file and what it holds); the file is removed when the hook returns, so the hook links or
  copies what it keeps (`restore.into_l3` hands it to the node's L3 store and to an `on_committed` hook).
* Sending: `send(peer, source, …)` (in-process, e.g. from the runner) opens a session on the peer, publishes
  each segment's chunks only within credit, commits and returns a `HandoffReport`, or raises `HandoffFailed`
  with the core's reason. A source is a finished file (its size announced at open, its segments read and
  hashed one by one while the previous one is sent: no pass over the file before the first byte moves) or an
  async iterator of segment bytes (e.g. produced while a prefill still runs: hashed one by one as they come).
  The session is opened once the first segment is in hand, so its first chunk follows the open at once (a
  receiver aborts a session with no chunk within its first-chunk timeout).

Staging is emptied at start. Events: `handoff_committed` (receiver), `handoff_aborted` (either side).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import threading
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import blake3
import msgspec
import nats.errors
from nats.aio.msg import Msg

from actors.handoff import receiver as rx
from actors.handoff import sender as tx
from actors.handoff.api import HandoffFailed, HandoffReport
from actors.handoff.probe import probe
from actors.l3 import layout
from actors.l3.layout import SegmentRef
from messages.datapath import DataHello, DirectOffer
from messages.errors import BAD_REQUEST, BUSY, INTERNAL, NOT_FOUND, ErrorReply
from messages.events import HandoffAborted, HandoffCommitted
from messages.handoff import (
    PROBE_PAYLOAD_KIND,
    CreditGrant,
    HandoffAbort,
    HandoffCommit,
    HandoffControl,
    HandoffOpen,
    HandoffOpened,
    HandoffResult,
    LinkProbe,
    LinkProbeResult,
    SegmentSpec,
    SessionAborted,
)
from messages.subjects import check_token
from runtime import tracing
from runtime.actor import Actor, ActorContext, RequestError
from runtime.bus import (
    BadMessage,
    BusError,
    NoResponders,
    PayloadTooLarge,
    RemoteError,
    RequestTimeout,
    decode_checked,
    encode,
    error_headers,
    parse_reply,
    refuse_reply,
    reply_allowed,
)
from runtime.datapath import (
    DataListener,
    DataPathConfig,
    DataUnavailable,
    PushStream,
    open_push,
    receive_pushed,
)
from runtime.logging import get_logger
from runtime.tickets import Grant

__all__ = [
    "STAGING_DIR",
    "CommittedHandoff",
    "HandoffActor",
    "HandoffFailed",
    "HandoffLimits",
    "HandoffReport",
    "Restore",
    "chunk_bytes",
]

STAGING_DIR: Final = "handoff"
_PART_SUFFIX: Final = ".part"
#: Room left in a data message for its headers (ours and the server's).
_HEADER_ROOM: Final = 4096
_SOURCE_POLL_S: Final = 0.25
#: Chunks staged by one worker-thread call, at most (fewer hops between the loop and the thread).
_BATCH_BYTES: Final = 8 << 20
_OPEN_FLAGS: Final = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


def chunk_bytes(max_payload: int) -> int:
    """The most payload bytes one data message carries on a bus with this `max_payload`."""
    return max(layout.MIN_SEGMENT_BYTES, max_payload - _HEADER_ROOM)


#: A link probe (its handoffs one after another) answers within this.
PROBE_DEADLINE_S: Final = 600.0


@dataclass(frozen=True, slots=True)
class HandoffLimits:
    # Credit a receiving session grants ahead of what it staged, at most. What every session together may have
    # in flight must stay under the server's per-connection buffer for a consumer (nats-server's max_pending,
    # 64 MiB by default), or the server itself drops chunks to a receiver that falls behind: sessions share
    # the budget (`receiver.session_window`), which grows only where two chunks per session do not fit in it
    # (a server whose max_payload is over 5 MiB). One session alone moved 1.3x faster with a 32 MiB window
    # than with 8 (benchmarks/RESULTS.md).
    window_bytes: int = 32 << 20
    credit_budget_bytes: int = 40 << 20
    idle_timeout_s: float = 10.0  # a receiving session with no progress for this long is aborted
    deadline_s: float = 900.0  # no session lives longer (either side)
    restore_timeout_s: float = 120.0
    max_sessions: int = 4  # receiving sessions at once; more opens are answered `busy`
    max_session_bytes: int = 64 << 30
    max_staging_bytes: int = 128 << 30  # what open sessions may reserve in all (their `max_bytes`)
    # A receiving session must move bytes, not messages: this much (or a chunk) counts as progress against
    # idle_timeout_s (one byte every 8 s held all four sessions for 900 s), and it must average
    # min_rate_bytes_per_s after rate_grace_s.
    progress_bytes: int = 1 << 20
    min_rate_bytes_per_s: float = float(1 << 20)
    rate_grace_s: float = 30.0
    min_free_disk_bytes: int = 1 << 30  # an open is refused unless its max_bytes fit the staging disk beside this
    # A receiving session with no chunk this long after its open is aborted (`empty`): one peer re-opening
    # empty sessions held every place for 10 s each (issue 30). A sender opens once its first segment is ready.
    first_chunk_timeout_s: float = 2.0
    open_timeout_s: float = 10.0
    commit_timeout_s: float = 180.0  # the sender waits this long for the result (the receiver's restore included)
    # The sender waits this long for credit at most, whatever idle timeout a receiver announces (a receiver's
    # 1e9 held a prefill worker for the whole deadline).
    credit_stall_s: float = 30.0
    segment_bytes: int = layout.DEFAULT_SEGMENT_BYTES  # how the sender cuts a file


@dataclass(frozen=True, slots=True)
class CommittedHandoff:
    """A verified payload, handed to the restore hook. `path` is removed when the hook returns."""

    session: str
    sender_node: str
    identity: str
    n_tokens: int
    tokens: tuple[int, ...]
    continuation_token: int | None
    payload_kind: str
    total_bytes: int
    payload_digest: str
    segments: tuple[SegmentRef, ...]
    path: Path


#: Restores a committed payload (into llama-server, into L3); returns what it restored into, for the result.
Restore = Callable[[CommittedHandoff], Awaitable[str | None]]


async def _keep_nothing(state: CommittedHandoff) -> str | None:
    return None


# ---- receiving ---------------------------------------------------------------------------------------------


class _Stop:
    """Ends a session task (after an abort or the answer)."""


class _RestoreNow:
    def __init__(self, action: rx.Restore) -> None:
        self.action = action


_Chunk = tuple[rx.Stage, bytes | bytearray]  # a chunk to stage (a NATS payload, or read off the direct stream)
_Item = _Chunk | _RestoreNow | _Stop


class _Session:
    def __init__(self, core: rx.Receiver, path: Path, fd: int) -> None:
        self.core = core
        self.path = path
        self.fd: int | None = fd
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.hasher: Any = None
        self.commit: Msg | None = None  # the commit request, answered with the result (inboxes only)
        # Held by the worker thread while it writes: the fd is closed only between writes (a write still running
        # when the session is cancelled must not land in a reused descriptor).
        self.writing = threading.Lock()
        self.held: _Item | None = None  # an item taken off the queue while batching, handled next
        self.direct = False  # chunks arrive over the direct data path
        self.stream_ended = asyncio.Event()  # that stream is over (its last chunk judged): a commit may be judged


class HandoffActor(Actor):
    name = "handoff"
    description = "KV handoff: saved slot states streamed between nodes with credits, verified before restore"

    def __init__(
        self,
        node_id: str,
        data_dir: Path,
        *,
        restore: Restore | None = None,
        limits: HandoffLimits | None = None,
        datapath: DataPathConfig | None = None,
    ) -> None:
        """`datapath`: where this node's data listener listens and with which certificates; with it, chunks go
        over a direct stream between the nodes (None: every chunk over NATS)."""
        self.node_id = check_token(node_id, "node id")
        self.staging = data_dir / STAGING_DIR
        self.limits = limits or HandoffLimits()
        self._restore = restore or _keep_nothing
        self._ctx: ActorContext | None = None
        self._sessions: dict[str, _Session] = {}
        self._rx_limits: rx.ReceiverLimits | None = None
        self.datapath = datapath
        self.listener: DataListener | None = None  # this incarnation's data listener, while it runs

    @property
    def running(self) -> bool:
        return self._ctx is not None

    @property
    def sessions(self) -> int:
        """Receiving sessions open now."""
        return len(self._sessions)

    async def run(self, ctx: ActorContext) -> None:
        self._ctx = None
        self._sessions.clear()
        await asyncio.to_thread(_fresh_dir, self.staging)
        lim = self.limits
        chunk = chunk_bytes(ctx.bus.max_payload)
        self._rx_limits = rx.ReceiverLimits(
            chunk_bytes=chunk,
            window_bytes=max(lim.window_bytes, 2 * chunk),
            credit_budget_bytes=max(lim.credit_budget_bytes, lim.max_sessions * 2 * chunk),
            idle_timeout_s=lim.idle_timeout_s,
            deadline_s=lim.deadline_s,
            restore_timeout_s=lim.restore_timeout_s,
            max_session_bytes=lim.max_session_bytes,
            max_sessions=lim.max_sessions,
            max_staging_bytes=lim.max_staging_bytes,
            progress_bytes=lim.progress_bytes,
            min_rate_bytes_per_s=lim.min_rate_bytes_per_s,
            rate_grace_s=lim.rate_grace_s,
            min_free_bytes=lim.min_free_disk_bytes,
            first_chunk_timeout_s=lim.first_chunk_timeout_s,
        )
        window, budget = self._rx_limits.window_bytes, self._rx_limits.credit_budget_bytes
        # Everything every session may have in flight may sit in the client's pending buffer (chunks, plus their
        # commits and aborts): sized so the server never has a reason to drop us as a slow consumer.
        sub = await ctx.bus.nc.subscribe(
            ctx.subjects.handoff_sessions(self.node_id),
            pending_msgs_limit=budget // chunk + lim.max_sessions * 64 + 1024,
            pending_bytes_limit=budget + lim.max_sessions * (1 << 20) + (16 << 20),
        )
        ctx.spawn(self._dispatch(ctx, sub), "sessions")
        if self.datapath is not None:
            listener = DataListener(self.node_id, self.datapath)
            await listener.start()
            self.listener = listener
            ctx.spawn(self._keep_listener(listener), "data-listener")
        await ctx.add_endpoint("open", ctx.subjects.handoff(self.node_id, "open"), HandoffOpen, self._on_open)

        async def on_probe(request: LinkProbe) -> LinkProbeResult:
            return await probe(self, ctx, request)

        await ctx.add_endpoint(
            "probe",
            ctx.subjects.handoff(self.node_id, "probe"),
            LinkProbe,
            on_probe,
            deadline_s=PROBE_DEADLINE_S,
        )
        self._ctx = ctx
        ctx.log.info(
            "handoff_started",
            window_bytes=window,
            credit_budget_bytes=budget,
            chunk_bytes=chunk,
            max_sessions=lim.max_sessions,
        )

    async def _keep_listener(self, listener: DataListener) -> None:
        try:
            await asyncio.Event().wait()  # lives as long as the incarnation
        finally:
            if self.listener is listener:
                self.listener = None
            await listener.close()

    # -- open --

    async def _on_open(self, request: HandoffOpen) -> HandoffOpened:
        ctx, limits = self._ctx, self._rx_limits
        if ctx is None or limits is None:
            raise RequestError(BUSY, "the handoff actor is starting; retry")
        decision = self._admission(request, limits)
        if isinstance(decision, rx.Seated):  # the disk, once the cheap checks passed (a stat in a worker thread)
            try:
                free = (await asyncio.to_thread(shutil.disk_usage, self.staging)).free
            except OSError as exc:
                raise RequestError(BUSY, f"cannot read the staging disk's free space: {exc}") from exc
            decision = self._admission(request, limits, free)  # judged again: sessions moved meanwhile
        if isinstance(decision, rx.SeatRefusal):
            code = BUSY if decision.reason in (rx.ReceiveReason.BUSY, rx.ReceiveReason.NO_SPACE) else BAD_REQUEST
            raise RequestError(code, decision.detail, {"reason": decision.reason.value})
        if decision.evict is not None:
            self._preempt(ctx, decision.evict, request.sender_node)
        session = secrets.token_hex(16)
        path = self.staging / f"{session}{_PART_SUFFIX}"
        fd = await asyncio.to_thread(os.open, path, _OPEN_FLAGS, 0o600)
        now = asyncio.get_running_loop().time()
        window = rx.session_window(limits, (s.core.credit_reserved for s in self._open_sessions()))
        state = _Session(rx.Receiver(session, request, limits, now, window), path, fd)
        self._sessions[session] = state
        ctx.spawn(self._run_session(ctx, state), f"session:{session[:12]}")
        direct: DirectOffer | None = None
        if request.direct and self.listener is not None:
            offer = self.listener.offer(
                self._take_direct(ctx, state),
                receiver=request.sender_node,
                digest=request.identity,
                offset=0,
                length=request.max_bytes,
                chunk=limits.chunk_bytes,
            )
            direct = offer if isinstance(offer, DirectOffer) else None  # no ticket left: the chunks come over NATS
        return HandoffOpened(
            session=session,
            subject=ctx.subjects.handoff_session(self.node_id, session),
            chunk_bytes=limits.chunk_bytes,
            credit=state.core.granted,
            idle_timeout_s=limits.idle_timeout_s,
            deadline_s=limits.deadline_s,
            direct=direct,
        )

    def _take_direct(
        self, ctx: ActorContext, session: _Session
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter, Grant[Any]], Awaitable[None]]:
        """The listener's work on the session's direct stream: each message is a chunk with the headers it would
        have had on NATS, judged by the session's core exactly as one (order, credit, segment digests); the
        stream ends the session's direct part when the sender closes it, stalls or sends what is not a chunk."""
        limits = self._rx_limits
        assert limits is not None

        async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, grant: Grant[Any]) -> None:
            session.direct = True
            try:
                await take_chunks(reader, writer)
            finally:
                session.stream_ended.set()

        async def take_chunks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            core, loop = session.core, asyncio.get_running_loop()
            over = (rx.State.DONE, rx.State.ABORTED)

            def deliver(headers: dict[str, str], data: bytes | bytearray) -> bool:
                if core.state in over:
                    return False
                self._perform(ctx, session, core.handle(rx.ChunkArrived(headers, len(data), loop.time())), data)
                return core.state not in over

            try:
                await receive_pushed(
                    reader, writer, deliver, max_payload=limits.chunk_bytes, stall_s=limits.idle_timeout_s
                )
            except TimeoutError:
                return  # the session's own deadlines judge the silence
            except (ValueError, msgspec.DecodeError, asyncio.IncompleteReadError, OSError) as exc:
                if core.state not in over:
                    failed = rx.Failed(
                        rx.ReceiveReason.BAD_CHUNK, f"the direct stream broke: {exc!r}"[:512], loop.time()
                    )
                    self._perform(ctx, session, core.handle(failed))
            # the sender closed its stream (its commit comes over NATS), or the session is over

        return take

    def _open_sessions(self) -> list[_Session]:
        """The receiving sessions not over yet (an ended one holds no place, only its staging for a moment)."""
        return [s for s in self._sessions.values() if s.core.state not in (rx.State.DONE, rx.State.ABORTED)]

    def _admission(
        self, request: HandoffOpen, limits: rx.ReceiverLimits, free: int | None = None
    ) -> rx.Seated | rx.SeatRefusal:
        """The cores' word on an open: the sender's share of the sessions (`seat`), then the rest of the
        receiver's limits with the preempted session's place counted free (`admit`; the staging disk when
        `free` is given)."""
        sessions = self._open_sessions()
        seats = [rx.Seat(s.core.session, s.core.open.sender_node, s.core.received, s.core.opened_at) for s in sessions]
        seated = rx.seat(request.sender_node, seats, limits)
        if isinstance(seated, rx.SeatRefusal):
            return seated
        staying = [s for s in sessions if s.core.session != seated.evict]
        refusal = rx.admit(
            request,
            limits,
            sessions=len(staying),
            reserved_bytes=sum(s.core.open.max_bytes for s in staying),
            free_bytes=free,
            unwritten_bytes=sum(s.core.unwritten for s in staying),
        )
        return seated if refusal is None else refusal

    def _preempt(self, ctx: ActorContext, session_id: str, newcomer: str) -> None:
        """Aborts an empty session (`preempted`) so that a sender under its share takes its place."""
        session = self._sessions[session_id]
        detail = f"an empty session of {session.core.open.sender_node}, over its share, gave its place to {newcomer}"
        now = asyncio.get_running_loop().time()
        self._perform(ctx, session, session.core.handle(rx.Failed(rx.ReceiveReason.PREEMPTED, detail, now)))

    # -- the session messages, in order --

    async def _dispatch(self, ctx: ActorContext, sub: Any) -> None:
        try:
            async for msg in sub.messages:
                try:
                    await self._on_session_message(ctx, msg)
                except Exception as exc:  # one message's failure is that message's, never the actor's
                    ctx.log.exception("handoff_message_failed", subject=msg.subject, error=repr(exc))
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _on_session_message(self, ctx: ActorContext, msg: Msg) -> None:
        parts = msg.subject.split(".")
        session_id, verb = parts[-2], parts[-1]
        session = self._sessions.get(session_id)
        now = asyncio.get_running_loop().time()
        if verb == "open":  # `<node>.<sender>.open`: the token before the verb is the sender, not a session
            # handled within the open's trace (its traceparent, or a fresh trace), as an endpoint's request is:
            # the session task it starts, the spans and the events it records carry it
            with tracing.use(tracing.incoming(msg.headers)):
                ctx.spawn(self._on_bound_open(ctx, msg, session_id), "open")
            return
        if verb == "data":
            if session is not None:
                self._perform(
                    ctx, session, session.core.handle(rx.ChunkArrived(msg.headers or {}, len(msg.data), now)), msg.data
                )
            return
        if verb == "commit":
            if not reply_allowed(msg.reply):
                # Dropped before any work, as an endpoint drops it: a commit names where its result goes, and a
                # result (or refusal) aimed at a bucket key or an event subject would be written there with this
                # node's rights. The session goes on waiting for a commit it may answer, within its deadlines.
                refuse_reply(ctx.log, msg.subject, msg.reply, session=session_id)
                return
            try:
                commit = decode_checked(msg.data, HandoffCommit, f"message on {msg.subject!r}")
            except BadMessage as exc:
                await _reply_error(ctx, msg, exc.to_reply())
                return
            if commit.session != session_id:
                reply = BadMessage("commit", "session differs from the subject's", "$.session").to_reply()
                await _reply_error(ctx, msg, reply)
                return
            if session is None:
                await _reply_error(ctx, msg, ErrorReply(code=NOT_FOUND, message=f"no open session {session_id}"))
                return
            if session.commit is not None:
                reply = BadMessage("commit", "this session's commit was already received").to_reply()
                await _reply_error(ctx, msg, reply)
                return
            session.commit = msg
            if session.direct and not session.stream_ended.is_set():
                # the commit overtook the stream's last chunks (two channels): judged once the stream ended
                ctx.spawn(self._commit_after_stream(ctx, session, commit), "commit-after-stream")
                return
            self._perform(ctx, session, session.core.handle(rx.CommitArrived(commit, now)))
            return
        if verb == "abort":
            try:
                abort = decode_checked(msg.data, HandoffAbort, f"message on {msg.subject!r}")
            except BadMessage as exc:
                await _reply_error(ctx, msg, exc.to_reply())
                return
            if session is not None and abort.session == session_id:
                self._perform(ctx, session, session.core.handle(rx.SenderAborted(abort.reason, abort.detail, now)))
            return
        await _reply_error(ctx, msg, BadMessage(msg.subject, f"unknown verb {verb[:32]!r}").to_reply())

    async def _on_bound_open(self, ctx: ActorContext, msg: Msg, sender: str) -> None:
        """An open on `<node>.<sender>.open`: nats-server lets a node publish there with its own id only, so an
        open whose `sender_node` is another node's is refused; the rest is the endpoint's (`_on_open`)."""
        if not reply_allowed(msg.reply):
            refuse_reply(ctx.log, msg.subject, msg.reply)
            return
        try:
            request = decode_checked(msg.data, HandoffOpen, f"message on {msg.subject!r}")
        except BadMessage as exc:
            await _reply_error(ctx, msg, exc.to_reply())
            return
        if request.sender_node != sender:
            detail = f"sender_node {request.sender_node!r} differs from the subject's {sender!r}"
            await _reply_error(ctx, msg, BadMessage("open", detail, "$.sender_node").to_reply())
            return
        try:
            async with asyncio.timeout(self.limits.open_timeout_s):
                opened = await self._on_open(request)
        except RequestError as exc:
            await _reply_error(ctx, msg, exc.reply)
            return
        except TimeoutError:
            await _reply_error(ctx, msg, ErrorReply(code=BUSY, message="the open took too long; retry"))
            return
        except Exception as exc:  # a bug met by one open: that open's, never the actor's
            ctx.log.exception("handoff_open_failed", sender=sender, error=repr(exc))
            await _reply_error(ctx, msg, ErrorReply(code=INTERNAL, message=f"the open failed: {exc!r}"[:512]))
            return
        await _answer(ctx, msg, encode(opened))

    async def _commit_after_stream(self, ctx: ActorContext, session: _Session, commit: HandoffCommit) -> None:
        """A commit judged once the session's direct stream ended (or after the idle timeout: the core then finds
        what is missing)."""
        assert self._rx_limits is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._rx_limits.idle_timeout_s):
                await session.stream_ended.wait()
        if session.core.state not in (rx.State.DONE, rx.State.ABORTED):
            now = asyncio.get_running_loop().time()
            self._perform(ctx, session, session.core.handle(rx.CommitArrived(commit, now)))

    def _perform(
        self, ctx: ActorContext, session: _Session, actions: Sequence[rx.Action], data: bytes | bytearray = b""
    ) -> None:
        """Carries out the core's actions; never waits (publishes are buffered by the client)."""
        core = session.core
        for action in actions:
            if isinstance(action, rx.Stage):
                session.queue.put_nowait((action, data))
            elif isinstance(action, rx.Grant):
                self._publish(ctx, core.open.credit_subject, CreditGrant(session=core.session, limit=action.limit))
            elif isinstance(action, rx.Restore):
                session.queue.put_nowait(_RestoreNow(action))
            elif isinstance(action, rx.Answer):
                if session.commit is not None:
                    ctx.spawn(_answer(ctx, session.commit, encode(action.result)), "answer")
                session.queue.put_nowait(_Stop())
            elif isinstance(action, rx.Abort):
                if action.notify_sender:
                    aborted = SessionAborted(
                        session=core.session, reason=action.reason.value, detail=action.detail[:1024]
                    )
                    self._publish(ctx, core.open.credit_subject, aborted)
                session.queue.put_nowait(_Stop())

    def _publish(self, ctx: ActorContext, subject: str, message: Any) -> None:
        ctx.spawn(_publish_quietly(ctx, subject, encode(message)), "publish")

    async def _run_session(self, ctx: ActorContext, session: _Session) -> None:
        """Stages the session's chunks, enforces its deadline, restores it; frees its staging at the end. A hop
        of the trace its open came with (started from the open's handler, the task runs within it)."""
        with tracing.hop("handoff receive", kind="server") as span:
            open_ = session.core.open
            span.update({"mesh.node": ctx.node_id, "mesh.handoff.sender": open_.sender_node,
                         "mesh.tokens": open_.n_tokens, "mesh.handoff.max_bytes": open_.max_bytes})  # fmt: skip
            await self._run_session_traced(ctx, session)

    async def _run_session_traced(self, ctx: ActorContext, session: _Session) -> None:
        core = session.core
        loop = asyncio.get_running_loop()
        try:
            while True:
                deadline = core.next_deadline
                if deadline is None and session.queue.empty() and session.held is None:
                    break
                if session.held is not None:
                    item, session.held = session.held, None
                else:
                    try:
                        async with asyncio.timeout_at(deadline if deadline is not None else loop.time() + 1.0):
                            item = await session.queue.get()
                    except TimeoutError:
                        self._perform(ctx, session, core.handle(rx.Tick(loop.time())))
                        continue
                if isinstance(item, _Stop):
                    if core.next_deadline is None:
                        break
                    continue
                try:
                    if isinstance(item, _RestoreNow):
                        await self._restore_one(ctx, session, item.action)
                    else:
                        await self._stage(ctx, session, self._batch(session, item))
                except OSError as exc:
                    failed = rx.Failed(rx.ReceiveReason.STAGING_FAILED, str(exc), loop.time())
                    self._perform(ctx, session, core.handle(failed))
                except Exception as exc:  # a bug met by one session: that session fails, the actor keeps serving
                    ctx.log.exception("handoff_session_failed", session=core.session, error=repr(exc))
                    self._perform(
                        ctx, session, core.handle(rx.Failed(rx.ReceiveReason.INTERNAL, repr(exc), loop.time()))
                    )
                if (deadline := core.next_deadline) is not None and loop.time() >= deadline:
                    self._perform(ctx, session, core.handle(rx.Tick(loop.time())))
        except asyncio.CancelledError:
            core.handle(rx.Failed(rx.ReceiveReason.SHUTDOWN, "the handoff actor stopped", loop.time()))
            raise
        finally:
            self._sessions.pop(core.session, None)
            _free(session)
            self._record(ctx, session, loop.time())

    @staticmethod
    def _batch(session: _Session, first: _Chunk) -> list[_Chunk]:
        """`first` and the chunks queued behind it (up to `_BATCH_BYTES`): one worker-thread call for all."""
        batch, size = [first], first[0].size
        while size < _BATCH_BYTES and not session.queue.empty():
            item = session.queue.get_nowait()
            if not isinstance(item, tuple):
                session.held = item  # handled next, after this batch
                break
            batch.append(item)
            size += item[0].size
        return batch

    async def _stage(self, ctx: ActorContext, session: _Session, batch: list[_Chunk]) -> None:
        core = session.core
        if core.state is rx.State.ABORTED or session.fd is None:
            return
        digests = await asyncio.to_thread(_write_and_hash, session, batch)
        now = asyncio.get_running_loop().time()
        if self._rx_limits is not None:  # other sessions may have ended or shrunk: this one's next grant may grow
            others = (s.core.credit_reserved for s in self._sessions.values() if s is not session)
            core.widen(rx.session_window(self._rx_limits, others))
        for (stage, _), digest in zip(batch, digests, strict=True):
            self._perform(ctx, session, core.handle(rx.ChunkStaged(stage.index, stage.chunk, stage.size, digest, now)))

    async def _restore_one(self, ctx: ActorContext, session: _Session, action: rx.Restore) -> None:
        core, open_ = session.core, session.core.open
        loop = asyncio.get_running_loop()
        _close(session)  # the staged file stays: the hook reads it by path
        state = CommittedHandoff(
            session=core.session,
            sender_node=open_.sender_node,
            identity=open_.identity,
            n_tokens=open_.n_tokens,
            tokens=open_.tokens,
            continuation_token=open_.continuation_token,
            payload_kind=open_.payload_kind,
            total_bytes=action.total_bytes,
            payload_digest=action.payload_digest,
            segments=action.segments,
            path=session.path,
        )
        started = loop.time()
        deadline = core.next_deadline
        try:
            async with asyncio.timeout_at(deadline):  # a link probe's verified bytes are thrown away
                restored = None if open_.payload_kind == PROBE_PAYLOAD_KIND else await self._restore(state)
        except TimeoutError:
            self._perform(ctx, session, core.handle(rx.Tick(loop.time())))
            return
        except Exception as exc:  # the hook's failure is this session's, never the actor's
            ctx.log.warning("handoff_restore_failed", session=core.session, error=repr(exc))
            self._perform(ctx, session, core.handle(rx.RestoreFailed(repr(exc)[:1024], loop.time())))
            return
        elapsed = round((loop.time() - started) * 1000, 3)
        self._perform(ctx, session, core.handle(rx.Restored(restored, elapsed, loop.time())))

    def _record(self, ctx: ActorContext, session: _Session, now: float) -> None:
        core = session.core
        open_ = core.open
        if core.state is rx.State.DONE and core.restored is not None:
            ctx.emit(
                HandoffCommitted,
                session=core.session,
                sender_node=open_.sender_node,
                identity=open_.identity,
                n_tokens=open_.n_tokens,
                bytes=core.received,
                segments=len(core.progress.observed),
                payload_digest=layout.payload_root(tuple(core.progress.observed)),
                restored=core.restored.restored,
                transfer_ms=round((now - core.opened_at) * 1000, 3),
                restore_ms=core.restored.restore_ms,
                transport="direct" if session.direct else "nats",
            )
            ctx.log.info("handoff_committed", session=core.session, bytes=core.received, peer=open_.sender_node)
            return
        reason = core.reason.value if core.reason else rx.ReceiveReason.SHUTDOWN.value
        ctx.emit(
            HandoffAborted,
            session=core.session,
            peer=open_.sender_node,
            role="receiver",
            reason=reason,
            detail=core.detail[:1024],
            bytes=core.received,
        )
        ctx.log.info("handoff_aborted", session=core.session, reason=reason, detail=core.detail, role="receiver")

    # ---- sending ---------------------------------------------------------------------------------------------

    async def send(
        self,
        peer: str,
        source: Path | AsyncIterable[bytes],
        *,
        identity: str,
        n_tokens: int,
        tokens: Sequence[int] = (),
        continuation_token: int | None = None,
        payload_kind: str = "llama_slot",
        max_bytes: int | None = None,
    ) -> HandoffReport:
        """Streams `source` to `peer`'s handoff actor and waits for its result (restore included).

        `source`: a finished file (cut into `segment_bytes` segments, its size announced at open), or an async
        iterator of segment bytes (each at most `layout.MAX_SEGMENT_BYTES`; then `max_bytes`, the
        most it can add up to, is required). Raises `HandoffFailed` (reason and detail) if it did not commit."""
        ctx = self._ctx
        if ctx is None:
            raise HandoffFailed(tx.SendReason.CANCELLED.value, "the handoff actor is not running")
        check_token(peer, "peer node")
        segments: AsyncIterator[tuple[bytes, str | None]]
        specs: tuple[SegmentSpec, ...] = ()
        total: int | None = None
        if isinstance(source, Path):
            try:
                total = (await asyncio.to_thread(os.stat, source)).st_size
            except OSError as exc:
                raise HandoffFailed(tx.SendReason.SOURCE_FAILED.value, f"cannot read {source}: {exc}") from exc
            max_bytes = total
            segments = _file_segments(source, total, self.limits.segment_bytes)
        else:
            if max_bytes is None:
                raise ValueError("a streamed source needs max_bytes")
            segments = _hashed(source)
        inbox = ctx.bus.nc.new_inbox()
        open_ = HandoffOpen(
            sender_node=self.node_id,
            identity=identity,
            n_tokens=n_tokens,
            tokens=tuple(tokens),
            continuation_token=continuation_token,
            payload_kind=payload_kind,
            total_bytes=total,
            max_bytes=max_bytes,
            segments=specs,
            payload_digest=layout.payload_root([SegmentRef(s.index, s.offset, s.length, s.digest) for s in specs])
            if specs
            else None,
            credit_subject=inbox,
            direct=self.datapath is not None,
        )
        with tracing.hop("handoff send", kind="client") as span:
            span.update({"mesh.node": ctx.node_id, "mesh.handoff.peer": peer, "mesh.tokens": n_tokens,
                         "mesh.handoff.max_bytes": max_bytes})  # fmt: skip
            report = await _Send(ctx, self.limits, peer, open_, inbox, self.datapath).run(segments)
            span.update({"mesh.handoff.bytes": report.bytes, "mesh.handoff.segments": report.segments})
            return report


class _Send:
    """One sending session: the core, the credit subscription, the publishing loop."""

    def __init__(
        self,
        ctx: ActorContext,
        limits: HandoffLimits,
        peer: str,
        open_: HandoffOpen,
        inbox: str,
        datapath: DataPathConfig | None = None,
    ) -> None:
        self.ctx = ctx
        self.peer = peer
        self.inbox = inbox
        self.datapath = datapath
        self.stream: PushStream | None = None  # the direct stream the chunks go on, when it opened
        self.transport = "nats"
        self.fallback = ""
        self.loop = asyncio.get_running_loop()
        self.core = tx.Sender(
            open_,
            tx.SenderLimits(
                open_timeout_s=limits.open_timeout_s,
                commit_timeout_s=limits.commit_timeout_s,
                deadline_s=limits.deadline_s,
                credit_stall_s=limits.credit_stall_s,
                max_chunk_bytes=chunk_bytes(ctx.bus.max_payload),
            ),
            self.loop.time(),
        )
        self.credit = asyncio.Event()
        self.log = get_logger(actor="handoff", node=ctx.node_id, peer=peer)

    async def _on_control(self, msg: Msg) -> None:
        try:
            control: CreditGrant | SessionAborted = decode_checked(
                msg.data,
                HandoffControl,  # type: ignore[arg-type]
                "handoff control",
            )
        except BadMessage as exc:
            self.log.warning("handoff_bad_control", error=str(exc))
            return
        if control.session != self.core.session:
            return
        now = self.loop.time()
        if isinstance(control, CreditGrant):
            self._act(self.core.handle(tx.Credit(control.limit, now)))
        else:
            self._act(self.core.handle(tx.ReceiverAborted(control.reason, control.detail, now)))
        self.credit.set()

    def _act(self, actions: Sequence[tx.Action]) -> None:
        for action in actions:
            if isinstance(action, tx.Abort) and action.notify_receiver and self.core.reply is not None:
                abort = HandoffAbort(session=self.core.session, reason=action.reason.value, detail=action.detail[:1024])
                subject = self.core.reply.subject + ".abort"
                self.ctx.spawn(_publish_quietly(self.ctx, subject, encode(abort)), "abort")

    def _failed(self) -> HandoffFailed:
        core = self.core
        reason = core.reason.value if core.reason else tx.SendReason.UNEXPECTED.value
        self.ctx.emit(
            HandoffAborted,
            session=core.session,
            peer=self.peer,
            role="sender",
            reason=reason,
            detail=core.detail[:1024],
            bytes=core.sent,
        )
        self.log.info("handoff_aborted", session=core.session, reason=reason, detail=core.detail, role="sender")
        return HandoffFailed(reason, core.detail, session=core.session)

    def _check(self) -> None:
        if self.core.state is tx.State.ABORTED:
            raise self._failed()

    async def run(self, segments: AsyncIterator[tuple[bytes, str | None]]) -> HandoffReport:
        nc = self.ctx.bus.nc
        sub = await nc.subscribe(self.inbox, cb=self._on_control)
        try:
            try:
                return await self._run(segments)
            except BaseExceptionGroup as group:  # from the prefetch task group: the first error is the one
                raise _first(group) from None
            except asyncio.CancelledError:
                self._act(self.core.handle(tx.Failed(tx.SendReason.CANCELLED, "the caller gave up", self.loop.time())))
                raise
        finally:
            await self._close_stream()
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await segments.aclose()  # type: ignore[attr-defined]

    def _remaining(self) -> float:
        deadline = self.core.next_deadline
        return max(0.001, (deadline if deadline is not None else self.loop.time()) - self.loop.time())

    async def _run(self, segments: AsyncIterator[tuple[bytes, str | None]]) -> HandoffReport:
        started = self.loop.time()
        ready: asyncio.Queue[tuple[bytes, str] | BaseException | None] = asyncio.Queue(maxsize=1)
        async with asyncio.TaskGroup() as tg:
            # The next segment is read (or produced) and hashed while this one is published; the session is
            # opened once the first one is in hand, so the receiver holds no place for a sender with no bytes.
            producer = tg.create_task(_prefetch(segments, ready), name="handoff:prefetch")
            try:
                first = await self._first_segment(ready)
                await self._open()
                assert self.core.reply is not None
                await self._open_direct(self.core.reply)
                await self._publish_all(self.core.reply.subject + ".data", ready, first)
            finally:
                producer.cancel()
        return await self._commit(started)

    async def _first_segment(
        self, ready: asyncio.Queue[tuple[bytes, str] | BaseException | None]
    ) -> tuple[bytes, str] | None:
        """The source's first segment (None: it has none), within the send's overall deadline; a source that
        fails first fails the send before anything is opened. The session's clock starts once the segment is
        in hand: a prefill may take a while, and no receiver waits for it."""
        core = self.core
        first: tuple[bytes, str] | BaseException | None
        try:
            async with asyncio.timeout(core.limits.deadline_s):
                first = await ready.get()
        except TimeoutError:
            first = TimeoutError(f"the source produced nothing within {core.limits.deadline_s:g}s")
        if isinstance(first, BaseException):
            self._act(core.handle(tx.Failed(tx.SendReason.SOURCE_FAILED, repr(first)[:512], self.loop.time())))
            raise self._failed()
        self.core = tx.Sender(core.open, core.limits, self.loop.time())
        return first

    async def _open(self) -> None:
        core, ctx = self.core, self.ctx
        subject = ctx.subjects.handoff_open(self.peer, core.open.sender_node)
        try:
            opened = await ctx.bus.request(subject, core.open, HandoffOpened, timeout=self._remaining())
        except RemoteError as exc:
            self._act(core.handle(tx.OpenRefused(exc.code, exc.reply.message, self.loop.time())))
        except RequestTimeout:
            detail = f"no answer to the open within {core.limits.open_timeout_s:g}s"
            self._act(core.handle(tx.Failed(tx.SendReason.OPEN_TIMEOUT, detail, self.loop.time())))
        except PayloadTooLarge as exc:  # the open (its token list) does not fit the bus's max_payload
            self._act(core.handle(tx.Failed(tx.SendReason.TOO_LARGE, str(exc), self.loop.time())))
        except (NoResponders, BusError, nats.errors.Error) as exc:
            self._act(core.handle(tx.OpenRefused("unreachable", str(exc), self.loop.time())))
        else:
            # The only subject this session's state may go to: the receiver's word for it is checked against it.
            expected = ctx.subjects.handoff_session(self.peer, opened.session)
            self._act(core.handle(tx.Opened(opened, self.loop.time(), expected)))
        self._check()

    async def _open_direct(self, opened: HandoffOpened) -> None:
        """The direct stream the receiver offered, when it opens; else the chunks go over NATS (and the report
        says why)."""
        if opened.direct is None or self.datapath is None:
            if self.datapath is not None:
                self.fallback = "the receiver offered no direct stream"
            return
        hello = DataHello(
            ticket=opened.direct.ticket,
            receiver=self.core.open.sender_node,
            digest=self.core.open.identity,
            offset=0,
            length=self.core.open.max_bytes,
            chunk=opened.chunk_bytes,
        )
        try:
            self.stream = await open_push(opened.direct, hello, tls=self.datapath.tls, limits=self.datapath.limits)
        except DataUnavailable as exc:
            self.fallback = str(exc)[:1024]
            self.log.info("handoff_direct_unavailable", session=self.core.session, error=self.fallback)
            return
        self.transport = "direct_tls" if opened.direct.tls else "direct"

    async def _close_stream(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            with contextlib.suppress(OSError, TimeoutError):
                await stream.close()

    async def _commit(self, started: float) -> HandoffReport:
        core, ctx = self.core, self.ctx
        assert core.reply is not None
        await self._close_stream()  # every chunk is on its way; the receiver reads the stream to its end
        self._act(core.handle(tx.EndOfPayload(self.loop.time())))
        self._check()
        commit = HandoffCommit(
            session=core.session,
            n_segments=len(core.segments),
            total_bytes=core.produced,
            n_tokens=core.open.n_tokens,
            payload_digest=layout.payload_root(core.segments),
        )
        try:
            reply = await ctx.bus.request_raw(core.reply.subject + ".commit", encode(commit), timeout=self._remaining())
            result = parse_reply(core.reply.subject, reply, HandoffResult)
        except RequestTimeout:
            detail = f"no result within {core.limits.commit_timeout_s:g}s"
            self._act(core.handle(tx.Failed(tx.SendReason.COMMIT_TIMEOUT, detail, self.loop.time())))
        except (BusError, nats.errors.Error) as exc:
            self._act(core.handle(tx.Failed(tx.SendReason.BUS_ERROR, str(exc), self.loop.time())))
        else:
            self._act(core.handle(tx.ResultArrived(result, self.loop.time())))
        self._check()
        final = core.result
        assert final is not None
        result = final
        report = HandoffReport(
            session=core.session,
            peer=self.peer,
            bytes=result.bytes,
            segments=result.segments,
            payload_digest=result.payload_digest or "",
            transfer_ms=round((self.loop.time() - started) * 1000, 3),
            restored=result.restored,
            restore_ms=result.restore_ms,
            transport=self.transport,
            fallback=self.fallback,
        )
        self.log.info("handoff_sent", session=core.session, bytes=report.bytes, transfer_ms=report.transfer_ms)
        return report

    async def _publish_all(
        self,
        subject: str,
        ready: asyncio.Queue[tuple[bytes, str] | BaseException | None],
        first: tuple[bytes, str] | None,
    ) -> None:
        core = self.core
        item: tuple[bytes, str] | BaseException | None = first
        taken = True
        while True:
            if not taken:
                try:
                    # Sliced, so an abort by the receiver (which arrives on the credit subscription) ends the send
                    # while the source is still producing the next segment.
                    async with asyncio.timeout(min(self._remaining(), _SOURCE_POLL_S)):
                        item = await ready.get()
                except TimeoutError:
                    self._act(core.handle(tx.Tick(self.loop.time())))
                    self._check()
                    continue
            taken = False
            if isinstance(item, BaseException):  # the source's failure (a prefill that died): the session's
                self._act(core.handle(tx.Failed(tx.SendReason.SOURCE_FAILED, repr(item)[:512], self.loop.time())))
                self._check()
            if item is None or isinstance(item, BaseException):
                return
            data, digest = item
            self._act(core.handle(tx.SegmentReady(len(data), digest, self.loop.time())))
            self._check()
            await self._publish_segment(subject, memoryview(data))

    async def _publish_segment(self, subject: str, data: memoryview) -> None:
        core, nc = self.core, self.ctx.bus.nc
        assert core.reply is not None
        session = core.session
        while True:
            batch: list[tuple[dict[str, str], Any]] = []
            for chunk in core.sendable():
                # A memoryview slice: the client joins it into its write buffer without another copy.
                part: Any = data[chunk.chunk : chunk.chunk + chunk.size]
                headers = tx.chunk_headers(session, chunk.segment, chunk.chunk)
                if self.stream is None:
                    await nc.publish(subject, part, headers=headers)
                else:
                    batch.append((headers, part))  # what the credit allows, written in one go
            if batch and self.stream is not None:
                try:
                    await self.stream.send(batch)
                except (OSError, TimeoutError) as exc:
                    detail = f"the direct stream broke: {exc!r}"[:512]
                    self._act(core.handle(tx.Failed(tx.SendReason.BUS_ERROR, detail, self.loop.time())))
                    self._check()
            if not core.pending:
                return
            self.credit.clear()
            if core.blocked:
                try:
                    async with asyncio.timeout(self._remaining()):
                        await self.credit.wait()
                except TimeoutError:
                    self._act(core.handle(tx.Tick(self.loop.time())))
            self._check()


# ---- helpers -----------------------------------------------------------------------------------------------


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


async def _publish_quietly(ctx: ActorContext, subject: str, payload: bytes) -> None:
    with contextlib.suppress(nats.errors.Error):
        await ctx.bus.nc.publish(subject, payload)


async def _answer(ctx: ActorContext, msg: Msg, payload: bytes, headers: dict[str, str] | None = None) -> None:
    """Answers `msg` only on an inbox (`Bus.respond`): a requester names the reply subject, and this node would
    write there with its own rights."""
    await ctx.bus.respond(msg, payload, headers=headers)


async def _reply_error(ctx: ActorContext, msg: Msg, reply: ErrorReply) -> None:
    if msg.reply:  # a message that asks for no answer gets none (a chunk, an abort)
        await _answer(ctx, msg, encode(reply), error_headers(reply))


def _fresh_dir(path: Path) -> None:  # worker thread
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _close(session: _Session) -> None:
    with session.writing:  # at most one chunk's write (milliseconds) to wait for
        if session.fd is not None:
            with contextlib.suppress(OSError):
                os.close(session.fd)
            session.fd = None


def _free(session: _Session) -> None:
    _close(session)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(session.path)


def _write_and_hash(session: _Session, batch: list[_Chunk]) -> list[str | None]:  # worker thread
    """Writes each chunk at its place and hashes it into its segment; a segment's blake3 where one ends."""
    digests: list[str | None] = []
    for stage, data in batch:
        with session.writing:
            if session.fd is None:
                raise OSError("the staging file is closed")
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.pwrite(session.fd, view[written:], stage.payload_offset + written)
        if stage.first:
            session.hasher = blake3.blake3()
        session.hasher.update(data)
        digests.append(str(session.hasher.hexdigest()) if stage.last else None)
    return digests


def _blake3(data: bytes) -> str:  # worker thread
    return str(blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest())


def _read_range(path: Path, offset: int, length: int) -> bytes:  # worker thread
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise OSError(f"{path} shrank while it was sent")
    return data


async def _file_segments(path: Path, size: int, segment_bytes: int) -> AsyncIterator[tuple[bytes, str | None]]:
    """The file's segments, read one at a time (each hashed by `_prefetch` while the previous one is sent: no
    pass over the file before the first byte moves). A file that shrinks is a source failure; the receiver
    checks the total the open announced."""
    for _, offset, length in layout.plan_segments(size, segment_bytes):
        yield await asyncio.to_thread(_read_range, path, offset, length), None


async def _prefetch(
    segments: AsyncIterator[tuple[bytes, str | None]], ready: asyncio.Queue[tuple[bytes, str] | BaseException | None]
) -> None:
    """Feeds `ready` with each segment and its blake3 (hashed here when the source did not know it), then None;
    a failure of the source is put in the queue, for the sender core to judge."""
    try:
        async for data, digest in segments:
            known = digest if digest is not None else await asyncio.to_thread(_blake3, data)
            await ready.put((data, known))
    except Exception as exc:
        await ready.put(exc)
        return
    await ready.put(None)


async def _hashed(source: AsyncIterable[bytes]) -> AsyncIterator[tuple[bytes, str | None]]:
    async for data in source:
        yield bytes(data), None
