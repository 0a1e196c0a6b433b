"""The exact-state identity against real llama-servers: a state moves only where it continues exactly.

The model is a tiny phi3 with LongRoPE factors (`write_phi3(original_context=512)`): llama.cpp rotates keys
with the short factors while a slot's context is at most 512 cells and with the long ones above, and caches
K rotated. Shown here with the engine alone: a state restored across that line is used (one token evaluated)
and continues with other tokens than the server computes itself, while the same state restored where the
identity is equal continues token for token; a slot file does not restore into another stream count at all.
Then through the mesh: after a node restarts with another context for the model, its L3 entries of the old
context are not restored (the prompt is computed cold), and they still serve that context when it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from actors.placement.context import resolve_context
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.runner.serving import state_identity
from messages.placement import Reservation, Stamp
from messages.settings import ServingSettings
from runtime.model_files import FileDigests
from tests.harness.generate import gen, start_model, wait_captured
from tests.harness.nodes import node, wait_nodes
from tests.llama_harness import call_server, require_server, server_args
from tests.tiny_models import write_phi3

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
ORIGINAL_CONTEXT = 512  # cells a slot may have before llama.cpp switches to the long factors
PROMPT = [1 + (i * 7) % 250 for i in range(300)]  # past the capture threshold, within a 512-cell slot
QUIET = ("--cache-ram", "0", "--ctx-checkpoints", "0", "--parallel", "2")
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_server()
    # a wide weight spread makes attention sharp, so the keys' rotation shows in the text
    return write_phi3(
        tmp_path_factory.mktemp("identity-model") / "longrope.gguf", original_context=ORIGINAL_CONTEXT, std=0.5
    )


@dataclass(frozen=True)
class Server:
    port: int
    slot_dir: Path
    settings: ServingSettings
    ctx: int

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        reply = await call_server(self.port, method, path, body, timeout_s=TIMEOUT_S)
        assert reply.status == 200, reply.body
        return reply.json()

    async def complete(self, prompt: list[int], n: int, *, cache_prompt: bool = True) -> tuple[list[int], int]:
        """Greedy tokens on slot 0, and how many prompt tokens the server evaluated."""
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "id_slot": 0, "cache_prompt": cache_prompt}
        reply = await self.call("POST", "/completion", body | {"return_tokens": True})
        return list(reply["tokens"]), int(reply["timings"]["prompt_n"])

    async def restore(self, state: Path) -> int:
        """Copies `state` into the slot directory and restores it into slot 0: the reply's status."""
        shutil.copy(state, self.slot_dir / "restored.bin")
        reply = await call_server(
            self.port, "POST", "/slots/0?action=restore", {"filename": "restored.bin"}, timeout_s=TIMEOUT_S
        )
        return reply.status

    def identity(self, model: Path) -> str:
        """The identity the runner gives an instance stamped like this server, with the context its prediction
        resolves (which the runner verifies against /props before the instance serves)."""
        reservation = Reservation(
            reservation_id="r",
            decision_id="d",
            node_id="n",
            state="running",
            model_path=str(model),
            stamp=Stamp(settings=self.settings, ctx=self.ctx, n_gpu_layers=0),
            layers=(0, 4),
            devices=(),
            held={},
            created_at=0.0,
        )
        context = resolve_context(geometry_from_header(read_header(model)), self.settings, self.ctx)
        digest = FileDigests().digest(model)
        return state_identity(reservation, digest, "pinned", context=context, sliding_window=False)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log_file(directory: Path) -> int:
    directory.mkdir(parents=True)
    return os.open(directory / "server.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)


@contextlib.asynccontextmanager
async def serving(model: Path, directory: Path, *, ctx: int, slots: int) -> AsyncIterator[Server]:
    """A llama-server pinned as the runner pins it, up once /health answers; its process group is stopped
    (SIGTERM, then SIGKILL) whatever happens."""
    settings = ServingSettings(slots=slots, kv_unified=False, cache_ram_mib=0, ctx_checkpoints=0, threads=1)
    port = _free_port()
    argv = ["-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += server_args(settings, ctx, extra=("-t", "1", "--slot-save-path", str(directory)))
    log = _log_file(directory)
    try:
        process = await asyncio.create_subprocess_exec(
            require_server(), *argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopping it stops all it started
        )  # fmt: skip
    finally:
        os.close(log)  # the child holds its own copy
    try:
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                assert process.returncode is None, f"llama-server exited; its log is in {directory}"
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    if (await call_server(port, "GET", "/health", timeout_s=1.0)).status == 200:
                        break
                await asyncio.sleep(0.05)
        server = Server(port=port, slot_dir=directory, settings=settings, ctx=ctx)
        props = await server.call("GET", "/props")
        shape = resolve_context(geometry_from_header(read_header(model)), settings, ctx)
        assert props["default_generation_settings"]["n_ctx"] == shape.n_ctx_seq  # the runner's drift check
        yield server
    finally:
        await _stop(process)


async def _stop(process: asyncio.subprocess.Process) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await process.wait()


async def test_a_state_restored_across_the_original_context_would_continue_with_other_tokens(
    tmp_path: Path, model: Path
) -> None:
    async with (
        serving(model, tmp_path / "short", ctx=512, slots=1) as short,  # 512 cells a slot: short factors
        serving(model, tmp_path / "twin", ctx=512, slots=1) as twin,  # the same settings on another server
        serving(model, tmp_path / "long", ctx=1024, slots=1) as long,  # 1024 cells: long factors
        serving(model, tmp_path / "streams", ctx=1024, slots=2) as streams,  # 512 cells a slot, two streams
    ):
        assert short.identity(model) == twin.identity(model)
        assert len({short.identity(model), long.identity(model), streams.identity(model)}) == 3

        first, _ = await short.complete(PROMPT, 16)
        await short.call("POST", "/slots/0?action=save", {"filename": "state.bin"})
        state = short.slot_dir / "state.bin"
        turn = PROMPT + first  # the next turn extends the saved tokens
        resident, evaluated = await short.complete(turn, 8)
        assert evaluated == 1

        # the same identity: restored, one token evaluated, the same continuation token for token
        assert await twin.restore(state) == 200
        assert await twin.complete(turn, 8) == (resident, 1)

        # across the original context: the engine restores it and uses it (one token evaluated), and the text
        # differs from what that server computes itself. This is the silent error the identity prevents.
        assert await long.restore(state) == 200
        restored, evaluated = await long.complete(turn, 8)
        assert evaluated == 1
        cold, evaluated = await long.complete(turn, 8, cache_prompt=False)
        assert evaluated == len(turn)
        assert restored != cold, "the keys' rotation should change the continuation"

        # another stream count: the engine refuses the file (a wasted restore, not a wrong one)
        assert await streams.restore(state) == 400


async def test_after_a_context_change_the_node_computes_cold_and_keeps_the_old_contexts_states(
    tmp_path: Path, model: Path
) -> None:
    data_dir = tmp_path / "node"
    # two slots with per-slot KV: -c 1024 gives 512 cells a slot (short factors), -c 2048 gives 1024 (long)
    async with node(data_dir, "solo", *QUIET):
        await wait_nodes(data_dir, "solo")
        await start_model(data_dir, model, ctx=1024)
        short = await gen(data_dir, model.name, PROMPT)
        assert short["source"] == "cold" and short["capture"] == "queued", short
        await wait_captured(data_dir, len(PROMPT) - 1)

    async with node(data_dir, "solo", *QUIET):  # restarted with the model at another context; L3 on disk
        await wait_nodes(data_dir, "solo")
        await start_model(data_dir, model, ctx=2048)
        long = await gen(data_dir, model.name, PROMPT, 32, "--no-capture")
        assert long["source"] == "cold" and long["tokens_evaluated"] == len(PROMPT), long
        assert long["tokens"] != short["tokens"]  # the model's text depends on the context, so a state would too

    async with node(data_dir, "solo", *QUIET):  # the first context again: its states are still there
        await wait_nodes(data_dir, "solo")
        await start_model(data_dir, model, ctx=1024)
        again = await gen(data_dir, model.name, PROMPT)
        assert again["source"] == "l3_local", again
        assert (again["tokens_restored"], again["tokens_evaluated"]) == (len(PROMPT) - 1, 1), again
        assert again["tokens"] == short["tokens"]
