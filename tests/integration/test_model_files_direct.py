"""Model files over the direct data path, on a real nats-server, real sockets and real TLS: the negotiation on
NATS (`mesh.files.<node>.offer`: a one-shot ticket for the range still missing), the bytes on a TCP stream from
the holder's data listener, each chunk checked as it lands into the same part file and journal as over NATS.

A pull says which path its bytes took; when the stream cannot be opened (a closed port, a holder without the
path) NATS carries them, and when it breaks off NATS fetches the rest from what was verified. A holder whose
frames lie is refused as over NATS; a file system that fills up mid-stream keeps the verified part.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import blake3
import msgspec
import pytest

from actors.files.actor import FilesActor, FilesLimits
from actors.files.transfer import chunk_bytes
from messages.datapath import DataAnswer, DirectOffer
from messages.files import ChunkRequest, OfferRequest
from runtime.bus import Bus, encode
from runtime.datapath import FRAME, DataLimits, DataPathConfig, machine_id
from runtime.tls import TlsFiles, ensure_route_certificates
from tests.conftest import JournalReader, of_type, supervised
from tests.harness.model_files import (
    S,
    answering,
    digest_of,
    evil_peer,
    hashed,
    leftovers,
    node_dirs,
    pull,
    refused,
    run,
)
from tests.tiny_models import write_llama

LIMITS = DataLimits(stall_s=2.0, rate_grace_s=60.0)
NAMES = ["127.0.0.1", "localhost"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ~18 MB: many chunks on the test server's max_payload
    return write_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512)


def certificates(root: Path, *secrets: str) -> tuple[TlsFiles, TlsFiles]:
    a, b = (ensure_route_certificates(root / f"t{i}", secret, NAMES) for i, secret in enumerate(secrets))
    return a, b


@contextlib.asynccontextmanager
async def direct_nodes(
    bus: Bus,
    root: Path,
    model: Path,
    *,
    tls: tuple[TlsFiles | None, TlsFiles | None] = (None, None),
    holder_direct: bool = True,
    free_space: Callable[[Path], int] | None = None,
) -> AsyncIterator[tuple[FilesActor, FilesActor, Path]]:
    """Node `a` holds the model, `b` does not; both with a data path (`a` only if `holder_direct`)."""
    data_a, models_a = node_dirs(root, "a")
    data_b, models_b = node_dirs(root, "b")
    os.link(model, models_a / "tiny.gguf")
    path_a = DataPathConfig(tls=tls[0], limits=LIMITS) if holder_direct else None
    a = FilesActor("a", data_a, models_dir=models_a, datapath=path_a)
    extra: dict[str, Any] = {"free_space": free_space} if free_space is not None else {}
    limits = FilesLimits(keep_free_bytes=0)
    b = FilesActor("b", data_b, models_dir=models_b, datapath=DataPathConfig(tls=tls[1], limits=LIMITS),
                   limits=limits, **extra)  # fmt: skip
    async with supervised(bus, [a], node_id="a"), supervised(bus, [b], node_id="b"):
        await answering(bus, a, b)
        yield a, b, models_b


async def test_a_pull_moves_the_file_over_the_direct_path_verified_and_says_so(
    bus: Bus, tmp_path: Path, model: Path, journal_reader: JournalReader
) -> None:
    async with direct_nodes(bus, tmp_path, model) as (a, _, models_b):
        reply = await pull(bus, "b", "tiny", peer="a")
        size = (await asyncio.to_thread(model.stat)).st_size
        assert (reply.transport, reply.fallback, reply.moved_bytes) == ("direct", "", size)
        assert reply.blake3 == digest_of(model) == digest_of(models_b / "tiny.gguf")
        assert leftovers(models_b) == ["tiny.gguf"]
        assert a.listener is not None and a.listener.refused == 0
        (event,) = await journal_reader.wait_for(of_type("model_file_pulled", node="b"))
        assert (event["transport"], event["moved_bytes"]) == ("direct", size)
        # the holder now knows every chunk's blake3 of that version: the next pull of it is sent with sendfile
        ((_, known),) = a._chunk_digests.items()
        assert sorted(known) == list(range(-(-size // chunk_bytes(bus.max_payload))))
        (models_b / "tiny.gguf").unlink()
        again = await pull(bus, "b", "tiny", peer="a")
        assert again.transport == "direct" and digest_of(models_b / "tiny.gguf") == digest_of(model)


async def test_with_cluster_certificates_the_bytes_travel_inside_mutual_tls(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    names = ["127.0.0.1", "localhost"]
    certs = (
        ensure_route_certificates(tmp_path / "ta", "s", names),
        ensure_route_certificates(tmp_path / "tb", "s", names),
    )
    async with direct_nodes(bus, tmp_path, model, tls=certs) as (_, _, models_b):
        reply = await pull(bus, "b", "tiny", peer="a")
        assert reply.transport == "direct_tls" and digest_of(models_b / "tiny.gguf") == digest_of(model)


async def test_a_node_of_another_cluster_gets_no_byte_directly_and_nats_carries_the_file(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    names = ["127.0.0.1", "localhost"]
    certs = (
        ensure_route_certificates(tmp_path / "ta", "s", names),
        ensure_route_certificates(tmp_path / "tb", "x", names),
    )
    async with direct_nodes(bus, tmp_path, model, tls=certs) as (_, _, models_b):
        reply = await pull(bus, "b", "tiny", peer="a")
        assert reply.transport == "nats" and "TLS handshake" in reply.fallback
        assert digest_of(models_b / "tiny.gguf") == digest_of(model)


async def test_a_closed_port_falls_back_to_nats_and_the_pull_says_why(bus: Bus, tmp_path: Path, model: Path) -> None:
    async with direct_nodes(bus, tmp_path, model) as (a, _, models_b):
        assert a.listener is not None and a.listener._server is not None
        a.listener._server.close()  # the holder's port closes, its tickets stay (as behind a firewall)
        await a.listener._server.wait_closed()
        reply = await pull(bus, "b", "tiny", peer="a")
        assert reply.transport == "nats" and "cannot connect" in reply.fallback, reply
        assert digest_of(models_b / "tiny.gguf") == digest_of(model)


async def test_a_holder_without_the_direct_path_serves_over_nats(bus: Bus, tmp_path: Path, model: Path) -> None:
    async with direct_nodes(bus, tmp_path, model, holder_direct=False) as (_, _, models_b):
        reply = await pull(bus, "b", "tiny", peer="a")
        assert reply.transport == "nats" and "no direct data path" in reply.fallback, reply
        assert digest_of(models_b / "tiny.gguf") == digest_of(model)


@contextlib.asynccontextmanager
async def direct_liar(bus: Bus, model: Path, frames: Callable[[OfferRequest, bytes], bytes]) -> AsyncIterator[None]:
    """Peer `evil`'s `.offer`: a ticket for a listener of its own that answers `ok` and sends `frames(request,
    file)`, then closes. (`held` and `.chunk` are `evil_peer`'s, faithful.)"""
    data = await asyncio.to_thread(model.read_bytes)
    request: list[OfferRequest] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            size = int.from_bytes(await reader.readexactly(4), "big")
            await reader.readexactly(size)
            body = msgspec.json.encode(DataAnswer(ok=True))
            writer.write(len(body).to_bytes(4, "big") + body + frames(request[-1], data))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])

    async def on_offer(msg: Any) -> None:
        request.append(msgspec.json.decode(msg.data, type=OfferRequest))
        offer = DirectOffer(host="127.0.0.1", port=port, ticket="e" * 64, tls=False, ttl_s=30, machine=machine_id())
        await msg.respond(encode(offer))

    sub = await bus.nc.subscribe(S.files("evil", "offer"), cb=on_offer)
    await bus.nc.flush()
    try:
        yield
    finally:
        await sub.unsubscribe()
        server.close()
        async with asyncio.timeout(5):
            await server.wait_closed()


def frame(data: bytes, offset: int, digest: bytes | None = None) -> bytes:
    return FRAME.pack(offset, len(data), digest or blake3.blake3(data).digest()) + data


async def test_a_stream_cut_mid_chunk_resumes_over_nats_from_what_was_verified(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    def two_and_a_half(request: OfferRequest, data: bytes) -> bytes:
        c = request.chunk
        return frame(data[:c], 0) + frame(data[c : 2 * c], c) + frame(data[2 * c : 3 * c], 2 * c)[: c // 2]

    asked: list[int] = []

    def faithful(request: ChunkRequest, piece: bytes) -> tuple[bytes, str]:
        asked.append(request.offset)
        return hashed(piece)

    async with direct_nodes(bus, tmp_path, model) as (_, _, models_b):
        async with evil_peer(bus, model, faithful), direct_liar(bus, model, two_and_a_half):
            reply = await pull(bus, "b", "tiny", peer="evil")
        assert reply.transport == "direct+nats" and "connection_lost" in reply.fallback, reply
        assert digest_of(models_b / "tiny.gguf") == digest_of(model)
        assert asked and min(asked) > 0  # the two verified chunks were not asked again over NATS


async def test_a_direct_stream_that_lies_is_refused_and_nothing_is_left(
    bus: Bus, tmp_path: Path, model: Path, journal_reader: JournalReader
) -> None:
    def lie(request: OfferRequest, data: bytes) -> bytes:
        c = request.chunk
        return frame(data[:c], 0) + frame(data[c : 2 * c], c, digest=bytes(32))

    async with direct_nodes(bus, tmp_path, model) as (_, _, models_b):
        async with evil_peer(bus, model, lambda r, piece: hashed(piece)), direct_liar(bus, model, lie):
            failure = await refused(bus, "b", "tiny", peer="evil")
        assert failure.reply.details["reason"] == "chunk_refused", failure
        assert leftovers(models_b) == []
        (event,) = await journal_reader.wait_for(of_type("model_file_pull_refused", reason="chunk_refused"))
        assert event["peer"] == "evil"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
async def test_a_file_system_that_fills_up_mid_stream_is_a_clear_refusal_keeping_the_verified_part(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    size = (await asyncio.to_thread(model.stat)).st_size
    # the free-space check is told there is room (a file system another writer fills meanwhile)
    async with direct_nodes(bus, tmp_path, model, free_space=lambda _: 1 << 40) as (_, _, models_b):
        if await run("mount", "-t", "tmpfs", "-o", f"size={size // 2}", "tmpfs", str(models_b)) != 0:
            pytest.skip("cannot mount a tmpfs here")
        try:
            failure = await refused(bus, "b", "tiny", peer="a")
            assert failure.reply.details["reason"] == "no_space" and "filled up" in failure.reply.message
            assert not (models_b / "tiny.gguf").exists()
            assert [p for p in leftovers(models_b) if p.endswith(".part")]  # the verified part, for a later pull
        finally:
            assert await run("umount", str(models_b)) == 0
