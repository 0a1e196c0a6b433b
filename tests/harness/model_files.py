"""What the model-file tests share: two files actors on one bus (a holds the model, b does not), a peer that
lies about chunks, and the requests a node answers (`mesh.files.<node>.*`)."""

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
from messages.files import (
    FILES_BLAKE3_HEADER,
    FILES_OFFSET_HEADER,
    FILES_TOTAL_HEADER,
    ChunkRequest,
    FileHeld,
    HeldRequest,
    PullReply,
    PullRequest,
)
from messages.subjects import Subjects
from runtime.bus import Bus, RemoteError, encode
from tests.conftest import supervised

S = Subjects()
CATALOG = '[models.tiny]\npath = "tiny.gguf"\n\n[models.escape]\npath = "../escape.gguf"\n'


def digest_of(path: Path) -> str:
    return str(blake3.blake3(path.read_bytes()).hexdigest())


def node_dirs(root: Path, name: str) -> tuple[Path, Path]:
    data = root / name
    models = data / "models"
    models.mkdir(parents=True)
    (data / "models.toml").write_text(CATALOG)
    return data, models


@contextlib.asynccontextmanager
async def nodes(
    bus: Bus, root: Path, model: Path, limits: FilesLimits | None = None, trusted: tuple[str, ...] = ()
) -> AsyncIterator[tuple[Path, Path]]:
    """Node `a` holds the model, node `b` does not; yields their models dirs."""
    data_a, models_a = node_dirs(root, "a")
    data_b, models_b = node_dirs(root, "b")
    os.link(model, models_a / "tiny.gguf")
    a = FilesActor("a", data_a, models_dir=models_a, limits=limits, trusted_registry_keys=trusted)
    b = FilesActor("b", data_b, models_dir=models_b, limits=limits, trusted_registry_keys=trusted)
    async with supervised(bus, [a], node_id="a"), supervised(bus, [b], node_id="b"):
        await answering(bus, b)
        yield models_a, models_b


async def answering(bus: Bus, *actors: FilesActor) -> None:
    """Once every one of `actors` answers (`not_found` for a name no catalog gives)."""
    async with asyncio.timeout(10):
        for actor in actors:
            while True:
                try:
                    await bus.request(S.files(actor.node_id, "held"), HeldRequest(path="x.gguf"), FileHeld, timeout=1)
                except RemoteError:
                    break
                except Exception:
                    await asyncio.sleep(0.05)


async def pull(bus: Bus, node: str, name: str, peer: str | None = None) -> PullReply:
    return await bus.request(S.files(node, "pull"), PullRequest(name=name, peer=peer), PullReply, timeout=60)


async def refused(bus: Bus, node: str, name: str, peer: str | None = None) -> RemoteError:
    with pytest.raises(RemoteError) as caught:
        await pull(bus, node, name, peer)
    return caught.value


@contextlib.asynccontextmanager
async def evil_peer(
    bus: Bus, model: Path, chunk: Callable[[ChunkRequest, bytes], tuple[bytes, str] | None]
) -> AsyncIterator[list[int]]:
    """A peer `evil` that says it holds the model and answers chunks as `chunk` decides (None: no answer);
    yields the offsets asked."""
    data = await asyncio.to_thread(model.read_bytes)
    asked: list[int] = []

    async def on_held(msg: Any) -> None:
        await msg.respond(encode(FileHeld(node_id="evil", path="tiny.gguf", size=len(data), blake3=digest_of(model))))

    async def on_chunk(msg: Any) -> None:
        request = msgspec.json.decode(msg.data, type=ChunkRequest)
        asked.append(request.offset)
        piece = data[request.offset : request.offset + min(request.length, bus.max_payload - 4096)]
        answer = chunk(request, piece)
        if answer is None:
            return
        body, stated = answer
        headers = {FILES_OFFSET_HEADER: str(request.offset), FILES_TOTAL_HEADER: str(len(data))}
        await bus.nc.publish(msg.reply, body, headers={**headers, FILES_BLAKE3_HEADER: stated})

    subs = [await bus.nc.subscribe(S.files("evil", "held"), cb=on_held)]
    subs.append(await bus.nc.subscribe(S.files("evil", "chunk"), cb=on_chunk))
    await bus.nc.flush()
    try:
        yield asked
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def run(*argv: str) -> int:
    process = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.DEVNULL)
    async with asyncio.timeout(30):
        return await process.wait()


def hashed(piece: bytes) -> tuple[bytes, str]:
    return piece, str(blake3.blake3(piece).hexdigest())


def leftovers(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir())
