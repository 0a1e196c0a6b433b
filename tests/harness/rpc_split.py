"""llama.cpp RPC splits: member processes, their health, greedy generation to compare outputs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from tests.llama_harness import call_server


@contextlib.asynccontextmanager
async def process(argv: Sequence[str], log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """A child in its own process group, stopped with the group (SIGTERM, then SIGKILL) whatever happens."""
    with log.open("wb") as out:
        child = await asyncio.create_subprocess_exec(
            *argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        yield child
    finally:
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(10):
                    await child.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                await child.wait()


def tail(log: Path, size: int = 3000) -> str:
    return log.read_text(errors="replace")[-size:]


async def healthy(port: int, child: asyncio.subprocess.Process, log: Path) -> None:
    async with asyncio.timeout(60):
        while True:
            assert child.returncode is None, tail(log)
            with contextlib.suppress(Exception):
                if (await call_server(port, "GET", "/health", timeout_s=2)).status == 200:
                    return
            await asyncio.sleep(0.2)


async def greedy(port: int) -> list[int]:
    body = {"prompt": "Once upon a time", "n_predict": 24, "temperature": 0, "return_tokens": True}
    reply = await call_server(port, "POST", "/completion", body, timeout_s=60)
    tokens = reply.json()["tokens"]
    assert isinstance(tokens, list) and tokens
    return [int(t) for t in tokens]
