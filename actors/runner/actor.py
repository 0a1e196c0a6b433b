"""Runner actor (shell): the endpoints that start and stop llama-server instances on this node.

`mesh.runner.<node>.start` takes a reservation id. The reservation (read from the node's ledger, never from
the caller) says which model runs with which stamp. Before anything starts, the runner admits it again on
the worker side (`start_checks`, the decisions; `preflight`, the reading): the node's serving settings and
engine build must equal the stamp, the model file named by the (peer-written, so hostile) ledger must be a
readable GGUF (and, from a signed registry entry, the signed file), and the model, re-sized now, must fit
what the node has minus what its other reservations hold. Then the runner claims the reservation on the
ledger with compare-and-set (`reserved` -> `starting`, with the instance id) and answers once the server
is spawned. A refusal that makes the reservation unusable here is journaled (`instance_refused` or
`drift_rejected`), so placement releases the memory at once.

Each instance is one supervised child of this actor (`driver.InstanceDriver`): an exception escaping one
driver ends that instance only (reaped, `instance_failed`), never the runner or the other instances.
`mesh.runner.<node>.stop` asks an instance to stop and answers, within its deadline, with the state reached
(`stopped`, or `stuck` when SIGKILL did not reap the server: its memory stays held). When the actor stops,
every driver stops its server before the incarnation ends; a killed runner process takes its servers with
it through the parent-death signal (see `process.py`).

Each instance has a directory in the data dir (`runner/<id>`: its server log, size-bounded, and its
`--slot-save-path`); those of ended instances are pruned beyond a count.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Final

import aiohttp
import nats.errors

from actors.handoff import cost
from actors.handoff.api import HandoffAccess
from actors.l3.api import L3Access
from actors.placement.memory import MemoryModelError, cache_allocations, estimate
from actors.placement.split import node_share
from actors.runner import instance_lifecycle as lc
from actors.runner import upkeep
from actors.runner.command import with_files
from actors.runner.drift import settings_drift
from actors.runner.driver import CommandRewrite, DriverFault, InstanceDriver, SignalFilter
from actors.runner.ledger_rules import Live
from actors.runner.lending import Lending, LendingConfig
from actors.runner.limits import RunnerLimits, default_restart_policy
from actors.runner.members import MemberLinks
from actors.runner.preflight import ModelFiles, NodeState, pull_missing
from actors.runner.process import ServerLog
from actors.runner.records import TTL_HEADER
from actors.runner.server_api import ServerApi
from actors.runner.serving import Serving, ServingLimits, state_identity
from actors.runner.slots import PromptLimit
from actors.runner.start_checks import (
    StartRefused,
    check_memory,
    check_reservation,
    claim,
    find,
)
from messages.errors import (
    DATA_DIR_UNWRITABLE,
    NOT_FOUND,
    RESERVATION_STATE,
    UNAVAILABLE,
    UNSUPPORTED,
)
from messages.events import DriftRejected, InstanceRefused
from messages.generate import (
    GenerateResult,
    Prefill,
    PrefillResult,
    Render,
    RunnerGenerate,
    Tokenize,
    Tokens,
)
from messages.memory import MemoryBreakdown
from messages.placement import NodeLedger, Reservation
from messages.runner import InstanceStatus, LendRequest, Lent, RunnerAck, StartInstance, StopInstance
from messages.settings import ServingSettings, SettingsBounds
from messages.telemetry import NodeResources
from runtime import buckets, tracing
from runtime.actor import Actor, ActorContext, RequestError
from runtime.bus import BadMessage, decode_checked, encode
from runtime.model_files import FileDigests
from runtime.restart import RestartPolicy
from runtime.tls import TlsFiles

__all__ = [
    "TTL_HEADER",
    "RunnerActor",
    "RunnerLimits",
    "default_restart_policy",
]

#: The shortest time between two serving reports: the changes of a burst go out together.
_REPORT_GAP_S: Final = 0.1


def own_share(predicted: MemoryBreakdown) -> MemoryBreakdown:
    """What this node itself holds of an instance: a split's RPC devices (`RPC0`, …) are its members' memory,
    booked and checked on their own ledgers."""
    own = [d for d in predicted.devices if not d.device.startswith("RPC")]
    return predicted if len(own) == len(predicted.devices) else node_share(predicted, own)


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
        rewrite_command: CommandRewrite | None = None,
        models_dir: Path | None = None,
        digests: FileDigests | None = None,
        driver_fault: DriverFault | None = None,
        signal_filter: SignalFilter | None = None,
        l3: L3Access | None = None,
        serving_limits: ServingLimits | None = None,
        handoff: HandoffAccess | None = None,
        booking_check_s: float = 5.0,
        bounds_source: Callable[[], SettingsBounds | None] = lambda: None,
        route_tls: TlsFiles | None = None,
        lending: LendingConfig | None = None,
    ) -> None:
        """`settings_source` gives the node's serving settings now (None: none advertised), `bounds_source` the
        bounds of a model's own settings it accepts (None: only its own settings); `engine_version`
        is its llama-server's `--version` as telemetry advertises it. `rewrite_command`, `driver_fault` and
        `signal_filter` are test seams (see `driver.py`): a real server that drifts, a driver that fails, a
        server that does not die. `l3` is the node's store of slot states (None: nothing is restored or
        captured). `booking_check_s`: how often the runner checks that what it runs is booked (`upkeep.py`).
        Split serving: `route_tls` are this node's certificates under the cluster CA, with which a split's head
        reaches its members (None: it cannot head a split); `lending` how this node lends its memory to other
        nodes' splits (None: it does not)."""
        self.node_id = node_id
        self.data_dir = data_dir
        # A reservation made from a registry entry alone names the file, not where it is: relative model
        # paths are found here (default: `models/` in the data dir), and may not leave it.
        self.models_dir = models_dir or data_dir / "models"
        self.engine_path = engine_path
        self.engine_version = engine_version
        self.settings_source = settings_source
        self.bounds_source = bounds_source
        self.limits = limits or RunnerLimits()
        self._policy = restart_policy
        self._clock = clock
        self._rewrite = rewrite_command
        self._fault = driver_fault
        self._signal_filter = signal_filter
        self._models = ModelFiles(self.models_dir, digests)
        self._node = NodeState(node_id, self.limits.kv_timeout_s)
        self._drivers: dict[str, InstanceDriver] = {}
        self._finished: OrderedDict[str, InstanceStatus] = OrderedDict()
        self.l3 = l3
        self.handoff = handoff  # sends prefilled states to the decoding node (`mesh.runner.<node>.prefill`)
        self.serving_limits = serving_limits or ServingLimits()
        self._identities: dict[str, asyncio.Future[str]] = {}  # model path -> its digest, computing or done
        self._longest_token: dict[str, int] = {}  # instance -> its vocabulary's longest token, bytes (prompt bounds)
        self._booking_check_s = booking_check_s
        self.route_tls = route_tls
        self.lending_config = lending

    # --- endpoints -----------------------------------------------------------------------------------

    async def run(self, ctx: ActorContext) -> None:
        self._drivers.clear()
        await buckets.instances(ctx.bus, ctx.subjects)
        # Before anything can start: what a predecessor left (records, claims) is for servers that are gone.
        await upkeep.clear_predecessor(ctx, self._node, deadline_s=2 * self.limits.kv_timeout_s)
        ctx.spawn(
            upkeep.keep_booked(
                ctx, self._node, self._live, lambda iid, why: self._stop_unbooked(ctx, iid, why), self._clock,
                interval_s=self._booking_check_s,
            ),
            "bookings",
        )  # fmt: skip
        await asyncio.to_thread((self.data_dir / "runner").mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(self._prune_instance_dirs, frozenset())

        # before the start endpoint: every driver of this incarnation talks to its server through this session
        session = ServerApi.session()
        api = ServerApi(session)
        serving = Serving(
            self.node_id, ctx.bus, api, self.l3, ctx.spawn, self.serving_limits,
            handoff=self.handoff, subjects=ctx.subjects, on_outcome=self._completion_outcome, emit=ctx.emit,
        )  # fmt: skip
        self._serving = serving
        ctx.spawn(self._serve(ctx, serving, session), "serving")
        if self.lending_config is not None:
            await self._lend_endpoint(ctx, self.lending_config)

        async def start(request: StartInstance) -> RunnerAck:
            return await self._start(ctx, request, api)

        async def stop(request: StopInstance) -> RunnerAck:
            return await self._stop(request)

        await ctx.add_endpoint("start", ctx.subjects.runner(self.node_id, "start"), StartInstance, start)
        await ctx.add_endpoint("stop", ctx.subjects.runner(self.node_id, "stop"), StopInstance, stop)

        # Each request first brings serving's view up to date: an instance record can say `ready` (and a router
        # send a request) before the next pass of the serving loop.
        async def generate(order: RunnerGenerate) -> GenerateResult:
            self._sync_serving(serving)
            return await serving.generate(order)

        async def tokenize(request: Tokenize) -> Tokens:
            self._sync_serving(serving)
            return Tokens(tokens=await serving.tokenize(request.instance_id, request.text))

        async def prefill(order: Prefill) -> PrefillResult:
            self._sync_serving(serving)
            return await serving.prefill(order)

        async def render(request: Render) -> Tokens:
            self._sync_serving(serving)
            return Tokens(tokens=await serving.render(request.instance_id, request.call))

        limits = self.serving_limits
        await ctx.add_endpoint(
            "generate",
            ctx.subjects.runner(self.node_id, "generate"),
            RunnerGenerate,
            generate,
            workers=limits.max_generations,
            inbox=limits.max_generations * 4,
            deadline_s=3600.0 + 60.0,  # each generation keeps its own `timeout_s` (at most an hour)
        )
        await ctx.add_endpoint("tokenize", ctx.subjects.runner(self.node_id, "tokenize"), Tokenize, tokenize, workers=8)
        await ctx.add_endpoint("render", ctx.subjects.runner(self.node_id, "render"), Render, render, workers=8)
        await ctx.add_endpoint(
            "prefill", ctx.subjects.runner(self.node_id, "prefill"), Prefill, prefill, workers=8,
            deadline_s=3600.0 + 60.0,
        )  # fmt: skip

    async def _lend_endpoint(self, ctx: ActorContext, config: LendingConfig) -> None:
        """`mesh.runner.<node>.lend`: this node's parts of other nodes' splits (`lending.py`), each ended when
        its booking leaves the ledger (watched: no polling) or the runner stops."""
        lending = Lending(self.node_id, self.data_dir, config, policy=self._policy)

        async def lend(request: LendRequest) -> Lent:
            read = await self._node.ledger(ctx)
            return await lending.lend(ctx, request, read.ledger)

        async def follow_ledger() -> None:
            try:
                kv = await buckets.reservations(ctx.bus, ctx.subjects)
                async for entry in buckets.watch(kv, None, key=self._node.key):
                    ledger = None
                    if entry.value:
                        with contextlib.suppress(BadMessage):
                            ledger = decode_checked(entry.value, NodeLedger, "ledger")
                    lending.reconcile(ledger)
            finally:
                await lending.close()

        ctx.spawn(follow_ledger(), "lending")
        await ctx.add_endpoint("lend", ctx.subjects.runner(self.node_id, "lend"), LendRequest, lend, workers=4)

    async def _serve(self, ctx: ActorContext, serving: Serving, session: aiohttp.ClientSession) -> None:
        """Keeps serving's view of the ready instances current and publishes the node's serving report on
        every change (at most every `_REPORT_GAP_S`) and every `report_interval_s`; closes the HTTP session at
        the end. It waits on `serving.changed`, which serving sets on every load change and the runner on every
        change of an instance (its driver's state, its digest hashed, its driver gone): no polling."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._sync_serving(serving)
                serving.changed.clear()  # after the sync, whose own changes this report carries
                with contextlib.suppress(nats.errors.Error):
                    await ctx.bus.nc.publish(ctx.subjects.serving(self.node_id), encode(serving.report()))
                published = loop.time()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(published + self.serving_limits.report_interval_s):
                        await serving.changed.wait()
                # Paces the reports: a burst of changes (slots taken and freed) goes out as one.
                await asyncio.sleep(max(0.0, published + _REPORT_GAP_S - loop.time()))
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await session.close()

    def _completion_outcome(self, instance_id: str, ok: bool, why: str) -> None:
        driver = self._drivers.get(instance_id)
        if driver is not None:
            driver.note_completion(ok, why)

    def _sync_serving(self, serving: Serving) -> None:
        ready: dict[str, tuple[int, int, Path, object, bool, bool]] = {}
        for driver in self._drivers.values():
            if driver.state == "ready" and driver.port is not None:
                generation = (driver.port, driver.machine.restarts)
                slots = driver.reservation.stamp.settings.slots
                rollback = driver.predicted.recurrent_bytes == 0  # a recurrent state cannot be rewound
                prompt_cache = driver.reservation.stamp.settings.cache_ram_mib != 0  # one for all its slots
                ready[driver.id] = (driver.port, slots, driver.directory / "slots", generation, rollback, prompt_cache)
        serving.sync(ready)
        for iid in ready:
            driver = self._drivers[iid]
            serving.set_state_size(iid, cost.StateSize.of_slot(driver.predicted))
            longest = self._longest_token.get(iid, 0)
            serving.set_prompt_limit(
                iid, PromptLimit(n_ctx_seq=driver.predicted.context.n_ctx_seq, longest_token_bytes=longest)
            )
            if serving.identity_of(iid) is None:
                identity = self._identity(self._drivers[iid])
                if identity is not None:
                    serving.set_identity(iid, identity)

    def _identity(self, driver: InstanceDriver) -> str | None:
        """The instance's exact-state identity once its model file's digest is known (hashed in a worker
        thread, once per file; None until then)."""
        path = driver.reservation.model_path
        future = self._identities.get(path)
        if future is None:
            future = asyncio.get_running_loop().run_in_executor(None, self._models.digests.digest, Path(path))
            self._identities[path] = future
            serving = self._serving
            future.add_done_callback(lambda _: serving.changed.set())  # the identity is known: sync again
            return None
        if not future.done():
            return None
        if future.cancelled() or future.exception() is not None:
            self._identities.pop(path, None)  # tried again on the next pass
            return None
        sliding_window = any(a.kind == "kv_swa" for a in driver.allocations)
        return state_identity(
            driver.reservation,
            future.result(),
            self.engine_version,
            context=driver.predicted.context,  # verified against the server before it was ready
            sliding_window=sliding_window,
        )

    async def _start(self, ctx: ActorContext, request: StartInstance, api: ServerApi) -> RunnerAck:
        rid = request.reservation_id
        for driver in self._drivers.values():
            if driver.reservation.reservation_id == rid:  # already running it: starting is idempotent
                return self._ack(driver, "already started")
        instance_id = uuid.uuid4().hex[:16]
        reservation: Reservation | None = None
        try:
            read = await self._node.ledger(ctx)
            reservation = find(read.ledger, rid, self.node_id)
            drift = settings_drift(
                reservation.stamp, self.settings_source(), engine_version=self.engine_version,
                bounds=self.bounds_source(),
            )  # fmt: skip
            check_reservation(
                reservation,
                node_id=self.node_id,
                has_engine=self.engine_path is not None,
                running=len(self._drivers),
                max_instances=self.limits.max_instances,
                drift=drift,
                can_head_split=self.route_tls is not None,
            )
            model = await self._models.read(
                reservation.model_path,
                reservation.model_digest,
                self.limits.file_budget_s,
                fetch=lambda name, digest, budget_s: pull_missing(ctx, name, digest, budget_s),  # from a peer
            )
            stamp = reservation.stamp
            draft = None  # the draft model's file, checked against the digest admission stamped
            if stamp.draft is not None:
                draft = await self._models.read(stamp.draft.path, stamp.draft.digest, self.limits.file_budget_s)
            mmproj = None  # the projector's file, likewise
            if stamp.mmproj is not None:
                mmproj = await self._models.read_projector(
                    stamp.mmproj.path, stamp.mmproj.digest, self.limits.file_budget_s
                )
            telemetry = await self._node.telemetry(ctx)  # its CPU features decide the repacked weights
            try:
                predicted = estimate(
                    model.geometry,
                    stamp.settings,
                    stamp.ctx,
                    n_gpu_layers=stamp.n_gpu_layers,
                    gpu_split=stamp.gpu_split,
                    cpu_features=telemetry.host.cpu_features if telemetry else None,
                    draft=draft.geometry if draft else None,
                    projector=mmproj.projector if mmproj else None,
                    rpc_devices=len(stamp.rpc),
                )
                allocations = cache_allocations(
                    model.geometry, stamp.settings, stamp.ctx, draft.geometry if draft else None
                )
            except MemoryModelError as exc:
                raise StartRefused(
                    UNSUPPORTED, f"llama-server would refuse these settings: {exc}", releases=True
                ) from exc
            try:
                async with asyncio.timeout(self.limits.claim_budget_s):
                    claimed = await self._claim(
                        ctx, reservation, own_share(predicted), instance_id, read.ledger, read.revision, telemetry
                    )
            except TimeoutError as exc:
                # a claim may have landed unseen: give the reservation up rather than leave it claimed by nobody
                message = f"the node's buckets did not answer within {self.limits.claim_budget_s:g}s"
                raise StartRefused(UNAVAILABLE, message, releases=True) from exc
            directory = self.data_dir / "runner" / instance_id
            try:
                server_log = await asyncio.to_thread(self._prepare_directory, directory, frozenset(self._drivers))
            except OSError as exc:  # after the claim: still journaled, so placement releases the memory
                raise StartRefused(DATA_DIR_UNWRITABLE, f"cannot prepare {directory}: {exc}", releases=True) from exc
            except asyncio.CancelledError:  # the deadline or the actor's end, after the claim: nothing will run
                message = "the start was cancelled after its claim; the reservation is given up"
                cancelled = StartRefused(UNAVAILABLE, message, releases=True)
                self._refused(ctx, rid, reservation, instance_id, cancelled)
                raise
        except StartRefused as refusal:
            raise self._refused(ctx, rid, reservation, instance_id, refusal) from refusal
        assert self.engine_path is not None  # check_reservation refused a node without one
        self._longest_token[instance_id] = model.geometry.longest_token_bytes
        driver = InstanceDriver(
            ctx,
            node_id=self.node_id,
            instance_id=instance_id,
            # the files this node runs: relative names resolved inside the models dir
            reservation=with_files(
                claimed,
                str(model.path),
                draft=str(draft.path) if draft else None,
                mmproj=str(mmproj.path) if mmproj else None,
            ),
            predicted=predicted,
            allocations=allocations,
            directory=directory,
            log=server_log,
            machine=lc.Lifecycle(self.limits.timings, self._policy()),
            engine=self.engine_path,
            limits=self.limits,
            clock=self._clock,
            api=api,
            rewrite=self._rewrite,
            fault=self._fault,
            signal_filter=self._signal_filter,
            projector=mmproj.projector if mmproj else None,
        )
        if stamp.rpc:  # a split: the driver reaches the members before each start of its server
            driver.links = MemberLinks(ctx, self.node_id, claimed, self.route_tls, driver.member_lost)
        self._drivers[instance_id] = driver
        serving = self._serving
        driver.busy = lambda: serving.busy(instance_id)  # no probe behind a running generation
        driver.changed = serving.changed.set  # ready, restarted, stopping: the serving view follows at once
        self._identity(driver)  # the model file's digest, hashed while the server loads
        with tracing.use(None):  # the instance outlives the request that started it: its events are its own
            ctx.spawn(self._supervise(ctx, driver), f"instance:{instance_id}")
        with contextlib.suppress(TimeoutError):  # spawning takes milliseconds; the ack says where it stands
            async with asyncio.timeout(self.limits.spawn_ack_s):
                await driver.spawned.wait()
        return self._ack(driver, "starting")

    async def _claim(
        self,
        ctx: ActorContext,
        checked: Reservation,
        predicted: MemoryBreakdown,
        instance_id: str,
        current: NodeLedger | None,
        revision: int,
        telemetry: NodeResources | None,
    ) -> Reservation:
        """Re-checks memory against the ledger and claims the reservation on that very revision; on a
        conflict (another writer came first) reads it again and decides again, a bounded number of times."""
        rid = checked.reservation_id
        for attempt in range(self.limits.claim_attempts):
            if attempt:  # someone wrote first: the ledger and the node's report, read again
                read = await self._node.ledger(ctx)
                current, revision = read.ledger, read.revision
                telemetry = await self._node.telemetry(ctx)
            reservation = find(current, rid, self.node_id)
            if (reservation.model_path, reservation.model_digest, reservation.stamp) != (
                checked.model_path,
                checked.model_digest,
                checked.stamp,
            ):
                raise StartRefused(RESERVATION_STATE, f"reservation {rid} changed while being started", releases=False)
            check_memory(reservation, predicted, telemetry, current)
            claimed_ledger = claim(current, rid, self.node_id, instance_id)
            if await self._node.write_ledger(ctx, claimed_ledger, revision):
                return find(claimed_ledger, rid, self.node_id)
        raise StartRefused(
            UNAVAILABLE,
            f"the ledger of node {self.node_id} kept changing; reservation {rid} not claimed after "
            f"{self.limits.claim_attempts} attempts: retry",
            releases=False,
        )

    def _refused(
        self, ctx: ActorContext, rid: str, reservation: Reservation | None, instance_id: str, refusal: StartRefused
    ) -> RequestError:
        """A refusal that makes the reservation unusable here is journaled, so placement releases its memory."""
        if refusal.releases and reservation is not None:
            if refusal.drift:
                ctx.emit(
                    DriftRejected,
                    instance_id=instance_id,
                    reservation_id=rid,
                    stage="before_start",
                    drift=refusal.drift,
                )
            else:
                ctx.emit(
                    InstanceRefused,
                    instance_id=instance_id,
                    reservation_id=rid,
                    need_bytes=refusal.need_bytes or {d.device: d.total_bytes for d in reservation.devices},
                    have_bytes=refusal.have_bytes,
                    message=f"{refusal.code}: {refusal.message}",
                )
        return RequestError(refusal.code, refusal.message, refusal.details)

    async def _supervise(self, ctx: ActorContext, driver: InstanceDriver) -> None:
        """One instance, isolated: its driver reports its own end; nothing it raises reaches the runner."""
        try:
            await driver.run()
        except Exception as exc:  # run() never raises one; should it, this instance alone is lost
            ctx.log.error("instance_driver_escaped", instance_id=driver.id, error=repr(exc))
        finally:
            self._drivers.pop(driver.id, None)
            self._longest_token.pop(driver.id, None)
            self._serving.changed.set()  # the instance is gone from the serving view
            self._finished[driver.id] = driver.status()
            while len(self._finished) > 256:
                self._finished.popitem(last=False)

    async def _stop(self, request: StopInstance) -> RunnerAck:
        driver = self._drivers.get(request.instance_id)
        if driver is None:
            final = self._finished.get(request.instance_id)
            if final is None:
                raise RequestError(NOT_FOUND, f"no instance {request.instance_id!r} on node {self.node_id}")
            return RunnerAck(instance_id=final.id, node_id=self.node_id, state=final.state, message=final.message)
        with contextlib.suppress(TimeoutError):  # answer with the state reached, within the deadline
            async with asyncio.timeout(self.limits.stop_answer_s):
                await driver.request_stop("stop requested", self.limits.stop_answer_s)
                await driver.settled.wait()
        return self._ack(driver, driver.message)

    def _live(self) -> list[Live]:
        """What this runner drives, as its bookings should read (`upkeep.keep_booked`)."""
        return [
            Live(d.id, d.reservation, d.state, d.observed.total_bytes if d.observed is not None else None)
            for d in list(self._drivers.values())
        ]

    def _stop_unbooked(self, ctx: ActorContext, instance_id: str, reason: str) -> None:
        driver = self._drivers.get(instance_id)
        if driver is not None:
            ctx.spawn(self._ask_stop(driver, reason), f"stop-unbooked:{instance_id}")

    async def _ask_stop(self, driver: InstanceDriver, reason: str) -> None:
        with contextlib.suppress(TimeoutError):  # its queue is full: it is busy ending anyway
            await driver.request_stop(reason, self.limits.stop_answer_s)

    def _ack(self, driver: InstanceDriver, message: str) -> RunnerAck:
        return RunnerAck(
            instance_id=driver.id, node_id=self.node_id, state=driver.state, port=driver.port, message=message
        )

    # --- instance directories --------------------------------------------------------------------------

    def _prepare_directory(self, directory: Path, live: frozenset[str]) -> ServerLog:  # worker thread
        self._prune_instance_dirs(live)
        (directory / "slots").mkdir(parents=True, exist_ok=True)
        return ServerLog(directory / "llama-server.log", max_bytes=self.limits.log_max_bytes)

    def _prune_instance_dirs(self, live: frozenset[str]) -> None:
        """Removes the oldest directories of ended instances beyond `kept_instance_dirs` (disk stays bounded)."""
        root = self.data_dir / "runner"
        try:
            ended = [d for d in root.iterdir() if d.is_dir() and d.name not in live]
            ended.sort(key=lambda d: d.stat().st_mtime, reverse=True)
        except OSError:
            return
        for directory in ended[self.limits.kept_instance_dirs :]:
            shutil.rmtree(directory, ignore_errors=True)
