"""Which local process is at the other end of a loopback TCP connection (runtime shell, Linux `/proc`).

llama.cpp's RPC protocol has no authentication, and llama-server and ggml-rpc-server speak it over TCP only, so
a relay on loopback cannot ask its peer for a credential. What it can ask the kernel: the peer's socket is the
line of `/proc/net/tcp` whose local address is the connection's remote one and whose remote address is its
local one; its inode is held open by exactly the processes in whose `/proc/<pid>/fd` a `socket:[inode]` link
points at it. Both files are read-only views the kernel writes; nothing here trusts what the peer says.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Final

__all__ = ["peer_is"]

_PROC: Final = Path("/proc")


def _address(field: str) -> tuple[str, int]:
    """`0100007F:9C40` (an IPv4 address in the kernel's byte order, a port in hex) as ("127.0.0.1", 40000)."""
    host, port = field.split(":")
    return socket.inet_ntoa(bytes.fromhex(host)[::-1]), int(port, 16)


def _inode(local: tuple[str, int], remote: tuple[str, int], proc: Path) -> int | None:
    """The inode of the IPv4 TCP socket whose own address is `local` and whose peer is `remote`."""
    try:
        lines = (proc / "net" / "tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            if _address(fields[1]) == local and _address(fields[2]) == remote:
                return int(fields[9])
        except ValueError:
            continue
    return None


def peer_is(pid: int, sockname: tuple[str, int], peername: tuple[str, int], *, proc: Path = _PROC) -> bool:
    """Whether process `pid` holds the other end of the loopback connection whose ends are `sockname` (ours) and
    `peername` (theirs). False whenever it cannot be told (no `/proc`, the peer gone, another process)."""
    inode = _inode(peername[:2], sockname[:2], proc)
    if not inode:
        return False
    wanted = f"socket:[{inode}]"
    fds = proc / str(pid) / "fd"
    try:
        names = os.listdir(fds)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(fds / name) == wanted:
                return True
        except OSError:
            continue
    return False
