"""Runner actor (shell): starts admitted llama-server instances on this node and keeps them as stamped.

`mesh.runner.<node>.start` takes a reservation id. The reservation (read from the reservations bucket, never
from the caller) says which model runs with which stamp. Before anything starts, the runner admits it again
on the worker side: the node's current serving settings and engine build must equal the stamp (else a
`drift_rejected` event naming each differing field), and the model, re-sized with the memory model, must
still fit what the node has now minus what other reservations hold (else `instance_refused` with need and
have). Then one driver task per instance (in this actor's task group) runs the lifecycle state machine of
`actors.runner.lifecycle`: it performs the machine's actions (spawn, verify, signal, deadlines, reports)
and feeds back what happened (spawned, healthy, verified, exited, stop requested, deadline passed).

Each instance has a directory in the data dir (`runner/<id>`: its server log, size-bounded, and its
`--slot-save-path`); those of ended instances are pruned beyond a count. Each instance's status is a
record in the instances bucket (key = instance id), rewritten on every change and refreshed while the
driver lives, with a TTL: records of a runner that died disappear by themselves.
`mesh.runner.<node>.stop` stops an instance. When the actor stops or crashes, every driver stops its server
(SIGTERM, then SIGKILL) before the incarnation ends; a killed runner process takes its servers with it
through the parent-death signal (see `process.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import msgspec
import nats.errors
import nats.js.errors

from actors.placement.geometry import GeometryError, geometry_from_header
from actors.placement.gguf_header import GGUFFormatError, read_header
from actors.placement.ledger import available, without
from actors.placement.memory import CacheAllocation, MemoryModelError, cache_allocations, estimate
from actors.runner import lifecycle as lc
from actors.runner.allocation_log import parse_allocation_log
from actors.runner.command import build_command, server_environment
from actors.runner.drift import ServerReport, server_drift, settings_drift
from actors.runner.observed import observed_memory
from actors.runner.process import HttpError, ServerLog, ServerProcess, free_port, http_request, port_free
from messages.errors import NOT_FOUND, UNAVAILABLE
from messages.events import (
    DriftRejected,
    InstanceCrashed,
    InstanceFailed,
    InstanceReady,
    InstanceRefused,
    InstanceRestarted,
    InstanceStarting,
    InstanceStopped,
)
from messages.memory import MemoryBreakdown
from messages.model import ModelGeometry
from messages.placement import LEDGER_KEY_PREFIX, NodeLedger, Reservation
from messages.runner import (
    FieldDrift,
    InstanceStatus,
    ObservedMemory,
    RunnerAck,
    StartInstance,
    StopInstance,
)
from messages.settings import ServingSettings
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.actor import Actor, ActorContext, RequestError
from runtime.bus import BadMessage, decode_checked, encode
from runtime.restart import RestartPolicy

__all__ = ["RunnerActor", "RunnerLimits"]

TTL_HEADER = "Nats-TTL"

#: Stable error codes of the runner's endpoints (besides the runtime's bad_request, not_found, …).
SETTINGS_DRIFT = "settings_drift"
INSUFFICIENT_MEMORY = "insufficient_memory"
TELEMETRY_STALE = "telemetry_stale"
UNSUPPORTED = "unsupported"
MODEL_UNREADABLE = "model_unreadable"
ENGINE_UNAVAILABLE = "engine_unavailable"
RESERVATION_STATE = "reservation_state"
TOO_MANY_INSTANCES = "too_many_instances"
DATA_DIR_UNWRITABLE = "data_dir_unwritable"
LEDGER_UNREADABLE = "ledger_unreadable"
MODEL_MISMATCH = "model_mismatch"


def default_restart_policy() -> RestartPolicy:
    return RestartPolicy(max_restarts=5, window_s=600.0, backoff_initial_s=1.0, backoff_max_s=60.0)


@dataclass(frozen=True)
class RunnerLimits:
    """Deadlines and bounds of the runner (the lifecycle's own deadlines are in `timings`)."""

    timings: lc.Timings = field(default_factory=lc.Timings)
    status_ttl_s: float = 30.0  # a live instance's record outlives a dead runner by at most this
    final_ttl_s: float = 600.0  # how long a stopped/failed/rejected instance stays visible
    max_instances: int = 64
    http_timeout_s: float = 5.0  # one /health, /props or /slots exchange
    health_interval_s: float = 0.1
    log_max_bytes: int = 16 << 20  # per instance; one rotated file is kept besides
    kept_instance_dirs: int = 32  # directories (logs, slot files) of ended instances kept for post-mortems
    kv_timeout_s: float = 5.0


@dataclass
class _Instance:
    id: str
    reservation: Reservation
    predicted: MemoryBreakdown
    allocations: tuple[CacheAllocation, ...]
    directory: Path
    machine: lc.Lifecycle
    log: ServerLog
    events: asyncio.Queue[lc.Event] = field(default_factory=lambda: asyncio.Queue(maxsize=64))
    spawned: asyncio.Event = field(default_factory=asyncio.Event)  # the first spawn was attempted
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    process: ServerProcess | None = None
    port: int | None = None
    command: tuple[str, ...] = ()
    observed: ObservedMemory | None = None
    exact: frozenset[str] = frozenset()  # which observed figures were recovered byte for byte
    pollers: list[asyncio.Task[None]] = field(default_factory=list)  # health/verify of this generation
    helpers: list[asyncio.Task[None]] = field(default_factory=list)  # log pumps and exit watchers

    def status(self, node: str, now: float) -> InstanceStatus:
        return InstanceStatus(
            id=self.id,
            node=node,
            reservation_id=self.reservation.reservation_id,
            state=self.machine.state,
            port=self.port,
            model_path=self.reservation.model_path,
            settings=self.reservation.stamp,
            predicted_memory=self.predicted,
            observed_memory=self.observed,
            restarts=self.machine.restarts,
            pid=self.machine.pid,
            message=self.machine.reason,
            updated_at=now,
        )


class RunnerActor(Actor):
    name = "runner"
    description = "llama-server instances: start, stop, supervise, verify against the stamp"

    def __init__(
        self,
        node_id: str,
        data_dir: Path,
        engine_path: Path | None,
        settings_source: Callable[[], ServingSettings | None],
        *,
        engine_version: str | None = None,
        limits: RunnerLimits | None = None,
        restart_policy: Callable[[], RestartPolicy] = default_restart_policy,
        clock: Callable[[], float] = time.time,
        rewrite_command: Callable[[tuple[str, ...]], Sequence[str]] | None = None,
        models_dir: Path | None = None,
    ) -> None:
        """`settings_source` gives the node's serving settings now (None: none advertised); `engine_version`
        is its llama-server's `--version` as telemetry advertises it. `rewrite_command` is a test seam that
        edits the argument list just before spawning, so tests can run a real server that drifts."""
        self.node_id = node_id
        self.data_dir = data_dir
        # A reservation made from a registry entry alone names the file, not where it is: relative model
        # paths are found here (default: `models/` in the data dir).
        self.models_dir = models_dir or data_dir / "models"
        self.engine_path = engine_path
        self.engine_version = engine_version
        self.settings_source = settings_source
        self.limits = limits or RunnerLimits()
        self._policy = restart_policy
        self._clock = clock
        self._rewrite = rewrite_command
        self._instances: dict[str, _Instance] = {}
        self._digests: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> blake3 of the file
        self._finished: OrderedDict[str, InstanceStatus] = OrderedDict()

    # --- endpoints -----------------------------------------------------------------------------------

    async def run(self, ctx: ActorContext) -> None:
        self._instances.clear()
        await buckets.instances(ctx.bus, ctx.subjects)
        (self.data_dir / "runner").mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._prune_instance_dirs)

        async def start(request: StartInstance) -> RunnerAck:
            return await self._start(ctx, request)

        async def stop(request: StopInstance) -> RunnerAck:
            return await self._stop(ctx, request)

        await ctx.add_endpoint("start", ctx.subjects.runner(self.node_id, "start"), StartInstance, start)
        await ctx.add_endpoint("stop", ctx.subjects.runner(self.node_id, "stop"), StopInstance, stop)

    async def _start(self, ctx: ActorContext, request: StartInstance) -> RunnerAck:
        rid = request.reservation_id
        for inst in self._instances.values():
            if inst.reservation.reservation_id == rid:  # already running it: starting is idempotent
                return self._ack(inst, "already started")
        reservation = await self._reservation(ctx, rid)
        if not Path(reservation.model_path).is_absolute():
            located = str(self.models_dir / reservation.model_path)
            reservation = msgspec.structs.replace(reservation, model_path=located)
        instance_id = uuid.uuid4().hex[:16]
        if reservation.multi_node:
            raise self._refuse(
                ctx,
                reservation,
                instance_id,
                UNSUPPORTED,
                f"reservation {rid} is one node's share of a multi-node placement; split (RPC) serving is not built",
            )
        if reservation.state != "reserved":
            raise RequestError(RESERVATION_STATE, f"reservation {rid} is {reservation.state}, not reserved")
        now = self._clock()
        if reservation.expires_at is not None and reservation.expires_at <= now:
            raise RequestError(RESERVATION_STATE, f"reservation {rid} expired at {reservation.expires_at:.0f}")
        if self.engine_path is None:
            raise self._refuse(
                ctx, reservation, instance_id, ENGINE_UNAVAILABLE, f"node {self.node_id} has no llama-server to run"
            )
        if len(self._instances) >= self.limits.max_instances:
            raise RequestError(TOO_MANY_INSTANCES, f"node {self.node_id} runs {len(self._instances)} instances")

        drift = settings_drift(reservation.stamp, self.settings_source(), engine_version=self.engine_version)
        if drift:
            ctx.emit(DriftRejected, instance_id=instance_id, reservation_id=rid, stage="before_start", drift=drift)
            raise RequestError(
                SETTINGS_DRIFT,
                "the node's settings changed since admission: " + _describe_drift(drift),
                {"drift": msgspec.to_builtins(drift)},
            )
        try:
            geometry = await self._geometry(reservation)
        except RequestError as exc:
            raise self._refuse(ctx, reservation, instance_id, exc.reply.code, exc.reply.message) from exc
        try:
            stamp = reservation.stamp
            predicted = estimate(
                geometry, stamp.settings, stamp.ctx, n_gpu_layers=stamp.n_gpu_layers, gpu_split=stamp.gpu_split
            )
            allocations = cache_allocations(geometry, stamp.settings, stamp.ctx)
        except MemoryModelError as exc:
            message = f"llama-server would refuse these settings: {exc}"
            raise self._refuse(ctx, reservation, instance_id, UNSUPPORTED, message) from exc
        await self._check_memory(ctx, reservation, predicted, instance_id)

        await asyncio.to_thread(self._prune_instance_dirs)
        directory = self.data_dir / "runner" / instance_id
        try:
            (directory / "slots").mkdir(parents=True, exist_ok=True)
            server_log = ServerLog(directory / "llama-server.log", max_bytes=self.limits.log_max_bytes)
        except OSError as exc:
            raise RequestError(DATA_DIR_UNWRITABLE, f"cannot prepare {directory}: {exc}") from exc
        inst = _Instance(
            id=instance_id,
            reservation=reservation,
            predicted=predicted,
            allocations=allocations,
            directory=directory,
            machine=lc.Lifecycle(self.limits.timings, self._policy()),
            log=server_log,
        )
        self._instances[instance_id] = inst
        ctx.spawn(self._drive(ctx, inst), f"instance:{instance_id}")
        with contextlib.suppress(TimeoutError):  # spawning takes milliseconds; the ack says where it stands
            async with asyncio.timeout(self.limits.http_timeout_s):
                await inst.spawned.wait()
        return self._ack(inst, "starting")

    async def _stop(self, ctx: ActorContext, request: StopInstance) -> RunnerAck:
        inst = self._instances.get(request.instance_id)
        if inst is None:
            final = self._finished.get(request.instance_id)
            if final is None:
                raise RequestError(NOT_FOUND, f"no instance {request.instance_id!r} on node {self.node_id}")
            return RunnerAck(instance_id=final.id, node_id=self.node_id, state=final.state, message=final.message)
        await inst.events.put(lc.StopRequested("stop requested"))
        t = self.limits.timings
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(t.stop_grace_s + t.kill_grace_s + 2.0, 25.0)):
                await inst.finished.wait()
        return self._ack(inst, inst.machine.reason)

    def _ack(self, inst: _Instance, message: str) -> RunnerAck:
        return RunnerAck(
            instance_id=inst.id, node_id=self.node_id, state=inst.machine.state, port=inst.port, message=message
        )

    def _prune_instance_dirs(self) -> None:
        """Removes the oldest directories of ended instances beyond `kept_instance_dirs` (disk stays bounded)."""
        root = self.data_dir / "runner"
        try:
            ended = [d for d in root.iterdir() if d.is_dir() and d.name not in self._instances]
            ended.sort(key=lambda d: d.stat().st_mtime, reverse=True)
        except OSError:
            return
        for directory in ended[self.limits.kept_instance_dirs :]:
            shutil.rmtree(directory, ignore_errors=True)

    # --- worker-side admission -----------------------------------------------------------------------

    async def _reservation(self, ctx: ActorContext, rid: str) -> Reservation:
        ledger = await self._ledger(ctx)
        for reservation in ledger.reservations if ledger else ():
            if reservation.reservation_id == rid:
                return reservation
        raise RequestError(NOT_FOUND, f"no reservation {rid!r} on node {self.node_id}")

    async def _ledger(self, ctx: ActorContext) -> NodeLedger | None:
        try:
            async with asyncio.timeout(self.limits.kv_timeout_s):
                kv = await buckets.reservations(ctx.bus, ctx.subjects)
                entry = await kv.get(f"{LEDGER_KEY_PREFIX}{self.node_id}")
        except nats.js.errors.KeyNotFoundError:
            return None
        except (nats.errors.Error, TimeoutError) as exc:
            raise RequestError(UNAVAILABLE, f"cannot read the reservations bucket: {exc!r}") from exc
        if not entry.value:
            return None
        try:
            return decode_checked(entry.value, NodeLedger, f"ledger of node {self.node_id}")
        except BadMessage as exc:
            raise RequestError(LEDGER_UNREADABLE, str(exc)) from exc

    async def _telemetry(self, ctx: ActorContext) -> NodeResources | None:
        try:
            async with asyncio.timeout(self.limits.kv_timeout_s):
                kv = await buckets.nodes(ctx.bus, ctx.subjects)
                entry = await kv.get(self.node_id)
        except nats.js.errors.KeyNotFoundError:
            return None
        except (nats.errors.Error, TimeoutError) as exc:
            raise RequestError(UNAVAILABLE, f"cannot read the nodes bucket: {exc!r}") from exc
        if not entry.value:  # expired: a delete marker
            return None
        try:
            return decode_checked(entry.value, NodeResources, f"telemetry of node {self.node_id}")
        except BadMessage:
            return None

    def _refuse(
        self, ctx: ActorContext, reservation: Reservation, instance_id: str, code: str, message: str
    ) -> RequestError:
        """A refusal that makes the reservation unusable here: journaled, so placement releases its memory."""
        ctx.emit(
            InstanceRefused,
            instance_id=instance_id,
            reservation_id=reservation.reservation_id,
            need_bytes={d.device: d.total_bytes for d in reservation.devices},
            have_bytes={},
            message=f"{code}: {message}",
        )
        return RequestError(code, message)

    async def _geometry(self, reservation: Reservation) -> ModelGeometry:
        """The model's header facts, read from the file the node will run. A reservation made from a signed
        registry entry carries the file's digest: the file here must be that file."""
        path = reservation.model_path

        def read() -> tuple[ModelGeometry, str | None]:
            geometry = geometry_from_header(read_header(path))
            if reservation.model_digest is None:
                return geometry, None
            stat = os.stat(path)
            key = (path, stat.st_size, stat.st_mtime_ns)
            digest = self._digests.get(key)
            if digest is None:
                hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
                hasher.update_mmap(path)
                digest = self._digests[key] = hasher.hexdigest()
            return geometry, digest

        try:
            geometry, digest = await asyncio.to_thread(read)
        except (OSError, GGUFFormatError, GeometryError) as exc:
            raise RequestError(MODEL_UNREADABLE, f"cannot read {path}: {exc}") from exc
        if reservation.model_digest is not None and digest != reservation.model_digest:
            raise RequestError(
                MODEL_MISMATCH,
                f"{path} is not the file admission was made for (blake3 {str(digest)[:16]}…, "
                f"expected {reservation.model_digest[:16]}…)",
            )
        return geometry

    async def _check_memory(
        self, ctx: ActorContext, reservation: Reservation, predicted: MemoryBreakdown, instance_id: str
    ) -> None:
        """The model, re-sized now, must fit what the node reports minus what other reservations hold."""
        rid = reservation.reservation_id
        node = await self._telemetry(ctx)
        need = {device.device: device.total_bytes for device in predicted.devices}
        if node is None:
            message = f"node {self.node_id} has no current telemetry; cannot check its memory"
            ctx.emit(
                InstanceRefused,
                instance_id=instance_id,
                reservation_id=rid,
                need_bytes=need,
                have_bytes={},
                message=message,
            )
            raise RequestError(TELEMETRY_STALE, message)
        ledger = await self._ledger(ctx)
        others = without(ledger, rid) if ledger is not None else None
        have = available(node, others, self._clock())
        short = {d: n for d, n in need.items() if n > have.get(d, 0)}
        if short:
            message = "the model no longer fits: " + ", ".join(
                f"{d} needs {n} bytes, has {have.get(d, 0)}" for d, n in short.items()
            )
            ctx.emit(
                InstanceRefused,
                instance_id=instance_id,
                reservation_id=rid,
                need_bytes=need,
                have_bytes={d: have.get(d, 0) for d in need},
                message=message,
            )
            raise RequestError(INSUFFICIENT_MEMORY, message, {"need_bytes": need, "have_bytes": have})

    # --- the driver: one task per instance ------------------------------------------------------------

    async def _drive(self, ctx: ActorContext, inst: _Instance) -> None:
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                try:
                    feedback: list[lc.Event] = [lc.Start()]
                    while True:
                        event = feedback.pop(0) if feedback else await self._next(ctx, inst, deadline)
                        if event is None:
                            await self._write_status(ctx, inst)  # refresh the TTL while nothing happens
                            continue
                        actions = inst.machine.handle(event, time.monotonic())
                        for action in actions:
                            if isinstance(action, lc.SetDeadline):
                                deadline = None if action.seconds is None else loop.time() + action.seconds
                            elif isinstance(action, lc.Spawn):
                                feedback.append(await self._spawn(inst, action.generation, tg))
                            elif isinstance(action, lc.Verify):
                                inst.pollers.append(tg.create_task(self._verify(inst, action.generation)))
                            elif isinstance(action, lc.Signal):
                                self._cancel_pollers(inst)
                                if inst.process is not None:
                                    inst.process.signal(signal.Signals[action.signal])
                            elif isinstance(action, lc.Finish):
                                self._cancel_pollers(inst)
                            else:
                                self._report(ctx, inst, action)
                                if isinstance(action, lc.ReportReady):
                                    inst.pollers.append(tg.create_task(self._liveness(inst, action.generation)))
                        if isinstance(event, lc.Spawned | lc.SpawnFailed):
                            inst.spawned.set()
                        if actions:  # something changed (state, pid, port, observed memory): rewrite the record
                            await self._write_status(ctx, inst)
                        if inst.machine.done:
                            return
                finally:
                    await self._reap(ctx, inst)
        finally:
            inst.log.close()
            inst.spawned.set()
            inst.finished.set()
            self._instances.pop(inst.id, None)
            self._finished[inst.id] = inst.status(self.node_id, self._clock())
            while len(self._finished) > 256:
                self._finished.popitem(last=False)

    async def _next(self, ctx: ActorContext, inst: _Instance, deadline: float | None) -> lc.Event | None:
        """The next event; `DeadlinePassed` at the machine's deadline; None when the record needs a refresh."""
        loop = asyncio.get_running_loop()
        refresh = loop.time() + self.limits.status_ttl_s / 3
        until = refresh if deadline is None else min(deadline, refresh)
        try:
            async with asyncio.timeout_at(until):
                return await inst.events.get()
        except TimeoutError:
            if deadline is not None and loop.time() >= deadline:
                return lc.DeadlinePassed()
            return None

    async def _spawn(self, inst: _Instance, generation: int, tg: asyncio.TaskGroup) -> lc.Event:
        self._cancel_pollers(inst)
        assert self.engine_path is not None
        port = inst.port if inst.port is not None and port_free(inst.port) else free_port()
        argv = build_command(
            str(self.engine_path), inst.reservation, port=port, slot_save_dir=str(inst.directory / "slots")
        )
        if self._rewrite is not None:
            argv = tuple(self._rewrite(argv))
        inst.port, inst.command, inst.observed = port, argv, None
        inst.log.begin(f"generation {generation}: {shlex.join(argv)}")
        try:
            # the runner's own working directory: a relative model path means what it meant to the header read
            process = await ServerProcess.spawn(argv, env=server_environment(os.environ), log=inst.log)
        except OSError as exc:
            return lc.SpawnFailed(generation, str(exc))
        inst.process = process
        inst.helpers += [
            tg.create_task(process.pump(), name=f"runner:{inst.id}:log"),
            tg.create_task(self._watch_exit(inst, generation, process), name=f"runner:{inst.id}:exit"),
        ]
        inst.pollers.append(tg.create_task(self._poll_health(inst, generation, port)))
        return lc.Spawned(generation, process.pid)

    def _cancel_pollers(self, inst: _Instance) -> None:
        for task in inst.pollers:
            task.cancel()
        inst.pollers.clear()

    async def _watch_exit(self, inst: _Instance, generation: int, process: ServerProcess) -> None:
        code = await process.wait()
        await inst.events.put(lc.Exited(generation, code))

    async def _poll_health(self, inst: _Instance, generation: int, port: int) -> None:
        # Bounded by the machine's readiness deadline: when it passes, the machine signals and we are cancelled.
        while True:
            try:
                response = await http_request(port, "GET", "/health", timeout_s=self.limits.http_timeout_s)
                if response.status == 200:
                    await inst.events.put(lc.Healthy(generation))
                    return
            except HttpError:
                pass  # not listening yet, or still loading
            await asyncio.sleep(self.limits.health_interval_s)

    async def _liveness(self, inst: _Instance, generation: int) -> None:
        """While ready: a server that keeps failing /health (hung, deadlocked) is reported unresponsive."""
        t = self.limits.timings
        port = inst.port
        assert port is not None
        failures = 0
        while True:
            await asyncio.sleep(t.liveness_interval_s)
            try:
                response = await http_request(port, "GET", "/health", timeout_s=self.limits.http_timeout_s)
                detail = f"HTTP {response.status}"
                ok = response.status == 200
            except HttpError as exc:
                detail, ok = str(exc) or type(exc).__name__, False
            failures = 0 if ok else failures + 1
            if failures >= t.liveness_failures:
                await inst.events.put(lc.Unresponsive(generation, f"{failures} checks in a row: {detail}"))
                return

    async def _verify(self, inst: _Instance, generation: int) -> None:
        port = inst.port
        assert port is not None
        try:
            # every allocation line is logged before "model loaded"; the pipe may lag /health a little
            async with asyncio.timeout(self.limits.timings.verify_timeout_s):
                await inst.log.loaded.wait()
            props = await _get_json(port, "/props", self.limits.http_timeout_s)
            slots = await _get_json(port, "/slots", self.limits.http_timeout_s)
        except (HttpError, TimeoutError) as exc:
            await inst.events.put(lc.Verified(generation, error=str(exc) or "the server never logged its load"))
            return
        log = parse_allocation_log(inst.log.allocation_text())
        drift = server_drift(inst.reservation.stamp, inst.predicted.context, ServerReport(props, slots, log))
        if not drift:
            observation = observed_memory(log, inst.predicted, inst.allocations)
            inst.observed, inst.exact = observation.memory, observation.exact
        await inst.events.put(lc.Verified(generation, drift))

    async def _reap(self, ctx: ActorContext, inst: _Instance) -> None:
        """The driver ends (done, actor stopping or crashing): no server of this instance may remain."""
        self._cancel_pollers(inst)
        process = inst.process
        t = self.limits.timings
        if process is not None and process.returncode is None:
            try:
                await process.terminate(t.stop_grace_s, t.kill_grace_s)
            except asyncio.CancelledError:
                process.signal(signal.SIGKILL)  # asked to hurry: no grace
                raise
        # let the log pump take the last lines, then end every helper so the task group can close
        pending = [task for task in inst.helpers if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        for task in inst.helpers:
            task.cancel()
        inst.helpers.clear()
        if not inst.machine.done:
            reason = "runner stopped"
            inst.machine.abandon(reason)
            ctx.emit(
                InstanceStopped, instance_id=inst.id, reservation_id=inst.reservation.reservation_id, reason=reason
            )
            with contextlib.suppress(Exception):  # best effort: NATS may be gone; the record's TTL covers us
                await self._write_status(ctx, inst)

    # --- reports ---------------------------------------------------------------------------------------

    def _report(self, ctx: ActorContext, inst: _Instance, action: lc.Action) -> None:
        ids = {"instance_id": inst.id, "reservation_id": inst.reservation.reservation_id}
        bound = ctx.log.bind(**ids)
        if isinstance(action, lc.ReportStarting):
            bound.info("instance_starting", port=inst.port, generation=action.generation)
            ctx.emit(InstanceStarting, **ids, command=inst.command, port=inst.port or 0)
        elif isinstance(action, lc.ReportRestarted):
            ctx.emit(InstanceRestarted, **ids, attempt=action.attempt)
        elif isinstance(action, lc.ReportReady):
            observed = inst.observed
            assert observed is not None
            bound.info(
                "instance_ready",
                port=inst.port,
                observed_total=observed.total_bytes,
                predicted_total=inst.predicted.total_bytes,
                exact=sorted(inst.exact),
            )
            ctx.emit(InstanceReady, **ids, port=inst.port or 0, predicted=inst.predicted, observed=observed)
        elif isinstance(action, lc.ReportDrift):
            bound.warning("instance_drift", drift=_describe_drift(action.drift))
            ctx.emit(DriftRejected, **ids, stage="after_start", drift=action.drift)
        elif isinstance(action, lc.ReportCrashed):
            bound.warning(
                "instance_crashed", exit_code=action.exit_code, restart_in_s=action.restart_in_s, reason=action.reason
            )
            ctx.emit(
                InstanceCrashed,
                **ids,
                exit_code=action.exit_code,
                restart_in_s=action.restart_in_s,
                reason=action.reason,
                log_tail=inst.log.tail(),
            )
        elif isinstance(action, lc.ReportStopped):
            ctx.emit(InstanceStopped, **ids, reason=action.reason)
        elif isinstance(action, lc.ReportFailed):
            bound.error("instance_failed", reason=action.reason)
            ctx.emit(InstanceFailed, **ids, reason=action.reason)

    async def _write_status(self, ctx: ActorContext, inst: _Instance) -> None:
        status = inst.status(self.node_id, self._clock())
        ttl = self.limits.final_ttl_s if inst.machine.done else self.limits.status_ttl_s
        try:
            await ctx.bus.js.publish(
                f"$KV.{ctx.subjects.instances_bucket}.{inst.id}",
                encode(status),
                timeout=self.limits.kv_timeout_s,
                headers={TTL_HEADER: f"{max(1, round(ttl))}s"},
            )
        except (nats.errors.Error, TimeoutError) as exc:
            # NATS is away (the client reconnects); the next change or refresh writes the record again
            ctx.log.warning("instance_status_not_written", instance=inst.id, error=str(exc) or type(exc).__name__)


async def _get_json(port: int, path: str, timeout_s: float) -> object:
    response = await http_request(port, "GET", path, timeout_s=timeout_s)
    if response.status != 200:
        raise HttpError(f"GET {path}: HTTP {response.status}")
    result: object = response.json()
    return result


def _describe_drift(drift: Sequence[FieldDrift]) -> str:
    return "; ".join(f"{d.field}: stamped {d.stamped}, now {d.current}" for d in drift)
