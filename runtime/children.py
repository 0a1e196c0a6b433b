"""Child processes of a node (nats-server, llama-server) and the loopback ports they listen on.

A child must not outlive the node, even when the node is killed with SIGKILL. Linux's parent-death signal
does that, but setting it needs code to run between fork and exec, and `preexec_fn` is unsafe while
threads run (our `asyncio.to_thread` workers do). So the child is started through a tiny exec wrapper: a
fresh Python interpreter sets the parent-death signal on itself, checks that its parent is still the node
(the node may have died before the signal was armed), and `exec`s the real program, which keeps the signal.
The child gets its own process group (`process_group=0`, no `preexec_fn`), so signals reach the whole group.
"""

from __future__ import annotations

import signal
import socket
import sys

LOOPBACK = "127.0.0.1"

# argv: [python, -c, WRAPPER, <signal number>, <parent pid>, program, args...]
_WRAPPER = (
    "import ctypes,os,sys\n"
    "sig,parent=int(sys.argv[1]),int(sys.argv[2])\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None,use_errno=True).prctl(1,sig)\n"  # PR_SET_PDEATHSIG
    "    if os.getppid()!=parent: os._exit(70)\n"
    "os.execv(sys.argv[3],sys.argv[3:])\n"
)


def dying_with_parent(argv: tuple[str, ...] | list[str], sig: signal.Signals, parent: int) -> list[str]:
    """`argv` wrapped so the program gets `sig` when the process `parent` (the caller's pid) dies.

    The signal follows the thread that forked: spawn from the event loop's thread, never a worker thread.
    `argv[0]` must be a path (the wrapper execs it without a PATH search)."""
    return [sys.executable, "-I", "-S", "-c", _WRAPPER, str(int(sig)), str(parent), *argv]


def port_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether `port` can be listened on now (a port in TIME_WAIT after our own restart counts as free,
    as nats-server and llama-server themselves set SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    """A port nobody listens on now. The child may still lose it to a race: callers handle the exit."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
