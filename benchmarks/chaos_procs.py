"""What the chaos run (`benchmarks/chaos.py`) does with processes and disks: `mesh-actor run` nodes it can kill,
stop and restart, the process table read from /proc, and a small filesystem for one node's data dir.

Every process the run starts carries the run's root directory in its command line (data dirs, model paths,
slot-save paths, the embedded server's config), so `sweep` finds whatever is left of the run and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import mesh_actor_command

__all__ = ["NodeProcess", "Proc", "mount_small_fs", "processes_of", "rss_bytes", "sweep", "unmount"]


@dataclass(frozen=True, slots=True)
class Proc:
    """One process of the run, as /proc showed it."""

    pid: int
    ppid: int
    kind: str  # "node", "llama-server", "nats-server" or "other" (a CLI command, the exec wrapper)
    state: str  # /proc/<pid>/stat's state letter (T: stopped, Z: a zombie not reaped yet)


def _kind(argv: list[str]) -> str:
    program = Path(argv[0]).name if argv else ""
    if program == "llama-server":
        return "llama-server"
    if program == "nats-server":
        return "nats-server"
    if "run" in argv and "--node-id" in argv:  # `mesh-actor run`, as NodeProcess starts it
        return "node"
    return "other"


def processes_of(root: Path) -> list[Proc]:
    """Every live process whose command line names `root` (the run's directory)."""
    needle = str(root).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            raw = (entry / "cmdline").read_bytes()
            if needle not in raw:
                continue
            stat = (entry / "stat").read_text()
            # The command name (field 2) may hold spaces: the fields after its closing parenthesis are fixed.
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
            found.append(Proc(int(entry.name), int(ppid), _kind(argv), state))
    return [p for p in found if p.pid != os.getpid()]


def rss_bytes(pid: int) -> int | None:
    """The resident set of `pid` (VmRSS), or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def sweep(root: Path) -> list[Proc]:
    """Kills (SIGKILL, by pid) every process of the run still alive; returns what it found."""
    left = processes_of(root)
    for proc in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a stopped process dies on SIGKILL too, but say so plainly
            os.kill(proc.pid, signal.SIGKILL)
    return left


def mount_small_fs(path: Path, size_mib: int) -> str | None:
    """Mounts a tmpfs of `size_mib` at `path` (root only). None when it worked, else why not."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root"
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(path)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


def unmount(path: Path) -> None:
    # Lazy: a process of the run that is still dying may hold a file open there for a moment.
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=False)


@dataclass
class NodeProcess:
    """One node of the mesh: `mesh-actor run` on its data dir, which the run starts, kills, stops and restarts.

    Its stdout (the "running" line) and stderr (the node's JSON log) go to files in the run's directory, never
    to pipes nobody reads."""

    name: str
    data_dir: Path
    flags: tuple[str, ...]
    env: dict[str, str]
    logs: Path
    process: asyncio.subprocess.Process | None = None
    starts: int = 0
    stopped: bool = False  # SIGSTOPped by the run
    exit_expected: bool = False  # the run killed or stopped it (or its NATS server): an exit is no surprise
    exits: list[int] = field(default_factory=list)  # exit codes of earlier incarnations

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.returncode is None else None

    @property
    def alive(self) -> bool:
        return self.pid is not None

    async def start(self, ready_s: float = 120.0) -> None:
        """Starts it and waits for its "running" line; a node that exits or stays silent is an error."""
        self.starts += 1
        out = self.logs / f"{self.name}.{self.starts}.out"  # one file per incarnation: its own "running" line
        with out.open("wb") as stdout, (self.logs / f"{self.name}.log").open("ab") as stderr:
            self.process = await asyncio.create_subprocess_exec(
                *mesh_actor_command(), "run", "--data-dir", str(self.data_dir), "--node-id", self.name, *self.flags,
                stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                start_new_session=True,  # a Ctrl-C reaches the run, which stops the nodes itself
            )  # fmt: skip
        self.stopped = False
        self.exit_expected = False
        async with asyncio.timeout(ready_s):
            while f"node {self.name} running" not in out.read_text(errors="replace"):
                if self.process.returncode is not None:
                    raise RuntimeError(f"node {self.name} exited with {self.process.returncode} while starting")
                await asyncio.sleep(0.2)  # one line, written once: a file gives no change notification here

    def signal(self, sig: signal.Signals) -> None:
        pid = self.pid
        if pid is not None:
            os.kill(pid, sig)
            if sig == signal.SIGSTOP:
                self.stopped = True
            elif sig == signal.SIGCONT:
                self.stopped = False

    async def wait_exit(self, timeout_s: float) -> int | None:
        """Its exit code once it exits within `timeout_s`, else None (still running)."""
        if self.process is None:
            return None
        try:
            async with asyncio.timeout(timeout_s):
                code = await self.process.wait()
        except TimeoutError:
            return None
        self.exits.append(code)
        return code

    async def kill(self) -> None:
        """SIGKILL, no cleanup: what a crash or the OOM killer does."""
        self.exit_expected = True
        if self.pid is not None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            await self.wait_exit(30)

    async def stop(self, timeout_s: float = 30.0) -> int | None:
        """A graceful stop (SIGTERM), SIGKILL past `timeout_s`; its exit code."""
        self.exit_expected = True
        if self.pid is None:
            return None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        code = await self.wait_exit(timeout_s)
        if code is None:
            await self.kill()
        return code
