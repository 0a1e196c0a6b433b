"""A multimodal projector (`--mmproj`) against the real llama-server: weights exact, image graph as predicted.

Each case writes a tiny text model and a LLaVA projector (`tests/tiny_projectors.py`) whose embeddings are
the model's width, starts the server with every allocation-relevant flag pinned as the runner pins them
(`--no-warmup` included, with `--no-mmproj-offload`), and compares what it logs with the prediction:

* at start: the projector was loaded on the host (`clip_ctx: CLIP using CPU backend`) as an "mlp" projector,
  its size (`load_hparams: model size`) prints as its tensors' bytes, and no compute buffer of its graph is
  reserved yet; the runner's observation recovers the weights exactly and counts the graph as pending;
* after the first image: its graph's compute buffer (`reserve_compute_meta`) prints as the placed graph
  predicts (byte for byte as far as 0.01 MiB shows), the text context reserved nothing more, and the image
  took `n_image_tokens` tokens of the context; the observation then counts the buffer, nothing pending.

A projector whose embeddings are not the model's width is refused by the estimate where llama-server
refuses to load it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.placement.caches import cache_allocations
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import MemoryModelError, compute_margin, estimate
from actors.placement.projector import n_image_tokens, projector_compute_bytes, projector_from_header
from actors.runner.allocation_log import parse_allocation_log, printed_mib
from actors.runner.observed import observed_memory
from messages.model import ModelGeometry, ProjectorGeometry
from messages.settings import ServingSettings
from runtime.children import free_port
from tests import tiny_models
from tests.harness.images import image_part
from tests.llama_harness import call_server, require_server, run_server, server_args
from tests.tiny_projectors import write_llava_projector

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
MIB = 1 << 20
#: mtmd's line for each image batch it decodes into the text context, with the image's token count.
IMAGE_BATCH = re.compile(r"decoding image batch \d+/\d+, n_tokens_batch = (\d+)")


def chat(with_image: bool, text: str = "What is in the picture?") -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if with_image:
        content.append(image_part())
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}


@dataclass
class Serving:
    port: int
    log: Callable[[], str]


@contextlib.asynccontextmanager
async def serving(binary: str, model: Path, args: list[str], log_path: Path) -> AsyncIterator[Serving]:
    """A llama-server that stays up while the block runs; always stopped (its process group) at the end."""
    port = free_port()
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    out = await asyncio.to_thread(log_path.open, "wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        out.close()

    def read() -> str:
        return log_path.read_text(errors="replace")

    try:
        async with asyncio.timeout(120):
            while True:
                assert proc.returncode is None, (await asyncio.to_thread(read))[-3000:]
                with contextlib.suppress(OSError, TimeoutError):
                    if (await call_server(port, "GET", "/health", timeout_s=1)).status == 200:
                        break
                await asyncio.sleep(0.05)
        yield Serving(port, read)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(10):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            async with asyncio.timeout(10):
                await proc.wait()


@dataclass(frozen=True)
class Case:
    name: str
    text_embd: int
    shape: dict[str, Any]
    flash_attn: str


CASES = [
    Case("tiny", 64, {"n_embd": 64, "n_head": 4, "n_ff": 128, "image_size": 32, "patch_size": 8}, "on"),
    Case("vit-b-no-class", 256, {"n_embd": 256, "n_head": 4, "n_ff": 1024, "n_layer": 3, "image_size": 224,
                                 "patch_size": 14, "class_embedding": False, "mm_hidden": 512}, "off"),
    Case("vit-l-336", 256, {"n_embd": 1024, "n_head": 16, "n_ff": 4096, "n_layer": 2, "image_size": 336,
                            "patch_size": 14, "mm_hidden": 2048, "dtype": "f16"}, "on"),
]  # fmt: skip


def _settings(flash_attn: str) -> ServingSettings:
    return msgspec.convert({"slots": 2, "cache_ram_mib": 0, "ctx_checkpoints": 0, "flash_attn": flash_attn},
                           ServingSettings)  # fmt: skip


def _files(directory: Path, case: Case) -> tuple[Path, Path, ModelGeometry, ProjectorGeometry]:
    model = tiny_models.write_llama(directory / f"{case.name}.gguf", n_layer=2, n_embd=case.text_embd, n_head=4,
                                    n_head_kv=2, n_ff=2 * case.text_embd)  # fmt: skip
    projector = write_llava_projector(directory / f"{case.name}-mmproj.gguf", text_embd=case.text_embd,
                                      sparse=case.name == "vit-l-336", **case.shape)  # fmt: skip
    return (
        model,
        projector,
        geometry_from_header(read_header(model)),
        projector_from_header(read_header(projector)),
    )


async def _log_once(server: Any, pattern: re.Pattern[str], timeout_s: float = 10.0) -> str:
    """The server's log once it holds `pattern` (llama.cpp logs from a thread of its own), or as it is at the
    deadline."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        text: str = await asyncio.to_thread(server.log)
        if pattern.search(text) or asyncio.get_running_loop().time() > deadline:
            return text
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_the_projector_allocates_what_admission_predicts(case: Case, tmp_path: Path) -> None:
    binary = require_server()
    model, mmproj, geometry, projector = _files(tmp_path, case)
    settings, n_ctx = _settings(case.flash_attn), 4096
    predicted = estimate(geometry, settings, n_ctx, projector=projector)
    allocations = cache_allocations(geometry, settings, n_ctx)
    args = server_args(settings, n_ctx, extra=["--mmproj", str(mmproj), "--no-mmproj-offload"])
    async with serving(binary, model, args, tmp_path / "server.log") as server:
        # at start: loaded on the host, its size as its tensors', no graph reserved yet
        log = parse_allocation_log(await asyncio.to_thread(server.log))
        assert log.projector is not None
        assert (log.projector.backend, log.projector.projector_type) == ("CPU", "mlp")
        assert log.projector.model_mib == printed_mib(projector.tensor_bytes)
        assert log.projector.compute_buffers == {}
        text_compute = [dict(c.compute_buffers) for c in log.contexts]
        at_start = observed_memory(log, predicted, allocations, projector)
        assert "projector_weights_bytes" in at_start.exact
        assert at_start.memory.projector_weights_bytes == predicted.projector_weights_bytes == projector.buffer_bytes
        graph = predicted.projector_compute_bytes
        assert at_start.memory.pending_bytes == graph + compute_margin(graph)

        # the first image: the graph reserved as placed, the image's tokens in the context
        seen = await call_server(server.port, "POST", "/v1/chat/completions", chat(True), timeout_s=120)
        assert seen.status == 200, seen.body[:500]
        text = await _log_once(server, IMAGE_BATCH)  # the server's log thread may write it after the answer
        assert [int(n) for n in IMAGE_BATCH.findall(text)] == [n_image_tokens(projector)]
        log = parse_allocation_log(text)
        assert log.projector is not None
        flash = case.flash_attn == "on"
        assert graph == projector_compute_bytes(projector, flash_attn=flash)
        assert log.projector.compute_buffers == {"CPU": printed_mib(graph)}
        assert [dict(c.compute_buffers) for c in log.contexts] == text_compute  # the text graph did not grow
        after = observed_memory(log, predicted, allocations, projector).memory
        assert after.pending_bytes == 0
        assert after.compute_bytes - at_start.memory.compute_bytes == round(printed_mib(graph) * MIB)


def test_a_projector_of_another_width_is_refused_where_llama_server_refuses_it(tmp_path: Path) -> None:
    binary = require_server()
    model = tiny_models.write_llama(tmp_path / "model.gguf", n_layer=1, n_embd=128, n_head=4, n_ff=256)
    mmproj = write_llava_projector(tmp_path / "mmproj.gguf", text_embd=64)
    settings = _settings("on")
    with pytest.raises(MemoryModelError, match="64 wide, the model's 128"):
        estimate(geometry_from_header(read_header(model)), settings, 4096,
                 projector=projector_from_header(read_header(mmproj)))  # fmt: skip
    run = run_server(model, server_args(settings, 4096, extra=["--mmproj", str(mmproj), "--no-mmproj-offload"]),
                     binary=binary)  # fmt: skip
    assert not run.healthy
    assert "mismatch between text model (n_embd = 128) and mmproj (n_embd = 64)" in run.log
