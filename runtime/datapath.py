"""The direct data path (shell): bulk bytes on a TCP stream beside the bus, opened for one transfer.

NATS carries the negotiation (who, what digest, which range, deadlines, refusals, journal events); the bytes of a
model file, an L3 segment or a handoff payload go over a TCP connection from the node that holds them to the
node that takes them (shared/DESIGN.md, "Bulk bytes beside the bus"). The wire is messages/datapath.py; the
ticket rules are runtime/tickets.py. This module is the listener and the client:

* `DataListener` (one per actor that offers bytes): an `asyncio` server. With the node's cluster certificates
  (`TlsFiles`, the route CA derived from the cluster secret, as routes and the RPC tunnel use) it listens on the
  cluster address and completes no TLS handshake without a client certificate under that CA; without them it
  listens on loopback only. Either way every connection must complete its TLS handshake and then present its
  hello, each within `hello_timeout_s` (a slowloris client is cut off there), with a one-shot ticket that the
  listener issued in a NATS reply (`offer`), bound to digest, range, chunk size, receiver and expiry; anything
  else is refused before a byte of data is sent or read. Connections beyond `max_connections` are closed at once.
* `send_range` (the listener's side of a pull): each chunk read and hashed in a worker thread (the next one
  while the current one is written), written as a frame, every drain under the stall deadline.
* `fetch_range` (the asking node's side): connect, handshake, hello and answer, then the frames, all in one
  worker thread on a blocking socket (no event loop hop per chunk: the loop would be the bottleneck): each
  frame's header checked against the plan before its bytes are read (offset, and a length no larger than the
  chunk: nothing is allocated from what the peer says), each chunk's blake3 checked as it lands, then handed
  to the caller's sink (a part file: written, journaled). A peer that sends nothing for `stall_s`, averages
  under `min_rate_bytes_per_s` after `rate_grace_s`, lies about a length, an offset or a hash, or closes early
  is cut off with `DataFailed`; what was handed to the sink stays verified (the caller resumes from it). A
  connection that cannot be opened at all is `DataUnavailable`: the caller falls back to NATS.

Why `asyncio` streams and a blocking socket rather than an HTTP library: the receiver must check every chunk's
hash as it lands and stop reading the moment a frame lies, and a transfer must hold one connection under one
ticket; an HTTP range server (aiohttp's `FileResponse` with sendfile) would serve the bytes but not the
per-chunk hashes, and its client reads through two more buffers. The framing is three fixed fields; the
security is TLS (the standard library's `ssl`) and a random ticket, nothing home-made.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Final, Protocol

import blake3
import msgspec

from messages.datapath import MAX_CONTROL_BYTES, DataAnswer, DataHello, DirectOffer
from runtime.logging import get_logger
from runtime.rpc_tunnel import client_context, server_context
from runtime.tickets import Grant, TicketBook, TicketReason, TicketRefusal
from runtime.tls import TlsFiles

__all__ = [
    "FRAME",
    "DataFailed",
    "DataLimits",
    "DataListener",
    "DataPathConfig",
    "DataUnavailable",
    "PushStream",
    "Sink",
    "chunk_plan",
    "fetch_range",
    "open_push",
    "pushed",
    "receive_pushed",
    "send_file_range",
    "send_range",
]

_log = get_logger(component="datapath")
#: A frame's header: the chunk's offset (u64), its length (u32) and its blake3 (32 raw bytes), big-endian.
FRAME: Final = struct.Struct("!QI32s")
_LENGTH: Final = struct.Struct("!I")
_LOOPBACK: Final = "127.0.0.1"
_READ_LIMIT: Final = 4 << 20


@dataclass(frozen=True, slots=True)
class DataLimits:
    hello_timeout_s: float = 5.0  # from accept to a whole hello (the TLS handshake included)
    connect_timeout_s: float = 3.0  # a firewalled peer is given up (and NATS used) after this
    stall_s: float = 10.0  # no byte moving for this long cuts the connection (either side)
    min_rate_bytes_per_s: float = float(1 << 20)  # and, after rate_grace_s, no less than this on average
    rate_grace_s: float = 10.0
    ticket_ttl_s: float = 30.0  # a ticket opens a connection within this of its issue, or never
    max_connections: int = 16  # accepted connections at once, per listener
    max_tickets: int = 256  # live tickets per listener
    max_chunk_bytes: int = 16 << 20  # the largest frame either side accepts


@dataclass(frozen=True, slots=True)
class DataPathConfig:
    """Where a node's data listeners listen and what they require. Without `tls` they listen on loopback only
    (a peer on another machine cannot connect, and falls back to NATS)."""

    bind: str = _LOOPBACK
    advertise: str = _LOOPBACK  # the address peers dial (a name the certificate holds, with TLS)
    tls: TlsFiles | None = None
    limits: DataLimits = DataLimits()

    @classmethod
    def loopback(cls, limits: DataLimits | None = None) -> DataPathConfig:
        return cls(limits=limits or DataLimits())

    @classmethod
    def for_node(cls, tls: TlsFiles | None, cluster_host: str | None) -> DataPathConfig:
        """A node's: with its cluster certificates, on its cluster address (a wildcard one is dialled by this
        host's name, which the certificate holds); without them, loopback only."""
        if tls is None or not cluster_host:
            return cls()
        advertise = socket.getfqdn() if cluster_host in ("0.0.0.0", "::") else cluster_host
        return cls(bind=cluster_host, advertise=advertise, tls=tls)


def machine_id() -> str:
    """This machine, as loopback offers name it: a digest of the kernel's boot id and the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read(64)
    except OSError:
        boot = b""
    return str(blake3.blake3(boot + socket.gethostname().encode()).hexdigest()[:32])


_MACHINE: Final = machine_id()


class DataUnavailable(Exception):
    """The direct connection could not be opened (refused, firewalled, no handshake, no ticket): use NATS."""


class DataFailed(Exception):
    """The direct transfer broke off: the peer refused the hello, stalled, lied or closed early. `reason` names
    it; what was handed to the sink before it stays verified."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Sink(Protocol):
    """Where verified chunks go (called in the receiving worker thread, in order)."""

    def __call__(self, offset: int, data: memoryview, digest: str, /) -> None: ...


#: The listener's work on an accepted connection (sending a range, or taking a push).
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, Grant[Any]], Awaitable[None]]


# ---- control messages on the stream ------------------------------------------------------------------------


def _control(message: msgspec.Struct) -> bytes:
    body = msgspec.json.encode(message)
    return _LENGTH.pack(len(body)) + body


async def _read_control_async(reader: asyncio.StreamReader) -> DataHello:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_CONTROL_BYTES:
        raise ValueError(f"a hello of {size} bytes (at most {MAX_CONTROL_BYTES})")
    return msgspec.json.decode(await reader.readexactly(size), type=DataHello)


def _recv_exactly(sock: socket.socket, view: memoryview, clock: _Clock) -> None:
    """Fills `view` from `sock`, each wait bounded by the stall and overall deadlines (blocking)."""
    got = 0
    while got < len(view):
        sock.settimeout(clock.wait_s())
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError as exc:
            raise DataFailed("stalled", clock.why_stalled()) from exc
        except (OSError, ssl.SSLError) as exc:
            raise DataFailed("connection_lost", f"after {clock.moved} bytes: {exc!r}") from exc
        if n == 0:
            raise DataFailed("connection_lost", f"the peer closed the connection after {clock.moved} bytes")
        got += n
        clock.moved_bytes(n)


class _Clock:
    """The stall, rate and overall deadlines of a receiving thread."""

    def __init__(self, limits: DataLimits, deadline: float) -> None:
        self.limits = limits
        self.started = time.monotonic()
        self.deadline = deadline
        self.moved = 0

    def wait_s(self) -> float:
        now = time.monotonic()
        left = self.deadline - now
        if left <= 0:
            raise DataFailed("deadline", f"the transfer passed its deadline after {self.moved} bytes")
        elapsed = now - self.started
        lim = self.limits
        if elapsed > lim.rate_grace_s and self.moved < lim.min_rate_bytes_per_s * elapsed:
            raise DataFailed(
                "too_slow", f"{self.moved} bytes in {elapsed:.1f}s, under {lim.min_rate_bytes_per_s:.0f} bytes/s"
            )
        return max(0.001, min(lim.stall_s, left))

    def why_stalled(self) -> str:
        return f"no byte for {self.limits.stall_s:g}s after {self.moved} bytes"

    def moved_bytes(self, n: int) -> None:
        self.moved += n


# ---- listener ----------------------------------------------------------------------------------------------


class DataListener:
    """A node's data listener for one actor: tickets issued in its NATS replies open one connection each."""

    def __init__(self, node_id: str, config: DataPathConfig) -> None:
        self.node_id = node_id
        self.config = config
        self.limits = config.limits
        self._book: TicketBook[Handler] = TicketBook(config.limits.max_tickets)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0
        self.refused = 0  # connections refused (no or bad ticket, no hello, over the limit): for tests and logs

    @property
    def tls(self) -> bool:
        return self.config.tls is not None

    async def start(self) -> None:
        context = server_context(self.config.tls) if self.config.tls is not None else None
        bind = self.config.bind if context is not None else _LOOPBACK
        self._server = await asyncio.start_server(
            self._accepted,
            bind,
            0,
            limit=_READ_LIMIT,  # a pushed chunk (a MiB) arrives in a few reads, not in 64 KiB steps
            ssl=context,
            ssl_handshake_timeout=self.limits.hello_timeout_s if context is not None else None,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(self._connections, timeout=5)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> DataListener:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def offer(
        self, handler: Handler, *, receiver: str, digest: str, offset: int, length: int, chunk: int
    ) -> DirectOffer | TicketRefusal:
        """A one-shot ticket for this transfer (`handler` runs on the connection it opens), or why not."""
        if self._server is None:
            return TicketRefusal(TicketReason.CLOSED, "the data listener is not listening")
        ticket = secrets.token_hex(32)
        now = asyncio.get_running_loop().time()
        ttl = self.limits.ticket_ttl_s
        grant: Grant[Handler] = Grant(receiver, digest, offset, length, chunk, now + ttl, handler)
        refusal = self._book.issue(ticket, grant, now)
        if refusal is not None:
            return refusal
        if self.tls:
            return DirectOffer(host=self.config.advertise, port=self.port, ticket=ticket, tls=True, ttl_s=ttl)
        return DirectOffer(host=_LOOPBACK, port=self.port, ticket=ticket, tls=False, ttl_s=ttl, machine=_MACHINE)

    def withdraw(self, offer: DirectOffer) -> None:
        self._book.withdraw(offer.ticket)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self.limits.max_connections:
            self.refused += 1
            await _close(writer)
            return
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError) as exc:
            _log.info("datapath_connection_lost", error=repr(exc))
        finally:
            self._connections.discard(task)
            await _close(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            async with asyncio.timeout(self.limits.hello_timeout_s):
                hello = await _read_control_async(reader)
        except (TimeoutError, ValueError, msgspec.DecodeError, asyncio.IncompleteReadError) as exc:
            self.refused += 1
            _log.info("datapath_hello_refused", peer=str(peer), error=repr(exc)[:200])
            return
        now = asyncio.get_running_loop().time()
        grant = self._book.redeem(
            hello.ticket,
            receiver=hello.receiver,
            digest=hello.digest,
            offset=hello.offset,
            length=hello.length,
            chunk=hello.chunk,
            now=now,
        )
        if isinstance(grant, TicketRefusal):
            self.refused += 1
            _log.info("datapath_ticket_refused", peer=str(peer), reason=grant.reason.value, detail=grant.detail)
            writer.write(_control(DataAnswer(ok=False, reason=grant.reason.value, detail=grant.detail)))
            async with asyncio.timeout(self.limits.stall_s):
                await writer.drain()
            return
        writer.write(_control(DataAnswer(ok=True)))
        await grant.handler(reader, writer, grant)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
        async with asyncio.timeout(2):
            await writer.wait_closed()


# ---- sending a range (the listener's side of a pull) -------------------------------------------------------


#: Reads `length` bytes at `offset` and returns them with their blake3 (blocking: a worker thread). Raises
#: OSError when the object is gone or changed (the connection is then closed early: the receiver resumes).
ChunkReader = Callable[[int, int], tuple[bytes, bytes]]


def chunk_plan(grant: Grant[Any]) -> list[tuple[int, int]]:
    """(offset, length) of every frame of a granted range."""
    end = grant.offset + grant.length
    return [(offset, min(grant.chunk, end - offset)) for offset in range(grant.offset, end, grant.chunk)]


async def send_range(writer: asyncio.StreamWriter, grant: Grant[Any], read: ChunkReader, limits: DataLimits) -> None:
    """The granted range as frames of `grant.chunk` bytes: each chunk read and hashed in a worker thread while the
    previous one is written; a receiver that takes nothing for `stall_s` is cut off."""
    plan = chunk_plan(grant)
    if not plan:
        return
    loop = asyncio.get_running_loop()
    ahead = loop.run_in_executor(None, read, *plan[0])
    try:
        for index, (offset, length) in enumerate(plan):
            data, digest = await ahead
            if index + 1 < len(plan):
                ahead = loop.run_in_executor(None, read, *plan[index + 1])
            if len(data) != length:
                raise OSError(f"read {len(data)} bytes at {offset}, wanted {length}")
            writer.write(FRAME.pack(offset, length, digest))
            writer.write(data)
            async with asyncio.timeout(limits.stall_s):
                await writer.drain()
    finally:
        if not ahead.done():
            ahead.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait({ahead}, timeout=limits.stall_s)


async def send_file_range(
    writer: asyncio.StreamWriter,
    grant: Grant[Any],
    open_file: Callable[[], BinaryIO],
    digests: Sequence[bytes],
    limits: DataLimits,
) -> None:
    """The granted range of a file whose chunks' blake3 are known already (`digests`, one per frame: hashed when
    that version was served before), each frame's bytes sent with `loop.sendfile` (zero copy on a plain socket;
    under TLS the loop reads and encrypts). `open_file` (a worker thread) opens the version the digests are of."""
    plan = chunk_plan(grant)
    if len(digests) != len(plan):
        raise ValueError(f"{len(digests)} digests for {len(plan)} frames")
    loop = asyncio.get_running_loop()
    handle = await loop.run_in_executor(None, open_file)
    try:
        for (offset, length), digest in zip(plan, digests, strict=True):
            writer.write(FRAME.pack(offset, length, digest))
            async with asyncio.timeout(limits.stall_s):
                await writer.drain()
                sent = await loop.sendfile(writer.transport, handle, offset, length)
            if sent != length:
                raise OSError(f"sent {sent} bytes at {offset}, wanted {length} (the file shrank)")
    finally:
        await loop.run_in_executor(None, handle.close)


def hashed_file_reader(path: str, check: Callable[[int], None] | None = None) -> ChunkReader:
    """A `ChunkReader` over a file, each chunk read with `pread` from a descriptor opened per chunk; `check(fd)`
    (blocking) may refuse a changed file by raising OSError."""

    def read(offset: int, length: int) -> tuple[bytes, bytes]:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if check is not None:
                check(fd)
            data = os.pread(fd, length, offset)
            while len(data) < length:
                more = os.pread(fd, length - len(data), offset + len(data))
                if not more:
                    break
                data += more
        finally:
            os.close(fd)
        return data, blake3.blake3(data).digest()

    return read


# ---- pushing messages (the listener takes the bytes: a handoff's receiver) ---------------------------------

#: A pushed message's lengths: its headers' JSON (u32) and its payload (u32), big-endian; then both.
PUSHED: Final = struct.Struct("!II")
MAX_PUSH_HEADERS: Final = 4096


async def open_push(offer: DirectOffer, hello: DataHello, *, tls: TlsFiles | None, limits: DataLimits) -> PushStream:
    """A connection to a listener that takes the bytes (it answered the NATS request that issued `offer`), its
    ticket accepted; write messages with `push`. Raises `DataUnavailable` when it cannot be opened."""
    if not offer.tls and offer.machine != _MACHINE:
        raise DataUnavailable("the peer's listener is on the loopback of another machine")
    if offer.tls and tls is None:
        raise DataUnavailable("the peer requires mutual TLS and this node has no cluster certificates")
    context = client_context(tls) if offer.tls and tls is not None else None
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(limits.connect_timeout_s + 2 * limits.hello_timeout_s):
            reader, writer = await asyncio.open_connection(
                offer.host,
                offer.port,
                ssl=context,
                server_hostname=offer.host if context is not None else None,
                ssl_handshake_timeout=limits.hello_timeout_s if context is not None else None,
            )
            writer.write(_control(hello))
            await writer.drain()
            (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
            if size > MAX_CONTROL_BYTES:
                raise ValueError(f"an answer of {size} bytes (at most {MAX_CONTROL_BYTES})")
            answer = msgspec.json.decode(await reader.readexactly(size), type=DataAnswer)
    except (OSError, ssl.SSLError, TimeoutError, ValueError, msgspec.DecodeError, asyncio.IncompleteReadError) as exc:
        if writer is not None:
            await _close(writer)
        raise DataUnavailable(f"no direct stream to {offer.host}:{offer.port}: {exc!r}") from exc
    if not answer.ok:
        await _close(writer)
        raise DataUnavailable(f"the peer refused the ticket: {answer.reason}: {answer.detail}")
    return PushStream(writer, limits)


class PushStream:
    """The sending end of a pushed stream (`open_push`): batches of messages, each its headers and payload.

    On plain TCP a batch is written by a worker thread on a blocking duplicate of the socket (`sendmsg`: the
    headers and the payload go from where they are, no copy into a write buffer, no event-loop wake-up per
    message); under TLS through the asyncio stream. Every write waits at most the stall deadline."""

    def __init__(self, writer: asyncio.StreamWriter, limits: DataLimits) -> None:
        self._writer = writer
        self._limits = limits
        raw = writer.transport.get_extra_info("socket")
        self._sock: socket.socket | None = None
        if writer.transport.get_extra_info("sslcontext") is None and raw is not None:
            self._sock = socket.socket(raw.family, raw.type, raw.proto, fileno=os.dup(raw.fileno()))
            self._sock.setblocking(True)

    async def send(self, batch: Sequence[tuple[dict[str, str], Any]]) -> None:
        """Writes every message of `batch` (headers, payload: bytes or a memoryview), in order."""
        if self._sock is None:
            for headers, payload in batch:
                self._writer.write(_pushed_head(headers, len(payload)))
                self._writer.write(payload)
                async with asyncio.timeout(self._limits.stall_s):
                    await self._writer.drain()
            return
        framed = [(_pushed_head(headers, len(payload)), payload) for headers, payload in batch]
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(None, _send_blocking, self._sock, framed, self._limits.stall_s)
        try:
            await asyncio.shield(work)  # each sendmsg waits at most `stall_s`
        except BaseException:
            _shut(self._sock)
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(self._limits.stall_s + 5):
                    await work
            raise

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        await _close(self._writer)


def _pushed_head(headers: dict[str, str], size: int) -> bytes:
    head = msgspec.json.encode(headers)
    return PUSHED.pack(len(head), size) + head


def _send_blocking(sock: socket.socket, framed: list[tuple[bytes, Any]], stall_s: float) -> None:
    """Each message's head and payload with `sendmsg`, the rest of a partial send again (a worker thread)."""
    sock.settimeout(stall_s)
    for head, payload in framed:
        parts = [memoryview(head), memoryview(payload).cast("B")]
        while parts:
            sent = sock.sendmsg(parts)
            while parts and sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            if parts and sent:
                parts[0] = parts[0][sent:]


async def pushed(
    reader: asyncio.StreamReader, *, max_payload: int, stall_s: float
) -> tuple[dict[str, str], bytes] | None:
    """The next pushed message (None: the peer closed between messages). Each read waits at most `stall_s`; the
    lengths are checked against their ceilings before anything is read into memory."""
    async with asyncio.timeout(stall_s):
        try:
            lengths = await reader.readexactly(PUSHED.size)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise
    head, size = PUSHED.unpack(lengths)
    if head > MAX_PUSH_HEADERS or size > max_payload:
        raise ValueError(
            f"a message of {head} header and {size} payload bytes (at most {MAX_PUSH_HEADERS}, {max_payload})"
        )
    async with asyncio.timeout(stall_s):
        headers = msgspec.json.decode(await reader.readexactly(head), type=dict[str, str])
    async with asyncio.timeout(stall_s):
        payload = await reader.readexactly(size)
    return headers, payload


#: Pushed messages read ahead of the event loop, at most (each a chunk: what a reading thread may hold).
_PUSHED_AHEAD: Final = 16

#: Takes one pushed message on the event loop (its headers and payload); False: read no more.
Deliver = Callable[[dict[str, str], bytes | bytearray], bool]


async def receive_pushed(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    deliver: Deliver,
    *,
    max_payload: int,
    stall_s: float,
) -> None:
    """Every message pushed on an accepted connection, in order, each handed to `deliver` on the event loop.

    A plain TCP connection is read by a worker thread on the socket itself (each payload copied once, out of the
    kernel into its own buffer; no event-loop wake-up per read), at most `_PUSHED_AHEAD` messages ahead of
    `deliver`; a TLS one through its stream (`pushed`). Returns when the peer closes between messages or
    `deliver` says stop; raises TimeoutError when nothing arrives for `stall_s`, ValueError (or a decode error)
    for a message over its ceilings or malformed, `asyncio.IncompleteReadError` for one cut short."""
    detached = _detach(reader, writer)
    if detached is None:
        while (message := await pushed(reader, max_payload=max_payload, stall_s=stall_s)) is not None:
            if not deliver(*message):
                return
        return
    sock, early = detached
    loop = asyncio.get_running_loop()
    ahead = threading.Semaphore(_PUSHED_AHEAD)
    stopped = threading.Event()

    def post(headers: dict[str, str], payload: bytearray) -> None:  # the reading thread
        ahead.acquire()
        loop.call_soon_threadsafe(hand, headers, payload)

    def hand(headers: dict[str, str], payload: bytearray) -> None:  # the event loop
        ahead.release()
        if stopped.is_set():
            return
        if not deliver(headers, payload):
            stopped.set()
            _shut(sock)

    work = loop.run_in_executor(None, _read_pushed, sock, early, post, stopped, max_payload, stall_s)
    try:
        await asyncio.shield(work)  # the thread waits at most `stall_s` for each read
    except BaseException:
        stopped.set()
        _shut(sock)
        for _ in range(_PUSHED_AHEAD):  # a thread waiting to post is let go
            ahead.release()
        with contextlib.suppress(BaseException):
            async with asyncio.timeout(stall_s + 5):
                await work
        raise
    finally:
        sock.close()
    await asyncio.sleep(0)  # the messages the thread posted last are delivered before this returns


def _detach(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[socket.socket, bytes] | None:
    """A blocking duplicate of a plain connection's socket for a worker thread, and the bytes the stream had read
    ahead (None under TLS, or when the stream's buffer cannot be taken). The transport stops reading; it still
    owns, and closes, the socket."""
    transport = writer.transport
    raw = transport.get_extra_info("socket")
    buffered = getattr(reader, "_buffer", None)  # CPython's StreamReader: what it read past the hello
    if transport.get_extra_info("sslcontext") is not None or raw is None or not isinstance(buffered, bytearray):
        return None
    if not isinstance(transport, asyncio.ReadTransport):
        return None
    transport.pause_reading()
    early = bytes(buffered)
    buffered.clear()
    sock = socket.socket(raw.family, raw.type, raw.proto, fileno=os.dup(raw.fileno()))
    sock.setblocking(True)
    return sock, early


def _read_pushed(
    sock: socket.socket,
    early: bytes,
    post: Callable[[dict[str, str], bytearray], None],
    stopped: threading.Event,
    max_payload: int,
    stall_s: float,
) -> None:
    """The reading thread: messages from `early`, then the socket, each posted whole (blocking)."""
    pending = memoryview(early)

    def fill(view: memoryview, *, first: bool = False) -> bool:
        nonlocal pending
        got = min(len(pending), len(view))
        view[:got] = pending[:got]
        pending = pending[got:]
        while got < len(view):
            if stopped.is_set():
                return False
            sock.settimeout(stall_s)
            try:
                n = sock.recv_into(view[got:])
            except OSError:
                if stopped.is_set():
                    return False
                raise
            if n == 0:
                if first and got == 0:
                    return False  # closed between messages
                raise asyncio.IncompleteReadError(bytes(view[:got]), len(view))
            got += n
        return True

    lengths = bytearray(PUSHED.size)
    while not stopped.is_set():
        if not fill(memoryview(lengths), first=True):
            return
        head, size = PUSHED.unpack(lengths)
        if head > MAX_PUSH_HEADERS or size > max_payload:
            ceilings = f"at most {MAX_PUSH_HEADERS} and {max_payload}"
            raise ValueError(f"a message of {head} header and {size} payload bytes ({ceilings})")
        raw_headers = bytearray(head)
        payload = bytearray(size)
        if not fill(memoryview(raw_headers)) or not fill(memoryview(payload)):
            return
        post(msgspec.json.decode(raw_headers, type=dict[str, str]), payload)


# ---- fetching a range (the asking node's side) -------------------------------------------------------------


class _Socket:
    """The receiving thread's socket, which the event loop may shut to end the thread's wait at once."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.aborted = False

    def set(self, sock: socket.socket) -> None:
        with self.lock:
            self.sock = sock
            if self.aborted:
                _shut(sock)

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            if self.sock is not None:
                _shut(self.sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


async def fetch_range(
    offer: DirectOffer,
    *,
    receiver: str,
    digest: str,
    offset: int,
    length: int,
    chunk: int,
    sink: Sink,
    tls: TlsFiles | None,
    limits: DataLimits,
    deadline_s: float,
) -> int:
    """Fetches `length` bytes at `offset` of the object `digest` over the direct stream `offer` names, each chunk
    checked against its blake3 and handed to `sink` in order; returns the bytes received (all of them).
    Raises `DataUnavailable` when no connection could be opened, `DataFailed` when one broke off (the chunks
    handed to the sink stay verified)."""
    if chunk > limits.max_chunk_bytes:
        raise DataUnavailable(f"a chunk of {chunk} bytes is over this node's {limits.max_chunk_bytes}")
    if not offer.tls and offer.machine != _MACHINE:
        raise DataUnavailable("the peer's listener is on the loopback of another machine")
    if offer.tls and tls is None:
        raise DataUnavailable("the peer requires mutual TLS and this node has no cluster certificates")
    context = client_context(tls) if offer.tls and tls is not None else None
    hello = DataHello(ticket=offer.ticket, receiver=receiver, digest=digest, offset=offset, length=length, chunk=chunk)
    holder = _Socket()
    deadline = time.monotonic() + deadline_s
    loop = asyncio.get_running_loop()
    work = loop.run_in_executor(None, _fetch_blocking, offer, context, hello, sink, limits, deadline, holder)
    try:
        async with asyncio.timeout(deadline_s + limits.stall_s):
            return await asyncio.shield(work)
    except BaseException:
        holder.abort()  # the thread's wait ends at once; it returns (or raises) and is awaited below
        with contextlib.suppress(BaseException):
            async with asyncio.timeout(limits.stall_s + 5):
                await work
        raise


def _fetch_blocking(
    offer: DirectOffer,
    context: ssl.SSLContext | None,
    hello: DataHello,
    sink: Sink,
    limits: DataLimits,
    deadline: float,
    holder: _Socket,
) -> int:
    try:
        raw = socket.create_connection((offer.host, offer.port), timeout=limits.connect_timeout_s)
    except OSError as exc:
        raise DataUnavailable(f"cannot connect to {offer.host}:{offer.port}: {exc}") from exc
    sock: socket.socket = raw
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        holder.set(raw)
        if context is not None:
            raw.settimeout(limits.hello_timeout_s)
            try:
                sock = context.wrap_socket(raw, server_hostname=offer.host)
            except (OSError, ssl.SSLError) as exc:
                raise DataUnavailable(f"no TLS handshake with {offer.host}:{offer.port}: {exc}") from exc
        sock.settimeout(limits.hello_timeout_s)
        try:
            sock.sendall(_control(hello))
            answer = _read_answer(sock)
        except (OSError, ssl.SSLError, ValueError, msgspec.DecodeError) as exc:
            raise DataUnavailable(f"no answer to the hello from {offer.host}:{offer.port}: {exc!r}") from exc
        if not answer.ok:
            raise DataUnavailable(f"the peer refused the ticket: {answer.reason}: {answer.detail}")
        return _receive_frames(sock, hello, sink, _Clock(limits, deadline))
    finally:
        with contextlib.suppress(OSError, ssl.SSLError):
            sock.close()
        with contextlib.suppress(OSError):
            raw.close()


def _read_answer(sock: socket.socket) -> DataAnswer:
    head = bytearray(_LENGTH.size)
    _recv_plain(sock, memoryview(head))
    (size,) = _LENGTH.unpack(head)
    if size > MAX_CONTROL_BYTES:
        raise ValueError(f"an answer of {size} bytes (at most {MAX_CONTROL_BYTES})")
    body = bytearray(size)
    _recv_plain(sock, memoryview(body))
    return msgspec.json.decode(body, type=DataAnswer)


def _recv_plain(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


#: Chunk buffers of a receiving transfer: one being received, the others queued for (or in) the sink.
_BUFFERS: Final = 4


def _receive_frames(sock: socket.socket, hello: DataHello, sink: Sink, clock: _Clock) -> int:
    """The frames of the range, in order, each checked, then handed to `sink` by a second thread (the next chunk
    is received and hashed while the sink writes this one; blocking). Every chunk verified before a failure
    reaches the sink before the failure is raised; a failure of the sink ends the receiving."""
    free: queue.Queue[memoryview] = queue.Queue()
    for _ in range(_BUFFERS):
        free.put(memoryview(bytearray(hello.chunk)))
    verified: queue.Queue[tuple[int, memoryview, str] | None] = queue.Queue()
    failed: list[BaseException] = []

    def drain() -> None:  # the sink's thread
        while (item := verified.get()) is not None:
            offset, view, digest = item
            if not failed:
                try:
                    sink(offset, view, digest)
                except BaseException as exc:
                    failed.append(exc)
            free.put(_whole(view))

    writer = threading.Thread(target=drain, name="datapath-sink", daemon=True)
    writer.start()
    header = memoryview(bytearray(FRAME.size))
    expected, end = hello.offset, hello.offset + hello.length
    try:
        while expected < end and not failed:
            _recv_exactly(sock, header, clock)
            offset, length, stated = FRAME.unpack(header)
            want = min(hello.chunk, end - expected)
            if offset != expected or length != want:
                raise DataFailed(
                    "frame_refused", f"a frame of {length} bytes at {offset}, expected {want} at {expected}"
                )
            view = _take(free, clock)[:length]
            _recv_exactly(sock, view, clock)
            observed = blake3.blake3(view).digest()
            if observed != stated:
                raise DataFailed("chunk_refused", f"the chunk at {offset} does not hash to the blake3 sent with it")
            verified.put((offset, view, observed.hex()))
            expected += length
    finally:
        verified.put(None)
        writer.join()
    if failed:
        raise failed[0]
    return expected - hello.offset


def _whole(view: memoryview) -> memoryview:
    """The whole buffer a chunk's view is a slice of (returned to the pool)."""
    base = view.obj
    assert isinstance(base, bytearray)
    return memoryview(base)


def _take(free: queue.Queue[memoryview], clock: _Clock) -> memoryview:
    """A free chunk buffer, once the sink is done with one (within the stall deadline: a sink that hangs)."""
    try:
        return free.get(timeout=clock.wait_s())
    except queue.Empty as exc:
        raise DataFailed("sink_stalled", f"the sink took no chunk for {clock.limits.stall_s:g}s") from exc
