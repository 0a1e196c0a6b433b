"""The front door from outside: a catalog written for nodes, API keys, an HTTP client, the instances a door reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

from tests.harness.nodes import events_of, instances_of

QUIET = ("--cache-ram", "0", "--ctx-checkpoints", "0", "--parallel", "2")


KEY = "test-key-123"


KEYED = {"MESH_ACTOR_API_KEY": KEY}  # the key in the environment: never on a command line


def write_catalog(data_dir: Path, entries: dict[str, dict[str, Any]]) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, fields in entries.items():
        lines.append(f"[models.{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    (data_dir / "models.toml").write_text("\n".join(lines) + "\n")


def client(port: int, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)


async def instances(data_dir: Path) -> list[dict[str, Any]]:
    return [i for i in await instances_of(data_dir) if i["state"] in ("starting", "ready")]


# Stops one thread of a running process (ptrace: PTRACE_SEIZE, then PTRACE_INTERRUPT) and keeps it stopped until
# the process ends, reaping the traced thread's events so that the process's real parent (the runner) sees it exit.
# Run as its own process: a tracer that dies detaches, so a failing test cannot leave a server stopped.
_WEDGE = """
import ctypes, os, sys
tid = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
for request in (0x4206, 0x4207):  # PTRACE_SEIZE, PTRACE_INTERRUPT
    if libc.ptrace(request, tid, None, None) != 0:
        print("ptrace:", os.strerror(ctypes.get_errno()), flush=True)
        sys.exit(3)
print("wedged", flush=True)
while True:
    try:
        _, status = os.waitpid(tid, 0x40000000)  # __WALL: a traced thread of another process's child
    except ChildProcessError:
        break
    if os.WIFEXITED(status) or os.WIFSIGNALED(status):
        break  # otherwise a stop (the interrupt, a signal): the thread stays stopped
"""


async def _events(data_dir: Path, kind: str) -> list[dict[str, Any]]:
    return await events_of(data_dir, "--subject", kind)
