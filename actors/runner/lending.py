"""A member's side of split serving: this node lends its host memory to another node's instance (runner shell).

A split's head asks `mesh.runner.<member>.lend` for the member's part of a reservation (`LendRequest`). The
member answers only for a part its own ledger books for that head (`lend_refusal`, pure: the ledger is the
truth, the request only names it), and then serves the part:

    ggml-rpc-server -H 127.0.0.1 -p C -d CPU -t N   (loopback only: llama.cpp's RPC has no authentication)
    TunnelExit on this node's lending address :B     (mutual TLS under the cluster CA, runtime/rpc_tunnel.py)

The RPC server's loopback is one of its own (`runtime.private_loopback`: a network namespace, which the exit
reaches through the server's broker), so no other local process can connect to it; where the host permits no
user namespaces, it is the host's, and `rpc_lent` says so (`private_loopback` false).

and answers where the exit listens (`Lent`). One RPC server per part: a `ggml-rpc-server` serves one client at a
time, so two heads (or two instances of one head) never share one. Asked again (the head restarts its server),
it answers with the same exit.

Supervision: the RPC server runs in its own process group and dies with the runner (parent-death signal, as
llama-server does, `process.py`), its output goes to `runner/lend-<reservation>/rpc-server.log` (size-bounded).
When it exits unasked, `rpc_server_exited` is journaled and it is restarted on the same port after the restart
policy's backoff; the head sees its connection end and restarts its instance (`instance_lifecycle.MemberLost`). Past the
policy's limit the part is given up (`rpc_lend_ended`). A part ends when its booking leaves this node's ledger
(`reconcile`, on every change of the ledger: the head's instance stopped or failed and placement released the
split), and every part ends when the runner stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from actors.runner.command import server_environment
from actors.runner.parts import lend_refusal, rpc_server_command, unbooked
from actors.runner.process import ServerLog, ServerProcess
from messages.errors import NOT_FOUND, UNAVAILABLE
from messages.events import RpcLendEnded, RpcLent, RpcServerExited
from messages.placement import NodeLedger
from messages.runner import LendRequest, Lent
from runtime import private_loopback
from runtime.actor import ActorContext, RequestError
from runtime.children import free_port, port_free
from runtime.private_loopback import BrokerGone, PrivateLoopback
from runtime.restart import GiveUp, RestartPolicy
from runtime.rpc_tunnel import TunnelExit
from runtime.tls import TlsFiles

__all__ = ["Lending", "LendingConfig"]

#: How long a fresh RPC server may take to listen on its port.
LISTEN_TIMEOUT_S: Final = 10.0
_LISTEN_POLL_S: Final = 0.02


@dataclass(frozen=True)
class LendingConfig:
    """How this node lends: its RPC server, the certificates of its tunnel exits (the cluster's route CA), the
    address its exits listen on (`bind`) and the one heads dial (`host`), and the RPC server's threads."""

    rpc_server: Path
    tls: TlsFiles
    host: str
    bind: str
    threads: int | None = None


@dataclass
class _Part:
    reservation_id: str
    head: str
    port: int  # the RPC server's, on loopback
    exit: TunnelExit
    log: ServerLog
    command: tuple[str, ...]
    private: bool  # on a loopback of its own
    restarts: int = 0
    process: ServerProcess | None = None
    broker: PrivateLoopback | None = None  # the running server's, when private
    listening: asyncio.Event = field(default_factory=asyncio.Event)
    ending: str | None = None  # why it is being ended (set before its server is stopped)
    task: asyncio.Task[None] | None = None


class Lending:
    """The parts this node lends, each an RPC server behind a tunnel exit, supervised."""

    def __init__(
        self,
        node_id: str,
        data_dir: Path,
        config: LendingConfig,
        *,
        policy: Callable[[], RestartPolicy],
        stop_grace_s: float = 5.0,
        log_max_bytes: int = 4 << 20,
    ) -> None:
        self.node_id = node_id
        self.data_dir = data_dir
        self.config = config
        self._policy = policy
        self._stop_grace_s = stop_grace_s
        self._log_max_bytes = log_max_bytes
        self._parts: dict[str, _Part] = {}
        self._lock = asyncio.Lock()  # one part set up at a time (two asks for one part share it)

    @property
    def parts(self) -> dict[str, int]:
        """Reservation id -> the tunnel exit's port, of every part served now."""
        return {rid: part.exit.port for rid, part in self._parts.items()}

    async def lend(self, ctx: ActorContext, request: LendRequest, ledger: NodeLedger | None) -> Lent:
        why = lend_refusal(ledger, request, self.node_id)
        if why is not None:
            raise RequestError(NOT_FOUND, why)
        async with self._lock:
            part = self._parts.get(request.reservation_id)
            if part is None:
                part = await self._open(ctx, request)
        try:
            async with asyncio.timeout(LISTEN_TIMEOUT_S):
                await part.listening.wait()
        except TimeoutError as exc:
            raise RequestError(UNAVAILABLE, f"the RPC server of {request.reservation_id} is not listening") from exc
        return Lent(
            node_id=self.node_id,
            reservation_id=part.reservation_id,
            host=self.config.host,
            port=part.exit.port,
            restarts=part.restarts,
        )

    async def _open(self, ctx: ActorContext, request: LendRequest) -> _Part:
        rid = request.reservation_id
        directory = self.data_dir / "runner" / f"lend-{rid}"
        port = free_port()
        private = await private_loopback.available()
        parts = self._parts

        async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            broker = parts[rid].broker if rid in parts else None
            if broker is None:
                raise BrokerGone("the RPC server is not running")
            return await broker.dial()

        exit_ = TunnelExit(self.config.tls, dial if private else port)
        await exit_.start(self.config.bind)
        try:
            log = await asyncio.to_thread(self._prepare, directory)
        except OSError as exc:
            await exit_.close()
            raise RequestError(UNAVAILABLE, f"cannot prepare {directory}: {exc}") from exc
        command = rpc_server_command(str(self.config.rpc_server), port, self.config.threads)
        part = _Part(
            reservation_id=rid, head=request.head, port=port, exit=exit_, log=log, command=command, private=private
        )
        self._parts[rid] = part
        part.task = ctx.spawn(self._serve(ctx, part), f"lend:{rid}")
        ctx.log.info(
            "rpc_lent", reservation_id=rid, head=request.head, port=exit_.port, command=shlex.join(command),
            private_loopback=private,
        )  # fmt: skip
        ctx.emit(
            RpcLent, reservation_id=rid, head=request.head, port=exit_.port, command=command, private_loopback=private
        )
        return part

    def _prepare(self, directory: Path) -> ServerLog:  # worker thread
        directory.mkdir(parents=True, exist_ok=True)
        return ServerLog(directory / "rpc-server.log", max_bytes=self._log_max_bytes)

    async def _serve(self, ctx: ActorContext, part: _Part) -> None:
        """Runs the part's RPC server, restarting it per the policy, until the part ends. Never raises: a
        failure ends this part only."""
        policy = self._policy()
        reason = "the runner stopped"
        try:
            while part.ending is None:
                code, tail = await self._run_once(part)
                if part.ending is not None:
                    break
                decision = policy.on_crash(time.monotonic())
                delay = None if isinstance(decision, GiveUp) else decision.delay_s
                ctx.log.warning("rpc_server_exited", reservation_id=part.reservation_id, exit_code=code,
                                restart_in_s=delay)  # fmt: skip
                ctx.emit(
                    RpcServerExited, reservation_id=part.reservation_id, head=part.head, exit_code=code,
                    restart_in_s=delay, log_tail=tail,
                )  # fmt: skip
                if delay is None:
                    part.ending = f"the RPC server exited {policy.max_restarts + 1} times within {policy.window_s:g}s"
                    break
                await asyncio.sleep(delay)
                part.restarts += 1
            reason = part.ending or reason
        except Exception as exc:  # one part's failure must not take the runner with it
            reason = f"lending failed: {type(exc).__name__}: {exc}"
            ctx.log.error("rpc_lend_failed", reservation_id=part.reservation_id, error=reason)
        finally:
            await self._stop_server(part)
            await part.exit.close()
            with contextlib.suppress(OSError):
                await asyncio.to_thread(part.log.close_file)
            if self._parts.get(part.reservation_id) is part:
                del self._parts[part.reservation_id]
            ctx.log.info("rpc_lend_ended", reservation_id=part.reservation_id, reason=reason)
            ctx.emit(RpcLendEnded, reservation_id=part.reservation_id, head=part.head, reason=reason)

    async def _run_once(self, part: _Part) -> tuple[int | None, str]:
        """One RPC server process, from spawn to exit: (exit code, the log's last lines)."""
        part.listening.clear()
        part.log.begin(f"{shlex.join(part.command)}")
        broker = PrivateLoopback() if part.private else None
        argv: list[str] | tuple[str, ...] = part.command
        if broker is not None:
            argv = private_loopback.command(part.command, broker.child_fd, part.port)
        try:
            process = await ServerProcess.spawn(
                argv,
                env=server_environment(os.environ),
                log=part.log,
                pass_fds=() if broker is None else (broker.child_fd,),
            )
        except OSError as exc:
            if broker is not None:
                broker.close()
            return None, f"could not start {part.command[0]}: {exc}"
        finally:
            if broker is not None:
                broker.spawned()
        part.process, part.broker = process, broker
        pump = asyncio.create_task(process.pump())
        try:
            if await self._listens(part, process, broker):
                part.listening.set()
            elif process.returncode is None:
                process.signal(signal.SIGKILL)
            code = await process.wait()
        finally:
            part.listening.clear()
            part.broker = None
            if broker is not None:
                broker.close()
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(pump, 2.0)
            pump.cancel()
        return code, part.log.tail()

    @staticmethod
    async def _listens(part: _Part, process: ServerProcess, broker: PrivateLoopback | None) -> bool:
        """Whether the RPC server listens within `LISTEN_TIMEOUT_S`: its broker says so, or, on the host's
        loopback, its port is looked at until it is taken (nothing else tells: the RPC server's own lines stay
        in its stdio buffer until its first client)."""
        if broker is not None:
            return await broker.listening(LISTEN_TIMEOUT_S) and process.returncode is None
        try:
            async with asyncio.timeout(LISTEN_TIMEOUT_S):
                while port_free(part.port) and process.returncode is None:  # noqa: ASYNC110
                    await asyncio.sleep(_LISTEN_POLL_S)
        except TimeoutError:
            return False
        return process.returncode is None

    async def _stop_server(self, part: _Part) -> None:
        process = part.process
        if process is not None and process.returncode is None:
            await process.terminate(self._stop_grace_s)

    def reconcile(self, ledger: NodeLedger | None, why: str = "its booking left this node's ledger") -> None:
        """Ends every part whose booking is gone (the head's instance ended and placement released the split)."""
        for rid in unbooked(set(self._parts), ledger, self.node_id):
            self.end(rid, why)

    def end(self, reservation_id: str, reason: str) -> None:
        part = self._parts.get(reservation_id)
        if part is None or part.ending is not None:
            return
        part.ending = reason
        if part.process is not None and part.process.returncode is None:
            part.process.signal(signal.SIGTERM)  # its supervision sees the exit, then ends the part
        elif part.task is not None:
            part.task.cancel()  # waiting to restart it: its supervision ends the part at once

    async def close(self) -> None:
        """Ends every part (the runner stops): each RPC server is stopped and each exit closed."""
        tasks = [part.task for part in self._parts.values() if part.task is not None]
        for rid in list(self._parts):
            self.end(rid, "the runner stopped")
        if tasks:
            await asyncio.wait(tasks, timeout=self._stop_grace_s + 10)
