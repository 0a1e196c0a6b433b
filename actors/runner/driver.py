"""One instance's driver (runner shell): performs the lifecycle machine's actions and feeds back what happened.

`InstanceDriver.run` feeds `Start()` to the instance's `instance_lifecycle.Lifecycle`, then performs each action the
machine returns (spawn, verify, signal, deadline, report) and feeds back each observation (spawned, healthy,
verified, exited, unresponsive, stop requested, deadline passed) until the machine reaches a final phase.
The helpers of one server generation (log pump, exit watcher, /health pollers, verification) run in the
driver's own task group.

Each instance is isolated: `run` never lets an exception out. One that escapes the driving (a bug, a
surprise from a dependency) ends this instance only: its server is reaped, the instance ends `failed` with an
`instance_failed` event naming the error, and its record is written; the runner and its other instances
keep running. Nothing final (`instance_stopped`, `instance_failed`, a final record) is said before the
server is confirmed reaped (`reaper.reap`); a server SIGKILL does not reap is reported `stuck` and its
memory stays held.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from actors.placement.memory import CacheAllocation
from actors.runner import instance_lifecycle as lc
from actors.runner.allocation_log import parse_allocation_log
from actors.runner.command import build_command, server_environment
from actors.runner.drift import ServerReport, server_drift, split_drift
from actors.runner.health import InferenceHealth, out_of_memory
from actors.runner.limits import RunnerLimits
from actors.runner.members import MemberLinks, SplitUnavailable
from actors.runner.observed import mib_to_bytes, observed_memory
from actors.runner.process import MIB, ServerLog, ServerProcess
from actors.runner.reaper import reap
from actors.runner.records import write_status
from actors.runner.server_api import ServerApi, ServerApiError
from actors.runner.start_checks import describe_drift
from messages.events import (
    DriftRejected,
    HealthCheckFailed,
    InstanceCrashed,
    InstanceFailed,
    InstanceReady,
    InstanceRestarted,
    InstanceStarting,
    InstanceStopped,
    InstanceStuck,
)
from messages.memory import MemoryBreakdown
from messages.model import ProjectorGeometry
from messages.placement import Reservation
from messages.runner import MAX_MODEL_INFO_BYTES, InstanceState, InstanceStatus, ObservedMemory
from runtime.actor import ActorContext
from runtime.children import free_port, port_free

__all__ = ["CommandRewrite", "DriverFault", "InstanceDriver", "SignalFilter"]

#: Test seam: edits the argument list just before spawning (e.g. a real server that drifts).
CommandRewrite = Callable[[tuple[str, ...]], Sequence[str]]
#: Test seam: called with (reservation id, event) before the machine handles each event; what it raises is
#: an unexpected failure of that instance's driver.
DriverFault = Callable[[str, lc.Event], None]
#: Test seam: called with (reservation id, signal) before each signal to the server; False drops it (a
#: server that does not die).
SignalFilter = Callable[[str, signal.Signals], bool]

#: Ceiling on a /props or /slots reply (a few KiB in practice).
_REPLY_LIMIT = 8 * MIB


class InstanceDriver:
    def __init__(
        self,
        ctx: ActorContext,
        *,
        node_id: str,
        instance_id: str,
        reservation: Reservation,
        predicted: MemoryBreakdown,
        allocations: tuple[CacheAllocation, ...],
        directory: Path,
        log: ServerLog,
        machine: lc.Lifecycle,
        engine: Path,
        limits: RunnerLimits,
        clock: Callable[[], float],
        api: ServerApi,
        rewrite: CommandRewrite | None = None,
        fault: DriverFault | None = None,
        signal_filter: SignalFilter | None = None,
        projector: ProjectorGeometry | None = None,
        links: MemberLinks | None = None,
    ) -> None:
        self.ctx = ctx
        self.node_id = node_id
        self.id = instance_id
        self.reservation = reservation
        self.predicted = predicted
        self.allocations = allocations
        self.projector = projector  # the multimodal projector it runs (`--mmproj`), as its header says
        self.links = links  # a split instance's links to its members (None: it runs on this node alone)
        self._endpoints: tuple[str, ...] = ()  # the --rpc endpoints of the current server, in member order
        self._links_generation = 0  # the server generation the links were last opened for
        self.directory = directory
        self.log = log
        self.machine = machine
        self.engine = engine
        self.limits = limits
        self._clock = clock
        self._api = api  # the runner incarnation's HTTP session (it outlives every driver of that incarnation)
        self._rewrite = rewrite
        self._fault = fault
        self._signal_filter = signal_filter
        self.events: asyncio.Queue[lc.Event] = asyncio.Queue(maxsize=64)
        self.spawned = asyncio.Event()  # the first spawn was attempted
        self.settled = asyncio.Event()  # final, or stuck: what a stop request waits for
        self.finished = asyncio.Event()
        self.process: ServerProcess | None = None
        self.port: int | None = None
        self.command: tuple[str, ...] = ()
        self.observed: ObservedMemory | None = None
        self.exact: frozenset[str] = frozenset()  # which observed figures were recovered byte for byte
        self.model_info: dict[str, Any] | None = None  # the server's own /v1/models entry, once verified
        self._pollers: list[asyncio.Task[None]] = []  # health/verify of this generation
        self._helpers: list[asyncio.Task[None]] = []  # log pumps and exit watchers
        self._stuck = ""  # set while the driver's own reap finds the server stuck
        self.health = InferenceHealth(failures=limits.timings.liveness_failures)
        self.busy: Callable[[], bool] = lambda: False  # whether a generation runs on it (set by the runner)
        # Called after each change of what others read (state, port, restarts): the runner's serving view is
        # brought up to date then, rather than by looking every few milliseconds (set by the runner).
        self.changed: Callable[[], None] = lambda: None
        self._generation = -1
        self._bound = ctx.log.bind(instance_id=instance_id, reservation_id=reservation.reservation_id)

    # --- what others read --------------------------------------------------------------------------------

    @property
    def state(self) -> InstanceState:
        return "stuck" if self._stuck and not self.machine.done else self.machine.state

    @property
    def message(self) -> str:
        return self._stuck if self._stuck and not self.machine.done else self.machine.message

    def status(self) -> InstanceStatus:
        return InstanceStatus(
            id=self.id,
            node=self.node_id,
            reservation_id=self.reservation.reservation_id,
            state=self.state,
            port=self.port,
            model_path=self.reservation.model_path,
            settings=self.reservation.stamp,
            predicted_memory=self.predicted,
            observed_memory=self.observed,
            restarts=self.machine.restarts,
            pid=self.machine.pid if self.process is None or self.process.returncode is None else None,
            message=self.message,
            updated_at=self._clock(),
            members=tuple(m.node_id for m in self.reservation.stamp.rpc),
            model_info=self.model_info,
        )

    async def request_stop(self, reason: str, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            await self.events.put(lc.StopRequested(reason))

    # --- driving -------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Drives the instance until it ends. Never raises an `Exception` (see the module docstring)."""
        error: Exception | None = None
        try:
            await self._drive()
        except Exception as exc:
            error = exc
        finally:
            await self._conclude(error)

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        async with asyncio.TaskGroup() as tg:
            try:
                feedback: list[lc.Event] = [lc.Start()]
                while True:
                    event = feedback.pop(0) if feedback else await self._next(deadline)
                    if event is None:
                        await self._write_status()  # refresh the TTL while nothing happens
                        continue
                    if self._fault is not None:
                        self._fault(self.reservation.reservation_id, event)
                    actions = self.machine.handle(event, time.monotonic())
                    for action in actions:
                        if isinstance(action, lc.SetDeadline):
                            deadline = None if action.seconds is None else loop.time() + action.seconds
                        elif isinstance(action, lc.Spawn):
                            feedback.append(await self._spawn(action.generation, tg))
                        elif isinstance(action, lc.Verify):
                            self._pollers.append(tg.create_task(self._verify(action.generation)))
                        elif isinstance(action, lc.Signal):
                            self._cancel_pollers()
                            self._send(signal.Signals[action.signal])
                        elif isinstance(action, lc.Finish):
                            self._cancel_pollers()
                        else:
                            self._report(action)
                            if isinstance(action, lc.ReportReady):
                                self._pollers.append(tg.create_task(self._liveness(action.generation)))
                    if isinstance(event, lc.Spawned | lc.SpawnFailed):
                        self.spawned.set()
                    if actions:  # something changed (state, pid, port, observed memory): rewrite the record
                        self.changed()
                        await self._write_status()
                    if self.machine.done or self.machine.phase is lc.Phase.STUCK:
                        self.settled.set()
                    else:  # e.g. a stuck server that finally exited and is restarted: a later stop waits again
                        self.settled.clear()
                    if self.machine.done:
                        return
            finally:
                await self._reap()

    async def _next(self, deadline: float | None) -> lc.Event | None:
        """The next event; `DeadlinePassed` at the machine's deadline; None when the record needs a refresh."""
        loop = asyncio.get_running_loop()
        refresh = loop.time() + self.limits.status_ttl_s / 3
        until = refresh if deadline is None else min(deadline, refresh)
        try:
            async with asyncio.timeout_at(until):
                return await self.events.get()
        except TimeoutError:
            if deadline is not None and loop.time() >= deadline:
                return lc.DeadlinePassed()
            return None

    async def _spawn(self, generation: int, tg: asyncio.TaskGroup) -> lc.Event:
        self._cancel_pollers()
        port = self.port if self.port is not None and port_free(self.port) else free_port()
        rpc: tuple[str, ...] = ()
        if self.links is not None:  # a split: each member lends its part before the server starts
            try:
                rpc = await self.links.open()
            except SplitUnavailable as exc:
                return lc.SpawnFailed(generation, str(exc))
            self._links_generation = generation  # the links' connections from now on are this server's
        argv = build_command(
            str(self.engine), self.reservation, port=port, slot_save_dir=str(self.directory / "slots"), rpc=rpc
        )
        self._endpoints = rpc
        if self._rewrite is not None:
            argv = tuple(self._rewrite(argv))
        self.port, self.command, self.observed = port, argv, None
        self.log.restart()
        await asyncio.to_thread(self.log.write, self.log.header(f"generation {generation}: {shlex.join(argv)}"))
        if self.links is not None:
            self.links.server_starting()
        try:
            process = await ServerProcess.spawn(argv, env=server_environment(os.environ), log=self.log)
        except OSError as exc:
            return lc.SpawnFailed(generation, str(exc))
        self.process = process
        if self.links is not None:  # its entrances carry this process's connections only
            self.links.server_started(process.pid)
        self._helpers += [
            tg.create_task(process.pump(), name=f"runner:{self.id}:log"),
            tg.create_task(self._watch_exit(generation, process), name=f"runner:{self.id}:exit"),
        ]
        self._pollers.append(tg.create_task(self._poll_health(generation, port)))
        return lc.Spawned(generation, process.pid)

    def _send(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        if self._signal_filter is not None and not self._signal_filter(self.reservation.reservation_id, sig):
            return
        self.process.signal(sig)

    def member_lost(self, member: str, detail: str) -> None:
        """A member's side of its link ended (`members.MemberLinks`): the machine decides what it means."""
        self._bound.warning("split_member_lost", member=member, detail=detail)
        with contextlib.suppress(asyncio.QueueFull):  # 64 events behind: the driver is ending anyway
            self.events.put_nowait(lc.MemberLost(self._links_generation, member, detail))

    def _cancel_pollers(self) -> None:
        for task in self._pollers:
            task.cancel()
        self._pollers.clear()

    async def _watch_exit(self, generation: int, process: ServerProcess) -> None:
        code = await process.wait()
        await self.events.put(lc.Exited(generation, code))

    async def _poll_health(self, generation: int, port: int) -> None:
        # Bounded by the machine's readiness deadline: when it passes, the machine signals and we are cancelled.
        while True:
            try:
                if await self._api.status(port, "/health", timeout_s=self.limits.http_timeout_s) == 200:
                    await self.events.put(lc.Healthy(generation))
                    return
            except ServerApiError:
                pass  # not listening yet (503 while loading is a status, not an error)
            await asyncio.sleep(self.limits.health_interval_s)

    def note_completion(self, ok: bool, why: str = "") -> None:
        """A real completion's outcome (from serving): evidence for health by inference."""
        loop = asyncio.get_running_loop()
        if ok:
            self.health.success(loop.time())
            return
        crashed = self.health.failure(loop.time(), why)
        self._check_failed("completion", self.health.consecutive_failures, why)
        if crashed:
            reason = f"{self.health.consecutive_failures} completions failed in a row: {why}"
            with contextlib.suppress(asyncio.QueueFull):
                self.events.put_nowait(lc.Unresponsive(self._generation, reason, by_inference=True))

    def _check_failed(self, check: Literal["probe", "health", "completion"], consecutive: int, why: str) -> None:
        self.ctx.emit(
            HealthCheckFailed, instance_id=self.id, reservation_id=self.reservation.reservation_id, check=check,
            consecutive=consecutive, reason=why[:500],
        )  # fmt: skip

    async def _probe(self, port: int) -> str | None:
        """One tiny real completion; None when it worked, else why not."""
        body = {"prompt": "ok", "n_predict": 1, "cache_prompt": False, "temperature": 0}
        try:
            reply = await self._api.json(port, "POST", "/completion", body, timeout_s=self.limits.probe_timeout_s)
        except ServerApiError as exc:
            return str(exc)
        if not isinstance(reply, dict) or "content" not in reply:
            return "POST /completion: no content in the reply"
        return None

    async def _liveness(self, generation: int) -> None:
        """While ready: a server that keeps failing /health (hung, deadlocked) or whose completions fail (health
        by inference: real completions, and a probe when none succeeded lately) is reported unresponsive."""
        t = self.limits.timings
        port = self.port
        assert port is not None
        loop = asyncio.get_running_loop()
        self._generation = generation
        self.health.started(loop.time())
        self.health.probe_interval_s = self.limits.probe_interval_s
        failures = 0
        while True:
            await asyncio.sleep(min(t.liveness_interval_s, self.limits.probe_interval_s))
            self._observe_late_allocations()
            if self.health.should_probe(loop.time(), busy=self.busy()):
                why = await self._probe(port)
                if why is None:
                    self.health.success(loop.time())
                else:
                    crashed = self.health.failure(loop.time(), why)
                    self._check_failed("probe", self.health.consecutive_failures, why)
                    if crashed:
                        reason = f"{self.health.consecutive_failures} completions failed in a row: {why}"
                        await self.events.put(lc.Unresponsive(generation, reason, by_inference=True))
                        return
            try:
                status = await self._api.status(port, "/health", timeout_s=self.limits.http_timeout_s)
                detail = f"HTTP {status}"
                ok = status == 200
            except ServerApiError as exc:
                detail, ok = str(exc) or type(exc).__name__, False
            failures = 0 if ok else failures + 1
            if not ok:
                self._check_failed("health", failures, detail)
            if failures >= t.liveness_failures:
                await self.events.put(lc.Unresponsive(generation, f"{failures} checks in a row: {detail}"))
                return

    def _observe_late_allocations(self) -> None:
        """Once a projector's image graph is reserved (at the first image), it is observed, no longer pending:
        the observation is taken again with the lines printed since the load, and the buffer compared with its
        prediction. The ledger keeps what was booked (the prediction plus its margin)."""
        observed = self.observed
        if observed is None or not observed.pending_bytes or not self.log.late_text():
            return
        log = parse_allocation_log(self.log.allocation_text() + "\n" + self.log.late_text())
        if log.projector is None or not log.projector.compute_buffers:
            return
        observation = observed_memory(log, self.predicted, self.allocations, self.projector)
        measured = sum(mib_to_bytes(mib) for mib in log.projector.compute_buffers.values())
        predicted = self.predicted.projector_compute_bytes
        within = measured <= observed.pending_bytes  # the prediction plus its margin, as booked
        report = self._bound.info if within else self._bound.warning
        report("projector_graph_reserved", predicted=predicted, measured=measured, booked=observed.pending_bytes)
        self.observed, self.exact = observation.memory, observation.exact
        self.changed()

    async def _verify(self, generation: int) -> None:
        port = self.port
        assert port is not None
        try:
            # every allocation line is logged before "model loaded"; the pipe may lag /health a little
            async with asyncio.timeout(self.limits.timings.verify_timeout_s):
                await self.log.loaded.wait()
            props = await self._get_json(port, "/props")
            slots = await self._get_json(port, "/slots")
        except (ServerApiError, TimeoutError) as exc:
            await self.events.put(lc.Verified(generation, error=str(exc) or "the server never logged its load"))
            return
        try:
            models: object = await self._get_json(port, "/v1/models")  # what it says of its model: shown, not checked
        except ServerApiError:
            models = None
        log = parse_allocation_log(self.log.allocation_text())
        stamp = self.reservation.stamp
        drift = server_drift(stamp, self.predicted.context, ServerReport(props, slots, log))
        if stamp.rpc:  # each member's buffers, as the head's log prints them, against the prediction
            drift += split_drift(stamp, self.predicted, self._endpoints, log)
        if not drift:
            observation = observed_memory(log, self.predicted, self.allocations, self.projector)
            self.observed, self.exact = observation.memory, observation.exact
            self.model_info = _model_info(models)
        await self.events.put(lc.Verified(generation, drift))

    # --- the end -------------------------------------------------------------------------------------------

    async def _reap(self) -> None:
        """The driving ends (done, the runner stopping, or a failure): no server of this instance may remain.

        Keeps killing a stuck server for as long as it takes, except when the driver is being cancelled (the
        runner is stopping): then for a bounded patience, after which the instance is left `stuck`."""
        self._cancel_pollers()
        process = self.process
        if process is not None and process.returncode is None:
            t = self.limits.timings
            task = asyncio.current_task()
            hurried = task is not None and task.cancelling() > 0
            await reap(
                process,
                self._send,
                t,
                self._on_stuck,
                graceful=self.machine.phase is not lc.Phase.STUCK,
                patience_s=t.stop_grace_s + t.kill_grace_s + 2 * t.kill_retry_s if hurried else None,
            )
        # let the log pump take the last lines, then end every helper so the task group can close
        pending = [task for task in self._helpers if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        for helper in self._helpers:
            helper.cancel()
        self._helpers.clear()
        if self.links is not None:  # the server is gone: its links to the members go too
            await self.links.close()

    async def _on_stuck(self, why: str) -> None:
        if not self._stuck:
            pid = self.process.pid if self.process else None
            self._bound.error("instance_stuck", pid=pid, reason=why)
            self.ctx.emit(
                InstanceStuck,
                instance_id=self.id,
                reservation_id=self.reservation.reservation_id,
                pid=pid,
                reason=why,
            )
        self._stuck = why
        self.settled.set()
        await self._write_status()

    async def _conclude(self, error: Exception | None) -> None:
        """Says how the instance ended, once that is true; then releases what waits on the driver."""
        try:
            if error is not None:
                self._bound.error("instance_driver_failed", error=_describe(error), exc_info=error)
            if not self.machine.done:
                reaped = self.process is None or self.process.returncode is not None
                ids = {"instance_id": self.id, "reservation_id": self.reservation.reservation_id}
                if not reaped:
                    # cancelled while the server was not confirmed gone: nothing final; its memory stays held
                    self._stuck = self._stuck or "the runner stopped before the server was confirmed gone"
                elif error is not None:
                    reason = f"the runner's driver failed: {_describe(error)}"
                    self.machine.abandon(reason, failed=True)
                    self.ctx.emit(InstanceFailed, **ids, reason=reason)
                else:
                    self.machine.abandon("runner stopped")
                    self.ctx.emit(InstanceStopped, **ids, reason="runner stopped")
                await self._write_status()
        except Exception as exc:  # the end of one instance must never take the runner with it
            self._bound.error("instance_end_not_recorded", error=_describe(exc))
        finally:
            self.log.finish()
            try:
                await asyncio.to_thread(self.log.close_file)
            except BaseException:
                self.log.close_file()  # asked to hurry: close it here rather than leak it
                raise
            finally:
                self.spawned.set()
                self.settled.set()
                self.finished.set()

    # --- reports -------------------------------------------------------------------------------------------

    def _report(self, action: lc.Action) -> None:
        ids = {"instance_id": self.id, "reservation_id": self.reservation.reservation_id}
        bound = self._bound
        if isinstance(action, lc.ReportStarting):
            bound.info("instance_starting", port=self.port, generation=action.generation)
            self.ctx.emit(InstanceStarting, **ids, command=self.command, port=self.port or 0)
        elif isinstance(action, lc.ReportRestarted):
            self.ctx.emit(InstanceRestarted, **ids, attempt=action.attempt)
        elif isinstance(action, lc.ReportReady):
            observed = self.observed
            assert observed is not None
            bound.info(
                "instance_ready",
                port=self.port,
                observed_total=observed.total_bytes,
                predicted_total=self.predicted.total_bytes,
                exact=sorted(self.exact),
            )
            self.ctx.emit(InstanceReady, **ids, port=self.port or 0, predicted=self.predicted, observed=observed)
        elif isinstance(action, lc.ReportDrift):
            bound.warning("instance_drift", drift=describe_drift(action.drift))
            self.ctx.emit(DriftRejected, **ids, stage="after_start", drift=action.drift)
        elif isinstance(action, lc.ReportCrashed):
            bound.warning(
                "instance_crashed", exit_code=action.exit_code, restart_in_s=action.restart_in_s, reason=action.reason
            )
            self.ctx.emit(
                InstanceCrashed,
                **ids,
                exit_code=action.exit_code,
                restart_in_s=action.restart_in_s,
                reason=action.reason,
                log_tail=self.log.tail(),
                out_of_memory=out_of_memory(action.exit_code, self.log.tail(), killed_by_runner=action.killed),
                member=action.member,
            )
        elif isinstance(action, lc.ReportStopped):
            self.ctx.emit(InstanceStopped, **ids, reason=action.reason)
        elif isinstance(action, lc.ReportFailed):
            bound.error("instance_failed", reason=action.reason)
            self.ctx.emit(InstanceFailed, **ids, reason=action.reason)
        elif isinstance(action, lc.ReportStuck):
            bound.error("instance_stuck", pid=action.pid, reason=action.reason)
            self.ctx.emit(InstanceStuck, **ids, pid=action.pid, reason=action.reason)

    async def _get_json(self, port: int, path: str) -> object:
        reply: object = await self._api.json(
            port, "GET", path, None, timeout_s=self.limits.http_timeout_s, max_bytes=_REPLY_LIMIT
        )
        return reply

    async def _write_status(self) -> None:
        await write_status(
            self.ctx,
            self.status(),
            live_ttl_s=self.limits.status_ttl_s,
            final_ttl_s=self.limits.final_ttl_s,
            timeout_s=self.limits.kv_timeout_s,
        )


def _describe(exc: BaseException) -> str:
    """The first real error inside (possibly nested) exception groups, as `Type: message`."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def _model_info(models: object) -> dict[str, Any] | None:
    """The model's entry of a server's `/v1/models` answer (its first `data` item), as it said it; None when it
    has none or it is over `MAX_MODEL_INFO_BYTES`."""
    data = models.get("data") if isinstance(models, dict) else None
    entry = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None
    if entry is None:
        return None
    return entry if len(msgspec.json.encode(entry)) <= MAX_MODEL_INFO_BYTES else None
