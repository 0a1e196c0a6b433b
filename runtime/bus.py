"""The bus: one NATS connection, typed publish/request helpers over msgspec Structs, and their errors.

Control messages are JSON encoded by msgspec. Encoders and typed decoders are built once per type and
reused. Everything that can go wrong on the way is a `BusError` subclass with a message a person can act
on: no responders is immediate, a payload over the server's `max_payload` fails at the sender naming both
sizes, every request has a deadline, and an error reply from a service is raised as `RemoteError` with its
stable code. A request or publish made while serving a request carries that request's W3C `traceparent`
header (`runtime/tracing.py`), so the next hop runs in the same trace.

A responder answers only on an inbox (`reply_allowed`): a requester's `_INBOX.…`, or the `_R_.…` subject
nats-server maps a request from another account to. A reply subject is chosen by the requester, so answering
on any other one would write where the requester pointed (a bucket key, an event subject) with the
responder's rights. Accounts already keep clients' replies out of the mesh (`runtime.roles`); this is the wall
between the mesh's own users.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import msgspec
import nats
import nats.aio.client
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from messages.errors import (
    BAD_REQUEST,
    ERROR_CODE_HEADER,
    ERROR_HEADER,
    MESH_ERROR_HEADER,
    ErrorReply,
    http_status,
)
from messages.subjects import check_token
from runtime import tracing
from runtime.config import NatsOptions
from runtime.creds import CredentialsError, with_creds_file
from runtime.logging import get_logger
from runtime.roles import inbox_prefix

T = TypeVar("T")

# How much nats-py reads from its socket at a time, and its stream reader's limit (it stops reading past twice
# that until the parser catches up). Its default, 32 KiB, is a thirty-second of one 1 MiB message: a receiver
# of KV chunks spent a fifth of its event loop pausing and resuming its reader (one epoll_ctl each time).
# nats-py takes it from this module constant at connect and at every read; it has no option for it.
NATS_READ_BYTES = 1 << 20
nats.aio.client.DEFAULT_BUFFER_SIZE = NATS_READ_BYTES

#: Where a responder may answer: a requester's inbox, or nats-server's mapping of a cross-account request's
#: reply (service imports). Gateways' `_GR_.` mappings carry a subject of the requester's choosing: not here.
REPLY_ROOTS: Final = ("_INBOX.", "_R_.")

_ENCODER = msgspec.json.Encoder()
_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}
_ERROR_DECODER = msgspec.json.Decoder(ErrorReply)
_PATH = re.compile(r"- at `([^`]*)`$")


def encode(message: Any) -> bytes:
    """JSON bytes of a Struct (or any msgspec-encodable value)."""
    return _ENCODER.encode(message)


def decoder(message_type: Any) -> msgspec.json.Decoder[Any]:
    """The cached typed decoder for `message_type`."""
    dec = _DECODERS.get(message_type)
    if dec is None:
        dec = _DECODERS[message_type] = msgspec.json.Decoder(message_type)
    return dec


def decode(data: bytes, message_type: type[T]) -> T:
    result: T = decoder(message_type).decode(data)
    return result


class BusError(Exception):
    """Something on the bus failed; the message says what and where."""


class ConnectFailed(BusError):
    pass


class NoResponders(BusError):
    def __init__(self, subject: str) -> None:
        super().__init__(f"no service is listening on {subject!r} (no responders)")
        self.subject = subject


class RequestTimeout(BusError):
    def __init__(self, subject: str, timeout: float) -> None:
        super().__init__(f"no reply on {subject!r} within {timeout:g}s")
        self.subject = subject
        self.timeout = timeout


class PayloadTooLarge(BusError):
    def __init__(self, subject: str, size: int, max_payload: int) -> None:
        super().__init__(
            f"message for {subject!r} is {size} bytes, over the server's max_payload of {max_payload} bytes"
        )
        self.subject = subject
        self.size = size
        self.max_payload = max_payload


class BadMessage(BusError):
    """A payload that is not valid JSON or does not match its schema. `path` locates the schema error."""

    def __init__(self, what: str, error: str, path: str | None = None) -> None:
        super().__init__(f"{what}: {error}")
        self.error = error
        self.path = path

    def to_reply(self) -> ErrorReply:
        details: dict[str, Any] = {"error": self.error}
        if self.path is not None:
            details["path"] = self.path
        return ErrorReply(code=BAD_REQUEST, message=str(self), details=details)


class RemoteError(BusError):
    """A service answered with an error reply."""

    def __init__(self, subject: str, reply: ErrorReply) -> None:
        super().__init__(f"{subject}: {reply.code}: {reply.message}")
        self.subject = subject
        self.code = reply.code
        self.reply = reply


def decode_checked(data: bytes, message_type: type[T], what: str) -> T:
    """Decodes `data`, turning msgspec's errors into `BadMessage` with the offending path."""
    try:
        return decode(data, message_type)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        raise BadMessage(what, text, match.group(1) if match else "$") from exc
    except msgspec.DecodeError as exc:
        raise BadMessage(what, f"malformed JSON: {exc}") from exc
    except RecursionError as exc:  # hostile nesting deeper than the decoder's stack allows
        raise BadMessage(what, "JSON nested too deeply") from exc


def error_headers(reply: ErrorReply) -> dict[str, str]:
    # Nats-Service-Error(-Code) follow the NATS micro convention (a numeric code), so generic tools show it: the
    # registry's HTTP status, the same the front door answers with.
    numeric = str(http_status(reply.code))
    return {ERROR_HEADER: reply.message[:256], ERROR_CODE_HEADER: numeric, MESH_ERROR_HEADER: reply.code}


#: Headers JetStream sets on a stored message it answers with (a direct get), which no publish carries.
_STORED_HEADERS: Final = ("Nats-Stream", "Nats-Sequence")


def stored_answer(msg: Msg) -> bool:
    """Whether a message heard on a live subject is JetStream's answer to a request whose reply subject named it
    (a direct get's stored message): a member may aim JetStream's answers at any subject, and nothing is stored
    there (`runtime.roles`), but a live subscriber would hear bytes of the requester's choosing as if published.
    Live subscribers drop it."""
    headers = msg.headers or {}
    return any(name in headers for name in _STORED_HEADERS)


def reply_allowed(reply: str | None) -> bool:
    """Whether a responder may answer on `reply` (see `REPLY_ROOTS`); a request without one gets no answer."""
    return reply is not None and reply.startswith(REPLY_ROOTS)


def refuse_reply(log: Any, subject: str, reply: str | None, **context: Any) -> None:
    """Logs a request left unanswered because of its reply subject (cut short: the requester chose it)."""
    log.warning("reply_refused", subject=subject, reply=(reply or "")[:128], **context)


def _is_token(text: str) -> bool:
    try:
        check_token(text)
    except ValueError:
        return False
    return True


def inbox_prefix_of(options: NatsOptions) -> str | None:
    """Where a connection as `options` receives replies: `_INBOX.<user>` for a user whose name is one subject
    token (a role's user may read no other inbox), else None (the client library's default)."""
    return inbox_prefix(options.user) if options.user and _is_token(options.user) else None


def _tls_context(options: NatsOptions) -> ssl.SSLContext | None:
    if not (options.tls_ca or options.tls_cert):
        return None
    context = ssl.create_default_context(cafile=options.tls_ca)
    if options.tls_cert:
        context.load_cert_chain(options.tls_cert, options.tls_key)
    return context


class Bus:
    """A connected NATS client with typed helpers. Create with `Bus.connect`; close with `close`."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self._log = get_logger(component="bus")

    @classmethod
    async def connect(
        cls,
        options: NatsOptions,
        *,
        name: str,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
        deadline_s: float = 10.0,
    ) -> Bus:
        """Connects to the first reachable URL within `deadline_s`; reconnects forever afterwards."""
        log = get_logger(component="bus", client=name)

        async def disconnected() -> None:
            if not nc.is_closed and not nc.is_draining:
                log.warning("nats_disconnected")

        async def reconnected() -> None:
            log.info("nats_reconnected", url=str(nc.connected_url.geturl()) if nc.connected_url else None)
            if on_reconnect is not None:
                await on_reconnect()

        last_error: list[str] = []

        async def error(exc: Exception) -> None:
            text = str(exc) or type(exc).__name__
            last_error[:] = [text]
            if nc.is_connected:  # while connecting, the failure is reported once, by ConnectFailed
                log.warning("nats_error", error=text)

        try:
            options = with_creds_file(options)  # our JSON credentials file: user, password, TLS CA, URLs
        except CredentialsError as exc:
            raise ConnectFailed(str(exc)) from exc
        kwargs: dict[str, Any] = {}
        if options.creds_file:
            kwargs["user_credentials"] = options.creds_file
        if options.token:
            kwargs["token"] = options.token
        if options.user:
            kwargs["user"] = options.user
            kwargs["password"] = options.password or ""
        prefix = inbox_prefix_of(options)
        if prefix is not None:  # replies on the user's own inbox, the only one its role may read
            kwargs["inbox_prefix"] = prefix
        try:
            tls = _tls_context(options)
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"cannot set up TLS: {exc}") from exc
        nc = Client()
        urls = ", ".join(options.urls)
        try:
            async with asyncio.timeout(deadline_s):
                await nc.connect(
                    servers=list(options.urls),
                    name=name,
                    tls=tls,
                    connect_timeout=options.connect_timeout_s,  # type: ignore[arg-type]
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,  # type: ignore[arg-type]
                    disconnected_cb=disconnected,
                    reconnected_cb=reconnected,
                    error_cb=error,
                    **kwargs,
                )
        except TimeoutError as exc:
            await _close_quietly(nc)
            reason = last_error[0] if last_error else "no server answered"
            raise ConnectFailed(f"cannot connect to NATS at {urls} within {deadline_s:g}s: {reason}") from exc
        except nats.errors.NoServersError as exc:
            await _close_quietly(nc)
            raise ConnectFailed(f"cannot connect to NATS at {urls}: no server answered") from exc
        except (nats.errors.Error, OSError) as exc:
            await _close_quietly(nc)
            reason = str(exc) or type(exc).__name__
            raise ConnectFailed(f"cannot connect to NATS at {urls}: {reason}") from exc
        return cls(nc)

    @property
    def max_payload(self) -> int:
        return int(self.nc.max_payload)

    def check_size(self, subject: str, payload: bytes) -> None:
        if len(payload) > self.max_payload:
            raise PayloadTooLarge(subject, len(payload), self.max_payload)

    async def publish(self, subject: str, message: Any, headers: dict[str, str] | None = None) -> None:
        """Publishes `message`, with the current request's trace context in its headers (`runtime.tracing`)."""
        payload = encode(message)
        self.check_size(subject, payload)
        await self.nc.publish(subject, payload, headers=tracing.inject(headers))

    async def request(self, subject: str, message: Any, reply_type: type[T], *, timeout: float) -> T:
        """Sends `message`, waits at most `timeout` seconds, returns the typed reply."""
        payload = encode(message)
        self.check_size(subject, payload)
        msg = await self.request_raw(subject, payload, timeout=timeout)
        return parse_reply(subject, msg, reply_type)

    async def respond(self, msg: Msg, payload: bytes, headers: dict[str, str] | None = None) -> bool:
        """Answers `msg` on its reply subject if a responder may (`reply_allowed`); otherwise logs and sends
        nothing. Returns whether it answered. A connection that fails meanwhile is the requester's timeout."""
        if not reply_allowed(msg.reply):
            refuse_reply(self._log, msg.subject, msg.reply)
            return False
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(msg.reply, payload, headers=headers)
        return True

    async def request_raw(self, subject: str, payload: bytes, *, timeout: float) -> Msg:
        """Sends `payload` (with the current request's trace context in its headers), returns the reply."""
        try:
            return await self.nc.request(subject, payload, timeout=timeout, headers=tracing.inject(None))
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(subject) from exc
        except nats.errors.TimeoutError as exc:
            raise RequestTimeout(subject, timeout) from exc
        except nats.errors.MaxPayloadError as exc:  # the server lowered max_payload since we checked
            raise PayloadTooLarge(subject, len(payload), self.max_payload) from exc

    async def close(self) -> None:
        await _close_quietly(self.nc)


def parse_reply(subject: str, msg: Msg, reply_type: type[T]) -> T:
    """Turns a reply into `reply_type`, or raises `RemoteError` for an error reply."""
    headers = msg.headers or {}
    if ERROR_HEADER in headers or MESH_ERROR_HEADER in headers:
        try:
            reply = _ERROR_DECODER.decode(msg.data)
        except msgspec.MsgspecError:
            reply = ErrorReply(
                code=headers.get(MESH_ERROR_HEADER, headers.get(ERROR_CODE_HEADER, "error")),
                message=headers.get(ERROR_HEADER, "error reply without a body"),
            )
        raise RemoteError(subject, reply)
    return decode_checked(msg.data, reply_type, f"reply on {subject!r}")


async def _close_quietly(nc: Client, deadline_s: float = 5.0) -> None:
    if nc.is_closed:
        return
    try:
        async with asyncio.timeout(deadline_s):
            with contextlib.suppress(nats.errors.Error, OSError):  # already gone; nothing more to release
                await nc.close()
    except TimeoutError:
        get_logger(component="bus").warning("nats_close_overdue", deadline_s=deadline_s)


NO_RESPONDERS_RETRY_S: Final = 0.25


async def once_listening(call: Callable[[], Awaitable[T]], deadline: float) -> T:
    """`call()`, made again every `NO_RESPONDERS_RETRY_S` while nobody listens on its subject (a node starting,
    an actor restarting: nothing was sent), until `deadline`; then its last `NoResponders` is raised. What a
    client's retry would do, without the client seeing the gap."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return await call()
        except NoResponders:
            if loop.time() + NO_RESPONDERS_RETRY_S >= deadline:
                raise
            await asyncio.sleep(NO_RESPONDERS_RETRY_S)
