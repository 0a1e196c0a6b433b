"""The direct data path on real sockets and real TLS: what a listener sends, to whom, and what a receiver keeps.

A listener sends a range only on a connection that presents a live ticket issued for exactly that range, digest,
chunk size and receiver (once), and, with cluster certificates, only inside mutual TLS under the cluster's CA;
everything else gets a refusal and no byte of data. A receiver keeps only chunks that hash to what was sent with
them at the offsets it asked, and cuts off a peer that stalls, lies about a length or closes early, keeping
what it verified so a later fetch resumes from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import blake3
import msgspec
import pytest

from messages.datapath import DataAnswer, DataHello, DirectOffer
from runtime.datapath import (
    FRAME,
    DataFailed,
    DataLimits,
    DataListener,
    DataPathConfig,
    DataUnavailable,
    fetch_range,
    hashed_file_reader,
    machine_id,
    send_range,
)
from runtime.tickets import Grant
from runtime.tls import TlsFiles, ensure_route_certificates

CHUNK = 64 * 1024
SIZE = 10 * CHUNK + 123
LIMITS = DataLimits(hello_timeout_s=1.0, stall_s=1.0, rate_grace_s=60.0)


@pytest.fixture
def payload(tmp_path: Path) -> tuple[Path, bytes, str]:
    data = os.urandom(SIZE)
    path = tmp_path / "object.bin"
    path.write_bytes(data)
    return path, data, str(blake3.blake3(data).hexdigest())


class Collect:
    """A sink keeping the chunks it was handed, in order."""

    def __init__(self) -> None:
        self.chunks: list[tuple[int, bytes, str]] = []

    def __call__(self, offset: int, data: memoryview, digest: str) -> None:
        self.chunks.append((offset, bytes(data), digest))

    @property
    def data(self) -> bytes:
        return b"".join(c for _, c, _ in self.chunks)


def file_handler(path: Path) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter, Grant[object]], Awaitable[None]]:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, grant: Grant[object]) -> None:
        await send_range(writer, grant, hashed_file_reader(str(path)), LIMITS)

    return handler


@contextlib.asynccontextmanager
async def listener(config: DataPathConfig | None = None) -> AsyncIterator[DataListener]:
    async with DataListener("holder", config or DataPathConfig.loopback(LIMITS)) as data_listener:
        yield data_listener


def offer(lst: DataListener, path: Path, digest: str, *, offset: int = 0, length: int = SIZE) -> DirectOffer:
    made = lst.offer(file_handler(path), receiver="taker", digest=digest, offset=offset, length=length, chunk=CHUNK)
    assert isinstance(made, DirectOffer), made
    return made


async def fetch(
    made: DirectOffer,
    digest: str,
    sink: Collect,
    *,
    offset: int = 0,
    length: int = SIZE,
    tls: TlsFiles | None = None,
    receiver: str = "taker",
) -> int:
    return await fetch_range(
        made,
        receiver=receiver,
        digest=digest,
        offset=offset,
        length=length,
        chunk=CHUNK,
        sink=sink,
        tls=tls,
        limits=LIMITS,
        deadline_s=30,
    )


async def raw_hello(port: int, hello: bytes) -> bytes:
    """What a listener answers a raw connection that sends `hello`, until it closes (at most 64 KiB)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(hello)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read(65536) + await reader.read(65536)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def framed(message: msgspec.Struct) -> bytes:
    body = msgspec.json.encode(message)
    return len(body).to_bytes(4, "big") + body


def answer_of(raw: bytes) -> DataAnswer:
    size = int.from_bytes(raw[:4], "big")
    assert len(raw) == 4 + size, "bytes followed the answer"
    return msgspec.json.decode(raw[4:], type=DataAnswer)


async def test_a_ticket_fetches_its_range_with_every_chunk_verified(payload: tuple[Path, bytes, str]) -> None:
    path, data, digest = payload
    async with listener() as lst:
        sink = Collect()
        assert await fetch(offer(lst, path, digest), digest, sink) == SIZE
        assert sink.data == data and str(blake3.blake3(sink.data).hexdigest()) == digest
        assert all(d == blake3.blake3(c).hexdigest() for _, c, d in sink.chunks)
        part = Collect()  # a range: only it moves
        assert await fetch(offer(lst, path, digest, offset=3 * CHUNK, length=2 * CHUNK), digest, part, offset=3 * CHUNK,
                           length=2 * CHUNK) == 2 * CHUNK  # fmt: skip
        assert part.data == data[3 * CHUNK : 5 * CHUNK]


async def test_a_connection_without_a_ticket_gets_nothing(payload: tuple[Path, bytes, str]) -> None:
    path, _, digest = payload
    async with listener() as lst:
        offer(lst, path, digest)  # a live ticket, not the one shown
        forged = DataHello(ticket="ab" * 32, receiver="taker", digest=digest, offset=0, length=SIZE, chunk=CHUNK)
        answer = answer_of(await raw_hello(lst.port, framed(forged)))
        assert not answer.ok and answer.reason == "ticket_unknown"
        assert await raw_hello(lst.port, b"GET / HTTP/1.1\r\n\r\n") == b""  # not a hello: closed, nothing said
        assert lst.refused == 2


async def test_a_ticket_opens_one_connection_only(payload: tuple[Path, bytes, str]) -> None:
    path, data, digest = payload
    async with listener() as lst:
        made = offer(lst, path, digest)
        first = Collect()
        await fetch(made, digest, first)
        assert first.data == data
        replay = Collect()
        with pytest.raises(DataUnavailable, match="ticket_used"):
            await fetch(made, digest, replay)
        assert replay.chunks == []


async def test_a_ticket_for_another_digest_range_or_receiver_gets_nothing_and_is_used_up(
    payload: tuple[Path, bytes, str],
) -> None:
    path, _, digest = payload
    other = "0" * 64
    async with listener() as lst:
        for kwargs in ({"digest": other}, {"offset": CHUNK}, {"length": CHUNK}, {"receiver": "thief"}):
            made = offer(lst, path, digest)
            sink = Collect()
            asked = {"digest": digest, **kwargs}
            with pytest.raises(DataUnavailable, match="ticket_foreign"):
                await fetch(made, sink=sink, **asked)  # type: ignore[arg-type]
            assert sink.chunks == []
            with pytest.raises(DataUnavailable, match="ticket_used"):  # not left for a second try
                await fetch(made, digest, sink)


async def test_an_expired_ticket_gets_nothing(payload: tuple[Path, bytes, str]) -> None:
    path, _, digest = payload
    expired = DataPathConfig.loopback(DataLimits(ticket_ttl_s=0.0))
    async with listener(expired) as lst:
        sink = Collect()
        with pytest.raises(DataUnavailable, match="ticket_expired"):
            await fetch(offer(lst, path, digest), digest, sink)
        assert sink.chunks == []


def certificates(root: Path, secret: str) -> TlsFiles:
    return ensure_route_certificates(root, secret, ["127.0.0.1", "localhost"])


async def test_with_cluster_certificates_only_a_member_of_the_cluster_gets_bytes(
    tmp_path: Path, payload: tuple[Path, bytes, str]
) -> None:
    path, data, digest = payload
    holder, member, stranger = (certificates(tmp_path / n, s) for n, s in (("h", "s1"), ("m", "s1"), ("x", "s2")))
    config = DataPathConfig(tls=holder, limits=LIMITS)
    async with listener(config) as lst:
        made = offer(lst, path, digest)
        assert made.tls
        sink = Collect()
        with pytest.raises(DataUnavailable, match="TLS handshake"):  # another cluster's certificate
            await fetch(made, digest, sink, tls=stranger)
        with pytest.raises(DataUnavailable, match="no cluster certificates"):
            await fetch(offer(lst, path, digest), digest, sink)
        # TLS without a client certificate: the listener ends the handshake there; not a byte of the data comes
        bare = ssl.create_default_context(cafile=str(holder.ca))
        bare.check_hostname = False
        hello = framed(DataHello(ticket=made.ticket, receiver="taker", digest=digest, offset=0, length=SIZE,
                                 chunk=CHUNK))  # fmt: skip

        def without_certificate() -> bytes:  # a thread: the listener runs on this loop
            with socket.create_connection(("127.0.0.1", lst.port), timeout=5) as raw, bare.wrap_socket(raw) as tls:
                tls.sendall(hello)
                return tls.recv(1024)

        try:
            received = await asyncio.to_thread(without_certificate)
        except ssl.SSLError:  # the alert, when it comes before the connection closes
            received = b""
        assert received == b""
        assert await raw_hello(lst.port, b"\x00\x00\x00\x02{}") == b""
        assert sink.chunks == []
        good = Collect()
        await fetch(offer(lst, path, digest), digest, good, tls=member)
        assert good.data == data


async def test_a_slowloris_client_is_cut_off_before_it_says_anything(payload: tuple[Path, bytes, str]) -> None:
    path, _, digest = payload
    async with listener() as lst:
        offer(lst, path, digest)
        reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
        try:
            writer.write(b"\x00\x00")  # half a length, then nothing
            await writer.drain()
            async with asyncio.timeout(10):  # the listener's hello_timeout_s (1 s) closes it well within this
                assert await reader.read(1) == b""
        finally:
            writer.close()
        assert lst.refused == 1


@contextlib.asynccontextmanager
async def scripted_peer(script: Callable[[asyncio.StreamWriter, bytes], Awaitable[None]]) -> AsyncIterator[int]:
    """A listener that answers any hello `ok` and then runs `script` (a peer that misbehaves)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            size = int.from_bytes(await reader.readexactly(4), "big")
            await reader.readexactly(size)
            writer.write(framed(DataAnswer(ok=True)))
            await script(writer, b"")
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        async with asyncio.timeout(5):
            await server.wait_closed()


def frame(data: bytes, offset: int, length: int | None = None, digest: bytes | None = None) -> bytes:
    size = len(data) if length is None else length
    return FRAME.pack(offset, size, blake3.blake3(data).digest() if digest is None else digest) + data


def peer_offer(port: int) -> DirectOffer:
    return DirectOffer(host="127.0.0.1", port=port, ticket="cd" * 32, tls=False, ttl_s=30, machine=machine_id())


async def test_a_sender_that_lies_about_a_length_an_offset_or_a_hash_is_cut_off(
    payload: tuple[Path, bytes, str],
) -> None:
    _, data, digest = payload
    first = frame(data[:CHUNK], 0)
    lies = {
        "frame_refused": frame(data[CHUNK : 2 * CHUNK], CHUNK, length=1 << 31),  # a length over the chunk
        "frame_refused ": frame(data[2 * CHUNK : 3 * CHUNK], 2 * CHUNK),  # another offset than the next
        "chunk_refused": frame(data[CHUNK : 2 * CHUNK], CHUNK, digest=bytes(32)),  # a hash it does not have
    }
    for reason, lie in lies.items():

        async def script(writer: asyncio.StreamWriter, _: bytes, lie: bytes = lie) -> None:
            writer.write(first + lie)

        async with scripted_peer(script) as port:
            sink = Collect()
            with pytest.raises(DataFailed) as failed:
                await fetch(peer_offer(port), digest, sink)
            assert failed.value.reason == reason.strip()
            assert sink.data == data[:CHUNK]  # what was verified before the lie, nothing after


async def test_a_stalled_sender_is_cut_off_and_a_cut_transfer_resumes_from_what_was_verified(
    payload: tuple[Path, bytes, str],
) -> None:
    path, data, digest = payload

    async def cut(writer: asyncio.StreamWriter, _: bytes) -> None:  # two chunks and half of the third
        writer.write(frame(data[:CHUNK], 0) + frame(data[CHUNK : 2 * CHUNK], CHUNK) + frame(data[2 * CHUNK :
                     3 * CHUNK], 2 * CHUNK)[: CHUNK // 2])  # fmt: skip

    async def stall(writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(frame(data[:CHUNK], 0))
        await writer.drain()
        await asyncio.sleep(30)  # cancelled when the receiver gives up and the test's peer closes

    sink = Collect()
    async with scripted_peer(stall) as port:
        with pytest.raises(DataFailed) as failed:
            await fetch(peer_offer(port), digest, sink)
    assert failed.value.reason == "stalled" and sink.data == data[:CHUNK]
    sink = Collect()
    async with scripted_peer(cut) as port:
        with pytest.raises(DataFailed) as failed:
            await fetch(peer_offer(port), digest, sink)
    assert failed.value.reason == "connection_lost" and sink.data == data[: 2 * CHUNK]
    async with listener() as lst:  # the rest from where the verified part ends
        rest = 2 * CHUNK
        await fetch(offer(lst, path, digest, offset=rest, length=SIZE - rest), digest, sink, offset=rest,
                    length=SIZE - rest)  # fmt: skip
    assert sink.data == data


async def test_a_loopback_offer_from_another_machine_is_not_dialled(payload: tuple[Path, bytes, str]) -> None:
    path, _, digest = payload
    async with listener() as lst:
        made = offer(lst, path, digest)
        assert made.machine == machine_id()
        elsewhere = msgspec.structs.replace(made, machine="f" * 32)
        with pytest.raises(DataUnavailable, match="another machine"):
            await fetch(elsewhere, digest, Collect())
        assert lst.refused == 0  # nothing was dialled


async def test_a_closed_port_is_unavailable_for_the_caller_to_fall_back() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(DataUnavailable, match="cannot connect"):
            await fetch(peer_offer(port), "0" * 64, Collect())


async def test_a_sink_that_cannot_write_fails_the_fetch_with_its_own_error(payload: tuple[Path, bytes, str]) -> None:
    path, _, digest = payload

    def full(offset: int, data: memoryview, digest: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async with listener() as lst:
        with pytest.raises(OSError) as caught:
            await fetch_range(offer(lst, path, digest), receiver="taker", digest=digest, offset=0, length=SIZE,
                              chunk=CHUNK, sink=full, tls=None, limits=LIMITS, deadline_s=30)  # fmt: skip
        assert caught.value.errno == errno.ENOSPC


async def test_a_receiver_that_takes_nothing_is_cut_off_by_the_listener(tmp_path: Path) -> None:
    data = os.urandom(32 << 20)  # more than the sockets buffer between the two ends
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    digest = str(blake3.blake3(data).hexdigest())
    async with listener() as lst:
        made = lst.offer(file_handler(path), receiver="taker", digest=digest, offset=0, length=len(data), chunk=CHUNK)
        assert isinstance(made, DirectOffer)
        hello = DataHello(ticket=made.ticket, receiver="taker", digest=digest, offset=0, length=len(data), chunk=CHUNK)
        reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
        try:
            writer.write(framed(hello))
            await writer.drain()
            async with asyncio.timeout(10):  # the listener's stall_s (1 s) ends its side well within this
                while lst._connections:
                    await asyncio.sleep(0.05)
            received = 0
            with contextlib.suppress(ConnectionError):
                async with asyncio.timeout(10):
                    while chunk := await reader.read(1 << 20):
                        received += len(chunk)
            assert received < len(data)  # what the sockets held when the listener gave up, not the range
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
