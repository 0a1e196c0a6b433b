"""A program on a loopback of its own, which no other local process can reach (runtime shell).

llama.cpp's `ggml-rpc-server` has no authentication and listens on TCP only, so on the host's loopback any
local process could drive a member's lent memory (issue 30, F15). A member therefore runs it in a network
namespace of its own, whose loopback only the processes inside can reach. A new user namespace maps the
runner's user to root there, so this needs no privilege: `unshare --user --map-root-user --net` (util-linux).

The runner's tunnel exit still reaches the program: the namespace's first process is a small broker
(`python -m runtime.private_loopback`) that starts the program, and, when the exit asks, connects to the
program's port inside the namespace and hands the connected socket back over a unix socket pair the runner
created (`socket.send_fds`, SCM_RIGHTS). The bytes then go between the exit and the program with nothing in
between. The pair is inherited, it has no name in any file system, so no other process can ask.

On the pair, one byte each way: the broker writes `R` once the program listens; the exit writes `C`, and the
broker answers `F` with the socket, or `E` when the connect failed. The broker exits with the program's code
when the program exits, and kills it when the runner is gone (the pair closed, or the parent-death signal).

Where user namespaces are not permitted (a `kernel.unprivileged_userns_clone=0` host, an AppArmor
restriction), `available()` says so once, and the caller runs the program on the host's loopback instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Final

from runtime.children import LOOPBACK, dying_with_parent, port_free

__all__ = ["BrokerGone", "PrivateLoopback", "available", "command"]

#: How long a dial may take: the broker's connect inside the namespace, and the socket's way back.
DIAL_TIMEOUT_S: Final = 10.0
_PROBE_TIMEOUT_S: Final = 10.0
_LISTEN_POLL_S: Final = 0.02
_READY, _CONNECT, _SOCKET, _FAILED = b"R", b"C", b"F", b"E"
# ioctl numbers and flag of netdevice(7): a new network namespace's loopback starts down
_SIOCGIFFLAGS: Final = 0x8913
_SIOCSIFFLAGS: Final = 0x8914
_IFF_UP: Final = 0x1
_IFREQ: Final = struct.Struct("16sH22x")

_available: bool | None = None


class BrokerGone(ConnectionError):
    """The broker (and so the program) is gone, or did not answer in time."""


def _unshare() -> str | None:
    return shutil.which("unshare")


def command(program: Sequence[str], broker_fd: int, port: int) -> list[str]:
    """The argv that runs `program` (listening on loopback `port`) in a namespace of its own, its broker on
    `broker_fd` (the child's end of the pair, passed to the child)."""
    unshare = _unshare()
    assert unshare is not None, "available() first"
    broker = [sys.executable, "-m", "runtime.private_loopback", str(broker_fd), str(port), str(os.getpid())]
    return [unshare, "--user", "--map-root-user", "--net", "--", *broker, "--", *program]


def _probe() -> bool:
    unshare = _unshare()
    if unshare is None:
        return False
    check = "import runtime.private_loopback as p; p.loopback_up(); p.port_free(0)"
    argv = [unshare, "--user", "--map-root-user", "--net", "--", sys.executable, "-c", check]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


async def available() -> bool:
    """Whether programs can be run on a loopback of their own here (asked once, then remembered)."""
    global _available
    if _available is None:
        _available = await asyncio.to_thread(_probe)
    return _available


class PrivateLoopback:
    """The runner's end of one broker's pair: waits until the program listens, and dials it."""

    def __init__(self) -> None:
        self._ours, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._ours.settimeout(DIAL_TIMEOUT_S)
        self._lock = asyncio.Lock()

    @property
    def child_fd(self) -> int:
        """The broker's end: pass it to the child (`pass_fds`), then `spawned()`."""
        return self._theirs.fileno()

    def spawned(self) -> None:
        """The child holds its end now: ours of it is closed, so the pair ends when the broker does."""
        self._theirs.close()

    async def listening(self, timeout_s: float) -> bool:
        """Whether the program listens within `timeout_s` (False: the broker ended, or it never did)."""
        try:
            return await asyncio.to_thread(self._read_ready, timeout_s) == _READY
        except OSError:  # a timeout among them
            return False

    def _read_ready(self, timeout_s: float) -> bytes:  # worker thread
        self._ours.settimeout(timeout_s)
        try:
            return self._ours.recv(1)
        finally:
            self._ours.settimeout(DIAL_TIMEOUT_S)

    async def dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the program, made inside its namespace."""
        async with self._lock:  # one question on the pair at a time
            try:
                sock = await asyncio.to_thread(self._ask)
            except OSError as exc:
                raise BrokerGone(f"the RPC server's broker did not hand over a connection: {exc!r}") from exc
        return await asyncio.open_connection(sock=sock)

    def _ask(self) -> socket.socket:  # worker thread
        self._ours.sendall(_CONNECT)
        message, fds, _flags, _address = socket.recv_fds(self._ours, 1, 1)
        if message != _SOCKET or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ConnectionRefusedError(f"the broker answered {message!r}")
        return socket.socket(fileno=fds[0])

    def close(self) -> None:
        self._ours.close()
        with contextlib.suppress(OSError):
            self._theirs.close()


# --- the broker: runs inside the namespace ---------------------------------------------------------------


def loopback_up() -> None:
    """Brings the namespace's loopback interface up (a new network namespace's starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        _name, flags = _IFREQ.unpack(fcntl.ioctl(s, _SIOCGIFFLAGS, _IFREQ.pack(b"lo", 0)))
        fcntl.ioctl(s, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))


def _serve(pair: socket.socket, port: int, program: subprocess.Popen[bytes]) -> None:
    """Answers the exit's asks until the pair closes (the runner is gone): then the program is killed."""
    while True:
        try:
            ask = pair.recv(1)
        except OSError:
            ask = b""
        if ask != _CONNECT:
            break
        try:
            with socket.create_connection((LOOPBACK, port), timeout=DIAL_TIMEOUT_S) as connected:
                socket.send_fds(pair, [_SOCKET], [connected.fileno()])
        except OSError:
            with contextlib.suppress(OSError):
                pair.sendall(_FAILED)
    with contextlib.suppress(ProcessLookupError):
        program.kill()


def main(argv: Sequence[str]) -> int:
    """`python -m runtime.private_loopback <pair fd> <port> <runner pid> -- program…`"""
    fd, port, parent = int(argv[0]), int(argv[1]), int(argv[2])
    program = list(argv[argv.index("--") + 1 :])
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the runner
    if os.getppid() != parent:
        return 70
    loopback_up()
    pair = socket.socket(fileno=fd)
    child = subprocess.Popen(dying_with_parent(program, signal.SIGKILL, os.getpid()))
    deadline = time.monotonic() + DIAL_TIMEOUT_S
    while port_free(port) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(_LISTEN_POLL_S)
    if child.poll() is None and not port_free(port):
        pair.sendall(_READY)
        threading.Thread(target=_serve, args=(pair, port, child), daemon=True).start()
    else:
        child.kill()
    code = child.wait()
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell says it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
