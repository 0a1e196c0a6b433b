"""A split's head: the links from its llama-server to the members' RPC servers (runner shell).

Before each start of a split instance's server, the head asks every member of its stamp for its part
(`mesh.runner.<member>.lend`, `lending.py` on the member) and keeps one `TunnelEntrance` per member on its own
loopback, dialling that member's tunnel exit with mutual TLS under the cluster CA. llama-server is then given
`--rpc 127.0.0.1:<entrance>,…` in the stamp's member order, so the device `RPC<i>` is the stamp's member `i`.

When a carried connection ends, or a member's exit cannot be reached, `on_lost(member, detail)` is called: the
driver turns it into `instance_lifecycle.MemberLost`, a crash naming the member once the server has loaded (its buffers
hold one connection per member for the server's life). The links are closed when the instance ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from messages.placement import Reservation
from messages.runner import LendRequest, Lent
from runtime.actor import ActorContext
from runtime.bus import BusError
from runtime.rpc_tunnel import TunnelEntrance
from runtime.tls import TlsFiles

__all__ = ["MemberLinks", "SplitUnavailable"]


class SplitUnavailable(Exception):
    """A member did not lend its part (it refused, did not answer, or answered nonsense)."""


class MemberLinks:
    def __init__(
        self,
        ctx: ActorContext,
        node_id: str,
        reservation: Reservation,
        tls: TlsFiles | None,
        on_lost: Callable[[str, str], None],
        *,
        timeout_s: float = 15.0,
    ) -> None:
        self._ctx = ctx
        self._node_id = node_id
        self._reservation = reservation
        self._tls = tls
        self._on_lost = on_lost
        self._timeout_s = timeout_s
        self._entrances: dict[str, tuple[Lent, TunnelEntrance]] = {}  # member -> where it lends, our entrance
        self._server: asyncio.Future[int] = asyncio.get_running_loop().create_future()  # its pid, once spawned

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(m.node_id for m in self._reservation.stamp.rpc)

    async def open(self) -> tuple[str, ...]:
        """Asks each member for its part; returns llama-server's `--rpc` endpoints, in the stamp's order."""
        if self.members and self._tls is None:
            raise SplitUnavailable(
                "this node has no cluster certificates (no --cluster-secret-file): it cannot reach split members"
            )
        endpoints = []
        for member in self.members:
            lent = await self._ask(member)
            known = self._entrances.get(member)
            if known is not None and (known[0].host, known[0].port) != (lent.host, lent.port):
                await known[1].close()  # the member serves its part elsewhere now
                known = None
            if known is None:
                assert self._tls is not None
                entrance = TunnelEntrance(
                    self._tls, lent.host, lent.port, on_end=self._lost(member), server_pid=self._server_pid
                )
                await entrance.start()
                known = (lent, entrance)
                self._entrances[member] = known
            endpoints.append(f"127.0.0.1:{known[1].port}")
        return tuple(endpoints)

    def server_starting(self) -> None:
        """A server is about to start: the entrances wait for its pid (not a predecessor's) before carrying."""
        if self._server.done():
            self._server = asyncio.get_running_loop().create_future()

    def server_started(self, pid: int) -> None:
        """The server the entrances carry for (only its process's connections): this spawn's."""
        if self._server.done():
            self._server = asyncio.get_running_loop().create_future()
        self._server.set_result(pid)

    async def _server_pid(self) -> int:
        return await asyncio.shield(self._server)

    def _lost(self, member: str) -> Callable[[str], None]:
        return lambda detail: self._on_lost(member, detail)

    async def _ask(self, member: str) -> Lent:
        request = LendRequest(reservation_id=self._reservation.reservation_id, head=self._node_id)
        subject = self._ctx.subjects.runner(member, "lend")
        try:
            lent = await self._ctx.bus.request(subject, request, Lent, timeout=self._timeout_s)
        except BusError as exc:
            raise SplitUnavailable(f"member {member} did not lend its part: {exc}") from exc
        if lent.node_id != member or lent.reservation_id != self._reservation.reservation_id:
            raise SplitUnavailable(f"member {member} answered for {lent.node_id}/{lent.reservation_id}")
        return lent

    async def close(self) -> None:
        for _, entrance in self._entrances.values():
            await entrance.close()
        self._entrances.clear()
