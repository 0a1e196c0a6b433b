"""A NATS cluster of `mesh-actor run` nodes on loopback for tests: each node's embedded nats-server takes
routes on its own port and joins the others, under one cluster secret (routes in TLS under the CA it derives;
the same certificates carry split serving's RPC tunnels). `cluster(root)` starts every node and stops them all
at the end (SIGTERM, then SIGKILL past 30 s), whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

from runtime.children import port_free
from tests.conftest import mesh_actor_command, run_cli

__all__ = ["NODES", "Cluster", "cli", "cluster"]

NODES = ("c1", "c2", "c3")
ALARMS = ("warning", "error", "critical")


async def cli(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    return await run_cli(*args, timeout=timeout)


class Cluster:
    def __init__(self, root: Path, flags: Mapping[str, Sequence[str]] | None = None) -> None:
        self.root = root
        self.flags = dict(flags or {})
        self.ports = _route_ports(len(NODES))
        root.mkdir(parents=True, exist_ok=True)
        self.secret = root / "cluster.secret"
        self.secret.write_text("s3cret-shared-by-every-node-" + os.urandom(8).hex() + "\n")
        self.processes: dict[str, asyncio.subprocess.Process] = {}

    def data_dir(self, name: str) -> Path:
        return self.root / name

    def stderr(self, name: str) -> Path:
        return self.root / f"{name}.stderr"

    def why(self, name: str) -> str:
        """What a node that did not come up left behind: its exit code, stderr and its nats-server's output."""
        tails = [f"{name} exit code {self.processes[name].returncode}"]
        for path in (self.stderr(name), self.data_dir(name) / "nats-server.out"):
            with contextlib.suppress(OSError):
                tails.append(f"--- {path.name}:\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(tails)

    def log_tails(self, lines: int = 25) -> str:
        """The last `lines` lines of each started node's log, its warnings and errors before them."""
        parts = []
        for name in self.processes:
            with contextlib.suppress(OSError):
                logged = self.stderr(name).read_text(errors="replace").splitlines()
                alarms = [line for line in logged[:-lines] if any(f'"level": "{lv}"' in line for lv in ALARMS)]
                parts.append(f"--- {name}'s log (warnings and errors, then its last {lines} lines):")
                parts += [*alarms[-lines:], *logged[-lines:]]
        return "\n".join(parts)

    async def start(self, name: str) -> asyncio.subprocess.Process:
        joins = [a for other in NODES for a in ("--join", f"127.0.0.1:{self.ports[other]}")]
        with self.stderr(name).open("ab") as err:  # the child keeps its own descriptor
            process = await asyncio.create_subprocess_exec(
                *mesh_actor_command(),
                "run",
                "--data-dir",
                str(self.data_dir(name)),
                "--node-id",
                name,
                "--nats-port",
                "0",
                "--telemetry-interval",
                "0.5",
                "--cluster-listen",
                f"127.0.0.1:{self.ports[name]}",
                "--cluster-secret-file",
                str(self.secret),
                *joins,
                *self.flags.get(name, ()),
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self.processes[name] = process
        return process

    async def ready(self, name: str, timeout: float = 90) -> None:
        stdout = self.processes[name].stdout
        assert stdout is not None
        async with asyncio.timeout(timeout):
            line = (await stdout.readline()).decode()
        if "running" not in line:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self.processes[name].wait()
            raise AssertionError(f"{name} did not start ({line!r})\n{self.why(name)}")

    def kill(self, name: str) -> None:
        self.processes[name].send_signal(signal.SIGKILL)

    async def stop_all(self) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                async with asyncio.timeout(30):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


def _route_ports(n: int) -> dict[str, int]:
    """Free ports for the route listeners, below Linux's ephemeral range (32768-60999): a port the kernel hands
    out for `--nats-port 0` or any client socket can never be one of them (seen: a route port taken by another
    node's client listener between choosing it and binding it)."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(20000, 32000)
        if port not in ports and port_free(port):
            ports.append(port)
    return dict(zip(NODES, ports, strict=True))


@contextlib.asynccontextmanager
async def cluster(root: Path, flags: Mapping[str, Sequence[str]] | None = None) -> AsyncIterator[Cluster]:
    """Every node of `NODES` started and ready (`flags`: more `mesh-actor run` flags per node)."""
    mesh = Cluster(root, flags)
    try:
        for name in NODES:
            await mesh.start(name)
        await asyncio.gather(*(mesh.ready(name) for name in NODES))
        yield mesh
    except Exception as exc:  # a failing test shows what each node logged last (a CI run keeps no files)
        exc.add_note(mesh.log_tails())
        raise
    finally:
        await mesh.stop_all()
