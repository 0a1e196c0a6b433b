"""A model split over llama.cpp's RPC backend, its traffic inside the mesh's mutual-TLS tunnel.

A member's `ggml-rpc-server` listens on loopback only, behind a `TunnelExit` (cluster certificate required); the
head's llama-server reaches it through a `TunnelEntrance` on its own loopback. Greedy output of the split server
equals the unsplit server's token for token, and the remote device holds layers (its buffers in the log)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from runtime.children import free_port, port_free
from runtime.rpc_tunnel import TunnelEntrance, TunnelExit
from runtime.tls import ensure_route_certificates
from tests.harness.rpc_split import greedy, healthy, process, tail
from tests.llama_harness import require_server
from tests.tiny_models import write_llama

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
SECRET = "split-secret"


def rpc_server_binary() -> str:
    path = Path(require_server()).with_name("ggml-rpc-server")
    if not os.access(path, os.X_OK):
        pytest.skip("llama.cpp was built without its RPC backend (CMAKE_ARGS=-DGGML_RPC=ON)")
    return str(path)


async def test_a_split_through_the_tls_tunnel_answers_as_the_unsplit_server(tmp_path: Path) -> None:
    server, rpc = require_server(), rpc_server_binary()
    model = write_llama(tmp_path / "split.gguf", n_layer=6, n_embd=128, n_head=4, n_head_kv=2, n_ff=256)
    member = ensure_route_certificates(tmp_path / "member", SECRET, ["127.0.0.1"])
    head = ensure_route_certificates(tmp_path / "head", SECRET, ["127.0.0.1"])
    common = ["-m", str(model), "-c", "1024", "-np", "1", "--host", "127.0.0.1", "--fit", "off", "-lv", "4"]

    unsplit_port = free_port()
    unsplit_log = tmp_path / "unsplit.log"
    async with process([server, *common, "--port", str(unsplit_port)], unsplit_log) as unsplit:
        await healthy(unsplit_port, unsplit, unsplit_log)
        expected = await greedy(unsplit_port)

    rpc_port = free_port()
    async with (
        process([rpc, "-H", "127.0.0.1", "-p", str(rpc_port)], tmp_path / "rpc.log") as rpc_server,
        TunnelExit(member, rpc_port) as exit_,
    ):
        async with asyncio.timeout(30):  # the split server connects once: the RPC server must listen first
            while port_free(rpc_port) and rpc_server.returncode is None:
                await asyncio.sleep(0.05)
        await exit_.start("127.0.0.1")
        async with TunnelEntrance(head, "127.0.0.1", exit_.port) as entrance:
            await entrance.start()
            split_port = free_port()
            split_log = tmp_path / "split.log"
            argv = [server, *common, "--port", str(split_port), "--rpc", f"127.0.0.1:{entrance.port}", "-ngl", "3"]
            async with process(argv, split_log) as split:
                await healthy(split_port, split, split_log)
                assert await greedy(split_port) == expected  # token for token
            log = tail(split_log, 1 << 20)
            assert f"RPC0[127.0.0.1:{entrance.port}]" in log and "model buffer size" in log, log[-3000:]
