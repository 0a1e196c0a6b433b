"""Which parts of other nodes' splits this node lends, and how it runs each (runner core, pure).

A member lends a part only on its head's request, and only while its own ledger books it for that head: the
ledger is the truth (placement wrote it, all parts or none), the request only names it (`lend_refusal`). A part
ends once its booking leaves the ledger (`unbooked`). Each part is one `ggml-rpc-server` on loopback, host
memory only (`rpc_server_command`). No I/O: `lending.py` is the shell that runs them.
"""

from __future__ import annotations

from actors.runner.command import LOOPBACK
from messages.placement import NodeLedger
from messages.runner import LendRequest

__all__ = ["lend_refusal", "rpc_server_command", "unbooked"]


def rpc_server_command(rpc_server: str, port: int, threads: int | None) -> tuple[str, ...]:
    """The RPC server of one part: loopback only, host memory only (`-d CPU`: what placement booked)."""
    argv = [rpc_server, "-H", LOOPBACK, "-p", str(port), "-d", "CPU"]
    if threads:
        argv += ["-t", str(threads)]
    return tuple(argv)


def lend_refusal(ledger: NodeLedger | None, request: LendRequest, node_id: str) -> str | None:
    """Why this node does not lend what `request` asks (None: its ledger books that part for that head)."""
    rid = request.reservation_id
    part = next((r for r in ledger.reservations if r.reservation_id == rid), None) if ledger else None
    if part is None:
        return f"node {node_id} holds no reservation {rid!r}"
    if part.split is None or node_id not in part.split.members:
        return f"reservation {rid!r} does not make node {node_id} a member of a split"
    if part.split.head != request.head:
        return f"reservation {rid!r} is lent to {part.split.head}, not to {request.head}"
    return None


def unbooked(lent: set[str], ledger: NodeLedger | None, node_id: str) -> set[str]:
    """The parts served now whose booking is no longer in this node's ledger."""
    booked = {
        r.reservation_id
        for r in (ledger.reservations if ledger else ())
        if r.split is not None and node_id in r.split.members
    }
    return lent - booked
